/*
 * model_copy.c: the SMs of an overlapped layer's dispatch (tw__model_copy_ctas, plan.h).
 *
 * With the dispatch overlapped, GEMM1 runs on P - C CTAs while the banded copy sends this rank's
 * rows on C, both in the order of the local experts. GEMM1 cannot start an expert's bands before
 * they have arrived and the copy's CTAs are lost to GEMM1 for its whole run (a persistent grid),
 * so the call takes about
 *   overlapped(C) = max(gemm1(P - C), copy(C)) + min(gemm1(P - C), copy(C)) / E,
 * the slower side plus the first expert's share of the faster one (the other side's head start
 * or tail), and no less than the device memory both need: GEMM1's weights and the copy's reads
 * and writes, at this rank's share of mem_gbps (ranks on one GPU share it). Against that,
 * sequential = copy(P) + gemm1(P): the dispatch on every SM, then GEMM1. Here
 *   gemm1(p) = max(FLOPs / (p x tile_tflops), weight bytes / memory),
 *   copy(c)  = local bytes / min(c x link_cta_gbps, memory / 2)
 *            + remote bytes / min(c x link_cta_gbps, link),
 * link = link_peak_gbps, or memory / 2 for ranks that share one GPU (a copy in device memory
 * reads and writes it). The dispatch copy's own rate per CTA (28-39 GB/s at 32..4 CTAs, run 94)
 * is about the consumer's over NVLink (link_cta_gbps). The choice is the C in 1..P/2 with the
 * least overlapped time, or 0 (sequential) unless that is at least TW__COPY_MIN_GAIN below the
 * sequential time: the copy's SMs cost GEMM1 C/P of its time, where GEMM1 streams its weights
 * the copy's traffic slows it as well, and the model is optimistic there (run 94, one H200: a
 * tie predicted for deepseek-v3 on one rank, 0.9-2.0 ms lost at C = 4..16; 1.5-3.5% predicted
 * for in-process pairs, -3..+0.5% measured). It ignores the copy's latency and the rows other ranks
 * send here (about this rank's own when routing is balanced); dev/NOTES.md has its record against
 * the sweep over C.
 */
#include "plan.h"

/* The least predicted gain, as a share of the sequential time, that overlap must show. */
#define TW__COPY_MIN_GAIN 0.05

typedef struct tw__copy_terms {
  double mem, link, cta; /* GB/s: this rank's device memory (read + write), link, one CTA */
} tw__copy_terms;

static double tw__min(double a, double b) {
  return a < b ? a : b;
}

static double tw__max(double a, double b) {
  return a > b ? a : b;
}

/* us for `bytes` at `gbps`. */
static double tw__us(double bytes, double gbps) {
  return gbps > 0 ? bytes / (gbps * 1e3) : 0.0;
}

static double tw__copy_us(const tw__copy_terms* t, const tw_copy_model_in* in, int32_t ctas) {
  const double rate = ctas * t->cta;
  return tw__us(in->local_bytes, tw__min(rate, 0.5 * t->mem)) +
         tw__us(in->remote_bytes, tw__min(rate, t->link));
}

static double tw__gemm1_us(const tw_hardware* hw, const tw__copy_terms* t,
                           const tw_copy_model_in* in, int32_t ctas) {
  const double rate = hw->tile_tflops > 0 ? hw->tile_tflops : 1.0;
  return tw__max(in->gemm1_flops / (ctas * rate * 1e6), tw__us(in->weight_bytes, t->mem));
}

int32_t tw__model_copy_ctas(const tw_hardware* hw, const tw_copy_model_in* in) {
  if (hw == NULL || in == NULL || in->budget < 2 || hw->link_cta_gbps <= 0 || hw->mem_gbps <= 0)
    return 0;
  const int32_t P = in->budget, E = in->local_experts > 0 ? in->local_experts : 1;
  const int32_t share = in->ranks_per_gpu > 1 ? in->ranks_per_gpu : 1;
  tw__copy_terms t;
  t.mem = hw->mem_gbps / share;
  t.link = share > 1 ? 0.5 * t.mem : hw->link_peak_gbps;
  t.cta = hw->link_cta_gbps;
  const double floor_us =
      tw__us(in->weight_bytes + 2.0 * (in->local_bytes + in->remote_bytes), t.mem);
  const double sequential_us = tw__gemm1_us(hw, &t, in, P) + tw__copy_us(&t, in, P);
  double best_us = sequential_us;
  int32_t best = 0;
  for (int32_t c = 1; c <= P / 2; c++) {
    const double g = tw__gemm1_us(hw, &t, in, P - c), k = tw__copy_us(&t, in, c);
    const double us = tw__max(tw__max(g, k) + tw__min(g, k) / E, floor_us);
    if (us < best_us) {
      best = c;
      best_us = us;
    }
  }
  return best_us <= (1.0 - TW__COPY_MIN_GAIN) * sequential_us ? best : 0;
}
