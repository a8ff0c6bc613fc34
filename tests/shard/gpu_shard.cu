// shard/ on the device: LocalOps<Cuda>::copy on strided slices against LocalOps<Host>::copy, and
// distribute -> redistribute chains -> full_tensor with Tensor<T, R, Cuda> shards on a one-rank
// mesh whose communicator is a device loopback (cudaMemcpyAsync), against the host tensor. One
// GPU cannot host a multi-rank NCCL communicator; the multi-rank data movement is the same code
// the thread-rank tests check, and this test covers the device packing kernels and streams.
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <chrono>
#include <cstring>
#include <span>
#include <vector>

#include "trellis/comm/communicator.hpp"
#include "trellis/comm/mesh.hpp"
#include "trellis/shard.hpp"
#include "trellis/shard/cuda.cuh"

using namespace trellis;
using namespace trellis::shard;

namespace {

struct LoopbackRequest {
  void wait() {}
  bool test() { return true; }
};

// One rank, device buffers: every collective is a device-to-device copy on the default stream.
struct DeviceLoopbackComm {
  using request_type = LoopbackRequest;
  using space = trellis::Cuda;
  int* calls;
  int rank() const { return 0; }
  int size() const { return 1; }
  template <class T> static void copy(const T* in, T* out, std::size_t n) {
    if (n && in != out)
      TRELLIS_CHECK_CUDA(cudaMemcpyAsync(out, in, n * sizeof(T), cudaMemcpyDeviceToDevice, nullptr));
  }
  template <class T> void all_reduce(const T* in, T* out, std::size_t n, comm::ReduceOp) { ++*calls; copy(in, out, n); }
  template <class T> void reduce(const T* in, T* out, std::size_t n, comm::ReduceOp, int) { copy(in, out, n); }
  template <class T> void broadcast(T*, std::size_t, int) { ++*calls; }
  template <class T> void all_gather(const T* in, T* out, std::size_t n) { ++*calls; copy(in, out, n); }
  template <class T> void reduce_scatter(const T* in, T* out, std::size_t n, comm::ReduceOp) { ++*calls; copy(in, out, n); }
  template <class T> void all_to_all(const T* in, T* out, std::size_t n) { ++*calls; copy(in, out, n); }
  template <class T>
  void all_to_allv(const T* in, std::span<const std::size_t> sc, std::span<const std::size_t> sd, T* out,
                   std::span<const std::size_t>, std::span<const std::size_t> rd) {
    ++*calls;
    copy(in + sd[0], out + rd[0], sc[0]);
  }
  template <class T> void send(const T*, std::size_t, int, int) {}
  template <class T> void recv(T*, std::size_t, int, int) {}
  void barrier() {}
  template <class T> LoopbackRequest all_reduce_async(const T* in, T* out, std::size_t n, comm::ReduceOp op) { all_reduce(in, out, n, op); return {}; }
  template <class T> LoopbackRequest all_gather_async(const T* in, T* out, std::size_t n) { all_gather(in, out, n); return {}; }
  template <class T> LoopbackRequest reduce_scatter_async(const T* in, T* out, std::size_t n, comm::ReduceOp op) { reduce_scatter(in, out, n, op); return {}; }
  template <class T> LoopbackRequest isend(const T*, std::size_t, int, int) { return {}; }
  template <class T> LoopbackRequest irecv(T*, std::size_t, int, int) { return {}; }
  LoopbackRequest batch(std::span<const comm::P2POp>) { return {}; }
  DeviceLoopbackComm split(int, int) { return {calls}; }
  void set_timeout(std::chrono::milliseconds) {}
};
static_assert(comm::Communicator<DeviceLoopbackComm>);

template <int R>
Tensor<float, R, Cuda> to_device(const Tensor<float, R>& h) {
  Tensor<float, R, Cuda> d(h.shape());
  if (h.size()) TRELLIS_CHECK_CUDA(cudaMemcpy(d.data(), h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice));
  return d;
}
template <int R>
Tensor<float, R> to_host(const Tensor<float, R, Cuda>& d) {
  Tensor<float, R> h(d.shape());
  TRELLIS_CHECK_CUDA(cudaDeviceSynchronize());
  if (h.size()) TRELLIS_CHECK_CUDA(cudaMemcpy(h.data(), d.data(), h.size() * sizeof(float), cudaMemcpyDeviceToHost));
  return h;
}

}  // namespace

TEST_CASE("LocalOps<Cuda>::copy of strided slices equals the host copy", "[gpu][shard]") {
  Tensor<float, 3> h({5, 6, 7});
  for (index_t i = 0; i < h.size(); ++i) h.data()[i] = static_cast<float>(i) * 0.5f - 3.0f;
  auto d = to_device<3>(h);
  struct Box { int dim; index_t b, e; };
  for (Box box : {Box{0, 1, 4}, Box{1, 2, 5}, Box{2, 3, 7}, Box{2, 0, 0}}) {
    auto hs = h.view().slice(box.dim, box.b, box.e);
    Tensor<float, 3> want(hs.extents().array());
    LocalOps<Host>::copy(hs, want.view());
    Tensor<float, 3, Cuda> got_d(hs.extents().array());
    LocalOps<Cuda>::copy(d.view().slice(box.dim, box.b, box.e), got_d.view());
    auto got = to_host<3>(got_d);
    REQUIRE(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) == 0);
    // And into a strided destination (the unpack direction).
    Tensor<float, 3, Cuda> back_d(h.shape());
    LocalOps<Cuda>::copy(got_d.view(), back_d.view().slice(box.dim, box.b, box.e));
    auto back = to_host<3>(back_d);
    for (index_t i = 0; i < back.size(); ++i) {
      auto idx = std::array<index_t, 3>{i / 42, (i / 7) % 6, i % 7};
      const bool inside = idx[box.dim] >= box.b && idx[box.dim] < box.e;
      REQUIRE(back.data()[i] == (inside ? h.data()[i] : 0.0f));
    }
  }
}

TEST_CASE("distribute, redistribute chains and full_tensor with device shards", "[gpu][shard]") {
  int calls = 0;
  DeviceLoopbackComm world{&calls};
  auto mesh = make_mesh<dp, tp>(world, {1, 1});
  Tensor<float, 2> h({5, 7});
  for (index_t i = 0; i < h.size(); ++i) h.data()[i] = static_cast<float>(i % 13) - 6.0f;
  auto d = to_device<2>(h);
  auto x = distribute<Shard<1>, Partial<>>(mesh, d.view());
  auto a = redistribute<Shard<0>, Replicate>(x);  // all_to_all (packing kernels) + all_reduce
  auto b = redistribute<Replicate, Shard<1>>(a);  // all_gather along 0 + slice
  auto c = redistribute<Shard<1>, Shard<0>>(b);   // nested/crossed: several steps
  auto e = redistribute<Partial<ReduceOp::max>, Shard<1>>(c);
  Tensor<float, 2, Cuda> full_d = full_tensor(e);
  auto full = to_host<2>(full_d);
  REQUIRE(full.shape() == h.shape());
  REQUIRE(std::memcmp(full.data(), h.data(), h.size() * sizeof(float)) == 0);
  REQUIRE(calls > 5);
  // Same placements: no collective.
  const int before = calls;
  auto same = redistribute<Partial<ReduceOp::max>, Shard<1>>(e);
  REQUIRE(calls == before);
  REQUIRE(to_host<2>(same.local()).shape() == e.local().shape());
}
