// Subnormal floats flushed to zero on the calling thread (x86-64: MXCSR's flush-to-zero and
// denormals-are-zero bits; other CPUs: nothing yet). Why: an arithmetic operation with a subnormal
// operand or result takes a microcode assist of ~100 cycles on x86, and training makes them
// (probabilities of tokens the model has learnt never to predict, scaled by 1 / tokens, and the
// gradients and AdamW moments they feed): a 150-step GPT run on the host measured 95 s with them
// and 50 s flushed, with the same losses to 4 digits. GPUs flush them in their fast paths too.
// The mode belongs to a thread and threads created later inherit it, so the host backend sets it
// where its kernels run: on the thread that makes a backend::Host, and on every kernel pool worker
// (their results then never depend on which thread ran a task).
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

namespace trellis {

inline void flush_subnormals_on_this_thread() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_setcsr(_mm_getcsr() | 0x8040u);  // FTZ (bit 15) | DAZ (bit 6)
#endif
}

// Whether this thread flushes them (false on CPUs where flush_subnormals_on_this_thread does nothing).
inline bool subnormals_flushed_on_this_thread() {
#if defined(__x86_64__) || defined(_M_X64)
  return (_mm_getcsr() & 0x8040u) == 0x8040u;
#else
  return false;
#endif
}

}  // namespace trellis
