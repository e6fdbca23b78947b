/*
 * tp_reference.c: the CPU reference of the tensor-parallel operator, GEMM2 + GatherRS, over a
 * whole TP x EP world (reference.h gives the arithmetic and its order).
 *
 * It is written from the operator's definition, not from a plan: every (token, slot) row's tp
 * partial sums over the F slices, their sum at the reducer, the owner's weighted sum of the
 * slots, one bf16 rounding at the end. The order of the fp32 operations is fixed so that a plan
 * executed on the CPU, or a kernel held to the same contract, can be compared bit for bit, and so
 * that tp = 1 is exactly the EP reference (tw__ref_gemm2_combine_f32) rounded to bf16.
 */
#include <stdlib.h>

#include "core.h"
#include "reference.h"

tw_status tw__ref_tp_gemm2_gatherrs(tw_routing_t routing, int32_t tp, int partial_bf16,
                                    const float* const* h, const float* w2, uint16_t* const* out) {
  TW_CHECK_NULL(routing);
  TW_CHECK_NULL(h);
  TW_CHECK_NULL(w2);
  TW_CHECK_NULL(out);
  const tw_problem* p = &routing->problem;
  const int32_t H = p->hidden, F = p->ffn, K = p->top_k, W = p->world_size;
  if (tp < 1 || W % tp != 0 || F % tp != 0)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "%s: tp %d must be >= 1 and divide world_size %d and ffn %d", __func__, tp, W,
                    F);
  const int32_t S = F / tp; /* the F slice of one TP rank */
  for (int32_t r = 0; r < W; r++) {
    if (routing->tokens[r] == 0) continue;
    if (h[r] == NULL || out[r] == NULL)
      return tw__fail(TW_ERR_NULL_POINTER, "%s: h[%d] or out[%d] is NULL for %d tokens", __func__,
                      r, r, routing->tokens[r]);
  }
  for (int32_t r = 0; r < W; r++)
    for (int32_t t = 0; t < routing->tokens[r]; t++)
      for (int32_t n = 0; n < H; n++) {
        float acc = 0.0f;
        for (int32_t j = 0; j < K; j++) {
          const int32_t e = routing->expert_ids[r][(size_t)t * K + j];
          const float* hv = h[r] + ((size_t)t * K + j) * F;
          const float* wn = w2 + ((size_t)e * H + n) * F;
          float y = 0.0f;
          for (int32_t q = 0; q < tp; q++) {
            float part = 0.0f; /* rank (g_j, q)'s partial sum over its slice */
            for (int32_t f = q * S; f < (q + 1) * S; f++) part += hv[f] * wn[f];
            if (partial_bf16) part = tw__ref_bf16_to_f32(tw__ref_f32_to_bf16(part));
            /* The first partial is taken as it is (0 + p would turn -0 into +0), so that tp = 1
             * is the EP reference bit for bit. */
            y = q == 0 ? part : y + part;
          }
          acc += routing->weights[r][(size_t)t * K + j] * y;
        }
        out[r][(size_t)t * H + n] = tw__ref_f32_to_bf16(acc);
      }
  return TW_SUCCESS;
}
