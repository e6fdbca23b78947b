/*
 * seq_layer.h: the sequential MoE layer that `tilewave bench layer` and `bench dispatch` time
 * tilewave against, for W ranks of an in-process team on one GPU (internal; tools only).
 *
 * Each step in the fastest form an engine has without tilewave, one after another on the rank's
 * stream, from the same inputs tw_moe_layer takes (x, int32 top-k ids and fp32 gate weights on
 * the GPU):
 *  1. permute: a histogram of the slots per global expert, the counts to the host and an
 *     all-gather of them over the team (the all-to-all's split sizes, as all_to_all_single needs
 *     them on the host), a stable radix sort of the slots by expert id (CUB), and a scatter of
 *     each slot's token row into a send buffer ordered by expert, i.e. by destination rank;
 *  2. copy all-to-all (one GPU): one cudaMemcpyAsync per destination rank from the send buffer
 *     into that rank's receive buffer, ordered by source rank then local expert (NCCL cannot put
 *     two ranks on one GPU; in-process the peers' buffers are plain device memory); events and a
 *     team barrier order the copies before the receivers' GEMMs;
 *  3. GEMM1 (rows, 2F) = rows x w13_e^T with cuBLAS (per (source, expert) group: a loop of
 *     cublasGemmEx, or one cublasGemmGroupedBatchedEx), bf16 out;
 *  4. SwiGLU (harness/swiglu.cu) into h (rows, F) bf16;
 *  5. GEMM2 (rows, H) = h x w2_e^T, the same two forms;
 *  6. copy all-to-all back: each source's block of GEMM2 rows into the source's return buffer,
 *     which then has the send buffer's row order;
 *  7. weighted sum: out[t] = bf16(sum_j w[t][j] * row(t, j)), fp32, in slot order.
 * At world 1 the exchanges are the identity and are left out (the scatter writes the GEMM input,
 * GEMM2's output is read back in place). Buffers are sized at creation for the worst case of the
 * capacity (every rank sending all its slots to one rank), as tilewave's context is.
 *
 * Ordering between ranks: a rank's copies into a peer's buffers of call n + 1 are enqueued after
 * the counts all-gather of call n + 1, which every rank enters only after its stream has finished
 * call n (it waits for its own counts), so no copy overwrites rows a peer still reads. Within a
 * call, each rank records an event after its copies and the team barrier makes every record
 * precede the peers' cudaStreamWaitEvent on it.
 */
#ifndef TW_SEQ_LAYER_H
#define TW_SEQ_LAYER_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "team.h" /* tw__team */
#include "tilewave.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tw__seq_layer* tw__seq_layer_t;

/* The expert GEMMs' form. */
typedef enum tw__seq_form {
  TW__SEQ_LOOP = 0,    /* one cublasGemmEx per non-empty (source, expert) group */
  TW__SEQ_GROUPED = 1, /* one cublasGemmGroupedBatchedEx over the groups (pointer tables uploaded
                          from pinned memory each call) */
  TW__SEQ_NFORMS
} tw__seq_form;

/* Creates rank team->rank's sequential layer for problem p (world_size = team->world; capacity
 * max_tokens tokens per rank). COLLECTIVE over `team` (all-gathers the buffers' addresses).
 * ffn = 0: the dispatch half only (no GEMM buffers, no cuBLAS handle). The current device must
 * be the team's. */
tw_status tw__seq_layer_create(const tw_problem* p, tw__team* team, int ffn, tw__seq_layer_t* out);
/* COLLECTIVE (its events): every rank destroys its own after all ranks' last calls. NULL: no-op. */
void tw__seq_layer_destroy(tw__seq_layer_t s);

/* Steps 1-2 on `stream`: this rank's `tokens` token rows x (tokens, H) bf16 by its topk_ids
 * (tokens, top_k) int32 into the receive buffers of the experts' ranks. COLLECTIVE. Blocks the
 * host until this rank's counts are on it. Afterwards (in the order of `stream`) this rank's
 * receive buffer holds tw__seq_recv_rows's rows. */
tw_status tw__seq_dispatch(tw__seq_layer_t s, const void* x, const int32_t* topk_ids,
                           int32_t tokens, cudaStream_t stream);
/* The whole layer (steps 1-7) on `stream`: w13 (E_local, 2F, H), w2 (E_local, H, F) bf16 as
 * tw_moe_layer takes them, weights (tokens, top_k) fp32, out (tokens, H) bf16. COLLECTIVE. */
tw_status tw__seq_layer_run(tw__seq_layer_t s, const void* x, const int32_t* topk_ids,
                            const float* weights, int32_t tokens, const void* w13, const void* w2,
                            void* out, tw__seq_form form, cudaStream_t stream);

/* After a call: this rank's receive buffer ((rows, H) bf16: for each source rank in order, for
 * each local expert in order, the source's tokens routed to it in token order) and its row
 * count. */
tw_status tw__seq_recv_rows(tw__seq_layer_t s, const void** recv, int64_t* rows);
/* Device bytes this rank's sequential layer allocated (its buffers for the worst case). */
int64_t tw__seq_layer_bytes(tw__seq_layer_t s);

/* Row check of a dispatched buffer: rows[i] (H bf16) must equal x of rank src[2i] at token
 * src[2i + 1], or be zero where src[2i] < 0 (padding). x_ranks: (W) device array of every rank's
 * x (one address space: an in-process team). Adds the rows that differ to *wrong (device int64,
 * zeroed by the caller). */
tw_status tw__seq_check_rows(const void* rows, int64_t nrows, const int32_t* src,
                             const void* const* x_ranks, int32_t hidden, unsigned long long* wrong,
                             cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* TW_SEQ_LAYER_H */
