/*
 * test_model_copy.c: the copy CTAs of an overlapped layer's dispatch (tw__model_copy_ctas,
 * src/plan/model_copy.c): always 1..P/2; nothing to send needs one CTA; more bytes against the
 * same GEMM1 never need fewer CTAs; and the choice is the argmin of the model's own time over
 * every C (recomputed here from the formula in the file's header).
 */
#include <math.h>

#include "plan.h"
#include "tilewave.h"
#include "tw_test.h"

/* The header's formula, written out again. */
static double model_us(const tw_hardware* hw, double flops, double bytes, int experts, int p,
                       int c) {
  const double g = flops / ((p - c) * hw->tile_tflops * 1e6);
  const double gbps = fmin(c * hw->link_cta_gbps, hw->link_peak_gbps);
  const double k = bytes / (gbps * 1e3);
  return fmax(g, k) + fmin(g, k) / experts;
}

static void test_bounds_and_argmin(void) {
  tw_hardware hw;
  CHECK_OK(tw_hardware_default(&hw));
  const int budgets[] = {2, 3, 16, 66, 132};
  const double mib[] = {0.0, 1.0, 16.0, 64.0, 512.0, 4096.0};
  for (int bi = 0; bi < 5; bi++)
    for (int mi = 0; mi < 6; mi++) {
      const int p = budgets[bi];
      /* GEMM1 of 8192 rows, hidden 4096, ffn 2048; 16 local experts. */
      const double flops = 4.0 * 8192 * 4096 * 2048, bytes = mib[mi] * 1048576.0;
      const int c = tw__model_copy_ctas(&hw, flops, bytes, 16, p);
      CHECKF(c >= 1 && c <= (p / 2 > 1 ? p / 2 : 1), "P %d, %.0f MiB: C %d", p, mib[mi], c);
      int best = 1;
      for (int k = 2; k <= p / 2; k++)
        if (model_us(&hw, flops, bytes, 16, p, k) < model_us(&hw, flops, bytes, 16, p, best))
          best = k;
      CHECKF(c == best, "P %d, %.0f MiB: C %d, the formula's argmin %d", p, mib[mi], c, best);
    }
}

static void test_more_bytes_more_ctas(void) {
  tw_hardware hw;
  CHECK_OK(tw_hardware_default(&hw));
  const double flops = 4.0 * 16384 * 7168 * 4096;
  CHECK(tw__model_copy_ctas(&hw, flops, 0.0, 32, 132) == 1);
  int prev = 1;
  for (double mib = 1; mib <= 8192; mib *= 2) {
    const int c = tw__model_copy_ctas(&hw, flops, mib * 1048576.0, 32, 132);
    CHECKF(c >= prev, "%.0f MiB: C %d after %d for fewer bytes", mib, c, prev);
    prev = c;
  }
  CHECKF(prev > 1, "8 GiB to send beside GEMM1 still gets one CTA");
  /* No hardware or no room: one CTA. */
  CHECK(tw__model_copy_ctas(NULL, flops, 1e9, 32, 132) == 1);
  CHECK(tw__model_copy_ctas(&hw, flops, 1e9, 32, 1) == 1);
}

int main(void) {
  static const tw_test_case cases[] = {TW_TEST(test_bounds_and_argmin),
                                       TW_TEST(test_more_bytes_more_ctas)};
  return tw_test_run(cases, (int)(sizeof cases / sizeof cases[0]));
}
