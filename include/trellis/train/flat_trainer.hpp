// train::FlatTrainer<B>: training steps of an nn::FlatGpt (a whole GPT-2 per rank, one device),
// optionally data parallel over a communicator whose memory space matches the backend B
// (ThreadComm or MpiComm with backend::Host, NcclComm with backend::Cuda; checked at compile time):
//
//   FlatTrainer<backend::Cuda> t(cfg, be);           // cfg: TrainerConfig with pp = tp = 1, no ZeRO
//   StepResult r = t.step(batch);                   // one GPU
//   StepResult r = t.step(batch, &nccl_dp_comm);    // dp ranks, gradients all-reduced (sum)
//
// A step: per microbatch forward + backward into the flat fp32 gradient (loss normalised by the
// global token count, as train::Trainer); dp: during the last microbatch's backward each block's
// gradient range starts an asynchronous all-reduce as soon as the block is done (overlapping the
// earlier blocks' backward), wte/wpe/ln_f at the end; NcclComm: give it the backend's stream
// (set_stream) so each reduction is ordered after the kernels that wrote its range; global
// gradient norm, clip factor and AdamW (fp32 master weights and moments, weight decay on matrices
// only, warm-up + cosine LR at the optimizer's step count); then the act_t weight copy is
// refreshed. The math is Trainer's with pp = tp = 1: the same config gives the same losses
// (tests/nn/test_flat_gpt.cpp).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <utility>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "trellis/backend/backend.hpp"
#include "trellis/comm/communicator.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/adamw_host.hpp"
#include "trellis/nn/flat_gpt.hpp"
#include "trellis/optim/adamw.hpp"
#include "trellis/train/checkpoint.hpp"
#include "trellis/train/data.hpp"
#include "trellis/train/hf_gpt2.hpp"
#include "trellis/train/rng.hpp"
#include "trellis/train/checkpoint_model.hpp"
#include "trellis/train/train_state.hpp"
#include "trellis/train/trainer.hpp"

namespace trellis::train {

// What FlatTrainer cannot run that Trainer can (each saying what to change).
inline std::vector<std::string> flat_layout_problems(const TrainerConfig& c) {
  std::vector<std::string> out;
  if (c.pp != 1 || c.tp != 1)
    out.push_back("the one-device GPT (--backend cuda) runs data parallelism only: use --pp 1 --tp 1 (got pp " +
                  std::to_string(c.pp) + ", tp " + std::to_string(c.tp) + ")");
  if (c.zero1) out.push_back("--zero1 is not supported by the one-device GPT (--backend cuda) yet");
  if (c.options.dropout != 0.0f) out.push_back("--dropout is not supported by the one-device GPT (--backend cuda)");
  if (c.options.recompute || c.options.sequence_parallel || c.options.overlap_chunks != 1)
    out.push_back("--recompute, --sp and --overlap need tensor parallelism (host backend)");
  return out;
}

// Every problem of a config for FlatTrainer (empty: usable).
inline std::vector<std::string> flat_config_problems(const TrainerConfig& c) {
  std::vector<std::string> out = config_problems(c);
  for (auto& p : flat_layout_problems(c)) out.push_back(std::move(p));
  return out;
}

template <backend::Backend B>
class FlatTrainer {
 public:
  explicit FlatTrainer(const TrainerConfig& cfg, B be = {}) : cfg_(cfg), model_(checked(cfg), cfg.options, be) {
    auto& o = model_.backend();
    const auto n = static_cast<std::size_t>(model_.flat_size());
    m_ = o.template allocate<float>(n);
    v_ = o.template allocate<float>(n);
  }

  nn::FlatGpt<B>& model() { return model_; }
  const TrainerConfig& config() const { return cfg_; }
  std::int64_t step_count() const { return step_; }

  // One optimizer step on one rank's rows (batch.rows = global batch / dp).
  StepResult step(const Batch& batch) { return step_impl(batch, static_cast<NoComm*>(nullptr)); }
  template <comm::Communicator C>
    requires backend::CompatibleWith<B, C>
  StepResult step(const Batch& batch, C* dp) {
    return step_impl(batch, dp);
  }

  // Writes <root>/step-N as a one-rank checkpoint (GPT-2 names and shapes, fp32 values and AdamW
  // moments, step, data position): any Trainer layout loads it (and load() reads any layout's).
  // Data parallel: the replicas are identical, so dp rank 0 alone calls save().
  void save(const std::filesystem::path& root, const DataState& data) {
    CheckpointWriter w(root, step_, 0, 1);
    std::vector<std::vector<float>> keep;  // host copies, alive until finish()
    keep.reserve(3 * model_.tensors().size());
    auto& o = model_.backend();
    for (const nn::FlatTensor& t : model_.tensors()) {
      const Box box = full_box(t.shape);
      const auto n = static_cast<std::size_t>(t.numel);
      const std::tuple<const float*, std::string, CheckpointFile> parts[] = {
          {model_.params(), t.name, CheckpointFile::model},
          {m_.data(), optim::adamw_m_name(t.name), CheckpointFile::optimizer},
          {v_.data(), optim::adamw_v_name(t.name), CheckpointFile::optimizer}};
      for (const auto& [base, name, file] : parts) {
        keep.emplace_back(n);
        o.download(keep.back().data(), base + t.offset, n);
        w.add(name, DType::f32, t.shape, box, keep.back().data(), file);
      }
    }
    TrainState s;
    s.step = step_;
    s.rng = Rng(cfg_.seed, 0);
    s.data = data;
    save_train_state(w, s);
    save_model_config(w, cfg_.model);
    w.finish();
    commit_checkpoint(root, step_, 1);
  }

  // Loads a checkpoint written by any layout (Trainer or FlatTrainer); returns its train state
  // (restore the loader with .data). Moments missing from the file are an error.
  TrainState load(const std::filesystem::path& step_dir) {
    Checkpoint ck(step_dir);
    check_model_config(ck, cfg_.model);
    TrainState s = load_train_state(ck, 0);
    check_saved_train_states(ck);  // the saving ranks agreed (step, data position, Rng streams)
    auto& o = model_.backend();
    for (const nn::FlatTensor& t : model_.tensors()) {
      const Box box = full_box(t.shape);
      std::vector<float> host(static_cast<std::size_t>(t.numel));
      for (auto [base, name] : {std::pair{model_.params(), t.name}, std::pair{m_.data(), optim::adamw_m_name(t.name)},
                                std::pair{v_.data(), optim::adamw_v_name(t.name)}}) {
        ck.expect(name, DType::f32, t.shape);
        ck.read(name, DType::f32, box, host.data());
        o.upload(base + t.offset, host.data(), host.size());
      }
    }
    step_ = s.step;
    model_.refresh_low_precision();
    return s;
  }

  // Starts from GPT-2 weights in a Hugging Face safetensors file (train/hf_gpt2.hpp); optimizer
  // state fresh (zero moments, step 0).
  void init_from_hf(const std::filesystem::path& file) {
    HfGpt2File hf(file, cfg_.model);
    auto& o = model_.backend();
    for (const nn::FlatTensor& t : model_.tensors()) {
      std::vector<float> host(static_cast<std::size_t>(t.numel));
      hf.read(t.name, full_box(t.shape), host.data());
      o.upload(model_.params() + t.offset, host.data(), host.size());
    }
    const std::vector<float> zeros(static_cast<std::size_t>(model_.flat_size()), 0.0f);
    o.upload(m_.data(), zeros.data(), zeros.size());
    o.upload(v_.data(), zeros.data(), zeros.size());
    step_ = 0;
    model_.refresh_low_precision();
  }

  // Global mean loss of a batch without training.
  double evaluate(const Batch& batch) { return evaluate_impl(batch, static_cast<NoComm*>(nullptr)); }
  template <comm::Communicator C>
    requires backend::CompatibleWith<B, C>
  double evaluate(const Batch& batch, C* dp) {
    return evaluate_impl(batch, dp);
  }

 private:
  struct NoComm {};

  static const nn::GptConfig& checked(const TrainerConfig& cfg) {
    const auto problems = flat_config_problems(cfg);
    if (!problems.empty()) {
      std::string all;
      for (const auto& p : problems) all += "\n  " + p;
      TRELLIS_THROW("FlatTrainer: the configuration cannot run:", all);
    }
    return cfg.model;
  }

  template <class C>
  double all_reduce_scalar(double x, C* dp) {
    if constexpr (std::is_same_v<C, NoComm>) {
      return x;
    } else {
      if (dp == nullptr || dp->size() == 1) return x;
      auto& o = model_.backend();
      auto buf = o.template allocate<double>(1);  // in the communicator's memory space
      o.upload(buf.data(), &x, 1);
      dp->all_reduce(buf.data(), buf.data(), 1, comm::ReduceOp::sum);
      double out = 0;
      o.download(&out, buf.data(), 1);
      return out;
    }
  }

  void check_batch(const Batch& b) const {
    TRELLIS_CHECK(b.seq_len == cfg_.seq, "FlatTrainer: batch of sequence length ", b.seq_len, ", configured ", cfg_.seq);
    TRELLIS_CHECK(b.rows >= 1 && b.rows % cfg_.microbatches == 0, "FlatTrainer: ", b.rows,
                  " rows do not split into ", cfg_.microbatches, " microbatches");
    TRELLIS_CHECK(b.inputs.size() == static_cast<std::size_t>(b.rows * b.seq_len) && b.targets.size() == b.inputs.size(),
                  "FlatTrainer: batch arrays do not match rows x seq_len");
  }

  template <class C>
  double token_count(const Batch& b, C* dp) {
    double local = 0;
    for (std::int32_t t : b.targets) local += t >= 0 ? 1.0 : 0.0;
    const double total = all_reduce_scalar(local, dp);
    TRELLIS_CHECK(total > 0, "FlatTrainer: the batch has no target tokens");
    return total;
  }

  template <class C>
  StepResult step_impl(const Batch& batch, C* dp) {
    check_batch(batch);
    model_.zero_grad();
    const double tokens = token_count(batch, dp);
    const index_t mb_rows = batch.rows / cfg_.microbatches;
    const nn::FlatShape shape{mb_rows, batch.seq_len};
    auto microbatch = [&](int mb, auto&& on_block_done) {
      const std::size_t first = static_cast<std::size_t>(mb * mb_rows * batch.seq_len);
      return model_.forward_backward(shape, batch.inputs.data() + first, batch.targets.data() + first, tokens,
                                     on_block_done);
    };
    double loss = 0;
    for (int mb = 0; mb + 1 < cfg_.microbatches; ++mb) loss += microbatch(mb, nn::NoBlockHook{});
    const int last = cfg_.microbatches - 1;
    int buckets = 0, overlapped = 0;  // dp reductions started, and those started during the backward
    bool last_done = false;
    if constexpr (!std::is_same_v<C, NoComm>) {
      if (dp != nullptr && dp->size() > 1) {
        // Each block's gradient range is reduced (sum, in place) as soon as the last microbatch's
        // backward has finished that block, overlapping the earlier blocks' backward; wte/wpe and
        // ln_f when everything is done. Element sums are in rank order either way: the result
        // equals one all-reduce of the whole buffer.
        float* g = model_.grads();
        std::vector<typename C::request_type> pending;
        auto reduce = [&](index_t offset, index_t count) {
          if (count > 0)
            pending.push_back(dp->all_reduce_async(g + offset, g + offset, static_cast<std::size_t>(count),
                                                   comm::ReduceOp::sum));
        };
        loss += microbatch(last, reduce);
        overlapped = static_cast<int>(pending.size());
        const index_t head = model_.block_begin(cfg_.model.layers);
        reduce(0, model_.block_begin(0));
        reduce(head, model_.flat_size() - head);
        buckets = static_cast<int>(pending.size());
        for (auto& request : pending) request.wait();
        last_done = true;
      }
    }
    if (!last_done) loss += microbatch(last, nn::NoBlockHook{});
    auto& o = model_.backend();
    StepResult r;
    r.loss = all_reduce_scalar(loss, dp);
    const auto grads = model_.grad_tensors();
    r.grad_norm = std::sqrt(o.sum_of_squares(std::span<const std::span<const float>>(grads)));
    r.clip_scale = cfg_.clip > 0 ? kernels::host::clip_scale(r.grad_norm, cfg_.clip) : 1.0f;
    const float lr = static_cast<float>(cfg_.lr(step_));
    r.lr = lr;
    std::vector<kernels::AdamWTensor<float>> work;
    for (const nn::FlatTensor& t : model_.tensors()) {
      const auto n = static_cast<std::size_t>(t.numel);
      work.push_back({std::span<float>(model_.params() + t.offset, n), std::span<const float>(model_.grads() + t.offset, n),
                      std::span<float>(m_.data() + t.offset, n), std::span<float>(v_.data() + t.offset, n),
                      t.decay ? 1.0f : 0.0f});
    }
    o.adamw(std::span<const kernels::AdamWTensor<float>>(work), cfg_.adamw.config(lr), step_ + 1, r.clip_scale);
    ++step_;
    model_.refresh_low_precision();
    r.step = step_;
    r.buckets = buckets;
    r.buckets_overlapped = overlapped;
    return r;
  }

  template <class C>
  double evaluate_impl(const Batch& batch, C* dp) {
    check_batch(batch);
    const double tokens = token_count(batch, dp);
    const index_t mb_rows = batch.rows / cfg_.microbatches;
    double loss = 0;
    for (int mb = 0; mb < cfg_.microbatches; ++mb) {
      const std::size_t first = static_cast<std::size_t>(mb * mb_rows * batch.seq_len);
      loss += model_.evaluate({mb_rows, batch.seq_len}, batch.inputs.data() + first, batch.targets.data() + first,
                              tokens);
    }
    return all_reduce_scalar(loss, dp);
  }

  TrainerConfig cfg_;
  nn::FlatGpt<B> model_;
  typename B::template buffer<float> m_, v_;
  std::int64_t step_ = 0;
};

}  // namespace trellis::train
