// Compiler and platform switches. Every macro is prefixed TRELLIS_ and may be predefined by the
// user (e.g. -DTRELLIS_HD=) to override it.
#pragma once

#if defined(__GNUC__) || defined(__clang__)
#pragma GCC system_header
#endif

// Functions callable from host and device code. Under g++ this is empty, so the same index math
// is compiled and tested on the host and reused inside kernels.
#ifndef TRELLIS_HD
#if defined(__CUDACC__) || defined(__HIPCC__)
#define TRELLIS_HD __host__ __device__
#else
#define TRELLIS_HD
#endif
#endif

#ifndef TRELLIS_DEVICE
#if defined(__CUDACC__)
#define TRELLIS_DEVICE __device__
#else
#define TRELLIS_DEVICE
#endif
#endif

#ifndef TRELLIS_FORCEINLINE
#if defined(__CUDACC__)
#define TRELLIS_FORCEINLINE __forceinline__
#elif defined(__GNUC__) || defined(__clang__)
#define TRELLIS_FORCEINLINE inline __attribute__((always_inline))
#else
#define TRELLIS_FORCEINLINE inline
#endif
#endif

// True while compiling device code (the device pass of nvcc).
#ifndef TRELLIS_DEVICE_CODE
#if defined(__CUDA_ARCH__)
#define TRELLIS_DEVICE_CODE 1
#else
#define TRELLIS_DEVICE_CODE 0
#endif
#endif

// Restrict-qualified pointers for the host kernels' inner loops.
#ifndef TRELLIS_RESTRICT
#define TRELLIS_RESTRICT __restrict__
#endif

// Alignment of host buffers: one cache line, also enough for AVX-512 loads.
#ifndef TRELLIS_HOST_ALIGNMENT
#define TRELLIS_HOST_ALIGNMENT 64
#endif

// How many operations each communicator's flight recorder keeps.
#ifndef TRELLIS_RECORDER_DEPTH
#define TRELLIS_RECORDER_DEPTH 64
#endif

// TRELLIS_LSAN_IGNORE_OBJECT(p): LeakSanitizer neither reports the heap object at p nor what it
// points to; for memory leaked on purpose (a failed rank's buffers that peers may still use).
// A no-op unless built with AddressSanitizer (g++: __SANITIZE_ADDRESS__; clang: __has_feature).
#ifndef TRELLIS_LSAN_IGNORE_OBJECT
#if defined(__SANITIZE_ADDRESS__)
#define TRELLIS_HAVE_LSAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(leak_sanitizer)
#define TRELLIS_HAVE_LSAN 1
#endif
#endif
#if defined(TRELLIS_HAVE_LSAN) && __has_include(<sanitizer/lsan_interface.h>)
#include <sanitizer/lsan_interface.h>
#define TRELLIS_LSAN_IGNORE_OBJECT(p) __lsan_ignore_object(p)
#else
#define TRELLIS_LSAN_IGNORE_OBJECT(p) static_cast<void>(p)
#endif
#endif
