// backend::DeviceChecked<Inner>: a host backend that keeps the discipline of device memory, so the
// host test suite checks the logic a GPU run depends on. Every buffer it allocates is registered;
// every kernel refuses a pointer argument that is not inside one of its allocations (a host
// std::vector passed to a kernel, which on a GPU is an illegal address), upload/download refuse
// a backend pointer on the host side, and parameters packed with it are not host-readable
// (host_readable = false: nn::ParamArray refuses element access, as it must on a GPU).
//
// The arithmetic is Inner's (backend::Host<float> or <bfloat16>), so a run with DeviceChecked<B>
// must equal a run with B bit for bit; the memory is host memory, so host communicators work on
// it as NCCL works on device memory. Workspace follows backend::Cuda's rule: a kernel whose query
// exceeds what reserve_workspace() reserved (shared by all copies) is refused; where Inner needs
// no scratch the queries answer stand-in sizes that grow with the problem as CUDA's do, so a
// missing or too small reservation is caught on the host too. Why this exists: without a GPU, it is how the CI proves that
// layers, models and trainers reach parameters, moments and activations only through the backend
// (docs/backend.md, "device discipline on the host").
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "trellis/backend/backend.hpp"
#include "trellis/backend/host.hpp"
#include "trellis/core/buffer.hpp"
#include "trellis/core/error.hpp"

namespace trellis::backend {

// The address ranges of a DeviceChecked backend's live allocations (shared by its copies).
class DeviceRegistry {
 public:
  void add(const void* p, std::size_t bytes) {
    std::lock_guard lock(mu_);
    ranges_[address(p)] = bytes;
  }
  void remove(const void* p) {
    std::lock_guard lock(mu_);
    ranges_.erase(address(p));
  }
  // p lies in an allocation (or at its end: an empty range past the last element).
  bool contains(const void* p) const {
    const std::uintptr_t a = address(p);
    std::lock_guard lock(mu_);
    auto it = ranges_.upper_bound(a);
    if (it == ranges_.begin()) return false;
    --it;
    return a <= it->first + it->second;
  }
  std::size_t allocations() const {
    std::lock_guard lock(mu_);
    return ranges_.size();
  }
  // The workspace reservation, shared like backend::Cuda's (every copy of the backend sees it).
  void reserve(std::size_t bytes) {
    std::lock_guard lock(mu_);
    reserved_ = std::max(reserved_, bytes);
  }
  std::size_t reserved() const {
    std::lock_guard lock(mu_);
    return reserved_;
  }
  // The named ranges the layers open and close ("name" / "/name"), recorded while tracing is on:
  // what a CUDA run shows in Nsight Systems, checked on the host.
  void set_tracing(bool on) {
    std::lock_guard lock(mu_);
    tracing_ = on;
  }
  void record(std::string event) {
    std::lock_guard lock(mu_);
    if (tracing_) trace_.push_back(std::move(event));
  }
  std::vector<std::string> trace() const {
    std::lock_guard lock(mu_);
    return trace_;
  }

 private:
  static std::uintptr_t address(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }
  mutable std::mutex mu_;
  std::map<std::uintptr_t, std::size_t> ranges_;
  std::size_t reserved_ = 0;
  bool tracing_ = false;
  std::vector<std::string> trace_;
};

// An open range of a DeviceChecked backend (recorded when tracing).
class CheckedRange {
 public:
  CheckedRange(std::shared_ptr<DeviceRegistry> registry, const char* name) : registry_(std::move(registry)), name_(name) {
    registry_->record(name_);
  }
  ~CheckedRange() { registry_->record("/" + name_); }
  CheckedRange(const CheckedRange&) = delete;
  CheckedRange& operator=(const CheckedRange&) = delete;

 private:
  std::shared_ptr<DeviceRegistry> registry_;
  std::string name_;
};

// An owning buffer in "device" memory: data() and size() only, like Buffer<T, Cuda>. Zeroed, or
// (scratch) filled with 0xFF bytes, a NaN in fp32 and bf16, so that reading scratch before writing
// it shows up in the results.
template <class T>
class CheckedBuffer {
 public:
  using value_type = T;
  using space = trellis::Host;

  CheckedBuffer() = default;
  CheckedBuffer(std::size_t n, std::shared_ptr<DeviceRegistry> registry, bool poison = false)
      : buffer_(n, !poison), registry_(std::move(registry)) {
    if (buffer_.data()) registry_->add(buffer_.data(), n * sizeof(T));
    if (poison && n > 0) std::memset(static_cast<void*>(buffer_.data()), 0xFF, n * sizeof(T));
  }
  CheckedBuffer(CheckedBuffer&& o) noexcept = default;
  CheckedBuffer& operator=(CheckedBuffer&& o) noexcept {
    if (this != &o) {
      unregister();
      buffer_ = std::move(o.buffer_);
      registry_ = std::move(o.registry_);
    }
    return *this;
  }
  ~CheckedBuffer() { unregister(); }

  T* data() noexcept { return buffer_.data(); }
  const T* data() const noexcept { return buffer_.data(); }
  std::size_t size() const noexcept { return buffer_.size(); }
  bool empty() const noexcept { return buffer_.empty(); }

 private:
  void unregister() noexcept {
    if (registry_ && buffer_.data()) registry_->remove(buffer_.data());
  }
  Buffer<T, trellis::Host> buffer_;
  std::shared_ptr<DeviceRegistry> registry_;
};

template <class Inner = Host<float>>
  requires std::same_as<typename Inner::space, trellis::Host>
class DeviceChecked {
 public:
  using space = trellis::Host;
  using act_t = typename Inner::act_t;
  using stream_type = typename Inner::stream_type;
  using event_type = typename Inner::event_type;
  template <class T> using buffer = CheckedBuffer<T>;
  static constexpr bool host_readable = false;

  DeviceChecked() : registry_(std::make_shared<DeviceRegistry>()) {}
  explicit DeviceChecked(Inner inner) : inner_(std::move(inner)), registry_(std::make_shared<DeviceRegistry>()) {}

  const DeviceRegistry& registry() const { return *registry_; }
  // Whether p points into this backend's memory (tests; the checks below use it).
  bool owns(const void* p) const { return registry_->contains(p); }

  stream_type stream() const { return inner_.stream(); }
  event_type record_event() const { return inner_.record_event(); }
  void wait_event(const event_type& e) const { inner_.wait_event(e); }
  void synchronize() const { inner_.synchronize(); }
  CheckedRange range(const char* name) const { return CheckedRange(registry_, name); }
  // Records the layers' ranges from now on (every copy of this backend shares the record).
  void set_tracing(bool on) const { registry_->set_tracing(on); }

  // ---- memory ---------------------------------------------------------------------------------
  template <class T> buffer<T> allocate(std::size_t n) const { return buffer<T>(n, registry_); }
  template <class T> buffer<T> scratch(std::size_t n) const { return buffer<T>(n, registry_, /*poison=*/true); }
  template <class T> void upload(T* dst, const T* src, std::size_t n) const {
    if (n == 0) return;
    device("upload", "dst", dst);
    host("upload", "src", src);
    inner_.upload(dst, src, n);
  }
  template <class T> void download(T* dst, const T* src, std::size_t n) const {
    if (n == 0) return;
    host("download", "dst", dst);
    device("download", "src", src);
    inner_.download(dst, src, n);
  }
  template <class T> void copy(T* dst, const T* src, std::size_t n) const {
    if (n == 0) return;
    device("copy", "dst", dst);
    device("copy", "src", src);
    inner_.copy(dst, src, n);
  }
  template <class T> void fill_zero(T* p, std::size_t n) const {
    if (n == 0) return;
    device("fill_zero", "p", p);
    inner_.fill_zero(p, n);
  }

  // ---- workspace (Inner's sizes, or stand-ins growing like CUDA's where Inner needs none) -------
  std::size_t layernorm_backward_workspace(index_t r, index_t d) const {
    return or_stand_in(inner_.layernorm_backward_workspace(r, d), 2 * d * row_blocks(r));
  }
  std::size_t attention_backward_workspace(const kernels::AttentionArgs& a) const {
    return or_stand_in(inner_.attention_backward_workspace(a), a.batch * a.q_heads * a.q_len);
  }
  std::size_t column_sums_workspace(index_t r, index_t c) const {
    return or_stand_in(inner_.column_sums_workspace(r, c), c * row_blocks(r));
  }
  std::size_t sum_of_squares_workspace(std::span<const std::span<const float>> g) const {
    return or_stand_in(inner_.sum_of_squares_workspace(g), 64 + 2 * static_cast<index_t>(g.size()));
  }
  // CUDA: the sort buffers (4 ints per assignment), per-expert counts and offsets, CUB's scratch.
  std::size_t moe_dispatch_plan_workspace(index_t rows, int topk, index_t experts) const {
    const index_t n = rows * topk;
    return or_stand_in(inner_.moe_dispatch_plan_workspace(rows, topk, experts), n > 0 ? 4 * n + 3 * experts + 64 : 0);
  }
  void reserve_workspace(std::size_t bytes) {
    inner_.reserve_workspace(bytes);
    registry_->reserve(bytes);
  }
  std::size_t workspace_reserved() const { return registry_->reserved(); }

  // ---- kernels: every pointer argument must be backend memory ---------------------------------
  void convert(std::size_t n, const float* src, act_t* dst) const {
    device("convert", "src", src, dst);
    inner_.convert(n, src, dst);
  }
  template <class TC, class E = kernels::epilogue::None>
  void gemm(const kernels::GemmArgs& args, const act_t* a, const act_t* b, TC* c, E ep = {}) const {
    device("gemm", "a, b, c", a, b, c);
    check_epilogue(ep);
    inner_.gemm(args, a, b, c, ep);
  }
  void layernorm_forward(index_t rows, index_t dim, const act_t* x, const float* w, const float* b, act_t* out,
                         float* mean, float* rstd, float eps, const act_t* residual = nullptr,
                         act_t* sum_out = nullptr) const {
    device("layernorm_forward", "x, w, b, out, mean, rstd, residual, sum_out", x, w, b, out, mean, rstd, residual,
           sum_out);
    inner_.layernorm_forward(rows, dim, x, w, b, out, mean, rstd, eps, residual, sum_out);
  }
  void layernorm_backward(index_t rows, index_t dim, const act_t* dout, const act_t* input, const float* w,
                          const float* mean, const float* rstd, act_t* dinput, float* dw, float* db,
                          bool accumulate) const {
    device("layernorm_backward", "dout, input, w, mean, rstd, dinput, dw, db", dout, input, w, mean, rstd, dinput,
           dw, db);
    workspace("layernorm_backward", layernorm_backward_workspace(rows, dim));
    inner_.layernorm_backward(rows, dim, dout, input, w, mean, rstd, dinput, dw, db, accumulate);
  }
  void attention_forward(const kernels::AttentionArgs& a, const act_t* q, const act_t* k, const act_t* v, act_t* o,
                         float* lse) const {
    device("attention_forward", "q, k, v, o, lse", q, k, v, o, lse);
    if (a.segmented()) device("attention_forward", "q_segments, kv_segments", a.q_segments, a.kv_segments);
    inner_.attention_forward(a, q, k, v, o, lse);
  }
  void attention_backward(const kernels::AttentionArgs& a, const act_t* q, const act_t* k, const act_t* v,
                          const act_t* o, const act_t* d_o, const float* lse, act_t* dq, act_t* dk, act_t* dv,
                          bool accumulate = false) const {
    device("attention_backward", "q, k, v, o, d_o, lse, dq, dk, dv", q, k, v, o, d_o, lse, dq, dk, dv);
    if (a.segmented()) device("attention_backward", "q_segments, kv_segments", a.q_segments, a.kv_segments);
    workspace("attention_backward", attention_backward_workspace(a));
    inner_.attention_backward(a, q, k, v, o, d_o, lse, dq, dk, dv, accumulate);
  }
  void merge_attention_partials(index_t rows, index_t head_dim, act_t* o_acc, float* lse_acc, const act_t* o_part,
                                const float* lse_part) const {
    device("merge_attention_partials", "o_acc, lse_acc, o_part, lse_part", o_acc, lse_acc, o_part, lse_part);
    inner_.merge_attention_partials(rows, head_dim, o_acc, lse_acc, o_part, lse_part);
  }
  void rows_to_heads(const kernels::HeadsLayout& l, const act_t* rows, index_t ld, act_t* heads) const {
    device("rows_to_heads", "rows, heads", rows, heads);
    inner_.rows_to_heads(l, rows, ld, heads);
  }
  void heads_to_rows(const kernels::HeadsLayout& l, const act_t* heads, act_t* rows, index_t ld) const {
    device("heads_to_rows", "heads, rows", heads, rows);
    inner_.heads_to_rows(l, heads, rows, ld);
  }
  void xent_partial_max(index_t rows, index_t vl, index_t ld, const act_t* logits, float* row_max) const {
    device("xent_partial_max", "logits, row_max", logits, row_max);
    inner_.xent_partial_max(rows, vl, ld, logits, row_max);
  }
  void xent_partial_sumexp(index_t rows, index_t vl, index_t ld, const act_t* logits, const float* global_max,
                           float* sumexp) const {
    device("xent_partial_sumexp", "logits, global_max, sumexp", logits, global_max, sumexp);
    inner_.xent_partial_sumexp(rows, vl, ld, logits, global_max, sumexp);
  }
  void xent_partial_target(index_t rows, index_t vl, index_t ld, const act_t* logits, const std::int32_t* targets,
                           index_t vocab_start, float* target_logit) const {
    device("xent_partial_target", "logits, targets, target_logit", logits, targets, target_logit);
    inner_.xent_partial_target(rows, vl, ld, logits, targets, vocab_start, target_logit);
  }
  void xent_finish(index_t rows, const float* global_max, const float* global_sumexp, const float* target_logit,
                   const std::int32_t* targets, float* loss, float* lse) const {
    device("xent_finish", "global_max, global_sumexp, target_logit, targets, loss, lse", global_max, global_sumexp,
           target_logit, targets, loss, lse);
    inner_.xent_finish(rows, global_max, global_sumexp, target_logit, targets, loss, lse);
  }
  void xent_backward_sharded(index_t rows, index_t vl, index_t ld, const act_t* logits, const std::int32_t* targets,
                             index_t vocab_start, const float* lse, float grad_scale, act_t* dlogits,
                             index_t ld_grad) const {
    device("xent_backward_sharded", "logits, targets, lse, dlogits", logits, targets, lse, dlogits);
    inner_.xent_backward_sharded(rows, vl, ld, logits, targets, vocab_start, lse, grad_scale, dlogits, ld_grad);
  }
  void embedding_forward(const kernels::EmbeddingArgs& a, const std::int32_t* tokens, const float* wte,
                         const float* wpe, act_t* out) const {
    device("embedding_forward", "tokens, wte, wpe, out", tokens, wte, wpe, out);
    inner_.embedding_forward(a, tokens, wte, wpe, out);
  }
  void embedding_backward(const kernels::EmbeddingArgs& a, const std::int32_t* tokens, const act_t* dout,
                          float* dwte, float* dwpe) const {
    device("embedding_backward", "tokens, dout, dwte, dwpe", tokens, dout, dwte, dwpe);
    inner_.embedding_backward(a, tokens, dout, dwte, dwpe);
  }
  void dropout(const kernels::DropoutArgs& a, act_t* x) const {
    device("dropout", "x", x);
    inner_.dropout(a, x);
  }
  void gelu_forward(index_t n, const act_t* x, act_t* out) const {
    device("gelu_forward", "x, out", x, out);
    inner_.gelu_forward(n, x, out);
  }
  void gelu_backward(index_t n, const act_t* x, const act_t* dout, act_t* dx) const {
    device("gelu_backward", "x, dout, dx", x, dout, dx);
    inner_.gelu_backward(n, x, dout, dx);
  }
  template <class TA, class TB, class TO>
  void add(index_t n, const TA* a, const TB* b, TO* out) const {
    device("add", "a, b, out", a, b, out);
    inner_.add(n, a, b, out);
  }
  void column_sums(index_t rows, index_t cols, index_t ld, const act_t* x, float* sums) const {
    device("column_sums", "x, sums", x, sums);
    workspace("column_sums", column_sums_workspace(rows, cols));
    inner_.column_sums(rows, cols, ld, x, sums);
  }
  template <class TC, class E>
  void grouped_gemm(std::span<const kernels::GemmGroup<act_t, act_t, TC, E>> groups) const {
    for (const auto& g : groups) {
      device("grouped_gemm", "a, b, c", g.a, g.b, g.c);
      check_epilogue(g.ep, "grouped_gemm epilogue");
    }
    inner_.grouped_gemm(groups);
  }
  void moe_route_forward(const kernels::MoeRouteArgs& a, const float* logits, float* probs, float* lse,
                         std::int32_t* expert, float* gate, std::int32_t* routed, float* prob_sums) const {
    device("moe_route_forward", "logits, probs, lse, expert, gate, routed, prob_sums", logits, probs, lse, expert, gate,
           routed, prob_sums);
    inner_.moe_route_forward(a, logits, probs, lse, expert, gate, routed, prob_sums);
  }
  void moe_dispatch_plan(index_t rows, int topk, index_t experts, index_t capacity, const std::int32_t* expert,
                         std::int32_t* slot, std::int32_t* source_row, std::int32_t* kept) const {
    device("moe_dispatch_plan", "expert, slot, source_row, kept", expert, slot, source_row, kept);
    workspace("moe_dispatch_plan", moe_dispatch_plan_workspace(rows, topk, experts));
    inner_.moe_dispatch_plan(rows, topk, experts, capacity, expert, slot, source_row, kept);
  }
  void gather_rows(index_t rows, index_t cols, const act_t* src, const std::int32_t* index, act_t* dst) const {
    device("gather_rows", "src, index, dst", src, index, dst);
    inner_.gather_rows(rows, cols, src, index, dst);
  }
  void moe_combine(index_t rows, int topk, index_t cols, const act_t* y, const std::int32_t* slot, const float* gate,
                   act_t* out, bool accumulate) const {
    device("moe_combine", "y, slot, gate, out", y, slot, gate, out);
    inner_.moe_combine(rows, topk, cols, y, slot, gate, out, accumulate);
  }
  void moe_combine_backward(index_t rows, int topk, index_t cols, const act_t* dout, const act_t* y,
                            const std::int32_t* slot, const float* gate, float* dgate, act_t* dy) const {
    device("moe_combine_backward", "dout, y, slot, gate, dgate, dy", dout, y, slot, gate, dgate, dy);
    inner_.moe_combine_backward(rows, topk, cols, dout, y, slot, gate, dgate, dy);
  }
  void moe_route_backward(const kernels::MoeRouteArgs& a, const float* probs, const float* lse,
                          const std::int32_t* expert, const float* gate, const float* dgate, const float* aux_grad,
                          float z_grad, float* dlogits) const {
    device("moe_route_backward", "probs, lse, expert, gate, dgate, aux_grad, dlogits", probs, lse, expert, gate, dgate,
           aux_grad, dlogits);
    inner_.moe_route_backward(a, probs, lse, expert, gate, dgate, aux_grad, z_grad, dlogits);
  }
  double sum_of_squares(std::span<const std::span<const float>> grads) const {
    for (const auto& g : grads)
      if (!g.empty()) device("sum_of_squares", "grads", g.data());
    workspace("sum_of_squares", sum_of_squares_workspace(grads));
    return inner_.sum_of_squares(grads);
  }
  double sum(const float* x, std::size_t n) const {
    if (n) device("sum", "x", x);
    return inner_.sum(x, n);
  }
  void adamw(std::span<const kernels::AdamWTensor<float>> tensors, const kernels::AdamWConfig& cfg,
             std::int64_t step, float grad_scale) const {
    for (const auto& t : tensors)
      if (!t.param.empty()) device("adamw", "param, grad, m, v", t.param.data(), t.grad.data(), t.m.data(), t.v.data());
    inner_.adamw(tensors, cfg, step, grad_scale);
  }

 private:
  // Each non-null pointer must lie in this backend's memory; `names` lists the arguments in order.
  template <class... P>
  void device(const char* kernel, const char* names, const P*... ptrs) const {
    const void* args[] = {static_cast<const void*>(ptrs)...};
    for (std::size_t i = 0; i < sizeof...(P); ++i)
      if (args[i] != nullptr && !registry_->contains(args[i]))
        TRELLIS_THROW("backend::DeviceChecked: ", kernel, " argument ", i + 1, " of (", names,
                      ") is not backend memory (a host pointer given to a device kernel)");
  }
  void workspace(const char* kernel, std::size_t bytes) const {
    TRELLIS_CHECK(bytes <= registry_->reserved(), "backend::DeviceChecked: ", kernel, " needs ", bytes,
                  " bytes of workspace but ", registry_->reserved(),
                  " are reserved: call reserve_workspace() with the largest *_workspace() query at set-up");
  }
  static index_t row_blocks(index_t rows) { return (rows + 63) / 64; }
  static std::size_t or_stand_in(std::size_t inner_bytes, index_t floats) {
    return inner_bytes > 0 ? inner_bytes : static_cast<std::size_t>(floats) * sizeof(float);
  }
  template <class P>
  void host(const char* what, const char* arg, const P* p) const {
    TRELLIS_CHECK(!registry_->contains(p), "backend::DeviceChecked: ", what, " ", arg,
                  " is backend memory, expected a host pointer");
  }
  template <class E>
  void check_epilogue(const E& ep, const char* kernel = "gemm epilogue") const {
    if constexpr (requires { ep.bias; }) device(kernel, "bias", ep.bias);
    if constexpr (requires { ep.pre_activation; }) device(kernel, "pre_activation", ep.pre_activation);
    if constexpr (requires { ep.bias_grad; }) device(kernel, "bias_grad", ep.bias_grad);
  }

  Inner inner_;
  std::shared_ptr<DeviceRegistry> registry_;
};

static_assert(Backend<DeviceChecked<Host<float>>> && Backend<DeviceChecked<Host<bfloat16>>>);

}  // namespace trellis::backend
