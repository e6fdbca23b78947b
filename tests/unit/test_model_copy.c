/*
 * test_model_copy.c: the copy CTAs of an overlapped layer's dispatch (tw__model_copy_ctas,
 * src/plan/model_copy.c): always 0..P/2; nothing to send: 0 (the dispatch before GEMM1); the
 * choice is the model's own argmin over the sequential order and every C, with the 5% margin (the
 * formula of the file's header, written out again here); one rank whose GEMM1 streams its
 * weights is not overlapped; a long dispatch over NVLink beside a long GEMM1 is, and more bytes
 * never need fewer CTAs once it is.
 */
#include <math.h>

#include "plan.h"
#include "tilewave.h"
#include "tw_test.h"

/* The header's formula; C = 0: sequential. */
static double model_us(const tw_hardware* hw, const tw_copy_model_in* in, int c) {
  const int share = in->ranks_per_gpu > 1 ? in->ranks_per_gpu : 1;
  const double mem = hw->mem_gbps / share, link = share > 1 ? mem / 2 : hw->link_peak_gbps;
  const int p = in->budget, ctas = c == 0 ? p : c;
  const double rate = ctas * hw->link_cta_gbps;
  const double k =
      in->local_bytes / (fmin(rate, mem / 2) * 1e3) + in->remote_bytes / (fmin(rate, link) * 1e3);
  const double g =
      fmax(in->gemm1_flops / ((p - c) * hw->tile_tflops * 1e6), in->weight_bytes / (mem * 1e3));
  if (c == 0) return g + k;
  const double floor = (in->weight_bytes + 2 * (in->local_bytes + in->remote_bytes)) / (mem * 1e3);
  return fmax(fmax(g, k) + fmin(g, k) / in->local_experts, floor);
}

/* A balanced layer of `tokens` tokens per rank on W ranks (shared: one GPU for all). */
static tw_copy_model_in layer_in(double tokens, double hidden, double ffn, int experts, int top_k,
                                 int world, int shared, int budget) {
  tw_copy_model_in in;
  const double rows = tokens * top_k, E = experts / world;
  in.gemm1_flops = 4.0 * rows * hidden * ffn;
  in.weight_bytes = 4.0 * E * hidden * ffn;
  in.local_bytes = 2.0 * hidden * rows / world;
  in.remote_bytes = 2.0 * hidden * rows * (world - 1) / world;
  in.local_experts = (int32_t)E;
  in.budget = budget;
  in.ranks_per_gpu = shared ? world : 1;
  return in;
}

static void test_bounds_and_argmin(void) {
  tw_hardware hw;
  CHECK_OK(tw_hardware_default(&hw));
  const int budgets[] = {2, 3, 16, 66, 132};
  const double tokens[] = {0, 1, 512, 4096, 16384, 65536};
  for (int shared = 0; shared < 2; shared++)
    for (int w = 1; w <= 8; w *= 2)
      for (int bi = 0; bi < 5; bi++)
        for (int ti = 0; ti < 6; ti++) {
          tw_copy_model_in in = layer_in(tokens[ti], 4096, 2048, 64, 4, w, shared, budgets[bi]);
          const int p = in.budget, c = tw__model_copy_ctas(&hw, &in);
          CHECKF(c >= 0 && c <= p / 2, "P %d, %.0f tokens: C %d", p, tokens[ti], c);
          int best = 0;
          for (int k = 1; k <= p / 2; k++)
            if (model_us(&hw, &in, k) < model_us(&hw, &in, best)) best = k;
          if (model_us(&hw, &in, best) > 0.95 * model_us(&hw, &in, 0)) best = 0;
          CHECKF(c == best, "W %d shared %d P %d, %.0f tokens: C %d, the formula's choice %d", w,
                 shared, p, tokens[ti], c, best);
        }
}

static void test_choices(void) {
  tw_hardware hw;
  CHECK_OK(tw_hardware_default(&hw));
  /* Nothing to send, no room, no hardware: sequential. */
  tw_copy_model_in in = layer_in(0, 7168, 2048, 256, 8, 2, 0, 132);
  CHECK(tw__model_copy_ctas(&hw, &in) == 0);
  in = layer_in(16384, 7168, 2048, 256, 8, 2, 0, 1);
  CHECK(tw__model_copy_ctas(&hw, &in) == 0);
  CHECK(tw__model_copy_ctas(NULL, &in) == 0 && tw__model_copy_ctas(&hw, NULL) == 0);
  /* deepseek-v3 on one rank, 4096 tokens: GEMM1 streams 15 GB of weights, the dispatch is a
   * device-memory copy: no overlap (run 94 lost 0.9-2.0 ms with it). */
  in = layer_in(4096, 7168, 2048, 256, 8, 1, 0, 132);
  CHECK(tw__model_copy_ctas(&hw, &in) == 0);
  /* Two GPUs over NVLink, 16384 tokens of deepseek-v3: overlapped, and more remote bytes for the
   * same GEMM1 never fewer CTAs. */
  in = layer_in(16384, 7168, 2048, 256, 8, 2, 0, 132);
  int prev = tw__model_copy_ctas(&hw, &in);
  CHECKF(prev > 0, "deepseek-v3, 2 GPUs, 16384 tokens: not overlapped");
  for (int i = 0; i < 4; i++) {
    in.remote_bytes *= 1.5;
    const int c = tw__model_copy_ctas(&hw, &in);
    CHECKF(c == 0 || c >= prev, "%.0f MB remote: C %d after %d", in.remote_bytes / 1e6, c, prev);
    if (c > 0) prev = c;
  }
}

int main(void) {
  static const tw_test_case cases[] = {TW_TEST(test_bounds_and_argmin), TW_TEST(test_choices)};
  return tw_test_run(cases, (int)(sizeof cases / sizeof cases[0]));
}
