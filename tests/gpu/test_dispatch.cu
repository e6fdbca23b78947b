/*
 * test_dispatch.cu: the eager dispatch (tw_moe_dispatch) on 2 GPUs (one process each, forked
 * here) or on W in-process ranks on one GPU (--in-process W). On seeded routings that change
 * every iteration (balanced, moderate and stress skew; 0, 1, odd and full token counts; int32
 * and int64 ids) every rank checks:
 *  - the plan the dispatch built on the host from the all-gathered device counts equals
 *    tw_plan_create's from the routing: summaries, and the uploaded tiles, bands, segments,
 *    consumer units, slot_row and gate weights read back from the device plan;
 *  - the expert-input buffer after the dispatch equals the one the host builds from the plan's
 *    row sources (every row x[owner][token], padding zero), bit for bit, with the buffer
 *    poisoned before the call;
 *  - tw_moe_combine on the dispatched buffer and the dispatch's device plan (hidden == ffn, so
 *    the dispatched rows are the GEMM2 input) gives the same bits as tw_moe_combine on the host
 *    plan and the host-built buffer, and is within 8e-3 relative error of a double-precision
 *    reference;
 *  - an id out of range (int32 and int64, negative too), a repeated id within a token and a token
 *    count above max_tokens on one rank fail the call on every rank with TW_ERR_EXPERT_ID /
 *    TW_ERR_DUPLICATE_EXPERT / TW_ERR_CAPACITY naming that rank, never hang, and leave the
 *    context usable: the next dispatch is right;
 *  - a context without dispatch refuses the call, and dispatch with the add dataflow is refused
 *    at creation;
 *  - after a combine that timed out, the next dispatch is refused on every rank alike and, after
 *    tw_context_reset, dispatch and combine are right again (W >= 2).
 * Exits 77 without the GPUs it needs.
 */
#include "context.h"
#include "overlap_common.h"

typedef struct tw_dispatch_cfg {
  int experts, hidden, top_k, max_tokens;
  tw_router router;
  int iters;
} tw_dispatch_cfg;

typedef struct tw_dbuf {
  void *x, *ids, *w, *w2, *out, *out2, *host_in;
  uint16_t *h_x, *h_in, *h_got, *h_out, *h_out2;
  int64_t* h_ids64;
  int32_t* h_i32;
  float* h_f32;
  size_t rows_cap;
} tw_dbuf;

static int tw_dbuf_alloc(const tw_problem* p, int64_t rows_max, tw_dbuf* b) {
  memset(b, 0, sizeof *b);
  const int E = p->experts / p->world_size, H = p->hidden, K = p->top_k;
  const size_t T = (size_t)p->max_tokens;
  b->rows_cap = (size_t)rows_max;
  int ok = cudaMalloc(&b->x, T * H * 2 + 16) == cudaSuccess &&
           cudaMalloc(&b->ids, T * K * 8 + 8) == cudaSuccess &&
           cudaMalloc(&b->w, T * K * 4 + 4) == cudaSuccess &&
           cudaMalloc(&b->w2, (size_t)E * H * H * 2) == cudaSuccess &&
           cudaMalloc(&b->out, T * H * 2 + 16) == cudaSuccess &&
           cudaMalloc(&b->out2, T * H * 2 + 16) == cudaSuccess &&
           cudaMalloc(&b->host_in, b->rows_cap * H * 2 + 16) == cudaSuccess;
  b->h_x = (uint16_t*)malloc(T * H * 2 + 16);
  b->h_in = (uint16_t*)malloc(b->rows_cap * H * 2 + 16);
  b->h_got = (uint16_t*)malloc(b->rows_cap * H * 2 + 16);
  b->h_out = (uint16_t*)malloc(T * H * 2 + 16);
  b->h_out2 = (uint16_t*)malloc(T * H * 2 + 16);
  b->h_ids64 = (int64_t*)malloc(T * K * 8 + 8);
  b->h_i32 = (int32_t*)malloc(T * K * 4 + 4 + b->rows_cap * 4);
  b->h_f32 = (float*)malloc(T * K * 4 + 4);
  return ok && b->h_x && b->h_in && b->h_got && b->h_out && b->h_out2 && b->h_ids64 && b->h_i32 &&
         b->h_f32;
}

static void tw_dbuf_free(tw_dbuf* b) {
  cudaFree(b->x);
  cudaFree(b->ids);
  cudaFree(b->w);
  cudaFree(b->w2);
  cudaFree(b->out);
  cudaFree(b->out2);
  cudaFree(b->host_in);
  free(b->h_x);
  free(b->h_in);
  free(b->h_got);
  free(b->h_out);
  free(b->h_out2);
  free(b->h_ids64);
  free(b->h_i32);
  free(b->h_f32);
}

/* The GEMM input the host builds from a plan's row sources: x[owner][token] per row, zero
 * padding. */
static void tw_expected_in(const struct tw_plan* plan, uint64_t salt, uint16_t* host) {
  const int H = plan->problem.hidden;
  for (int32_t r = 0; r < plan->rows; r++) {
    const tw_row_src* s = &plan->row_src[r];
    for (int h = 0; h < H; h++)
      host[(size_t)r * H + h] = s->owner < 0 ? 0 : tw_f2bf(tw_x_value(salt, s->owner, s->token, h));
  }
}

/* Reference out[t] in double: sum_j w_j bf16(x[t] . w2[g_j][n]). */
static void tw_dispatch_reference(const tw_problem* p, tw_routing_t rt, int rank, int t,
                                  uint64_t salt_x, uint64_t salt_w, double* out) {
  int32_t n_tok = 0;
  const int32_t* ids = NULL;
  const float* ws = NULL;
  tw_routing_rank(rt, rank, &n_tok, &ids, &ws);
  const int H = p->hidden, K = p->top_k;
  double* xr = (double*)malloc(sizeof(double) * (size_t)H);
  for (int f = 0; f < H; f++) xr[f] = tw_x_value(salt_x, rank, t, f);
  for (int n = 0; n < H; n++) out[n] = 0.0;
  for (int j = 0; j < K; j++) {
    const int g = ids[(size_t)t * K + j];
    for (int n = 0; n < H; n++) {
      double acc = 0.0;
      for (int f = 0; f < H; f++) acc += xr[f] * (double)tw_w2_value(salt_w, g, n, f);
      out[n] += (double)ws[(size_t)t * K + j] * (double)tw_bf2f(tw_f2bf((float)acc));
    }
  }
  free(xr);
}

/* Device array (n elements of `elem` bytes) equals host array. */
static int tw_same_on_device(const void* dev, const void* host, size_t n, size_t elem, void* tmp) {
  if (n == 0) return 1;
  if (cudaMemcpy(tmp, dev, n * elem, cudaMemcpyDeviceToHost) != cudaSuccess) return 0;
  return memcmp(tmp, host, n * elem) == 0;
}

/* The device plan the dispatch uploaded against the host plan of the same routing. */
static void tw_compare_device_plan(tw_rank_env* env, tw_device_plan_t dp,
                                   const struct tw_plan* plan, tw_routing_t rt, const char* what) {
  tw_plan_summary a, b;
  CHECK_OK(tw_plan_summary_get((tw_plan_t)plan, &a));
  CHECK_OK(tw_device_plan_summary_get(dp, &b));
  a.solve_us = b.solve_us = 0; /* measured */
  CHECKF(memcmp(&a, &b, sizeof a) == 0,
         "rank %d %s: summaries differ (rows %lld / %lld, C %d / %d, T %.17g / %.17g)", env->rank,
         what, (long long)a.rows, (long long)b.rows, a.comm_ctas, b.comm_ctas, a.predicted_us,
         b.predicted_us);
  /* The experts' row ranges an engine's own expert computation reads. */
  const int32_t E = plan->local_experts;
  int32_t* er = (int32_t*)malloc(sizeof(int32_t) * 3 * (size_t)E + 4);
  CHECK_OK(tw_device_plan_expert_rows(dp, er, er + E, er + 2 * E));
  CHECKF(memcmp(er, plan->expert_row0, (size_t)E * 4) == 0 &&
             memcmp(er + E, plan->expert_rows, (size_t)E * 4) == 0 &&
             memcmp(er + 2 * E, plan->expert_real_rows, (size_t)E * 4) == 0,
         "rank %d %s: tw_device_plan_expert_rows differs from the host plan's layout", env->rank,
         what);
  free(er);
  int32_t n = 0;
  const int32_t* ids = NULL;
  const float* ws = NULL;
  CHECK_OK(tw_routing_rank(rt, env->rank, &n, &ids, &ws));
  const size_t slots = (size_t)n * plan->problem.top_k;
  const size_t big = (size_t)plan->num_tiles * sizeof(tw_tile) + slots * 4 +
                     (size_t)plan->num_bands * sizeof(tw_band) + 64;
  void* tmp = malloc(big);
  CHECKF(dp->rows == plan->rows && dp->recv_rows == plan->recv_rows &&
             dp->num_tiles == plan->num_tiles && dp->num_bands == plan->num_bands &&
             dp->tokens == n && dp->comm_ctas == plan->comm_ctas,
         "rank %d %s: device plan sizes differ", env->rank, what);
  CHECKF(tw_same_on_device(dp->tiles, plan->tiles, (size_t)plan->num_tiles, sizeof(tw_tile), tmp),
         "rank %d %s: tiles differ", env->rank, what);
  CHECKF(tw_same_on_device(dp->bands, plan->bands, (size_t)plan->num_bands, sizeof(tw_band), tmp),
         "rank %d %s: bands differ", env->rank, what);
  CHECKF(tw_same_on_device(dp->segments, plan->segments, (size_t)plan->num_segments,
                           sizeof(tw_segment), tmp),
         "rank %d %s: segments differ", env->rank, what);
  /* Units: the host cuts the same plan the same way (the staging array holds the last cut). */
  int64_t units = 0;
  int32_t* u0 = (int32_t*)malloc(((size_t)plan->num_bands * 2 + 2) * 4);
  units = tw__consumer_units(plan, dp->ctx->tail_bands, dp->ctx->tail_parts, dp->ctx->unit_chunks,
                             u0, u0 + plan->num_bands + 1);
  CHECKF(units == dp->total_units &&
             tw_same_on_device(dp->seg_unit0, u0, (size_t)plan->num_segments + 1, 4, tmp),
         "rank %d %s: consumer units differ (%lld / %d)", env->rank, what, (long long)units,
         dp->total_units);
  free(u0);
  CHECKF(tw_same_on_device(dp->slot_row, plan->slot_row, slots, 4, tmp),
         "rank %d %s: slot_row from the device scan differs from the host plan's", env->rank, what);
  CHECKF(tw_same_on_device(dp->weights, ws, slots, 4, tmp), "rank %d %s: weights differ", env->rank,
         what);
  free(tmp);
}

static thread_local double g_max_rel = 0.0;

static void tw_run_dispatch_cfg(tw_rank_env* env, const tw_dispatch_cfg* cfg, int cfg_index) {
  tw_problem p =
      tw_rank_problem(env, cfg->hidden, cfg->hidden, cfg->experts, cfg->top_k, cfg->max_tokens);
  CHECK_OK(tw_problem_validate(&p));
  tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
  cc.dispatch = 1;
  cc.dataflow = TW_DATAFLOW_REDUCE;
  tw_context_t ctx = NULL;
  CHECK_OK(tw_rank_context_create(env, &p, &cc, &ctx));
  if (ctx == NULL) return;
  tw_context_info info;
  CHECK_OK(tw_context_info_get(ctx, &info));
  void* dbuf = NULL;
  int64_t rows_max = 0;
  CHECK_OK(tw_context_dispatch_buffer(ctx, &dbuf, &rows_max));
  CHECK(dbuf != NULL && rows_max > 0);
  tw_device_plan_t dp = NULL, dp2 = NULL;
  CHECK_OK(tw_device_plan_create(ctx, &dp));
  CHECK_OK(tw_device_plan_create(ctx, &dp2));
  tw_dbuf b;
  CHECK(tw_dbuf_alloc(&p, rows_max, &b));
  const int H = p.hidden, E = p.experts / p.world_size;
  const uint64_t salt_w = 300 + (uint64_t)cfg_index;
  {
    const size_t n = (size_t)E * H * H;
    uint16_t* w2 = (uint16_t*)malloc(n * 2);
    tw_fill_w2(&p, env->rank, salt_w, w2);
    CHECK_CUDA(cudaMemcpy(b.w2, w2, n * 2, cudaMemcpyHostToDevice));
    free(w2);
  }
  double cfg_max_rel = 0.0;
  for (int it = 0; it < cfg->iters && dp != NULL && dp2 != NULL; it++) {
    int32_t tokens[TW_MAX_RANKS];
    tw_token_counts(it, env->nranks, p.max_tokens, 40 + (uint64_t)cfg_index, tokens);
    if (it == 4)
      for (int r = 0; r < env->nranks; r++)
        tokens[r] = (tokens[r] | 1) <= p.max_tokens ? tokens[r] | 1 : p.max_tokens;
    const uint64_t seed = 7000 + (uint64_t)cfg_index * 100 + (uint64_t)it;
    const tw_router router = it % 3 == 2 ? TW_ROUTER_STRESS_SKEW : cfg->router;
    tw_routing_t rt = NULL;
    CHECK_OK(tw_make_routing(&p, router, tokens, seed, &rt));
    if (rt == NULL) break;
    const int id64 = it % 2;
    const uint64_t salt_x = seed * 13 + 5;
    tw_upload_routed_inputs(env, &p, rt, salt_x, id64, b.h_x, b.h_ids64, b.x, b.ids, b.w);
    const int32_t nt = tokens[env->rank];
    /* The plan the dispatch must equal: the context's budget (the dispatch's default), or a
     * given config (every third iteration: a fixed partition). */
    tw_plan_config pc = TW_PLAN_CONFIG_INIT;
    pc.dataflow = TW_DATAFLOW_REDUCE;
    pc.sm_budget = info.sm_budget;
    const int given = it % 3 == 1;
    if (given) {
      pc.comm_ctas = 1 + it % 7;
      pc.coalesce = 1 + it % 3;
    }
    tw_plan_t plan = NULL;
    CHECK_OK(tw_plan_create(&p, rt, env->rank, &pc, &plan));
    if (plan == NULL) {
      tw_routing_destroy(rt);
      break;
    }
    CHECK((int64_t)plan->rows <= rows_max);
    /* Poison the buffer (this rank's: peers write into it only after this rank's credit,
     * which its call below raises after the poison in stream order). */
    CHECK_OK(tw__fill_bf16(dbuf, (size_t)rows_max * H, 0xFFFF, env->stream));
    tw_dispatch_options opt = TW_DISPATCH_OPTIONS_INIT;
    opt.plan_config = &pc;
    void* expert_in = NULL;
    const tw_status st = tw_moe_dispatch_ex(
        ctx, dp, nt > 0 ? b.x : NULL, nt > 0 ? b.ids : NULL, id64 ? TW_INDEX_INT64 : TW_INDEX_INT32,
        nt > 0 ? (const float*)b.w : NULL, nt, &expert_in, given ? &opt : NULL, env->stream);
    CHECKF(st == TW_SUCCESS, "rank %d cfg %d iter %d: tw_moe_dispatch: %s (%s)", env->rank,
           cfg_index, it, tw_status_string(st), tw_last_error());
    CHECK(expert_in == dbuf);
    CHECK_OK(tw_context_check(ctx));
    char what[64];
    snprintf(what, sizeof what, "cfg %d iter %d", cfg_index, it);
    if (st == TW_SUCCESS) tw_compare_device_plan(env, dp, plan, rt, what);
    /* (ii) the buffer, bit for bit. */
    tw_expected_in(plan, salt_x, b.h_in);
    const size_t in_elems = (size_t)plan->rows * H;
    if (in_elems > 0) {
      CHECK_CUDA(cudaMemcpy(b.h_got, dbuf, in_elems * 2, cudaMemcpyDeviceToHost));
      int32_t bad_rows = 0, first_bad = -1;
      for (int32_t r = 0; r < plan->rows; r++)
        if (memcmp(b.h_got + (size_t)r * H, b.h_in + (size_t)r * H, (size_t)H * 2) != 0) {
          if (first_bad < 0) first_bad = r;
          bad_rows++;
        }
      CHECKF(bad_rows == 0,
             "rank %d %s: %d of %d expert-input rows differ from the host-built ones (first %d, "
             "owner %d)",
             env->rank, what, bad_rows, plan->rows, first_bad,
             first_bad >= 0 ? plan->row_src[first_bad].owner : 0);
      CHECK_CUDA(cudaMemcpy(b.host_in, b.h_in, in_elems * 2, cudaMemcpyHostToDevice));
    }
    /* (iii) combine on the dispatch's plan and buffer, and on the host plan and buffer. */
    CHECK_OK(tw_device_plan_upload(dp2, plan, rt, env->stream));
    const size_t n_out = (size_t)nt * H;
    CHECK_OK(tw__fill_bf16(b.out, n_out + 8, 0xFFFF, env->stream));
    CHECK_OK(tw_moe_combine(ctx, dp, expert_in, b.w2, b.out, env->stream));
    CHECK_OK(tw_context_check(ctx));
    CHECK_OK(tw__fill_bf16(b.out2, n_out + 8, 0xFFFF, env->stream));
    CHECK_OK(tw_moe_combine(ctx, dp2, b.host_in, b.w2, b.out2, env->stream));
    CHECK_OK(tw_context_check(ctx));
    CHECK_CUDA(cudaStreamSynchronize(env->stream));
    if (n_out > 0) {
      CHECK_CUDA(cudaMemcpy(b.h_out, b.out, n_out * 2, cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(b.h_out2, b.out2, n_out * 2, cudaMemcpyDeviceToHost));
      CHECKF(memcmp(b.h_out, b.h_out2, n_out * 2) == 0,
             "rank %d %s: dispatch + combine differs from host-planned combine", env->rank, what);
      int nan_seen = 0;
      for (size_t i = 0; i < n_out; i++) nan_seen += isnan(tw_bf2f(b.h_out[i])) != 0;
      CHECKF(nan_seen == 0, "rank %d %s: %d output elements never written", env->rank, what,
             nan_seen);
      double max_err = 0.0, max_ref = 0.0;
      double* ref = (double*)malloc(sizeof(double) * (size_t)H);
      const int samples = nt < 5 ? nt : 5;
      for (int s = 0; s < samples; s++) {
        const int t = s == 0   ? 0
                      : s == 1 ? nt - 1
                               : (int)(tw_mix64(seed + (uint64_t)s) % (uint64_t)nt);
        tw_dispatch_reference(&p, rt, env->rank, t, salt_x, salt_w, ref);
        for (int n = 0; n < H; n++) {
          max_err = fmax(max_err, fabs((double)tw_bf2f(b.h_out[(size_t)t * H + n]) - ref[n]));
          max_ref = fmax(max_ref, fabs(ref[n]));
        }
      }
      free(ref);
      const double rel = max_ref > 0 ? max_err / max_ref : max_err;
      if (rel > cfg_max_rel) cfg_max_rel = rel;
      CHECKF(rel < 8e-3, "rank %d %s: relative error %.3e", env->rank, what, rel);
    }
    tw_plan_destroy(plan);
    tw_routing_destroy(rt);
  }
  if (env->rank == 0)
    printf("  cfg %d: E=%d H=F=%d k=%d tokens<=%d router=%d: max rel err %.3e\n", cfg_index,
           p.experts, H, p.top_k, p.max_tokens, (int)cfg->router, cfg_max_rel);
  if (cfg_max_rel > g_max_rel) g_max_rel = cfg_max_rel;
  tw_dbuf_free(&b);
  CHECK_OK(tw_device_plan_destroy(dp));
  CHECK_OK(tw_device_plan_destroy(dp2));
  CHECK_OK(tw_context_destroy(ctx));
}

static void test_dispatch_matches_host(tw_rank_env* env) {
  static const tw_dispatch_cfg cfgs[] = {
      {8, 256, 2, 128, TW_ROUTER_BALANCED, 8},      {16, 512, 4, 200, TW_ROUTER_MODERATE_SKEW, 8},
      {6, 384, 3, 129, TW_ROUTER_BALANCED, 6},      {64, 256, 6, 96, TW_ROUTER_STRESS_SKEW, 6},
      {4, 128, 1, 300, TW_ROUTER_MODERATE_SKEW, 6},
  };
  const int quick = getenv("TW_TEST_QUICK") != NULL;
  const int n = quick ? 1 : (int)(sizeof cfgs / sizeof cfgs[0]);
  for (int i = 0; i < n; i++) {
    tw_dispatch_cfg c = cfgs[i];
    if (quick) c.iters = 2;
    tw_run_dispatch_cfg(env, &c, i);
  }
  if (env->rank == 0)
    printf("  max relative error over all configs: %.3e (bound 8e-3)\n", g_max_rel);
}

/* One dispatch with this rank's ids replaced by `h_ids` (n tokens): the status every rank must
 * see. */
static void tw_expect_refusal(tw_rank_env* env, tw_context_t ctx, tw_device_plan_t dp, tw_dbuf* b,
                              int32_t n, int id64, tw_status want, int culprit, const char* what) {
  void* out = (void*)1;
  const tw_status st =
      tw_moe_dispatch(ctx, dp, b->x, b->ids, id64 ? TW_INDEX_INT64 : TW_INDEX_INT32,
                      (const float*)b->w, n, &out, env->stream);
  char needle[32];
  snprintf(needle, sizeof needle, "rank %d", culprit);
  CHECKF(st == want && strstr(tw_last_error(), needle) != NULL && out == NULL,
         "rank %d, %s: got %s (%s), expected %s naming rank %d", env->rank, what,
         tw_status_string(st), tw_last_error(), tw_status_string(want), culprit);
}

static void test_bad_ids_refused(tw_rank_env* env) {
  tw_problem p = tw_rank_problem(env, 256, 256, 8, 2, 64);
  tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
  cc.dispatch = 1;
  cc.dataflow = TW_DATAFLOW_REDUCE;
  tw_context_t ctx = NULL;
  CHECK_OK(tw_rank_context_create(env, &p, &cc, &ctx));
  if (ctx == NULL) return;
  void* dbuf = NULL;
  int64_t rows_max = 0;
  CHECK_OK(tw_context_dispatch_buffer(ctx, &dbuf, &rows_max));
  tw_device_plan_t dp = NULL;
  CHECK_OK(tw_device_plan_create(ctx, &dp));
  tw_dbuf b;
  CHECK(tw_dbuf_alloc(&p, rows_max, &b));
  const int K = p.top_k, ET = p.experts, T = p.max_tokens, H = p.hidden;
  const int culprit = env->nranks - 1;
  int32_t tokens[TW_MAX_RANKS];
  for (int r = 0; r < env->nranks; r++) tokens[r] = T;
  tw_routing_t rt = NULL;
  CHECK_OK(tw_make_routing(&p, TW_ROUTER_BALANCED, tokens, 99, &rt));
  for (int round = 0; rt != NULL && dp != NULL && round < 6; round++) {
    const int id64 = round % 2;
    tw_upload_routed_inputs(env, &p, rt, 11, id64, b.h_x, b.h_ids64, b.x, b.ids, b.w);
    tw_status want = TW_ERR_EXPERT_ID;
    const char* what = "an id out of range";
    int32_t n = T;
    if (env->rank == culprit) {
      /* Rounds: id = experts; id = -1 (int64: a large negative); a repeated id; too many
       * tokens; a NaN gate weight; round 5: a valid call. */
      const size_t at = (size_t)(T / 2) * K + (K - 1);
      if (round <= 1) {
        const int64_t bad = round == 0 ? ET : (int64_t)-5000000000LL;
        if (id64)
          CHECK_CUDA(cudaMemcpy((int64_t*)b.ids + at, &bad, 8, cudaMemcpyHostToDevice));
        else {
          const int32_t bad32 = round == 0 ? ET : -1;
          CHECK_CUDA(cudaMemcpy((int32_t*)b.ids + at, &bad32, 4, cudaMemcpyHostToDevice));
        }
      } else if (round == 2) { /* slot K-1 repeats slot 0 of the same token */
        if (id64)
          CHECK_CUDA(cudaMemcpy((int64_t*)b.ids + at, (int64_t*)b.ids + at - (K - 1), 8,
                                cudaMemcpyDeviceToDevice));
        else
          CHECK_CUDA(cudaMemcpy((int32_t*)b.ids + at, (int32_t*)b.ids + at - (K - 1), 4,
                                cudaMemcpyDeviceToDevice));
      } else if (round == 3) {
        n = T + 1;
      } else if (round == 4) {
        const float nan = nanf("");
        CHECK_CUDA(cudaMemcpy((float*)b.w + at, &nan, 4, cudaMemcpyHostToDevice));
      }
    }
    if (round == 2) {
      want = TW_ERR_DUPLICATE_EXPERT;
      what = "a repeated id";
    } else if (round == 3) {
      want = TW_ERR_CAPACITY;
      what = "too many tokens";
    } else if (round == 4) {
      want = TW_ERR_INVALID_ARGUMENT;
      what = "a NaN gate weight";
    }
    if (round < 5) {
      tw_expect_refusal(env, ctx, dp, &b, n, id64, want, culprit, what);
      continue;
    }
    /* The context is still usable: a valid dispatch, its buffer right. */
    tw_plan_config pc = TW_PLAN_CONFIG_INIT;
    pc.dataflow = TW_DATAFLOW_REDUCE;
    tw_context_info info;
    CHECK_OK(tw_context_info_get(ctx, &info));
    pc.sm_budget = info.sm_budget;
    tw_plan_t plan = NULL;
    CHECK_OK(tw_plan_create(&p, rt, env->rank, &pc, &plan));
    void* expert_in = NULL;
    CHECK_OK(tw_moe_dispatch(ctx, dp, b.x, b.ids, id64 ? TW_INDEX_INT64 : TW_INDEX_INT32,
                             (const float*)b.w, T, &expert_in, env->stream));
    CHECK_OK(tw_context_check(ctx));
    if (plan != NULL && expert_in != NULL) {
      tw_compare_device_plan(env, dp, plan, rt, "after refusals");
      tw_expected_in(plan, 11, b.h_in);
      CHECK_CUDA(
          cudaMemcpy(b.h_got, expert_in, (size_t)plan->rows * H * 2, cudaMemcpyDeviceToHost));
      CHECKF(memcmp(b.h_got, b.h_in, (size_t)plan->rows * H * 2) == 0,
             "rank %d: the dispatch after the refusals wrote other rows", env->rank);
    }
    tw_plan_destroy(plan);
  }
  tw_routing_destroy(rt);
  tw_dbuf_free(&b);
  CHECK_OK(tw_device_plan_destroy(dp));
  CHECK_OK(tw_context_destroy(ctx));
}

static void test_dispatch_needs_its_context(tw_rank_env* env) {
  tw_problem p = tw_rank_problem(env, 256, 256, 8, 2, 64);
  tw_context_t ctx = NULL;
  /* Dispatch off: the call is refused before anything collective. */
  CHECK_OK(tw_rank_context_create(env, &p, NULL, &ctx));
  if (ctx != NULL) {
    tw_device_plan_t dp = NULL;
    CHECK_OK(tw_device_plan_create(ctx, &dp));
    void* out = NULL;
    CHECK_STATUS(tw_moe_dispatch(ctx, dp, NULL, NULL, TW_INDEX_INT32, NULL, 0, &out, env->stream),
                 TW_ERR_STATE);
    CHECK(strstr(tw_last_error(), "dispatch = 1") != NULL);
    CHECK_STATUS(tw_context_dispatch_buffer(ctx, &out, NULL), TW_ERR_STATE);
    CHECK_OK(tw_device_plan_destroy(dp));
    CHECK_OK(tw_context_destroy(ctx));
  }
  /* With the add dataflow: refused at creation, on every rank alike. */
  tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
  cc.dispatch = 1;
  cc.dataflow = TW_DATAFLOW_ADD;
  ctx = NULL;
  CHECK_STATUS(tw_rank_context_create(env, &p, &cc, &ctx), TW_ERR_UNSUPPORTED);
  CHECK(ctx == NULL);
  cc.dispatch = 2;
  cc.dataflow = TW_DATAFLOW_REDUCE;
  CHECK_STATUS(tw_rank_context_create(env, &p, &cc, &ctx), TW_ERR_INVALID_ARGUMENT);
  /* A bad id type is refused before anything collective, on every rank alike. */
  cc.dispatch = 1;
  CHECK_OK(tw_rank_context_create(env, &p, &cc, &ctx));
  if (ctx != NULL) {
    tw_device_plan_t dp = NULL;
    CHECK_OK(tw_device_plan_create(ctx, &dp));
    void* out = NULL;
    CHECK_STATUS(tw_moe_dispatch(ctx, dp, NULL, NULL, (tw_index_type)3, NULL, 0, &out, env->stream),
                 TW_ERR_INVALID_ARGUMENT);
    /* No tokens anywhere: a valid call that sends nothing. */
    CHECK_OK(tw_moe_dispatch(ctx, dp, NULL, NULL, TW_INDEX_INT32, NULL, 0, &out, env->stream));
    CHECK_OK(tw_context_check(ctx));
    tw_plan_summary s;
    CHECK_OK(tw_device_plan_summary_get(dp, &s));
    CHECK(s.rows == 0 && s.send_bytes == 0);
    CHECK_OK(tw_device_plan_destroy(dp));
    CHECK_OK(tw_context_destroy(ctx));
  }
}

/* A combine that times out (a consumer fault on rank 0) fails the context on every rank: the
 * next dispatch is refused alike on every rank (no rank left waiting in its collective), and
 * after tw_context_reset the dispatch and the combine are right again. */
static void test_reset_after_failure(tw_rank_env* env) {
  if (env->nranks < 2) return; /* one rank sends nothing: no consumer to fault */
  tw_problem p = tw_rank_problem(env, 256, 256, 8, 2, 128);
  tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
  cc.dispatch = 1;
  cc.dataflow = TW_DATAFLOW_REDUCE;
  cc.timeout_ms = 400;
  tw_context_t ctx = NULL;
  CHECK_OK(tw_rank_context_create(env, &p, &cc, &ctx));
  if (ctx == NULL) return;
  tw_context_info info;
  CHECK_OK(tw_context_info_get(ctx, &info));
  void* dbuf = NULL;
  int64_t rows_max = 0;
  CHECK_OK(tw_context_dispatch_buffer(ctx, &dbuf, &rows_max));
  tw_device_plan_t dp = NULL, dp2 = NULL;
  CHECK_OK(tw_device_plan_create(ctx, &dp));
  CHECK_OK(tw_device_plan_create(ctx, &dp2));
  tw_dbuf b;
  CHECK(tw_dbuf_alloc(&p, rows_max, &b));
  const int H = p.hidden, E = p.experts / p.world_size, T = p.max_tokens;
  {
    uint16_t* w2 = (uint16_t*)malloc((size_t)E * H * H * 2);
    tw_fill_w2(&p, env->rank, 21, w2);
    CHECK_CUDA(cudaMemcpy(b.w2, w2, (size_t)E * H * H * 2, cudaMemcpyHostToDevice));
    free(w2);
  }
  int32_t tokens[TW_MAX_RANKS];
  for (int r = 0; r < env->nranks; r++) tokens[r] = T;
  tw_routing_t rt = NULL;
  CHECK_OK(tw_make_routing(&p, TW_ROUTER_BALANCED, tokens, 2024, &rt));
  tw_plan_config pc = TW_PLAN_CONFIG_INIT;
  pc.dataflow = TW_DATAFLOW_REDUCE;
  pc.sm_budget = info.sm_budget;
  pc.comm_ctas = 4;
  tw_plan_t plan = NULL;
  if (rt != NULL) CHECK_OK(tw_plan_create(&p, rt, env->rank, &pc, &plan));
  tw_dispatch_options opt = TW_DISPATCH_OPTIONS_INIT;
  opt.plan_config = &pc;
  if (plan != NULL && dp != NULL && dp2 != NULL) {
    tw_upload_routed_inputs(env, &p, rt, 22, 0, b.h_x, b.h_ids64, b.x, b.ids, b.w);
    void* expert_in = NULL;
    CHECK_OK(tw_moe_dispatch_ex(ctx, dp, b.x, b.ids, TW_INDEX_INT32, (const float*)b.w, T,
                                &expert_in, &opt, env->stream));
    CHECK_OK(tw_context_check(ctx));
    if (env->rank == 0) CHECK_OK(tw__context_inject_fault(ctx, TW_FAULT_SKIP_UNIT, 0));
    CHECK_OK(tw_moe_combine(ctx, dp, expert_in, b.w2, b.out, env->stream));
    CHECK_STATUS(tw_context_check(ctx), TW_ERR_TIMEOUT);
    /* Refused on every rank, before anything is sent. */
    CHECK_STATUS(tw_moe_dispatch_ex(ctx, dp, b.x, b.ids, TW_INDEX_INT32, (const float*)b.w, T,
                                    &expert_in, &opt, env->stream),
                 TW_ERR_STATE);
    CHECK(strstr(tw_last_error(), "tw_context_reset") != NULL);
    CHECK_OK(tw_context_reset(ctx));
    /* Clean again: the buffer and the combine as the host plans them. */
    CHECK_OK(tw__fill_bf16(dbuf, (size_t)rows_max * H, 0xFFFF, env->stream));
    CHECK_OK(tw_moe_dispatch_ex(ctx, dp, b.x, b.ids, TW_INDEX_INT32, (const float*)b.w, T,
                                &expert_in, &opt, env->stream));
    CHECK_OK(tw_context_check(ctx));
    tw_compare_device_plan(env, dp, plan, rt, "after the reset");
    tw_expected_in(plan, 22, b.h_in);
    const size_t in_elems = (size_t)plan->rows * H;
    CHECK_CUDA(cudaMemcpy(b.h_got, dbuf, in_elems * 2, cudaMemcpyDeviceToHost));
    CHECKF(memcmp(b.h_got, b.h_in, in_elems * 2) == 0,
           "rank %d: the dispatch after the reset wrote other rows", env->rank);
    CHECK_CUDA(cudaMemcpy(b.host_in, b.h_in, in_elems * 2, cudaMemcpyHostToDevice));
    CHECK_OK(tw_device_plan_upload(dp2, plan, rt, env->stream));
    CHECK_OK(tw_moe_combine(ctx, dp, expert_in, b.w2, b.out, env->stream));
    CHECK_OK(tw_context_check(ctx));
    CHECK_OK(tw_moe_combine(ctx, dp2, b.host_in, b.w2, b.out2, env->stream));
    CHECK_OK(tw_context_check(ctx));
    CHECK_CUDA(cudaMemcpy(b.h_out, b.out, (size_t)T * H * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(b.h_out2, b.out2, (size_t)T * H * 2, cudaMemcpyDeviceToHost));
    CHECKF(memcmp(b.h_out, b.h_out2, (size_t)T * H * 2) == 0,
           "rank %d: dispatch + combine after the reset differs from host-planned combine",
           env->rank);
  }
  tw_plan_destroy(plan);
  tw_routing_destroy(rt);
  tw_dbuf_free(&b);
  CHECK_OK(tw_device_plan_destroy(dp));
  CHECK_OK(tw_device_plan_destroy(dp2));
  CHECK_OK(tw_context_destroy(ctx));
}

static const tw_rank_case kCases[] = {
    {"dispatch_matches_host", test_dispatch_matches_host},
    {"bad_ids_refused", test_bad_ids_refused},
    {"dispatch_needs_its_context", test_dispatch_needs_its_context},
    {"reset_after_failure", test_reset_after_failure},
};

int main(int argc, char** argv) {
  return tw_rank_test_main(argc, argv, kCases, (int)(sizeof kCases / sizeof kCases[0]), 600);
}
