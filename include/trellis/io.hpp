// trellis::io: the file formats and file primitives below checkpoints and logs, no dependency
// beyond the C++ standard library and POSIX. Host-only.
#pragma once

#include "trellis/io/atomic_file.hpp"  // defines: AtomicFileWriter, ReadOnlyFile, fsync_directory, write_file_atomically
#include "trellis/io/checksum.hpp"     // defines: crc32c, Crc32c
#include "trellis/io/json.hpp"         // defines: json::Value, json::parse, json::dump
#include "trellis/io/number.hpp"       // defines: parse_integer (strict, range-checked)
#include "trellis/io/safetensors.hpp"  // defines: SafetensorsWriter, SafetensorsFile, Shape, Metadata
