/*
 * baseline.h: the conventional return paths that tilewave is measured against (internal).
 *
 * Every baseline runs on the same inputs as the overlapped path, one process (or thread) per GPU,
 * over the plan's remote-owner-aligned row layout, and ends with the same weighted reduction into
 * the owner's (tokens, H) output, so that its output can be compared with ours on every run:
 *
 *  - sequential: one cuBLAS GEMM per local expert (cublasGemmEx, bf16 in, fp32 accumulate), then
 *    one NCCL group of ncclSend/ncclRecv pairs, one pair per (expert, owner) group, into the same
 *    receive layout the overlapped path uses, then the reduction: the "conventional" path of both
 *    papers. Two variants: all GEMMs in one cublasGemmGroupedBatchedEx call, and a packed
 *    exchange (one gather kernel, then one send/recv pair per peer).
 *  - chunked: what a pragmatic engineer builds without tile signals: cuBLAS GEMMs over chunks of
 *    remote rows (remote rows first), each chunk's rows pushed by the copy engine into the
 *    owner's receive buffer (cudaMemcpyAsync on a peer pointer from CUDA IPC) on a second stream
 *    after an event, then the local rows' GEMMs, a cross-rank fence, and the reduction.
 *
 * A baseline owns its GEMM output, its receive buffer and its cuBLAS handle; it never owns the
 * caller's communicator or streams. Calls on different ranks must be made in the same order (they
 * are collective where they communicate), and the caller must fence the ranks (e.g. a tiny
 * allreduce) between two calls, as a pipeline's previous layer would: a chunked call writes into
 * the peers' receive buffers without waiting for their previous reduction.
 */
#ifndef TW_BASELINE_H
#define TW_BASELINE_H

#include <cuda_runtime.h>
#include <nccl.h>
#include <stdint.h>

#include "plan.h"
#include "tilewave.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tw_baseline* tw_baseline_t;

/* Creates rank `rank`'s baselines. Collective over `comm` (exchanges receive-buffer IPC handles).
 * [in] plans:   (world) every rank's plan of the same problem and routing; plans[rank] is this
 *               rank's. The receive side needs the senders' band order and offsets.
 * [in] routing: the routing the plans were built from (this rank's gate weights).
 * [in] comm:    this rank's communicator (rank `rank` of `world`); not owned.
 * The current CUDA device must be this rank's GPU. */
tw_status tw__baseline_create(const struct tw_plan* const* plans, int32_t world, int32_t rank,
                              tw_routing_t routing, ncclComm_t comm, tw_baseline_t* baseline);
tw_status tw__baseline_destroy(tw_baseline_t baseline);

/* Sequential baseline on `stream`: GEMM, NCCL exchange, reduction.
 * [in]  a:   (rows, F) bf16, the plan's layout rows
 * [in]  w:   (E, H, F) bf16, nn.Linear weight of each local expert
 * [out] out: (tokens, H) bf16, this rank's tokens, sum over k of gate weight x expert row */
tw_status tw__baseline_sequential(tw_baseline_t b, const void* a, const void* w, void* out,
                                  cudaStream_t stream);
/* The same with all per-expert GEMMs in one cublasGemmGroupedBatchedEx call (one group per
 * non-empty expert). The first call with a new (a, w) pair uploads a pointer table synchronously;
 * later calls with the same pair are fully asynchronous. */
tw_status tw__baseline_sequential_grouped(tw_baseline_t b, const void* a, const void* w, void* out,
                                          cudaStream_t stream);
tw_status tw__baseline_gemm_grouped(tw_baseline_t b, const void* a, const void* w,
                                    cudaStream_t stream);
/* The same with a packed exchange: one gather kernel puts this rank's rows for each peer into one
 * block in the peer's receive order, then one ncclSend/ncclRecv pair per peer (fewer, larger
 * transfers than one pair per group). TW_ERR_UNSUPPORTED if a plan's regions are not contiguous. */
tw_status tw__baseline_sequential_packed(tw_baseline_t b, const void* a, const void* w, void* out,
                                         cudaStream_t stream);
tw_status tw__baseline_exchange_packed(tw_baseline_t b, cudaStream_t stream);
/* Its phases alone: the per-expert cuBLAS GEMMs, and the NCCL exchange of the last GEMM output. */
tw_status tw__baseline_gemm(tw_baseline_t b, const void* a, const void* w, cudaStream_t stream);
tw_status tw__baseline_exchange(tw_baseline_t b, cudaStream_t stream);

/* Chunked copy-engine pipeline: the remote bands in schedule order, cut into chunks of whole bands
 * of at least `chunk_rows` rows each (the last chunk may be shorter). Same arguments and output as
 * tw__baseline_sequential. */
tw_status tw__baseline_chunked(tw_baseline_t b, const void* a, const void* w, void* out,
                               int32_t chunk_rows, cudaStream_t stream);

/* Phase events of the sequential and chunked baselines (bench --phases). With timing on, each
 * call records, on the streams it uses, when it starts, when its GEMMs end, when its exchange (or
 * its last copy) ends, when the reduction starts (after the cross-rank fence) and when it ends;
 * tw__baseline_timeline waits for the last such call and gives those times in milliseconds from
 * its start. Off by default, so the timed rounds record nothing extra. */
typedef struct tw__bl_timeline {
  float gemm_end_ms, comm_end_ms, reduce_start_ms, total_ms;
} tw__bl_timeline;
tw_status tw__baseline_set_timing(tw_baseline_t b, int on);
tw_status tw__baseline_timeline(tw_baseline_t b, tw__bl_timeline* t);

/* The weighted reduction of this rank's tokens from a receive buffer and a local GEMM output:
 * out[t] = sum_j weight[t][j] * row(slot_row[t][j]), rows < recv_rows from `recv`, the others from
 * `local` (plan.h, tw_plan.slot_row), fp32 accumulation in slot order, bf16 result.
 * [in]  local: (plan rows, H) bf16
 * [in]  recv:  (recv_rows, H) bf16
 * [out] out:   (tokens, H) bf16 */
tw_status tw__baseline_reduce(tw_baseline_t b, const void* local, const void* recv, void* out,
                              cudaStream_t stream);

/* Normwise relative difference max|x - ref| / max|ref| over n bf16 values, NaN or Inf anywhere in x
 * giving +Inf. Synchronises `stream`. `scratch` is 2 x uint32 of device memory. */
tw_status tw__baseline_rel_diff(const void* x, const void* ref, size_t n, uint32_t* scratch,
                                cudaStream_t stream, double* rel);

/* Fills n bf16 values with uniform random values in [-scale, scale) from `seed` (deterministic,
 * independent of the launch shape). */
tw_status tw__baseline_fill_random(void* dst, size_t n, uint64_t seed, float scale,
                                   cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* TW_BASELINE_H */
