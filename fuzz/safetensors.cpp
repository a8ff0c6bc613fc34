// Fuzz target `safetensors`: the input is a whole safetensors file (u64 header length, JSON header,
// data), opened with io::SafetensorsFile; every tensor of an accepted file is read (with its CRC32C
// check when the header stores one).
#include "harness.hpp"
#include "trellis/io/safetensors.hpp"

TRELLIS_FUZZ_TARGET(safetensors) {
  static trellis::fuzz::MemFile file;
  const std::string& path = file.hold(trellis::fuzz::text(data, size));
  trellis::fuzz::guarded([&] {
    trellis::io::SafetensorsFile f(path);
    std::size_t total = 0;
    for (const auto& e : f.entries()) {
      if (e.end < e.begin || e.bytes() > size) trellis::fuzz::finding("an accepted entry spans more than the file");
      total += e.bytes();
    }
    if (total > size) trellis::fuzz::finding("accepted entries span more bytes than the file holds");
    for (const auto& e : f.entries()) trellis::fuzz::guarded([&] { (void)f.read(e.name); });
  });
  return 0;
}
