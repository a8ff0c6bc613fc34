// The cluster description: the shipped example files against their figures converted by hand,
// the writer's round trip, the link rule against a member-by-member enumeration, and one error per
// kind of bad input, each naming the file and the field.
#include <catch2/catch.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <sys/stat.h>

#include "train/temp_dir.hpp"
#include "trellis/io/json.hpp"
#include "trellis/plan/cluster.hpp"

using namespace trellis;
using namespace trellis::plan;

namespace {

std::filesystem::path example(const char* file) {
  return std::filesystem::path(TRELLIS_SOURCE_DIR) / "examples/trellis_plan/clusters" / file;
}

// Field by field, so a failure says which one differs.
void require_same(const Cluster& a, const Cluster& b) {
  REQUIRE(a.name == b.name);
  REQUIRE(a.nodes == b.nodes);
  REQUIRE(a.devices_per_node == b.devices_per_node);
  REQUIRE(a.device.name == b.device.name);
  REQUIRE(a.device.memory_bytes == b.device.memory_bytes);
  REQUIRE(a.device.peak_flops_fp32 == b.device.peak_flops_fp32);
  REQUIRE(a.device.peak_flops_bf16 == b.device.peak_flops_bf16);
  REQUIRE(a.device.memory_bandwidth == b.device.memory_bandwidth);
  REQUIRE(a.intra_node.bandwidth == b.intra_node.bandwidth);
  REQUIRE(a.intra_node.latency == b.intra_node.latency);
  REQUIRE(a.inter_node.bandwidth == b.inter_node.bandwidth);
  REQUIRE(a.inter_node.latency == b.inter_node.latency);
  REQUIRE(a.gemm_efficiency == b.gemm_efficiency);
  REQUIRE(a.attention_efficiency == b.attention_efficiency);
  REQUIRE(a.speed == b.speed);
}

// A valid 2 x 4 cluster; the bad inputs below are this text with one piece replaced.
const std::string good = R"({
  "name": "test cluster",
  "nodes": 2,
  "devices_per_node": 4,
  "device": {"name": "dev", "memory_gib": 16, "peak_tflops": {"fp32": 10, "bf16": 100},
             "memory_bandwidth_gbps": 900},
  "intra_node": {"bandwidth_gbps": 100, "latency_us": 2},
  "inter_node": {"bandwidth_gbps": 10, "latency_us": 20},
  "efficiency": {"gemm": 0.8, "attention": 0.4},
  "speed": [1, 1, 1, 1, 1, 1, 1, 0.5]
})";

std::string replaced(std::string text, const std::string& from, const std::string& to) {
  const auto at = text.find(from);
  REQUIRE(at != std::string::npos);  // a typo in the test itself must not pass as a bad input
  text.replace(at, from.size(), to);
  return text;
}

std::string error_of(const std::string& text) {
  try {
    parse_cluster(text, "bad.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::string load_error(const std::filesystem::path& p) {
  try {
    load_cluster(p);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("the example cluster files load with the figures they state", "[cluster]") {
  const Cluster h = load_cluster(example("h100_sxm_16x8.json"));
  REQUIRE(h.nodes == 16);
  REQUIRE(h.devices_per_node == 8);
  REQUIRE(h.devices() == 128);
  REQUIRE(h.device.name == "H100 SXM 80GB");
  REQUIRE(h.device.memory_bytes == Approx(79.6 * 1024 * 1024 * 1024).epsilon(1e-15));
  REQUIRE(h.device.peak_flops_bf16 == 9.89e14);
  REQUIRE(h.device.peak_flops_fp32 == 6.7e13);
  REQUIRE(h.device.memory_bandwidth == 3.35e12);
  REQUIRE(h.intra_node.bandwidth == 3.6e11);
  REQUIRE(h.intra_node.latency == Approx(5e-6).epsilon(1e-15));
  REQUIRE(h.inter_node.bandwidth == 4.5e10);
  REQUIRE(h.inter_node.latency == Approx(15e-6).epsilon(1e-15));
  REQUIRE(h.gemm_efficiency == 0.7);
  REQUIRE(h.attention_efficiency == 0.45);
  REQUIRE(h.speed.empty());
  REQUIRE(h.speed_of(0) == 1.0);
  REQUIRE(h.speed_of(127) == 1.0);
  REQUIRE_THROWS_AS(h.speed_of(128), Error);

  const Cluster a = load_cluster(example("a100_sxm_4x8.json"));
  REQUIRE(a.devices() == 32);
  REQUIRE(a.device.name == "A100 SXM 80GB");
  REQUIRE(a.device.memory_bytes == Approx(79.2 * 1024 * 1024 * 1024).epsilon(1e-15));
  REQUIRE(a.device.peak_flops_bf16 == 3.12e14);
  REQUIRE(a.device.peak_flops_fp32 == 1.95e13);
  REQUIRE(a.device.memory_bandwidth == 2.039e12);
  REQUIRE(a.intra_node.bandwidth == 2.3e11);
  REQUIRE(a.inter_node.bandwidth == 2.2e10);
  // No "efficiency" in the file: the documented defaults.
  REQUIRE(a.gemm_efficiency == 0.7);
  REQUIRE(a.attention_efficiency == 0.5);
  // An all-reduce of 1 GiB over the 8 GPUs of one H100 node, by the busbw formula.
  const double S = 1024.0 * 1024 * 1024;
  const Link& l = h.link(1, 8);
  REQUIRE(2.0 * 7 / 8 * S / l.bandwidth + l.latency == Approx(2.0 * 7 / 8 * S / 360e9 + 5e-6));
}

TEST_CASE("a small cluster file parses field by field", "[cluster]") {
  const Cluster c = parse_cluster(good, "good.json");
  REQUIRE(c.name == "test cluster");
  REQUIRE(c.devices() == 8);
  REQUIRE(c.device.memory_bytes == 16.0 * (1 << 30));
  REQUIRE(c.device.peak_flops_fp32 == 1e13);
  REQUIRE(c.device.peak_flops_bf16 == 1e14);
  REQUIRE(c.device.memory_bandwidth == 9e11);
  REQUIRE(c.intra_node == Link{1e11, 2e-6});
  REQUIRE(c.inter_node == Link{1e10, 2e-5});
  REQUIRE(c.gemm_efficiency == 0.8);
  REQUIRE(c.attention_efficiency == 0.4);
  REQUIRE(c.speed == std::vector<double>{1, 1, 1, 1, 1, 1, 1, 0.5});
  REQUIRE(c.speed_of(7) == 0.5);
  REQUIRE(c.speed_of(6) == 1.0);

  // One node: inter_node may be left out and then equals intra_node; speed and efficiency are
  // optional, and so is each efficiency entry; latency 0 and efficiency 1 are allowed; integral
  // counts written as doubles are accepted.
  const std::string one_node = R"({"name": "one", "nodes": 1.0, "devices_per_node": 2,
    "device": {"name": "d", "memory_gib": 1, "peak_tflops": {"fp32": 1, "bf16": 2}, "memory_bandwidth_gbps": 3},
    "intra_node": {"bandwidth_gbps": 4, "latency_us": 0}, "efficiency": {"gemm": 1}})";
  const Cluster o = parse_cluster(one_node, "one.json");
  REQUIRE(o.nodes == 1);
  REQUIRE(o.inter_node == o.intra_node);
  REQUIRE(o.intra_node.latency == 0);
  REQUIRE(o.gemm_efficiency == 1.0);
  REQUIRE(o.attention_efficiency == 0.5);
  REQUIRE(o.speed.empty());
}

TEST_CASE("to_json writes the same format and reads back equal", "[cluster]") {
  for (const char* file : {"h100_sxm_16x8.json", "a100_sxm_4x8.json", "h100_a100_mixed_2x8.json"}) {
    INFO(file);
    const Cluster c = load_cluster(example(file));
    const std::string text = to_json(c);
    // The file format, not SI: the units are the file's.
    const auto v = io::json::parse(text);
    REQUIRE(v.at("device").at("peak_tflops").at("bf16").as_double() ==
            Approx(c.device.peak_flops_bf16 / 1e12).epsilon(1e-15));
    REQUIRE(v.at("inter_node").find("bandwidth_gbps") != nullptr);
    require_same(parse_cluster(text, "written.json"), c);
    if (std::string(file) == "h100_a100_mixed_2x8.json") REQUIRE((c.speed_of(7) == 1.0 && c.speed_of(8) == 0.315));
  }
  require_same(parse_cluster(to_json(parse_cluster(good, "good.json")), "written.json"),
               parse_cluster(good, "good.json"));

  // Random decimals over six decades: the writer divides what the parser multiplied, and the
  // value read back must still be bit for bit the same.
  std::mt19937 rng(20240611);
  std::uniform_real_distribution<double> mantissa(0.001, 1000.0);
  std::uniform_int_distribution<int> exponent(-3, 3);
  for (int trial = 0; trial < 300; ++trial) {
    auto num = [&] {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.17ge%d", mantissa(rng), exponent(rng));
      return std::string(buf);
    };
    const std::string text = "{\"name\": \"r\", \"nodes\": 2, \"devices_per_node\": 2, \"device\": {\"name\": \"d\", "
                             "\"memory_gib\": " + num() + ", \"peak_tflops\": {\"fp32\": " + num() +
                             ", \"bf16\": " + num() + "}, \"memory_bandwidth_gbps\": " + num() +
                             "}, \"intra_node\": {\"bandwidth_gbps\": " + num() + ", \"latency_us\": " + num() +
                             "}, \"inter_node\": {\"bandwidth_gbps\": " + num() + ", \"latency_us\": " + num() +
                             "}, \"speed\": [" + num() + ", " + num() + ", " + num() + ", " + num() + "]}";
    INFO(text);
    const Cluster c = parse_cluster(text, "random.json");
    require_same(parse_cluster(to_json(c), "written.json"), c);
  }
}

TEST_CASE("link() picks the intra-node link exactly when a group fits in one node", "[cluster]") {
  Cluster c = parse_cluster(good, "good.json");  // 2 nodes x 4 devices
  REQUIRE(c.intra_node != c.inter_node);
  // By hand: members {0,1,2,3} node 0; {0..7} both nodes; {0,4} nodes 0 and 1; {0,2} node 0.
  REQUIRE(&c.link(1, 4) == &c.intra_node);
  REQUIRE(&c.link(1, 8) == &c.inter_node);
  REQUIRE(&c.link(4, 2) == &c.inter_node);
  REQUIRE(&c.link(2, 2) == &c.intra_node);
  REQUIRE(&c.link(1, 1) == &c.intra_node);
  REQUIRE(&c.link(8, 1) == &c.intra_node);
  REQUIRE(&c.link(3, 2) == &c.intra_node);  // {0,3}
  REQUIRE(&c.link(2, 3) == &c.inter_node);  // {0,2,4}
  REQUIRE_THROWS_AS(c.link(0, 2), Error);
  REQUIRE_THROWS_AS(c.link(1, 0), Error);

  // Against an enumeration of the members' nodes, for several node sizes.
  for (int per_node : {1, 2, 3, 4, 8}) {
    c.devices_per_node = per_node;
    for (int stride = 1; stride <= 10; ++stride)
      for (int size = 1; size <= 10; ++size) {
        bool one_node = true;
        for (int m = 0; m < size; ++m) one_node = one_node && (m * stride) / per_node == 0;
        INFO("per_node " << per_node << " stride " << stride << " size " << size);
        REQUIRE(&c.link(stride, size) == (one_node ? &c.intra_node : &c.inter_node));
      }
  }
  // A stride and size whose product overflows an int is still answered (inter-node).
  REQUIRE(&c.link(1 << 20, 1 << 12) == &c.inter_node);
}

TEST_CASE("bad cluster files give errors naming the file and the field", "[cluster]") {
  struct Bad {
    std::string text;
    std::vector<std::string> says;
  };
  const std::vector<Bad> cases = {
      // JSON syntax: the JSON parser's byte position, with the file name.
      {replaced(good, "0.5]", "0.5,]"), {"invalid JSON", "byte"}},
      {"[1, 2]", {"top level must be a JSON object"}},
      // Unknown keys, at the top level and nested: named, with the allowed ones.
      {replaced(good, "\"devices_per_node\"", "\"devices_per_nod\""),
       {"unknown key \"devices_per_nod\"", "devices_per_node, device"}},
      {replaced(good, "\"memory_gib\"", "\"memory_gb\""), {"unknown key \"device.memory_gb\"", "memory_gib"}},
      {replaced(good, "\"fp32\"", "\"fp16\""), {"unknown key \"device.peak_tflops.fp16\""}},
      {replaced(good, "\"latency_us\": 20", "\"latency_us\": 20, \"latency_ms\": 1"),
       {"unknown key \"inter_node.latency_ms\""}},
      {replaced(good, "\"gemm\"", "\"gem\""), {"unknown key \"efficiency.gem\""}},
      // Missing required keys.
      {replaced(good, "\"nodes\": 2,", ""), {"missing required key \"nodes\""}},
      {replaced(good, ", \"bf16\": 100", ""), {"missing required key \"device.peak_tflops.bf16\""}},
      {replaced(good, "\"latency_us\": 2}", "\"bandwidth_gbps\": 1}"), {"invalid JSON", "duplicate key"}},
      {replaced(good, "\"bandwidth_gbps\": 100, ", ""), {"missing required key \"intra_node.bandwidth_gbps\""}},
      {replaced(good, "\"inter_node\": {\"bandwidth_gbps\": 10, \"latency_us\": 20},", ""),
       {"missing required key \"inter_node\"", "nodes > 1"}},
      {replaced(good, "\"name\": \"test cluster\",", ""), {"missing required key \"name\""}},
      // Wrong types.
      {replaced(good, "\"memory_gib\": 16", "\"memory_gib\": \"16\""),
       {"device.memory_gib must be a number > 0 (got \"16\")"}},
      {replaced(good, "\"nodes\": 2", "\"nodes\": true"), {"nodes must be an integer in 1..1000000 (got true)"}},
      {replaced(good, "\"efficiency\": {\"gemm\": 0.8, \"attention\": 0.4}", "\"efficiency\": 0.8"),
       {"efficiency must be an object (got 0.8)"}},
      {R"({"name": "n", "nodes": 1, "devices_per_node": 1, "device": 5, "intra_node": {}})",
       {"device must be an object (got 5)"}},
      {R"({"name": "n", "nodes": 1, "devices_per_node": 1, "intra_node": {}})", {"missing required key \"device\""}},
      {replaced(good, "\"name\": \"test cluster\"", "\"name\": 7"), {"name must be a non-empty string (got 7)"}},
      {replaced(good, "\"speed\": [1, 1, 1, 1, 1, 1, 1, 0.5]", "\"speed\": 1"), {"speed must be an array"}},
      {replaced(good, "\"intra_node\": {\"bandwidth_gbps\": 100, \"latency_us\": 2}", "\"intra_node\": [100, 2]"),
       {"intra_node must be an object"}},
      // Counts: fractional, zero, huge, and a product beyond an int.
      {replaced(good, "\"nodes\": 2", "\"nodes\": 2.5"), {"nodes must be an integer in 1..1000000 (got 2.5)"}},
      {replaced(good, "\"devices_per_node\": 4", "\"devices_per_node\": 0"), {"devices_per_node must be an integer"}},
      {replaced(good, "\"nodes\": 2", "\"nodes\": 2000000"), {"nodes must be an integer in 1..1000000"}},
      {replaced(replaced(good, "\"nodes\": 2", "\"nodes\": 1000000"), "\"devices_per_node\": 4",
                "\"devices_per_node\": 1000000"),
       {"nodes * devices_per_node = 1000000000000 does not fit in an int"}},
      // Out-of-range numbers.
      {replaced(good, "\"bf16\": 100", "\"bf16\": -3"), {"device.peak_tflops.bf16 must be a number > 0 (got -3)"}},
      {replaced(good, "\"bandwidth_gbps\": 100", "\"bandwidth_gbps\": 0"),
       {"intra_node.bandwidth_gbps must be a number > 0 (got 0)"}},
      {replaced(good, "\"latency_us\": 20", "\"latency_us\": -1"), {"inter_node.latency_us must be a number >= 0"}},
      {replaced(good, "\"memory_gib\": 16", "\"memory_gib\": 1e300"), {"device.memory_gib is out of range"}},
      {replaced(good, "\"memory_bandwidth_gbps\": 900", "\"memory_bandwidth_gbps\": null"),
       {"device.memory_bandwidth_gbps must be a number > 0 (got null)"}},
      {replaced(good, "\"gemm\": 0.8", "\"gemm\": 1.5"), {"efficiency.gemm must be a number in (0, 1] (got 1.5)"}},
      {replaced(good, "\"attention\": 0.4", "\"attention\": 0"), {"efficiency.attention must be a number in (0, 1]"}},
      // speed: length and entries.
      {replaced(good, "[1, 1, 1, 1, 1, 1, 1, 0.5]", "[1, 1, 0.5]"),
       {"speed must have one entry per device", "= 8 (got 3 entries)"}},
      {replaced(good, "[1, 1, 1, 1, 1, 1, 1, 0.5]", "[]"), {"speed must have one entry per device"}},
      {replaced(good, "[1, 1, 1, 1, 1, 1, 1, 0.5]", "[1, 1, 0, 1, 1, 1, 1, 1]"), {"speed[2] must be a number > 0"}},
      {replaced(good, "[1, 1, 1, 1, 1, 1, 1, 0.5]", "[1, 1, 1, 1, 1, 1, 1, \"x\"]"), {"speed[7] must be a number > 0"}},
      // Empty names.
      {replaced(good, "\"name\": \"test cluster\"", "\"name\": \"\""), {"name must be a non-empty string (got \"\")"}},
      {replaced(good, "\"name\": \"dev\"", "\"name\": \"\""), {"device.name must be a non-empty string"}},
  };
  for (const auto& bad : cases) {
    INFO(bad.text);
    const std::string message = error_of(bad.text);
    REQUIRE_THAT(message, Catch::Contains("cluster file 'bad.json'"));
    for (const auto& s : bad.says) REQUIRE_THAT(message, Catch::Contains(s));
  }
}

TEST_CASE("load_cluster refuses what is not a readable regular file", "[cluster]") {
  TempDir dir("cluster");
  const auto missing = dir.path / "missing.json";
  REQUIRE_THAT(load_error(missing), Catch::Contains("missing.json") && Catch::Contains("no such file"));
  REQUIRE_THAT(load_error(dir.path), Catch::Contains("is a directory"));
  // A FIFO with no writer: opening it would block forever, so it must be refused first.
  const auto fifo = dir.path / "pipe.json";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  REQUIRE_THAT(load_error(fifo), Catch::Contains("pipe.json") && Catch::Contains("not a regular file"));
  // A regular file: loads, and a bad one's errors carry its path.
  const auto file = dir.path / "c.json";
  std::ofstream(file) << good;
  REQUIRE(load_cluster(file).devices() == 8);
  std::ofstream(file) << replaced(good, "\"bf16\": 100", "\"bf16\": -3");
  REQUIRE_THAT(load_error(file), Catch::Contains("cluster file '" + file.string() + "': device.peak_tflops.bf16"));
}
