/*
 * reference.h: CPU references of the MoE layer and a CPU execution of a GEMM2 + combine plan
 * (internal; usable from C and CUDA tests).
 *
 * The references are deliberately plain: double precision, loops in the order the maths is
 * written, no tiling, so that they can be read and trusted. They accept small shapes that the
 * kernels would reject (any hidden/ffn >= 1), which lets tests check them by hand.
 *
 * tw__plan_exec_cpu() is different: it runs a set of plans (one per simulated rank) the way the
 * GPU does, with a producer thread per rank walking the tile schedule and publishing band
 * counters, C consumer threads per rank forwarding segments into other ranks' receive buffers,
 * and a receiver per rank doing the weighted reduction. It is the host-side proof that every
 * row of the plan lands where the owner's reduction looks for it, with the same memory-ordering
 * protocol (release publish, acquire wait, bounded spins) as the kernels.
 *
 * Tensor conventions: weights follow nn.Linear, i.e. (out_features, in_features) row-major.
 *   x      (tokens, H)          token activations of one rank
 *   router (H, E_total)         router logits = x . router
 *   w1     (E_total, 2F, H)     rows [0, F) are the gate projection, rows [F, 2F) the up one
 *   w2     (E_total, H, F)      down projection
 *   h      (tokens, k, F)       GEMM2 input of each (token, slot) assignment, on the owner rank
 */
#ifndef TW_REFERENCE_H
#define TW_REFERENCE_H

#include <stdint.h>

#include "plan.h"
#include "tilewave.h"

#ifdef __cplusplus
extern "C" {
#endif

/* silu(v) = v / (1 + exp(-v)), in double. */
double tw__ref_silu(double v);

/* bf16 <-> fp32 conversions with round-to-nearest-even (NaN kept quiet), matching the CUDA
 * intrinsics __float2bfloat16_rn / __bfloat162float, for tests that feed bf16 kernels. */
uint16_t tw__ref_f32_to_bf16(float v);
float tw__ref_bf16_to_f32(uint16_t v);

/* Top-k routing of one rank's tokens: logits = x . router in double, the k largest logits
 * (ties go to the lower expert id) in descending order, gate weights = softmax over the k
 * chosen logits.
 * [in]  x       (tokens, hidden)
 * [in]  router  (hidden, experts)
 * [out] ids     (tokens, top_k) chosen expert ids
 * [out] weights (tokens, top_k) gate weights (each token's sum is 1) */
tw_status tw__ref_route(int32_t hidden, int32_t experts, int32_t top_k, int32_t tokens,
                        const float* x, const float* router, int32_t* ids, double* weights);

/* GEMM1 -> SwiGLU of one token for one expert, in double.
 * [in]  x  (hidden)
 * [in]  w1 (2 ffn, hidden) of this expert: gate rows then up rows
 * [out] h  (ffn) silu(x . gate^T) * (x . up^T) */
void tw__ref_expert_gemm1(int32_t hidden, int32_t ffn, const float* x, const float* w1, double* h);

/* GEMM1 -> SwiGLU of `rows` consecutive rows of one expert from bf16 operands (the kernels'
 * inputs, as raw bf16 bits), in double: gate = a . w13[f]^T, up = a . w13[ffn + f]^T,
 * h = silu(gate) * up. Any hidden, ffn >= 1.
 * [in]  a    (rows, hidden) bf16: the expert's rows of the layout
 * [in]  w13  (2 ffn, hidden) bf16 of this expert: gate rows [0, ffn), up rows [ffn, 2 ffn)
 * [out] h    (rows, ffn)
 * [out] gate, up (rows, ffn) the two projections (each may be NULL), e.g. for error bounds */
void tw__ref_gemm1_swiglu_bf16(int32_t hidden, int32_t ffn, int32_t rows, const uint16_t* a,
                               const uint16_t* w13, double* h, double* gate, double* up);

/* GEMM2 of one row in double: out[n] = sum_f h[f] w2[n][f].
 * [in] h (ffn), w2 (hidden, ffn) of this expert; [out] out (hidden) */
void tw__ref_expert_gemm2(int32_t hidden, int32_t ffn, const double* h, const float* w2,
                          double* out);

/* The whole MoE layer forward over W simulated ranks, in double: route (top-k over router
 * logits, or the given routing) -> dispatch every (token, slot) row to the rank of its expert
 * -> GEMM1 -> SwiGLU -> GEMM2 on that rank -> combine (rows back to the owner) -> weighted sum.
 * Only world_size, hidden, ffn, experts and top_k of the problem are used (any sizes >= 1;
 * experts divisible by world_size).
 * [in]  tokens  (W) tokens per rank; may be NULL when routing is given (its counts are used)
 * [in]  x       (W) -> (tokens[r], hidden)
 * [in]  router  (hidden, experts) or NULL: then `routing` gives the ids and gate weights
 * [in]  routing used when router is NULL (must match the problem's W, experts, top_k)
 * [in]  w1      (experts, 2 ffn, hidden)
 * [in]  w2      (experts, hidden, ffn)
 * [out] out     (W) -> (tokens[r], hidden) */
tw_status tw__ref_moe_layer(const tw_problem* problem, const int32_t* tokens, const float* const* x,
                            const float* router, tw_routing_t routing, const float* w1,
                            const float* w2, double* const* out);

/* The layer of one token as the kernels round it, in double from bf16 operands (raw bits):
 *   h_j   = bf16(silu(x . w13[g_j][f]^T) * (x . w13[g_j][ffn + f]^T))  GEMM1 + SwiGLU's output
 *   y_j   = bf16(h_j . w2[g_j][n]^T)                                    GEMM2's output row
 *   out   = sum_j weights[j] y_j                                        the weighted reduction
 * over the token's slots j = 0..top_k-1, g_j = ids[j]. Only the two roundings the GEMM outputs
 * have are modelled (the kernels' fp32 accumulation is not), so the result is the kernels' up to
 * fp32 rounding and the rare bf16 value that fp32 puts on the other side of a rounding boundary.
 * Any hidden, ffn >= 1.
 * [in]  x       (hidden) bf16: the token's row
 * [in]  ids     (top_k) global expert ids, 0..experts-1 (TW_ERR_EXPERT_ID otherwise)
 * [in]  weights (top_k) gate weights
 * [in]  w13     (experts, 2 ffn, hidden) bf16: gate rows [0, ffn), up rows [ffn, 2 ffn)
 * [in]  w2      (experts, hidden, ffn) bf16
 * [out] out     (hidden) */
tw_status tw__ref_moe_token_bf16(int32_t hidden, int32_t ffn, int32_t experts, int32_t top_k,
                                 const uint16_t* x, const int32_t* ids, const float* weights,
                                 const uint16_t* w13, const uint16_t* w2, double* out);

/* tw__ref_moe_token_bf16 for every token of every rank of a routing: the whole layer (dispatch,
 * GEMM1 + SwiGLU, GEMM2, combine, weighted sum) as the kernels round it.
 * [in]  routing (W ranks, experts, top_k; its tokens and ids select the rows)
 * [in]  hidden, ffn
 * [in]  x   (W) -> (tokens[r], hidden) bf16
 * [in]  w13 (experts, 2 ffn, hidden) bf16
 * [in]  w2  (experts, hidden, ffn) bf16
 * [out] out (W) -> (tokens[r], hidden) */
tw_status tw__ref_moe_layer_bf16(tw_routing_t routing, int32_t hidden, int32_t ffn,
                                 const uint16_t* const* x, const uint16_t* w13, const uint16_t* w2,
                                 double* const* out);

/* GEMM2 + combine + weighted sum from given GEMM2 inputs, in double:
 * out[r][t][n] = sum_j w[t][j] sum_f h[r][t][j][f] w2[e(t,j)][n][f].
 * [in]  h   (W) -> (tokens[r], top_k, ffn), indexed by the owner rank
 * [in]  w2  (experts, hidden, ffn)
 * [out] out (W) -> (tokens[r], hidden)
 * [out] mag (W) -> (tokens[r], hidden) or NULL: sum_j |w| sum_f |h w2|, the scale of the
 *       rounding error of any fp32 evaluation (see tw__ref_fp32_error_bound) */
tw_status tw__ref_gemm2_combine(tw_routing_t routing, const float* const* h, const float* w2,
                                double* const* out, double* const* mag);

/* The same in fp32, in the one order the CPU plan execution and the kernels' contract fix:
 * row[n] = sum over f = 0..F-1 of h[f] * w2[e][n][f] (fp32 accumulator, k order), then
 * out[n] = sum over j = 0..k-1 of w[j] * row_j[n] (fp32 accumulator, slot order). */
tw_status tw__ref_gemm2_combine_f32(tw_routing_t routing, const float* const* h, const float* w2,
                                    float* const* out);

/* A rigorous bound on |fp32 result - exact| for the evaluation above, relative to `mag`:
 * each fp32 operation adds at most one rounding u = 2^-24 relative to its result; the GEMM2 dot
 * of F products has error <= gamma_F sum |h w2| and the weighted sum of k rows adds at most
 * gamma_{k+1} of its absolute sum (with gamma_n = n u / (1 - n u)), so
 * |err| <= (gamma_F (1 + gamma_{k+1}) + gamma_{k+1}) * mag. Returns the factor. */
double tw__ref_fp32_error_bound(int32_t ffn, int32_t top_k);

/* TP x EP GEMM2 + GatherRS of the whole world (docs/model.md, "Tensor parallel"), from the same
 * inputs as tw__ref_gemm2_combine_f32, in fp32 in one order. With tp ranks per EP group, rank
 * (g, q) holds F slice q, [q F/tp, (q + 1) F/tp), of every expert of group g, and for a token t of
 * owner o, slot j, expert e (group g_j):
 *   p_q[n] = sum over f of slice q, ascending, of h[o][t][j][f] * w2[e][n][f]   (rank (g_j, q))
 *            rounded to bf16 when partial_bf16 (the producer's bf16 store), else kept fp32;
 *   y[n]   = p_0[n] + p_1[n] + ... + p_{tp-1}[n]   (GatherRS at rank (g_j, o % tp), TP order)
 *   out[o][t][n] = bf16(sum over j = 0..k-1 of w[t][j] * y_j[n])  (the owner, slot order).
 * With tp = 1 and partial_bf16 = 0 this is bf16(tw__ref_gemm2_combine_f32) bit for bit. Any
 * hidden, ffn >= 1 with ffn % tp == 0 (no kernel alignment).
 * [in]  routing the world's routing (W = tp x ep ranks)
 * [in]  tp      TP ranks per EP group, dividing W and ffn
 * [in]  h       (W) -> (tokens[r], top_k, ffn) GEMM2 inputs by owner (every TP rank of the
 *               expert's group holds the row's F slice)
 * [in]  w2      (experts, hidden, ffn)
 * [out] out     (W) -> (tokens[r], hidden) bf16 bits */
tw_status tw__ref_tp_gemm2_gatherrs(tw_routing_t routing, int32_t tp, int partial_bf16,
                                    const float* const* h, const float* w2, uint16_t* const* out);

/* ---------------------------------------------------------------------------------------- */
/* CPU execution of planned GEMM2 + combine                                                  */
/* ---------------------------------------------------------------------------------------- */

/* Test hooks and limits of tw__plan_exec_cpu. */
typedef struct tw_plan_exec_options {
  int64_t timeout_ms;  /* bound of every wait; <= 0: TW_TIMEOUT_MS or 10000 */
  int32_t skip_rank;   /* fault injection: rank whose producer skips one publish; -1 none */
  int32_t skip_band;   /* band (index into that rank's plan->bands) whose first tile is not
                          published */
  float padding_value; /* every input value of padding rows: 0 like the runtime's zeroed rows;
                          any finite value must leave the result unchanged, since padding rows
                          are computed but never sent or read */
} tw_plan_exec_options;

#define TW_PLAN_EXEC_OPTIONS_INIT \
  { 0, -1, -1, 0.0f }

/* Runs the plans of all W ranks on the CPU, threaded like the GPU, in fp32:
 *  - one producer thread per rank computes the tiles of plan->tiles in schedule order into the
 *    rank's layout output (rows, hidden) and release-increments the tile's band counter;
 *  - plan->comm_ctas consumer threads per rank claim the transfer units (one band x one column
 *    tile, segments in schedule order) one at a time from a shared counter, wait (acquire) until
 * every band of the unit's segment is published, copy the band's valid rows x the tile's columns to
 * the destination's receive buffer at the band's dest_offset and release-increment the
 *    destination's arrival counter for this source;
 *  - one receiver per rank waits for all arrivals and its local bands and computes
 *    out[t] = sum_j w[t][j] row(slot_row[t k + j]) in fp32, slot order.
 * The result equals tw__ref_gemm2_combine_f32 bit for bit when the plans are right.
 * [in]  routing the routing the plans were made from
 * [in]  plans   (W) plans[r] = tw_plan_create(..., rank r, ...)
 * [in]  h       (W) -> (tokens[r], top_k, ffn) GEMM2 inputs by owner
 * [in]  w2      (experts, hidden, ffn)
 * [out] out     (W) -> (tokens[r], hidden)
 * [in]  options NULL for defaults
 * Returns TW_ERR_TIMEOUT (never hangs) when a wait exceeds the timeout, TW_ERR_INTERNAL when
 * the plans are inconsistent with each other or the routing. */
tw_status tw__plan_exec_cpu(tw_routing_t routing, const tw_plan_t* plans, const float* const* h,
                            const float* w2, float* const* out,
                            const tw_plan_exec_options* options);

#ifdef __cplusplus
}
#endif

#endif /* TW_REFERENCE_H */
