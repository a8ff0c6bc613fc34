// train::OptimizerState<B>: a Trainer's AdamW state, in the compute backend's memory or offloaded
// to host memory (ZeRO-Offload's optimizer tier). Offloaded, the moments live in host memory and
// each update runs on the CPU (the host AdamW kernel) over staged host copies of the tensors'
// values and gradients, downloaded from B's memory; the updated values are uploaded back. That
// frees the moments' 8 bytes per parameter (or per ZeRO shard element) of device memory; the fp32
// values stay on the device, where the layers read them, so no master copy is kept on the host.
// On the host backends both tiers are RAM, but separate allocations counted apart
// (device_bytes, host_bytes), so the logic and the accounting are tested on any machine, and the
// host kernel is the one the host backends run: offloading changes no bits there.
// The disk tier (Offload::dir set; ZeRO-Infinity's NVMe tier): the moments live in a file
// (train/disk_moments.hpp) and an update streams them through bounded host buffers, a chunk at a
// time (moments read, values and gradients staged, the host kernel, values uploaded, moments
// written back). A chunk is a contiguous range of the file of at most min(Offload::buffer_elements,
// the largest tensor) elements (the host-buffer bound of before, which plan/memory_model.hpp
// models): a large tensor is cut into several, and consecutive tensors of an update share one
// (coalesced: biases and norms are not a tiny read and a thread hand-off each). The update visits
// its tensors in the file's order (any order gives the same bits: tensors are independent), so a
// unit's parameters, listed in backward order, are adjacent there. AdamW is elementwise, so
// chunks give the bits of one update. Prefetched (Offload::disk_prefetch, the
// default; DiskMoments::stream): the disk tier's I/O thread reads the next disk_readahead (D,
// default 2) chunks' moments and writes the previous chunk's back while this thread updates the
// current one, so the host holds D + 1 chunks of moments (m and v) besides the chunk of values
// and gradients (2 (D + 1) + 2 buffers of a chunk: 8 at D = 2, 6 at D = 1; 4 without), allocated
// at construction.
// Overlapped (Offload::overlap, the host tier): an update stages its tensors' values and
// gradients on the calling thread (the device's copies: its work so far is done), then the host
// kernel runs on a worker thread (train/update_worker.hpp) while the caller goes on with the
// backward; the updated values are uploaded when the staging buffer is wanted again (two buffers:
// one update staged while the one before runs) or when the step ends (advance_step), so nothing
// reads them stale: a unit is updated after its last use in the step. The same bits.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "trellis/backend/backend.hpp"
#include "trellis/backend/host.hpp"
#include "trellis/core/error.hpp"
#include "trellis/optim/adamw.hpp"
#include "trellis/train/disk_moments.hpp"
#include "trellis/train/update_worker.hpp"

namespace trellis::train {

// Where the moments live: B's memory (default), host memory (`host`), or files under `dir`.
struct Offload {
  bool host = false;
  std::filesystem::path dir;        // non-empty: the disk tier
  std::uint64_t dir_cap_bytes = 0;  // the most the disk tier may take (0: no cap; tests: a full disk)
  std::size_t buffer_elements = std::size_t{1} << 22;  // the disk tier's chunk (4 host buffers of it; prefetched 2 (D + 1) + 2)
  bool overlap = true;  // the host tier: updates on a worker thread (false: on the caller's)
  bool disk_prefetch = true;  // the disk tier: reads and writes on its I/O thread, overlapping the update
  int disk_readahead = 2;     // prefetched: chunks read ahead of the update (D >= 1)
};

template <backend::Backend B>
class OptimizerState {
 public:
  OptimizerState() = default;
  // One moment pair per tensor of `sizes` (parameters' local shards, or ZeRO pieces).
  OptimizerState(std::span<const index_t> sizes, const Offload& where, B be)
      : be_(std::move(be)), offload_(where.host || !where.dir.empty()), overlap_(where.host && where.overlap && where.dir.empty()),
        buffer_(where.buffer_elements), prefetch_(where.disk_prefetch), readahead_(where.disk_readahead) {
    TRELLIS_CHECK(buffer_ >= 1, "OptimizerState: a disk buffer of ", buffer_, " elements");
    TRELLIS_CHECK(readahead_ >= 1, "OptimizerState: a disk read-ahead of ", readahead_, " chunks (>= 1)");
    if (!where.dir.empty()) {
      disk_.emplace(where.dir, sizes, where.dir_cap_bytes);
      // The host buffers now, at their size in every update (the largest chunk is the cap: the
      // largest tensor's is cut to it), so a memory report counts them from the start.
      index_t largest = 0;
      for (index_t n : sizes) largest = std::max(largest, n);
      const std::size_t cap = std::min(buffer_, static_cast<std::size_t>(largest));
      disk_->reserve_buffers(prefetch_ ? static_cast<std::size_t>(readahead_) + 1 : 1, cap);
      staged_values_.resize(cap);
      staged_grads_.resize(cap);
    } else if (offload_)
      host_ = optim::AdamWState<backend::Host<float>>(sizes);
    else
      device_ = optim::AdamWState<B>(sizes, be_);
    for (index_t n : sizes) sizes_.push_back(static_cast<std::size_t>(n));
  }

  bool offloaded() const { return offload_; }
  bool on_disk() const { return disk_.has_value(); }
  // The disk tier's file (tests and benches: DiskMoments::set_probe, its seam).
  DiskMoments& disk_moments() {
    TRELLIS_CHECK(disk_.has_value(), "OptimizerState: the moments are not on disk (no offload_dir)");
    return *disk_;
  }
  // The disk tier's coalescing of consecutive tensors into one chunk (default on). A test and
  // bench seam: off, each chunk is one tensor's, as before it was built (the same bits).
  void set_disk_coalescing(bool on) { coalesce_ = on; }
  std::size_t tensors() const { return sizes_.size(); }
  std::size_t size(std::size_t i) const { return sizes_.at(i); }
  std::int64_t step() const { return disk_ ? disk_step_ : offload_ ? host_.step() : device_.step(); }
  void set_step(std::int64_t s) {
    TRELLIS_CHECK(s >= 0, "OptimizerState: negative step ", s);
    finish_updates();
    disk_ ? void(disk_step_ = s) : offload_ ? host_.set_step(s) : device_.set_step(s);
  }
  // Counts a step; the updates still running finish first (their values uploaded).
  void advance_step() {
    finish_updates();
    disk_ ? void(++disk_step_) : offload_ ? host_.advance_step() : device_.advance_step();
  }
  void reset() {
    finish_updates();
    if (disk_) {
      disk_->zero();
      disk_step_ = 0;
      return;
    }
    offload_ ? host_.reset() : device_.reset();
  }
  // Moments in B's memory; offloaded moments (disk: the bounded buffers, a chunk of moments
  // readahead + 1 times when prefetched, and one of values and gradients) and the staging buffers' largest size, in
  // host memory; the disk tier's file.
  std::size_t device_bytes() const { return offload_ ? 0 : device_.bytes(); }
  std::size_t host_bytes() const {
    if (disk_) return disk_->buffer_bytes() + (staged_values_.size() + staged_grads_.size()) * sizeof(float);
    std::size_t staged = 0;
    for (const auto& st : staging_) staged += (st.values.size() + st.grads.size()) * sizeof(float);
    return offload_ ? host_.bytes() + staged : 0;
  }
  std::uint64_t disk_bytes() const { return disk_ ? disk_->bytes() : 0; }

  // Overlapped updates submitted so far, and the test probe run on the worker before each.
  std::size_t updates_submitted() const { return worker_ ? worker_->submitted() : 0; }
  void set_update_probe(std::function<void(std::size_t)> probe) { worker().set_probe(std::move(probe)); }
  // Waits for the overlapped updates and uploads their values (advance_step does it).
  void finish_updates() {
    const bool second_first = staging_[0].job && staging_[1].job && *staging_[1].job < *staging_[0].job;
    retire(staging_[second_first ? 1 : 0]);  // the older one first
    retire(staging_[second_first ? 0 : 1]);
  }

  // Tensor i's moments from / to host memory (checkpoints).
  void read_m(std::size_t i, float* dst) const { read(i, dst, true); }
  void read_v(std::size_t i, float* dst) const { read(i, dst, false); }
  void write_m(std::size_t i, const float* src) { write(i, src, true); }
  void write_v(std::size_t i, const float* src) { write(i, src, false); }

  // AdamW for tensors `which` at step() + 1, not counted (advance_step once per optimizer step):
  // values and grads in B's memory, one per tensor of `which`.
  void update(const optim::AdamW& hp, float lr, std::span<const std::size_t> which,
              std::span<const std::span<float>> values, std::span<const std::span<const float>> grads,
              std::span<const float> decay, float scale) {
    if (!offload_) {
      device_.update_part(hp, lr, which, values, grads, decay, scale);
      return;
    }
    if (disk_) {
      update_from_disk(hp, lr, which, values, grads, decay, scale);
      return;
    }
    Staging& st = free_staging();
    std::size_t n = 0;
    for (const auto& v : values) n += v.size();
    st.values.resize(std::max(st.values.size(), n));
    st.grads.resize(std::max(st.grads.size(), n));
    st.host.clear();
    st.device.assign(values.begin(), values.end());
    std::vector<std::span<const float>> hg;
    std::size_t at = 0;
    for (std::size_t k = 0; k < values.size(); ++k) {
      TRELLIS_CHECK(grads[k].size() == values[k].size(), "OptimizerState: tensor ", which[k], " has ",
                    values[k].size(), " values and ", grads[k].size(), " gradients");
      be_.download(st.values.data() + at, values[k].data(), values[k].size());
      be_.download(st.grads.data() + at, grads[k].data(), grads[k].size());
      st.host.emplace_back(st.values.data() + at, values[k].size());
      hg.emplace_back(st.grads.data() + at, grads[k].size());
      at += values[k].size();
    }
    auto run = [this, &st, hp, lr, which = std::vector<std::size_t>(which.begin(), which.end()), hg = std::move(hg),
                decay = std::vector<float>(decay.begin(), decay.end()), scale] {
      host_.update_part(hp, lr, which, st.host, hg, decay, scale);
    };
    if (overlap_) {
      st.job = worker().submit(std::move(run));
    } else {
      run();
      upload(st);
    }
  }

 private:
  // One update's values and gradients staged in host memory, and where the values go back.
  struct Staging {
    std::vector<float> values, grads;
    std::vector<std::span<float>> host, device;  // per tensor: staged values, B's values
    std::optional<std::size_t> job;              // overlapped: its worker job until retired
  };
  // The first buffer without a running update (overlapped: if both run, the older one retired).
  Staging& free_staging() {
    for (auto& st : staging_)
      if (!st.job) return st;
    Staging& older = *staging_[0].job < *staging_[1].job ? staging_[0] : staging_[1];
    retire(older);
    return older;
  }
  UpdateWorker& worker() {
    if (!worker_) worker_ = std::make_unique<UpdateWorker>();
    return *worker_;
  }
  void upload(Staging& st) {
    for (std::size_t k = 0; k < st.device.size(); ++k) be_.upload(st.device[k].data(), st.host[k].data(), st.host[k].size());
  }
  // An overlapped update's job waited for (its error rethrown) and its values uploaded.
  void retire(Staging& st) {
    if (!st.job) return;
    const std::size_t job = *std::exchange(st.job, std::nullopt);
    worker_->wait(job);
    upload(st);
  }

  // One tensor's part of a disk chunk: elements [at, at + n) of which[k], at `off` in the chunk.
  struct Slice {
    std::size_t k = 0, at = 0, n = 0, off = 0;
  };
  // The chunks of an update of `which` (sizes n), in the file's order: a chunk runs on into the
  // next tensor while that one starts where it ends in the file (coalescing) and it has room;
  // slices[first[j], first[j + 1]) are chunk j's. At most min(buffer_, largest tensor) elements.
  void plan_chunks(std::span<const std::size_t> which, std::span<const std::size_t> n, std::vector<DiskChunk>& chunks,
                   std::vector<Slice>& slices, std::vector<std::size_t>& first) const {
    std::size_t largest = 1;
    for (std::size_t s : sizes_) largest = std::max(largest, s);
    const std::size_t cap = std::min(buffer_, largest);
    std::vector<std::size_t> order(which.size());
    for (std::size_t k = 0; k < order.size(); ++k) order[k] = k;
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return which[a] < which[b]; });
    std::size_t end = 0;  // the open chunk's end in the file (m's order)
    for (std::size_t k : order) {
      const std::size_t i = which[k];
      const bool joins = coalesce_ && !chunks.empty() && chunks.back().n < cap && disk_->offset(i) == end;
      for (std::size_t at = 0; at < n[k];) {
        if (at == 0 && joins) {
          chunks.back().tensors = i - chunks.back().tensor + 1;  // (over empty tensors between, if any)
        } else {  // the tensor's start out of reach, or the chunk before full
          first.push_back(slices.size());
          chunks.push_back({i, at, 0, 1});
        }
        const std::size_t take = std::min(n[k] - at, cap - chunks.back().n);
        slices.push_back({k, at, take, chunks.back().n});
        chunks.back().n += take;
        at += take;
      }
      if (n[k] > 0) end = disk_->offset(i) + n[k];
    }
    first.push_back(slices.size());
  }

  // The disk tier: the update's chunks (plan_chunks) through the host buffers (DiskMoments::stream:
  // the moments' reads and writes on its I/O thread when prefetched; values and gradients here).
  void update_from_disk(const optim::AdamW& hp, float lr, std::span<const std::size_t> which,
                        std::span<const std::span<float>> values, std::span<const std::span<const float>> grads,
                        std::span<const float> decay, float scale) {
    std::vector<std::size_t> n(which.size());
    for (std::size_t k = 0; k < which.size(); ++k) {
      const std::size_t i = which[k];
      n[k] = values[k].size();
      TRELLIS_CHECK(i < sizes_.size() && n[k] == sizes_[i] && grads[k].size() == n[k], "OptimizerState: tensor ", i,
                    " given ", n[k], " values and ", grads[k].size(), " gradients");
    }
    std::vector<DiskChunk> chunks;
    std::vector<Slice> slices;
    std::vector<std::size_t> first;
    plan_chunks(which, n, chunks, slices, first);
    std::size_t c = 0;
    for (const DiskChunk& ch : chunks) c = std::max(c, ch.n);
    for (auto* b : {&staged_values_, &staged_grads_}) b->resize(std::max(b->size(), c));
    std::vector<kernels::AdamWTensor<float>> ts;
    disk_->stream(chunks, prefetch_ ? static_cast<std::size_t>(readahead_) : 0, [&](std::size_t j, float* m, float* v) {
      ts.clear();
      for (std::size_t q = first[j]; q < first[j + 1]; ++q) {  // each tensor's slice of the chunk
        const Slice& sl = slices[q];
        float* val = staged_values_.data() + sl.off;
        float* grad = staged_grads_.data() + sl.off;
        be_.download(val, values[sl.k].data() + sl.at, sl.n);
        be_.download(grad, grads[sl.k].data() + sl.at, sl.n);
        ts.push_back({{val, sl.n}, {grad, sl.n}, {m + sl.off, sl.n}, {v + sl.off, sl.n}, decay[sl.k]});
      }
      backend::Host<float>{}.adamw(std::span<const kernels::AdamWTensor<float>>(ts), hp.config(lr), disk_step_ + 1, scale);
      for (std::size_t q = first[j]; q < first[j + 1]; ++q) {
        const Slice& sl = slices[q];
        be_.upload(values[sl.k].data() + sl.at, staged_values_.data() + sl.off, sl.n);
      }
    });
  }
  void read(std::size_t i, float* dst, bool m) const {
    TRELLIS_CHECK(!staging_[0].job && !staging_[1].job, "OptimizerState: moments read while an update runs");
    if (disk_) {
      disk_->read(i, m, 0, sizes_.at(i), dst);
      return;
    }
    if (offload_) {
      const auto src = m ? host_.m(i) : host_.v(i);
      std::copy(src.begin(), src.end(), dst);
    } else {
      const auto src = m ? device_.m(i) : device_.v(i);
      be_.download(dst, src.data(), src.size());
    }
  }
  void write(std::size_t i, const float* src, bool m) {
    finish_updates();
    if (disk_) {
      disk_->write(i, m, 0, sizes_.at(i), src);
      return;
    }
    if (offload_) {
      auto dst = m ? host_.m(i) : host_.v(i);
      std::copy_n(src, dst.size(), dst.begin());
    } else {
      auto dst = m ? device_.m(i) : device_.v(i);
      be_.upload(dst.data(), src, dst.size());
    }
  }

  B be_;
  bool offload_ = false;
  std::vector<std::size_t> sizes_;
  optim::AdamWState<B> device_;
  optim::AdamWState<backend::Host<float>> host_;
  bool overlap_ = false;
  std::array<Staging, 2> staging_;  // the host tier: the second while an overlapped update runs
  std::vector<float> staged_values_, staged_grads_;  // the disk tier's values and gradients chunk
  std::optional<DiskMoments> disk_;
  std::size_t buffer_ = std::size_t{1} << 22;
  bool prefetch_ = true;  // the disk tier's I/O on its thread, overlapping the update
  int readahead_ = 2;     // ... reading that many chunks ahead
  bool coalesce_ = true;  // the disk tier: consecutive tensors share a chunk (set_disk_coalescing)
  std::int64_t disk_step_ = 0;
  std::unique_ptr<UpdateWorker> worker_;  // last: joined before the buffers its jobs use go
};

}  // namespace trellis::train
