// Shared helpers of the nn tests: deterministic global tensors, running a function on n thread
// ranks, assembling per-rank shards into global arrays (checking that replicated copies agree),
// and norm-relative comparison.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <span>
#include <vector>

#include "trellis/comm/threads.hpp"
#include "trellis/nn/gpt.hpp"
#include "trellis/nn/parameter.hpp"

// Catch2 is not thread-safe: assertions made on rank threads go through one lock. (The
// expression runs under the lock, so it must not wait for another rank: no collectives inside.)
namespace nn_test {
inline std::mutex& catch_mutex() {
  static std::mutex m;
  return m;
}
}  // namespace nn_test
#define RANK_CHECK(...)                                               \
  do {                                                                \
    std::lock_guard<std::mutex> rank_check_lock_(nn_test::catch_mutex()); \
    CHECK(__VA_ARGS__);                                               \
  } while (0)
#define RANK_CHECK_THROWS_AS(expr, type)                              \
  do {                                                                \
    std::lock_guard<std::mutex> rank_check_lock_(nn_test::catch_mutex()); \
    CHECK_THROWS_AS(expr, type);                                      \
  } while (0)
#define RANK_CHECK_THAT(arg, matcher)                                  \
  do {                                                                \
    std::lock_guard<std::mutex> rank_check_lock_(nn_test::catch_mutex()); \
    CHECK_THAT(arg, matcher);                                         \
  } while (0)
#define RANK_CHECK_THROWS_WITH(expr, matcher)                         \
  do {                                                                \
    std::lock_guard<std::mutex> rank_check_lock_(nn_test::catch_mutex()); \
    CHECK_THROWS_WITH(expr, matcher);                                 \
  } while (0)

namespace nn_test {

using trellis::index_t;
using trellis::nn::Parameter;

// Element i of a named global test tensor: a smooth, tp-independent value.
inline float global_value(const std::string& name, index_t i, float scale = 1.0f) {
  return scale * trellis::nn::counter_normal(77, name, i);
}

// Sets every parameter from its global index: weights N(0, scale); LayerNorm weights 1 + N(0, scale).
inline void randomize(Parameter& p, float scale) {
  const bool ln_weight = (p.name.find("ln_") != std::string::npos) && p.name.size() > 7 &&
                         p.name.compare(p.name.size() - 7, 7, ".weight") == 0;
  for (index_t i = 0; i < p.numel(); ++i)
    p.value[i] = (ln_weight ? 1.0f : 0.0f) + global_value(p.name, p.global_index(i), scale);
}

// Global arrays written by several ranks; an element written twice must agree (replicas).
class Collector {
 public:
  void put(const std::string& key, index_t size, index_t index, float v) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& a = arrays_[key];
    if (a.values.empty()) {
      a.values.assign(static_cast<std::size_t>(size), 0.0f);
      a.written.assign(static_cast<std::size_t>(size), 0);
    }
    if (a.written[index]) replica_diff_ = std::max(replica_diff_, std::fabs(a.values[index] - v));
    a.values[index] = v;
    a.written[index] = 1;
  }
  void put_grad(const Parameter& p) {
    for (index_t i = 0; i < p.numel(); ++i) put(p.name, p.global_numel(), p.global_index(i), p.grad[i]);
  }
  std::vector<float> get(const std::string& key) const {
    auto it = arrays_.find(key);
    return it == arrays_.end() ? std::vector<float>{} : it->second.values;
  }
  // True when every element of `key` was written by some rank.
  bool complete(const std::string& key) const {
    auto it = arrays_.find(key);
    return it != arrays_.end() && std::all_of(it->second.written.begin(), it->second.written.end(), [](char c) { return c; });
  }
  std::vector<std::string> keys() const {
    std::vector<std::string> k;
    for (auto& [name, a] : arrays_) k.push_back(name);
    return k;
  }
  float replica_diff() const { return replica_diff_; }
  double scalar = 0.0;

 private:
  struct Array {
    std::vector<float> values;
    std::vector<char> written;
  };
  std::mutex mutex_;
  std::map<std::string, Array> arrays_;
  float replica_diff_ = 0.0f;
};

// max |a - b| / max |b|: error relative to the tensor's scale.
inline double rel_error(std::span<const float> a, std::span<const float> b) {
  if (a.size() != b.size()) return 1e30;
  double diff = 0.0, scale = 1e-30;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return diff / scale;
}

// ||a - b|| / ||b|| (L2): the error relative to the tensor's norm (size mismatch: 1e30).
inline double norm_relative(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return 1e30;
  double d = 0, w = 0;
  for (std::size_t i = 0; i < b.size(); ++i) {
    d += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    w += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(d) / std::max(std::sqrt(w), 1e-30);
}

// ---- the tiny GPT-2 of the model tests (2 layers, 4 heads, width 64, seq 32) ----
inline trellis::nn::GptConfig tiny(index_t vocab = 96) {
  trellis::nn::GptConfig c;
  c.vocab = vocab;
  c.positions = 32;
  c.layers = 2;
  c.heads = 4;
  c.width = 64;
  return c;
}
inline constexpr index_t kBatch = 2, kSeq = 32;

// Microbatch mb's tokens and targets (one ignored target, -1, per microbatch).
inline std::vector<std::int32_t> make_ids(const std::string& what, int mb, index_t vocab) {
  std::vector<std::int32_t> ids(kBatch * kSeq);
  for (index_t i = 0; i < kBatch * kSeq; ++i)
    ids[i] = static_cast<std::int32_t>(trellis::splitmix64(trellis::name_hash(what) + 1000 * mb + i) % vocab);
  if (what == "targets") ids[5 + mb] = -1;
  return ids;
}
inline double count_targets(int microbatches, index_t vocab) {
  double n = 0;
  for (int mb = 0; mb < microbatches; ++mb)
    for (auto t : make_ids("targets", mb, vocab)) n += t >= 0;
  return n;
}

template <class F>
void run_ranks(int n, F&& fn) {
  trellis::comm::ThreadWorld world(n);
  world.run([&](trellis::comm::ThreadComm& comm) {
    comm.set_timeout(std::chrono::milliseconds(20000));
    fn(comm);
  });
}

}  // namespace nn_test
