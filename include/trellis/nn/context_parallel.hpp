// Context parallelism (long sequences): the sequence of every sample is split over the cp ranks,
// and attention, the only layer that mixes positions, exchanges what it needs.
//
// Split (TokenShape): the full sequence is cut into 2 cp chunks of L tokens; rank r holds chunks r
// and 2 cp - 1 - r (zig-zag). Under a causal mask each rank then does the same attention work:
// per ring step, two full L x L blocks, except step 0 (two diagonal blocks and one full block).
//
// Ring attention (Liu et al. 2023; the zig-zag balance of ring-flash-attention / Megatron CP):
// the local K and V (this rank's heads over tp, both chunks) travel round the cp ring, one hop per
// step, with point-to-point messages started before the step's compute, so the exchange runs
// while the blocks are computed. Each query chunk attends to each arriving key chunk that is not
// after it (causal_offset = the chunks' position difference; packed documents: the chunks' ids),
// and the partial results are merged by their log-sum-exp. Backward: the K/V blocks travel the
// same way (sent before the compute), each followed by an accumulator of its dK/dV (act_t) that
// every rank adds into; after cp hops the accumulator is back at its owner. dQ stays local.
//
// Layout of the tensors given here: [2][batch, heads, L, head_dim] (local chunk 0, then 1), lse
// [2][batch, heads, L]; document ids [2 cp][batch, L] for every global chunk (all ranks hold
// them: they come with the batch).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "trellis/backend/backend.hpp"
#include "trellis/comm/communicator.hpp"
#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/attention.hpp"
#include "trellis/nn/tensor_parallel.hpp"

namespace trellis::nn {

enum class CpMode : std::uint8_t { ring, ulysses, hybrid };

inline const char* to_string(CpMode m) {
  switch (m) {
    case CpMode::ring: return "ring";
    case CpMode::ulysses: return "ulysses";
    case CpMode::hybrid: return "hybrid";
  }
  return "?";
}
inline CpMode parse_cp_mode(std::string_view s) {
  if (s == "ring") return CpMode::ring;
  if (s == "ulysses") return CpMode::ulysses;
  if (s == "hybrid") return CpMode::hybrid;
  TRELLIS_THROW("unknown context-parallel mode '", s, "' (ring, ulysses or hybrid)");
}

// The context-parallel communicator of a layer (the ranks that differ only in their cp
// coordinate) and the mode. A null or size-1 communicator: no context parallelism.
template <comm::Communicator C>
struct ContextParallel {
  C* comm = nullptr;
  CpMode mode = CpMode::ring;
  int size() const { return comm ? comm->size() : 1; }
  int rank() const { return comm ? comm->rank() : 0; }
  bool active() const { return size() > 1; }
  // The shape's split must be this communicator's (the trainer sets both from the mesh).
  void check(const TokenShape& s, const char* who) const {
    TRELLIS_CHECK(s.cp_size == size() && s.cp_rank == rank(), who, ": the microbatch is split for cp rank ", s.cp_rank,
                  " of ", s.cp_size, " but the layer's cp communicator is rank ", rank(), " of ", size());
    TRELLIS_CHECK(s.cp_size == 1 || s.seq % 2 == 0, who, ": a context-parallel rank holds two equal chunks, so its ",
                  "local sequence must be even, got ", s.seq);
  }
};

// The document ids of every global chunk, [chunks][batch, L], from the full (batch, full_seq)
// ids: what the ring's masks read (host vector; the caller uploads it).
inline std::vector<std::int32_t> chunked_segments(const TokenShape& s) {
  const index_t L = s.cp_chunk(), n = s.full_seq(), chunks = n / L;
  std::vector<std::int32_t> out(static_cast<std::size_t>(s.batch * n));
  for (index_t c = 0; c < chunks; ++c)
    for (index_t b = 0; b < s.batch; ++b)
      for (index_t i = 0; i < L; ++i)
        out[static_cast<std::size_t>((c * s.batch + b) * L + i)] = s.segments[b * n + c * L + i];
  return out;
}

// One block of ring attention: at ring step `step` this rank holds the K/V of rank `src`, and
// its local query chunk qi (global chunk qc) attends to that rank's local key chunk ki (global kc).
struct RingBlock {
  int step = 0, src = 0, qi = 0, ki = 0;
  index_t qc = 0, kc = 0;
  bool diagonal() const { return qc == kc; }
};

// The blocks cp rank `rank` of `size` computes, in order (step by step; at step 0 each query
// chunk's diagonal block first, since it initialises that chunk's result). Causal: blocks whose
// keys all come after their queries are left out. The forward and backward passes run exactly
// this list; tests and benches read it to count and time each rank's work.
inline std::vector<RingBlock> ring_plan(int rank, int size, bool causal) {
  auto chunk = [&](int r, int c) -> index_t { return c == 0 ? r : 2 * size - 1 - r; };
  std::vector<RingBlock> out;
  for (int step = 0; step < size; ++step) {
    const int src = (rank - step + size) % size;
    for (int qi = 0; qi < 2; ++qi)
      for (int kk = 0; kk < 2; ++kk) {
        const int ki = step == 0 ? (qi + kk) % 2 : kk;
        const RingBlock b{step, src, qi, ki, chunk(rank, qi), chunk(src, ki)};
        if (!causal || b.kc <= b.qc) out.push_back(b);
      }
  }
  return out;
}

// Ring attention over one microbatch. `args` describes one chunk pair (batch, heads, head_dim,
// q_len = kv_len = L, causal); segments: the chunked ids ([2 cp][batch, L], B's memory) or null.
template <comm::Communicator C, backend::Backend B>
class RingAttention {
 public:
  using act_t = typename B::act_t;
  // Where a call's time went (this rank): seconds blocked waiting for a K/V block that had not
  // arrived when the compute ran out (what overlap did not hide), and for the dK/dV hand-off.
  struct Stats {
    double kv_wait_seconds = 0, grad_exchange_seconds = 0;
  };

  RingAttention(C& comm, const B& be, const kernels::AttentionArgs& args, const std::int32_t* segments)
      : comm_(comm), be_(be), args_(args), segments_(segments), P_(comm.size()), r_(comm.rank()),
        n_(args.q_elements()), m_(args.lse_elements()) {}

  // q, k, v: [2][n] this rank's chunks; o: [2][n] and lse: [2][m], written.
  void forward(const act_t* q, const act_t* k, const act_t* v, act_t* o, float* lse) {
    auto o_part = be_.template scratch<act_t>(static_cast<std::size_t>(n_));
    auto lse_part = be_.template scratch<float>(static_cast<std::size_t>(m_));
    std::array<typename B::template buffer<act_t>, 2> kbuf, vbuf;
    const act_t *kc = k, *vc = v;
    for (int step = 0; step < P_; ++step) {
      std::optional<typename C::request_type> pending;
      act_t *kn = nullptr, *vn = nullptr;
      if (step + 1 < P_) {  // the next block travels while this one is computed
        kn = next_buffer(kbuf, step), vn = next_buffer(vbuf, step);
        pending = exchange({kc, vc}, {kn, vn});
      }
      for (const RingBlock& b : plan_) {
        if (b.step != step) continue;
        const auto a = block_args(b);
        if (step == 0 && b.diagonal()) {  // the first result of this query chunk: written directly
          be_.attention_forward(a, q + b.qi * n_, kc + b.ki * n_, vc + b.ki * n_, o + b.qi * n_, lse + b.qi * m_);
        } else {
          be_.attention_forward(a, q + b.qi * n_, kc + b.ki * n_, vc + b.ki * n_, o_part.data(), lse_part.data());
          be_.merge_attention_partials(m_, args_.head_dim, o + b.qi * n_, lse + b.qi * m_, o_part.data(),
                                       lse_part.data());
        }
      }
      if (pending) {
        wait(*pending, stats_.kv_wait_seconds);
        kc = kn, vc = vn;
      }
    }
  }
  const Stats& stats() const { return stats_; }

  // Gradients from the merged o and lse of forward: dq [2][n] of this rank's queries, dk and dv
  // [2][n] of this rank's keys and values (all overwritten).
  void backward(const act_t* q, const act_t* k, const act_t* v, const act_t* o, const act_t* d_o, const float* lse,
                act_t* dq, act_t* dk, act_t* dv) {
    const auto two_n = static_cast<std::size_t>(2 * n_);
    be_.fill_zero(dq, two_n);
    std::array<typename B::template buffer<act_t>, 2> kbuf, vbuf, dkbuf, dvbuf;
    const act_t *kc = k, *vc = v;
    act_t* dkc = next_buffer(dkbuf, 1);  // the accumulator of the block held now (this rank's first)
    act_t* dvc = next_buffer(dvbuf, 1);
    be_.fill_zero(dkc, two_n);
    be_.fill_zero(dvc, two_n);
    for (int step = 0; step < P_; ++step) {
      std::optional<typename C::request_type> pending;
      act_t *kn = nullptr, *vn = nullptr;
      if (step + 1 < P_) {
        kn = next_buffer(kbuf, step), vn = next_buffer(vbuf, step);
        pending = exchange({kc, vc}, {kn, vn});
      }
      for (const RingBlock& b : plan_) {
        if (b.step != step) continue;
        be_.attention_backward(block_args(b), q + b.qi * n_, kc + b.ki * n_, vc + b.ki * n_, o + b.qi * n_,
                               d_o + b.qi * n_, lse + b.qi * m_, dq + b.qi * n_, dkc + b.ki * n_, dvc + b.ki * n_,
                               /*accumulate=*/true);
      }
      if (pending) {
        wait(*pending, stats_.kv_wait_seconds);
        kc = kn, vc = vn;
      }
      // The accumulator follows its block to the next rank; after the last hop it is back home.
      act_t* dkn = step + 1 < P_ ? next_buffer(dkbuf, step) : dk;
      act_t* dvn = step + 1 < P_ ? next_buffer(dvbuf, step) : dv;
      auto handed = exchange({dkc, dvc}, {dkn, dvn}, kGradientTags);
      wait(handed, stats_.grad_exchange_seconds);
      dkc = dkn, dvc = dvn;
    }
  }

 private:
  // Kernel arguments of a block: the causal mask shifted by the chunks' position difference, and
  // the chunks' document ids.
  kernels::AttentionArgs block_args(const RingBlock& b) const {
    const index_t L = args_.q_len;
    kernels::AttentionArgs a = args_;
    a.causal_offset = (b.qc - b.kc) * L;
    if (segments_) {
      a.q_segments = segments_ + b.qc * args_.batch * L;
      a.kv_segments = segments_ + b.kc * args_.batch * L;
    }
    return a;
  }
  static void wait(typename C::request_type& r, double& seconds) {
    const auto t0 = std::chrono::steady_clock::now();
    r.wait();
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  // Buffers alternate by step, so a block being sent is never the one being received.
  act_t* next_buffer(std::array<typename B::template buffer<act_t>, 2>& bufs, int step) const {
    auto& b = bufs[static_cast<std::size_t>(step % 2)];
    if (b.empty()) b = be_.template scratch<act_t>(static_cast<std::size_t>(2 * n_));
    return b.data();
  }
  // Sends two [2][n] tensors to the next rank and receives two from the previous one, together
  // (tags: K/V blocks 0 and 1, their gradient accumulators 2 and 3).
  static constexpr int kGradientTags = 2;
  typename C::request_type exchange(std::array<const act_t*, 2> send, std::array<act_t*, 2> recv, int tag = 0) {
    const int next = (r_ + 1) % P_, prev = (r_ - 1 + P_) % P_;
    const auto count = static_cast<std::size_t>(2 * n_);
    const comm::P2POp ops[4] = {
        {comm::P2POp::Kind::send, const_cast<act_t*>(send[0]), count, dtype_v<act_t>, next, tag},
        {comm::P2POp::Kind::send, const_cast<act_t*>(send[1]), count, dtype_v<act_t>, next, tag + 1},
        {comm::P2POp::Kind::recv, recv[0], count, dtype_v<act_t>, prev, tag},
        {comm::P2POp::Kind::recv, recv[1], count, dtype_v<act_t>, prev, tag + 1},
    };
    return comm_.batch(std::span<const comm::P2POp>(ops));
  }

  C& comm_;
  const B& be_;
  kernels::AttentionArgs args_;
  const std::int32_t* segments_;
  int P_, r_;
  index_t n_, m_;
  std::vector<RingBlock> plan_ = ring_plan(r_, P_, args_.causal);
  Stats stats_;
};

}  // namespace trellis::nn
