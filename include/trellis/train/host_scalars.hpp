// Host values over a communicator whose buffers may live in device memory (NCCL reduces device
// buffers only): each collective is staged through the compute backend's memory. What a trainer's
// loss and norm scalars and the checkpoint agreement (save_collectively,
// open_checkpoint_collectively, agree_on_train_state) need of a communicator.
#pragma once

#include <cstddef>

#include "trellis/backend/backend.hpp"
#include "trellis/comm/communicator.hpp"

namespace trellis::train {

template <backend::Backend B, comm::Communicator C>
struct HostScalars {
  const B* be;
  C* c;
  int rank() const { return c->rank(); }
  int size() const { return c->size(); }
  template <class T>
  void all_reduce(const T* in, T* out, std::size_t n, comm::ReduceOp op) {
    auto staged = be->template allocate<T>(n);
    be->upload(staged.data(), in, n);
    c->all_reduce(staged.data(), staged.data(), n, op);
    be->download(out, staged.data(), n);
  }
  template <class T>
  void all_gather(const T* in, T* out, std::size_t n) {
    const std::size_t total = n * static_cast<std::size_t>(c->size());
    auto staged_in = be->template allocate<T>(n), staged_out = be->template allocate<T>(total);
    be->upload(staged_in.data(), in, n);
    c->all_gather(staged_in.data(), staged_out.data(), n);
    be->download(out, staged_out.data(), total);
  }
  template <class T>
  void broadcast(T* x, std::size_t n, int root) {
    auto staged = be->template allocate<T>(n);
    be->upload(staged.data(), x, n);
    c->broadcast(staged.data(), n, root);
    be->download(x, staged.data(), n);
  }
};

// f(c) for host values (flags, strings, counts): c itself where B's memory is the host's, else c
// through HostScalars.
template <backend::Backend B, comm::Communicator C, class F>
decltype(auto) with_host_comm(const B& be, C& c, F&& f) {
  if constexpr (B::host_readable) {
    return f(c);
  } else {
    HostScalars<B, C> staged{&be, &c};
    return f(staged);
  }
}

// A host scalar reduced over `c` (staged through B's memory where B's memory is not the host's).
template <backend::Backend B, comm::Communicator C>
double reduce_scalar(const B& be, C& c, double x, comm::ReduceOp op = comm::ReduceOp::sum) {
  double out = 0;
  with_host_comm(be, c, [&](auto& h) { h.all_reduce(&x, &out, 1, op); });
  return out;
}

}  // namespace trellis::train
