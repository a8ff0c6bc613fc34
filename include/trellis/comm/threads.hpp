// The thread-rank backend: n ranks as n threads of one process, sharing memory.
//
//   trellis::comm::ThreadWorld world(4);
//   world.run([&](trellis::comm::ThreadComm& comm) { ... comm.all_reduce(x, x, n); ... });
//
// Algorithms (bandwidth-optimal for shared memory): every rank publishes its buffer pointers,
// then the message is cut into 64 KiB tasks that read and write peers' buffers directly, one
// 64-byte line at a time (accumulators in registers, each finished line stored straight into
// every destination, streaming stores for large messages), so every input byte is read once and
// every output byte written once -- the minimum -- with no staging copy:
//  - all_reduce: a task reduces one chunk over every rank's input and writes it into every
//    rank's output (a fused reduce-scatter + all-gather in one pass);
//  - reduce: the same, writing only into the root's output; reduce_scatter: a chunk of one
//    rank's block; all_gather: a chunk of one rank's input, read once, written into every
//    output; broadcast: a chunk of the root's buffer into every other rank's; all_to_all(v):
//    memcpy of one chunk.
// The tasks are cut into one contiguous region per rank: a rank claims its own region's tasks
// first (one sequential stream per core, which the memory system serves best), then helps with
// the other regions, so when ranks outnumber cores the ranks that are running do the work of
// those that are not. One barrier per collective (publish) plus a wait for the last task; no
// lock on the data path. The reduction order is fixed (rank 0, 1, ..., n-1 for every element,
// whoever runs the task) so results are deterministic and equal a serial left-to-right sum;
// half/bfloat16 reduce in float and round once; copies move bits (NaN payloads intact).
//
// Waiting: a short spin (none when ranks outnumber cores), then a futex sleep, so 8 ranks on 2
// cores stay fast. Every wait checks an abort flag (a rank's function threw: the others get
// "rank k failed: ..."), a deadline (set_timeout, env TRELLIS_COMM_TIMEOUT_MS, default 60 s: the
// error names the ranks that never joined) and whether the missing ranks already returned.
//
// Safety: every collective compares all ranks' fingerprints (operation, dtype, count, root,
// reduce op) after publishing, which costs nothing here, so a mismatched program raises an Error
// on every rank naming the odd rank and both calls; set_debug()/TRELLIS_COMM_DEBUG is accepted
// for parity with the MPI/NCCL backends, where the check costs an extra exchange. Each
// communicator keeps a FlightRecorder whose dump is part of every timeout/abort error.
//
// Point to point: per-destination mailboxes; whichever side arrives second copies (sends of at
// most eager_limit bytes are buffered and complete at once). isend/irecv/batch therefore progress
// without any thread. Async collectives run in order on a per-rank progress thread that sleeps on
// a condition variable until work arrives; blocking collectives first wait for pending async ones.
//
// The pieces, top down (each compiles on its own):
//   threads/world.hpp       ThreadWorld: one thread per rank, first failure reported
//   threads/comm.hpp        ThreadComm: the Communicator (collectives, async, p2p, split)
//   threads/request.hpp     ThreadRequest: a pending operation
//   threads/rank_state.hpp  one rank's state: barrier, collective protocol, mailboxes, progress thread
//   threads/group.hpp       shared state of the world and of each group
//   threads/reduce.hpp      typed reduction kernels (fixed rank order, line at a time)
//   threads/copy.hpp        streaming copies for large messages
//   threads/wait.hpp        spin, then futex sleep
#pragma once

#include "trellis/comm/threads/comm.hpp"     // defines: ThreadComm
#include "trellis/comm/threads/request.hpp"  // defines: ThreadRequest
#include "trellis/comm/threads/world.hpp"    // defines: ThreadWorld
