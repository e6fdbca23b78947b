/*
 * oracle.c: workload matrices and summary arithmetic of `tilewave sweep --oracle` (oracle.h).
 * The full matrix takes the papers' presets from the library's table (tw_preset_name,
 * tw__preset_from_papers), so a paper's preset added there joins it without an edit here; the
 * large models' presets (for the layer benchmark) stay out, so that the matrix keeps its 114
 * points and its regret numbers stay comparable between runs.
 */
#include "oracle.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_stats.h"
#include "plan.h" /* tw__preset_from_papers */
#include "tilewave.h"

static int tw__oracle_add(tw__oracle_point* out, int cap, int* n, const char* name, int hidden,
                          int ffn, int experts, int topk, int tokens, int router) {
  if (*n >= cap) return -1;
  tw__oracle_point* p = &out[(*n)++];
  memset(p, 0, sizeof *p);
  snprintf(p->name, sizeof p->name, "%s", name);
  p->hidden = hidden;
  p->ffn = ffn;
  p->experts = experts;
  p->topk = topk;
  p->tokens = tokens;
  p->router = router;
  return 0;
}

static int tw__oracle_add_preset(tw__oracle_point* out, int cap, int* n, const char* name,
                                 int tokens, int router) {
  tw_problem p = TW_PROBLEM_INIT;
  if (tw_problem_preset(name, &p) != TW_SUCCESS) return -1;
  return tw__oracle_add(out, cap, n, name, p.hidden, p.ffn, p.experts, p.top_k, tokens, router);
}

/* The second paper's grid: K 2048, top-2. */
static int tw__oracle_add_grid(tw__oracle_point* out, int cap, int* n, int tokens, int hidden,
                               int experts, int router) {
  return tw__oracle_add(out, cap, n, "grid", hidden, 2048, experts, 2, tokens, router);
}

int tw__oracle_matrix(const char* which, tw__oracle_point* out, int cap) {
  if (which == NULL || out == NULL || cap < 1) return -1;
  const int routers[3] = {TW_ROUTER_BALANCED, TW_ROUTER_MODERATE_SKEW, TW_ROUTER_STRESS_SKEW};
  int n = 0;
  if (strcmp(which, "full") == 0) {
    const int preset_tokens[3] = {1024, 4096, 16384};
    for (int i = 0; i < tw_preset_count(); i++)
      for (int t = 0; t < 3 && tw__preset_from_papers(i); t++)
        for (int r = 0; r < 3; r++)
          if (tw__oracle_add_preset(out, cap, &n, tw_preset_name(i), preset_tokens[t],
                                    routers[r]) != 0)
            return -1;
    const int grid_tokens[2] = {8192, 16384}, hs[2] = {4096, 8192}, es[5] = {4, 8, 16, 32, 64};
    for (int t = 0; t < 2; t++)
      for (int h = 0; h < 2; h++)
        for (int e = 0; e < 5; e++)
          for (int r = 0; r < 3; r++)
            if (tw__oracle_add_grid(out, cap, &n, grid_tokens[t], hs[h], es[e], routers[r]) != 0)
              return -1;
    return n;
  }
  if (strcmp(which, "quick") == 0) {
    /* Grid points first (the default sweep point, where the model's link rate was fitted, then
     * both N, the E extremes and every router), then every preset once or twice. */
    /* {tokens, N, E, router index} */
    static const int grid[6][4] = {{8192, 4096, 16, 0},  {8192, 4096, 64, 2},
                                   {8192, 8192, 4, 1},   {16384, 4096, 32, 1},
                                   {16384, 8192, 16, 0}, {16384, 8192, 64, 2}};
    for (int i = 0; i < 6; i++)
      if (tw__oracle_add_grid(out, cap, &n, grid[i][0], grid[i][1], grid[i][2],
                              routers[grid[i][3]]) != 0)
        return -1;
    static const struct {
      const char* name;
      int tokens, router;
    } presets[8] = {{"granite-3.1-1b-a400m", 1024, 0},
                    {"granite-3.1-1b-a400m", 16384, 2},
                    {"qwen1.5-moe-a2.7b", 4096, 1},
                    {"deepseek-v2-lite", 16384, 0},
                    {"deepseek-v2-lite", 4096, 2},
                    {"m-gpt", 16384, 1},
                    {"m-bert", 4096, 0},
                    {"m-trans-xl", 1024, 2}};
    for (int i = 0; i < 8; i++)
      if (tw__oracle_add_preset(out, cap, &n, presets[i].name, presets[i].tokens,
                                routers[presets[i].router]) != 0)
        return -1;
    return n;
  }
  return -1;
}

double tw__oracle_percentile(double* v, int n, double q) {
  return tw__stats_percentile(v, n, q); /* the one definition (harness/bench_stats.c) */
}

double tw__oracle_median_ci(double* v, int n, double conf, double* median, double* lo, double* hi) {
  if (median == NULL || lo == NULL || hi == NULL) return NAN;
  *median = *lo = *hi = NAN;
  if (v == NULL || n < 1 || !(conf > 0 && conf < 1)) return NAN;
  *median = tw__stats_median(v, n);
  /* cdf = P(B <= j - 1) for B ~ Binomial(n, 1/2), grown one term at a time; the interval
   * [v_(k), v_(n+1-k)] misses the median with probability 2 P(B <= k - 1). */
  const double tail = 0.5 * (1.0 - conf);
  double term = pow(0.5, n), cdf = 0; /* term = P(B = j - 1), starting at j = 1 */
  int k = 0;
  for (int j = 1; 2 * j <= n; j++) {
    cdf += term;
    if (cdf > tail) break;
    k = j;
    term *= (double)(n - (j - 1)) / (double)j;
  }
  if (k == 0) {
    *lo = -INFINITY, *hi = INFINITY;
    return 1.0;
  }
  *lo = v[k - 1], *hi = v[n - k];
  /* The coverage: 1 - 2 P(B <= k - 1). */
  double miss = 0, t = pow(0.5, n);
  for (int j = 0; j < k; j++) {
    miss += t;
    t *= (double)(n - j) / (double)(j + 1);
  }
  return 1.0 - 2.0 * miss;
}

double tw__oracle_regret(double t_chosen, double t_oracle) {
  return (t_chosen - t_oracle) / t_oracle;
}

/* The oracle of point p: the fastest configuration measured there, the model's and the other one
 * included (they may lie outside the candidates). NaN entries are skipped: NaN < x is false. */
static double tw__oracle_at(const double* t, int p, int ncand, const double* t_model,
                            const double* t_other) {
  double oracle = t_model[p];
  if (t_other != NULL && t_other[p] < oracle) oracle = t_other[p];
  for (int j = 0; j < ncand; j++)
    if (t[(size_t)p * ncand + j] < oracle) oracle = t[(size_t)p * ncand + j];
  return oracle;
}

int tw__oracle_summarize(const double* t, int npoints, int ncand, const double* t_model,
                         const double* t_other, tw__oracle_summary* out) {
  if (t == NULL || t_model == NULL || out == NULL || npoints < 1 || ncand < 1) return -1;
  memset(out, 0, sizeof *out);
  out->points = npoints;
  out->fixed = -1;
  out->max_regret = -INFINITY;
  /* The other configuration against the model's (NaN on either side counts as not faster). */
  for (int p = 0; t_other != NULL && p < npoints; p++) {
    out->other_faster += t_other[p] < t_model[p];
    out->other_faster_1pct += t_other[p] * 1.01 < t_model[p];
  }
  double sum = 0;
  for (int p = 0; p < npoints; p++) {
    if (!(isfinite(t_model[p]) && t_model[p] > 0)) return -1;
    const double r = tw__oracle_regret(t_model[p], tw__oracle_at(t, p, ncand, t_model, t_other));
    sum += r;
    if (r > out->max_regret) {
      out->max_regret = r;
      out->max_regret_point = p;
    }
  }
  out->mean_regret = sum / npoints;

  double best = INFINITY;
  for (int j = 0; j < ncand; j++) {
    double s = 0, mx = -INFINITY;
    int ok = 1;
    for (int p = 0; p < npoints; p++) {
      const double tj = t[(size_t)p * ncand + j];
      if (!(isfinite(tj) && tj > 0)) {
        ok = 0;
        break;
      }
      const double r = tw__oracle_regret(tj, tw__oracle_at(t, p, ncand, t_model, t_other));
      s += r;
      if (r > mx) mx = r;
    }
    if (ok && s / npoints < best) {
      best = s / npoints;
      out->fixed = j;
      out->fixed_mean_regret = best;
      out->fixed_max_regret = mx;
    }
  }
  if (out->fixed >= 0)
    for (int p = 0; p < npoints; p++) {
      const double tf = t[(size_t)p * ncand + out->fixed];
      if (t_model[p] > tf) out->model_slower++;
      if (t_model[p] > 1.01 * tf) out->model_slower_1pct++;
    }
  return 0;
}
