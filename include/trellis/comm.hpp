// trellis comm, host parts: the Communicator concept, the flight recorder and fingerprints, the
// thread-rank backend and device meshes. MPI: <trellis/comm/mpi.hpp> (needs trellis::mpi);
// NCCL: <trellis/comm/nccl.hpp> (CUDA builds).
#pragma once

#include "trellis/comm/communicator.hpp"  // defines: Communicator, ReduceOp, P2POp, Request
#include "trellis/comm/mesh.hpp"          // defines: dp, tp, pp, cp, ep, Mesh, make_mesh
#include "trellis/comm/recorder.hpp"      // defines: OpFingerprint, FlightRecorder, find_fingerprint_mismatch
#include "trellis/comm/simulated_link.hpp"  // defines: SimulatedLink, LinkModel (a modelled link on the host)
#include "trellis/comm/threads.hpp"       // defines: ThreadWorld, ThreadComm, ThreadRequest
