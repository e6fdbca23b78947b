/*
 * oracle.h: the workload matrices of `tilewave sweep --oracle` and the arithmetic of its summary
 * (regret against the measured oracle, the best single fixed (C, mgb) over a matrix, and how often
 * the model's choice loses to it). Pure host C, no CUDA, so that the unit tests check it with
 * hand-computed numbers (tests/unit/test_oracle.c) and the numbers behind the model's bars come
 * from tested code.
 */
#ifndef TW_ORACLE_H
#define TW_ORACLE_H

#ifdef __cplusplus
extern "C" {
#endif

/* One workload of a matrix: GEMM2 K = ffn, N = hidden, experts in total over all ranks. */
typedef struct tw__oracle_point {
  char name[32]; /* preset name, or "grid" for the second paper's grid */
  int hidden, ffn, experts, topk;
  int tokens; /* tokens per rank */
  int router; /* tw_router: balanced, moderate or stress Zipf */
} tw__oracle_point;

/* Largest matrix tw__oracle_matrix builds (the full one has 114 points). */
#define TW__ORACLE_MAX_POINTS 160

/* Fills out[0..n) with the matrix `which` and returns n, or -1 for an unknown name or cap too
 * small.
 *   "full":  every preset at tokens/rank {1024, 4096, 16384} x routers {balanced, moderate_skew,
 *            stress_skew}, then the second paper's grid: tokens/rank {8192, 16384} x N {4096,
 *            8192} x E {4, 8, 16, 32, 64}, K 2048, top-2, x the three routers;
 *   "quick": 14 points of the full matrix, each preset and both grid sizes at least once, every
 *            router and every token count at least once. */
int tw__oracle_matrix(const char* which, tw__oracle_point* out, int cap);

/* Percentile q in [0, 1] of v[0..n) by linear interpolation between order statistics (numpy's
 * default, as the benchmark's p10/p90). Sorts v in place; n < 1 gives NaN. */
double tw__oracle_percentile(double* v, int n, double q);

/* The sample median of v[0..n) and a distribution-free confidence interval for the population
 * median at confidence >= `conf` (0 < conf < 1): the order statistics [v_(k), v_(n+1-k)] (1-based)
 * with the largest k such that P(Binomial(n, 1/2) < k) <= (1 - conf) / 2. Where even k = 1 is
 * not enough (n = 5 or fewer at 95%), lo = -inf and hi = +inf. Sorts v in place. Returns the
 * coverage of the interval (1 when unbounded), or NaN (and NaN outputs) for n < 1, a NULL
 * pointer or conf outside (0, 1). */
double tw__oracle_median_ci(double* v, int n, double conf, double* median, double* lo, double* hi);

/* Regret of a chosen time against the oracle's: (t_chosen - t_oracle) / t_oracle. */
double tw__oracle_regret(double t_chosen, double t_oracle);

typedef struct tw__oracle_summary {
  int points;
  double mean_regret, max_regret; /* the model's choice against each point's oracle */
  int max_regret_point;           /* the point of max_regret */
  int fixed;                      /* best fixed candidate (lowest mean regret), -1 if none */
  double fixed_mean_regret, fixed_max_regret;
  int model_slower;      /* points where t_model > t_fixed */
  int model_slower_1pct; /* points where t_model > 1.01 t_fixed */
  int other_faster;      /* points where t_model > t_other (0 without t_other) */
  int other_faster_1pct; /* points where t_model > 1.01 t_other */
} tw__oracle_summary;

/* Summarises a measured matrix.
 * [in] t:       (npoints, ncand) measured time of candidate j at point p, row-major; NaN where
 *               the candidate was not measured (a candidate counts as a fixed choice only if it
 *               was measured at every point)
 * [in] t_model: (npoints) measured time of the model's choice at each point (it may lie outside
 *               the candidates: each point's oracle is the minimum of its row and t_model)
 * [in] t_other: (npoints) or NULL: one more measured configuration per point that joins the
 *               oracle but is no fixed choice (the sweep's: the model's C and mgb with the
 *               other schedule); NaN where not measured
 * Returns 0, or -1 when npoints or ncand < 1, a t_model is not finite and positive, or a pointer
 * is NULL (out is then filled only in part: other_faster* are counted over every point before
 * the t_model checks). Ties between fixed candidates go to the lower index. */
int tw__oracle_summarize(const double* t, int npoints, int ncand, const double* t_model,
                         const double* t_other, tw__oracle_summary* out);

#ifdef __cplusplus
}
#endif

#endif /* TW_ORACLE_H */
