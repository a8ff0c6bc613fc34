// Incremental decoding (generation): the keys and values of the tokens a model has already seen,
// so that each new token costs one row per layer instead of a forward over the whole window.
//
//   KvCache<B> cache = model.make_kv_cache(batch);      // capacity: cfg.positions
//   model.decode(cache, prompt, prompt_len, logits);    // prefill: the whole prompt in one call
//   model.decode(cache, &next, 1, logits);              // then one token at a time
//
// Per block, K and V of this rank's heads (tensor parallel: local_heads * head_dim columns) as
// token rows in the layers' sequence-major order, row = t * batch + b, for positions
// [0, capacity): appending the rows of positions [t0, t0 + n) is one contiguous row range. The
// buffers are in the backend's memory (B::act_t: bf16 on a bf16 backend), allocated once.
// Positions are GPT-2's learned absolute ones, so a cache cannot slide: once a context is longer
// than the capacity, its last `capacity` tokens must be prefilled again (train::Generator does).
#pragma once

#include <vector>

#include "trellis/backend/backend.hpp"
#include "trellis/core/error.hpp"

namespace trellis::nn {

// One decoding call's new tokens: `count` per sample at positions [start, start + count), for
// `batch` samples; rows (sequence-major) = batch * count.
struct DecodeStep {
  index_t batch = 1;
  index_t start = 0;  // the first new position (= the positions already cached)
  index_t count = 1;  // new tokens per sample
  index_t rows() const { return batch * count; }
  index_t end() const { return start + count; }
};

// One block's cache.
template <backend::Backend B>
struct KvBuffers {
  typename B::template buffer<typename B::act_t> k, v;  // (capacity * batch, local_width), row = t * batch + b
};

template <backend::Backend B>
class KvCache {
 public:
  KvCache() = default;
  KvCache(const B& be, index_t layers, index_t batch, index_t capacity, index_t local_width)
      : batch_(batch), capacity_(capacity), local_width_(local_width) {
    TRELLIS_CHECK(layers >= 0 && batch > 0 && capacity > 0 && local_width > 0, "KvCache: bad sizes (layers ", layers,
                  ", batch ", batch, ", capacity ", capacity, ", width ", local_width, ")");
    const auto n = static_cast<std::size_t>(capacity * batch * local_width);
    layers_.resize(static_cast<std::size_t>(layers));
    for (auto& l : layers_) {
      l.k = be.template allocate<typename B::act_t>(n);
      l.v = be.template allocate<typename B::act_t>(n);
    }
  }

  index_t batch() const { return batch_; }
  index_t capacity() const { return capacity_; }  // positions
  index_t length() const { return length_; }      // positions cached
  index_t local_width() const { return local_width_; }
  index_t layers() const { return static_cast<index_t>(layers_.size()); }
  KvBuffers<B>& layer(index_t i) { return layers_.at(static_cast<std::size_t>(i)); }

  // The next call's geometry for n new tokens per sample; refuses to outgrow the capacity.
  DecodeStep next(index_t n) const {
    TRELLIS_CHECK(n >= 1 && length_ + n <= capacity_, "KvCache: ", n, " new positions after ", length_,
                  " do not fit the capacity of ", capacity_, " (prefill the last ", capacity_,
                  " tokens into a cleared cache instead)");
    return {batch_, length_, n};
  }
  // After every block has written the rows of `step`.
  void advance(const DecodeStep& step) {
    TRELLIS_CHECK(step.start == length_ && step.end() <= capacity_, "KvCache::advance: step [", step.start, ", ",
                  step.end(), ") does not follow the ", length_, " cached positions");
    length_ = step.end();
  }
  // Forget the sequence (the buffers are kept for the next one).
  void clear() { length_ = 0; }

 private:
  index_t batch_ = 0, capacity_ = 0, local_width_ = 0, length_ = 0;
  std::vector<KvBuffers<B>> layers_;
};

}  // namespace trellis::nn
