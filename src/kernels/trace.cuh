/*
 * trace.cuh: the device side of a traced call (src/core/trace.h has the record format). Every
 * event site is one call of tw_trace_event with the kernel's trace pointer, which is a kernel
 * parameter: NULL (tracing off, the default) costs one uniform, well-predicted branch on a
 * constant-bank value and nothing else. Built with TW_TRACE_HOOKS=0 (cmake -DTW_TRACE_HOOKS=OFF)
 * every site compiles to nothing: the build that measures what the branches cost
 * (bench/trace_cost.sh); tw__context_trace then refuses to turn tracing on.
 */
#ifndef TW_TRACE_CUH
#define TW_TRACE_CUH

#include <stdint.h>

#include "sync.cuh" /* tw_globaltimer_ns */
#include "trace.h"

#ifndef TW_TRACE_HOOKS
#define TW_TRACE_HOOKS 1
#endif

/* Whether a site records: the pointer is set, and the hooks are compiled in. A site that needs
 * more than one thread's record (a barrier first, a count) tests this before doing any of it. */
__device__ __forceinline__ bool tw_trace_on(const tw_trace* t) {
#if TW_TRACE_HOOKS
  return __builtin_expect(t != nullptr, 0);
#else
  (void)t;
  return false;
#endif
}

/* Takes the next slot of `t` and writes {now, kind, cta, index} into it, or counts the record as
 * dropped (the cursor passes the capacity) when the buffer is full. One thread per event. The
 * timestamp is taken before the slot, so records of one thread are in time order. */
__device__ __forceinline__ void tw_trace_event(tw_trace* t, uint32_t kind, uint32_t cta,
                                               uint32_t index) {
  if (!tw_trace_on(t)) return;
  const uint64_t ns = tw_globaltimer_ns();
  const uint32_t slot = atomicAdd(&t->cursor, 1u);
  if (slot >= t->capacity) return; /* dropped: the host reads cursor - capacity */
  /* The record as one 16-byte store (little-endian: ns, then kind | cta << 16, then index). */
  reinterpret_cast<uint4*>(t + 1)[slot] =
      make_uint4((uint32_t)ns, (uint32_t)(ns >> 32), (kind & 0xFFFFu) | (cta << 16), index);
}

#endif /* TW_TRACE_CUH */
