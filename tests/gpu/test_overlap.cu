/*
 * test_overlap.cu: correctness of the overlapped GEMM2 + combine on 2 GPUs (one process each,
 * forked here). Checks, on seeded inputs that change every iteration:
 *  - the overlapped output is bit-identical to the unfused one (same kernels, consumer after the
 *    producer) and to a comm-only rerun, and within 8e-3 relative error of a double-precision
 *    reference built from the same bf16 inputs;
 *  - with debug tags on and identity weights, every (token, k) row arrives exactly once from the
 *    right source (transport tags) and carries the right (owner, token, slot, expert, iteration)
 *    payload (decoded from the output);
 *  - no deadlock for any consumer CTA count C from 1 to 64.
 * Routers balanced / moderate / stress, 4 to 64 experts, mgb 1, 2, 4, C 1..64, token counts
 * that shrink and grow, ranks with no tokens. Exits 77 with fewer than 2 GPUs.
 */
#include "overlap_common.h"

typedef struct tw_overlap_cfg {
  int experts, hidden, ffn, top_k, max_tokens;
  tw_router router;
  int mgb;
  int iters;
} tw_overlap_cfg;

static const int kCs[] = {2, 3, 5, 8, 12, 16, 24, 32};

typedef struct tw_buffers {
  void *expert_in, *w2, *out;
  uint16_t *h_in, *h_out, *h_out2;
  size_t in_cap;
} tw_buffers;

static int tw_alloc_buffers(const tw_problem* p, tw_buffers* b) {
  memset(b, 0, sizeof *b);
  const int W = p->world_size, E = p->experts / W;
  const size_t rows_cap = (size_t)W * p->max_tokens * p->top_k + (size_t)E * W * 128 + 128;
  b->in_cap = rows_cap;
  if (cudaMalloc(&b->expert_in, rows_cap * p->ffn * 2) != cudaSuccess) return 0;
  if (cudaMalloc(&b->w2, (size_t)E * p->hidden * p->ffn * 2) != cudaSuccess) return 0;
  if (cudaMalloc(&b->out, (size_t)p->max_tokens * p->hidden * 2 + 16) != cudaSuccess) return 0;
  b->h_in = (uint16_t*)malloc(rows_cap * p->ffn * 2);
  b->h_out = (uint16_t*)malloc((size_t)p->max_tokens * p->hidden * 2 + 16);
  b->h_out2 = (uint16_t*)malloc((size_t)p->max_tokens * p->hidden * 2 + 16);
  return b->h_in && b->h_out && b->h_out2;
}

static void tw_free_buffers(tw_buffers* b) {
  cudaFree(b->expert_in);
  cudaFree(b->w2);
  cudaFree(b->out);
  free(b->h_in);
  free(b->h_out);
  free(b->h_out2);
}

/* This rank's w2 (seeded by salt) into b->w2. */
static void tw_upload_w2(const tw_problem* p, int rank, uint64_t salt, tw_buffers* b) {
  const size_t n = (size_t)(p->experts / p->world_size) * p->hidden * p->ffn;
  uint16_t* w2 = (uint16_t*)malloc(n * 2);
  tw_fill_w2(p, rank, salt, w2);
  CHECK_CUDA(cudaMemcpy(b->w2, w2, n * 2, cudaMemcpyHostToDevice));
  free(w2);
}

/* One call in `mode`, with out poisoned (NaN) first; copies out to host. */
static void tw_run_mode(tw_rank_env* env, tw_context_t ctx, tw_device_plan_t dp, tw_buffers* b,
                        int32_t tokens, int hidden, tw_combine_mode mode, int C, uint16_t* host) {
  CHECK_OK(tw__fill_bf16(b->out, (size_t)tokens * hidden + 8, 0xFFFF, env->stream));
  tw_combine_options opt = TW_COMBINE_OPTIONS_INIT;
  opt.mode = mode;
  opt.comm_ctas = C;
  CHECK_OK(tw_moe_combine_ex(ctx, dp, b->expert_in, b->w2, b->out, &opt, env->stream));
  CHECK_OK(tw_context_check(ctx));
  CHECK_CUDA(cudaMemcpyAsync(host, b->out, (size_t)tokens * hidden * 2, cudaMemcpyDeviceToHost,
                             env->stream));
  CHECK_CUDA(cudaStreamSynchronize(env->stream));
}

static thread_local double g_max_rel = 0.0; /* per rank (thread, in-process) */

static void tw_run_config(tw_rank_env* env, const tw_overlap_cfg* cfg, int cfg_index, int copy) {
  tw_problem p =
      tw_rank_problem(env, cfg->hidden, cfg->ffn, cfg->experts, cfg->top_k, cfg->max_tokens);
  CHECK_OK(tw_problem_validate(&p));
  /* Consumer unit widths 1 (default), several and whole bands (clamped to col_tiles). */
  static const int kUnitTiles[] = {1, 4, 1, 3, 1, 2, 64};
  tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
  cc.unit_tiles = kUnitTiles[cfg_index % (int)(sizeof kUnitTiles / sizeof kUnitTiles[0])];
  cc.consumer_copy = copy;
  tw_context_t ctx = NULL;
  CHECK_OK(tw_rank_context_create(env, &p, &cc, &ctx));
  if (ctx == NULL) return;
  tw_device_plan_t dp = NULL;
  CHECK_OK(tw_device_plan_create(ctx, &dp));
  tw_buffers b;
  CHECK(tw_alloc_buffers(&p, &b));
  const uint64_t salt_w = 1000 + (uint64_t)cfg_index;
  tw_upload_w2(&p, env->rank, salt_w, &b);
  double cfg_max_rel = 0.0;
  for (int it = 0; it < cfg->iters && dp != NULL; it++) {
    int32_t tokens[TW_MAX_RANKS];
    tw_token_counts(it, env->nranks, p.max_tokens, (uint64_t)cfg_index, tokens);
    const uint64_t seed = (uint64_t)cfg_index * 1000 + (uint64_t)it;
    tw_routing_t rt = NULL;
    CHECK_OK(tw_make_routing(&p, cfg->router, tokens, seed, &rt));
    if (rt == NULL) break;
    const int C = kCs[(it + cfg_index) % (int)(sizeof kCs / sizeof kCs[0])];
    tw_plan_config pc = TW_PLAN_CONFIG_INIT;
    pc.coalesce = cfg->mgb;
    tw_plan_t plan = NULL;
    CHECK_OK(tw_plan_create(&p, rt, env->rank, &pc, &plan));
    if (plan == NULL) {
      tw_routing_destroy(rt);
      break;
    }
    CHECK(plan->coalesce == cfg->mgb);
    CHECK((size_t)plan->rows <= b.in_cap);
    const uint64_t salt_h = seed * 7 + 3;
    tw_fill_expert_in(plan, salt_h, b.h_in);
    if (plan->rows > 0)
      CHECK_CUDA(
          cudaMemcpy(b.expert_in, b.h_in, (size_t)plan->rows * p.ffn * 2, cudaMemcpyHostToDevice));
    CHECK_OK(tw_device_plan_upload(dp, plan, rt, env->stream));
    const int32_t nt = tokens[env->rank];
    const size_t n_out = (size_t)nt * p.hidden;

    /* Odd iterations run unfused first, so that an overlapped call also directly follows the
     * previous plan's overlapped call: band counters must start every call clean even though
     * the last producer may publish local bands after the consumer has finished. */
    if (it % 2 == 0) {
      tw_run_mode(env, ctx, dp, &b, nt, p.hidden, TW_COMBINE_OVERLAP, C, b.h_out);
      tw_run_mode(env, ctx, dp, &b, nt, p.hidden, TW_COMBINE_UNFUSED, C, b.h_out2);
    } else {
      tw_run_mode(env, ctx, dp, &b, nt, p.hidden, TW_COMBINE_UNFUSED, C, b.h_out2);
      tw_run_mode(env, ctx, dp, &b, nt, p.hidden, TW_COMBINE_OVERLAP, C, b.h_out);
    }
    CHECKF(memcmp(b.h_out, b.h_out2, n_out * 2) == 0,
           "rank %d cfg %d iter %d: overlapped and unfused outputs differ", env->rank, cfg_index,
           it);
    if (it == 0) {
      /* Comm-only reuses the GEMM output left by the last call: same result again. */
      tw_run_mode(env, ctx, dp, &b, nt, p.hidden, TW_COMBINE_COMM_ONLY, C, b.h_out2);
      CHECKF(memcmp(b.h_out, b.h_out2, n_out * 2) == 0, "rank %d: comm-only output differs",
             env->rank);
      tw_combine_options g = TW_COMBINE_OPTIONS_INIT;
      g.mode = TW_COMBINE_GEMM_ONLY;
      CHECK_OK(tw_moe_combine_ex(ctx, dp, b.expert_in, b.w2, b.out, &g, env->stream));
      CHECK_OK(tw_context_check(ctx));
    }

    /* Reference on a sample of tokens: first, last and a few seeded ones. */
    double max_err = 0.0, max_ref = 0.0;
    int nan_seen = 0;
    double* ref = (double*)malloc(sizeof(double) * (size_t)p.hidden);
    const int samples = nt < 6 ? nt : 6;
    for (int s = 0; s < samples; s++) {
      int t = s == 0 ? 0 : s == 1 ? nt - 1 : (int)(tw_mix64(seed + (uint64_t)s) % (uint64_t)nt);
      tw_reference_token(&p, rt, env->rank, t, salt_h, salt_w, ref);
      for (int n = 0; n < p.hidden; n++) {
        float o = tw_bf2f(b.h_out[(size_t)t * p.hidden + n]);
        if (isnan(o)) nan_seen++;
        double e = fabs((double)o - ref[n]);
        if (e > max_err) max_err = e;
        if (fabs(ref[n]) > max_ref) max_ref = fabs(ref[n]);
      }
    }
    free(ref);
    /* Every output element was written (no NaN poison left anywhere). */
    for (size_t i = 0; i < n_out; i++) nan_seen += isnan(tw_bf2f(b.h_out[i])) != 0;
    CHECKF(nan_seen == 0, "rank %d cfg %d iter %d: %d output elements never written", env->rank,
           cfg_index, it, nan_seen);
    if (samples > 0) {
      const double rel = max_ref > 0 ? max_err / max_ref : max_err;
      if (rel > cfg_max_rel) cfg_max_rel = rel;
      CHECKF(rel < 8e-3, "rank %d cfg %d iter %d: relative error %.3e", env->rank, cfg_index, it,
             rel);
    }
    tw_plan_destroy(plan);
    tw_routing_destroy(rt);
  }
  if (env->rank == 0)
    printf(
        "  cfg %d: E=%d H=%d F=%d k=%d tokens<=%d router=%d mgb=%d unit_tiles=%d copy=%d: max rel "
        "err %.3e\n",
        cfg_index, cfg->experts, cfg->hidden, cfg->ffn, cfg->top_k, cfg->max_tokens,
        (int)cfg->router, cfg->mgb, cc.unit_tiles, copy, cfg_max_rel);
  if (cfg_max_rel > g_max_rel) g_max_rel = cfg_max_rel;
  tw_free_buffers(&b);
  CHECK_OK(tw_device_plan_destroy(dp));
  CHECK_OK(tw_context_destroy(ctx));
}

static void test_overlap_matches_unfused_and_reference(tw_rank_env* env) {
  static const tw_overlap_cfg cfgs[] = {
      {4, 512, 256, 2, 256, TW_ROUTER_BALANCED, 2, 16},
      {8, 1024, 512, 4, 384, TW_ROUTER_MODERATE_SKEW, 1, 12},
      {16, 768, 256, 4, 300, TW_ROUTER_STRESS_SKEW, 4, 16},
      {64, 512, 128, 6, 256, TW_ROUTER_STRESS_SKEW, 2, 12},
      {32, 256, 512, 8, 200, TW_ROUTER_BALANCED, 4, 12},
      {8, 384, 192, 2, 129, TW_ROUTER_MODERATE_SKEW, 1, 16},
      {64, 2048, 1408, 6, 512, TW_ROUTER_MODERATE_SKEW, 2, 4},
  };
  /* TW_TEST_QUICK=1 (sanitizer runs): the first configuration, two iterations. Every
   * configuration runs with both ways of copying (or the one TW_TEST_COPY names). */
  const int quick = getenv("TW_TEST_QUICK") != NULL;
  const int n = quick ? 1 : (int)(sizeof cfgs / sizeof cfgs[0]);
  for (int i = 0; i < n; i++) {
    tw_overlap_cfg c = cfgs[i];
    if (quick) c.iters = 2;
    if (tw_test_copy_wanted(TW_CONSUMER_COPY_BULK))
      tw_run_config(env, &c, i, TW_CONSUMER_COPY_BULK);
    if (tw_test_copy_wanted(TW_CONSUMER_COPY_REGISTERS))
      tw_run_config(env, &c, i, TW_CONSUMER_COPY_REGISTERS);
  }
  if (env->rank == 0)
    printf("  max relative error over all configs: %.3e (bound 8e-3)\n", g_max_rel);
}

/* Debug tags + identity weights: out decodes to exactly the expected (token, k) payloads. */
static void tw_debug_tags_exactly_once(tw_rank_env* env, int copy) {
  tw_problem p = tw_rank_problem(env, 256, 256, 16, 4, 300);
  tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
  cc.debug_tags = TW_DEBUG_TAGS_CHECK;
  cc.unit_tiles = 2; /* hits must still add up to col_tiles per row */
  cc.consumer_copy = copy;
  tw_context_t ctx = NULL;
  CHECK_OK(tw_rank_context_create(env, &p, &cc, &ctx));
  if (ctx == NULL) return;
  tw_device_plan_t dp = NULL;
  CHECK_OK(tw_device_plan_create(ctx, &dp));
  tw_buffers b;
  CHECK(tw_alloc_buffers(&p, &b));
  const int E = p.experts / p.world_size, H = p.hidden, F = p.ffn, K = p.top_k;
  {
    uint16_t* w2 = (uint16_t*)calloc((size_t)E * H * F, 2);
    for (int e = 0; e < E; e++)
      for (int n = 0; n < H; n++) w2[((size_t)e * H + n) * F + n] = tw_f2bf(1.0f);
    CHECK_CUDA(cudaMemcpy(b.w2, w2, (size_t)E * H * F * 2, cudaMemcpyHostToDevice));
    free(w2);
  }
  const tw_router routers[] = {TW_ROUTER_BALANCED, TW_ROUTER_MODERATE_SKEW, TW_ROUTER_STRESS_SKEW};
  int bad_payload = 0, bad_tags = 0;
  const int iters = getenv("TW_TEST_QUICK") != NULL ? 2 : 12;
  for (int it = 0; it < iters && dp != NULL; it++) {
    int32_t tokens[TW_MAX_RANKS];
    tw_token_counts(it, env->nranks, p.max_tokens, 77, tokens);
    tw_routing_t gen = NULL;
    CHECK_OK(tw_make_routing(&p, routers[it % 3], tokens, 500 + (uint64_t)it, &gen));
    if (gen == NULL) break;
    /* Same ids, gate weights 1: out[t] is the plain sum of its k rows. */
    const int32_t* ids[TW_MAX_RANKS];
    float* ones[TW_MAX_RANKS];
    for (int r = 0; r < env->nranks; r++) {
      int32_t n = 0;
      const float* w = NULL;
      tw_routing_rank(gen, r, &n, &ids[r], &w);
      ones[r] = (float*)malloc(sizeof(float) * ((size_t)n * K + 1));
      for (int i = 0; i < n * K; i++) ones[r][i] = 1.0f;
    }
    tw_routing_t rt = NULL;
    CHECK_OK(tw_routing_create(&p, tokens, ids, (const float* const*)ones, &rt));
    tw_plan_config pc = TW_PLAN_CONFIG_INIT;
    pc.coalesce = 1 + it % 3;
    tw_plan_t plan = NULL;
    CHECK_OK(tw_plan_create(&p, rt, env->rank, &pc, &plan));
    if (plan == NULL || rt == NULL) break;
    /* Row of (owner, token, slot): zero except 8 tag columns in block `slot`. */
    for (int32_t r = 0; r < plan->rows; r++) {
      const tw_row_src* s = &plan->row_src[r];
      uint16_t* row = b.h_in + (size_t)r * F;
      memset(row, 0, (size_t)F * 2);
      if (s->owner < 0) continue;
      int32_t n = 0;
      const int32_t* oid = NULL;
      const float* ow = NULL;
      tw_routing_rank(rt, s->owner, &n, &oid, &ow);
      const int g = oid[(size_t)s->token * K + s->slot];
      const float tags[8] = {(float)(s->owner + 1),
                             (float)(s->token % 256),
                             (float)(s->token / 256 + 1),
                             (float)(s->slot + 1),
                             (float)(g + 1),
                             (float)(it + 1),
                             (float)(env->rank + 1),
                             3.0f};
      for (int c = 0; c < 8; c++) row[s->slot * 8 + c] = tw_f2bf(tags[c]);
    }
    if (plan->rows > 0)
      CHECK_CUDA(
          cudaMemcpy(b.expert_in, b.h_in, (size_t)plan->rows * F * 2, cudaMemcpyHostToDevice));
    CHECK_OK(tw_device_plan_upload(dp, plan, rt, env->stream));
    const int32_t nt = tokens[env->rank];
    tw_run_mode(env, ctx, dp, &b, nt, H, TW_COMBINE_OVERLAP, kCs[it % 8], b.h_out);
    uint32_t* slots = (uint32_t*)malloc(sizeof(uint32_t) * ((size_t)nt * K + 1));
    CHECK_OK(tw__context_debug_slots(ctx, slots, (int64_t)nt * K));
    const int32_t* my_ids = ids[env->rank];
    for (int t = 0; t < nt; t++) {
      for (int j = 0; j < K; j++) {
        const int g = my_ids[(size_t)t * K + j], src = g / E;
        const float expect[8] = {
            (float)(env->rank + 1), (float)(t % 256), (float)(t / 256 + 1), (float)(j + 1),
            (float)(g + 1),         (float)(it + 1),  (float)(src + 1),     3.0f};
        for (int c = 0; c < 8; c++)
          if (tw_bf2f(b.h_out[(size_t)t * H + j * 8 + c]) != expect[c]) bad_payload++;
        const uint32_t want = src == env->rank
                                  ? 0xFFFF0000u
                                  : ((uint32_t)(src + 1) << 16) | (uint32_t)plan->col_tiles;
        if (slots[(size_t)t * K + j] != want) bad_tags++;
      }
      for (int n = K * 8; n < H; n++)
        if (b.h_out[(size_t)t * H + n] != 0) bad_payload++;
    }
    free(slots);
    tw_plan_destroy(plan);
    tw_routing_destroy(rt);
    tw_routing_destroy(gen);
    for (int r = 0; r < env->nranks; r++) free(ones[r]);
  }
  CHECKF(bad_payload == 0, "rank %d: %d output values decode to the wrong payload", env->rank,
         bad_payload);
  CHECKF(bad_tags == 0, "rank %d: %d (token, k) rows with a wrong source or arrival count",
         env->rank, bad_tags);
  tw_free_buffers(&b);
  CHECK_OK(tw_device_plan_destroy(dp));
  CHECK_OK(tw_context_destroy(ctx));
}

/* Every C from 1 to 64 completes (no deadlock) and gives the same bits. */
static void test_debug_tags_exactly_once(tw_rank_env* env) {
  if (tw_test_copy_wanted(TW_CONSUMER_COPY_BULK))
    tw_debug_tags_exactly_once(env, TW_CONSUMER_COPY_BULK);
  if (tw_test_copy_wanted(TW_CONSUMER_COPY_REGISTERS))
    tw_debug_tags_exactly_once(env, TW_CONSUMER_COPY_REGISTERS);
}

static void test_no_deadlock_any_c(tw_rank_env* env) {
  /* Large enough that the reduction's grid reaches its cap (it could fill every SM). */
  tw_problem p = tw_rank_problem(env, 1024, 128, 8, 2, 2048);
  tw_context_t ctx = NULL;
  CHECK_OK(tw_rank_context_create(env, &p, NULL, &ctx));
  if (ctx == NULL) return;
  tw_device_plan_t dp = NULL;
  CHECK_OK(tw_device_plan_create(ctx, &dp));
  tw_buffers b;
  CHECK(tw_alloc_buffers(&p, &b));
  tw_upload_w2(&p, env->rank, 99, &b);
  int32_t tokens[TW_MAX_RANKS];
  for (int r = 0; r < env->nranks; r++) tokens[r] = p.max_tokens;
  tw_routing_t rt = NULL;
  CHECK_OK(tw_make_routing(&p, TW_ROUTER_MODERATE_SKEW, tokens, 4242, &rt));
  tw_plan_config pc = TW_PLAN_CONFIG_INIT;
  pc.coalesce = 2;
  tw_plan_t plan = NULL;
  CHECK_OK(tw_plan_create(&p, rt, env->rank, &pc, &plan));
  if (plan != NULL && dp != NULL) {
    tw_fill_expert_in(plan, 4243, b.h_in);
    CHECK_CUDA(
        cudaMemcpy(b.expert_in, b.h_in, (size_t)plan->rows * p.ffn * 2, cudaMemcpyHostToDevice));
    CHECK_OK(tw_device_plan_upload(dp, plan, rt, env->stream));
    const size_t n_out = (size_t)p.max_tokens * p.hidden;
    tw_run_mode(env, ctx, dp, &b, p.max_tokens, p.hidden, TW_COMBINE_OVERLAP, 1, b.h_out);
    int mismatched = 0;
    /* Every C the context allows (its budget less one producer SM, at most 64). */
    tw_context_info info;
    CHECK_OK(tw_context_info_get(ctx, &info));
    const int c_max = getenv("TW_TEST_QUICK") != NULL ? 3 : info.max_comm_ctas;
    for (int C = 1; C <= c_max; C++) {
      /* Several calls in flight before one check: the credits carry the calls along. Both
       * modes: in unfused mode consumer and reduction become ready at the same moment. */
      for (int rep = 0; rep < 3; rep++) {
        tw_combine_options opt = TW_COMBINE_OPTIONS_INIT;
        opt.comm_ctas = C;
        opt.mode = rep == 1 ? TW_COMBINE_UNFUSED : TW_COMBINE_OVERLAP;
        CHECK_OK(tw_moe_combine_ex(ctx, dp, b.expert_in, b.w2, b.out, &opt, env->stream));
      }
      CHECK_OK(tw_context_check(ctx));
      CHECK_CUDA(cudaMemcpy(b.h_out2, b.out, n_out * 2, cudaMemcpyDeviceToHost));
      if (memcmp(b.h_out, b.h_out2, n_out * 2) != 0) mismatched++;
    }
    CHECKF(mismatched == 0, "rank %d: %d values of C gave different bits", env->rank, mismatched);
  }
  tw_plan_destroy(plan);
  tw_routing_destroy(rt);
  tw_free_buffers(&b);
  CHECK_OK(tw_device_plan_destroy(dp));
  CHECK_OK(tw_context_destroy(ctx));
}

static int tw_cmp_float(const void* a, const void* b) {
  const float x = *(const float*)a, y = *(const float*)b;
  return x < y ? -1 : x > y;
}

/* Phase timings exist in every mode and are sane; prints medians for one realistic shape
 * (informational: this is a correctness test, the bench tool measures performance). */
static void tw_modes_and_timings(tw_rank_env* env, int copy, int unit_tiles, uint16_t** out_copy,
                                 size_t* out_n) {
  const int quick = getenv("TW_TEST_QUICK") != NULL;
  tw_problem p =
      tw_rank_problem(env, quick ? 512 : 4096, quick ? 256 : 2048, 16, 2, quick ? 256 : 8192);
  tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
  cc.timing = 1;
  cc.unit_tiles = unit_tiles;
  cc.consumer_copy = copy;
  tw_context_t ctx = NULL;
  CHECK_OK(tw_rank_context_create(env, &p, &cc, &ctx));
  if (ctx == NULL) return;
  tw_combine_timings tm;
  CHECK_STATUS(tw_context_timings(ctx, &tm), TW_ERR_STATE); /* no call yet */
  tw_device_plan_t dp = NULL;
  CHECK_OK(tw_device_plan_create(ctx, &dp));
  tw_buffers b;
  CHECK(tw_alloc_buffers(&p, &b));
  int32_t tokens[TW_MAX_RANKS];
  for (int r = 0; r < env->nranks; r++) tokens[r] = p.max_tokens;
  tw_routing_t rt = NULL;
  CHECK_OK(tw_make_routing(&p, TW_ROUTER_BALANCED, tokens, 77, &rt));
  tw_plan_t plan = NULL;
  CHECK_OK(tw_plan_create(&p, rt, env->rank, NULL, &plan));
  if (plan != NULL && dp != NULL) {
    /* Seeded values without the per-element hash (large shape): a cheap LCG is enough here. */
    uint64_t x = 12345 + (uint64_t)env->rank;
    const size_t n_in = (size_t)plan->rows * p.ffn,
                 n_w = (size_t)(p.experts / p.world_size) * p.hidden * p.ffn;
    uint16_t* w2 = (uint16_t*)malloc(n_w * 2);
    for (size_t i = 0; i < n_in; i++) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      b.h_in[i] = tw_f2bf((float)((double)(x >> 40) / 16777216.0 - 0.5));
    }
    for (size_t i = 0; i < n_w; i++) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      w2[i] = tw_f2bf((float)((double)(x >> 40) / 16777216.0 - 0.5) * 0.05f);
    }
    CHECK_CUDA(cudaMemcpy(b.expert_in, b.h_in, n_in * 2, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(b.w2, w2, n_w * 2, cudaMemcpyHostToDevice));
    free(w2);
    CHECK_OK(tw_device_plan_upload(dp, plan, rt, env->stream));
    const tw_combine_mode modes[] = {TW_COMBINE_OVERLAP, TW_COMBINE_UNFUSED, TW_COMBINE_GEMM_ONLY,
                                     TW_COMBINE_COMM_ONLY};
    const char* names[] = {"overlap", "unfused", "gemm-only", "comm-only"};
    /* TW_TEST_REPS (1..15) shortens the run under a sanitizer; the medians need no more. */
    enum { kMaxReps = 15 };
    const char* reps_env = getenv("TW_TEST_REPS");
    int kReps = reps_env != NULL ? atoi(reps_env) : kMaxReps;
    if (kReps < 1 || kReps > kMaxReps) kReps = kMaxReps;
    float total[4][kMaxReps], gemm[4][kMaxReps], comm[4][kMaxReps], red[4][kMaxReps];
    const char* timeout_env = getenv("TW_TIMEOUT_MS");
    const float call_limit_ms = timeout_env != NULL && atof(timeout_env) > 1000.0
                                    ? 4.0f * (float)atof(timeout_env)
                                    : 1000.0f;
    for (int rep = 0; rep < kReps; rep++) {
      for (int m = 0; m < 4; m++) {
        tw_combine_options opt = TW_COMBINE_OPTIONS_INIT;
        opt.mode = modes[m];
        CHECK_OK(tw_moe_combine_ex(ctx, dp, b.expert_in, b.w2, b.out, &opt, env->stream));
        CHECK_OK(tw_context_timings(ctx, &tm));
        total[m][rep] = tm.total_ms;
        gemm[m][rep] = tm.gemm_ms;
        comm[m][rep] = tm.comm_ms;
        red[m][rep] = tm.reduce_ms;
        /* A call is bounded by its waits' timeout (long under a sanitizer), else by 1 s. */
        CHECKF(tm.total_ms > 0.0f && tm.total_ms < call_limit_ms, "mode %d total %.3f ms", m,
               tm.total_ms);
        if (modes[m] != TW_COMBINE_COMM_ONLY) CHECK(tm.gemm_ms > 0.0f && tm.gemm_ms <= tm.total_ms);
        if (modes[m] != TW_COMBINE_GEMM_ONLY) CHECK(tm.comm_ms > 0.0f && tm.reduce_ms > 0.0f);
      }
    }
    CHECK_OK(tw_context_check(ctx));
    /* The output of one more overlapped call, for the comparison across unit widths. */
    tw_combine_options opt = TW_COMBINE_OPTIONS_INIT;
    CHECK_OK(tw_moe_combine_ex(ctx, dp, b.expert_in, b.w2, b.out, &opt, env->stream));
    CHECK_OK(tw_context_check(ctx));
    *out_n = (size_t)p.max_tokens * p.hidden;
    *out_copy = (uint16_t*)malloc(*out_n * 2);
    CHECK_CUDA(cudaMemcpy(*out_copy, b.out, *out_n * 2, cudaMemcpyDeviceToHost));
    tw_plan_summary sum;
    CHECK_OK(tw_plan_summary_get(plan, &sum));
    tw_context_info info;
    CHECK_OK(tw_context_info_get(ctx, &info));
    if (env->rank == 0) {
      printf(
          "  H=%d F=%d E=%d k=%d tokens/rank=%d rows=%lld C=%d mgb=%d unit_tiles=%d %s copies: "
          "medians over %d calls\n",
          p.hidden, p.ffn, p.experts, p.top_k, p.max_tokens, (long long)sum.rows, sum.comm_ctas,
          sum.coalesce, info.unit_tiles,
          info.consumer_copy == TW_CONSUMER_COPY_BULK ? "bulk" : "register", (int)kReps);
      for (int m = 0; m < 4; m++) {
        qsort(total[m], kReps, sizeof(float), tw_cmp_float);
        qsort(gemm[m], kReps, sizeof(float), tw_cmp_float);
        qsort(comm[m], kReps, sizeof(float), tw_cmp_float);
        qsort(red[m], kReps, sizeof(float), tw_cmp_float);
        printf("    %-9s total %8.1f us  gemm %8.1f us  comm %8.1f us  reduce %8.1f us\n", names[m],
               1000.0f * total[m][kReps / 2], 1000.0f * gemm[m][kReps / 2],
               1000.0f * comm[m][kReps / 2], 1000.0f * red[m][kReps / 2]);
      }
    }
  }
  tw_plan_destroy(plan);
  tw_routing_destroy(rt);
  tw_free_buffers(&b);
  CHECK_OK(tw_device_plan_destroy(dp));
  CHECK_OK(tw_context_destroy(ctx));
}

/* Timings with register copies (one column tile per unit, whole bands) and bulk copies (the
 * default whole bands, one column tile per unit); all give the same bits. */
static void test_modes_and_timings(tw_rank_env* env) {
  static const int kRuns[][2] = {{TW_CONSUMER_COPY_REGISTERS, 1},
                                 {TW_CONSUMER_COPY_REGISTERS, 64},
                                 {TW_CONSUMER_COPY_BULK, 0},
                                 {TW_CONSUMER_COPY_BULK, 1}};
  uint16_t* first = NULL;
  size_t n_first = 0;
  for (int i = 0; i < (int)(sizeof kRuns / sizeof kRuns[0]); i++) {
    uint16_t* out = NULL;
    size_t n = 0;
    tw_modes_and_timings(env, kRuns[i][0], kRuns[i][1], &out, &n);
    CHECK(out != NULL);
    if (i == 0) {
      first = out;
      n_first = n;
      continue;
    }
    if (first != NULL && out != NULL)
      CHECKF(n == n_first && memcmp(first, out, n * 2) == 0,
             "rank %d: outputs differ between copy %d / unit width %d and the first run", env->rank,
             kRuns[i][0], kRuns[i][1]);
    free(out);
  }
  free(first);
}

/* One call under budget b: planned for b (so the model's C leaves the producer SMs), the
 * launch record checked against b, the output copied to `host`. */
static void tw_budget_call(tw_rank_env* env, tw_context_t ctx, tw_device_plan_t dp, tw_buffers* b,
                           const tw_problem* p, tw_routing_t rt, int budget, int whole_gpu,
                           uint16_t* host) {
  tw_plan_config pc = TW_PLAN_CONFIG_INIT;
  pc.sm_budget = budget;
  tw_plan_t plan = NULL;
  CHECK_OK(tw_plan_create(p, rt, env->rank, &pc, &plan));
  if (plan == NULL) return;
  tw_plan_summary sum;
  CHECK_OK(tw_plan_summary_get(plan, &sum));
  CHECK(sum.sm_budget == budget && sum.comm_ctas < budget);
  tw_fill_expert_in(plan, 777, b->h_in);
  CHECK_CUDA(
      cudaMemcpy(b->expert_in, b->h_in, (size_t)plan->rows * p->ffn * 2, cudaMemcpyHostToDevice));
  CHECK_OK(tw_device_plan_upload(dp, plan, rt, env->stream));
  const size_t n_out = (size_t)p->max_tokens * p->hidden;
  CHECK_OK(tw__fill_bf16(b->out, n_out, 0xFFFF, env->stream));
  tw_combine_options opt = TW_COMBINE_OPTIONS_INIT;
  opt.sm_budget = budget;
  CHECK_OK(tw_moe_combine_ex(ctx, dp, b->expert_in, b->w2, b->out, &opt, env->stream));
  CHECK_OK(tw_context_check(ctx));
  tw__launch_record rec;
  CHECK_OK(tw__context_last_launch(ctx, &rec));
  const int moves = plan->num_remote_tiles > 0;
  CHECKF(rec.budget == budget && rec.producer_ctas >= 1 &&
             rec.producer_ctas + rec.consumer_ctas <= budget && rec.reduce_ctas >= 1 &&
             rec.reduce_ctas <= rec.reduce_cap && (whole_gpu || rec.reduce_cap <= budget) &&
             (moves || (rec.consumer_ctas == 0 && rec.producer_ctas == budget)),
         "rank %d budget %d: producer %d + consumer %d CTAs, reduction %d (cap %d), plan C %d, "
         "%s",
         env->rank, budget, rec.producer_ctas, rec.consumer_ctas, rec.reduce_ctas, rec.reduce_cap,
         sum.comm_ctas, moves ? "sends" : "sends nothing");
  /* The producer alone runs on the same P. */
  opt.mode = TW_COMBINE_GEMM_ONLY;
  CHECK_OK(tw_moe_combine_ex(ctx, dp, b->expert_in, b->w2, b->out, &opt, env->stream));
  CHECK_OK(tw__context_last_launch(ctx, &rec));
  CHECK(rec.consumer_ctas == 0 && rec.reduce_ctas == 0 && rec.producer_ctas <= budget);
  CHECK_OK(tw_context_check(ctx));
  CHECK_CUDA(cudaMemcpy(host, b->out, n_out * 2, cudaMemcpyDeviceToHost));
  tw_plan_destroy(plan);
}

/* The SM budget: no kernel of a call exceeds it (the launch record), every budget from the whole
 * default down to 2 SMs gives the same bits, a rank with nothing to send launches no consumer,
 * and budgets that cannot run are refused with a message naming the fix. */
static void test_sm_budget(tw_rank_env* env) {
  tw_problem p = tw_rank_problem(env, 1024, 256, 8, 2, 512);
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
  tw_context_t ctx = NULL;
  cc.sm_budget = 1; /* no room for a producer beside a consumer */
  CHECK(tw_rank_context_create(env, &p, &cc, &ctx) == TW_ERR_INVALID_ARGUMENT && ctx == NULL);
  CHECK(strstr(tw_last_error(), "sm_budget") != NULL);
  if (env->team != NULL && env->nranks > 1) {
    cc.sm_budget = sms; /* every rank asks for the whole GPU: cannot all be resident */
    CHECK(tw_rank_context_create(env, &p, &cc, &ctx) == TW_ERR_UNSUPPORTED && ctx == NULL);
    CHECK(strstr(tw_last_error(), "sm_budget") != NULL);
  }
  cc.sm_budget = 0;
  CHECK_OK(tw_rank_context_create(env, &p, &cc, &ctx));
  if (ctx == NULL) return;
  tw_context_info info;
  CHECK_OK(tw_context_info_get(ctx, &info));
  CHECK(info.sm_budget == (env->team != NULL ? sms / env->nranks : sms));
  CHECK(info.in_process == (env->team != NULL));
  const int whole_gpu = env->team == NULL || env->nranks == 1; /* the GPU is this rank's alone */
  tw_device_plan_t dp = NULL;
  CHECK_OK(tw_device_plan_create(ctx, &dp));
  tw_buffers b;
  CHECK(tw_alloc_buffers(&p, &b));
  const int E = p.experts / p.world_size;
  tw_upload_w2(&p, env->rank, 778, &b);
  const size_t n_out = (size_t)p.max_tokens * p.hidden;
  uint16_t* first = (uint16_t*)malloc(n_out * 2);
  int32_t tokens[TW_MAX_RANKS];
  for (int r = 0; r < env->nranks; r++) tokens[r] = p.max_tokens;
  tw_routing_t rt = NULL;
  CHECK_OK(tw_make_routing(&p, TW_ROUTER_MODERATE_SKEW, tokens, 4711, &rt));
  const int B = info.sm_budget;
  const int budgets[] = {B, B * 3 / 4, B / 2, 8, 3, 2};
  int mismatched = 0;
  for (int i = 0; rt != NULL && dp != NULL && first != NULL && i < 6; i++) {
    if (budgets[i] < 2 || (i > 0 && budgets[i] >= budgets[i - 1])) continue;
    tw_budget_call(env, ctx, dp, &b, &p, rt, budgets[i], whole_gpu && budgets[i] == sms,
                   i == 0 ? first : b.h_out);
    if (i > 0) mismatched += memcmp(first, b.h_out, n_out * 2) != 0;
  }
  CHECKF(mismatched == 0, "rank %d: %d budgets gave other bits than the whole one", env->rank,
         mismatched);
  /* Refusals, before anything is launched (every rank refuses alike). */
  tw_combine_options opt = TW_COMBINE_OPTIONS_INIT;
  opt.sm_budget = 1;
  CHECK_STATUS(tw_moe_combine_ex(ctx, dp, b.expert_in, b.w2, b.out, &opt, env->stream),
               TW_ERR_INVALID_ARGUMENT);
  opt.sm_budget = B + 1;
  CHECK_STATUS(tw_moe_combine_ex(ctx, dp, b.expert_in, b.w2, b.out, &opt, env->stream),
               TW_ERR_INVALID_ARGUMENT);
  if (env->nranks > 1) { /* with one rank nothing moves, and C is not launched at all */
    opt.sm_budget = 2;   /* the upload above was planned for 2: C 1 fits, C 2 does not */
    opt.comm_ctas = 2;
    CHECK_STATUS(tw_moe_combine_ex(ctx, dp, b.expert_in, b.w2, b.out, &opt, env->stream),
                 TW_ERR_INVALID_ARGUMENT);
    CHECK(strstr(tw_last_error(), "sm_budget") != NULL);
  }

  /* Every token routed to its own rank's experts: nothing to send, no consumer on any rank, and
   * the output still right (against the double reference). */
  {
    int32_t* ids[TW_MAX_RANKS];
    float* ws[TW_MAX_RANKS];
    for (int r = 0; r < env->nranks; r++) {
      ids[r] = (int32_t*)malloc(sizeof(int32_t) * (size_t)p.max_tokens * p.top_k);
      ws[r] = (float*)malloc(sizeof(float) * (size_t)p.max_tokens * p.top_k);
      for (int t = 0; t < p.max_tokens; t++)
        for (int j = 0; j < p.top_k; j++) {
          ids[r][t * p.top_k + j] = r * E + (t + j) % E;
          ws[r][t * p.top_k + j] = j == 0 ? 0.75f : 0.25f;
        }
    }
    tw_routing_t local = NULL;
    CHECK_OK(
        tw_routing_create(&p, tokens, (const int32_t* const*)ids, (const float* const*)ws, &local));
    if (local != NULL) {
      tw_budget_call(env, ctx, dp, &b, &p, local, B, whole_gpu, b.h_out);
      double* ref = (double*)malloc(sizeof(double) * (size_t)p.hidden);
      double max_err = 0, max_ref = 0;
      for (int t = 0; t < p.max_tokens; t += 37) {
        tw_reference_token(&p, local, env->rank, t, 777, 778, ref);
        for (int n = 0; n < p.hidden; n++) {
          const double got = tw_bf2f(b.h_out[(size_t)t * p.hidden + n]);
          max_err = fmax(max_err, fabs(got - ref[n]));
          max_ref = fmax(max_ref, fabs(ref[n]));
        }
      }
      CHECKF(max_err <= 8e-3 * max_ref, "rank %d, all local: error %.3e of %.3e", env->rank,
             max_err, max_ref);
      free(ref);
    }
    tw_routing_destroy(local);
    for (int r = 0; r < env->nranks; r++) {
      free(ids[r]);
      free(ws[r]);
    }
  }
  free(first);
  tw_routing_destroy(rt);
  tw_free_buffers(&b);
  CHECK_OK(tw_device_plan_destroy(dp));
  CHECK_OK(tw_context_destroy(ctx));
}

/* Ranks whose problems differ are refused at creation on every rank (before, only unit width,
 * tail split and dataflow were compared, and a smaller peer window was overrun later). */
static void test_mismatched_problems_refused(tw_rank_env* env) {
  tw_problem p = tw_rank_problem(env, 512, 256, 8, 2, env->rank == 0 ? 256 : 128);
  tw_context_t ctx = NULL;
  CHECK_STATUS(tw_rank_context_create(env, &p, NULL, &ctx), TW_ERR_INVALID_ARGUMENT);
  CHECK(ctx == NULL && strstr(tw_last_error(), "max_tokens") != NULL);
  p = tw_rank_problem(env, env->rank == 0 ? 512 : 768, 256, 8, 2, 128);
  CHECK_STATUS(tw_rank_context_create(env, &p, NULL, &ctx), TW_ERR_INVALID_ARGUMENT);
  CHECK(ctx == NULL && strstr(tw_last_error(), "hidden") != NULL);
  /* The same problem again: the context is created (nothing was left behind). */
  p = tw_rank_problem(env, 512, 256, 8, 2, 128);
  CHECK_OK(tw_rank_context_create(env, &p, NULL, &ctx));
  CHECK_OK(tw_context_destroy(ctx));
}

/* Calls on alternating streams with no host synchronisation are ordered by the context: the
 * output of the last equals that of one call alone (before, a call on another stream could
 * overwrite the GEMM output and zero the counters under the previous call's consumer). */
static void test_calls_on_two_streams(tw_rank_env* env) {
  tw_problem p = tw_rank_problem(env, 2048, 512, 16, 2, 1024);
  tw_context_t ctx = NULL;
  CHECK_OK(tw_rank_context_create(env, &p, NULL, &ctx));
  if (ctx == NULL) return;
  tw_device_plan_t dp = NULL;
  CHECK_OK(tw_device_plan_create(ctx, &dp));
  tw_buffers b;
  CHECK(tw_alloc_buffers(&p, &b));
  cudaStream_t s2 = NULL;
  CHECK_CUDA(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  tw_upload_w2(&p, env->rank, 91, &b);
  int32_t tokens[TW_MAX_RANKS];
  for (int r = 0; r < env->nranks; r++) tokens[r] = p.max_tokens;
  tw_routing_t rt = NULL;
  CHECK_OK(tw_make_routing(&p, TW_ROUTER_STRESS_SKEW, tokens, 92, &rt));
  tw_plan_t plan = NULL;
  if (rt != NULL) CHECK_OK(tw_plan_create(&p, rt, env->rank, NULL, &plan));
  if (plan != NULL && dp != NULL && s2 != NULL) {
    tw_fill_expert_in(plan, 93, b.h_in);
    CHECK_CUDA(
        cudaMemcpy(b.expert_in, b.h_in, (size_t)plan->rows * p.ffn * 2, cudaMemcpyHostToDevice));
    CHECK_OK(tw_device_plan_upload(dp, plan, rt, env->stream));
    const size_t n_out = (size_t)p.max_tokens * p.hidden;
    tw_run_mode(env, ctx, dp, &b, p.max_tokens, p.hidden, TW_COMBINE_OVERLAP, 0, b.h_out);
    for (int i = 0; i < 12; i++) {
      cudaStream_t s = i % 2 ? s2 : env->stream;
      CHECK_OK(tw__fill_bf16(b.out, n_out, 0xFFFF, s)); /* each call starts from poison */
      CHECK_OK(tw_moe_combine(ctx, dp, b.expert_in, b.w2, b.out, s));
    }
    CHECK_OK(tw_context_check(ctx));
    CHECK_CUDA(cudaStreamSynchronize(s2));
    CHECK_CUDA(cudaMemcpy(b.h_out2, b.out, n_out * 2, cudaMemcpyDeviceToHost));
    CHECKF(memcmp(b.h_out, b.h_out2, n_out * 2) == 0,
           "rank %d: calls on two streams gave other bits than one call", env->rank);
  }
  if (s2 != NULL) cudaStreamDestroy(s2);
  tw_plan_destroy(plan);
  tw_routing_destroy(rt);
  tw_free_buffers(&b);
  CHECK_OK(tw_device_plan_destroy(dp));
  CHECK_OK(tw_context_destroy(ctx));
}

/* CUDA graphs: one call captured and replayed 100 times with its input changing between replays
 * (one of two input sets copied in on the graph's stream first): every replay's output is
 * bit-identical to an eager call's on the same input, and the replays keep the ranks' counters
 * in step (checked every 25 replays and by an eager call after them). The captured device plan
 * takes the same plan again and refuses one of other sizes; a capture invalidated before the
 * call leaves the context usable (before: the capture failed in the call, the context refused
 * every later call while tw_context_check passed). */
static void test_graph_replays(tw_rank_env* env) {
  tw_problem p = tw_rank_problem(env, 2048, 512, 16, 2, 1024);
  tw_context_t ctx = NULL;
  CHECK_OK(tw_rank_context_create(env, &p, NULL, &ctx));
  if (ctx == NULL) return;
  tw_device_plan_t dp = NULL;
  CHECK_OK(tw_device_plan_create(ctx, &dp));
  tw_buffers b;
  CHECK(tw_alloc_buffers(&p, &b));
  tw_upload_w2(&p, env->rank, 111, &b);
  int32_t tokens[TW_MAX_RANKS], half[TW_MAX_RANKS];
  for (int r = 0; r < env->nranks; r++) {
    tokens[r] = p.max_tokens;
    half[r] = p.max_tokens / 2;
  }
  tw_routing_t rt = NULL, rt_half = NULL;
  CHECK_OK(tw_make_routing(&p, TW_ROUTER_MODERATE_SKEW, tokens, 112, &rt));
  CHECK_OK(tw_make_routing(&p, TW_ROUTER_MODERATE_SKEW, half, 112, &rt_half));
  tw_plan_t plan = NULL, plan_half = NULL;
  if (rt != NULL) CHECK_OK(tw_plan_create(&p, rt, env->rank, NULL, &plan));
  if (rt_half != NULL) CHECK_OK(tw_plan_create(&p, rt_half, env->rank, NULL, &plan_half));
  void* inputs[2] = {NULL, NULL};
  uint16_t* expect[2] = {NULL, NULL};
  cudaGraph_t graph = NULL;
  cudaGraphExec_t exec = NULL;
  const size_t n_out = (size_t)p.max_tokens * p.hidden;
  if (plan != NULL && plan_half != NULL && dp != NULL) {
    const size_t in_bytes = (size_t)plan->rows * p.ffn * 2;
    for (int i = 0; i < 2; i++) {
      CHECK_CUDA(cudaMalloc(&inputs[i], in_bytes + 16));
      tw_fill_expert_in(plan, 113 + (uint64_t)i, b.h_in);
      CHECK_CUDA(cudaMemcpy(inputs[i], b.h_in, in_bytes, cudaMemcpyHostToDevice));
      expect[i] = (uint16_t*)malloc(n_out * 2);
    }
    CHECK_OK(tw_device_plan_upload(dp, plan, rt, env->stream));
    for (int i = 0; i < 2; i++) {
      CHECK_CUDA(
          cudaMemcpyAsync(b.expert_in, inputs[i], in_bytes, cudaMemcpyDeviceToDevice, env->stream));
      tw_run_mode(env, ctx, dp, &b, p.max_tokens, p.hidden, TW_COMBINE_OVERLAP, 0, expect[i]);
    }
    /* A capture invalidated before the call: the call says so and enqueues nothing. */
    CHECK_CUDA(cudaStreamBeginCapture(env->stream, cudaStreamCaptureModeThreadLocal));
    CHECK(cudaStreamQuery(env->stream) != cudaSuccess); /* not allowed: invalidates the capture */
    CHECK_STATUS(tw_moe_combine(ctx, dp, b.expert_in, b.w2, b.out, env->stream), TW_ERR_STATE);
    CHECK(cudaStreamEndCapture(env->stream, &graph) != cudaSuccess);
    if (graph != NULL) cudaGraphDestroy(graph);
    graph = NULL;
    (void)cudaGetLastError();
    CHECK_OK(tw_context_check(ctx));
    tw_run_mode(env, ctx, dp, &b, p.max_tokens, p.hidden, TW_COMBINE_OVERLAP, 0, b.h_out);
    CHECKF(memcmp(b.h_out, expect[1], n_out * 2) == 0,
           "rank %d: the call after a failed capture gave other bits", env->rank);

    /* TW_TEST_GRAPH_MODE=unfused captures the unfused call (the consumer a plain launch after
     * the producer, no programmatic dependent): the same bits. */
    const char* gm = getenv("TW_TEST_GRAPH_MODE");
    tw_combine_options gopt = TW_COMBINE_OPTIONS_INIT;
    gopt.mode = gm != NULL && strcmp(gm, "unfused") == 0 ? TW_COMBINE_UNFUSED : TW_COMBINE_OVERLAP;
    CHECK_CUDA(cudaStreamBeginCapture(env->stream, cudaStreamCaptureModeThreadLocal));
    CHECK_OK(tw_moe_combine_ex(ctx, dp, b.expert_in, b.w2, b.out, &gopt, env->stream));
    CHECK_CUDA(cudaStreamEndCapture(env->stream, &graph));
    size_t nodes = 0;
    if (graph != NULL) {
      CHECK_CUDA(cudaGraphGetNodes(graph, NULL, &nodes));
      CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
      /* Every rank's graph is on the device before any rank launches one: instantiating or a
       * first launch's upload can wait for the device, here for a peer's spinning kernels. */
      if (exec != NULL) CHECK_CUDA(cudaGraphUpload(exec, env->stream));
      CHECK_CUDA(cudaStreamSynchronize(env->stream));
    }
    (void)tw_rank_sum(env, 0); /* a barrier */
    /* Three eager calls so far; capturing ran nothing. The device counts every call. */
    tw__counters c0, c;
    CHECK_OK(tw__context_counters(ctx, env->stream, &c0));
    CHECKF(c0.epoch == 3, "rank %d: %u calls on the device after 3 eager ones and a capture",
           env->rank, c0.epoch);
    /* The output comes back through pinned memory. A synchronous pageable copy queued behind a
     * replay that waits on its peers stalled the team at W >= 3 until the timeouts (the peers'
     * units of the replay showed up only after it; dev/NOTES.md 35): TW_TEST_GRAPH_COPY=pageable
     * shows it again, =sync synchronises the stream before a pageable copy (passes). Diagnosis:
     * TW_TEST_GRAPH_TRACE=1 reads the counters after every replay (else only after the first
     * wrong one), TW_TEST_GRAPH_LOCKSTEP=1 launches replay i on every rank once all have finished
     * replay i - 1. */
    const int trace = getenv("TW_TEST_GRAPH_TRACE") != NULL;
    const int lockstep = getenv("TW_TEST_GRAPH_LOCKSTEP") != NULL;
    const char* copy_env = getenv("TW_TEST_GRAPH_COPY");
    const char* copy = copy_env != NULL ? copy_env : "pinned";
    CHECKF(
        strcmp(copy, "pinned") == 0 || strcmp(copy, "pageable") == 0 || strcmp(copy, "sync") == 0,
        "TW_TEST_GRAPH_COPY=%s: pinned, pageable or sync", copy);
    uint16_t* h_out = b.h_out;
    if (strcmp(copy, "pinned") == 0) CHECK_CUDA(cudaMallocHost((void**)&h_out, n_out * 2));
    enum { kReplays = 100 };
    tw__counters* seen = (tw__counters*)calloc(kReplays, sizeof(tw__counters));
    CHECK(seen != NULL);
    double at[kReplays][3]; /* loop start, launch, done: ms since the barrier */
    const double base = tw_test_now_ms();
    int wrong = 0, first_wrong = -1;
    for (int i = 0; i < kReplays && exec != NULL && seen != NULL; i++) {
      const int set = (i * 7 / 3) % 2;
      at[i][0] = tw_test_now_ms() - base;
      if (lockstep) (void)tw_rank_sum(env, 0);
      if (i == 50) CHECK_OK(tw_device_plan_upload(dp, plan, rt, env->stream)); /* same sizes */
      CHECK_CUDA(cudaMemcpyAsync(b.expert_in, inputs[set], in_bytes, cudaMemcpyDeviceToDevice,
                                 env->stream));
      CHECK_OK(tw__fill_bf16(b.out, n_out, 0xFFFF, env->stream));
      at[i][1] = tw_test_now_ms() - base;
      CHECK_CUDA(cudaGraphLaunch(exec, env->stream));
      if (strcmp(copy, "sync") == 0) CHECK_CUDA(cudaStreamSynchronize(env->stream));
      CHECK_CUDA(cudaMemcpyAsync(h_out, b.out, n_out * 2, cudaMemcpyDeviceToHost, env->stream));
      CHECK_CUDA(cudaStreamSynchronize(env->stream));
      at[i][2] = tw_test_now_ms() - base;
      const int bad = memcmp(h_out, expect[set], n_out * 2) != 0;
      wrong += bad;
      if (bad && first_wrong < 0) first_wrong = i;
      if (trace || (bad && first_wrong == i))
        CHECK_OK(tw__context_counters(ctx, env->stream, &seen[i]));
      if (i % 25 == 24) CHECK_OK(tw_context_check(ctx));
    }
    CHECKF(wrong == 0, "rank %d: %d of 100 replays differ from the eager call (the first: %d)",
           env->rank, wrong, first_wrong);
    if (first_wrong >= 0) {
      /* What the device counted after the replays before the first wrong one (with the trace)
       * and after it: which side's counts stopped. */
      for (int i = first_wrong < 2 || !trace ? first_wrong : first_wrong - 2; i <= first_wrong;
           i++) {
        const tw__counters* k = &seen[i];
        char line[2048];
        int n = snprintf(line, sizeof line,
                         "  rank %d replay %d (at %.1f, launched %.1f, done %.1f ms): epoch %u, "
                         "consumer %u units in epoch %u, error %d at %d[%d] seen %u target %u;",
                         env->rank, i, at[i][0], at[i][1], at[i][2], k->epoch, k->consumer_units,
                         k->consumer_epoch, k->err_status, k->err_where, k->err_index, k->err_seen,
                         k->err_target);
        for (int s = 0; s < env->nranks && n < (int)sizeof line - 96; s++)
          if (s != env->rank)
            n += snprintf(line + n, sizeof line - n, " [%d] arrived %u/%u announced %u credits %u;",
                          s, k->arrived[s], k->target[s], k->announced[s], k->credits[s]);
        printf("%s\n", line);
      }
    }
    if (h_out != b.h_out) cudaFreeHost(h_out);
    free(seen);
    CHECK_OK(tw__context_counters(ctx, env->stream, &c));
    /* Every rank has read its counters before any sends the next call's units (once this rank's
     * last reduction has returned its credit, a peer may). */
    (void)tw_rank_sum(env, 0);
    CHECKF(c.epoch == c0.epoch + kReplays,
           "rank %d: %u calls on the device after %d replays (graph of %zu nodes), expected %u",
           env->rank, c.epoch, kReplays, nodes, c0.epoch + kReplays);
    /* A source's announced total to an owner is that owner's arrivals from it (each side prints
     * its own: which side lost the units). */
    for (int s = 0; s < env->nranks; s++)
      CHECKF(s == env->rank || c.target[s] == c.arrived[s],
             "rank %d: from rank %d %u units arrived, %u expected; to rank %d this rank announced "
             "%u",
             env->rank, s, c.arrived[s], c.target[s], s, c.announced[s]);
    CHECK_STATUS(tw_device_plan_upload(dp, plan_half, rt_half, env->stream), TW_ERR_STATE);
    /* Eager calls after the replays, on the graph's stream, continue the sequence. */
    CHECK_CUDA(
        cudaMemcpyAsync(b.expert_in, inputs[0], in_bytes, cudaMemcpyDeviceToDevice, env->stream));
    tw_run_mode(env, ctx, dp, &b, p.max_tokens, p.hidden, TW_COMBINE_OVERLAP, 0, b.h_out);
    CHECKF(memcmp(b.h_out, expect[0], n_out * 2) == 0,
           "rank %d: the eager call after the replays gave other bits", env->rank);
  }
  if (exec != NULL) cudaGraphExecDestroy(exec);
  if (graph != NULL) cudaGraphDestroy(graph);
  for (int i = 0; i < 2; i++) {
    cudaFree(inputs[i]);
    free(expect[i]);
  }
  tw_plan_destroy(plan);
  tw_plan_destroy(plan_half);
  tw_routing_destroy(rt);
  tw_routing_destroy(rt_half);
  tw_free_buffers(&b);
  CHECK_OK(tw_device_plan_destroy(dp));
  CHECK_OK(tw_context_destroy(ctx));
}

/* The disagreement cases' common part, on a context of its own (2 s timeout): this rank plans
 * from `mine` (its peers from theirs); within `calls` calls tw_context_check must report
 * TW_ERR_INVALID_ARGUMENT on every rank; after a reset every rank's plan from `good` runs and
 * its output is checked (tw_run_mode). same_sizes: the two plans must have equal sizes (the
 * arrival counts cannot tell them apart). */
static void tw_expect_disagreement(tw_rank_env* env, const tw_problem* p, tw_routing_t mine,
                                   tw_routing_t good_rt, int calls, int same_sizes, uint64_t salt,
                                   const char* what) {
  tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
  cc.timeout_ms = 2000;
  tw_context_t ctx = NULL;
  CHECK_OK(tw_rank_context_create(env, p, &cc, &ctx));
  if (ctx == NULL) return;
  tw_device_plan_t dp = NULL;
  CHECK_OK(tw_device_plan_create(ctx, &dp));
  tw_buffers b;
  CHECK(tw_alloc_buffers(p, &b));
  tw_upload_w2(p, env->rank, salt, &b);
  tw_plan_t plan = NULL, good = NULL;
  if (mine != NULL) CHECK_OK(tw_plan_create(p, mine, env->rank, NULL, &plan));
  if (good_rt != NULL) CHECK_OK(tw_plan_create(p, good_rt, env->rank, NULL, &good));
  if (plan != NULL && good != NULL && dp != NULL) {
    if (same_sizes) CHECK(plan->rows == good->rows && plan->recv_rows == good->recv_rows);
    tw_fill_expert_in(plan, salt + 1, b.h_in);
    CHECK_CUDA(
        cudaMemcpy(b.expert_in, b.h_in, (size_t)plan->rows * p->ffn * 2, cudaMemcpyHostToDevice));
    CHECK_OK(tw_device_plan_upload(dp, plan, mine, env->stream));
    tw_status st = TW_SUCCESS;
    for (int call = 0; call < calls && st == TW_SUCCESS; call++) {
      CHECK_OK(tw_moe_combine(ctx, dp, b.expert_in, b.w2, b.out, env->stream));
      st = tw_context_check(ctx);
    }
    CHECKF(st == TW_ERR_INVALID_ARGUMENT, "rank %d: %s gave %s (%s)", env->rank, what,
           tw_status_string(st), tw_last_error());
    CHECK_OK(tw_context_reset(ctx));
    tw_fill_expert_in(good, salt + 2, b.h_in);
    CHECK_CUDA(
        cudaMemcpy(b.expert_in, b.h_in, (size_t)good->rows * p->ffn * 2, cudaMemcpyHostToDevice));
    CHECK_OK(tw_device_plan_upload(dp, good, good_rt, env->stream));
    tw_run_mode(env, ctx, dp, &b, p->max_tokens, p->hidden, TW_COMBINE_OVERLAP, 0, b.h_out);
  }
  tw_plan_destroy(plan);
  tw_plan_destroy(good);
  tw_free_buffers(&b);
  CHECK_OK(tw_device_plan_destroy(dp));
  CHECK_OK(tw_context_destroy(ctx));
}

/* Ranks that plan a call from different routings: rank 0 plans as if rank 1 held every token,
 * the others as if it held one (all else equal), so rank 0 sends rank 1 far more units than
 * rank 1's plan expects. Before, owners compared running totals with >= and passed, reading rows
 * still arriving, in this call and the later ones; now the owner reports the over-delivery
 * (TW_ERR_INVALID_ARGUMENT on every rank) by the second call at the latest (once the first
 * call's surplus has arrived), and after a reset consistent plans work again. */
static void test_plans_disagree(tw_rank_env* env) {
  if (env->nranks < 2) {
    TW_TEST_SKIP_CASE("needs two ranks or more");
    return;
  }
  tw_problem p = tw_rank_problem(env, 1024, 256, 16, 2, 512);
  int32_t full[TW_MAX_RANKS], one[TW_MAX_RANKS];
  for (int r = 0; r < env->nranks; r++) full[r] = one[r] = p.max_tokens;
  one[1] = 1;
  tw_routing_t rt_full = NULL, rt_one = NULL;
  CHECK_OK(tw_make_routing(&p, TW_ROUTER_BALANCED, full, 122, &rt_full));
  CHECK_OK(tw_make_routing(&p, TW_ROUTER_BALANCED, one, 122, &rt_one));
  tw_expect_disagreement(env, &p, env->rank == 0 ? rt_full : rt_one, rt_full, 2, 0, 121,
                         "plans that disagree");
  tw_routing_destroy(rt_full);
  tw_routing_destroy(rt_one);
}

/* Ranks whose plans differ with equal counts: rank 0 plans from a routing in which two of rank
 * 1's tokens swapped their experts, every other rank from the original. The count matrix, hence
 * every layout size and unit count, is the same, so the exact arrival counts pass; before the
 * plan fingerprint the owners then summed rows of the wrong tokens without a word. Now every
 * owner that receives from a rank of the other plan reports TW_ERR_INVALID_ARGUMENT, every rank
 * sees a failure at its check, and after a reset consistent plans work again. */
static void test_plans_disagree_same_counts(tw_rank_env* env) {
  if (env->nranks < 2) {
    TW_TEST_SKIP_CASE("needs two ranks or more");
    return;
  }
  tw_problem p = tw_rank_problem(env, 1024, 256, 16, 2, 512);
  int32_t tokens[TW_MAX_RANKS];
  for (int r = 0; r < env->nranks; r++) tokens[r] = p.max_tokens;
  tw_routing_t rt = NULL, rt_swapped = NULL;
  CHECK_OK(tw_make_routing(&p, TW_ROUTER_BALANCED, tokens, 132, &rt));
  /* The swapped routing: a copy of every rank's arrays, then rank 1's token 0 trades its experts
   * with the first token whose expert set differs. */
  int32_t* ids[TW_MAX_RANKS] = {NULL};
  float* ws[TW_MAX_RANKS] = {NULL};
  int swapped = 0;
  for (int r = 0; r < env->nranks && rt != NULL; r++) {
    int32_t n = 0;
    const int32_t* rid = NULL;
    const float* rw = NULL;
    CHECK_OK(tw_routing_rank(rt, r, &n, &rid, &rw));
    const size_t k = (size_t)p.top_k, len = (size_t)n * k;
    ids[r] = (int32_t*)malloc(len * 4 + 4);
    ws[r] = (float*)malloc(len * 4 + 4);
    if (ids[r] == NULL || ws[r] == NULL || rid == NULL) continue;
    memcpy(ids[r], rid, len * 4);
    memcpy(ws[r], rw, len * 4);
    if (r != 1) continue;
    for (int32_t t = 1; t < n && !swapped; t++) {
      int same = 1;
      for (size_t j = 0; j < k; j++) {
        int found = 0;
        for (size_t q = 0; q < k; q++) found |= ids[r][t * k + j] == ids[r][q];
        same &= found;
      }
      if (same) continue;
      for (size_t j = 0; j < k; j++) {
        const int32_t v = ids[r][j];
        ids[r][j] = ids[r][t * k + j];
        ids[r][t * k + j] = v;
      }
      swapped = 1;
    }
  }
  CHECK(swapped);
  if (swapped)
    CHECK_OK(tw_routing_create(&p, tokens, (const int32_t* const*)ids, (const float* const*)ws,
                               &rt_swapped));
  for (int r = 0; r < env->nranks; r++) {
    free(ids[r]);
    free(ws[r]);
  }
  tw_expect_disagreement(env, &p, env->rank == 0 ? rt_swapped : rt, rt, 1, 1, 131,
                         "plans with equal counts that disagree");
  tw_routing_destroy(rt);
  tw_routing_destroy(rt_swapped);
}

static const tw_rank_case kCases[] = {
    {"overlap_matches_unfused_and_reference", test_overlap_matches_unfused_and_reference},
    {"debug_tags_exactly_once", test_debug_tags_exactly_once},
    {"no_deadlock_any_c", test_no_deadlock_any_c},
    {"modes_and_timings", test_modes_and_timings},
    {"sm_budget", test_sm_budget},
    {"mismatched_problems_refused", test_mismatched_problems_refused},
    {"calls_on_two_streams", test_calls_on_two_streams},
    {"graph_replays", test_graph_replays},
    {"plans_disagree", test_plans_disagree},
    {"plans_disagree_same_counts", test_plans_disagree_same_counts},
};

int main(int argc, char** argv) {
  return tw_rank_test_main(argc, argv, kCases, (int)(sizeof kCases / sizeof kCases[0]), 600);
}
