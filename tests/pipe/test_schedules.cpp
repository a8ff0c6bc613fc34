// Generators and the verifier: every generator over a grid of (p, m, v) is accepted, with buffered
// and with rendezvous sends, and its compute order is the one pinned before receives were paired;
// independent structural checks (each rank's F/B/W counts, the data flow of each placement, the
// published warm-up counts); hand-made broken schedules are rejected with the rank and action named.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "trellis/pipe/generators.hpp"
#include "trellis/pipe/text.hpp"
#include "trellis/pipe/verify.hpp"

using namespace trellis::pipe;

namespace {

struct Case {
  std::string name;
  int p, m, v;
};

std::vector<Case> grid() {
  std::vector<Case> cases;
  for (const auto& name : schedule_names())
    for (int p : {1, 2, 3, 4, 5})
      for (int m : {1, 2, 3, 4, 6, 8, 10, 12}) {
        if (name == "interleaved_1f1b") {
          for (int v : {1, 2, 3})
            if (v == 1 || m % p == 0) cases.push_back({name, p, m, v});
        } else if (name == "dualpipe_v") {
          if (m >= 2 * p) cases.push_back({name, p, m, 2});
        } else {
          cases.push_back({name, p, m, 1});
        }
      }
  return cases;
}

// The rendezvous sweep: p in {2, 3, 4}, m from 1 (2p for DualPipeV) to 3p + 2, v in {1, 2, 3}
// for interleaved (m a multiple of p when v > 1).
std::vector<Case> rendezvous_sweep() {
  std::vector<Case> cases;
  for (const auto& name : schedule_names())
    for (int p : {2, 3, 4})
      for (int m = 1; m <= 3 * p + 2; ++m)
        for (int v : {1, 2, 3}) {
          if (name != "interleaved_1f1b" && v > 1) continue;
          if (name == "interleaved_1f1b" && v > 1 && m % p != 0) continue;
          if (name == "dualpipe_v" && m < 2 * p) continue;
          cases.push_back({name, p, m, v});
        }
  return cases;
}

// FNV-1a of a text.
std::uint64_t fnv1a(std::uint64_t h, const std::string& text) {
  for (char c : text) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return h;
}

// The actions of a list without its receives.
std::vector<Action> without_receives(const std::vector<Action>& list) {
  std::vector<Action> out;
  for (const auto& a : list)
    if (a.kind != ActionKind::recv) out.push_back(a);
  return out;
}

// Compute actions before each receive, by message (rank, token).
std::map<std::string, int> receive_positions(const Schedule& s) {
  std::map<std::string, int> out;
  for (int r = 0; r < s.stages; ++r) {
    int computes = 0;
    for (const auto& a : s.ranks[r]) {
      computes += a.is_compute();
      if (a.kind == ActionKind::recv) out[std::to_string(r) + ":" + action_token(a)] = computes;
    }
  }
  return out;
}

// Counts by kind, independent of the verifier.
std::tuple<int, int, int, int, int> count_kinds(const std::vector<Action>& list) {
  int f = 0, b = 0, w = 0, s = 0, r = 0;
  for (const auto& a : list) {
    f += a.kind == ActionKind::forward;
    b += a.kind == ActionKind::backward_input;
    w += a.kind == ActionKind::backward_weight;
    s += a.kind == ActionKind::send;
    r += a.kind == ActionKind::recv;
  }
  return {f, b, w, s, r};
}

std::string error_of(const Schedule& s, VerifyOptions o = {}) {
  try {
    verify(s, o);
  } catch (const trellis::Error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("every generator over a (p, m, v) grid passes the verifier", "[pipe][schedules]") {
  int checked = 0;
  for (const auto& c : grid()) {
    INFO(c.name << " p=" << c.p << " m=" << c.m << " v=" << c.v);
    Schedule s = make_schedule(c.name, c.p, c.m, c.v);
    REQUIRE(s.stages == c.p);
    REQUIRE(s.microbatches == c.m);
    REQUIRE(s.virtual_stages() == c.p * (c.name == "zb_v" || c.name == "dualpipe_v" ? 2 : c.v));
    REQUIRE_NOTHROW(verify(s));
    REQUIRE_NOTHROW(verify(s, {SendMode::rendezvous}));
    for (int r = 0; r < c.p; ++r) {
      auto [f, b, w, snd, rcv] = count_kinds(s.ranks[r]);
      REQUIRE(f == c.m * s.chunks);
      REQUIRE(b == c.m * s.chunks);
      REQUIRE(w == c.m * s.chunks);
      // messages: each chunk boundary that crosses ranks costs one message per microbatch and
      // direction (none backwards under local learning)
      int expected_sends = 0, expected_recvs = 0;
      for (int ch = 0; ch < s.chunks; ++ch) {
        const int vs = s.virtual_stage(r, ch);
        if (vs + 1 < s.virtual_stages() && s.locate(vs + 1).rank != r) expected_sends += c.m;
        if (vs > 0 && s.locate(vs - 1).rank != r) expected_recvs += c.m;
        if (!s.local_learning) {
          if (vs > 0 && s.locate(vs - 1).rank != r) expected_sends += c.m;
          if (vs + 1 < s.virtual_stages() && s.locate(vs + 1).rank != r) expected_recvs += c.m;
        }
      }
      REQUIRE(snd == expected_sends);
      REQUIRE(rcv == expected_recvs);
    }
    ++checked;
  }
  REQUIRE(checked > 200);
}

TEST_CASE("every generator passes the rendezvous check, with its compute order unchanged", "[pipe][schedules]") {
  // FNV-1a of every rank's F/B/W order over the sweep, taken at commit 341660f, before receives
  // were paired (interleaved, ZB-V and DualPipeV then failed the rendezvous check): pairing moves
  // receives only, so the bubble and the memory stay what the papers give.
  std::uint64_t compute_order_hash = 1469598103934665603ull;
  int cases = 0;
  for (const auto& c : rendezvous_sweep()) {
    INFO(c.name << " p=" << c.p << " m=" << c.m << " v=" << c.v);
    const Schedule s = make_schedule(c.name, c.p, c.m, c.v);
    REQUIRE_NOTHROW(verify(s, {SendMode::rendezvous}));
    REQUIRE_NOTHROW(verify(s));
    compute_order_hash = fnv1a(compute_order_hash, to_text(s, {.with_communication = false}));
    ++cases;
    // the placement at the consumer: each receive is followed by the action that consumes it
    const Schedule at_use = insert_communication(s, CommPlacement::at_use);
    for (int r = 0; r < c.p; ++r) {
      const auto& list = at_use.ranks[r];
      for (std::size_t i = 0; i < list.size(); ++i) {
        if (list[i].kind != ActionKind::recv) continue;
        std::size_t j = i;
        while (list[j].is_comm()) ++j;
        const auto want = list[i].direction == Direction::activation ? ActionKind::forward : ActionKind::backward_input;
        REQUIRE(list[j] == Action{want, list[i].microbatch, list[i].chunk});
      }
      // pairing keeps every compute and send where it was and moves receives only, earlier
      REQUIRE(without_receives(s.ranks[r]) == without_receives(list));
    }
    const auto paired_at = receive_positions(s), use_at = receive_positions(at_use);
    REQUIRE(paired_at.size() == use_at.size());
    for (const auto& [message, computes_before] : paired_at) REQUIRE(computes_before <= use_at.at(message));
    if (is_valid(at_use, {SendMode::rendezvous})) {
      REQUIRE(s.ranks == at_use.ranks);  // nothing to pair: left exactly as it was
    } else {
      REQUIRE((c.name == "interleaved_1f1b" || c.name == "zb_v" || c.name == "dualpipe_v"));
    }
    if (c.name != "interleaved_1f1b" && c.name != "zb_v" && c.name != "dualpipe_v") REQUIRE(s.ranks == at_use.ranks);
    // NCCL has no tags: each rank receives a peer's messages in the order the peer sends them
    for (int from = 0; from < c.p; ++from)
      for (int to = 0; to < c.p; ++to) {
        std::vector<MessageKey> sent, received;
        for (const auto& a : s.ranks[from])
          if (a.kind == ActionKind::send && a.peer == to) sent.push_back(message_key(s, from, a));
        for (const auto& a : s.ranks[to])
          if (a.kind == ActionKind::recv && a.peer == from) received.push_back(message_key(s, to, a));
        REQUIRE(sent == received);
      }
    // a compute-only text gets the same communication
    REQUIRE(same_schedule(parse_schedule(to_text(s, {.with_communication = false})), s));
  }
  REQUIRE(cases == 269);
  REQUIRE(compute_order_hash == 0xfbef984458a75f72ull);

  // three of them written out (commit 341660f)
  auto compute_lines = [](const Schedule& s) {
    std::vector<std::string> lines;
    for (const auto& list : s.ranks) {
      std::string line;
      for (const auto& a : list)
        if (a.is_compute()) {
          if (!line.empty()) line += ' ';
          line += action_token(a);
        }
      lines.push_back(line);
    }
    return lines;
  };
  REQUIRE(compute_lines(interleaved_1f1b(2, 4, 2)) ==
          std::vector<std::string>{
              "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 W0.1 F3.0 B1.1 W1.1 F2.1 B0.0 W0.0 F3.1 B1.0 W1.0 B2.1 W2.1 B3.1 W3.1 "
              "B2.0 W2.0 B3.0 W3.0",
              "F0.0 F1.0 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 F2.0 B0.0 W0.0 F3.0 B1.0 W1.0 F2.1 B2.1 W2.1 F3.1 B3.1 W3.1 "
              "B2.0 W2.0 B3.0 W3.0"});
  REQUIRE(compute_lines(zero_bubble_v(2, 4)) ==
          std::vector<std::string>{
              "F0.0 F1.0 F2.0 F0.1 B0.1 W0.1 F1.1 B1.1 B0.0 W1.1 F3.0 B1.0 W0.0 F2.1 B2.1 W1.0 W2.1 B2.0 W2.0 F3.1 "
              "B3.1 W3.1 B3.0 W3.0",
              "F0.0 F0.1 F1.0 F1.1 B0.1 B0.0 W0.1 F2.0 B1.1 B1.0 W0.0 F2.1 W1.1 F3.0 B2.1 B2.0 W1.0 F3.1 W2.1 W2.0 "
              "B3.1 B3.0 W3.1 W3.0"});
  REQUIRE(compute_lines(dualpipe_v(2, 4)) ==
          std::vector<std::string>{
              "F0.0 F1.0 F2.0 F0.1 B0.1 W0.1 F1.1 F3.0 B1.1 W1.1 F2.1 B0.0 W0.0 B2.1 W2.1 F3.1 B1.0 W1.0 B3.1 W3.1 "
              "B2.0 W2.0 B3.0 W3.0",
              "F0.0 F0.1 F1.0 F1.1 F2.0 B0.1 W0.1 F2.1 B0.0 W0.0 F3.0 B1.1 W1.1 F3.1 B1.0 W1.0 B2.1 W2.1 B2.0 W2.0 "
              "B3.1 B3.0 W3.1 W3.0"});

  // Megatron's pairs on interleaved rank 1: the next forward's input comes with the last
  // forward's output (send_forward_recv_forward), the next gradient with the last one
  // (send_backward_recv_backward)
  const std::string rank1 = to_text(interleaved_1f1b(2, 4, 2));
  REQUIRE(contains(rank1, "F2.0 Sa2.0>0 Ra3.0<0 B0.0"));
  REQUIRE(contains(rank1, "W0.0 Sg0.0>0 Rg1.0<0 F3.0"));
}

TEST_CASE("insert_communication leaves an order that deadlocks to the verifier", "[pipe][schedules]") {
  // rank 0 wants the gradient of microbatch 0 before it forwards microbatch 1; rank 1 wants
  // microbatch 1 before it returns that gradient
  const Schedule s = parse_schedule("@ backward=full\nF0 B0 W0 F1 B1 W1\nF0 F1 B0 W0 B1 W1\n");
  REQUIRE(s.ranks == insert_communication(s, CommPlacement::at_use).ranks);
  REQUIRE_THAT(error_of(s), Catch::Contains("deadlock (buffered sends)") && Catch::Contains("a cycle of waits"));
}

TEST_CASE("placements map virtual stages to ranks and chunks", "[pipe][schedules]") {
  Schedule loop = interleaved_1f1b(4, 8, 3);
  for (int s = 0; s < 12; ++s) {
    auto slot = loop.locate(s);
    REQUIRE(slot.rank == s % 4);
    REQUIRE(slot.chunk == s / 4);
    REQUIRE(loop.virtual_stage(slot.rank, slot.chunk) == s);
  }
  Schedule vee = zero_bubble_v(4, 8);
  // down the ranks on chunk 0, back up on chunk 1: rank 3 holds stages 3 and 4, rank 0 holds 0 and 7
  REQUIRE(vee.virtual_stage(0, 0) == 0);
  REQUIRE(vee.virtual_stage(0, 1) == 7);
  REQUIRE(vee.virtual_stage(3, 0) == 3);
  REQUIRE(vee.virtual_stage(3, 1) == 4);
  for (int s = 0; s < 8; ++s) REQUIRE(vee.virtual_stage(vee.locate(s).rank, vee.locate(s).chunk) == s);
  // the V turn is on one rank: no message between stages 3 and 4
  for (const auto& a : vee.ranks[3])
    if (a.is_comm()) REQUIRE(a.peer == 2);
}

TEST_CASE("1F1B and interleaved warm-up counts follow the papers", "[pipe][schedules]") {
  const int p = 4, m = 8;
  auto s = one_f_one_b(p, m);
  for (int r = 0; r < p; ++r) {
    int warmup = 0;
    for (const auto& a : s.ranks[r]) {
      if (a.kind == ActionKind::backward_input) break;
      warmup += a.kind == ActionKind::forward;
    }
    REQUIRE(warmup == p - r);  // p-1-r warm-up forwards plus the first steady-state forward
  }
  const int v = 2;
  auto il = interleaved_1f1b(p, m, v);
  for (int r = 0; r < p; ++r) {
    int warmup = 0;
    for (const auto& a : il.ranks[r]) {
      if (a.kind == ActionKind::backward_input) break;
      warmup += a.kind == ActionKind::forward;
    }
    REQUIRE(warmup == (p - r - 1) * 2 + (v - 1) * p + 1);  // Megatron-LM's formula, + 1 steady F
  }
  // GPipe: all forwards first
  auto g = gpipe(p, m);
  for (int r = 0; r < p; ++r) {
    int f_seen = 0;
    for (const auto& a : g.ranks[r]) {
      if (a.kind == ActionKind::forward) ++f_seen;
      if (a.kind == ActionKind::backward_input) REQUIRE(f_seen == m);
    }
  }
}

TEST_CASE("generators reject impossible parameters with clear errors", "[pipe][schedules]") {
  REQUIRE_THROWS_WITH(interleaved_1f1b(4, 6, 2), Catch::Contains("multiple of stages"));
  REQUIRE_THROWS_WITH(dualpipe_v(4, 7), Catch::Contains(">= 2 * stages"));
  REQUIRE_THROWS_WITH(gpipe(0, 4), Catch::Contains("stages (p) must be >= 1"));
  REQUIRE_THROWS_WITH(one_f_one_b(2, 0), Catch::Contains("microbatches (m) must be >= 1"));
  REQUIRE_THROWS_WITH(make_schedule("pipedream", 2, 2), Catch::Contains("unknown schedule 'pipedream'"));
}

TEST_CASE("split_layers covers every layer once, unevenly when needed", "[pipe][schedules]") {
  for (int parts = 1; parts <= 8; ++parts)
    for (int layers = parts; layers <= 30; ++layers) {
      auto b = split_layers(layers, parts);
      REQUIRE(b.size() == static_cast<std::size_t>(parts) + 1);
      REQUIRE(b.front() == 0);
      REQUIRE(b.back() == layers);
      int smallest = layers, largest = 0;
      for (int i = 0; i < parts; ++i) {
        smallest = std::min(smallest, b[i + 1] - b[i]);
        largest = std::max(largest, b[i + 1] - b[i]);
      }
      REQUIRE(smallest >= 1);
      REQUIRE(largest - smallest <= 1);
    }
  REQUIRE(split_layers(7, 3) == std::vector<int>{0, 3, 5, 7});
  REQUIRE_THROWS_WITH(split_layers(3, 4), Catch::Contains("cannot split 3 layers over 4 chunks"));
}

TEST_CASE("verifier: a missing receive is named", "[pipe][verify]") {
  Schedule s = one_f_one_b(3, 4);
  auto& list = s.ranks[2];
  for (std::size_t i = 0; i < list.size(); ++i)
    if (list[i] == recv_action(Direction::activation, 2, 0, 1)) {
      list.erase(list.begin() + static_cast<long>(i));
      break;
    }
  auto msg = error_of(s);
  INFO(msg);
  REQUIRE(contains(msg, "rank 1"));
  REQUIRE(contains(msg, "Sa2.0>2"));
  REQUIRE(contains(msg, "no matching receive"));
  REQUIRE(contains(msg, "Ra2.0<1"));
}

TEST_CASE("verifier: an action before its input is named", "[pipe][verify]") {
  // F1 before its recv on rank 1
  Schedule s = gpipe(2, 2);
  auto& list = s.ranks[1];
  REQUIRE(list[2] == recv_action(Direction::activation, 1, 0, 0));
  REQUIRE(list[3] == forward_action(1, 0));
  std::swap(list[2], list[3]);
  auto msg = error_of(s);
  INFO(msg);
  REQUIRE(contains(msg, "rank 1"));
  REQUIRE(contains(msg, "forward of microbatch 1, chunk 0 (F1.0) runs before its input"));
  REQUIRE(contains(msg, "Ra1.0<0"));
  REQUIRE(contains(msg, "comes later"));

  // W before B
  Schedule t = one_f_one_b(2, 2);
  auto& l0 = t.ranks[0];
  for (std::size_t i = 0; i + 1 < l0.size(); ++i)
    if (l0[i].kind == ActionKind::backward_input && l0[i + 1].kind == ActionKind::backward_weight) {
      std::swap(l0[i], l0[i + 1]);
      break;
    }
  msg = error_of(t);
  INFO(msg);
  REQUIRE(contains(msg, "rank 0"));
  REQUIRE(contains(msg, "backward-weight of microbatch 0, chunk 0 (W0.0) runs before its input"));
}

TEST_CASE("verifier: a cyclic wait is a deadlock naming the ranks", "[pipe][verify]") {
  // Both ranks receive before they send: rank 1 waits for rank 0's activation while rank 0 waits
  // for rank 1's gradient of microbatch 0 before it has sent microbatch 1... build it by hand.
  Schedule s;
  s.name = "cycle";
  s.stages = 2;
  s.microbatches = 2;
  s.ranks = {
      {forward_action(0), send_action(Direction::activation, 0, 0, 1),
       recv_action(Direction::gradient, 0, 0, 1), backward_input_action(0), backward_weight_action(0),
       forward_action(1), send_action(Direction::activation, 1, 0, 1),
       recv_action(Direction::gradient, 1, 0, 1), backward_input_action(1), backward_weight_action(1)},
      // rank 1 wants microbatch 1 before it returns the gradient of microbatch 0
      {recv_action(Direction::activation, 0, 0, 0), forward_action(0),
       recv_action(Direction::activation, 1, 0, 0), forward_action(1), backward_input_action(0),
       send_action(Direction::gradient, 0, 0, 0), backward_weight_action(0), backward_input_action(1),
       send_action(Direction::gradient, 1, 0, 0), backward_weight_action(1)},
  };
  auto msg = error_of(s);
  INFO(msg);
  REQUIRE(contains(msg, "deadlock (buffered sends)"));
  REQUIRE(contains(msg, "rank 0 waits at action 2, recv gradient of microbatch 0"));
  REQUIRE(contains(msg, "rank 1 waits at action 2, recv activation of microbatch 1"));
  REQUIRE(contains(msg, "a cycle of waits"));
}

TEST_CASE("verifier: rendezvous mode catches what buffered sends hide", "[pipe][verify]") {
  // Consecutive send/recv actions are posted together (a batch, like Megatron's
  // send_forward_recv_backward), so the 1F1B family with one chunk survives synchronous sends.
  for (const auto& s :
       {gpipe(4, 6), one_f_one_b(4, 8), zero_bubble_h1(4, 8), zero_bubble_h2(4, 8), local_learning(4, 6)}) {
    INFO(s.name);
    REQUIRE(error_of(s, {SendMode::rendezvous}).empty());
  }
  // Hand-made: rank 0 runs GPipe-style, rank 1 1F1B-style. With buffered sends that is fine; with
  // synchronous sends rank 1 blocks sending the gradient of microbatch 0 while rank 0 blocks
  // sending the activation of microbatch 1 (each waits for a recv the other has not reached).
  Schedule s;
  s.name = "mixed";
  s.stages = 2;
  s.microbatches = 3;
  using D = Direction;
  s.ranks = {
      {forward_action(0), send_action(D::activation, 0, 0, 1), forward_action(1),
       send_action(D::activation, 1, 0, 1), forward_action(2), send_action(D::activation, 2, 0, 1),
       recv_action(D::gradient, 0, 0, 1), backward_input_action(0), backward_weight_action(0),
       recv_action(D::gradient, 1, 0, 1), backward_input_action(1), backward_weight_action(1),
       recv_action(D::gradient, 2, 0, 1), backward_input_action(2), backward_weight_action(2)},
      {recv_action(D::activation, 0, 0, 0), forward_action(0), backward_input_action(0),
       send_action(D::gradient, 0, 0, 0), backward_weight_action(0), recv_action(D::activation, 1, 0, 0),
       forward_action(1), backward_input_action(1), send_action(D::gradient, 1, 0, 0),
       backward_weight_action(1), recv_action(D::activation, 2, 0, 0), forward_action(2),
       backward_input_action(2), send_action(D::gradient, 2, 0, 0), backward_weight_action(2)},
  };
  REQUIRE(error_of(s).empty());
  auto msg = error_of(s, {SendMode::rendezvous});
  INFO(msg);
  REQUIRE(contains(msg, "deadlock (rendezvous sends)"));
  REQUIRE(contains(msg, "rank 0 waits at action 3, send activation of microbatch 1, chunk 0 to rank 1"));
  REQUIRE(contains(msg, "rank 1 waits at action 3, send gradient of microbatch 0, chunk 0 to rank 0"));
  REQUIRE(contains(msg, "a cycle of waits"));
  // Megatron's interleaved order with every receive right before its consumer needs buffered
  // sends; the vee orders so placed also receive a peer's messages out of the order it sends them
  // (NCCL, which has no tags, would hand them the wrong data). Paired (the default), all pass.
  const auto il = insert_communication(interleaved_1f1b(4, 8, 2), CommPlacement::at_use);
  REQUIRE(error_of(il).empty());
  auto cycle = error_of(il, {SendMode::rendezvous});
  INFO(cycle);
  REQUIRE(contains(cycle, "deadlock (rendezvous sends)"));
  REQUIRE(contains(cycle, "a cycle of waits"));
  for (const auto& vee : {zero_bubble_v(4, 8), dualpipe_v(4, 8)}) {
    const auto at_use = insert_communication(vee, CommPlacement::at_use);
    REQUIRE(error_of(at_use).empty());
    REQUIRE(contains(error_of(at_use, {SendMode::rendezvous}), "must be received in the order sent"));
  }
  for (const auto& paired : {interleaved_1f1b(4, 8, 2), zero_bubble_v(4, 8), dualpipe_v(4, 8)})
    REQUIRE(error_of(paired, {SendMode::rendezvous}).empty());
}

TEST_CASE("verifier: rendezvous mode wants a peer's messages received in the order sent", "[pipe][verify]") {
  // interleaved rank 1 receives activation 2 and then gradient 0 from rank 0, the order rank 0
  // sends them; swapped, the abstract run still finishes (it matches by message), NCCL would not
  Schedule s = interleaved_1f1b(2, 4, 2);
  auto& list = s.ranks[1];
  auto it = std::find(list.begin(), list.end(), recv_action(Direction::activation, 2, 0, 0));
  REQUIRE(it + 1 != list.end());
  REQUIRE(*(it + 1) == recv_action(Direction::gradient, 0, 0, 0));
  std::iter_swap(it, it + 1);
  REQUIRE(error_of(s).empty());
  auto msg = error_of(s, {SendMode::rendezvous});
  INFO(msg);
  REQUIRE(contains(msg, "rank 1: recv gradient of microbatch 0, chunk 0 from rank 0 (Rg0.0<0) is received where "
                        "rank 0 sends Sa2.0>1"));
}

TEST_CASE("verifier: duplicate, missing and misrouted actions", "[pipe][verify]") {
  auto s = one_f_one_b(2, 3);
  s.ranks[0].push_back(forward_action(1));
  REQUIRE_THAT(error_of(s), Catch::Contains("rank 0: forward of microbatch 1, chunk 0 (F1.0) runs 2 times"));

  s = one_f_one_b(2, 3);
  std::erase(s.ranks[1], backward_weight_action(2));
  REQUIRE_THAT(error_of(s),
               Catch::Contains("rank 1: backward-weight of microbatch 2, chunk 0 (W2.0) never runs"));

  s = one_f_one_b(2, 3);
  s.ranks[0][0].microbatch = 7;
  REQUIRE_THAT(error_of(s), Catch::Contains("microbatch 7 is out of range [0, 3)"));

  s = one_f_one_b(3, 3);  // rank 0 sends its activation to rank 2 instead of rank 1
  for (auto& a : s.ranks[0])
    if (a.kind == ActionKind::send) a.peer = 2;
  REQUIRE_THAT(error_of(s), Catch::Contains("does not follow the data flow"));

  s = local_learning(2, 2);
  s.ranks[1].insert(s.ranks[1].begin() + 3, send_action(Direction::gradient, 0, 0, 0));
  REQUIRE_THAT(error_of(s), Catch::Contains("local-learning schedule sends no gradients"));
}
