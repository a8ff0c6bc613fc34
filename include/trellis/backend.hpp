// trellis compute backends, host half: the Backend concept, backend::Host<float | bfloat16>, and
// backend::DeviceChecked (host arithmetic under device-memory discipline, for tests).
// The CUDA backend (backend::Cuda) is in <trellis/cuda.cuh>.
#pragma once

#include "trellis/backend/backend.hpp"  // defines: Backend, CompatibleWith, space_of
#include "trellis/backend/copy_queue.hpp"  // defines: backend::HostCopyQueue, copy_queue_t, SimulatedCopyLink
#include "trellis/backend/device_checked.hpp"  // defines: backend::DeviceChecked<Inner>, CheckedBuffer, DeviceRegistry
#include "trellis/backend/host.hpp"     // defines: backend::Host<Act>
