/*
 * bulk.cuh: the Hopper asynchronous-copy primitives shared by the producer and the consumer:
 * shared-memory mbarriers and 1D bulk copies (cp.async.bulk, the TMA engine without a tensor
 * map). Both kernels move data through the async proxy; the ordering rules that go with it are
 * stated where each kernel publishes (sm90_gemm.cu, combine.cu).
 */
#ifndef TW_BULK_CUH
#define TW_BULK_CUH

#include <stdint.h>

__device__ __forceinline__ uint32_t tw__smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void tw__mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(tw__smem_u32(bar)), "r"(count));
}

__device__ __forceinline__ void tw__mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(tw__smem_u32(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void tw__mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(tw__smem_u32(bar)) : "memory");
}

/* One test of the barrier's phase with `parity` (acquire, CTA scope); the hardware may suspend
 * the thread for a while before answering false. */
__device__ __forceinline__ bool tw__mbar_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(tw__smem_u32(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

/* Spins until the barrier's phase with `parity` has completed. No timeout: only for barriers
 * completed by the calling CTA's own threads or by copies it issued itself, never by another CTA
 * or GPU, so it can only hang on a bug in that kernel, not because a peer is slow or failed. */
__device__ __forceinline__ void tw__mbar_wait(uint64_t* bar, uint32_t parity) {
  while (!tw__mbar_try_wait(bar, parity)) {
  }
}

/* 1D bulk copy global -> shared (async proxy); completes `bytes` transaction bytes on `bar`.
 * Addresses 16-byte aligned, bytes a multiple of 16. */
__device__ __forceinline__ void tw__bulk_load(void* sdst, const void* gsrc, uint32_t bytes,
                                              uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(tw__smem_u32(sdst)),
      "l"(gsrc), "r"(bytes), "r"(tw__smem_u32(bar))
      : "memory");
}

/* 1D bulk copy shared -> global (async proxy), tracked by this thread's bulk groups. The global
 * address may be a peer GPU's memory mapped into this one's address space (NVLink). */
__device__ __forceinline__ void tw__bulk_store(void* gdst, const void* ssrc, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gdst),
               "r"(tw__smem_u32(ssrc)), "r"(bytes)
               : "memory");
}

/* 1D bulk reduction shared -> global: gdst[i] = bf16(gdst[i] + ssrc[i]) for `bytes` / 2 bf16
 * values, performed where gdst lives (its L2; a peer's over NVLink), rounded once to nearest
 * even (.noftz: bf16 has no denormal flush here). Tracked by the same bulk groups as
 * tw__bulk_store. Bit for bit in the lab (dev/comm/reduce_add_lab.cu, run 39). */
__device__ __forceinline__ void tw__bulk_add_bf16(void* gdst, const void* ssrc, uint32_t bytes) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.noftz.bf16 [%0], [%1], %2;" ::"l"(
          gdst),
      "r"(tw__smem_u32(ssrc)), "r"(bytes)
      : "memory");
}

__device__ __forceinline__ void tw__bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

/* Waits until at most N of this thread's bulk groups are pending, reads of their shared-memory
 * sources only (the source may be reused; the destination writes may still be in flight). */
template <int N>
__device__ __forceinline__ void tw__bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

/* Waits until every bulk group of this thread has completed, destination writes included. */
__device__ __forceinline__ void tw__bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

#endif /* TW_BULK_CUH */
