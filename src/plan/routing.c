/*
 * routing.c: routings (for every rank, every token's top_k expert ids and gate weights): built
 * from caller arrays, generated from a seed, read from and written to a text file, and
 * summarised by the load-imbalance statistic R_expert.
 *
 * Generated routings are reproducible bit for bit on every machine: the random stream is
 * xoshiro256** (Blackman and Vigna), seeded per token through splitmix64 from (seed, rank,
 * token). Seeding per token keeps each token's draws independent of every other token's, so
 * the routings for two Zipf exponents differ only where the exponent changes a token's choice
 * (common random numbers); this makes R_expert nearly monotone in the exponent, which the
 * TW_ROUTER_TARGET bisection relies on.
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "plan.h"

/* ------------------------------------------------------------------------------------------ */
/* Random numbers                                                                             */
/* ------------------------------------------------------------------------------------------ */

typedef struct tw__rng {
  uint64_t s[4];
} tw__rng;

static uint64_t tw__splitmix64(uint64_t* x) {
  uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static void tw__rng_seed(tw__rng* r, uint64_t seed) {
  /* splitmix64 never yields four zero words, so the xoshiro state is never all zero. */
  for (int i = 0; i < 4; i++) r->s[i] = tw__splitmix64(&seed);
}

static uint64_t tw__rotl(uint64_t x, int k) {
  return (x << k) | (x >> (64 - k));
}

static uint64_t tw__rng_next(tw__rng* r) {
  uint64_t* s = r->s;
  uint64_t result = tw__rotl(s[1] * 5, 7) * 9;
  uint64_t t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = tw__rotl(s[3], 45);
  return result;
}

/* Uniform in [0, 1) with 53 random bits. */
static double tw__rng_uniform(tw__rng* r) {
  return (double)(tw__rng_next(r) >> 11) * 0x1.0p-53;
}

/* Uniform integer in [0, n), unbiased (rejection of the short last interval). */
static uint64_t tw__rng_below(tw__rng* r, uint64_t n) {
  uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  uint64_t x;
  do {
    x = tw__rng_next(r);
  } while (x >= limit);
  return x % n;
}

/* Standard normal (Box-Muller; one of the pair is enough here). */
static double tw__rng_normal(tw__rng* r) {
  double u1 = 1.0 - tw__rng_uniform(r); /* (0, 1]: log stays finite */
  double u2 = tw__rng_uniform(r);
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

/* ------------------------------------------------------------------------------------------ */
/* Allocation and validation                                                                  */
/* ------------------------------------------------------------------------------------------ */

/* Frees a routing, possibly partly built; keeps the thread's last error (failure paths use it). */
static void tw__routing_free(struct tw_routing* routing) {
  if (routing == NULL) return;
  int32_t w = routing->problem.world_size;
  for (int32_t r = 0; r < w; r++) {
    if (routing->expert_ids) free(routing->expert_ids[r]);
    if (routing->weights) free(routing->weights[r]);
  }
  free(routing->expert_ids);
  free(routing->weights);
  free(routing->tokens);
  free(routing);
}

tw_status tw_routing_destroy(tw_routing_t routing) {
  tw__clear_error();
  tw__routing_free(routing);
  return TW_SUCCESS;
}

/* Allocates a routing with room for tokens[r] tokens on each rank (contents unset). */
static tw_status tw__routing_alloc(const tw_problem* p, const int32_t* tokens,
                                   struct tw_routing** out) {
  struct tw_routing* rt = calloc(1, sizeof *rt);
  if (rt == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "routing: out of host memory");
  rt->problem = *p;
  size_t w = (size_t)p->world_size;
  rt->tokens = calloc(w, sizeof *rt->tokens);
  rt->expert_ids = calloc(w, sizeof *rt->expert_ids);
  rt->weights = calloc(w, sizeof *rt->weights);
  if (rt->tokens == NULL || rt->expert_ids == NULL || rt->weights == NULL) {
    tw__routing_free(rt);
    return tw__fail(TW_ERR_OUT_OF_MEMORY, "routing: out of host memory");
  }
  for (size_t r = 0; r < w; r++) {
    /* At least one element, so that a rank with no tokens still has a non-NULL array. */
    size_t n = (size_t)(tokens[r] > 0 ? tokens[r] : 1) * (size_t)p->top_k;
    rt->tokens[r] = tokens[r];
    rt->expert_ids[r] = malloc(n * sizeof(int32_t));
    rt->weights[r] = malloc(n * sizeof(float));
    if (rt->expert_ids[r] == NULL || rt->weights[r] == NULL) {
      tw__routing_free(rt);
      return tw__fail(TW_ERR_OUT_OF_MEMORY, "routing: out of host memory for rank %zu", r);
    }
  }
  *out = rt;
  return TW_SUCCESS;
}

/* Checks a rank's token count against the capacity. */
static tw_status tw__check_token_count(const tw_problem* p, int32_t rank, int32_t tokens) {
  if (tokens < 0)
    return tw__fail(TW_ERR_INVALID_SIZE, "rank %d: token count %d is negative; pass 0..%d", rank,
                    tokens, p->max_tokens);
  if (tokens > p->max_tokens)
    return tw__fail(TW_ERR_CAPACITY,
                    "rank %d holds %d tokens, more than max_tokens (%d); raise the problem's "
                    "max_tokens or split the batch",
                    rank, tokens, p->max_tokens);
  return TW_SUCCESS;
}

/* Checks one token's choices. stamp: (experts) scratch, where stamp[e] == mark means expert e was
 * already named by this token; mark must be fresh for every token. */
static tw_status tw__check_token(const tw_problem* p, int32_t rank, int32_t token,
                                 const int32_t* ids, const float* weights, int64_t* stamp,
                                 int64_t mark) {
  for (int32_t j = 0; j < p->top_k; j++) {
    int32_t id = ids[j];
    if (id < 0 || id >= p->experts)
      return tw__fail(TW_ERR_EXPERT_ID,
                      "rank %d token %d slot %d: expert id %d is outside 0..%d; ids are global "
                      "expert indices",
                      rank, token, j, id, p->experts - 1);
    if (stamp[id] == mark)
      return tw__fail(TW_ERR_DUPLICATE_EXPERT,
                      "rank %d token %d slot %d: expert id %d is named twice by this token; the "
                      "top_k choices of a token must be distinct experts",
                      rank, token, j, id);
    stamp[id] = mark;
    if (!isfinite(weights[j]))
      return tw__fail(TW_ERR_NONFINITE_WEIGHT,
                      "rank %d token %d slot %d: gate weight %g is not finite; check the router "
                      "output for overflow",
                      rank, token, j, (double)weights[j]);
  }
  return TW_SUCCESS;
}

static int64_t* tw__alloc_stamp(int32_t experts) {
  int64_t* stamp = malloc((size_t)experts * sizeof *stamp);
  if (stamp != NULL)
    for (int32_t e = 0; e < experts; e++) stamp[e] = -1;
  return stamp;
}

tw_status tw_routing_create(const tw_problem* problem, const int32_t* tokens,
                            const int32_t* const* expert_ids, const float* const* weights,
                            tw_routing_t* routing) {
  tw__clear_error();
  TW_CHECK_NULL(routing);
  *routing = NULL;
  TW_TRY(tw_problem_validate(problem));
  TW_CHECK_NULL(tokens);
  TW_CHECK_NULL(expert_ids);
  TW_CHECK_NULL(weights);
  const tw_problem* p = problem;
  for (int32_t r = 0; r < p->world_size; r++) {
    TW_TRY(tw__check_token_count(p, r, tokens[r]));
    if (tokens[r] > 0 && (expert_ids[r] == NULL || weights[r] == NULL))
      return tw__fail(TW_ERR_NULL_POINTER,
                      "rank %d holds %d tokens but its expert_ids or weights array is NULL", r,
                      tokens[r]);
  }
  int64_t* stamp = tw__alloc_stamp(p->experts);
  if (stamp == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "routing: out of host memory");
  int64_t mark = 0;
  for (int32_t r = 0; r < p->world_size; r++) {
    for (int32_t t = 0; t < tokens[r]; t++) {
      size_t off = (size_t)t * (size_t)p->top_k;
      tw_status s = tw__check_token(p, r, t, expert_ids[r] + off, weights[r] + off, stamp, mark++);
      if (s != TW_SUCCESS) {
        free(stamp);
        return s;
      }
    }
  }
  free(stamp);
  struct tw_routing* rt = NULL;
  TW_TRY(tw__routing_alloc(p, tokens, &rt));
  for (int32_t r = 0; r < p->world_size; r++) {
    size_t n = (size_t)tokens[r] * (size_t)p->top_k;
    if (n == 0) continue;
    memcpy(rt->expert_ids[r], expert_ids[r], n * sizeof(int32_t));
    memcpy(rt->weights[r], weights[r], n * sizeof(float));
  }
  *routing = rt;
  return TW_SUCCESS;
}

/* ------------------------------------------------------------------------------------------ */
/* Statistics                                                                                 */
/* ------------------------------------------------------------------------------------------ */

static void tw__routing_loads(const struct tw_routing* rt, int64_t* loads) {
  const tw_problem* p = &rt->problem;
  for (int32_t e = 0; e < p->experts; e++) loads[e] = 0;
  for (int32_t r = 0; r < p->world_size; r++) {
    size_t n = (size_t)rt->tokens[r] * (size_t)p->top_k;
    const int32_t* ids = rt->expert_ids[r];
    for (size_t i = 0; i < n; i++) loads[ids[i]]++;
  }
}

/* Statistics from precomputed loads. */
static void tw__stats_from_loads(const struct tw_routing* rt, const int64_t* loads,
                                 tw_routing_stats* st) {
  const tw_problem* p = &rt->problem;
  int32_t local = p->experts / p->world_size;
  memset(st, 0, sizeof *st);
  for (int32_t r = 0; r < p->world_size; r++) st->total_tokens += rt->tokens[r];
  st->max_expert_load = loads[0];
  st->min_expert_load = loads[0];
  for (int32_t e = 0; e < p->experts; e++) {
    if (loads[e] > st->max_expert_load) st->max_expert_load = loads[e];
    if (loads[e] < st->min_expert_load) st->min_expert_load = loads[e];
  }
  for (int32_t r = 0; r < p->world_size; r++) {
    int64_t rows = 0;
    for (int32_t e = 0; e < local; e++) rows += loads[r * local + e];
    if (rows > st->max_rank_rows) st->max_rank_rows = rows;
  }
  /* R_expert = max_e L_e / (M k / E): 1 means every expert gets its fair share. With no tokens
   * at all the ratio is undefined; report 0 so that it is never mistaken for "balanced". */
  double mean = (double)st->total_tokens * p->top_k / p->experts;
  st->r_expert = st->total_tokens > 0 ? (double)st->max_expert_load / mean : 0.0;
}

tw_status tw_routing_stats_get(tw_routing_t routing, tw_routing_stats* stats) {
  tw__clear_error();
  TW_CHECK_NULL(routing);
  TW_CHECK_NULL(stats);
  int64_t* loads = malloc((size_t)routing->problem.experts * sizeof *loads);
  if (loads == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "routing stats: out of host memory");
  tw__routing_loads(routing, loads);
  tw__stats_from_loads(routing, loads, stats);
  free(loads);
  return TW_SUCCESS;
}

tw_status tw_routing_expert_loads(tw_routing_t routing, int64_t* loads) {
  tw__clear_error();
  TW_CHECK_NULL(routing);
  TW_CHECK_NULL(loads);
  tw__routing_loads(routing, loads);
  return TW_SUCCESS;
}

tw_status tw_routing_rank(tw_routing_t routing, int32_t rank, int32_t* tokens,
                          const int32_t** expert_ids, const float** weights) {
  tw__clear_error();
  TW_CHECK_NULL(routing);
  if (rank < 0 || rank >= routing->problem.world_size)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "rank %d is outside 0..%d (the routing's world size)",
                    rank, routing->problem.world_size - 1);
  if (tokens) *tokens = routing->tokens[rank];
  if (expert_ids) *expert_ids = routing->expert_ids[rank];
  if (weights) *weights = routing->weights[rank];
  return TW_SUCCESS;
}

/* ------------------------------------------------------------------------------------------ */
/* Generators                                                                                 */
/* ------------------------------------------------------------------------------------------ */

/* Scratch of one generation: the popularity order and its cumulative weights. */
typedef struct tw__gen {
  int32_t* perm;  /* (experts) expert id of popularity rank i (a seeded shuffle) */
  double* pop;    /* (experts) p_i, unnormalised: 1 / (1 + i)^s */
  double* cum;    /* (experts) prefix sums of pop */
  int64_t* stamp; /* (experts) per popularity rank: mark of the token that chose it */
} tw__gen;

/* After this many rejected draws (an already chosen expert), a token's remaining choices are
 * drawn by an exact scan instead; both give the same distribution. */
#define TW__MAX_REJECTIONS 16

/* Fills rt (already sized: tokens_per_rank tokens on every rank) with Zipf(s) routing. Every
 * token draws top_k distinct experts by successive sampling without replacement, each draw
 * proportional to p among the experts not yet chosen. */
static void tw__generate_zipf(struct tw_routing* rt, double s, uint64_t seed, tw__gen* g) {
  const tw_problem* p = &rt->problem;
  int32_t n_exp = p->experts, k = p->top_k;
  tw__rng rng;
  tw__rng_seed(&rng, seed);
  for (int32_t i = 0; i < n_exp; i++) g->perm[i] = i;
  for (int32_t i = n_exp - 1; i > 0; i--) { /* Fisher-Yates */
    int32_t j = (int32_t)tw__rng_below(&rng, (uint64_t)i + 1);
    int32_t t = g->perm[i];
    g->perm[i] = g->perm[j];
    g->perm[j] = t;
  }
  double total = 0.0;
  for (int32_t i = 0; i < n_exp; i++) {
    g->pop[i] = pow(1.0 + i, -s);
    total += g->pop[i];
    g->cum[i] = total;
    g->stamp[i] = -1;
  }
  /* Token streams hang off a hash of the seed that differs from the shuffle's stream. */
  uint64_t token_base = seed ^ 0x6a09e667f3bcc909ull;
  token_base = tw__splitmix64(&token_base);
  int64_t mark = 0;
  for (int32_t r = 0; r < p->world_size; r++) {
    for (int32_t t = 0; t < rt->tokens[r]; t++, mark++) {
      int32_t* ids = rt->expert_ids[r] + (size_t)t * k;
      float* w = rt->weights[r] + (size_t)t * k;
      /* Per-token stream from (seed, rank, token); see the file comment. */
      tw__rng_seed(&rng, token_base ^ ((uint64_t)(uint32_t)r << 32) ^ (uint64_t)(uint32_t)t);
      for (int32_t j = 0; j < k; j++) {
        int32_t pick = -1;
        for (int attempt = 0; attempt < TW__MAX_REJECTIONS && pick < 0; attempt++) {
          double u = tw__rng_uniform(&rng) * total;
          int32_t lo = 0, hi = n_exp - 1; /* first i with cum[i] > u */
          while (lo < hi) {
            int32_t mid = lo + (hi - lo) / 2;
            if (g->cum[mid] > u)
              hi = mid;
            else
              lo = mid + 1;
          }
          if (g->stamp[lo] != mark) pick = lo;
        }
        if (pick < 0) { /* exact draw among the experts not chosen yet */
          double rest = 0.0;
          for (int32_t i = 0; i < n_exp; i++)
            if (g->stamp[i] != mark) rest += g->pop[i];
          double u = tw__rng_uniform(&rng) * rest;
          for (int32_t i = 0; i < n_exp; i++) {
            if (g->stamp[i] == mark) continue;
            pick = i; /* the last unchosen one absorbs rounding at the top end */
            if (u < g->pop[i]) break;
            u -= g->pop[i];
          }
        }
        g->stamp[pick] = mark;
        ids[j] = g->perm[pick];
      }
      /* Gate weights: softmax over the chosen experts' standard-normal logits (the logits are
       * kept in w, then replaced by their softmax computed in double). */
      double mx = -INFINITY, sum = 0.0;
      for (int32_t j = 0; j < k; j++) {
        w[j] = (float)tw__rng_normal(&rng);
        if (w[j] > mx) mx = w[j];
      }
      for (int32_t j = 0; j < k; j++) sum += exp((double)w[j] - mx);
      for (int32_t j = 0; j < k; j++) w[j] = (float)(exp((double)w[j] - mx) / sum);
    }
  }
}

/* R_expert of rt (loads: (experts) scratch). */
static double tw__r_expert(const struct tw_routing* rt, int64_t* loads) {
  tw_routing_stats st;
  tw__routing_loads(rt, loads);
  tw__stats_from_loads(rt, loads, &st);
  return st.r_expert;
}

tw_status tw_routing_generate(const tw_problem* problem, tw_router router, double param,
                              int32_t tokens_per_rank, uint64_t seed, tw_routing_t* routing) {
  tw__clear_error();
  TW_CHECK_NULL(routing);
  *routing = NULL;
  TW_TRY(tw_problem_validate(problem));
  const tw_problem* p = problem;
  if (tokens_per_rank < 0)
    return tw__fail(TW_ERR_INVALID_SIZE, "tokens_per_rank (%d) is negative; pass 0..%d",
                    tokens_per_rank, p->max_tokens);
  if (tokens_per_rank > p->max_tokens)
    return tw__fail(TW_ERR_CAPACITY,
                    "tokens_per_rank (%d) exceeds max_tokens (%d); raise the problem's max_tokens",
                    tokens_per_rank, p->max_tokens);
  double s = 0.0;
  switch (router) {
    case TW_ROUTER_BALANCED:
      s = 0.0;
      break;
    case TW_ROUTER_MODERATE_SKEW:
      s = TW_ZIPF_MODERATE;
      break;
    case TW_ROUTER_STRESS_SKEW:
      s = TW_ZIPF_STRESS;
      break;
    case TW_ROUTER_TARGET:
      if (!(param >= 1.0) || !isfinite(param))
        return tw__fail(TW_ERR_INVALID_ARGUMENT,
                        "target R_expert (%g) must be a finite number >= 1 (1 = balanced)", param);
      break;
    default:
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "router (%d) is not a tw_router; use TW_ROUTER_BALANCED, "
                      "TW_ROUTER_MODERATE_SKEW, TW_ROUTER_STRESS_SKEW or TW_ROUTER_TARGET",
                      (int)router);
  }
  int32_t* tokens = malloc((size_t)p->world_size * sizeof *tokens);
  if (tokens == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "routing: out of host memory");
  for (int32_t r = 0; r < p->world_size; r++) tokens[r] = tokens_per_rank;
  struct tw_routing* rt = NULL;
  tw_status st = tw__routing_alloc(p, tokens, &rt);
  free(tokens);
  if (st != TW_SUCCESS) return st;
  size_t ne = (size_t)p->experts;
  tw__gen g = {malloc(ne * sizeof(int32_t)), malloc(ne * sizeof(double)),
               malloc(ne * sizeof(double)), malloc(ne * sizeof(int64_t))};
  int64_t* loads = malloc(ne * sizeof(int64_t));
  if (!g.perm || !g.pop || !g.cum || !g.stamp || !loads) {
    st = tw__fail(TW_ERR_OUT_OF_MEMORY, "routing: out of host memory");
    goto done;
  }
  if (router == TW_ROUTER_TARGET) {
    /* R_expert grows with the Zipf exponent (from about 1 at s = 0 up to E / k when every token
     * picks the same k experts). Bracket the target by doubling, then bisect, keeping the
     * exponent whose realised routing came closest. The realised value is what stats report. */
    double best_s = 0.0, best_err = INFINITY;
    double lo = 0.0, hi = 0.0;
    for (int i = 0; i < 8; i++) { /* s = 0, 0.5, 1, 2, ..., 32 */
      tw__generate_zipf(rt, hi, seed, &g);
      double rr = tw__r_expert(rt, loads);
      if (fabs(rr - param) < best_err) best_err = fabs(rr - param), best_s = hi;
      if (rr >= param) break;
      lo = hi;
      hi = hi == 0.0 ? 0.5 : 2.0 * hi;
    }
    for (int i = 0; i < 30 && hi > lo && best_err > 1e-4 * param; i++) {
      double mid = 0.5 * (lo + hi);
      tw__generate_zipf(rt, mid, seed, &g);
      double rr = tw__r_expert(rt, loads);
      if (fabs(rr - param) < best_err) best_err = fabs(rr - param), best_s = mid;
      if (rr >= param)
        hi = mid;
      else
        lo = mid;
    }
    s = best_s;
    TW_INFO("routing target R_expert %g: Zipf exponent %g, realised within %g", param, s, best_err);
  }
  tw__generate_zipf(rt, s, seed, &g);
  *routing = rt;
  rt = NULL;
done:
  free(g.perm);
  free(g.pop);
  free(g.cum);
  free(g.stamp);
  free(loads);
  tw__routing_free(rt);
  return st;
}

/* ------------------------------------------------------------------------------------------ */
/* File format (docs/routing-format.md)                                                       */
/* ------------------------------------------------------------------------------------------ */

#define TW__ROUTING_FORMAT_VERSION 1

tw_status tw_routing_write(tw_routing_t routing, const char* path) {
  tw__clear_error();
  TW_CHECK_NULL(routing);
  TW_CHECK_NULL(path);
  const tw_problem* p = &routing->problem;
  FILE* f = fopen(path, "w");
  if (f == NULL)
    return tw__fail(TW_ERR_IO, "cannot open routing file \"%s\" for writing: %s", path,
                    strerror(errno));
  fprintf(f, "tilewave-routing %d world_size %d experts %d top_k %d\n", TW__ROUTING_FORMAT_VERSION,
          p->world_size, p->experts, p->top_k);
  for (int32_t r = 0; r < p->world_size; r++) {
    fprintf(f, "rank %d tokens %d\n", r, routing->tokens[r]);
    for (int32_t t = 0; t < routing->tokens[r]; t++) {
      const int32_t* ids = routing->expert_ids[r] + (size_t)t * p->top_k;
      const float* w = routing->weights[r] + (size_t)t * p->top_k;
      for (int32_t j = 0; j < p->top_k; j++) fprintf(f, j ? " %d" : "%d", ids[j]);
      /* %.9g: nine significant digits round-trip every float exactly. */
      for (int32_t j = 0; j < p->top_k; j++) fprintf(f, " %.9g", (double)w[j]);
      fputc('\n', f);
    }
  }
  int bad = ferror(f);
  if (fclose(f) != 0 || bad)
    return tw__fail(TW_ERR_IO, "writing routing file \"%s\" failed: %s", path, strerror(errno));
  return TW_SUCCESS;
}

/* Line reader that skips blank lines and '#' comments and counts lines. */
typedef struct tw__reader {
  FILE* f;
  const char* path;
  char* buf;
  size_t cap;
  long line;
} tw__reader;

/* A routing line holds at most TW_MAX_TOP_K ids and weights: a longer one (or one with a NUL
 * byte) is not a routing file, and an endless one (a device, a pipe) must not be read forever;
 * nor may an endless run of blank or comment lines. */
enum { TW__MAX_LINE = 1 << 16, TW__MAX_SKIPPED_LINES = 1 << 20 };

/* Next content line in r->buf: 1, 0 at end of file, -1 (recorded with tw__fail) when the input
 * is not a routing file's text. */
static int tw__next_line(tw__reader* r) {
  if (r->buf == NULL) {
    r->buf = (char*)malloc(TW__MAX_LINE + 1);
    if (r->buf == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "routing: host memory"), -1;
    r->cap = TW__MAX_LINE + 1;
  }
  for (long skipped = 0; skipped < TW__MAX_SKIPPED_LINES; skipped++) {
    size_t n = 0;
    int c = EOF;
    while (n < TW__MAX_LINE && (c = getc(r->f)) != EOF && c != '\n') {
      if (c == '\0') {
        tw__fail(TW_ERR_IO, "%s:%ld: a NUL byte; not a routing file (docs/routing-format.md)",
                 r->path, r->line + 1);
        return -1;
      }
      r->buf[n++] = (char)c;
    }
    if (n == TW__MAX_LINE) {
      tw__fail(TW_ERR_IO, "%s:%ld: a line of more than %d bytes; not a routing file", r->path,
               r->line + 1, TW__MAX_LINE);
      return -1;
    }
    if (c == EOF && n == 0) return 0;
    r->buf[n] = '\0';
    r->line++;
    char* s = r->buf;
    while (*s == ' ' || *s == '\t' || *s == '\r') s++;
    if (*s != '\0' && *s != '#') return 1;
  }
  tw__fail(TW_ERR_IO, "%s:%ld: more than %d blank or comment lines in a row; not a routing file",
           r->path, r->line, TW__MAX_SKIPPED_LINES);
  return -1;
}

/* Records again the failure of a shared check (tw_last_error()), prefixed with path:line. */
static tw_status tw__fail_here(const tw__reader* r, tw_status st) {
  char msg[768];
  snprintf(msg, sizeof msg, "%s", tw_last_error());
  return tw__fail(st, "%s:%ld: %s", r->path, r->line, msg);
}

/* Parses an int at *s (after spaces); advances *s. Returns 0 on failure. */
static int tw__parse_int(char** s, int32_t* v) {
  char* end = NULL;
  errno = 0;
  long x = strtol(*s, &end, 10);
  if (end == *s || errno != 0 || x < INT32_MIN || x > INT32_MAX) return 0;
  if (*end != '\0' && *end != ' ' && *end != '\t' && *end != '\r' && *end != '\n') return 0;
  *v = (int32_t)x;
  *s = end;
  return 1;
}

static int tw__parse_float(char** s, float* v) {
  char* end = NULL;
  float x = strtof(*s, &end); /* accepts nan/inf; the caller rejects them with a precise code */
  if (end == *s) return 0;
  if (*end != '\0' && *end != ' ' && *end != '\t' && *end != '\r' && *end != '\n') return 0;
  *v = x;
  *s = end;
  return 1;
}

/* Expects the literal word at *s (after spaces). */
static int tw__parse_word(char** s, const char* word) {
  while (**s == ' ' || **s == '\t') (*s)++;
  size_t n = strlen(word);
  if (strncmp(*s, word, n) != 0) return 0;
  char c = (*s)[n];
  if (c != ' ' && c != '\t' && c != '\0' && c != '\r' && c != '\n') return 0;
  *s += n;
  return 1;
}

static int tw__at_end(char* s) {
  while (*s == ' ' || *s == '\t' || *s == '\r' || *s == '\n') s++;
  return *s == '\0';
}

tw_status tw_routing_read(const tw_problem* problem, const char* path, tw_routing_t* routing) {
  tw__clear_error();
  TW_CHECK_NULL(routing);
  *routing = NULL;
  TW_TRY(tw_problem_validate(problem));
  TW_CHECK_NULL(path);
  const tw_problem* p = problem;
  tw__reader rd = {fopen(path, "r"), path, NULL, 0, 0};
  if (rd.f == NULL)
    return tw__fail(TW_ERR_IO, "cannot open routing file \"%s\": %s", path, strerror(errno));
  tw_status st = TW_SUCCESS;
  struct tw_routing* rt = NULL;
  int32_t* zero = calloc((size_t)p->world_size, sizeof *zero);
  int64_t* stamp = tw__alloc_stamp(p->experts);
  if (zero == NULL || stamp == NULL) {
    st = tw__fail(TW_ERR_OUT_OF_MEMORY, "routing: out of host memory");
    goto done;
  }
  /* Header. */
  int32_t version = 0, w = 0, e = 0, k = 0;
  char* s = NULL;
  const int got_header = tw__next_line(&rd);
  if (got_header < 0) {
    st = TW_ERR_IO;
    goto done;
  }
  if (got_header == 0) {
    st = tw__fail(TW_ERR_IO,
                  "%s:%ld: empty file; expected the header \"tilewave-routing 1 "
                  "world_size W experts E top_k K\"",
                  path, rd.line + 1);
    goto done;
  }
  s = rd.buf;
  if (!tw__parse_word(&s, "tilewave-routing") || !tw__parse_int(&s, &version) ||
      !tw__parse_word(&s, "world_size") || !tw__parse_int(&s, &w) ||
      !tw__parse_word(&s, "experts") || !tw__parse_int(&s, &e) || !tw__parse_word(&s, "top_k") ||
      !tw__parse_int(&s, &k) || !tw__at_end(s)) {
    st = tw__fail(TW_ERR_IO,
                  "%s:%ld: bad header; expected \"tilewave-routing 1 world_size W experts E "
                  "top_k K\"",
                  path, rd.line);
    goto done;
  }
  if (version != TW__ROUTING_FORMAT_VERSION) {
    st = tw__fail(TW_ERR_IO, "%s:%ld: format version %d is not supported (this library reads %d)",
                  path, rd.line, version, TW__ROUTING_FORMAT_VERSION);
    goto done;
  }
  if (w != p->world_size || e != p->experts || k != p->top_k) {
    st = tw__fail(TW_ERR_INVALID_ARGUMENT,
                  "%s:%ld: the file is for world_size %d, experts %d, top_k %d but the problem "
                  "has %d, %d, %d; use a problem of the same shape",
                  path, rd.line, w, e, k, p->world_size, p->experts, p->top_k);
    goto done;
  }
  /* Every rank starts empty; its arrays grow to its declared count when its line is read, so
   * the file is read once and memory follows the file, not the capacity. */
  st = tw__routing_alloc(p, zero, &rt);
  if (st != TW_SUCCESS) goto done;
  int64_t mark = 0;
  for (int32_t r = 0; r < w; r++) {
    int32_t rank = -1, n = -1;
    const int got = tw__next_line(&rd);
    if (got < 0) {
      st = TW_ERR_IO;
      goto done;
    }
    if (got == 0) {
      st = tw__fail(TW_ERR_IO, "%s:%ld: end of file; expected \"rank %d tokens N\"", path,
                    rd.line + 1, r);
      goto done;
    }
    s = rd.buf;
    if (!tw__parse_word(&s, "rank") || !tw__parse_int(&s, &rank) || !tw__parse_word(&s, "tokens") ||
        !tw__parse_int(&s, &n) || !tw__at_end(s) || rank != r) {
      st = tw__fail(TW_ERR_IO, "%s:%ld: expected \"rank %d tokens N\" (ranks in order 0..%d)", path,
                    rd.line, r, w - 1);
      goto done;
    }
    st = tw__check_token_count(p, r, n);
    if (st != TW_SUCCESS) {
      st = tw__fail_here(&rd, st);
      goto done;
    }
    if (n > 0) {
      size_t cnt = (size_t)n * (size_t)k;
      int32_t* grown_ids = realloc(rt->expert_ids[r], cnt * sizeof(int32_t));
      if (grown_ids != NULL) rt->expert_ids[r] = grown_ids;
      float* grown_w = realloc(rt->weights[r], cnt * sizeof(float));
      if (grown_w != NULL) rt->weights[r] = grown_w;
      if (grown_ids == NULL || grown_w == NULL) {
        st = tw__fail(TW_ERR_OUT_OF_MEMORY, "%s:%ld: out of host memory for %d tokens", path,
                      rd.line, n);
        goto done;
      }
    }
    for (int32_t t = 0; t < n; t++) {
      const int got_token = tw__next_line(&rd);
      if (got_token < 0) {
        st = TW_ERR_IO;
        goto done;
      }
      if (got_token == 0) {
        st = tw__fail(TW_ERR_IO, "%s:%ld: end of file; rank %d declares %d tokens, found %d", path,
                      rd.line + 1, r, n, t);
        goto done;
      }
      int32_t* ids = rt->expert_ids[r] + (size_t)t * k;
      float* wt = rt->weights[r] + (size_t)t * k;
      s = rd.buf;
      int ok = 1;
      for (int32_t j = 0; j < k && ok; j++) ok = tw__parse_int(&s, &ids[j]);
      for (int32_t j = 0; j < k && ok; j++) ok = tw__parse_float(&s, &wt[j]);
      if (!ok || !tw__at_end(s)) {
        st = tw__fail(TW_ERR_IO,
                      "%s:%ld: rank %d token %d: expected %d integer expert ids then %d gate "
                      "weights",
                      path, rd.line, r, t, k, k);
        goto done;
      }
      st = tw__check_token(p, r, t, ids, wt, stamp, mark++);
      if (st != TW_SUCCESS) {
        st = tw__fail_here(&rd, st);
        goto done;
      }
    }
    rt->tokens[r] = n;
  }
  const int after = tw__next_line(&rd);
  if (after != 0) {
    st = after < 0
             ? TW_ERR_IO
             : tw__fail(TW_ERR_IO, "%s:%ld: unexpected content after the last rank", path, rd.line);
    goto done;
  }
  *routing = rt;
  rt = NULL;
done:
  tw__routing_free(rt);
  free(zero);
  free(stamp);
  free(rd.buf);
  fclose(rd.f);
  return st;
}
