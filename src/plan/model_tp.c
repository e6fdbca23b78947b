/*
 * model_tp.c: the first paper's dependency-constrained, wave-quantized resource model for the
 * tensor-parallel GEMM2 + GatherRS operator, kept exactly (its equations (2)-(18), Algorithm 1).
 *
 * Time is counted in compute-CTA waves. With C communication CTAs the operator reserves
 * R(C) = ceil(C / o_comm) SMs and keeps P(C) = o_comp (G - R(C)) compute slots. Split s (of L)
 * is published after its cumulative tiles finish, A_s(C) = ceil((s + 1) W_comp / P(C)) waves;
 * the communication CTAs serve the splits in order, each in q(C) = rho V_comm(C) waves, so
 * F_s = max(A_s, F_{s-1}) + q and T(C) = F_{L-1}. rho is the paper's reference service-rate
 * ratio rescaled for K, tile size and rank count (eq. (14)-(16)). Among equal T the candidate
 * with the fewest empty slots in the last compute wave wins (eq. (18)), then the smaller C.
 *
 * Cost: O(E + L * c_max) arithmetic, no allocation. Its ceiling divisions (E + (L + 2) c_max of
 * them) were most of a call's time as 64-bit hardware divisions; they are now a shift (a
 * power-of-two tile height) or one floating-point division each, which give the same integers
 * (tw__ceil_div_fp), so every T is the same bit for bit.
 */
#include <math.h>

#include "core.h"
#include "plan.h"

/* Reference point of rho_ref (paper eq. (16)). */
#define TW__TP_K_REF 352.0
#define TW__TP_TM_REF 128.0
#define TW__TP_TN_REF 128.0
#define TW__TP_D_REF 4.0

/* Operands below this bound may take tw__ceil_div_fp's fast path. */
#define TW__FP_DIV_LIMIT ((int64_t)1 << 51)

/* ceil(a / b) for 0 <= a, 1 <= b; `fp` != 0 promises a, b < TW__FP_DIV_LIMIT (checked once per
 * call). Then x = a + b - 1 and b satisfy x + b < 2^53, and floor of the rounded quotient
 * x / b is exact: both are exact doubles, rounding is monotone and n = floor(x / b) is
 * representable, so the quotient does not round below n; rounding it up to n + 1 would need
 * (n + 1) - x / b >= 1 / b to be within 2^-53 (n + 1), i.e. b (n + 1) >= 2^53, but b (n + 1)
 * <= x + b < 2^53. A floating-point division pipelines; a 64-bit integer one does not. */
static inline int64_t tw__ceil_div_fp(int64_t a, int64_t b, int fp) {
  if (!fp) return tw__ceil_div(a, b);
  return (int64_t)((double)(a + b - 1) / (double)b);
}

/* Two T values are the same plateau when they agree to rounding: T is a sum of integer waves
 * and multiples of one rho, so a relative 1e-12 only absorbs floating-point association. */
static int tw__tp_same(double a, double b) {
  const double fa = fabs(a), fb = fabs(b);
  return fabs(a - b) <= 1e-12 * (fa > fb ? fa : fb); /* a conditional, not a libm fmax call */
}

tw_status tw_tp_select(const tw_tp_workload* w, const tw_hardware* hw, int32_t* best_c, double* t) {
  tw__clear_error();
  TW_CHECK_NULL(w);
  TW_CHECK_NULL(hw);
  TW_CHECK_NULL(best_c);
  TW_TRY(tw__hardware_validate(hw));
  if (w->m < 1 || w->n < 1 || w->k < 1 || w->splits < 1 || w->ranks < 1 || w->experts < 1)
    return tw__fail(TW_ERR_INVALID_SIZE,
                    "tw_tp_select: m = %lld, n = %d, k = %d, splits = %d, ranks = %d, experts = "
                    "%d; each must be >= 1",
                    (long long)w->m, w->n, w->k, w->splits, w->ranks, w->experts);
  if (w->splits > w->n)
    return tw__fail(TW_ERR_INVALID_SIZE,
                    "tw_tp_select: splits = %d > n = %d; a split needs at least one column",
                    w->splits, w->n);
  if (w->tm < 1 || w->tn < 1 || w->tm_comm < 1 || w->tn_comm < 1)
    return tw__fail(TW_ERR_INVALID_SIZE,
                    "tw_tp_select: tiles %dx%d (compute) and %dx%d (communication); each side "
                    "must be >= 1",
                    w->tm, w->tn, w->tm_comm, w->tn_comm);
  if (w->expert_rows == NULL)
    return tw__fail(TW_ERR_NULL_POINTER,
                    "tw_tp_select: expert_rows is NULL; pass the (experts) routed row counts M_e");

  /* Eq. (2)-(8): tiles of one split. Each split covers ceil(N / L) output columns. */
  const int64_t split_cols = tw__ceil_div(w->n, w->splits);
  int64_t row_tiles = 0;
  /* TM = 2^sh (the usual 64 or 128): ceil(M_e / TM) is a shift; the test is loop-invariant. */
  const int tm_pow2 = (w->tm & (w->tm - 1)) == 0;
  int32_t sh = 0;
  while (tm_pow2 && (1 << sh) < w->tm) sh++;
  for (int32_t e = 0; e < w->experts; e++) {
    const int64_t rows = w->expert_rows[e];
    if (rows < 0)
      return tw__fail(TW_ERR_INVALID_SIZE,
                      "tw_tp_select: expert_rows[%d] = %lld; routed counts are >= 0", e,
                      (long long)rows);
    row_tiles += tm_pow2 ? (rows + w->tm - 1) >> sh : tw__ceil_div(rows, w->tm);
  }
  const int64_t w_comp = row_tiles * tw__ceil_div(split_cols, w->tn);
  const int64_t w_comm =
      tw__ceil_div(tw__ceil_div(w->m, w->ranks), w->tm_comm) * tw__ceil_div(split_cols, w->tn_comm);

  /* Eq. (15)-(16): rho in compute waves per communication wave. */
  const double rho = hw->rho_ref * (TW__TP_K_REF / (double)w->k) *
                     (TW__TP_TM_REF * TW__TP_TN_REF / ((double)w->tm * (double)w->tn)) *
                     ((double)w->ranks / TW__TP_D_REF);

  int32_t best = 0;
  double best_t = 0.0;
  int64_t best_delta = 0;
  /* The divisions below may use the floating-point path when every dividend (at most L W_comp
   * and W_comm) and divisor (at most G o_comp) is below TW__FP_DIV_LIMIT. */
  const int fp = w_comp <= TW__FP_DIV_LIMIT / w->splits && w_comm < TW__FP_DIV_LIMIT;
  /* R(C) = ceil(C / o_comm) steps up by one at C = 1, o_comm + 1, 2 o_comm + 1, ... */
  int64_t r = 0;
  int32_t left = 0; /* C values before R steps again */
  for (int32_t c = 1; c <= hw->c_max; c++) {
    if (left == 0) r++, left = hw->occ_comm; /* eq. (4) */
    left--;
    const int64_t p = (int64_t)hw->occ_comp * (hw->sm_count - r); /* eq. (5) */
    const int64_t v_comm = tw__ceil_div_fp(w_comm, c, fp);        /* eq. (9) */
    const int64_t v_comp = tw__ceil_div_fp(w_comp, p, fp);        /* eq. (8) */
    const double q = rho * (double)v_comm;                        /* eq. (11) */
    double f = 0.0;                                               /* F_{-1} = 0 */
    for (int32_t s = 0; s < w->splits; s++) {
      /* eq. (10); A_0 = V_comp */
      const int64_t a = s == 0 ? v_comp : tw__ceil_div_fp((int64_t)(s + 1) * w_comp, p, fp);
      f = ((double)a > f ? (double)a : f) + q; /* eq. (12); max without a libm fmax call */
    }
    if (t != NULL) t[c - 1] = f;               /* eq. (13): T(C) = F_{L-1}(C) */
    const int64_t delta = v_comp * p - w_comp; /* eq. (18) */
    /* Strictly better T wins; on the same plateau fewer empty slots win; the ascending loop
     * keeps the smaller C on a full tie. */
    if (best == 0 || (!tw__tp_same(f, best_t) && f < best_t) ||
        (tw__tp_same(f, best_t) && delta < best_delta)) {
      best = c;
      best_t = f;
      best_delta = delta;
    }
  }
  *best_c = best;
  return TW_SUCCESS;
}
