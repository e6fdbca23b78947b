/*
 * sync.cuh: the signalling primitives shared by the producer, the consumer and the receiver.
 *
 * NOTES: the protocol is release/acquire on 32-bit counters compared wrap-safely. Arrival and
 * credit counters only grow (their targets are running totals); band counters count from 0 in
 * each call and are zeroed by the consumer's last CTA (combine.h). A writer makes its
 * data visible and then publishes with a release reduction; a reader polls with acquire loads
 * until the counter reaches the target, and only then reads the data. Scope `.gpu` is enough
 * when both sides run on one GPU; anything seen by a peer GPU over NVLink needs `.sys`.
 * Every wait is bounded: on timeout it records an error in the device error word and returns
 * false, never traps (a trap would kill the CUDA context for every kernel of the process).
 */
#ifndef TW_SYNC_CUH
#define TW_SYNC_CUH

#include <stdint.h>

#include "tilewave.h" /* tw_status codes recorded in tw_dev_error.status */

/* Device-side error report: the first failing thread's report wins; the host reads it after the
 * launch and turns it into a tw_status. */
typedef struct tw_dev_error {
  int32_t status;  /* tw_status, 0 = none */
  int32_t where;   /* which wait: TW_WAIT_* */
  int32_t index;   /* band / segment / source index that timed out */
  uint32_t seen;   /* counter value seen */
  uint32_t target; /* value waited for */
  int32_t rank;    /* rank of the waiting kernel */
  int32_t pad_[2];
} tw_dev_error;

enum { TW_WAIT_BAND = 1, TW_WAIT_ARRIVAL = 2 }; /* 3 unused; combine.h continues at 4 */

__device__ __forceinline__ uint32_t tw_ld_acquire_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t tw_ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

/* Publish: every write this thread made (and, after a barrier, its CTA made) before this call is
 * visible to any thread that acquires the counter and sees the increment. */
__device__ __forceinline__ void tw_red_release_gpu(uint32_t* p, uint32_t v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void tw_red_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint64_t tw_globaltimer_ns(void) {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void tw_report_error(tw_dev_error* err, int32_t status, int32_t where,
                                                int32_t index, uint32_t seen, uint32_t target,
                                                int32_t rank) {
  if (err == NULL) return;
  if (atomicCAS(&err->status, 0, status) == 0) {
    err->where = where;
    err->index = index;
    err->seen = seen;
    err->target = target;
    err->rank = rank;
  }
}

/* Waits until *counter >= target (wrap-safe) with acquire semantics at system scope when `sys`,
 * GPU scope otherwise. Returns false on timeout (after recording it) or if another thread has
 * already recorded an error (so one failure stops every waiter quickly). Call from one thread. */
__device__ __forceinline__ bool tw_wait_geq(const uint32_t* counter, uint32_t target, bool sys,
                                            uint64_t timeout_ns, tw_dev_error* err, int32_t where,
                                            int32_t index, int32_t rank) {
  const uint64_t start = tw_globaltimer_ns();
  uint32_t sleep_ns = 32;
  for (;;) {
    uint32_t v = sys ? tw_ld_acquire_sys(counter) : tw_ld_acquire_gpu(counter);
    if ((int32_t)(v - target) >= 0) return true;
    if (err != NULL && *(volatile int32_t*)&err->status != 0) return false;
    if (tw_globaltimer_ns() - start > timeout_ns) {
      tw_report_error(err, TW_ERR_TIMEOUT, where, index, v, target, rank);
      return false;
    }
    __nanosleep(sleep_ns);
    if (sleep_ns < 1024) sleep_ns *= 2;
  }
}

/* An owner's wait for one source's arrivals of this call, exact: none of the source's next-call
 * units can arrive before this rank returns its credit, so a count above the target is an
 * over-delivery (the ranks' plans disagree), recorded as TW_ERR_INVALID_ARGUMENT at
 * TW_CHECK_ARRIVALS (7, see combine.h) rather than passed early. The reduce dataflow only (the add
 * dataflow's next call may start adding early). Call from one thread. */
__device__ __forceinline__ bool tw_wait_arrivals_exact(const uint32_t* arrivals, uint32_t target,
                                                       uint64_t timeout_ns, tw_dev_error* err,
                                                       int32_t source, int32_t rank) {
  if (!tw_wait_geq(arrivals, target, true, timeout_ns, err, TW_WAIT_ARRIVAL, source, rank))
    return false;
  const uint32_t v = tw_ld_acquire_sys(arrivals);
  if (v == target) return true;
  tw_report_error(err, TW_ERR_INVALID_ARGUMENT, 7, source, v, target, rank);
  return false;
}

#endif /* TW_SYNC_CUH */
