/*
 * tw_test_random.h: seeded random inputs for the CPU tests (references, plan execution).
 *
 * One seed per run, printed by the tw_test_seed_setup case (list it first in TW_TEST_MAIN);
 * TW_TEST_SEED repeats a run. Each test derives its own splitmix64 stream from tw_test_seed, so
 * that adding a draw to one test does not change the inputs of the others.
 */
#ifndef TW_TEST_RANDOM_H
#define TW_TEST_RANDOM_H

#include <stdint.h>
#include <time.h>

#include "tilewave.h"
#include "tw_test.h"

static uint64_t tw_test_seed;

static inline void tw_test_seed_setup(void) {
  const char* env = getenv("TW_TEST_SEED");
  tw_test_seed = env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL);
  printf("  seed %llu (TW_TEST_SEED to repeat)\n", (unsigned long long)tw_test_seed);
}

static inline uint64_t tw_test_rng_next(uint64_t* s) { /* splitmix64 */
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* Uniform in [-1, 1). */
static inline float tw_test_rng_sym(uint64_t* s) {
  return (float)((double)(tw_test_rng_next(s) >> 11) * 0x1.0p-52 - 1.0);
}

static inline tw_problem tw_test_problem(int32_t W, int32_t H, int32_t F, int32_t E, int32_t K,
                                         int32_t max_tokens, int32_t tm, int32_t tn) {
  tw_problem p = TW_PROBLEM_INIT;
  p.world_size = W;
  p.hidden = H;
  p.ffn = F;
  p.experts = E;
  p.top_k = K;
  p.max_tokens = max_tokens;
  p.tile_m = tm;
  p.tile_n = tn;
  return p;
}

/* A random routing with the given per-rank token counts (some may be 0): distinct experts per
 * token, uniform over all experts, or piled on the first top_k + 1 when `pile` is set; gate
 * weights signed and unnormalised (any weights must work). NULL (and a failed check) on error. */
static inline tw_routing_t tw_test_random_routing(const tw_problem* p, const int32_t* tokens,
                                                  uint64_t* s, int pile) {
  int32_t* ids[TW_MAX_RANKS];
  float* w[TW_MAX_RANKS];
  const int32_t K = p->top_k;
  const uint64_t range = pile && K < p->experts ? (uint64_t)(K + 1) : (uint64_t)p->experts;
  for (int32_t r = 0; r < p->world_size; r++) {
    ids[r] = (int32_t*)malloc(sizeof(int32_t) * ((size_t)tokens[r] * K + 1));
    w[r] = (float*)malloc(sizeof(float) * ((size_t)tokens[r] * K + 1));
    for (int32_t t = 0; t < tokens[r]; t++)
      for (int32_t j = 0; j < K; j++) {
        int32_t e, dup;
        do {
          e = (int32_t)(tw_test_rng_next(s) % range);
          dup = 0;
          for (int32_t i = 0; i < j; i++) dup |= ids[r][t * K + i] == e;
        } while (dup);
        ids[r][t * K + j] = e;
        w[r][t * K + j] = tw_test_rng_sym(s);
      }
  }
  tw_routing_t rt = NULL;
  CHECK_OK(tw_routing_create(p, tokens, (const int32_t* const*)ids, (const float* const*)w, &rt));
  for (int32_t r = 0; r < p->world_size; r++) {
    free(ids[r]);
    free(w[r]);
  }
  return rt;
}

/* Uniform in [lo, hi]. */
static inline int32_t tw_test_rnd_in(uint64_t* s, int32_t lo, int32_t hi) {
  return lo + (int32_t)(tw_test_rng_next(s) % (uint64_t)(hi - lo + 1));
}

/* Per-rank token counts of the kinds the planner must take: full, 0, 1, odd or any, drawn per
 * rank. */
static inline void tw_test_token_kinds(uint64_t* s, int32_t W, int32_t max_tokens,
                                       int32_t* tokens) {
  for (int32_t r = 0; r < W; r++) {
    const int32_t kind = tw_test_rnd_in(s, 0, 4);
    tokens[r] = kind == 0   ? max_tokens
                : kind == 1 ? 0
                : kind == 2 ? 1
                : kind == 3 ? (tw_test_rnd_in(s, 0, max_tokens) | 1)
                            : tw_test_rnd_in(s, 0, max_tokens);
    if (tokens[r] > max_tokens) tokens[r] = max_tokens;
  }
}

/* tw_routing_generate's routing for `router` (every rank max_tokens) cut to `tokens` per rank;
 * NULL on failure. */
static inline tw_routing_t tw_test_router_routing(const tw_problem* p, tw_router router,
                                                  const int32_t* tokens, uint64_t seed) {
  tw_routing_t full = NULL, rt = NULL;
  if (tw_routing_generate(p, router, 0.0, p->max_tokens, seed, &full) != TW_SUCCESS) return NULL;
  const int32_t* ids[TW_MAX_RANKS];
  const float* ws[TW_MAX_RANKS];
  for (int32_t r = 0; r < p->world_size; r++) tw_routing_rank(full, r, NULL, &ids[r], &ws[r]);
  tw_routing_create(p, tokens, ids, ws, &rt);
  tw_routing_destroy(full);
  return rt;
}

/* The count matrix (W, experts) of a routing: how many of rank o's slots name expert g
 * (calloc'd; free it). */
static inline int32_t* tw_test_count_matrix(const tw_problem* p, tw_routing_t rt) {
  const int32_t W = p->world_size, ET = p->experts, K = p->top_k;
  int32_t* c = (int32_t*)calloc((size_t)W * ET, sizeof *c);
  for (int32_t o = 0; c != NULL && o < W; o++) {
    int32_t n = 0;
    const int32_t* ids = NULL;
    tw_routing_rank(rt, o, &n, &ids, NULL);
    for (int64_t i = 0; i < (int64_t)n * K; i++) c[(size_t)o * ET + ids[i]]++;
  }
  return c;
}

#endif /* TW_TEST_RANDOM_H */
