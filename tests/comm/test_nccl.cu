// NcclComm on the GPUs of one process (skipped, exit 77, without a CUDA device):
//  - one-rank communicator semantics for every collective, compared with the host formula
//    (a one-rank reduction is the input itself; avg divides by one);
//  - stream ordering: work enqueued before and after a collective on the communicator's stream,
//    and a second stream ordered after it only through NcclRequest::wait_on;
//  - async handles (test until done, wait), batches of self send/recv, split, argument errors;
//  - with two or more GPUs: a two-rank all_reduce / all_gather driven from two threads.
#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <thread>
#include <vector>

#include "trellis/comm/nccl.hpp"
#include "trellis/core/check_cuda.hpp"

using trellis::comm::NcclComm;
using trellis::comm::P2POp;
using trellis::comm::ReduceOp;

namespace {

template <class T>
struct DeviceArray {
  T* ptr = nullptr;
  std::size_t n = 0;
  explicit DeviceArray(std::size_t count) : n(count) {
    TRELLIS_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&ptr), count * sizeof(T)));
  }
  ~DeviceArray() { cudaFree(ptr); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  void upload(const std::vector<T>& host) {
    TRELLIS_CHECK_CUDA(cudaMemcpy(ptr, host.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(n);
    TRELLIS_CHECK_CUDA(cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
};

template <class T>
std::vector<T> ramp(std::size_t n, int offset) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<T>(static_cast<float>((static_cast<int>(i) + offset) % 17 - 8));
  return v;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

NcclComm one_rank() {
  std::array<int, 1> devices{0};
  auto comms = NcclComm::init_all(devices, "one");
  return std::move(comms[0]);
}

}  // namespace

TEMPLATE_TEST_CASE("one-rank NcclComm: every reduction returns its input", "[nccl]", float, double, trellis::half,
                   trellis::bfloat16, std::int8_t, std::int32_t, std::uint64_t) {
  using T = TestType;
  NcclComm comm = one_rank();
  REQUIRE(comm.rank() == 0);
  REQUIRE(comm.size() == 1);
  const std::size_t n = 1000;
  const auto host = ramp<T>(n, 3);
  DeviceArray<T> in(n), out(n);
  in.upload(host);
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::min, ReduceOp::max, ReduceOp::prod}) {
    INFO("op " << trellis::comm::reduce_op_name(op));
    TRELLIS_CHECK_CUDA(cudaMemsetAsync(out.ptr, 0, n * sizeof(T), comm.stream()));
    comm.all_reduce(in.ptr, out.ptr, n, op);
    comm.synchronize();
    REQUIRE(same_bits(out.download(), host));

    TRELLIS_CHECK_CUDA(cudaMemsetAsync(out.ptr, 0, n * sizeof(T), comm.stream()));
    comm.reduce(in.ptr, out.ptr, n, op, 0);
    comm.reduce_scatter(in.ptr, out.ptr, n, op);
    comm.synchronize();
    REQUIRE(same_bits(out.download(), host));
  }
}

TEST_CASE("one-rank NcclComm: movement, batches, split and errors", "[nccl]") {
  NcclComm comm = one_rank();
  const std::size_t n = 4096;
  const auto host = ramp<float>(n, 5);
  DeviceArray<float> a(n), b(n);
  a.upload(host);

  comm.all_gather(a.ptr, b.ptr, n);
  comm.synchronize();
  REQUIRE(b.download() == host);

  TRELLIS_CHECK_CUDA(cudaMemsetAsync(b.ptr, 0, n * sizeof(float), comm.stream()));
  comm.all_to_all(a.ptr, b.ptr, n);
  comm.broadcast(b.ptr, n, 0);
  comm.synchronize();
  REQUIRE(b.download() == host);

  // Self send/recv inside one group.
  TRELLIS_CHECK_CUDA(cudaMemsetAsync(b.ptr, 0, n * sizeof(float), comm.stream()));
  std::array<P2POp, 2> ops{P2POp{P2POp::Kind::send, a.ptr, n, trellis::DType::f32, 0},
                           P2POp{P2POp::Kind::recv, b.ptr, n, trellis::DType::f32, 0}};
  comm.batch(ops).wait();
  REQUIRE(b.download() == host);

  NcclComm sub = comm.split(0, 0);
  REQUIRE(sub.size() == 1);
  REQUIRE(sub.label() == "one/split(0)");
  TRELLIS_CHECK_CUDA(cudaMemsetAsync(b.ptr, 0, n * sizeof(float), sub.stream()));
  sub.all_reduce(a.ptr, b.ptr, n, ReduceOp::sum);
  sub.barrier();
  REQUIRE(b.download() == host);

  // A negative color takes part and joins nothing (the only rank: nobody joins).
  REQUIRE_FALSE(comm.split_or_none(-1, 0).has_value());
  auto again = comm.split_or_none(3, 0);
  REQUIRE(again.has_value());
  REQUIRE(again->size() == 1);
  CHECK_THROWS_WITH(comm.split(-1, 0), Catch::Contains("split_or_none"));

  CHECK_THROWS_WITH(comm.broadcast(a.ptr, n, 1), Catch::Contains("broadcast: root 1 is not a rank"));
  CHECK_THROWS_WITH(comm.send(a.ptr, n, -1), Catch::Contains("send: peer -1 is not a rank"));
  CHECK_THROWS_WITH(comm.all_to_all(a.ptr, a.ptr, n), Catch::Contains("separate input and output"));
  REQUIRE(comm.recorder().calls() > 0);
}

TEST_CASE("NcclComm: stream ordering and async handles", "[nccl]") {
  NcclComm comm = one_rank();
  const std::size_t n = 1 << 20;
  std::vector<std::int32_t> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<std::int32_t>(i * 7);
  DeviceArray<std::int32_t> a(n), b(n), c(n);
  a.upload(host);

  // Before: a memset on the same stream is overwritten by the all_reduce enqueued after it.
  TRELLIS_CHECK_CUDA(cudaMemsetAsync(b.ptr, 0xff, n * sizeof(std::int32_t), comm.stream()));
  auto request = comm.all_reduce_async(a.ptr, b.ptr, n, ReduceOp::max);
  // After, on another stream: ordered only through the request's event.
  cudaStream_t other = nullptr;
  TRELLIS_CHECK_CUDA(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  request.wait_on(other);
  TRELLIS_CHECK_CUDA(cudaMemcpyAsync(c.ptr, b.ptr, n * sizeof(std::int32_t), cudaMemcpyDeviceToDevice, other));
  TRELLIS_CHECK_CUDA(cudaStreamSynchronize(other));
  REQUIRE(c.download() == host);
  while (!request.test()) std::this_thread::yield();
  REQUIRE(request.test());
  request.wait();  // released already: returns at once

  // A user stream set on the communicator.
  comm.set_stream(other);
  REQUIRE(comm.stream() == other);
  TRELLIS_CHECK_CUDA(cudaMemsetAsync(c.ptr, 0, n * sizeof(std::int32_t), other));
  auto gather = comm.all_gather_async(a.ptr, c.ptr, n);
  gather.wait();
  REQUIRE(c.download() == host);
  auto scatter = comm.reduce_scatter_async(a.ptr, b.ptr, n, ReduceOp::sum);
  scatter.wait();
  REQUIRE(b.download() == host);
  comm.synchronize();
  TRELLIS_CHECK_CUDA(cudaStreamDestroy(other));
}

namespace {
// Keeps its stream busy for about `ns` nanoseconds (a stand-in for a layer's kernel).
__global__ void spin_kernel(long long ns) {
  long long start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

TEST_CASE("NcclComm overlap mode: ordered after the compute stream, which waits at wait(); the host never blocks",
          "[nccl][overlap]") {
  NcclComm comm = one_rank();
  cudaStream_t compute = nullptr;
  TRELLIS_CHECK_CUDA(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  comm.set_compute_stream(compute);
  REQUIRE(comm.compute_stream() == compute);
  REQUIRE(comm.stream() != compute);  // a communication stream of its own
  const std::size_t n = 1 << 22;
  std::vector<std::int32_t> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<std::int32_t>(i % 1001);
  DeviceArray<std::int32_t> a(n), b(n), c(n);
  TRELLIS_CHECK_CUDA(cudaMemset(a.ptr, 0, n * sizeof(std::int32_t)));
  TRELLIS_CHECK_CUDA(cudaMemset(b.ptr, 0, n * sizeof(std::int32_t)));

  // The producer runs on `compute` behind a 300 ms kernel; the all-reduce must read its data.
  const auto t0 = std::chrono::steady_clock::now();
  spin_kernel<<<1, 1, 0, compute>>>(300'000'000LL);
  TRELLIS_CHECK_CUDA(cudaMemcpyAsync(a.ptr, host.data(), n * sizeof(std::int32_t), cudaMemcpyHostToDevice, compute));
  auto request = comm.all_reduce_async(a.ptr, b.ptr, n, ReduceOp::sum);
  request.wait();  // the compute stream waits; the host does not
  const double host_wait = seconds_since(t0);
  TRELLIS_CHECK_CUDA(cudaMemcpyAsync(c.ptr, b.ptr, n * sizeof(std::int32_t), cudaMemcpyDeviceToDevice, compute));
  TRELLIS_CHECK_CUDA(cudaStreamSynchronize(compute));
  CHECK(host_wait < 0.15);  // legacy wait() would block about 0.3 s here
  CHECK(c.download() == host);

  // A blocking call: the next kernel on `compute` sees its result.
  TRELLIS_CHECK_CUDA(cudaMemsetAsync(c.ptr, 0, n * sizeof(std::int32_t), compute));
  comm.all_reduce(a.ptr, b.ptr, n, ReduceOp::max);
  TRELLIS_CHECK_CUDA(cudaMemcpyAsync(c.ptr, b.ptr, n * sizeof(std::int32_t), cudaMemcpyDeviceToDevice, compute));
  TRELLIS_CHECK_CUDA(cudaStreamSynchronize(compute));
  CHECK(c.download() == host);

  // The communication stream does not serialise with `compute` (non-blocking, no implicit
  // synchronisation): 200 ms of work on each ends well before 400 ms.
  std::vector<double> single, both;
  for (int rep = 0; rep < 3; ++rep) {
    auto t = std::chrono::steady_clock::now();
    spin_kernel<<<1, 1, 0, comm.stream()>>>(200'000'000LL);  // the transfer's stand-in, on the comm stream
    spin_kernel<<<1, 1, 0, compute>>>(200'000'000LL);
    TRELLIS_CHECK_CUDA(cudaStreamSynchronize(comm.stream()));
    TRELLIS_CHECK_CUDA(cudaStreamSynchronize(compute));
    both.push_back(seconds_since(t));
  }
  CHECK(*std::min_element(both.begin(), both.end()) < 0.3);  // serial would take 0.4 s

  // split: the child keeps overlap mode with a stream of its own.
  NcclComm child = comm.split(0, 0);
  CHECK(child.compute_stream() == compute);
  CHECK(child.stream() != compute);
  CHECK(child.stream() != comm.stream());
  comm.set_stream(compute);  // back to one stream
  CHECK(comm.compute_stream() == nullptr);
  comm.synchronize();
  TRELLIS_CHECK_CUDA(cudaStreamDestroy(compute));
}

TEST_CASE("NcclComm: two GPUs in one process, one thread each", "[nccl]") {
  int devices = 0;
  TRELLIS_CHECK_CUDA(cudaGetDeviceCount(&devices));
  if (devices < 2) {
    WARN("fewer than two GPUs: two-rank test not run");
    return;
  }
  std::array<int, 2> list{0, 1};
  auto comms = NcclComm::init_all(list, "pair");
  const std::size_t n = 3000;
  std::array<std::vector<float>, 2> gathered, reduced;
  std::array<std::exception_ptr, 2> errors;
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
      TRELLIS_CHECK_CUDA(cudaSetDevice(list[r]));
      NcclComm& comm = comms[r];
      DeviceArray<float> in(n), sum(n), all(2 * n);
      in.upload(ramp<float>(n, r));
      comm.all_reduce(in.ptr, sum.ptr, n, ReduceOp::sum);
      comm.all_gather(in.ptr, all.ptr, n);
      comm.synchronize();
      reduced[r] = sum.download();
      gathered[r] = all.download();
      } catch (...) {
      errors[r] = std::current_exception();
     }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  const auto r0 = ramp<float>(n, 0), r1 = ramp<float>(n, 1);
  for (int r = 0; r < 2; ++r) {
    for (std::size_t i = 0; i < n; ++i) {
      REQUIRE(reduced[r][i] == r0[i] + r1[i]);
      REQUIRE(gathered[r][i] == r0[i]);
      REQUIRE(gathered[r][n + i] == r1[i]);
    }
  }
}
