// Long context on the GPT-2 model (tiny config: 2 layers, 4 heads, width 64, vocab 96, T 32).
// Packed documents (TokenShape::segments): a microbatch packing several documents and padding
// gives the loss and every gradient of the same documents run alone, one sequence each
// (positions from 0, nothing seen across documents, padding ignored): the documents' losses
// summed with the same normaliser, their gradients summed (1e-5 relative: only the summation
// order of the GEMMs differs). Tensor parallel 2 with sp, and recompute, equal tp 1 packed.
// Context parallelism (ring attention, zig-zag chunks): cp 2 and 4, packed and not, cp 2 with
// tp 2 + sp, with recompute, and with dropout (masks by global position) equal one rank (1e-5;
// 2e-5 with tp); a TokenShape split that does not match the cp communicator is refused. The ring
// plan (the blocks each rank computes) covers every causal pair once, the same count per rank.
// Ulysses (all-to-all of heads) over cp 2 and 4, packed or not, and cp 2 with tp 2 + sp; hybrid
// cp 4 = Ulysses 2 x ring 2 (and the degenerate 1 x 4, 4 x 1): the same comparisons, saved state
// in a poisoned arena checked against saved_bytes; heads that do not split over the all-to-all
// are refused on every rank.
// Balanced documents (each row's documents reordered, balanced_document_order): the work and the
// order by hand; cp 2 and 4 ring, hybrid cp 4 and tp 2 + sp cp 2 equal the documents run alone
// (1e-5; 2e-5 with tp); on rows of 16..1024-token documents at T 4096, counted per rank from the
// ring plan and the stored ids, every causal pair of every document once, and the ranks no
// further apart than under the plain zig-zag (cp 2: within 5 %). Host bf16 RingAttention at cp 8
// against the fp32 kernel over the whole sequence: dq and dk within 1.1x, dv within 1.3x of the
// error of one bf16 call (the sums are fp32; with bf16 sums dq measured 1.26x, dv 1.37x).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "support.hpp"
#include "trellis/comm/mesh.hpp"
#include "trellis/nn/gpt.hpp"

using namespace trellis;
using namespace trellis::nn;
using nn_test::Collector;
using nn_test::rel_error;
using Comm = comm::ThreadComm;

namespace {

constexpr index_t kBatch = 2, kSeq = 32;

// Sample 0: documents of 9, 1 and 14 tokens, then 8 of padding; sample 1: 20 and 12.
const std::vector<std::vector<index_t>> kDocuments = {{9, 1, 14}, {20, 12}};

struct Packed {
  std::vector<std::int32_t> tokens, targets, segments;  // (kBatch, kSeq)
  double token_count = 0;
};

Packed make_packed(index_t vocab) {
  Packed p;
  p.tokens = nn_test::make_ids("tokens", 0, vocab);
  p.targets = nn_test::make_ids("targets", 0, vocab);
  p.segments.assign(static_cast<std::size_t>(kBatch * kSeq), 0);
  for (index_t b = 0; b < kBatch; ++b) {
    index_t t = 0;
    std::int32_t id = 0;
    for (index_t len : kDocuments[static_cast<std::size_t>(b)]) {
      for (index_t i = 0; i < len; ++i) p.segments[static_cast<std::size_t>(b * kSeq + t++)] = id;
      ++id;
    }
    for (; t < kSeq; ++t) {  // padding: a document of its own, no targets
      p.segments[static_cast<std::size_t>(b * kSeq + t)] = id;
      p.targets[static_cast<std::size_t>(b * kSeq + t)] = -1;
    }
  }
  for (auto t : p.targets) p.token_count += t >= 0;
  return p;
}

struct Run {
  int tp = 1;
  bool sp = false;
  bool recompute = false;
  bool alone = false;  // every document as its own one-sample microbatch, without segments
  int cp = 1;          // context-parallel ranks (ring attention)
  bool packed = true;  // false: the same tokens as one sequence per sample
  float dropout = 0.0f;
  CpMode mode = CpMode::ring;
  int ulysses = 2;     // hybrid: the ranks of one all-to-all group
  bool arena = false;  // saved state in a poisoned arena, its used bytes checked against saved_bytes
  bool balanced = false;  // each row's documents in balanced order (balanced_document_order)
};

// Loss (sum over the microbatches and cp ranks) and every gradient (summed over cp ranks) of the
// tiny GPT on the packed batch. cp > 1: each rank gets its zig-zag chunks of every sample.
void run(const Run& o, Collector& out) {
  const GptConfig cfg = nn_test::tiny();
  Packed data = make_packed(cfg.vocab);
  if (o.balanced) {  // every row reordered the same way: tokens, targets, ids
    data.segments = balance_documents(data.segments, kSeq, o.cp, {&data.tokens, &data.targets});
  }
  std::mutex mutex;
  std::vector<double> losses;
  nn_test::run_ranks(o.tp * o.cp, [&](Comm& world) {
    auto mesh = comm::make_mesh<trellis::cp, trellis::tp>(world, {o.cp, o.tp});
    Comm& cp_comm = mesh.comm<trellis::cp>();
    GptOptions opt;
    opt.sequence_parallel = o.sp;
    opt.recompute = o.recompute;
    opt.dropout = o.dropout;
    ContextParallel<Comm> cp{&cp_comm, o.mode};
    std::optional<HybridComms<Comm>> hybrid;
    if (o.mode == CpMode::hybrid) cp = hybrid_context(cp_comm, hybrid.emplace(make_hybrid_comms(cp_comm, o.ulysses)));
    GptModel<Comm> model(cfg, mesh.comm<trellis::tp>(), opt, {}, {}, nullptr, cp);
    for (Parameter* p : model.parameters()) nn_test::randomize(*p, 0.05f);
    std::unique_ptr<ActivationArena<backend::Host<float>>> arena;
    int pool = 0;
    auto pass = [&](int mb, const TokenShape& shape, const std::int32_t* tokens, const std::int32_t* targets) {
      if (o.arena && !arena) {
        arena = std::make_unique<ActivationArena<backend::Host<float>>>();
        pool = arena->add_pool("model", model.saved_bytes(shape), 1);
        arena->allocate(/*poison=*/true);
        model.set_saved_memory(arena.get(), pool);
      }
      StageInput in{tokens, nullptr, targets, data.token_count};
      const double loss = model.forward(mb, shape, in, nullptr);
      model.backward_input(mb, shape, nullptr, nullptr);
      if (arena) RANK_CHECK(arena->used_bytes(pool, mb) == model.saved_bytes(shape));
      model.backward_weight(mb);
      return loss;
    };
    double loss = 0;
    if (!o.alone) {
      TokenShape shape{kBatch, kSeq / o.cp, /*seed=*/99, /*first_sample=*/0};
      shape.cp_rank = cp_comm.rank();
      shape.cp_size = o.cp;
      if (o.packed) shape.segments = data.segments.data();
      std::vector<std::int32_t> tokens, targets;  // this rank's positions of every sample
      for (index_t b = 0; b < kBatch; ++b)
        for (index_t p = 0; p < shape.seq; ++p) {
          const auto g = static_cast<std::size_t>(b * kSeq + shape.global_position(p));
          tokens.push_back(data.tokens[g]);
          targets.push_back(data.targets[g]);
        }
      loss = pass(0, shape, tokens.data(), targets.data());
    } else {
      int mb = 0;
      for (index_t b = 0; b < kBatch; ++b) {
        index_t t0 = 0;
        for (index_t len : kDocuments[static_cast<std::size_t>(b)]) {
          const auto first = data.tokens.begin() + b * kSeq + t0;
          const std::vector<std::int32_t> tokens(first, first + len);
          const auto tfirst = data.targets.begin() + b * kSeq + t0;
          const std::vector<std::int32_t> targets(tfirst, tfirst + len);
          loss += pass(mb++, TokenShape{1, len}, tokens.data(), targets.data());
          t0 += len;
        }
      }
    }
    model.reduce_tp_partial_grads();
    RANK_CHECK(model.saved_microbatches() == 0);
    // The cp ranks hold the same weights and each the gradient of its tokens: sum them.
    for (Parameter* p : model.parameters()) cp_comm.all_reduce(p->grad.data(), p->grad.data(), p->grad.size());
    cp_comm.all_reduce(&loss, &loss, 1);
    for (Parameter* p : model.parameters()) out.put_grad(*p);
    std::lock_guard<std::mutex> lock(mutex);
    losses.push_back(loss);
  });
  for (double l : losses) CHECK(std::fabs(l - losses.front()) <= 1e-12 * std::fabs(losses.front()));
  out.scalar = losses.front();
}

void check_equal(const Collector& got, const Collector& ref, double tol) {
  CHECK(std::fabs(got.scalar - ref.scalar) <= tol * std::fabs(ref.scalar));
  CHECK(got.replica_diff() <= 1e-6f);
  for (const std::string& key : ref.keys()) {
    INFO(key);
    REQUIRE(got.complete(key));
    CHECK(rel_error(got.get(key), ref.get(key)) <= tol);
  }
}

}  // namespace

TEST_CASE("a packed microbatch equals its documents run alone", "[nn][gpt][packed]") {
  Collector alone, packed;
  run({.alone = true}, alone);
  run({}, packed);
  check_equal(packed, alone, 1e-5);
  SECTION("tensor parallel 2 with sp, and recompute, equal tp 1") {
    Collector tp2;
    run({.tp = 2, .sp = true}, tp2);
    check_equal(tp2, packed, 2e-5);
    Collector rc;
    run({.recompute = true}, rc);
    check_equal(rc, packed, 1e-6);
  }
}

TEST_CASE("ring attention over cp 2 and 4 equals one rank, packed or not, with tp + sp, recompute, dropout",
          "[nn][gpt][cp]") {
  Collector packed, plain;
  run({}, packed);
  run({.packed = false}, plain);
  REQUIRE(std::fabs(packed.scalar - plain.scalar) > 1e-3 * plain.scalar);  // the documents matter
  for (int cp : {2, 4}) {
    INFO("cp " << cp);
    Collector got, got_plain;
    run({.cp = cp}, got);
    check_equal(got, packed, 1e-5);
    run({.cp = cp, .packed = false}, got_plain);
    check_equal(got_plain, plain, 1e-5);
  }
  Collector tp_sp, rc;
  run({.tp = 2, .sp = true, .cp = 2}, tp_sp);
  check_equal(tp_sp, packed, 2e-5);
  run({.recompute = true, .cp = 2}, rc);
  check_equal(rc, packed, 1e-5);
  // Dropout masks follow the global position: cp 2 (tp 2 + sp) drops what one rank drops.
  Collector drop1, drop2;
  run({.dropout = 0.1f}, drop1);
  run({.tp = 2, .sp = true, .cp = 2, .dropout = 0.1f}, drop2);
  REQUIRE(std::fabs(drop1.scalar - packed.scalar) > 1e-4 * packed.scalar);
  check_equal(drop2, drop1, 2e-5);
}

TEST_CASE("the ring plan covers every causal (query, key) pair once and balances the work", "[nn][cp][balance]") {
  // Each rank's blocks, as global (query, key) positions with the block's mask (key <= query
  // within the whole sequence), counted over all ranks: every visible pair exactly once, no other.
  for (int cp : {2, 3, 4, 8}) {
    INFO("cp " << cp);
    const index_t L = 3, T = 2 * cp * L;
    std::vector<int> seen(static_cast<std::size_t>(T * T), 0);
    std::vector<double> work(static_cast<std::size_t>(cp), 0.0);
    for (int r = 0; r < cp; ++r)
      for (const RingBlock& b : ring_plan(r, zigzag_chunks(cp), /*causal=*/true))
        for (index_t i = 0; i < L; ++i)
          for (index_t j = 0; j < L; ++j) {
            const index_t gi = b.qc * L + i, gj = b.kc * L + j;
            if (j <= i + (b.qc - b.kc) * L) {  // the block's causal_offset
              ++seen[static_cast<std::size_t>(gi * T + gj)];
              work[static_cast<std::size_t>(r)] += 1;
            }
          }
    for (index_t gi = 0; gi < T; ++gi)
      for (index_t gj = 0; gj < T; ++gj) REQUIRE(seen[static_cast<std::size_t>(gi * T + gj)] == (gj <= gi ? 1 : 0));
    const auto [lo, hi] = std::minmax_element(work.begin(), work.end());
    CHECK(*hi <= 1.05 * *lo);  // the bound; zig-zag gives exactly equal counts
    CHECK(*hi == *lo);
    // Without a mask every rank computes every block of its queries: 4 cp blocks of L x L.
    for (int r = 0; r < cp; ++r) CHECK(ring_plan(r, zigzag_chunks(cp), false).size() == static_cast<std::size_t>(4 * cp));
  }
}

TEST_CASE("balanced documents: reordered rows equal the documents run alone", "[nn][gpt][cp][packed]") {
  // By hand, cp 2 (chunks of 4): documents of 12 and 4 tokens. Packed order: rank 0 (chunks 0, 3)
  // has 1+2+3+4 = 10 pairs of each, rank 1 the 5+...+12 = 68 of the long one's middle; the short
  // one first gives 10 + 42 against 10 + 26.
  CHECK(cp_rank_work({12, 4}, 16, 2) == std::vector<double>{20, 68});
  CHECK(cp_rank_work({4, 12}, 16, 2) == std::vector<double>{52, 36});
  const std::vector<std::int32_t> ids = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1};
  std::vector<std::int32_t> values(16);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<std::int32_t>(i);
  CHECK(balance_documents(ids, 16, 2, {&values}) ==
        std::vector<std::int32_t>{0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1});
  CHECK(values == std::vector<std::int32_t>{12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11});

  Collector alone;
  run({.alone = true}, alone);
  for (int cp : {2, 4}) {
    INFO("cp " << cp);
    Collector ring;
    run({.cp = cp, .balanced = true}, ring);
    check_equal(ring, alone, 1e-5);
  }
  Collector hybrid, tp_sp;
  run({.cp = 4, .mode = CpMode::hybrid, .balanced = true}, hybrid);
  check_equal(hybrid, alone, 1e-5);
  run({.tp = 2, .sp = true, .recompute = true, .cp = 2, .balanced = true}, tp_sp);
  check_equal(tp_sp, alone, 2e-5);
}

TEST_CASE("balanced documents even out the causal work of packed rows over the cp ranks", "[nn][cp][balance][packed]") {
  // Rows of documents of 16 to 1024 tokens. Each rank's ring blocks are counted with the kernel's
  // mask (same id, key <= query + the chunks' offset) over the row as stored; every counted pair,
  // mapped back to the original row, must be a causal pair of one document, and every such pair
  // must be counted exactly once.
  const index_t T = 4096;
  for (int cp : {2, 4, 8})
    for (std::uint64_t seed : {5, 6}) {
      INFO("cp " << cp << " seed " << seed);
      std::vector<std::int32_t> ids(static_cast<std::size_t>(T)), where(ids.size());
      for (index_t t = 0, d = 0; t < T; ++d) {
        const index_t len = std::min(T - t, static_cast<index_t>(16 + splitmix64(seed * 1000 + static_cast<std::uint64_t>(d)) % 1009));
        for (index_t i = 0; i < len; ++i, ++t) ids[static_cast<std::size_t>(t)] = static_cast<std::int32_t>(d);
      }
      for (std::size_t i = 0; i < where.size(); ++i) where[i] = static_cast<std::int32_t>(i);
      const index_t L = T / (2 * cp);
      std::vector<double> spread;
      for (bool balanced : {false, true}) {
        auto origin = where;  // stored -> original position
        const auto row_ids = balanced ? balance_documents(ids, T, cp, {&origin}) : ids;
        std::vector<std::uint8_t> seen(static_cast<std::size_t>(T * T), 0);
        std::vector<double> work(static_cast<std::size_t>(cp), 0.0);
        for (int r = 0; r < cp; ++r)
          for (const RingBlock& b : ring_plan(r, zigzag_chunks(cp), /*causal=*/true))
            for (index_t i = 0; i < L; ++i)
              for (index_t j = 0; j < L && j <= i + (b.qc - b.kc) * L; ++j) {
                const auto gi = static_cast<std::size_t>(b.qc * L + i), gj = static_cast<std::size_t>(b.kc * L + j);
                if (row_ids[gi] != row_ids[gj]) continue;
                ++seen[static_cast<std::size_t>(origin[gi]) * static_cast<std::size_t>(T) + static_cast<std::size_t>(origin[gj])];
                work[static_cast<std::size_t>(r)] += 1;
              }
        std::size_t wrong = 0;  // pairs counted other than once each causal pair
        for (index_t a = 0; a < T; ++a)
          for (index_t k = 0; k < T; ++k) {
            const bool causal = ids[static_cast<std::size_t>(a)] == ids[static_cast<std::size_t>(k)] && k <= a;
            wrong += seen[static_cast<std::size_t>(a * T + k)] != (causal ? 1 : 0);
          }
        REQUIRE(wrong == 0);
        const auto [lo, hi] = std::minmax_element(work.begin(), work.end());
        spread.push_back(*hi / *lo);
      }
      WARN("cp " << cp << " seed " << seed << ": causal pairs max / min over ranks, zig-zag " << spread[0]
                 << ", balanced " << spread[1]);
      // Hill climbing starts from the packed order, so never worse; with these rows' 9 to 12
      // documents, cp 2 comes within the 5 % (cp 4 and 8: docs/nn.md's figures).
      CHECK(spread[1] <= spread[0]);
      if (cp == 2) CHECK(spread[1] <= 1.05);
      if (cp == 4 && seed == 5) CHECK(spread[0] > 1.5);  // the plain zig-zag of these rows is far apart
    }
}

TEST_CASE("ring attention in bf16 sums dQ and the dK/dV it passes round in fp32", "[nn][cp][bf16]") {
  // cp 8 (7 hops), 2 heads of 32, chunks of 32. The inputs are bf16 values; the reference is the
  // fp32 kernel over the whole sequence on them. Against the error of the bf16 kernel run over the
  // whole sequence in one call (each output rounded once), the ring measured 1.00x, 1.03x and
  // 1.25x for dq, dk, dv (each block's part is rounded once: dv's 16 parts per key chunk show it);
  // with the sums in bf16 it was 1.26x, 1.04x and 1.37x.
  constexpr int cp = 8;
  constexpr index_t H = 2, D = 32, L = 32, T = 2 * cp * L;
  using Bf16 = backend::Host<bfloat16>;
  kernels::AttentionArgs whole;
  whole.q_heads = whole.kv_heads = H, whole.head_dim = D, whole.q_len = whole.kv_len = T, whole.causal = true;
  const auto n = static_cast<std::size_t>(H * T * D);
  auto values = [&](std::uint64_t seed) {  // bf16-representable floats, (heads, T, D)
    std::vector<float> v(n);
    for (std::size_t i = 0; i < n; ++i)
      v[i] = static_cast<float>(bfloat16(static_cast<float>((splitmix64(seed + i) >> 40) * 0x1.0p-24 - 0.5)));
    return v;
  };
  const auto q = values(1), k = values(2), v = values(3), d_o = values(4);
  std::vector<float> o(n), lse(static_cast<std::size_t>(H * T)), dq(n), dk(n), dv(n);
  backend::Host<float> fp32;
  fp32.attention_forward(whole, q.data(), k.data(), v.data(), o.data(), lse.data());
  fp32.attention_backward(whole, q.data(), k.data(), v.data(), o.data(), d_o.data(), lse.data(), dq.data(), dk.data(),
                          dv.data());
  auto to_bf16 = [](const std::vector<float>& x) { return std::vector<bfloat16>(x.begin(), x.end()); };
  auto error = [&](const std::vector<bfloat16>& got, const std::vector<float>& ref) {
    return rel_error(std::vector<float>(got.begin(), got.end()), ref);
  };
  // One bf16 call over the whole sequence.
  const auto bq = to_bf16(q), bk = to_bf16(k), bv = to_bf16(v), bdo = to_bf16(d_o);
  std::vector<bfloat16> bo(n), bdq(n), bdk(n), bdv(n);
  std::vector<float> blse(lse.size());
  Bf16 bf16;
  bf16.attention_forward(whole, bq.data(), bk.data(), bv.data(), bo.data(), blse.data());
  bf16.attention_backward(whole, bq.data(), bk.data(), bv.data(), bo.data(), bdo.data(), blse.data(), bdq.data(),
                          bdk.data(), bdv.data());
  const double one_call[3] = {error(bdq, dq), error(bdk, dk), error(bdv, dv)};
  // The bf16 ring: rank r holds chunks r and 2 cp - 1 - r, [2][heads, L, D].
  std::vector<bfloat16> rq(n), rk(n), rv(n);
  std::mutex mutex;
  nn_test::run_ranks(cp, [&](Comm& comm) {
    const int r = comm.rank();
    const index_t chunks[2] = {r, 2 * cp - 1 - r};
    auto local = [&](const std::vector<bfloat16>& full) {
      std::vector<bfloat16> out(static_cast<std::size_t>(2 * H * L * D));
      for (int c = 0; c < 2; ++c)
        for (index_t h = 0; h < H; ++h)
          for (index_t i = 0; i < L * D; ++i)
            out[static_cast<std::size_t>((c * H + h) * L * D + i)] =
                full[static_cast<std::size_t>(h * T * D + chunks[c] * L * D + i)];
      return out;
    };
    const auto lq = local(bq), lk = local(bk), lv = local(bv), ldo = local(bdo);
    const auto m = lq.size();
    std::vector<bfloat16> lo(m), ldq(m), ldk(m), ldv(m);
    std::vector<float> llse(static_cast<std::size_t>(2 * H * L));
    kernels::AttentionArgs chunk = whole;
    chunk.q_len = chunk.kv_len = L;
    Bf16 be;
    RingAttention<Comm, Bf16> ring(comm, be, chunk, nullptr);
    ring.forward(lq.data(), lk.data(), lv.data(), lo.data(), llse.data());
    ring.backward(lq.data(), lk.data(), lv.data(), lo.data(), ldo.data(), llse.data(), ldq.data(), ldk.data(), ldv.data());
    std::lock_guard lock(mutex);
    for (int c = 0; c < 2; ++c)
      for (index_t h = 0; h < H; ++h)
        for (index_t i = 0; i < L * D; ++i) {
          const auto from = static_cast<std::size_t>((c * H + h) * L * D + i);
          const auto to = static_cast<std::size_t>(h * T * D + chunks[c] * L * D + i);
          rq[to] = ldq[from], rk[to] = ldk[from], rv[to] = ldv[from];
        }
  });
  const double ring_error[3] = {error(rq, dq), error(rk, dk), error(rv, dv)};
  for (int g = 0; g < 3; ++g) {
    INFO("gradient " << "qkv"[g] << ": ring " << ring_error[g] << ", one bf16 call " << one_call[g]);
    CHECK(one_call[g] > 0);
    CHECK(ring_error[g] <= (g == 2 ? 1.3 : 1.1) * one_call[g]);
  }
  WARN("bf16 ring cp 8 against one bf16 call, relative error of dq, dk, dv: " << ring_error[0] / one_call[0] << ", "
       << ring_error[1] / one_call[1] << ", " << ring_error[2] / one_call[2]);
}

TEST_CASE("ulysses over cp 2 and 4 equals one rank, packed or not, with tp + sp", "[nn][gpt][cp][ulysses]") {
  Collector packed, plain;
  run({}, packed);
  run({.packed = false}, plain);
  for (int cp : {2, 4}) {
    INFO("cp " << cp);
    Collector got, got_plain;
    run({.cp = cp, .mode = CpMode::ulysses, .arena = true}, got);
    check_equal(got, packed, 1e-5);
    run({.cp = cp, .packed = false, .mode = CpMode::ulysses}, got_plain);
    check_equal(got_plain, plain, 1e-5);
  }
  Collector tp_sp;
  run({.tp = 2, .sp = true, .cp = 2, .mode = CpMode::ulysses, .arena = true}, tp_sp);
  check_equal(tp_sp, packed, 2e-5);
}

TEST_CASE("hybrid cp 4 (ulysses 2 x ring 2, and 1 x 4, 4 x 1) equals one rank, packed or not", "[nn][gpt][cp][hybrid]") {
  Collector packed, plain, got, got_plain;
  run({}, packed);
  run({.packed = false}, plain);
  run({.cp = 4, .mode = CpMode::hybrid, .ulysses = 2, .arena = true}, got);
  check_equal(got, packed, 1e-5);
  run({.cp = 4, .packed = false, .mode = CpMode::hybrid, .ulysses = 2}, got_plain);
  check_equal(got_plain, plain, 1e-5);
  // The degenerate splits: groups of one rank (a ring of all cp), one group (a ring of one).
  for (int u : {1, 4}) {
    INFO("ulysses " << u);
    Collector edge;
    run({.cp = 4, .mode = CpMode::hybrid, .ulysses = u}, edge);
    check_equal(edge, packed, 1e-5);
  }
}

TEST_CASE("ulysses refuses heads that do not split over cp, on every rank", "[nn][gpt][cp][ulysses][errors]") {
  const GptConfig cfg = nn_test::tiny();  // 4 heads: 2 per tp rank, not a multiple of cp 4
  std::vector<std::string> messages(8);
  nn_test::run_ranks(8, [&](Comm& world) {
    auto mesh = comm::make_mesh<trellis::cp, trellis::tp>(world, {4, 2});
    try {
      GptModel<Comm> model(cfg, mesh.comm<trellis::tp>(), {}, {}, {}, nullptr,
                           {&mesh.comm<trellis::cp>(), CpMode::ulysses});
    } catch (const Error& e) {
      messages[static_cast<std::size_t>(world.rank())] = e.what();
    }
  });
  for (const auto& m : messages)
    CHECK_THAT(m, Catch::Contains("ulysses") && Catch::Contains("4 heads over tp 2") && Catch::Contains("(cp 4)") &&
                      Catch::Contains("not a multiple of 4"));
}

TEST_CASE("a split that does not match the cp communicator is refused", "[nn][gpt][cp][errors]") {
  const GptConfig cfg = nn_test::tiny();
  const Packed data = make_packed(cfg.vocab);
  std::vector<std::string> messages(2);
  nn_test::run_ranks(2, [&](Comm& comm) {
    Comm solo = comm.split(comm.rank(), 0);  // tp 1
    GptModel<Comm> model(cfg, solo, {}, {}, {}, nullptr, {&comm, CpMode::ring});
    TokenShape shape{kBatch, kSeq / 2};  // cp_size left at 1
    StageInput in{data.tokens.data(), nullptr, data.targets.data(), data.token_count};
    try {
      model.forward(0, shape, in, nullptr);
    } catch (const Error& e) {
      messages[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  for (const auto& m : messages) CHECK_THAT(m, Catch::Contains("split for cp rank 0 of 1") && Catch::Contains("of 2"));
}

TEST_CASE("document ids that decrease along a sample are refused", "[nn][gpt][packed][errors]") {
  const GptConfig cfg = nn_test::tiny();
  Packed data = make_packed(cfg.vocab);
  data.segments[static_cast<std::size_t>(kSeq + 25)] = 0;  // sample 1: ..., 1, 0, 1, ...
  std::string message;
  nn_test::run_ranks(1, [&](Comm& comm) {
    GptModel<Comm> model(cfg, comm);
    TokenShape shape{kBatch, kSeq};
    shape.segments = data.segments.data();
    StageInput in{data.tokens.data(), nullptr, data.targets.data(), data.token_count};
    try {
      model.forward(0, shape, in, nullptr);
    } catch (const Error& e) {
      message = e.what();
    }
  });
  CHECK_THAT(message, Catch::Contains("sample 1") && Catch::Contains("position 25") && Catch::Contains("contiguous"));
}
