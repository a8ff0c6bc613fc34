// MpiCommState: the state of one MpiComm shared with its requests -- its MPI communicators,
// flight recorder and settings, waiting with a deadline, and the diagnosis of failures: the
// timeout error, arrival queries naming the ranks that never came, and the debug-mode
// fingerprint and all_to_allv count checks (part of comm/mpi.hpp).
// Needs MPI (under comm/mpi/: built only with trellis::mpi).
#pragma once

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "trellis/comm/mpi/fault.hpp"
#include "trellis/comm/mpi/pending.hpp"
#include "trellis/comm/recorder.hpp"
#include "trellis/core/buffer.hpp"
#include "trellis/core/check_mpi.hpp"
#include "trellis/core/config.hpp"
#include "trellis/core/error.hpp"

namespace trellis::comm {

namespace detail {

// A small message this rank sent on the control channel (arrival query or answer), kept alive
// until MPI is done with it.
struct MpiControlSend {
  OpFingerprint fp;
  MPI_Request request = MPI_REQUEST_NULL;
};

// The state of one MpiComm, shared with its requests (a request may outlive a moved communicator
// handle, never the state).
struct MpiCommState {
  MPI_Comm comm = MPI_COMM_NULL;     // data traffic
  MPI_Comm control = MPI_COMM_NULL;  // debug fingerprint exchange, arrival queries
  int rank = 0;
  int size = 1;
  std::vector<int> world_ranks;      // world rank of each rank of this communicator
  bool world_order = true;           // rank r is world rank r for every r, and all are here
  FlightRecorder recorder;
  bool debug = false;
  std::chrono::milliseconds timeout{0};
  std::uint64_t collectives = 0;     // collective sequence number (equal on every rank)
  int tag_upper_bound = 32767;       // MPI_TAG_UB (the standard's minimum until queried)
  std::string failure;               // why the communicator is unusable; empty while healthy
  std::vector<std::unique_ptr<MpiPending>> abandoned;  // timed-out operations, maybe in flight
  // Arrival queries (a collective timed out without debug mode): the last query each rank sent
  // here, i.e. the call it was waiting in when it timed out, and our sends still in flight.
  static constexpr int arrival_query_tag = 1, arrival_answer_tag = 2;  // control channel (0: debug)
  std::vector<std::optional<OpFingerprint>> queried_from;
  std::vector<std::unique_ptr<MpiControlSend>> control_sends;

  MpiCommState() = default;
  MpiCommState(const MpiCommState&) = delete;
  MpiCommState& operator=(const MpiCommState&) = delete;

  ~MpiCommState() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    if (mpi_faulted()) {
      // No MPI call at all (any may progress an abandoned operation into freed memory): what MPI
      // may still use is leaked, and the communicators are left to MPI_Abort.
      for (auto& p : abandoned) TRELLIS_LSAN_IGNORE_OBJECT(p.release());
      for (auto& c : control_sends) TRELLIS_LSAN_IGNORE_OBJECT(c.release());
      return;
    }
    for (auto& p : abandoned) {
      int flag = 0;
      if (!p->requests.empty())
        MPI_Testall(static_cast<int>(p->requests.size()), p->requests.data(), &flag, MPI_STATUSES_IGNORE);
      // Still in flight: MPI may write into its buffers later, so they are never freed.
      if (!p->requests.empty() && !flag) (void)p.release();
    }
    for (auto& c : control_sends) {
      int flag = 0;
      MPI_Test(&c->request, &flag, MPI_STATUS_IGNORE);
      if (!flag) (void)c.release();  // 24 bytes MPI may still read
    }
    if (control != MPI_COMM_NULL) MPI_Comm_free(&control);
    if (comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  }

  // "rank 2" or, in a communicator whose ranks are not the world's, "rank 2 (world rank 5)".
  std::string name_rank(int r) const {
    std::ostringstream out;
    out << "rank " << r;
    if (!world_order && r >= 0 && r < static_cast<int>(world_ranks.size()))
      out << " (world rank " << world_ranks[r] << ")";
    return out.str();
  }

  std::string where() const {
    std::ostringstream out;
    out << "on rank " << rank << " of " << size << " of communicator '" << recorder.label() << "'";
    return out.str();
  }

  void check_usable() const {
    if (!failure.empty()) [[unlikely]]
      TRELLIS_THROW("communicator '", recorder.label(), "' is unusable after an earlier failure: ", failure);
  }

  bool forever() const { return timeout.count() <= 0; }

  std::chrono::steady_clock::time_point deadline() const {
    return std::chrono::steady_clock::now() + (forever() ? std::chrono::milliseconds(0) : timeout);
  }

  // Raises the timeout error for `call`, keeping the operation's buffers alive for MPI.
  [[noreturn]] void timed_out(std::unique_ptr<MpiPending> pending, const OpFingerprint& call,
                              const std::string& who) {
    recorder.failed(call.seq);
    std::ostringstream out;
    out << call.describe() << " timed out after " << timeout.count() << " ms " << where() << ": "
        << who << ". The communicator is unusable from now on.\n"
        << recorder.dump(8);
    failure = out.str();
    mpi_record_fault(call.describe() + " timed out after " + std::to_string(timeout.count()) + " ms " + where());
    if (pending) abandoned.push_back(std::move(pending));
    TRELLIS_THROW(failure);
  }

  // Keeps an operation that is given up while it may be in flight (its request was destroyed by
  // an exception, or after a fault) and records the fault: nothing waits for it any more.
  void abandon(std::unique_ptr<MpiPending> pending, const char* why) noexcept {
    recorder.failed(pending->call.seq);
    try {
      mpi_record_fault(pending->call.describe() + " " + why + " " + where());
      abandoned.push_back(std::move(pending));
    } catch (...) {
      TRELLIS_LSAN_IGNORE_OBJECT(pending.release());  // MPI may still use it
    }
  }

  // Waits for a started operation (blocking form) and finishes it.
  void finish(std::unique_ptr<MpiPending> pending) {
    const OpFingerprint call = pending->call;
    bool timed = false;
    try {
      const bool collective = !op_is_point_to_point(call.kind) && size > 1;
      const auto answer = [&] {
        if (collective) answer_arrival_queries(call);
      };
      if (!mpi_wait_until(*pending, deadline(), forever(), answer)) {
        std::string who;
        if (collective) who = ask_who_arrived(*pending, call);
        else who = "the peer never posted its side";
        if (!who.empty()) {  // (empty: a late rank arrived while we asked, and the call completed)
          if (debug) who = "every rank passed the debug fingerprint check; " + who;
          timed = true;
          timed_out(std::move(pending), call, who);
        }
      }
      pending->complete();
    } catch (const Error& e) {
      recorder.failed(call.seq);
      if (timed) throw;  // the timeout error, complete already
      throw Error(call.describe() + " failed " + where() + ": " + e.message(), e.file(), e.line(), e.rank());
    } catch (...) {
      recorder.failed(call.seq);
      throw;
    }
    recorder.completed(call.seq);
  }

  // Sends `fp` to `peer` on the control channel with `tag` (nonblocking; kept until done).
  void send_control(const OpFingerprint& fp, int peer, int tag) {
    std::erase_if(control_sends, [](const std::unique_ptr<MpiControlSend>& c) {
      int flag = 0;
      MPI_Test(&c->request, &flag, MPI_STATUS_IGNORE);
      return flag != 0;
    });
    auto c = std::make_unique<MpiControlSend>();
    c->fp = fp;
    TRELLIS_CHECK_MPI(MPI_Isend(&c->fp, static_cast<int>(sizeof(OpFingerprint)), MPI_BYTE, peer, tag, control, &c->request));
    control_sends.push_back(std::move(c));
  }

  // While waiting in `current` (for a millisecond or more): answers every arrival query that came
  // in with the call this rank is waiting in, and remembers who asked about which call.
  void answer_arrival_queries(const OpFingerprint& current) {
    if (queried_from.size() != static_cast<std::size_t>(size)) queried_from.assign(static_cast<std::size_t>(size), std::nullopt);
    OpFingerprint asked;
    int source = 0;
    while (receive_control(arrival_query_tag, asked, source)) {
      queried_from[static_cast<std::size_t>(source)] = asked;
      send_control(current, source, arrival_answer_tag);
    }
  }

  // Receives one fingerprint with `tag` from any rank if one has come (a matched probe, so that
  // two threads waiting on requests of this communicator cannot take each other's message).
  bool receive_control(int tag, OpFingerprint& fp, int& source) {
    int flag = 0;
    MPI_Message message;
    MPI_Status status;
    TRELLIS_CHECK_MPI(MPI_Improbe(MPI_ANY_SOURCE, tag, control, &flag, &message, &status));
    if (!flag) return false;
    source = status.MPI_SOURCE;
    TRELLIS_CHECK_MPI(MPI_Mrecv(&fp, static_cast<int>(sizeof(OpFingerprint)), MPI_BYTE, &message, MPI_STATUS_IGNORE));
    return true;
  }

  // A collective timed out: asks every peer which call it is waiting in (the peers that wait in a
  // collective of this communicator answer from their wait loop; a rank that timed out first has
  // asked us already) and names the ranks that neither answered nor asked within a grace period.
  // Returns "" if the call completed meanwhile (a late rank arrived). Costs nothing before the
  // timeout: the only per-call work is a probe while a wait has lasted over a millisecond.
  std::string ask_who_arrived(MpiPending& pending, const OpFingerprint& call) {
    answer_arrival_queries(call);
    for (int peer = 0; peer < size; ++peer)
      if (peer != rank) send_control(call, peer, arrival_query_tag);
    std::vector<std::optional<OpFingerprint>> answered(static_cast<std::size_t>(size));
    const auto grace = std::clamp(timeout / 4, std::chrono::milliseconds(50), std::chrono::milliseconds(2000));
    const auto until = std::chrono::steady_clock::now() + grace;
    // A query about an earlier collective is stale (that rank got past it, since we did).
    const auto asked_now = [&](int r) { return queried_from[r] && queried_from[r]->seq >= call.seq; };
    const auto known = [&](int r) { return r == rank || answered[r] || asked_now(r); };
    for (;;) {
      if (pending.test()) return "";
      answer_arrival_queries(call);
      OpFingerprint fp;
      int source = 0;
      while (receive_control(arrival_answer_tag, fp, source))
        if (fp.seq >= call.seq) answered[static_cast<std::size_t>(source)] = fp;  // else: an old round's
      bool all_known = true;
      for (int r = 0; r < size; ++r) all_known = all_known && known(r);
      if (all_known || std::chrono::steady_clock::now() >= until) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::vector<int> missing;
    std::ostringstream elsewhere;
    for (int r = 0; r < size; ++r) {
      if (!known(r)) {
        missing.push_back(r);
        continue;
      }
      if (r == rank) continue;
      const OpFingerprint& fp = answered[r] ? *answered[r] : *queried_from[r];  // known(r): one is set
      if (!same_call(fp, call)) elsewhere << "; " << name_rank(r) << " is waiting in " << fp.describe();
    }
    std::ostringstream who;
    if (missing.empty()) {
      who << "every rank answered from a collective of this communicator";
    } else {
      who << (missing.size() == 1 ? "rank " : "ranks ");
      for (std::size_t i = 0; i < missing.size(); ++i) who << (i ? ", " : "") << name_rank(missing[i]).substr(5);
      who << " did not arrive (no answer to an arrival query within " << grace.count()
          << " ms: not waiting in a collective of this communicator)";
    }
    who << elsewhere.str();
    return who.str();
  }

  // Debug mode: every rank learns every rank's fingerprint of this collective, then each raises
  // the same error when they differ. Written as point-to-point so that a timeout can name the
  // ranks whose fingerprint never came.
  void check_fingerprints(const OpFingerprint& call) {
    if (!debug || size == 1) return;
    auto exchange = std::make_unique<MpiPending>();
    exchange->call = call;
    exchange->scratch = Buffer<std::byte>(sizeof(OpFingerprint) * static_cast<std::size_t>(size + 1));
    auto* all = reinterpret_cast<OpFingerprint*>(exchange->scratch.data());
    auto* mine = all + size;
    *mine = call;
    all[rank] = call;
    const int bytes = static_cast<int>(sizeof(OpFingerprint));
    for (int peer = 0; peer < size; ++peer) {
      if (peer == rank) continue;
      MPI_Request r;
      TRELLIS_CHECK_MPI(MPI_Irecv(&all[peer], bytes, MPI_BYTE, peer, 0, control, &r));
      exchange->requests.push_back(r);
      exchange->peers.push_back(peer);
    }
    const std::size_t receives = exchange->requests.size();
    for (int peer = 0; peer < size; ++peer) {
      if (peer == rank) continue;
      MPI_Request r;
      TRELLIS_CHECK_MPI(MPI_Isend(mine, bytes, MPI_BYTE, peer, 0, control, &r));
      exchange->requests.push_back(r);
    }
    if (!mpi_wait_until(*exchange, deadline(), forever())) {
      std::vector<int> missing, arrived;
      for (std::size_t i = 0; i < receives; ++i) {
        int flag = 0;
        TRELLIS_CHECK_MPI(MPI_Test(&exchange->requests[i], &flag, MPI_STATUS_IGNORE));
        if (flag) {
          arrived.push_back(exchange->peers[i]);
        } else {
          missing.push_back(exchange->peers[i]);
          MPI_Cancel(&exchange->requests[i]);
          MPI_Wait(&exchange->requests[i], MPI_STATUS_IGNORE);
        }
      }
      std::ostringstream who;
      who << (missing.size() == 1 ? "rank " : "ranks ");
      for (std::size_t i = 0; i < missing.size(); ++i) who << (i ? ", " : "") << name_rank(missing[i]).substr(5);
      if (missing.empty()) {
        who.str("");
        who << "every rank's fingerprint arrived but this rank's own sends did not complete";
      } else {
        who << " did not arrive (debug fingerprint exchange)";
      }
      for (int r : arrived) {
        if (!same_call(all[r], call)) who << "; rank " << r << " arrived with " << all[r].describe();
      }
      timed_out(std::move(exchange), call, who.str());
    }
    if (auto mismatch = find_fingerprint_mismatch(std::span<const OpFingerprint>(all, size))) {
      recorder.failed(call.seq);
      TRELLIS_THROW(*mismatch, " (communicator '", recorder.label(), "')\n", recorder.dump(8));
    }
  }

  // Debug mode, all_to_allv: what each rank sends to each peer must be what that peer expects.
  // Every rank learns every disagreement (one all-to-all and one all-gather of int triples on the
  // control communicator, under the deadline) and raises the same error.
  void check_exchange_counts(const OpFingerprint& call, const int* send_counts, const int* recv_counts) {
    if (!debug || size == 1) return;
    const auto n = static_cast<std::size_t>(size);
    auto p = std::make_unique<MpiPending>();
    p->call = call;
    p->counts.assign(n + 3 + 3 * n, 0);
    int* announced = p->counts.data();  // announced[j]: what rank j says it sends here
    TRELLIS_CHECK_MPI(MPI_Ialltoall(send_counts, 1, MPI_INT, announced, 1, MPI_INT, control, &p->requests.emplace_back()));
    if (!mpi_wait_until(*p, deadline(), forever()))
      timed_out(std::move(p), call, "some rank did not arrive at the debug check of all_to_allv counts");
    p->requests.clear();
    int* mine = announced + n;  // first disagreement seen here: (sender, sent, expected) or -1
    mine[0] = -1;
    for (int j = 0; j < size; ++j) {
      if (announced[j] != recv_counts[j]) {
        mine[0] = j, mine[1] = announced[j], mine[2] = recv_counts[j];
        break;
      }
    }
    int* everyone = mine + 3;
    TRELLIS_CHECK_MPI(MPI_Iallgather(mine, 3, MPI_INT, everyone, 3, MPI_INT, control, &p->requests.emplace_back()));
    if (!mpi_wait_until(*p, deadline(), forever()))
      timed_out(std::move(p), call, "some rank did not arrive at the debug check of all_to_allv counts");
    std::ostringstream out;
    for (int r = 0; r < size; ++r) {
      const int* e = everyone + 3 * r;
      if (e[0] < 0) continue;
      out << (out.tellp() > 0 ? "; " : "") << "rank " << r << " expects " << e[2] << " elements from rank "
          << e[0] << ", which sends " << e[1];
    }
    if (out.tellp() > 0) {
      recorder.failed(call.seq);
      TRELLIS_THROW(call.describe(), ": send and receive counts disagree: ", out.str(), " (communicator '",
                    recorder.label(), "')");
    }
  }
};

}  // namespace detail

}  // namespace trellis::comm
