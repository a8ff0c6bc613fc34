// Ring attention (Liu et al. 2023; the zig-zag balance of ring-flash-attention / Megatron CP):
// the local K and V (this member's heads, all of its chunks) travel round the ring, one hop per
// step, with point-to-point messages started before the step's compute, so the exchange runs
// while the blocks are computed. Each query chunk attends to each arriving key chunk that is not
// after it (causal_offset = the chunks' position difference; packed documents: the chunks' ids),
// and the partial results are merged by their log-sum-exp. Backward: the K/V blocks travel the
// other way round (sent before the compute), each followed by an accumulator of its dK/dV (act_t)
// that every member adds its contribution to; the hand-off of one step runs during the next step's
// compute, the last one (home to the owner) during the owner's own off-diagonal blocks, the first
// K/V hop during its diagonal blocks. dQ stays local.
//
// Which global chunks a ring member holds (ChunkLists, the same count K for every member):
//  plain ring: member r of cp holds chunks r and 2 cp - 1 - r (zig-zag). Under a causal mask
//    every rank then does the same work: per step two full L x L blocks, except step 0 (two
//    diagonal blocks and one full block).
//  hybrid (cp = u x g): after the Ulysses all-to-all inside its group k, a member holds the 2u
//    chunks of the group's ranks k u + i (i < u), chunks k u + i and 2 cp - 1 - (k u + i); the
//    ring runs over the g groups (hybrid_chunks).
//
// Layout of the tensors given here: [K][batch, heads, L, head_dim] (the member's chunks in list
// order), lse [K][batch, heads, L]; document ids [2 cp][batch, L] for every global chunk (all
// ranks hold them: they come with the batch).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "trellis/backend/backend.hpp"
#include "trellis/comm/communicator.hpp"
#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/attention.hpp"
#include "trellis/nn/context_parallel.hpp"

namespace trellis::nn {

// The global chunks held by every ring member, in the order of its [K][...] tensors.
using ChunkLists = std::vector<std::vector<index_t>>;

// The plain ring: cp rank r holds chunks r and 2 cp - 1 - r.
inline ChunkLists zigzag_chunks(int cp) {
  ChunkLists out(static_cast<std::size_t>(cp));
  for (int r = 0; r < cp; ++r) out[static_cast<std::size_t>(r)] = {r, 2 * cp - 1 - r};
  return out;
}
// The hybrid's ring over the cp / u groups: member k holds, for each i < u, the zig-zag chunks of
// cp rank k u + i (slot 2 i + c: its local chunk c), the order of UlyssesExchange's output.
inline ChunkLists hybrid_chunks(int cp, int u) {
  ChunkLists out(static_cast<std::size_t>(cp / u));
  for (int k = 0; k < cp / u; ++k)
    for (int i = 0; i < u; ++i) {
      const int r = k * u + i;
      out[static_cast<std::size_t>(k)].push_back(r);
      out[static_cast<std::size_t>(k)].push_back(2 * cp - 1 - r);
    }
  return out;
}

// One block of ring attention: at ring step `step` this member holds the K/V of member `src`, and
// its query chunk qi (global chunk qc) attends to that member's key chunk ki (global kc).
struct RingBlock {
  int step = 0, src = 0, qi = 0, ki = 0;
  index_t qc = 0, kc = 0;
  bool diagonal() const { return qc == kc; }
};

// The blocks ring member `member` computes, in order: step by step, and at step 0 each query
// chunk's diagonal block first (it initialises that chunk's result). Causal: blocks whose keys all
// come after their queries are left out. Forward and backward run exactly this list; tests and
// benches read it to count and time each member's work.
inline std::vector<RingBlock> ring_plan(int member, const ChunkLists& chunks, bool causal) {
  const int P = static_cast<int>(chunks.size());
  const int K = static_cast<int>(chunks[static_cast<std::size_t>(member)].size());
  std::vector<RingBlock> out;
  for (int step = 0; step < P; ++step) {
    const int src = (member - step + P) % P;
    for (int qi = 0; qi < K; ++qi)
      for (int kk = 0; kk < K; ++kk) {
        const int ki = step == 0 ? (qi + kk) % K : kk;
        const RingBlock b{step, src, qi, ki, chunks[static_cast<std::size_t>(member)][static_cast<std::size_t>(qi)],
                          chunks[static_cast<std::size_t>(src)][static_cast<std::size_t>(ki)]};
        if (!causal || b.kc <= b.qc) out.push_back(b);
      }
  }
  return out;
}

// Ring attention over one microbatch. `args` describes one chunk pair (batch, heads, head_dim,
// q_len = kv_len = L, causal); segments: the chunked ids ([2 cp][batch, L], B's memory) or null;
// chunks: what every member of `comm` holds (empty: the plain zig-zag of comm).
template <comm::Communicator C, backend::Backend B>
class RingAttention {
 public:
  using act_t = typename B::act_t;
  // Where this member's time went: seconds blocked waiting for a K/V block that had not arrived
  // when the compute ran out (what overlap did not hide), and in the dK/dV hand-off.
  struct Stats {
    double kv_wait_seconds = 0, grad_exchange_seconds = 0;
  };

  RingAttention(C& comm, const B& be, const kernels::AttentionArgs& args, const std::int32_t* segments,
                ChunkLists chunks = {})
      : comm_(comm), be_(be), args_(args), segments_(segments), P_(comm.size()), r_(comm.rank()),
        n_(args.q_elements()), m_(args.lse_elements()),
        chunks_(chunks.empty() ? zigzag_chunks(comm.size()) : std::move(chunks)) {
    TRELLIS_CHECK(static_cast<int>(chunks_.size()) == P_ && !chunks_[0].empty(), "RingAttention: chunk lists for ",
                  chunks_.size(), " members, the ring has ", P_);
    K_ = static_cast<int>(chunks_[0].size());
    for (const auto& l : chunks_)
      TRELLIS_CHECK(static_cast<int>(l.size()) == K_, "RingAttention: every member must hold ", K_, " chunks");
    plan_ = ring_plan(r_, chunks_, args_.causal);
  }
  const Stats& stats() const { return stats_; }

  // q, k, v: [K][n] this member's chunks; o: [K][n] and lse: [K][m], written.
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
        pending = exchange<act_t>({kc, vc}, {kn, vn}, (r_ + 1) % P_, (r_ - 1 + P_) % P_);
      }
      for (const RingBlock& b : plan_) {
        if (b.step != step) continue;
        const auto a = block_args(b);
        if (step == 0 && b.qi == b.ki) {  // the chunk's first result: written directly
          be_.attention_forward(a, q + b.qi * n_, kc + b.ki * n_, vc + b.ki * n_, o + b.qi * n_, lse + b.qi * m_);
        } else {
          be_.attention_forward(a, q + b.qi * n_, kc + b.ki * n_, vc + b.ki * n_, o_part.data(), lse_part.data());
          be_.merge_attention_partials(m_, args_.head_dim, o + b.qi * n_, lse + b.qi * m_, o_part.data(),
                                       lse_part.data());
        }
      }
      if (pending) {
        timed_wait(*pending, stats_.kv_wait_seconds);
        kc = kn, vc = vn;
      }
    }
  }

  // Gradients from the merged o and lse of forward: dq [K][n] of this member's queries, dk and dv
  // [K][n] of its keys and values (all overwritten).
  //
  // The backward ring runs the other way round: member r holds its own K/V, then the blocks of
  // r + 1, r + 2, ..., r - 1. A block's dK/dV accumulator travels with it (each member adds its
  // contribution, then hands it on, the hand-off running during the next step's compute) and
  // reaches the owner after the last step. The owner's own blocks are split round that: the
  // diagonal blocks run first, while the first remote block travels in; the others run last, while
  // the accumulator of its own K/V comes home. So no hop waits on an idle member when the compute
  // of a step outlasts it. Every block's gradients are rounded to act_t once; their sums (dQ, the
  // dK/dV accumulators that travel, this member's own) are fp32 whatever act_t, as in
  // ring-flash-attention, and rounded once at the end.
  void backward(const act_t* q, const act_t* k, const act_t* v, const act_t* o, const act_t* d_o, const float* lse,
                act_t* dq, act_t* dk, act_t* dv) {
    using acc_t = float;  // dQ's sum and the dK/dV sums, travelling ones included
    const auto all = static_cast<std::size_t>(K_ * n_);
    auto sum = [&](std::size_t size) {
      auto b = be_.template scratch<acc_t>(size);
      be_.fill_zero(b.data(), size);
      return b;
    };
    auto dq_sum = sum(all), own_k = sum(all), own_v = sum(all);
    auto part_q = be_.template scratch<act_t>(static_cast<std::size_t>(n_));
    auto part_k = be_.template scratch<act_t>(static_cast<std::size_t>(n_));
    auto part_v = be_.template scratch<act_t>(static_cast<std::size_t>(n_));
    // This member's blocks that `take` selects, over the key block kb/vb: each block's gradients
    // into fresh parts (rounded to act_t once), added into dq_sum and the key sums gk/gv.
    auto blocks = [&](auto take, const act_t* kb, const act_t* vb, acc_t* gk, acc_t* gv) {
      for (const RingBlock& b : plan_) {
        if (!take(b)) continue;
        be_.attention_backward(block_args(b), q + b.qi * n_, kb + b.ki * n_, vb + b.ki * n_, o + b.qi * n_,
                               d_o + b.qi * n_, lse + b.qi * m_, part_q.data(), part_k.data(), part_v.data());
        be_.add(n_, part_q.data(), dq_sum.data() + b.qi * n_, dq_sum.data() + b.qi * n_);
        be_.add(n_, part_k.data(), gk + b.ki * n_, gk + b.ki * n_);
        be_.add(n_, part_v.data(), gv + b.ki * n_, gv + b.ki * n_);
      }
    };
    const int r = r_;
    auto finish = [&] {  // the sums, rounded once
      be_.convert(all, dq_sum.data(), dq);
      be_.convert(all, own_k.data(), dk);
      be_.convert(all, own_v.data(), dv);
    };
    if (P_ == 1) {  // a ring of one: every block is this member's own
      blocks([](const RingBlock&) { return true; }, k, v, own_k.data(), own_v.data());
      finish();
      return;
    }
    const int next = (r_ + 1) % P_, prev = (r_ - 1 + P_) % P_;
    std::array<typename B::template buffer<act_t>, 2> kbuf, vbuf;
    std::array<typename B::template buffer<acc_t>, 2> send_k, send_v, in_k, in_v;
    auto step_k = be_.template scratch<acc_t>(all), step_v = be_.template scratch<acc_t>(all);
    act_t *kc = next_buffer(kbuf, 0), *vc = next_buffer(vbuf, 0);
    std::optional<typename C::request_type> pending = exchange<act_t>({k, v}, {kc, vc}, prev, next);
    blocks([r](const RingBlock& b) { return b.src == r && b.diagonal(); }, k, v, own_k.data(), own_v.data());
    std::optional<typename C::request_type> handing;  // the accumulator handed on last step / arriving now
    acc_t *acc_k = nullptr, *acc_v = nullptr;          // where it arrives
    for (int step = 1; step < P_; ++step) {
      timed_wait(*pending, stats_.kv_wait_seconds);  // the block of member r + step
      pending.reset();
      const act_t *held_k = kc, *held_v = vc;
      if (step + 1 < P_) {
        kc = next_buffer(kbuf, step), vc = next_buffer(vbuf, step);
        pending = exchange<act_t>({held_k, held_v}, {kc, vc}, prev, next);
      }
      be_.fill_zero(step_k.data(), all);
      be_.fill_zero(step_v.data(), all);
      const int src = (r_ + step) % P_;
      blocks([src](const RingBlock& b) { return b.src == src; }, held_k, held_v, step_k.data(), step_v.data());
      // This member's part added to the block's sum from the members after it (none at step 1),
      // into the buffer handed on.
      acc_t* out_k = next_buffer(send_k, step);
      acc_t* out_v = next_buffer(send_v, step);
      if (handing) {
        timed_wait(*handing, stats_.grad_exchange_seconds);
        be_.add(static_cast<index_t>(all), step_k.data(), acc_k, out_k);
        be_.add(static_cast<index_t>(all), step_v.data(), acc_v, out_v);
      } else {
        be_.copy(out_k, step_k.data(), all);
        be_.copy(out_v, step_v.data(), all);
      }
      // On to the previous member (after the last step: the block's owner).
      acc_k = next_buffer(in_k, step), acc_v = next_buffer(in_v, step);
      handing = exchange<acc_t>({out_k, out_v}, {acc_k, acc_v}, prev, next, kGradientTags);
    }
    blocks([r](const RingBlock& b) { return b.src == r && !b.diagonal(); }, k, v, own_k.data(), own_v.data());
    timed_wait(*handing, stats_.grad_exchange_seconds);  // every other member's part of our dK/dV
    be_.add(static_cast<index_t>(all), own_k.data(), acc_k, own_k.data());
    be_.add(static_cast<index_t>(all), own_v.data(), acc_v, own_v.data());
    finish();
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
  static void timed_wait(typename C::request_type& r, double& seconds) {
    const auto t0 = std::chrono::steady_clock::now();
    r.wait();
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  // Buffers alternate by step, so a block being sent is never the one being received.
  template <class Buffer>
  auto next_buffer(std::array<Buffer, 2>& bufs, int step) const {
    auto& b = bufs[static_cast<std::size_t>(step % 2)];
    using T = std::remove_pointer_t<decltype(b.data())>;
    if (b.empty()) b = be_.template scratch<T>(static_cast<std::size_t>(K_ * n_));
    return b.data();
  }
  // Sends two [K][n] tensors to member `to` and receives two from member `from`, together (tags:
  // K/V blocks 0 and 1, their gradient accumulators 2 and 3).
  static constexpr int kGradientTags = 2;
  template <class T>
  typename C::request_type exchange(std::array<const T*, 2> send, std::array<T*, 2> recv, int to, int from,
                                    int tag = 0) {
    const auto count = static_cast<std::size_t>(K_ * n_);
    const comm::P2POp ops[4] = {
        {comm::P2POp::Kind::send, const_cast<T*>(send[0]), count, dtype_v<T>, to, tag},
        {comm::P2POp::Kind::send, const_cast<T*>(send[1]), count, dtype_v<T>, to, tag + 1},
        {comm::P2POp::Kind::recv, recv[0], count, dtype_v<T>, from, tag},
        {comm::P2POp::Kind::recv, recv[1], count, dtype_v<T>, from, tag + 1},
    };
    return comm_.batch(std::span<const comm::P2POp>(ops));
  }

  C& comm_;
  const B& be_;
  kernels::AttentionArgs args_;
  const std::int32_t* segments_;
  int P_, r_, K_ = 2;
  index_t n_, m_;
  ChunkLists chunks_;
  std::vector<RingBlock> plan_;
  Stats stats_;
};

}  // namespace trellis::nn
