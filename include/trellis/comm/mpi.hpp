// MpiComm: the Communicator over an MPI communicator (OpenMPI), for multi-process and multi-node
// CPU runs under mpirun; MpiWorld: MPI's lifetime plus run(fn), shaped like ThreadWorld.
//
// How it maps onto MPI:
//  - every MpiComm owns two duplicates of the communicator it was built from: one for the data
//    (MPI_ERRORS_RETURN set, so every failure becomes a trellis::Error) and one private control
//    channel for the debug-mode fingerprint exchange, so neither disturbs the user's tags.
//  - blocking operations are the nonblocking MPI call (MPI_I*) plus a test loop with a deadline:
//    yield first, then sleep a little (no hot spin), and raise Error when the timeout passes.
//    With the timeout switched off (set_timeout(0ms)) the blocking MPI call itself is used.
//  - half and bfloat16 travel as a committed 2-byte user MPI_Datatype. min/max reduce them with
//    user MPI_Ops (exact); sum/avg/prod widen to float, reduce in float and round once at the
//    end, as the thread backend does. avg = sum, then divide by size() (integers truncate).
//  - debug mode (TRELLIS_COMM_DEBUG=1 or set_debug(true)): before each collective every rank
//    sends its OpFingerprint to every other rank (an all-gather written as point-to-point, so a
//    partial arrival is visible). A mismatch raises on every rank naming the odd rank and both
//    calls; a timeout there names exactly the ranks whose fingerprint never came.
//  - outside debug mode MPI gives no partial view of a collective in flight, so a rank whose
//    collective times out asks every peer, on the control channel, which call it is waiting in:
//    ranks waiting in a collective of this communicator answer from their wait loop (a probe
//    once a wait has lasted a millisecond: nothing on fast calls), and the error names the ranks
//    that neither answered nor asked themselves within a grace period (timeout/4, 50 ms..2 s),
//    plus any rank waiting in a different call.
// After a timeout the communicator is unusable (the MPI operation may still be in flight and is
// kept alive, with its staging buffers, until the communicator is destroyed); later calls raise.
// A timeout, or a pending request destroyed by an exception, is a fault of the process
// (mpi/fault.hpp): clean-up then makes no MPI call, and an MpiWorld that owns MPI ends the job
// with MPI_Abort (after printing the error) instead of finalising -- so a stopped or failed rank
// ends the whole job within the timeout instead of hanging it.
// Needs MPI (the header's name contains "mpi": built only with trellis::mpi).
//
// The pieces, top down (each compiles on its own):
//   mpi/world.hpp        MpiWorld: MPI_Init_thread / MPI_Finalize, run(fn)
//   mpi/comm.hpp         MpiComm: the Communicator (collectives, async, p2p, batch, split)
//   mpi/request.hpp      MpiRequest: an operation in flight
//   mpi/comm_state.hpp   shared state; timeouts, arrival queries, debug-mode checks
//   mpi/fault.hpp        the process-wide fault record (no MPI progress after one)
//   mpi/pending.hpp      MpiPending: requests, staging buffers, finishing step; polling wait
//   mpi/environment.hpp  TRELLIS_COMM_DEBUG, TRELLIS_COMM_TIMEOUT_MS
//   mpi/datatypes.hpp    half/bfloat16 user datatypes and min/max operators, widening, counts
#pragma once

#include "trellis/comm/mpi/comm.hpp"     // defines: MpiComm
#include "trellis/comm/mpi/request.hpp"  // defines: MpiRequest
#include "trellis/comm/mpi/world.hpp"    // defines: MpiWorld
