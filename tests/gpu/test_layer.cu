/*
 * test_layer.cu: the whole MoE layer in one call (tw_moe_layer: dispatch, GEMM1 + SwiGLU, GEMM2 +
 * combine; eager, reduce dataflow) on 2 GPUs (one process each, forked here) or on W in-process
 * ranks on one GPU (--in-process W). On seeded inputs that change every iteration (hidden
 * 1024 / 2048, ffn 512 / 768, 8 / 16 experts, top-2; 0, 1, odd and full token counts, all ranks
 * empty too; int32 and int64 ids; balanced and skewed routings) every rank checks:
 *  - out (poisoned before the call: every element written, no NaN) against the double CPU
 *    reference of the whole layer with the GEMM outputs rounded to bf16 as the kernels round
 *    them (tw__ref_moe_token_bf16), within 8e-3 relative to the largest reference value, on the
 *    first, the last and three random tokens of the rank;
 *  - the plan the call built equals tw_plan_create's from the routing (summary), and the GEMM1
 *    tile list uploaded with it equals tw__plan_gemm1_tiles of that plan;
 *  - bit equality: tw_moe_layer's out (the model's choice of the dispatch beside or before GEMM1)
 *    equals
 *    the three halves called one after another (tw_moe_dispatch, tw__layer_gemm1 into a buffer
 *    of the test, tw_moe_combine on it), and the context's h equals that buffer; the unfused
 *    combine mode, the sequential dispatch (TW_LAYER_DISPATCH_SEQUENTIAL) and the overlapped one
 *    on 1..3 copy CTAs give the same out;
 *  - every launch of the call keeps within the SM budget, the context's and half of it (the
 *    recorded grids of GEMM1 and the combine; the dispatch's by its own checks), and half the
 *    budget gives the same bits;
 *  - a bad topk id (int32 and int64) or a NULL w13 on one rank fails the call on every rank with
 *    TW_ERR_EXPERT_ID / TW_ERR_NULL_POINTER naming that rank, never hangs, and leaves the
 *    context usable: the next layer call is right;
 *  - a banded-copy unit that never arrives (an injected fault) times out the destination's GEMM1
 *    band wait, every rank reports a failure within the bound, and the context recovers by reset;
 *  - a context without layer refuses the call; bad configs and options are refused; the
 *    context's device memory (tw_context_memory_get) adds up, printed beside what a sequential
 *    layer of the same capacity needs.
 * Exits 77 without the GPUs it needs.
 */
#include "context.h"
#include "overlap_common.h"
#include "reference.h"

/* Weights are uniform bf16 in [-1, 1) times 2^-4 (exact in bf16), so that a projection of
 * hidden 1024..2048 has a spread of about 1 and SwiGLU runs in its curved part. */
static const float kWeightScale = 0.0625f;

typedef struct tw_layer_cfg {
  int experts, hidden, ffn, top_k, max_tokens;
  tw_router router;
  int iters;
} tw_layer_cfg;

/* One configuration's buffers: device inputs and outputs, host mirrors, and the global weights
 * of every expert on the host (the reference reads any expert's). */
typedef struct tw_lbuf {
  void *x, *ids, *w, *w13, *w2, *out, *out2, *out3, *h2;
  uint16_t *h_x, *h_out, *h_out2, *h_h, *h_h2;
  uint16_t *g_w13, *g_w2; /* (experts, 2F, H), (experts, H, F) */
  int64_t* h_ids64;
  size_t rows_cap;
} tw_lbuf;

static int tw_lbuf_alloc(const tw_problem* p, int64_t rows_max, tw_lbuf* b) {
  memset(b, 0, sizeof *b);
  const size_t E = (size_t)(p->experts / p->world_size), ET = (size_t)p->experts;
  const size_t H = (size_t)p->hidden, F = (size_t)p->ffn, K = (size_t)p->top_k;
  const size_t T = (size_t)p->max_tokens;
  b->rows_cap = (size_t)rows_max;
  int ok = cudaMalloc(&b->x, T * H * 2 + 16) == cudaSuccess &&
           cudaMalloc(&b->ids, T * K * 8 + 8) == cudaSuccess &&
           cudaMalloc(&b->w, T * K * 4 + 4) == cudaSuccess &&
           cudaMalloc(&b->w13, E * 2 * F * H * 2) == cudaSuccess &&
           cudaMalloc(&b->w2, E * H * F * 2) == cudaSuccess &&
           cudaMalloc(&b->out, T * H * 2 + 16) == cudaSuccess &&
           cudaMalloc(&b->out2, T * H * 2 + 16) == cudaSuccess &&
           cudaMalloc(&b->out3, T * H * 2 + 16) == cudaSuccess &&
           cudaMalloc(&b->h2, b->rows_cap * F * 2 + 16) == cudaSuccess;
  b->h_x = (uint16_t*)malloc(T * H * 2 + 16);
  b->h_out = (uint16_t*)malloc(T * H * 2 + 16);
  b->h_out2 = (uint16_t*)malloc(T * H * 2 + 16);
  b->h_h = (uint16_t*)malloc(b->rows_cap * F * 2 + 16);
  b->h_h2 = (uint16_t*)malloc(b->rows_cap * F * 2 + 16);
  b->g_w13 = (uint16_t*)malloc(ET * 2 * F * H * 2);
  b->g_w2 = (uint16_t*)malloc(ET * H * F * 2);
  b->h_ids64 = (int64_t*)malloc(T * K * 8 + 8);
  return ok && b->h_x && b->h_out && b->h_out2 && b->h_h && b->h_h2 && b->g_w13 && b->g_w2 &&
         b->h_ids64;
}

static void tw_lbuf_free(tw_lbuf* b) {
  void* dev[] = {b->x, b->ids, b->w, b->w13, b->w2, b->out, b->out2, b->out3, b->h2};
  for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) cudaFree(dev[i]);
  free(b->h_x);
  free(b->h_out);
  free(b->h_out2);
  free(b->h_h);
  free(b->h_h2);
  free(b->g_w13);
  free(b->g_w2);
  free(b->h_ids64);
}

/* Every expert's weights of data set `salt` on the host, this rank's local experts on the
 * device. */
static void tw_fill_weights(tw_rank_env* env, const tw_problem* p, uint64_t salt, tw_lbuf* b) {
  const size_t ET = (size_t)p->experts, E = ET / (size_t)p->world_size;
  const size_t H = (size_t)p->hidden, F = (size_t)p->ffn;
  for (size_t g = 0; g < ET; g++) {
    for (size_t r = 0; r < 2 * F; r++)
      for (size_t c = 0; c < H; c++)
        b->g_w13[(g * 2 * F + r) * H + c] =
            tw_f2bf(kWeightScale * tw_uniform_bf16(salt ^ 0x1313, g, r, c));
    for (size_t n = 0; n < H; n++)
      for (size_t f = 0; f < F; f++)
        b->g_w2[(g * H + n) * F + f] =
            tw_f2bf(kWeightScale * tw_uniform_bf16(salt ^ 0x2424, g, n, f));
  }
  const size_t e0 = (size_t)env->rank * E;
  CHECK_CUDA(
      cudaMemcpy(b->w13, b->g_w13 + e0 * 2 * F * H, E * 2 * F * H * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(b->w2, b->g_w2 + e0 * H * F, E * H * F * 2, cudaMemcpyHostToDevice));
}

/* out (already on the host in b->h_out, nt rows) against the reference on up to five tokens:
 * the largest error relative to the largest reference value; every element must be finite. */
static double tw_layer_error(tw_rank_env* env, const tw_problem* p, tw_routing_t rt, int32_t nt,
                             uint64_t seed, const tw_lbuf* b, const char* what) {
  if (nt == 0) return 0.0;
  const int H = p->hidden, K = p->top_k;
  int nan_seen = 0;
  for (size_t i = 0; i < (size_t)nt * H; i++) nan_seen += !isfinite(tw_bf2f(b->h_out[i]));
  CHECKF(nan_seen == 0, "rank %d %s: %d output elements not finite (never written?)", env->rank,
         what, nan_seen);
  int32_t n = 0;
  const int32_t* ids = NULL;
  const float* ws = NULL;
  CHECK_OK(tw_routing_rank(rt, env->rank, &n, &ids, &ws));
  double* ref = (double*)malloc(sizeof(double) * (size_t)H);
  double max_err = 0.0, max_ref = 0.0;
  const int samples = nt < 5 ? nt : 5;
  for (int s = 0; s < samples; s++) {
    const int t = s == 0   ? 0
                  : s == 1 ? nt - 1
                           : (int)(tw_mix64(seed * 7 + (uint64_t)s) % (uint64_t)nt);
    CHECK_OK(tw__ref_moe_token_bf16(H, p->ffn, p->experts, K, b->h_x + (size_t)t * H,
                                    ids + (size_t)t * K, ws + (size_t)t * K, b->g_w13, b->g_w2,
                                    ref));
    for (int c = 0; c < H; c++) {
      max_err = fmax(max_err, fabs((double)tw_bf2f(b->h_out[(size_t)t * H + c]) - ref[c]));
      max_ref = fmax(max_ref, fabs(ref[c]));
    }
  }
  free(ref);
  const double rel = max_ref > 0 ? max_err / max_ref : max_err;
  CHECKF(rel < 8e-3, "rank %d %s: relative error %.3e against the reference", env->rank, what, rel);
  return rel;
}

/* The device plan the layer built against the host plan of the same routing: summary and the
 * GEMM1 tile list. */
static void tw_compare_layer_plan(tw_rank_env* env, tw_device_plan_t dp, const struct tw_plan* plan,
                                  const char* what) {
  tw_plan_summary a, s;
  CHECK_OK(tw_plan_summary_get((tw_plan_t)plan, &a));
  CHECK_OK(tw_device_plan_summary_get(dp, &s));
  a.solve_us = s.solve_us = 0; /* measured */
  CHECKF(memcmp(&a, &s, sizeof a) == 0,
         "rank %d %s: summaries differ (rows %lld / %lld, C %d / %d)", env->rank, what,
         (long long)a.rows, (long long)s.rows, a.comm_ctas, s.comm_ctas);
  int32_t n = 0;
  CHECK_OK(tw__plan_gemm1_tiles(plan, TW_GEMM1_TN, NULL, 0, &n));
  CHECKF(n == dp->num_gemm1_tiles, "rank %d %s: %d GEMM1 tiles uploaded, the plan has %d",
         env->rank, what, dp->num_gemm1_tiles, n);
  if (n > 0 && n == dp->num_gemm1_tiles) {
    tw_tile* want = (tw_tile*)malloc((size_t)n * sizeof(tw_tile));
    tw_tile* got = (tw_tile*)malloc((size_t)n * sizeof(tw_tile));
    CHECK_OK(tw__plan_gemm1_tiles(plan, TW_GEMM1_TN, want, n, &n));
    CHECK_CUDA(
        cudaMemcpy(got, dp->gemm1_tiles, (size_t)n * sizeof(tw_tile), cudaMemcpyDeviceToHost));
    CHECKF(memcmp(want, got, (size_t)n * sizeof(tw_tile)) == 0,
           "rank %d %s: the uploaded GEMM1 tiles differ from tw__plan_gemm1_tiles", env->rank,
           what);
    free(want);
    free(got);
  }
}

/* What a sequential layer of the same capacity holds per rank, unpadded, bf16: the dispatch's
 * send and receive buffers, GEMM1's (rows, 2F) output before a separate SwiGLU, h, GEMM2's
 * output and the combine's receive buffer. */
static double tw_sequential_mib(const tw_problem* p) {
  const double T = p->max_tokens, K = p->top_k, H = p->hidden, F = p->ffn;
  const double E = p->experts / p->world_size;
  const double R = p->world_size * T * (K < E ? K : E); /* rows an expert rank can receive */
  const double bytes = 2.0 * (T * K * H + R * H + R * 2 * F + R * F + R * H + T * K * H);
  return bytes / 1048576.0;
}

static void tw_print_memory(tw_context_t ctx, const tw_problem* p) {
  tw_context_memory m = TW_CONTEXT_MEMORY_INIT;
  CHECK_OK(tw_context_memory_get(ctx, &m));
  const double M = 1048576.0;
  printf(
      "  memory per rank (rows_max %lld): combine window %.2f MiB, dispatch window %.2f, GEMM2 "
      "out %.2f, h %.2f, state %.3f, device plan %.3f: total %.2f MiB; a sequential layer of "
      "the same capacity (all-to-all buffers, GEMM1 out of 2F, h, GEMM2 out): %.2f MiB\n",
      (long long)m.rows_max, m.window_bytes / M, m.dispatch_bytes / M, m.gemm2_out_bytes / M,
      m.h_bytes / M, m.state_bytes / M, m.plan_bytes / M, m.total_bytes / M, tw_sequential_mib(p));
}

static thread_local double g_max_rel = 0.0;

static tw_context_t tw_layer_context(tw_rank_env* env, const tw_problem* p, int timeout_ms) {
  tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
  cc.layer = 1;
  cc.dataflow = TW_DATAFLOW_REDUCE;
  cc.timeout_ms = timeout_ms;
  tw_context_t ctx = NULL;
  CHECK_OK(tw_rank_context_create(env, p, &cc, &ctx));
  return ctx;
}

static void tw_run_layer_cfg(tw_rank_env* env, const tw_layer_cfg* cfg, int cfg_index) {
  tw_problem p =
      tw_rank_problem(env, cfg->hidden, cfg->ffn, cfg->experts, cfg->top_k, cfg->max_tokens);
  CHECK_OK(tw_problem_validate(&p));
  tw_context_t ctx = tw_layer_context(env, &p, 0);
  if (ctx == NULL) return;
  tw_context_info info;
  CHECK_OK(tw_context_info_get(ctx, &info));
  int64_t rows_max = 0;
  CHECK_OK(tw_context_dispatch_buffer(ctx, NULL, &rows_max));
  void* ctx_h = NULL;
  CHECK_OK(tw__context_layer_h(ctx, &ctx_h));
  tw_device_plan_t dp = NULL, dp2 = NULL;
  CHECK_OK(tw_device_plan_create(ctx, &dp));
  CHECK_OK(tw_device_plan_create(ctx, &dp2));
  tw_lbuf b;
  const int ok = tw_lbuf_alloc(&p, rows_max, &b);
  CHECK(ok);
  const int H = p.hidden, F = p.ffn;
  if (ok) tw_fill_weights(env, &p, 500 + (uint64_t)cfg_index, &b);
  if (env->rank == 0) tw_print_memory(ctx, &p);
  double cfg_max_rel = 0.0;
  for (int it = 0; ok && it < cfg->iters && dp != NULL && dp2 != NULL; it++) {
    int32_t tokens[TW_MAX_RANKS];
    tw_token_counts(it, env->nranks, p.max_tokens, 60 + (uint64_t)cfg_index, tokens);
    if (it == 4)
      for (int r = 0; r < env->nranks; r++)
        tokens[r] = (tokens[r] | 1) <= p.max_tokens ? tokens[r] | 1 : p.max_tokens;
    if (it == 5)
      for (int r = 0; r < env->nranks; r++) tokens[r] = 0;
    const uint64_t seed = 9000 + (uint64_t)cfg_index * 100 + (uint64_t)it;
    const tw_router router = it % 3 == 2 ? TW_ROUTER_STRESS_SKEW : cfg->router;
    tw_routing_t rt = NULL;
    CHECK_OK(tw_make_routing(&p, router, tokens, seed, &rt));
    if (rt == NULL) break;
    const int id64 = it % 2;
    const tw_index_type itype = id64 ? TW_INDEX_INT64 : TW_INDEX_INT32;
    tw_upload_routed_inputs(env, &p, rt, seed * 13 + 5, id64, b.h_x, b.h_ids64, b.x, b.ids, b.w);
    const int32_t nt = tokens[env->rank];
    /* The plan the call must build: the context's budget (the default), or a given config
     * (every third iteration: a fixed partition). */
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
    char what[64];
    snprintf(what, sizeof what, "cfg %d iter %d", cfg_index, it);
    const void* x = nt > 0 ? b.x : NULL;
    const void* ids = nt > 0 ? b.ids : NULL;
    const float* ws = nt > 0 ? (const float*)b.w : NULL;
    const size_t n_out = (size_t)nt * H;
    /* (i) the layer, out poisoned. */
    tw_layer_options lo = TW_LAYER_OPTIONS_INIT;
    lo.plan_config = &pc;
    CHECK_OK(tw__fill_bf16(b.out, n_out + 8, 0xFFFF, env->stream));
    tw_status st = tw_moe_layer_ex(ctx, dp, x, ids, itype, ws, nt, b.w13, b.w2, b.out,
                                   given ? &lo : NULL, env->stream);
    CHECKF(st == TW_SUCCESS, "rank %d %s: tw_moe_layer: %s (%s)", env->rank, what,
           tw_status_string(st), tw_last_error());
    CHECK_OK(tw_context_check(ctx));
    tw__launch_record lr;
    CHECK_OK(tw__context_last_launch(ctx, &lr));
    /* The model's choice (the default): the copy beside GEMM1 on dispatch_ctas SMs, both within
     * the budget, or (0) the dispatch before GEMM1. */
    const int32_t g1_room = info.sm_budget - lr.dispatch_ctas;
    const int32_t g1_want = g1_room < dp->num_gemm1_tiles ? g1_room : dp->num_gemm1_tiles;
    CHECKF(lr.budget == info.sm_budget && lr.producer_ctas + lr.consumer_ctas <= lr.budget &&
               lr.reduce_ctas <= lr.reduce_cap && lr.dispatch_ctas >= 0 &&
               lr.dispatch_ctas < lr.budget && lr.gemm1_ctas == g1_want,
           "rank %d %s: launches P %d + C %d, reduction %d, copy %d beside GEMM1 %d (expected "
           "%d) against the budget %d",
           env->rank, what, lr.producer_ctas, lr.consumer_ctas, lr.reduce_ctas, lr.dispatch_ctas,
           lr.gemm1_ctas, g1_want, lr.budget);
    if (st == TW_SUCCESS) tw_compare_layer_plan(env, dp, plan, what);
    const size_t h_elems = (size_t)plan->rows * F;
    if (h_elems > 0) CHECK_CUDA(cudaMemcpy(b.h_h, ctx_h, h_elems * 2, cudaMemcpyDeviceToHost));
    if (n_out > 0) CHECK_CUDA(cudaMemcpy(b.h_out, b.out, n_out * 2, cudaMemcpyDeviceToHost));
    const double rel = tw_layer_error(env, &p, rt, nt, seed, &b, what);
    if (rel > cfg_max_rel) cfg_max_rel = rel;

    /* (ii) the three halves one after another, into buffers of the test. */
    tw_dispatch_options dopt = TW_DISPATCH_OPTIONS_INIT;
    dopt.plan_config = &pc;
    void* expert_in = NULL;
    CHECK_OK(tw_moe_dispatch_ex(ctx, dp2, x, ids, itype, ws, nt, &expert_in, &dopt, env->stream));
    CHECK_OK(tw__fill_bf16(b.h2, h_elems + 8, 0xFFFF, env->stream));
    CHECK_OK(tw__layer_gemm1(ctx, dp2, expert_in, b.w13, b.h2, 0, env->stream));
    CHECK_OK(tw__fill_bf16(b.out2, n_out + 8, 0xFFFF, env->stream));
    tw_combine_options co = TW_COMBINE_OPTIONS_INIT;
    CHECK_OK(tw_moe_combine_ex(ctx, dp2, b.h2, b.w2, b.out2, &co, env->stream));
    CHECK_OK(tw_context_check(ctx));
    CHECK_CUDA(cudaStreamSynchronize(env->stream));
    if (h_elems > 0) {
      CHECK_CUDA(cudaMemcpy(b.h_h2, b.h2, h_elems * 2, cudaMemcpyDeviceToHost));
      CHECKF(memcmp(b.h_h, b.h_h2, h_elems * 2) == 0,
             "rank %d %s: the layer's h differs from GEMM1 called after tw_moe_dispatch", env->rank,
             what);
    }
    if (n_out > 0) {
      CHECK_CUDA(cudaMemcpy(b.h_out2, b.out2, n_out * 2, cudaMemcpyDeviceToHost));
      CHECKF(memcmp(b.h_out, b.h_out2, n_out * 2) == 0,
             "rank %d %s: tw_moe_layer differs from dispatch, GEMM1 and combine called one "
             "after another",
             env->rank, what);
    }

    /* (iii) the layer with the unfused combine. */
    lo.mode = TW_COMBINE_UNFUSED;
    lo.plan_config = given ? &pc : NULL;
    CHECK_OK(tw__fill_bf16(b.out3, n_out + 8, 0xFFFF, env->stream));
    CHECK_OK(
        tw_moe_layer_ex(ctx, dp, x, ids, itype, ws, nt, b.w13, b.w2, b.out3, &lo, env->stream));
    CHECK_OK(tw_context_check(ctx));
    if (n_out > 0) {
      CHECK_CUDA(cudaMemcpy(b.h_out2, b.out3, n_out * 2, cudaMemcpyDeviceToHost));
      CHECKF(memcmp(b.h_out, b.h_out2, n_out * 2) == 0,
             "rank %d %s: the unfused combine mode gives other bits than the overlapped one",
             env->rank, what);
    }
    /* (iv) the dispatch before GEMM1 (SEQUENTIAL), or beside it on 1..3 copy CTAs (the
     * fewest: GEMM1 waits the longest for its bands): the same bits. */
    {
      tw_layer_options ld = TW_LAYER_OPTIONS_INIT;
      ld.plan_config = given ? &pc : NULL;
      ld.dispatch_ctas = it % 2 == 0 ? TW_LAYER_DISPATCH_SEQUENTIAL : 1 + it % 3;
      CHECK_OK(tw__fill_bf16(b.out3, n_out + 8, 0xFFFF, env->stream));
      CHECK_OK(
          tw_moe_layer_ex(ctx, dp, x, ids, itype, ws, nt, b.w13, b.w2, b.out3, &ld, env->stream));
      CHECK_OK(tw_context_check(ctx));
      CHECK_OK(tw__context_last_launch(ctx, &lr));
      const int32_t want_copy = ld.dispatch_ctas > 0 ? ld.dispatch_ctas : 0;
      CHECKF(lr.dispatch_ctas == want_copy, "rank %d %s: dispatch_ctas %d ran %d copy CTAs",
             env->rank, what, ld.dispatch_ctas, lr.dispatch_ctas);
      if (n_out > 0) {
        CHECK_CUDA(cudaMemcpy(b.h_out2, b.out3, n_out * 2, cudaMemcpyDeviceToHost));
        CHECKF(memcmp(b.h_out, b.h_out2, n_out * 2) == 0,
               "rank %d %s: dispatch_ctas %d gives other bits than the default", env->rank, what,
               ld.dispatch_ctas);
      }
    }
    /* (v) half the budget (the plan made for it): the same bits, every grid within it. */
    if (!given) {
      tw_layer_options lh = TW_LAYER_OPTIONS_INIT;
      lh.sm_budget = info.sm_budget / 2;
      CHECK_OK(tw__fill_bf16(b.out3, n_out + 8, 0xFFFF, env->stream));
      CHECK_OK(
          tw_moe_layer_ex(ctx, dp, x, ids, itype, ws, nt, b.w13, b.w2, b.out3, &lh, env->stream));
      CHECK_OK(tw_context_check(ctx));
      CHECK_OK(tw__context_last_launch(ctx, &lr));
      CHECKF(lr.budget == lh.sm_budget && lr.producer_ctas + lr.consumer_ctas <= lh.sm_budget &&
                 lr.reduce_ctas <= lh.sm_budget &&
                 lr.gemm1_ctas + lr.dispatch_ctas <= lh.sm_budget &&
                 (dp->num_gemm1_tiles == 0) == (lr.gemm1_ctas == 0),
             "rank %d %s: with sm_budget %d: P %d + C %d, reduction %d, GEMM1 %d", env->rank, what,
             lh.sm_budget, lr.producer_ctas, lr.consumer_ctas, lr.reduce_ctas, lr.gemm1_ctas);
      tw_plan_summary hs;
      CHECK_OK(tw_device_plan_summary_get(dp, &hs));
      CHECK(hs.sm_budget == lh.sm_budget);
      if (n_out > 0) {
        CHECK_CUDA(cudaMemcpy(b.h_out2, b.out3, n_out * 2, cudaMemcpyDeviceToHost));
        CHECKF(memcmp(b.h_out, b.h_out2, n_out * 2) == 0,
               "rank %d %s: half the SM budget gives other bits", env->rank, what);
      }
    }
    tw_plan_destroy(plan);
    tw_routing_destroy(rt);
  }
  if (env->rank == 0)
    printf("  cfg %d: E=%d H=%d F=%d k=%d tokens<=%d router=%d: max rel err %.3e\n", cfg_index,
           p.experts, H, F, p.top_k, p.max_tokens, (int)cfg->router, cfg_max_rel);
  if (cfg_max_rel > g_max_rel) g_max_rel = cfg_max_rel;
  tw_lbuf_free(&b);
  CHECK_OK(tw_device_plan_destroy(dp));
  CHECK_OK(tw_device_plan_destroy(dp2));
  CHECK_OK(tw_context_destroy(ctx));
}

static void test_layer_matches_reference(tw_rank_env* env) {
  static const tw_layer_cfg cfgs[] = {
      {8, 1024, 512, 2, 96, TW_ROUTER_BALANCED, 6},
      {16, 2048, 768, 2, 160, TW_ROUTER_MODERATE_SKEW, 6},
  };
  const int quick = getenv("TW_TEST_QUICK") != NULL;
  const int n = quick ? 1 : (int)(sizeof cfgs / sizeof cfgs[0]);
  for (int i = 0; i < n; i++) {
    tw_layer_cfg c = cfgs[i];
    if (quick) c.iters = 2;
    tw_run_layer_cfg(env, &c, i);
  }
  if (env->rank == 0)
    printf("  max relative error over all configs: %.3e (bound 8e-3)\n", g_max_rel);
}

/* One layer call whose refusal every rank must see: status `want`, naming rank `culprit` and
 * the call. */
static void tw_expect_layer_refusal(tw_rank_env* env, tw_context_t ctx, tw_device_plan_t dp,
                                    tw_lbuf* b, int32_t n, int id64, const void* w13,
                                    tw_status want, int culprit, const char* what) {
  const tw_status st = tw_moe_layer(ctx, dp, b->x, b->ids, id64 ? TW_INDEX_INT64 : TW_INDEX_INT32,
                                    (const float*)b->w, n, w13, b->w2, b->out, env->stream);
  char needle[32];
  snprintf(needle, sizeof needle, "rank %d", culprit);
  CHECKF(st == want && strstr(tw_last_error(), needle) != NULL &&
             strstr(tw_last_error(), "tw_moe_layer") != NULL,
         "rank %d, %s: got %s (%s), expected %s naming rank %d", env->rank, what,
         tw_status_string(st), tw_last_error(), tw_status_string(want), culprit);
}

/* A small layer on every rank (H 1024, F 512, 8 experts, top-2, 64 tokens, each rank full): the
 * context, a device plan, the buffers with seeded weights, and a balanced routing. ok: all
 * made. */
typedef struct tw_lfix {
  tw_problem p;
  tw_context_t ctx;
  tw_device_plan_t dp;
  tw_lbuf b;
  tw_routing_t rt;
  int ok;
} tw_lfix;

static void tw_lfix_open(tw_rank_env* env, tw_lfix* f, int timeout_ms, uint64_t salt,
                         uint64_t seed) {
  memset(f, 0, sizeof *f);
  f->p = tw_rank_problem(env, 1024, 512, 8, 2, 64);
  f->ctx = tw_layer_context(env, &f->p, timeout_ms);
  if (f->ctx == NULL) return;
  int64_t rows_max = 0;
  CHECK_OK(tw_context_dispatch_buffer(f->ctx, NULL, &rows_max));
  CHECK_OK(tw_device_plan_create(f->ctx, &f->dp));
  const int bufs = tw_lbuf_alloc(&f->p, rows_max, &f->b);
  CHECK(bufs);
  if (bufs) tw_fill_weights(env, &f->p, salt, &f->b);
  int32_t tokens[TW_MAX_RANKS];
  for (int r = 0; r < env->nranks; r++) tokens[r] = f->p.max_tokens;
  CHECK_OK(tw_make_routing(&f->p, TW_ROUTER_BALANCED, tokens, seed, &f->rt));
  f->ok = bufs && f->dp != NULL && f->rt != NULL;
}

static void tw_lfix_close(tw_lfix* f) {
  tw_routing_destroy(f->rt);
  tw_lbuf_free(&f->b);
  if (f->ctx == NULL) return;
  CHECK_OK(tw_device_plan_destroy(f->dp));
  CHECK_OK(tw_context_destroy(f->ctx));
}

static void test_bad_ids_refused(tw_rank_env* env) {
  tw_lfix f;
  tw_lfix_open(env, &f, 0, 77, 123);
  const tw_problem& p = f.p;
  tw_context_t ctx = f.ctx;
  tw_device_plan_t dp = f.dp;
  tw_lbuf& b = f.b;
  tw_routing_t rt = f.rt;
  const int K = p.top_k, ET = p.experts, T = p.max_tokens, H = p.hidden;
  const int culprit = env->nranks - 1;
  for (int round = 0; f.ok && round < 4; round++) {
    const int id64 = round % 2;
    tw_upload_routed_inputs(env, &p, rt, 31, id64, b.h_x, b.h_ids64, b.x, b.ids, b.w);
    const void* w13 = b.w13;
    tw_status want = TW_ERR_EXPERT_ID;
    const char* what = "an id out of range";
    if (env->rank == culprit) {
      /* Rounds 0, 1: id = experts (int32), a large negative int64; round 2: a NULL w13;
       * round 3: a valid call. */
      const size_t at = (size_t)(T / 2) * K + (K - 1);
      if (round == 0) {
        const int32_t bad = ET;
        CHECK_CUDA(cudaMemcpy((int32_t*)b.ids + at, &bad, 4, cudaMemcpyHostToDevice));
      } else if (round == 1) {
        const int64_t bad = -5000000000LL;
        CHECK_CUDA(cudaMemcpy((int64_t*)b.ids + at, &bad, 8, cudaMemcpyHostToDevice));
      } else if (round == 2) {
        w13 = NULL;
      }
    }
    if (round == 2) {
      want = TW_ERR_NULL_POINTER;
      what = "a NULL w13";
    }
    if (round < 3) {
      tw_expect_layer_refusal(env, ctx, dp, &b, T, id64, w13, want, culprit, what);
      continue;
    }
    /* The context is still usable: a valid layer call, right against the reference. */
    CHECK_OK(tw__fill_bf16(b.out, (size_t)T * H + 8, 0xFFFF, env->stream));
    CHECK_OK(tw_moe_layer(ctx, dp, b.x, b.ids, id64 ? TW_INDEX_INT64 : TW_INDEX_INT32,
                          (const float*)b.w, T, b.w13, b.w2, b.out, env->stream));
    CHECK_OK(tw_context_check(ctx));
    CHECK_CUDA(cudaMemcpy(b.h_out, b.out, (size_t)T * H * 2, cudaMemcpyDeviceToHost));
    tw_layer_error(env, &p, rt, T, 4242, &b, "after the refusals");
  }
  tw_lfix_close(&f);
}

/* A banded-copy unit that never arrives (TW_FAULT_DROP_COPY_UNIT on rank 0, every rank's GEMM1
 * beside its dispatch): its destination's GEMM1 times out on that band (its own record says so),
 * every rank's check reports TW_ERR_TIMEOUT within the bound, calls are refused until the reset,
 * and the next layer calls give the bits of the call before the fault. */
static void test_dropped_copy_unit_times_out(tw_rank_env* env) {
  enum { kTimeoutMs = 1500 };
  tw_lfix f;
  tw_lfix_open(env, &f, kTimeoutMs, 91, 321);
  const tw_problem& p = f.p;
  tw_context_t ctx = f.ctx;
  tw_device_plan_t dp = f.dp;
  tw_lbuf& b = f.b;
  tw_routing_t rt = f.rt;
  if (f.ok) {
    tw_upload_routed_inputs(env, &p, rt, 17, 0, b.h_x, b.h_ids64, b.x, b.ids, b.w);
    const size_t n_out = (size_t)p.max_tokens * p.hidden;
    tw_layer_options lo = TW_LAYER_OPTIONS_INIT;
    lo.dispatch_ctas = 2; /* beside GEMM1 on every rank: the band waits are what must catch it */
    CHECK_OK(tw_moe_layer_ex(ctx, dp, b.x, b.ids, TW_INDEX_INT32, (const float*)b.w, p.max_tokens,
                             b.w13, b.w2, b.out, &lo, env->stream));
    CHECK_OK(tw_context_check(ctx));
    CHECK_CUDA(cudaMemcpy(b.h_out, b.out, n_out * 2, cudaMemcpyDeviceToHost));
    if (env->rank == 0) CHECK_OK(tw__context_inject_fault(ctx, TW_FAULT_DROP_COPY_UNIT, 0));
    const double t0 = tw__now_seconds();
    CHECK_OK(tw_moe_layer_ex(ctx, dp, b.x, b.ids, TW_INDEX_INT32, (const float*)b.w, p.max_tokens,
                             b.w13, b.w2, b.out2, &lo, env->stream));
    const tw_status st = tw_context_check(ctx);
    const double waited = tw__now_seconds() - t0;
    CHECKF(st == TW_ERR_TIMEOUT, "rank %d: %s (%s), expected TW_ERR_TIMEOUT", env->rank,
           tw_status_string(st), tw_last_error());
    /* Rank 0's unit 0 is its first expert's rows at rank 1 (W > 1) or at itself; that rank's own
     * record (the check reports one rank's on every rank) is the band wait. */
    if (env->rank == (env->nranks > 1 ? 1 : 0)) {
      tw__counters k;
      CHECK_OK(tw__context_counters(ctx, env->stream, &k));
      CHECKF(k.err_status == TW_ERR_TIMEOUT && k.err_where == TW_WAIT_BAND_ROWS,
             "rank %d: its record is status %d at %d (index %d), expected the GEMM1 band wait",
             env->rank, k.err_status, k.err_where, k.err_index);
    }
    CHECKF(waited < 4.0 * kTimeoutMs / 1000.0 + 2.0, "rank %d: the failure took %.2f s", env->rank,
           waited);
    if (env->rank == 0)
      printf("  dropped copy unit: %s after %.2f s: %s\n", tw_status_string(st), waited,
             tw_last_error());
    CHECK_STATUS(tw_moe_layer_ex(ctx, dp, b.x, b.ids, TW_INDEX_INT32, (const float*)b.w,
                                 p.max_tokens, b.w13, b.w2, b.out2, &lo, env->stream),
                 TW_ERR_STATE);
    CHECK_OK(tw_context_reset(ctx));
    for (int rep = 0; rep < 2; rep++) {
      CHECK_OK(tw__fill_bf16(b.out2, n_out + 8, 0xFFFF, env->stream));
      CHECK_OK(tw_moe_layer_ex(ctx, dp, b.x, b.ids, TW_INDEX_INT32, (const float*)b.w, p.max_tokens,
                               b.w13, b.w2, b.out2, &lo, env->stream));
      CHECK_OK(tw_context_check(ctx));
      CHECK_CUDA(cudaMemcpy(b.h_out2, b.out2, n_out * 2, cudaMemcpyDeviceToHost));
      CHECKF(memcmp(b.h_out, b.h_out2, n_out * 2) == 0,
             "rank %d: the layer after the reset differs from the one before the fault", env->rank);
    }
  }
  tw_lfix_close(&f);
}

static void test_layer_needs_its_context(tw_rank_env* env) {
  tw_problem p = tw_rank_problem(env, 1024, 512, 8, 2, 64);
  tw_context_t ctx = NULL;
  /* Dispatch without layer: refused before anything collective. */
  tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
  cc.dispatch = 1;
  cc.dataflow = TW_DATAFLOW_REDUCE;
  CHECK_OK(tw_rank_context_create(env, &p, &cc, &ctx));
  int64_t plan_bytes_dispatch = 0;
  if (ctx != NULL) {
    tw_device_plan_t dp = NULL;
    CHECK_OK(tw_device_plan_create(ctx, &dp));
    CHECK_STATUS(
        tw_moe_layer(ctx, dp, NULL, NULL, TW_INDEX_INT32, NULL, 0, NULL, NULL, NULL, env->stream),
        TW_ERR_STATE);
    CHECK(strstr(tw_last_error(), "layer = 1") != NULL);
    tw_context_memory m = TW_CONTEXT_MEMORY_INIT;
    CHECK_OK(tw_context_memory_get(ctx, &m));
    CHECK(m.h_bytes == 0 && m.dispatch_bytes > 0);
    plan_bytes_dispatch = m.plan_bytes;
    CHECK_OK(tw_device_plan_destroy(dp));
    CHECK_OK(tw_context_destroy(ctx));
  }
  /* Configs: layer 2, layer with the add dataflow, hidden not a multiple of 64. */
  cc = TW_CONTEXT_CONFIG_INIT;
  cc.layer = 2;
  ctx = NULL;
  CHECK_STATUS(tw_rank_context_create(env, &p, &cc, &ctx), TW_ERR_INVALID_ARGUMENT);
  cc.layer = 1;
  cc.dataflow = TW_DATAFLOW_ADD;
  CHECK_STATUS(tw_rank_context_create(env, &p, &cc, &ctx), TW_ERR_UNSUPPORTED);
  cc.dataflow = TW_DATAFLOW_REDUCE;
  tw_problem q = tw_rank_problem(env, 1000, 512, 8, 2, 64);
  CHECK_STATUS(tw_rank_context_create(env, &q, &cc, &ctx), TW_ERR_ALIGNMENT);
  CHECK(ctx == NULL);
  /* A layer context: options refused before anything collective; a call with no tokens
   * anywhere is valid; the memory adds up. */
  ctx = tw_layer_context(env, &p, 0);
  if (ctx == NULL) return;
  tw_device_plan_t dp = NULL;
  CHECK_OK(tw_device_plan_create(ctx, &dp));
  tw_layer_options lo = TW_LAYER_OPTIONS_INIT;
  lo.mode = TW_COMBINE_GEMM_ONLY;
  void* w = NULL;
  CHECK_CUDA(cudaMalloc(&w, 256));
  CHECK_STATUS(
      tw_moe_layer_ex(ctx, dp, NULL, NULL, TW_INDEX_INT32, NULL, 0, w, w, NULL, &lo, env->stream),
      TW_ERR_INVALID_ARGUMENT);
  /* dispatch_ctas below SEQUENTIAL or leaving GEMM1 no SM: refused, naming the range. */
  lo = TW_LAYER_OPTIONS_INIT;
  lo.dispatch_ctas = -2;
  CHECK_STATUS(
      tw_moe_layer_ex(ctx, dp, NULL, NULL, TW_INDEX_INT32, NULL, 0, w, w, NULL, &lo, env->stream),
      TW_ERR_INVALID_ARGUMENT);
  CHECK(strstr(tw_last_error(), "dispatch_ctas") != NULL);
  tw_context_info ci;
  CHECK_OK(tw_context_info_get(ctx, &ci));
  lo.dispatch_ctas = ci.sm_budget;
  CHECK_STATUS(
      tw_moe_layer_ex(ctx, dp, NULL, NULL, TW_INDEX_INT32, NULL, 0, w, w, NULL, &lo, env->stream),
      TW_ERR_INVALID_ARGUMENT);
  lo = TW_LAYER_OPTIONS_INIT;
  lo.magic = 0;
  CHECK_STATUS(
      tw_moe_layer_ex(ctx, dp, NULL, NULL, TW_INDEX_INT32, NULL, 0, w, w, NULL, &lo, env->stream),
      TW_ERR_CONFIG_VERSION);
  CHECK_OK(tw_moe_layer(ctx, dp, NULL, NULL, TW_INDEX_INT32, NULL, 0, w, w, NULL, env->stream));
  CHECK_OK(tw_context_check(ctx));
  tw_plan_summary s;
  CHECK_OK(tw_device_plan_summary_get(dp, &s));
  CHECK(s.rows == 0 && s.send_bytes == 0 && dp->num_gemm1_tiles == 0);
  tw_context_memory m = TW_CONTEXT_MEMORY_INIT;
  CHECK_OK(tw_context_memory_get(ctx, &m));
  CHECK(m.rows_max > 0 && m.h_bytes == m.rows_max * p.ffn * 2 &&
        m.gemm2_out_bytes == m.rows_max * p.hidden * 2 &&
        m.dispatch_bytes >= m.rows_max * p.hidden * 2 && m.window_bytes > 0 && m.state_bytes > 0 &&
        m.plan_bytes > plan_bytes_dispatch &&
        m.total_bytes == m.window_bytes + m.dispatch_bytes + m.gemm2_out_bytes + m.h_bytes +
                             m.state_bytes + m.plan_bytes);
  m.size = 8;
  CHECK_STATUS(tw_context_memory_get(ctx, &m), TW_ERR_CONFIG_VERSION);
  if (env->rank == 0) tw_print_memory(ctx, &p);
  cudaFree(w);
  CHECK_OK(tw_device_plan_destroy(dp));
  CHECK_OK(tw_context_destroy(ctx));
}

static const tw_rank_case kCases[] = {
    {"layer_matches_reference", test_layer_matches_reference},
    {"bad_ids_refused", test_bad_ids_refused},
    {"dropped_copy_unit_times_out", test_dropped_copy_unit_times_out},
    {"layer_needs_its_context", test_layer_needs_its_context},
};

int main(int argc, char** argv) {
  return tw_rank_test_main(argc, argv, kCases, (int)(sizeof kCases / sizeof kCases[0]), 600);
}
