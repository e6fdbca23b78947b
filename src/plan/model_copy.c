/*
 * model_copy.c: the SMs of an overlapped layer's dispatch (tw__model_copy_ctas, plan.h).
 *
 * With the dispatch overlapped, GEMM1 runs on P - C CTAs while the banded copy sends this rank's
 * rows on C, both in the order of the local experts. GEMM1 cannot start an expert's bands before
 * they have arrived and the copy's CTAs are lost to GEMM1 for its whole run (a persistent grid),
 * so the call takes about
 *   max(gemm1(P - C), copy(C)) + min(gemm1(P - C), copy(C)) / E
 * the slower side, plus the first expert's share of the faster one (the other side's head start
 * or tail). gemm1(P) = FLOPs / (P x tile_tflops), copy(C) = bytes / min(C x link_cta_gbps,
 * link_peak_gbps). The choice is the C in 1..P/2 with the least such time (the smallest on ties).
 * It ignores the copy's latency and the rows that other ranks send here (about this rank's own
 * when routing is balanced): a first model, measured against the sweep over C in the layer
 * bench (dev/NOTES.md).
 */
#include "plan.h"

static double tw__overlap_us(double gemm1_us_all, int32_t budget, int32_t c, double bytes,
                             const tw_hardware* hw, int32_t experts) {
  const double gemm1_us = gemm1_us_all * budget / (double)(budget - c);
  double gbps = c * hw->link_cta_gbps;
  if (gbps > hw->link_peak_gbps) gbps = hw->link_peak_gbps;
  const double copy_us = bytes / (gbps * 1e3);
  const double slow = gemm1_us > copy_us ? gemm1_us : copy_us;
  const double fast = gemm1_us > copy_us ? copy_us : gemm1_us;
  return slow + fast / (experts > 0 ? experts : 1);
}

int32_t tw__model_copy_ctas(const tw_hardware* hw, double gemm1_flops, double copy_bytes,
                            int32_t local_experts, int32_t budget) {
  if (hw == NULL || budget < 2) return 1;
  const double rate = hw->tile_tflops > 0 ? hw->tile_tflops : 1.0;
  const double gemm1_us_all = gemm1_flops / (budget * rate * 1e6);
  int32_t best = 1;
  double best_us = 0;
  for (int32_t c = 1; c <= budget / 2; c++) {
    const double t = tw__overlap_us(gemm1_us_all, budget, c, copy_bytes, hw, local_experts);
    if (c == 1 || t < best_us) {
      best = c;
      best_us = t;
    }
  }
  return best;
}
