// The cluster description the planner reads: how many devices there are, how fast each one is, and
// the two links between them (inside a node, across nodes). People write it by hand as a small
// JSON file (docs/plan.md, "Cluster files"; examples in examples/trellis_plan/clusters/):
//
//   {"name": "16 nodes of 8 H100 SXM", "nodes": 16, "devices_per_node": 8,
//    "device": {"name": "H100 SXM 80GB", "memory_gib": 79.6,
//               "peak_tflops": {"fp32": 67, "bf16": 989}, "memory_bandwidth_gbps": 3350},
//    "intra_node": {"bandwidth_gbps": 360, "latency_us": 5},
//    "inter_node": {"bandwidth_gbps": 45, "latency_us": 15},   // required only when nodes > 1
//    "efficiency": {"gemm": 0.7, "attention": 0.45},           // optional
//    "host": {"memory_bandwidth_gbps": 50, "link_gbps": 25},   // optional: the offloaded optimizer's
//    "speed": [1, 1, 0.5, ...]}                                // optional, one per device
//
// Units in the file are the ones data sheets use (GiB, TFLOP/s, GB/s = 1e9 bytes/s, microseconds);
// in memory everything is SI (bytes, FLOP/s, bytes/s, seconds), so cost formulas need no factors.
// The parser is strict: unknown keys, missing keys, wrong types and out-of-range numbers are errors
// naming the file and the field path, because a typo that silently took a default would make every
// plan wrong without a trace.
#pragma once

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "trellis/core/error.hpp"
#include "trellis/io/json.hpp"

namespace trellis::plan {

// bandwidth: bytes/s as a BUS bandwidth (nccl-tests busbw), so an all-reduce of S bytes on n ranks
// takes 2(n-1)/n * S / bandwidth + latency, and published busbw figures can be used as they are.
// latency: seconds per operation.
struct Link {
  double bandwidth = 0;
  double latency = 0;
  bool operator==(const Link&) const = default;
};

struct Device {
  std::string name;
  double memory_bytes = 0;      // usable device memory
  double peak_flops_fp32 = 0;   // dense FLOP/s
  double peak_flops_bf16 = 0;   // dense FLOP/s (tensor cores, no sparsity)
  double memory_bandwidth = 0;  // bytes/s
  bool operator==(const Device&) const = default;
};

struct Cluster {
  std::string name;
  int nodes = 1, devices_per_node = 1;
  Device device;
  Link intra_node, inter_node;
  double gemm_efficiency = 0.7;       // achieved fraction of peak for large dense GEMMs
  double attention_efficiency = 0.5;  // achieved fraction of peak for attention kernels
  // The host, for the offloaded optimizer (AdamW on the CPU): each device's share of the host's
  // memory bandwidth (bytes/s; a node's CPUs serve all its devices), and the device-host link
  // (PCIe; bytes/s one way, per device). Defaults: 50 GB/s (two sockets of DDR5 shared by 8
  // devices, at about 70 % of peak) and 25 GB/s (PCIe 4.0 x16 as achieved).
  double host_memory_bandwidth = 50e9;
  double host_link_bandwidth = 25e9;
  std::vector<double> speed;          // empty, or one relative speed factor (> 0) per device, rank order

  int devices() const { return nodes * devices_per_node; }

  // The link a communicator group uses, for a group of `size` ranks whose members are `stride`
  // apart in rank order. trellis meshes lay ranks out with the LAST axis fastest: make_mesh<pp, dp,
  // tp> puts tp ranks at stride 1, dp at stride tp, pp at stride dp*tp. The group is taken to start
  // at rank 0, so its members 0, stride, ..., stride*(size-1) share node 0 exactly when the last
  // one does: then the intra-node link, else the inter-node one (the slowest hop sets a ring's
  // pace). A group of one rank gets intra_node; it sends nothing anyway.
  const Link& link(int stride, int size) const {
    TRELLIS_CHECK(stride >= 1 && size >= 1, "Cluster::link: stride ", stride, ", size ", size);
    if (size == 1) return intra_node;
    const std::int64_t last = static_cast<std::int64_t>(stride) * (size - 1);  // no int overflow
    return last / devices_per_node == 0 ? intra_node : inter_node;
  }

  double speed_of(int rank) const {
    TRELLIS_CHECK(rank >= 0 && rank < devices(), "Cluster::speed_of: rank ", rank, " of ", devices());
    return speed.empty() ? 1.0 : speed[static_cast<std::size_t>(rank)];
  }

  bool operator==(const Cluster&) const = default;
};

namespace detail {

// A file unit and its SI value: si = written * mul / div, with mul or div 1 so that the conversion
// rounds once (dividing by 1e6 is exact-rounded; multiplying by the inexact 1e-6 is not).
struct ClusterUnit {
  double mul = 1, div = 1;
  double to_si(double written) const { return written * mul / div; }
  // The number to write. For every value the parser produced (si = to_si(written)) this reads back
  // exactly, which the round-trip test checks on random decimals; a value set by hand may come
  // back one ulp off, as no written number maps onto it.
  double from_si(double si) const { return si * div / mul; }
};
inline constexpr ClusterUnit cluster_unit_one{1, 1};
inline constexpr ClusterUnit cluster_unit_gib{1073741824.0, 1};  // 2^30 bytes
inline constexpr ClusterUnit cluster_unit_gbps{1e9, 1};          // GB/s -> bytes/s
inline constexpr ClusterUnit cluster_unit_tflops{1e12, 1};       // TFLOP/s -> FLOP/s
inline constexpr ClusterUnit cluster_unit_us{1, 1e6};            // microseconds -> seconds

inline constexpr int cluster_max_count = 1000000;  // nodes and devices_per_node

// Reads one cluster file; every error starts with "cluster file '<source>': <field path>".
class ClusterReader {
 public:
  explicit ClusterReader(std::string_view source)
      : where_(::trellis::detail::concat("cluster file '", source, "'")) {}

  const std::string& where() const { return where_; }

  template <class... Why>
  [[noreturn]] void fail(const Why&... why) const {
    TRELLIS_THROW(where_, ": ", why...);
  }

  // The value as the file wrote it, shortened so that a huge array does not flood the message.
  static std::string got(const io::json::Value& v) {
    std::string text = io::json::dump(v);
    if (text.size() > 60) text = text.substr(0, 57) + "...";
    return text;
  }

  static std::string join(std::string_view path, std::string_view key) {
    return path.empty() ? std::string(key) : ::trellis::detail::concat(path, ".", key);
  }

  // An object whose keys must all be in `allowed` (path "" is the top level).
  const io::json::Object& object(const io::json::Value& v, std::string_view path,
                                 std::initializer_list<std::string_view> allowed) const {
    if (!v.is_object()) {
      if (path.empty()) fail("the top level must be a JSON object (got ", got(v), ")");
      fail(path, " must be an object (got ", got(v), ")");
    }
    const io::json::Object& o = v.as_object();
    for (const auto& [key, value] : o) {
      bool known = false;
      for (std::string_view a : allowed) known = known || a == key;
      if (known) continue;
      std::string list;
      for (std::string_view a : allowed) list += (list.empty() ? "" : ", ") + std::string(a);
      fail("unknown key \"", join(path, key), "\" (allowed in ", path.empty() ? "the top level" : path,
           ": ", list, ")");
    }
    return o;
  }

  // nullptr when absent and optional; an error when absent and required.
  const io::json::Value* member(const io::json::Object& o, std::string_view path, std::string_view key,
                                bool required = true) const {
    auto it = o.find(key);
    if (it != o.end()) return &it->second;
    if (required) fail("missing required key \"", join(path, key), "\"");
    return nullptr;
  }

  std::string name(const io::json::Value& v, std::string_view path) const {
    if (!v.is_string() || v.as_string().empty())
      fail(path, " must be a non-empty string (got ", got(v), ")");
    return v.as_string();
  }

  enum class Range { positive, non_negative, fraction };

  // A finite number in `range`, converted to SI; the converted value is checked too, since a
  // finite number of GiB can overflow to infinity in bytes.
  double number(const io::json::Value& v, std::string_view path, Range range,
                ClusterUnit unit = cluster_unit_one) const {
    const char* want = range == Range::positive       ? "a number > 0"
                       : range == Range::non_negative ? "a number >= 0"
                                                      : "a number in (0, 1]";
    if (!v.is_number()) fail(path, " must be ", want, " (got ", got(v), ")");
    const double x = v.as_double();
    const bool ok = std::isfinite(x) && (range == Range::non_negative ? x >= 0 : x > 0) &&
                    (range != Range::fraction || x <= 1);
    if (!ok) fail(path, " must be ", want, " (got ", got(v), ")");
    const double si = unit.to_si(x);
    if (!std::isfinite(si) || (range != Range::non_negative && si <= 0))
      fail(path, " is out of range (got ", got(v), ", which is not a finite positive value in SI units)");
    return si;
  }

  int count(const io::json::Value& v, std::string_view path) const {
    // 2.0 or 1e3 are integers written as doubles: accepted; 2.5 is not.
    const bool integral = v.is_int() || (v.is_number() && std::isfinite(v.as_double()) &&
                                         v.as_double() == std::floor(v.as_double()));
    const double x = integral ? v.as_double() : 0;
    if (!integral || x < 1 || x > cluster_max_count)
      fail(path, " must be an integer in 1..", cluster_max_count, " (got ", got(v), ")");
    return static_cast<int>(x);
  }

  Link link(const io::json::Value& v, std::string_view path) const {
    const auto& o = object(v, path, {"bandwidth_gbps", "latency_us"});
    Link l;
    l.bandwidth = number(*member(o, path, "bandwidth_gbps"), join(path, "bandwidth_gbps"), Range::positive,
                         cluster_unit_gbps);
    l.latency = number(*member(o, path, "latency_us"), join(path, "latency_us"), Range::non_negative,
                       cluster_unit_us);
    return l;
  }

  Device device(const io::json::Value& v) const {
    const auto& o = object(v, "device", {"name", "memory_gib", "peak_tflops", "memory_bandwidth_gbps"});
    Device d;
    d.name = name(*member(o, "device", "name"), "device.name");
    d.memory_bytes = number(*member(o, "device", "memory_gib"), "device.memory_gib", Range::positive,
                            cluster_unit_gib);
    const auto& peak = object(*member(o, "device", "peak_tflops"), "device.peak_tflops", {"fp32", "bf16"});
    d.peak_flops_fp32 = number(*member(peak, "device.peak_tflops", "fp32"), "device.peak_tflops.fp32",
                               Range::positive, cluster_unit_tflops);
    d.peak_flops_bf16 = number(*member(peak, "device.peak_tflops", "bf16"), "device.peak_tflops.bf16",
                               Range::positive, cluster_unit_tflops);
    d.memory_bandwidth = number(*member(o, "device", "memory_bandwidth_gbps"), "device.memory_bandwidth_gbps",
                                Range::positive, cluster_unit_gbps);
    return d;
  }

  Cluster cluster(const io::json::Value& root) const {
    const auto& o = object(root, "",
                           {"name", "nodes", "devices_per_node", "device", "intra_node", "inter_node",
                            "efficiency", "host", "speed"});
    Cluster c;
    c.name = name(*member(o, "", "name"), "name");
    c.nodes = count(*member(o, "", "nodes"), "nodes");
    c.devices_per_node = count(*member(o, "", "devices_per_node"), "devices_per_node");
    const std::int64_t devices = std::int64_t{c.nodes} * c.devices_per_node;
    if (devices > std::numeric_limits<int>::max())
      fail("nodes * devices_per_node = ", devices, " does not fit in an int");
    c.device = device(*member(o, "", "device"));
    c.intra_node = link(*member(o, "", "intra_node"), "intra_node");
    if (const auto* inter = member(o, "", "inter_node", false)) {
      c.inter_node = link(*inter, "inter_node");
    } else if (c.nodes > 1) {
      fail("missing required key \"inter_node\" (required when nodes > 1; nodes = ", c.nodes, ")");
    } else {
      c.inter_node = c.intra_node;  // one node: never used, but keep it a valid link
    }
    if (const auto* eff = member(o, "", "efficiency", false)) {
      const auto& e = object(*eff, "efficiency", {"gemm", "attention"});
      if (const auto* g = member(e, "efficiency", "gemm", false))
        c.gemm_efficiency = number(*g, "efficiency.gemm", Range::fraction);
      if (const auto* a = member(e, "efficiency", "attention", false))
        c.attention_efficiency = number(*a, "efficiency.attention", Range::fraction);
    }
    if (const auto* host = member(o, "", "host", false)) {
      const auto& h = object(*host, "host", {"memory_bandwidth_gbps", "link_gbps"});
      if (const auto* m = member(h, "host", "memory_bandwidth_gbps", false))
        c.host_memory_bandwidth = number(*m, "host.memory_bandwidth_gbps", Range::positive, cluster_unit_gbps);
      if (const auto* l = member(h, "host", "link_gbps", false))
        c.host_link_bandwidth = number(*l, "host.link_gbps", Range::positive, cluster_unit_gbps);
    }
    if (const auto* speed = member(o, "", "speed", false)) {
      if (!speed->is_array()) fail("speed must be an array of numbers > 0 (got ", got(*speed), ")");
      const auto& a = speed->as_array();
      if (static_cast<std::int64_t>(a.size()) != devices)
        fail("speed must have one entry per device, nodes * devices_per_node = ", devices, " (got ",
             a.size(), " entries)");
      c.speed.reserve(a.size());
      for (std::size_t i = 0; i < a.size(); ++i)
        c.speed.push_back(number(a[i], ::trellis::detail::concat("speed[", i, "]"), Range::positive));
    }
    return c;
  }

 private:
  std::string where_;
};

}  // namespace detail

// Parses a cluster file's text; `source` (the file name) prefixes every error.
inline Cluster parse_cluster(std::string_view text, std::string_view source) {
  detail::ClusterReader reader(source);
  return reader.cluster(io::json::parse(text, reader.where()));  // JSON errors name the byte too
}

// Reads and parses a cluster file. The file is checked to be a regular file before it is opened:
// opening a FIFO for reading would block until a writer came, and a directory "opens" on Linux.
inline Cluster load_cluster(const std::filesystem::path& file) {
  const std::string shown = file.string();
  std::error_code ec;
  const auto status = std::filesystem::status(file, ec);
  if (status.type() == std::filesystem::file_type::not_found)
    TRELLIS_THROW("cannot open cluster file '", shown, "': no such file");
  if (ec) TRELLIS_THROW("cannot open cluster file '", shown, "': ", ec.message());
  if (status.type() == std::filesystem::file_type::directory)
    TRELLIS_THROW("cannot open cluster file '", shown, "': it is a directory");
  if (status.type() != std::filesystem::file_type::regular)
    TRELLIS_THROW("cannot open cluster file '", shown, "': not a regular file");
  std::ifstream in(file, std::ios::binary);
  if (!in) TRELLIS_THROW("cannot open cluster file '", shown, "'");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) TRELLIS_THROW("cannot read cluster file '", shown, "'");
  return parse_cluster(text.str(), shown);
}

// Writes the file format (pretty-printed, keys sorted); parse_cluster(to_json(c), ...) == c for
// every field of a cluster the parser produced. inter_node, efficiency and host are always written.
inline std::string to_json(const Cluster& c) {
  using io::json::Value;
  auto link = [](const Link& l) {
    io::json::Object o;
    o["bandwidth_gbps"] = Value(detail::cluster_unit_gbps.from_si(l.bandwidth));
    o["latency_us"] = Value(detail::cluster_unit_us.from_si(l.latency));
    return Value(std::move(o));
  };
  io::json::Object peak;
  peak["fp32"] = Value(detail::cluster_unit_tflops.from_si(c.device.peak_flops_fp32));
  peak["bf16"] = Value(detail::cluster_unit_tflops.from_si(c.device.peak_flops_bf16));
  io::json::Object device;
  device["name"] = Value(c.device.name);
  device["memory_gib"] = Value(detail::cluster_unit_gib.from_si(c.device.memory_bytes));
  device["peak_tflops"] = Value(std::move(peak));
  device["memory_bandwidth_gbps"] = Value(detail::cluster_unit_gbps.from_si(c.device.memory_bandwidth));
  io::json::Object efficiency;
  efficiency["gemm"] = Value(c.gemm_efficiency);
  efficiency["attention"] = Value(c.attention_efficiency);
  io::json::Object host;
  host["memory_bandwidth_gbps"] = Value(detail::cluster_unit_gbps.from_si(c.host_memory_bandwidth));
  host["link_gbps"] = Value(detail::cluster_unit_gbps.from_si(c.host_link_bandwidth));
  io::json::Object root;
  root["name"] = Value(c.name);
  root["nodes"] = Value(c.nodes);
  root["devices_per_node"] = Value(c.devices_per_node);
  root["device"] = Value(std::move(device));
  root["intra_node"] = link(c.intra_node);
  root["inter_node"] = link(c.inter_node);
  root["efficiency"] = Value(std::move(efficiency));
  root["host"] = Value(std::move(host));
  if (!c.speed.empty()) {
    io::json::Array speed;
    for (double s : c.speed) speed.emplace_back(s);
    root["speed"] = Value(std::move(speed));
  }
  return io::json::dump(Value(std::move(root)), 2) + "\n";
}

}  // namespace trellis::plan
