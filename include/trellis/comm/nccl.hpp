// NcclComm: the Communicator over NCCL, for device buffers on CUDA streams.
//
// How it maps onto NCCL:
//  - every operation is enqueued on the communicator's current stream (set_stream) and returns
//    at once: "blocking" calls are stream-ordered, as in NCCL itself. The *_async forms also
//    record a CUDA event and return an NcclRequest: wait() blocks the host until the event
//    completes (polling cudaEventQuery with the timeout, NCCL's asynchronous errors checked),
//    wait_on(stream) makes another stream wait for it without blocking the host, test() polls.
//  - batch() is one ncclGroupStart/End of ncclSend/ncclRecv; all_to_all(v) likewise (rank-ordered
//    pairs), so it works on every NCCL version.
//  - avg is ncclAvg; half/bfloat16 are ncclFloat16/ncclBfloat16 (NCCL reduces 16-bit data in its
//    own order and precision, so results may differ from the thread backend in the last bits;
//    float avg is computed by NCCL as a pre-multiplied sum).
//  - split is ncclCommSplit; a new communicator keeps the parent's stream, timeout and debug mode
//    (in overlap mode: the parent's compute stream, and a communication stream of its own).
//  - NCCL has no tags: point-to-point messages between a pair of ranks match in issue order; the
//    tag argument is accepted (for the common API) and ignored.
//  - debug mode (TRELLIS_COMM_DEBUG=1 or set_debug(true)) all-gathers each rank's OpFingerprint
//    through NCCL itself before each collective and compares them on the host (one stream
//    synchronisation per call): a mismatch raises on every rank naming the odd rank and both
//    calls. A rank that never arrives makes that exchange time out; NCCL gives no partial view,
//    so the missing rank is not named.
//  - on a timeout the communicator is aborted (ncclCommAbort) and unusable from then on.
//  - each operation's enqueue is an NVTX range, "nccl all_reduce 4718592 B (tp)" (kind, bytes,
//    label), so Nsight Systems shows which layer issued which collective next to its kernels.
//  - overlap mode (set_compute_stream(compute)), how a trainer overlaps communication with compute
//    on a GPU: operations run on the communicator's own high-priority stream, each ordered after
//    what `compute` holds when it is issued (an event); a blocking call makes `compute` wait for
//    it, so the caller's later kernels still see its result; an async call's wait() makes
//    `compute` wait for it and returns at once: the host never blocks, and kernels enqueued
//    between the call and its wait() run beside the transfer. Errors and timeouts of work waited
//    for this way surface at the next host synchronisation (synchronize, barrier, a download).
// Bootstrap: NcclComm::bootstrap(any_communicator, device) broadcasts the ncclUniqueId over an
// existing communicator (e.g. MpiComm, one process per GPU), or NcclComm::init_all(devices)
// builds one communicator per local GPU in one process (ncclCommInitAll; drive them from one
// thread each, or inside one NcclGroup).
// Needs CUDA and NCCL (the header's name contains "nccl": built only with trellis::nccl).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <source_location>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "trellis/comm/communicator.hpp"
#include "trellis/comm/recorder.hpp"
#include "trellis/core/check_cuda.hpp"
#include "trellis/core/check_nccl.hpp"
#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"

namespace trellis::comm {

namespace detail {

inline ncclDataType_t nccl_datatype(DType t) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::f16: return ncclFloat16;
    case DType::bf16: return ncclBfloat16;
    case DType::i8: return ncclInt8;
    case DType::u8: return ncclUint8;
    case DType::i32: return ncclInt32;
    case DType::u32: return ncclUint32;
    case DType::i64: return ncclInt64;
    case DType::u64: return ncclUint64;
  }
  TRELLIS_THROW("no NCCL datatype for dtype ", static_cast<int>(t));
}

inline ncclRedOp_t nccl_reduce_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return ncclAvg;
    case ReduceOp::min: return ncclMin;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::prod: return ncclProd;
  }
  TRELLIS_THROW("unknown reduce op ", static_cast<int>(op));
}

inline bool nccl_env_debug() {
  const char* v = std::getenv("TRELLIS_COMM_DEBUG");
  return v && *v && std::strcmp(v, "0") != 0;
}

// TRELLIS_COMM_TIMEOUT_MS, or 60 s (as the thread backend); 0 (or less) switches the timeout off.
inline std::chrono::milliseconds nccl_env_timeout() {
  if (const char* v = std::getenv("TRELLIS_COMM_TIMEOUT_MS"); v && *v) {
    char* end = nullptr;
    long long ms = std::strtoll(v, &end, 10);
    if (end && *end == '\0') return std::chrono::milliseconds(ms);
  }
  return std::chrono::seconds(60);
}

// Makes `device` current for its scope (events and scratch memory belong to one device).
class NcclDeviceScope {
 public:
  explicit NcclDeviceScope(int device) {
    TRELLIS_CHECK_CUDA(cudaGetDevice(&previous_));
    if (previous_ != device) TRELLIS_CHECK_CUDA(cudaSetDevice(device));
  }
  ~NcclDeviceScope() { cudaSetDevice(previous_); }
  NcclDeviceScope(const NcclDeviceScope&) = delete;
  NcclDeviceScope& operator=(const NcclDeviceScope&) = delete;

 private:
  int previous_ = 0;
};

// The state of one NcclComm, shared with its requests.
struct NcclCommState {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;        // where operations are enqueued now (set_stream may change it)
  cudaStream_t owned_stream = nullptr;  // the stream this communicator created, destroyed with it
  bool owns_stream = false;
  cudaStream_t compute = nullptr;       // overlap mode: the stream operations are ordered after
  cudaStream_t side_stream = nullptr;   // overlap mode: the communication stream (created here)
  int rank = 0;
  int size = 1;
  int device = 0;
  FlightRecorder recorder;
  bool debug = false;
  std::chrono::milliseconds timeout{0};
  std::uint64_t collectives = 0;
  std::string failure;
  void* scratch = nullptr;  // device: barrier word and fingerprint exchange (size+1 fingerprints)

  NcclCommState() = default;
  NcclCommState(const NcclCommState&) = delete;
  NcclCommState& operator=(const NcclCommState&) = delete;

  ~NcclCommState() {
    if (!comm && !scratch && !owns_stream && !side_stream) return;
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device);
    if (comm) {
      if (failure.empty()) {
        ncclCommDestroy(comm);
      } else {
        ncclCommAbort(comm);
      }
    }
    if (scratch) cudaFree(scratch);
    // Destroy only the stream we created: a stream given by set_stream belongs to the caller.
    if (owns_stream && owned_stream) cudaStreamDestroy(owned_stream);
    if (side_stream) cudaStreamDestroy(side_stream);
    cudaSetDevice(previous);
  }

  void check_usable() const {
    if (!failure.empty()) [[unlikely]]
      TRELLIS_THROW("NCCL communicator '", recorder.label(), "' is unusable after an earlier failure: ", failure);
  }

  std::string where() const {
    std::ostringstream out;
    out << "on rank " << rank << " of " << size << " of NCCL communicator '" << recorder.label()
        << "' (device " << device << ")";
    return out.str();
  }

  // Polls `event` until it completed; raises on NCCL's asynchronous errors and, past the
  // timeout, aborts the communicator and raises.
  void wait_event(cudaEvent_t event, const OpFingerprint& call) {
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    for (int polls = 0;; ++polls) {
      cudaError_t status = cudaEventQuery(event);
      if (status == cudaSuccess) return;
      if (status != cudaErrorNotReady) {
        recorder.failed(call.seq);
        TRELLIS_CHECK_CUDA(status);
      }
      ncclResult_t async = ncclSuccess;
      TRELLIS_CHECK_NCCL(ncclCommGetAsyncError(comm, &async));
      if (async != ncclSuccess && async != ncclInProgress) {
        recorder.failed(call.seq);
        failure = std::string("asynchronous NCCL error ") + ncclGetErrorString(async);
        TRELLIS_THROW(call.describe(), " failed ", where(), ": ", failure, "\n", recorder.dump(8));
      }
      const auto waited = clock::now() - start;
      if (timeout.count() > 0 && waited >= timeout) {
        recorder.failed(call.seq);
        std::ostringstream out;
        out << call.describe() << " timed out after " << timeout.count() << " ms " << where()
            << ": some rank did not arrive or stalled (NCCL gives no per-rank view); the "
               "communicator was aborted and is unusable from now on.\n"
            << recorder.dump(8);
        failure = out.str();
        ncclCommAbort(comm);
        comm = nullptr;
        TRELLIS_THROW(failure);
      }
      if (polls < 64) {
        std::this_thread::yield();
      } else {
        auto us = std::chrono::duration_cast<std::chrono::microseconds>(waited);
        std::this_thread::sleep_for(std::clamp(us / 16, std::chrono::microseconds(20), std::chrono::microseconds(1000)));
      }
    }
  }

  // Records an event on the stream and waits for it on the host.
  void synchronize(const OpFingerprint& call) {
    cudaEvent_t event = nullptr;
    TRELLIS_CHECK_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    struct Destroy {
      cudaEvent_t e;
      ~Destroy() { cudaEventDestroy(e); }
    } destroy{event};
    TRELLIS_CHECK_CUDA(cudaEventRecord(event, stream));
    wait_event(event, call);
  }

  void* scratch_memory() {
    if (!scratch) {
      TRELLIS_CHECK_CUDA(cudaMalloc(&scratch, sizeof(OpFingerprint) * static_cast<std::size_t>(size + 1)));
    }
    return scratch;
  }

  // Debug mode: all-gathers every rank's fingerprint through NCCL and compares on the host.
  void check_fingerprints(const OpFingerprint& call) {
    if (!debug || size == 1) return;
    auto* device_all = static_cast<OpFingerprint*>(scratch_memory());
    std::vector<OpFingerprint> all(static_cast<std::size_t>(size));
    all[static_cast<std::size_t>(rank)] = call;
    TRELLIS_CHECK_CUDA(cudaMemcpyAsync(device_all + rank, &all[static_cast<std::size_t>(rank)],
                                       sizeof(OpFingerprint), cudaMemcpyHostToDevice, stream));
    TRELLIS_CHECK_NCCL(ncclAllGather(device_all + rank, device_all, sizeof(OpFingerprint), ncclUint8, comm, stream));
    TRELLIS_CHECK_CUDA(cudaMemcpyAsync(all.data(), device_all, sizeof(OpFingerprint) * all.size(),
                                       cudaMemcpyDeviceToHost, stream));
    synchronize(call);
    if (auto mismatch = find_fingerprint_mismatch(all)) {
      recorder.failed(call.seq);
      TRELLIS_THROW(*mismatch, " (NCCL communicator '", recorder.label(), "')\n", recorder.dump(8));
    }
  }
};

}  // namespace detail

// A handle to NCCL work enqueued on a stream: a CUDA event recorded right after it.
class NcclRequest {
 public:
  NcclRequest() = default;
  NcclRequest(NcclRequest&& other) noexcept
      : state_(std::move(other.state_)), event_(std::exchange(other.event_, nullptr)), call_(other.call_) {}
  NcclRequest& operator=(NcclRequest&& other) noexcept {
    if (this != &other) {
      release();
      state_ = std::move(other.state_);
      event_ = std::exchange(other.event_, nullptr);
      call_ = other.call_;
    }
    return *this;
  }
  NcclRequest(const NcclRequest&) = delete;
  NcclRequest& operator=(const NcclRequest&) = delete;
  ~NcclRequest() { release(); }

  // Blocks the host until the work completed (with the communicator's timeout); in overlap mode
  // (NcclComm::set_compute_stream) makes the compute stream wait for it instead, at once.
  void wait() {
    if (!event_) return;
    if (state_->compute) {
      TRELLIS_CHECK_CUDA(cudaStreamWaitEvent(state_->compute, event_, 0));
    } else {
      state_->wait_event(event_, call_);
    }
    state_->recorder.completed(call_.seq);
    release();
  }

  // Makes `stream` wait for the work, without blocking the host; the request stays valid.
  void wait_on(cudaStream_t stream) const {
    if (event_) TRELLIS_CHECK_CUDA(cudaStreamWaitEvent(stream, event_, 0));
  }

  // True once the work completed (then the request is released).
  bool test() {
    if (!event_) return true;
    cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) return false;
    TRELLIS_CHECK_CUDA(status);
    state_->recorder.completed(call_.seq);
    release();
    return true;
  }

  cudaEvent_t event() const noexcept { return event_; }

 private:
  friend class NcclComm;
  NcclRequest(std::shared_ptr<detail::NcclCommState> state, cudaEvent_t event, OpFingerprint call)
      : state_(std::move(state)), event_(event), call_(call) {}

  void release() noexcept {
    if (event_) cudaEventDestroy(event_);  // deferred by CUDA until the event completes
    event_ = nullptr;
  }

  std::shared_ptr<detail::NcclCommState> state_;
  cudaEvent_t event_ = nullptr;
  OpFingerprint call_;
};

// ncclGroupStart/End for a scope: several communicators driven from one thread, or several
// operations fused into one launch.
class NcclGroup {
 public:
  NcclGroup() { TRELLIS_CHECK_NCCL(ncclGroupStart()); }
  ~NcclGroup() noexcept(false) {
    if (std::uncaught_exceptions() > uncaught_) {
      ncclGroupEnd();
      return;
    }
    TRELLIS_CHECK_NCCL(ncclGroupEnd());
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

 private:
  int uncaught_ = std::uncaught_exceptions();
};

class NcclComm {
 public:
  using request_type = NcclRequest;
  using space = Cuda;  // buffers are device memory of this communicator's GPU

  // One communicator per listed local GPU, in one process (ncclCommInitAll); each gets its own
  // non-blocking stream on its device.
  static std::vector<NcclComm> init_all(std::span<const int> devices, std::string label = "nccl") {
    TRELLIS_CHECK(!devices.empty(), "init_all needs at least one device");
    std::vector<ncclComm_t> comms(devices.size(), nullptr);
    TRELLIS_CHECK_NCCL(ncclCommInitAll(comms.data(), static_cast<int>(devices.size()), devices.data()));
    std::vector<NcclComm> result;
    result.reserve(devices.size());
    for (std::size_t i = 0; i < devices.size(); ++i) {
      result.push_back(NcclComm(comms[i], devices[i], nullptr, label));
    }
    return result;
  }

  // One process per GPU: rank 0 creates the unique id, `boot` (any Communicator: MpiComm,
  // a thread communicator...) broadcasts it, every rank joins on `device` (collective on boot).
  template <Communicator Boot>
  static NcclComm bootstrap(Boot& boot, int device, std::string label = "nccl") {
    ncclUniqueId id{};
    if (boot.rank() == 0) TRELLIS_CHECK_NCCL(ncclGetUniqueId(&id));
    boot.broadcast(reinterpret_cast<std::uint8_t*>(&id), sizeof(id), 0);
    detail::NcclDeviceScope scope(device);
    ncclComm_t comm = nullptr;
    TRELLIS_CHECK_NCCL(ncclCommInitRank(&comm, boot.size(), id, boot.rank()));
    return NcclComm(comm, device, nullptr, std::move(label));
  }

  // Adopts an initialised ncclComm_t (destroyed with this object). A null stream means: create
  // an own non-blocking stream on `device`.
  NcclComm(ncclComm_t comm, int device, cudaStream_t stream, std::string label = "nccl")
      : state_(std::make_shared<detail::NcclCommState>()) {
    auto& s = *state_;
    s.comm = comm;
    s.device = device;
    TRELLIS_CHECK_NCCL(ncclCommUserRank(comm, &s.rank));
    TRELLIS_CHECK_NCCL(ncclCommCount(comm, &s.size));
    if (stream) {
      s.stream = stream;
    } else {
      detail::NcclDeviceScope scope(device);
      TRELLIS_CHECK_CUDA(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
      s.owned_stream = s.stream;
      s.owns_stream = true;
    }
    s.recorder.identify(std::move(label), s.rank, s.size);
    s.debug = detail::nccl_env_debug();
    s.timeout = detail::nccl_env_timeout();
  }

  NcclComm(NcclComm&&) noexcept = default;
  NcclComm& operator=(NcclComm&&) noexcept = default;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;
  ~NcclComm() = default;

  int rank() const { return state_->rank; }
  int size() const { return state_->size; }
  int device() const { return state_->device; }
  ncclComm_t native() const { return state_->comm; }
  const std::string& label() const { return state_->recorder.label(); }
  const FlightRecorder& recorder() const { return state_->recorder; }

  // The stream every later operation is enqueued on (the caller keeps it alive). Ends overlap mode.
  void set_stream(cudaStream_t stream) {
    state_->stream = stream;
    state_->compute = nullptr;
  }
  cudaStream_t stream() const { return state_->stream; }

  // Overlap mode (see the header comment): operations on a high-priority stream of this
  // communicator's own, ordered after `compute`, which waits for them at blocking calls and at
  // wait(). nullptr ends it (operations go on stream() as before, wait() blocks the host).
  void set_compute_stream(cudaStream_t compute) {
    auto& s = *state_;
    if (!compute) {
      if (s.compute) s.stream = s.compute;  // back to one stream: the compute stream
      s.compute = nullptr;
      return;
    }
    if (!s.side_stream) {
      detail::NcclDeviceScope scope(s.device);
      int least = 0, greatest = 0;
      TRELLIS_CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&least, &greatest));
      TRELLIS_CHECK_CUDA(cudaStreamCreateWithPriority(&s.side_stream, cudaStreamNonBlocking, greatest));
    }
    s.stream = s.side_stream;
    s.compute = compute;
  }
  cudaStream_t compute_stream() const { return state_->compute; }

  void set_debug(bool on) { state_->debug = on; }
  bool debug() const { return state_->debug; }
  void set_timeout(std::chrono::milliseconds timeout) { state_->timeout = timeout; }
  std::chrono::milliseconds timeout() const { return state_->timeout; }

  // Blocks the host until everything enqueued on the current stream so far completed.
  void synchronize(std::source_location where = std::source_location::current()) {
    auto call = begin(OpKind::barrier, DType::u8, 0, -1, ReduceOp::sum, where, false);
    detail::NcclDeviceScope scope(state_->device);
    state_->synchronize(call);
    nvtxRangePop();
    state_->recorder.completed(call.seq);
  }

  // ---- collectives (device pointers; stream-ordered) ---------------------------------------

  template <Element T>
  void all_reduce(const T* in, T* out, std::size_t n, ReduceOp op,
                  std::source_location where = std::source_location::current()) {
    auto call = begin(OpKind::all_reduce, dtype_v<T>, n, -1, op, where, true);
    TRELLIS_CHECK_NCCL(ncclAllReduce(in, out, n, detail::nccl_datatype(dtype_v<T>), detail::nccl_reduce_op(op), comm(), stream()));
    enqueued(call);
  }
  template <Element T>
  NcclRequest all_reduce_async(const T* in, T* out, std::size_t n, ReduceOp op,
                               std::source_location where = std::source_location::current()) {
    auto call = begin(OpKind::all_reduce, dtype_v<T>, n, -1, op, where, true);
    TRELLIS_CHECK_NCCL(ncclAllReduce(in, out, n, detail::nccl_datatype(dtype_v<T>), detail::nccl_reduce_op(op), comm(), stream()));
    return make_request(call);
  }

  template <Element T>
  void reduce(const T* in, T* out, std::size_t n, ReduceOp op, int root,
              std::source_location where = std::source_location::current()) {
    check_rank(root, "reduce: root");
    auto call = begin(OpKind::reduce, dtype_v<T>, n, root, op, where, true);
    TRELLIS_CHECK_NCCL(ncclReduce(in, out, n, detail::nccl_datatype(dtype_v<T>), detail::nccl_reduce_op(op), root, comm(), stream()));
    enqueued(call);
  }

  template <Element T>
  void broadcast(T* buffer, std::size_t n, int root,
                 std::source_location where = std::source_location::current()) {
    check_rank(root, "broadcast: root");
    auto call = begin(OpKind::broadcast, dtype_v<T>, n, root, ReduceOp::sum, where, true);
    TRELLIS_CHECK_NCCL(ncclBroadcast(buffer, buffer, n, detail::nccl_datatype(dtype_v<T>), root, comm(), stream()));
    enqueued(call);
  }

  template <Element T>
  void all_gather(const T* in, T* out, std::size_t n,
                  std::source_location where = std::source_location::current()) {
    auto call = begin(OpKind::all_gather, dtype_v<T>, n, -1, ReduceOp::sum, where, true);
    TRELLIS_CHECK_NCCL(ncclAllGather(in, out, n, detail::nccl_datatype(dtype_v<T>), comm(), stream()));
    enqueued(call);
  }
  template <Element T>
  NcclRequest all_gather_async(const T* in, T* out, std::size_t n,
                               std::source_location where = std::source_location::current()) {
    auto call = begin(OpKind::all_gather, dtype_v<T>, n, -1, ReduceOp::sum, where, true);
    TRELLIS_CHECK_NCCL(ncclAllGather(in, out, n, detail::nccl_datatype(dtype_v<T>), comm(), stream()));
    return make_request(call);
  }

  template <Element T>
  void reduce_scatter(const T* in, T* out, std::size_t n, ReduceOp op,
                      std::source_location where = std::source_location::current()) {
    auto call = begin(OpKind::reduce_scatter, dtype_v<T>, n, -1, op, where, true);
    TRELLIS_CHECK_NCCL(ncclReduceScatter(in, out, n, detail::nccl_datatype(dtype_v<T>), detail::nccl_reduce_op(op), comm(), stream()));
    enqueued(call);
  }
  template <Element T>
  NcclRequest reduce_scatter_async(const T* in, T* out, std::size_t n, ReduceOp op,
                                   std::source_location where = std::source_location::current()) {
    auto call = begin(OpKind::reduce_scatter, dtype_v<T>, n, -1, op, where, true);
    TRELLIS_CHECK_NCCL(ncclReduceScatter(in, out, n, detail::nccl_datatype(dtype_v<T>), detail::nccl_reduce_op(op), comm(), stream()));
    return make_request(call);
  }

  // Block j of `in` goes to rank j's block rank(); `in` and `out` must not overlap.
  template <Element T>
  void all_to_all(const T* in, T* out, std::size_t n,
                  std::source_location where = std::source_location::current()) {
    const std::size_t total = n * static_cast<std::size_t>(size());
    TRELLIS_CHECK(n == 0 || in + total <= out || out + total <= in,
                  "all_to_all on NCCL needs separate input and output buffers");
    auto call = begin(OpKind::all_to_all, dtype_v<T>, n, -1, ReduceOp::sum, where, true);
    const ncclDataType_t type = detail::nccl_datatype(dtype_v<T>);
    {
      NcclGroup group;
      for (int peer = 0; peer < size(); ++peer) {
        const std::size_t offset = n * static_cast<std::size_t>(peer);
        TRELLIS_CHECK_NCCL(ncclSend(in + offset, n, type, peer, comm(), stream()));
        TRELLIS_CHECK_NCCL(ncclRecv(out + offset, n, type, peer, comm(), stream()));
      }
    }
    enqueued(call);
  }

  template <Element T>
  void all_to_allv(const T* in, std::span<const std::size_t> send_counts,
                   std::span<const std::size_t> send_displs, T* out,
                   std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs,
                   std::source_location where = std::source_location::current()) {
    const auto n = static_cast<std::size_t>(size());
    TRELLIS_CHECK(send_counts.size() == n && send_displs.size() == n && recv_counts.size() == n &&
                      recv_displs.size() == n,
                  "all_to_allv: counts and displacements need one entry per rank (", n, ")");
    auto call = begin(OpKind::all_to_allv, dtype_v<T>, 0, -1, ReduceOp::sum, where, true);
    const ncclDataType_t type = detail::nccl_datatype(dtype_v<T>);
    {
      NcclGroup group;
      for (std::size_t peer = 0; peer < n; ++peer) {
        if (send_counts[peer])
          TRELLIS_CHECK_NCCL(ncclSend(in + send_displs[peer], send_counts[peer], type, static_cast<int>(peer), comm(), stream()));
        if (recv_counts[peer])
          TRELLIS_CHECK_NCCL(ncclRecv(out + recv_displs[peer], recv_counts[peer], type, static_cast<int>(peer), comm(), stream()));
      }
    }
    enqueued(call);
  }

  // A device-side all-reduce of one word, then the host waits for the stream (with the timeout).
  void barrier(std::source_location where = std::source_location::current()) {
    auto call = begin(OpKind::barrier, DType::u8, 0, -1, ReduceOp::sum, where, true);
    detail::NcclDeviceScope scope(state_->device);
    auto* word = static_cast<std::int32_t*>(state_->scratch_memory());
    TRELLIS_CHECK_NCCL(ncclAllReduce(word, word, 1, ncclInt32, ncclSum, comm(), stream()));
    state_->synchronize(call);
    nvtxRangePop();
    state_->recorder.completed(call.seq);
  }

  // ---- point to point (tags ignored: NCCL matches a pair's messages in order) ---------------

  template <Element T>
  void send(const T* buffer, std::size_t n, int peer, int tag = 0,
            std::source_location where = std::source_location::current()) {
    check_rank(peer, "send: peer");
    auto call = begin(OpKind::send, dtype_v<T>, n, peer, ReduceOp::sum, where, false);
    TRELLIS_CHECK_NCCL(ncclSend(buffer, n, detail::nccl_datatype(dtype_v<T>), peer, comm(), stream()));
    enqueued(call);
  }
  template <Element T>
  void recv(T* buffer, std::size_t n, int peer, int tag = 0,
            std::source_location where = std::source_location::current()) {
    check_rank(peer, "recv: peer");
    auto call = begin(OpKind::recv, dtype_v<T>, n, peer, ReduceOp::sum, where, false);
    TRELLIS_CHECK_NCCL(ncclRecv(buffer, n, detail::nccl_datatype(dtype_v<T>), peer, comm(), stream()));
    enqueued(call);
  }
  template <Element T>
  NcclRequest isend(const T* buffer, std::size_t n, int peer, int tag = 0,
                    std::source_location where = std::source_location::current()) {
    check_rank(peer, "send: peer");
    auto call = begin(OpKind::send, dtype_v<T>, n, peer, ReduceOp::sum, where, false);
    TRELLIS_CHECK_NCCL(ncclSend(buffer, n, detail::nccl_datatype(dtype_v<T>), peer, comm(), stream()));
    return make_request(call);
  }
  template <Element T>
  NcclRequest irecv(T* buffer, std::size_t n, int peer, int tag = 0,
                    std::source_location where = std::source_location::current()) {
    check_rank(peer, "recv: peer");
    auto call = begin(OpKind::recv, dtype_v<T>, n, peer, ReduceOp::sum, where, false);
    TRELLIS_CHECK_NCCL(ncclRecv(buffer, n, detail::nccl_datatype(dtype_v<T>), peer, comm(), stream()));
    return make_request(call);
  }

  // All sends and receives in one NCCL group; one request for the lot.
  NcclRequest batch(std::span<const P2POp> ops, std::source_location where = std::source_location::current()) {
    for (const P2POp& op : ops) check_rank(op.peer, op.kind == P2POp::Kind::send ? "batch send: peer" : "batch recv: peer");
    auto call = begin(OpKind::batch, ops.empty() ? DType::u8 : ops[0].dtype, ops.size(), -1, ReduceOp::sum, where, false);
    {
      NcclGroup group;
      for (const P2POp& op : ops) {
        const ncclDataType_t type = detail::nccl_datatype(op.dtype);
        if (op.kind == P2POp::Kind::send) {
          TRELLIS_CHECK_NCCL(ncclSend(op.buffer, op.count, type, op.peer, comm(), stream()));
        } else {
          TRELLIS_CHECK_NCCL(ncclRecv(op.buffer, op.count, type, op.peer, comm(), stream()));
        }
      }
    }
    return make_request(call);
  }

  // ncclCommSplit: ranks with the same color, ordered by key then rank (collective; blocks the
  // host until every rank of the color joined).
  NcclComm split(int color, int key, std::source_location where = std::source_location::current()) {
    TRELLIS_CHECK(color >= 0, "split: color must be >= 0, got ", color,
                  "; use split_or_none() for ranks that take part without joining a communicator");
    return *split_or_none(color, key, where);
  }

  // As split, but a negative color (MPI_UNDEFINED; NCCL_SPLIT_NOCOLOR) takes part in the split and
  // joins no communicator: std::nullopt.
  std::optional<NcclComm> split_or_none(int color, int key,
                                        std::source_location where = std::source_location::current()) {
    auto call = begin(OpKind::split, DType::i32, 0, -1, ReduceOp::sum, where, true);
    detail::NcclDeviceScope scope(device());
    ncclComm_t sub = nullptr;
    TRELLIS_CHECK_NCCL(ncclCommSplit(comm(), color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &sub, nullptr));
    nvtxRangePop();
    state_->recorder.completed(call.seq);
    if (color < 0 || sub == nullptr) {
      TRELLIS_CHECK(color < 0, "split_or_none: ncclCommSplit gave no communicator for color ", color);
      return std::nullopt;
    }
    NcclComm result(sub, device(), stream(), label() + "/split(" + std::to_string(color) + ")");
    result.set_debug(debug());
    result.set_timeout(timeout());
    if (compute_stream()) result.set_compute_stream(compute_stream());  // a stream of its own
    return result;
  }

 private:
  ncclComm_t comm() const { return state_->comm; }

  void check_rank(int r, const char* what) const {
    if (r < 0 || r >= state_->size) [[unlikely]]
      TRELLIS_THROW(what, " ", r, " is not a rank of NCCL communicator '", label(), "' (size ", state_->size, ")");
  }

  OpFingerprint begin(OpKind kind, DType dtype, std::size_t n, int root, ReduceOp op, std::source_location where,
                      bool collective) {
    auto& s = *state_;
    s.check_usable();
    OpFingerprint call = s.recorder.record(kind, dtype, n, root, op, where);
    if (collective) {
      OpFingerprint shared = call;
      shared.seq = s.collectives++;
      if (s.debug && s.size > 1) {
        detail::NcclDeviceScope scope(s.device);
        try {
          s.check_fingerprints(shared);
        } catch (...) {
          s.recorder.failed(call.seq);
          throw;
        }
      }
    }
    if (s.compute) stream_waits(s.stream, s.compute);  // overlap mode: after the data's producers
    char name[160];
    std::snprintf(name, sizeof name, "nccl %s %llu B (%s)", op_kind_name(kind),
                  static_cast<unsigned long long>(n * dtype_size(dtype)), s.recorder.label().c_str());
    nvtxRangePushA(name);  // popped once the call is enqueued or done (an error on the way leaves it open)
    return call;
  }

  // Stream-ordered calls are "completed" for the recorder once enqueued; in overlap mode the
  // compute stream waits for a blocking call's work.
  void enqueued(const OpFingerprint& call) {
    nvtxRangePop();
    if (state_->compute) stream_waits(state_->compute, state_->stream);
    state_->recorder.completed(call.seq);
  }

  // `waiter` waits (on the device) for what `producer` holds now.
  void stream_waits(cudaStream_t waiter, cudaStream_t producer) {
    detail::NcclDeviceScope scope(state_->device);
    cudaEvent_t event = nullptr;
    TRELLIS_CHECK_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    cudaError_t status = cudaEventRecord(event, producer);
    if (status == cudaSuccess) status = cudaStreamWaitEvent(waiter, event, 0);
    cudaEventDestroy(event);  // released once completed
    TRELLIS_CHECK_CUDA(status);
  }

  NcclRequest make_request(const OpFingerprint& call) {
    nvtxRangePop();
    detail::NcclDeviceScope scope(state_->device);
    cudaEvent_t event = nullptr;
    TRELLIS_CHECK_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    cudaError_t status = cudaEventRecord(event, stream());
    if (status != cudaSuccess) cudaEventDestroy(event);
    TRELLIS_CHECK_CUDA(status);
    return NcclRequest(state_, event, call);
  }

  std::shared_ptr<detail::NcclCommState> state_;
};

static_assert(Communicator<NcclComm>);

}  // namespace trellis::comm
