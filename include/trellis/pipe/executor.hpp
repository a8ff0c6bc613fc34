// The executor: runs a verified schedule on real stages over any Communicator, with asynchronous
// point-to-point messages (isend/irecv), and records a timeline of what really ran. A run of
// consecutive send/recv actions is posted at once; each receive is waited for right before the
// action that consumes it (the verifier, buffered mode, waits for it at its run already, so what
// it proves deadlock-free holds here too, and a receive posted early costs no early wait); sends
// complete in the background, their buffers kept until then.
//
// A rank's stage object holds this rank's chunks and satisfies trellis::pipe::Stage:
//   value_type                               element type of activations and gradients
//   input_size(chunk), output_size(chunk)    elements of one microbatch's input / output activation
//                                            of that chunk (also the sizes of the gradients)
//   forward(mb, chunk, input, output)        input is empty for the model's first stage (the stage
//                                            reads its own microbatch); the last stage computes its
//                                            loss and may have output_size 0
//   backward_input(mb, chunk, grad_output, grad_input)
//                                            B: grad_output is empty where the stage's own loss
//                                            starts the backward (last stage, or every stage under
//                                            local learning); grad_input is empty where nobody
//                                            needs it (first stage, local learning)
//   backward_weight(mb, chunk)               W: accumulate parameter gradients (summed over the
//                                            step's microbatches) and free what F/B kept for mb
//   allocate(n)  (optional)                  an owning buffer of n value_type (data(), size()) in the
//                                            stage's memory: the executor's activation and gradient
//                                            buffers (device memory for a device backend). Without
//                                            it they are std::vector.
// The spans are valid only during the call: a stage copies what it keeps. The executor frees its
// own buffers as soon as they are consumed (sent, or passed to the next chunk on the same rank);
// an activation counts as alive from its F to its W (ExecutionResult::peak_live_activations).
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <span>
#include <utility>
#include <vector>

#include "trellis/comm/communicator.hpp"
#include "trellis/core/config.hpp"
#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"
#include "trellis/pipe/schedule.hpp"
#include "trellis/pipe/timeline.hpp"
#include "trellis/pipe/verify.hpp"

namespace trellis::pipe {

template <class S>
concept Stage = requires(S& s, const S& cs, int mb, int chunk, std::span<const typename S::value_type> in,
                         std::span<typename S::value_type> out) {
  typename S::value_type;
  requires Element<typename S::value_type>;
  { cs.input_size(chunk) } -> std::convertible_to<std::size_t>;
  { cs.output_size(chunk) } -> std::convertible_to<std::size_t>;
  s.forward(mb, chunk, in, out);
  s.backward_input(mb, chunk, in, out);
  s.backward_weight(mb, chunk);
};

namespace detail {
// The executor's buffers: the stage's own (allocate(n)) where it has them, else host vectors.
template <class S>
auto stage_buffer(const S& stage, std::size_t n) {
  if constexpr (requires { stage.allocate(n); })
    return stage.allocate(n);
  else
    return std::vector<typename S::value_type>(n);
}
template <class S>
using stage_buffer_t = decltype(stage_buffer(std::declval<const S&>(), std::size_t{}));
template <class Buf>
auto view(Buf& b) { return std::span(b.data(), b.size()); }
template <class Buf>
auto const_view(const Buf& b) { return std::span(b.data(), b.size()); }
}  // namespace detail

struct ExecuteOptions {
  // Time zero of the recorded timeline. Give every rank the same origin (ThreadWorld: one clock
  // read before run) so the ranks' timelines line up; by default each rank uses its own start.
  std::chrono::steady_clock::time_point origin{};
  bool verify = true;  // verify the schedule before running (every rank, cheap)
  // How a run of consecutive send/recv actions goes out:
  //   isend: each operation on its own (isend/irecv), each receive waited for by its consumer,
  //          sends left to complete in the background. Needs the schedule to pass verify() with
  //          buffered sends.
  //   batch: the run as one comm.batch() (an NCCL group), waited for as a whole. Safe for backends
  //          whose point-to-point operations must be grouped; needs the schedule to pass verify()
  //          with rendezvous sends (checked first when `verify` is set).
  enum class P2P : std::uint8_t { isend, batch } p2p = P2P::isend;
};

struct ExecutionResult {
  std::vector<TimedAction> events;  // this rank's actions, seconds since the origin, in list
                                    // order except that a receive comes right before its
                                    // consumer: isend mode records the wait for its data there
                                    // (batch mode: the run, from its posting to its completion)
  int peak_live_activations = 0;    // (mb, chunk) activations alive at once, F to W
  double seconds = 0;               // wall time of this rank's run
};

// Message tag: unique per (direction, microbatch, consuming virtual stage) within one step.
inline int message_tag(const Schedule& s, int rank, const Action& a) {
  auto [dir, mb, consumer] = detail::message_of(s, rank, a);
  return (mb * s.virtual_stages() + consumer) * 2 + dir;
}

template <comm::Communicator Comm, Stage S>
ExecutionResult execute(Comm& comm, const Schedule& schedule, S& stage, const ExecuteOptions& options = {}) {
  using T = typename S::value_type;
  using Buf = detail::stage_buffer_t<S>;
  using clock = std::chrono::steady_clock;
  const int rank = comm.rank();
  if (comm.size() != schedule.stages)
    TRELLIS_THROW("pipe::execute: schedule '", schedule.name, "' has ", schedule.stages,
                  " stages but the communicator has ", comm.size(), " ranks");
  const bool batched = options.p2p == ExecuteOptions::P2P::batch;
  if (options.verify) verify(schedule, {batched ? SendMode::rendezvous : SendMode::buffered});
  const auto origin = options.origin == clock::time_point{} ? clock::now() : options.origin;
  auto seconds_since = [&](clock::time_point t) { return std::chrono::duration<double>(t - origin).count(); };

  using Key = std::pair<int, int>;               // (microbatch, chunk)
  std::map<Key, Buf> activation_in;   // input of F(mb, chunk): received or local
  std::map<Key, Buf> gradient_in;     // output gradient for B(mb, chunk)
  std::map<Key, Buf> activation_out;  // F's output waiting for its send
  std::map<Key, Buf> gradient_out;    // B's input gradient waiting for its send
  struct PendingSend {
    typename Comm::request_type request;
    Buf buffer;  // kept alive until the send completes
  };
  std::deque<PendingSend> sends;

  ExecutionResult result;
  int live = 0;
  const auto t_begin = clock::now();
  auto take = [&](std::map<Key, Buf>& from, Key key, const Action& a, const char* what) {
    auto it = from.find(key);
    if (it == from.end())
      TRELLIS_THROW("pipe::execute: rank ", rank, ": ", describe(a), " has no ", what,
                    " (schedule not verified?)");
    Buf out = std::move(it->second);
    from.erase(it);
    return out;
  };

  const auto& list = schedule.ranks[rank];
  struct PendingRecv {
    typename Comm::request_type request;
    Buf buffer;
    std::size_t action;  // index in the rank's list
  };
  std::map<std::pair<Direction, Key>, PendingRecv> recvs;  // posted, not yet consumed (isend mode)
  // Waits for the receive that feeds a compute action, if it has one, and hands its data over.
  auto await_input = [&](Direction d, Key key) {
    auto it = recvs.find({d, key});
    if (it == recvs.end()) return;
    const double waited = seconds_since(clock::now());
    it->second.request.wait();
    (d == Direction::activation ? activation_in : gradient_in)[key] = std::move(it->second.buffer);
    result.events.push_back({rank, list[it->second.action], waited, seconds_since(clock::now())});
    recvs.erase(it);
  };
  std::vector<Buf> buffers;  // the current run's buffers (batch mode)
  try {
    for (std::size_t i = 0; i < list.size();) {
      const Action& a = list[i];
      const Key key{a.microbatch, a.chunk};
      if (a.kind == ActionKind::forward) await_input(Direction::activation, key);
      if (a.kind == ActionKind::backward_input) await_input(Direction::gradient, key);
      const auto start = clock::now();
      if (a.is_comm() && batched) {
        // the whole run as one batch, waited for as a whole
        std::size_t end = i;
        while (end < list.size() && list[end].is_comm()) ++end;
        buffers.clear();
        std::vector<comm::P2POp> ops;
        buffers.reserve(end - i);
        for (std::size_t j = i; j < end; ++j) {
          const Action& c = list[j];
          const bool act = c.direction == Direction::activation;
          if (c.kind == ActionKind::send)
            buffers.push_back(take(act ? activation_out : gradient_out, {c.microbatch, c.chunk}, c,
                                   act ? "output activation" : "input gradient"));
          else
            buffers.push_back(detail::stage_buffer(
                stage, static_cast<std::size_t>(act ? stage.input_size(c.chunk) : stage.output_size(c.chunk))));
          ops.push_back(
              comm::P2POp{c.kind == ActionKind::send ? comm::P2POp::Kind::send : comm::P2POp::Kind::recv,
                          buffers.back().data(), buffers.back().size(), dtype_v<T>, c.peer,
                          message_tag(schedule, rank, c)});
        }
        comm.batch(std::span<const comm::P2POp>(ops)).wait();
        const double done = seconds_since(clock::now());
        for (std::size_t j = i; j < end; ++j) {
          const Action& c = list[j];
          if (c.kind == ActionKind::recv)
            (c.direction == Direction::activation ? activation_in : gradient_in)[{c.microbatch, c.chunk}] =
                std::move(buffers[j - i]);
          result.events.push_back({rank, c, seconds_since(start), done});
        }
        i = end;
        continue;
      }
      if (a.is_comm()) {
        // a run of consecutive send/recv actions is posted at once (as the verifier assumes); its
        // receives are waited for by their consumers, sends complete in the background
        std::size_t end = i;
        for (; end < list.size() && list[end].is_comm(); ++end) {
          const Action& c = list[end];
          const Key ckey{c.microbatch, c.chunk};
          const auto posted = clock::now();
          if (c.kind == ActionKind::send) {
            auto& from = c.direction == Direction::activation ? activation_out : gradient_out;
            Buf buffer = take(
                from, ckey, c, c.direction == Direction::activation ? "output activation" : "input gradient");
            auto request = comm.isend(buffer.data(), buffer.size(), c.peer, message_tag(schedule, rank, c));
            sends.push_back(PendingSend{std::move(request), std::move(buffer)});
            result.events.push_back({rank, c, seconds_since(posted), seconds_since(clock::now())});
          } else {
            const bool act = c.direction == Direction::activation;
            if (recvs.count({c.direction, ckey}))
              TRELLIS_THROW("pipe::execute: rank ", rank, ": ", describe(c),
                            " is posted twice (schedule not verified?)");
            Buf buffer = detail::stage_buffer(
                stage, static_cast<std::size_t>(act ? stage.input_size(c.chunk) : stage.output_size(c.chunk)));
            auto request = comm.irecv(buffer.data(), buffer.size(), c.peer, message_tag(schedule, rank, c));
            recvs.emplace(std::pair{c.direction, ckey}, PendingRecv{std::move(request), std::move(buffer), end});
          }
        }
        i = end;
        while (!sends.empty() && sends.front().request.test()) sends.pop_front();  // free sent buffers
        continue;
      }
      const bool first = schedule.is_first(rank, a.chunk);
      const bool last = schedule.is_last(rank, a.chunk);
      switch (a.kind) {
        case ActionKind::forward: {
          Buf input;
          if (!first) input = take(activation_in, key, a, "input activation");
          Buf output = detail::stage_buffer(stage, static_cast<std::size_t>(stage.output_size(a.chunk)));
          ++live;
          result.peak_live_activations = std::max(result.peak_live_activations, live);
          stage.forward(a.microbatch, a.chunk, std::span<const T>(detail::const_view(input)), detail::view(output));
          if (!last) {
            auto next = schedule.next_slot(rank, a.chunk);
            if (next.rank == rank)
              activation_in[{a.microbatch, next.chunk}] = std::move(output);
            else
              activation_out[key] = std::move(output);
          }
          break;
        }
        case ActionKind::backward_input: {
          const bool own_loss = last || schedule.local_learning;
          const bool pass_back = !first && !schedule.local_learning;
          Buf grad_output;
          if (!own_loss) grad_output = take(gradient_in, key, a, "output gradient");
          Buf grad_input =
              detail::stage_buffer(stage, pass_back ? static_cast<std::size_t>(stage.input_size(a.chunk)) : 0);
          stage.backward_input(a.microbatch, a.chunk, std::span<const T>(detail::const_view(grad_output)),
                               detail::view(grad_input));
          if (pass_back) {
            auto prev = schedule.prev_slot(rank, a.chunk);
            if (prev.rank == rank)
              gradient_in[{a.microbatch, prev.chunk}] = std::move(grad_input);
            else
              gradient_out[key] = std::move(grad_input);
          }
          break;
        }
        default:  // backward_weight
          stage.backward_weight(a.microbatch, a.chunk);
          --live;
          break;
      }
      result.events.push_back({rank, a, seconds_since(start), seconds_since(clock::now())});
      while (!sends.empty() && sends.front().request.test()) sends.pop_front();  // free sent buffers
      ++i;
    }
    for (auto& pending : sends) pending.request.wait();
    while (!recvs.empty()) await_input(recvs.begin()->first.first, recvs.begin()->first.second);
  } catch (...) {
    // Operations may still be in flight (a peer can still read a send buffer or write a receive
    // buffer), and waiting for them could hang now that this rank has failed: their requests and
    // buffers are deliberately leaked instead of freed under the peer's feet.
    struct InFlight {
      std::deque<PendingSend> sends;
      std::map<std::pair<Direction, Key>, PendingRecv> recvs;
      std::vector<Buf> buffers;
    };
    auto* leaked = new InFlight{std::move(sends), std::move(recvs), std::move(buffers)};
    TRELLIS_LSAN_IGNORE_OBJECT(leaked);  // leaked on purpose: LeakSanitizer must not report it
    throw;
  }
  result.seconds = std::chrono::duration<double>(clock::now() - t_begin).count();
  return result;
}

// Collects every rank's events into one timeline (for pictures and statistics).
inline Timeline merge_timelines(int stages, const std::vector<ExecutionResult>& per_rank) {
  Timeline t;
  t.stages = stages;
  for (const auto& r : per_rank) t.events.insert(t.events.end(), r.events.begin(), r.events.end());
  return t;
}

}  // namespace trellis::pipe
