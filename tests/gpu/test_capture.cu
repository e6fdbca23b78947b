/*
 * test_capture.cu: the capturable dispatch and layer (tw_context_config.dispatch_capacity > 0)
 * against the eager ones, on 2 GPUs (one process each, forked here) or on W in-process ranks on
 * one GPU (--in-process W). Every rank holds two contexts on one team, an eager one and a
 * capturable one, and runs them one after the other (each call checked before the next), so
 * that only one of them has kernels on the GPU at a time. On seeded routings that change every
 * iteration (balanced, moderate and stress skew; full, odd, 1 and 0 tokens, all ranks empty too;
 * int32 and int64 ids) every rank checks:
 *  - dispatch + combine (hidden == ffn, the dispatched rows are GEMM2's input): the capturable
 *    call's out equals the eager call's bit for bit, every element written (out poisoned before
 *    each call);
 *  - the layer (dispatch, GEMM1 + SwiGLU, GEMM2 + combine): the same, for tw_moe_layer;
 *  - a CUDA graph of the capturable call (dispatch + combine, and the layer) captured once and
 *    replayed 60 times, with new x, topk_ids and topk_weights (a new routing of the same token
 *    counts) written into the same device buffers on the graph's stream before each replay:
 *    every replay's out equals an eager call's on the same inputs, and tw_context_check passes
 *    every 20 replays;
 *  - a slot past its expert's capacity on one rank: tw_context_check returns TW_ERR_CAPACITY on
 *    every rank naming that rank and the capacity; after tw_context_reset the next call equals
 *    the eager one again;
 *  - refusals: a capacity above max_tokens, with the add dataflow; a plan config per call; a
 *    device plan whose static plan an upload replaced; the eager layer under capture;
 *  - the memory holds the static plan (rows_max >= E W C).
 * Prints per configuration the time per call of the eager and the capturable mode (the masking's
 * overhead over the live rows) and per graph replay.
 * Exits 77 without the GPUs it needs.
 */
#include "context.h"
#include "overlap_common.h"

/* Weights uniform bf16 in [-1, 1) times 2^-4 (exact in bf16): projections of hidden 1024 have
 * a spread of about 1. */
static const float kWeightScale = 0.0625f;

typedef struct tw_cap_cfg {
  int experts, hidden, ffn, top_k, max_tokens;
  int capacity; /* tw_context_config.dispatch_capacity */
  int layer;    /* 1: tw_moe_layer; 0: tw_moe_dispatch + tw_moe_combine (hidden == ffn) */
  int iters;
} tw_cap_cfg;

/* One configuration's device buffers and host staging. */
typedef struct tw_cbuf {
  void *x, *ids, *w, *w13, *w2, *out_e, *out_c;
  uint16_t *h_x, *h_e, *h_c, *h_w;
  int64_t* h_ids64;
} tw_cbuf;

static int tw_cbuf_alloc(const tw_problem* p, tw_cbuf* b) {
  memset(b, 0, sizeof *b);
  const size_t E = (size_t)(p->experts / p->world_size), H = (size_t)p->hidden;
  const size_t F = (size_t)p->ffn, K = (size_t)p->top_k, T = (size_t)p->max_tokens;
  const size_t w_elems = E * 2 * F * H > E * H * F ? E * 2 * F * H : E * H * F;
  int ok = cudaMalloc(&b->x, T * H * 2 + 16) == cudaSuccess &&
           cudaMalloc(&b->ids, T * K * 8 + 8) == cudaSuccess &&
           cudaMalloc(&b->w, T * K * 4 + 4) == cudaSuccess &&
           cudaMalloc(&b->w13, E * 2 * F * H * 2) == cudaSuccess &&
           cudaMalloc(&b->w2, E * H * F * 2) == cudaSuccess &&
           cudaMalloc(&b->out_e, T * H * 2 + 16) == cudaSuccess &&
           cudaMalloc(&b->out_c, T * H * 2 + 16) == cudaSuccess;
  b->h_x = (uint16_t*)malloc(T * H * 2 + 16);
  b->h_e = (uint16_t*)malloc(T * H * 2 + 16);
  b->h_c = (uint16_t*)malloc(T * H * 2 + 16);
  b->h_w = (uint16_t*)malloc(w_elems * 2);
  b->h_ids64 = (int64_t*)malloc(T * K * 8 + 8);
  return ok && b->h_x && b->h_e && b->h_c && b->h_w && b->h_ids64;
}

static void tw_cbuf_free(tw_cbuf* b) {
  void* dev[] = {b->x, b->ids, b->w, b->w13, b->w2, b->out_e, b->out_c};
  for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) cudaFree(dev[i]);
  free(b->h_x);
  free(b->h_e);
  free(b->h_c);
  free(b->h_w);
  free(b->h_ids64);
}

/* This rank's local experts' w13 (E, 2F, H) and w2 (E, H, F), seeded by global expert. */
static void tw_cap_weights(tw_rank_env* env, const tw_problem* p, uint64_t salt, tw_cbuf* b) {
  const size_t E = (size_t)(p->experts / p->world_size), H = (size_t)p->hidden;
  const size_t F = (size_t)p->ffn, g0 = (size_t)env->rank * E;
  for (size_t e = 0; e < E; e++)
    for (size_t i = 0; i < 2 * F * H; i++)
      b->h_w[e * 2 * F * H + i] =
          tw_f2bf(kWeightScale * tw_uniform_bf16(salt ^ 0x1313, g0 + e, i / H, i % H));
  CHECK_CUDA(cudaMemcpy(b->w13, b->h_w, E * 2 * F * H * 2, cudaMemcpyHostToDevice));
  for (size_t e = 0; e < E; e++)
    for (size_t i = 0; i < H * F; i++)
      b->h_w[e * H * F + i] =
          tw_f2bf(kWeightScale * tw_uniform_bf16(salt ^ 0x2424, g0 + e, i / F, i % F));
  CHECK_CUDA(cudaMemcpy(b->w2, b->h_w, E * H * F * 2, cudaMemcpyHostToDevice));
}

/* The two contexts of a configuration: eager (dispatch or layer) and capturable. */
static tw_status tw_cap_contexts(tw_rank_env* env, const tw_problem* p, const tw_cap_cfg* c,
                                 int timeout_ms, tw_context_t* eager, tw_context_t* capt) {
  *eager = *capt = NULL;
  tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
  cc.dataflow = TW_DATAFLOW_REDUCE;
  cc.dispatch = 1;
  cc.layer = c->layer;
  cc.timeout_ms = timeout_ms;
  /* Two contexts per rank on one GPU: each takes half of the default share of SMs. */
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess) sms = 0;
  if (env->team != NULL) cc.sm_budget = sms / env->nranks / 2 >= 2 ? sms / env->nranks / 2 : 2;
  tw_status st = tw_rank_context_create(env, p, &cc, eager);
  if (st != TW_SUCCESS) return st;
  cc.dispatch_capacity = c->capacity;
  return tw_rank_context_create_second(env, p, &cc, capt);
}

/* One call of either mode into out: dispatch + combine, or the layer. */
static tw_status tw_cap_call(tw_rank_env* env, tw_context_t ctx, tw_device_plan_t dp,
                             const tw_cap_cfg* c, tw_cbuf* b, int32_t nt, tw_index_type itype,
                             void* out) {
  const void* x = nt > 0 ? b->x : NULL;
  const void* ids = nt > 0 ? b->ids : NULL;
  const float* ws = nt > 0 ? (const float*)b->w : NULL;
  if (c->layer)
    return tw_moe_layer(ctx, dp, x, ids, itype, ws, nt, b->w13, b->w2, nt > 0 ? out : NULL,
                        env->stream);
  void* expert_in = NULL;
  tw_status st = tw_moe_dispatch(ctx, dp, x, ids, itype, ws, nt, &expert_in, env->stream);
  if (st == TW_SUCCESS) st = tw_moe_combine(ctx, dp, expert_in, b->w2, out, env->stream);
  return st;
}

/* A call with out poisoned, checked, then out on the host (n_out elements into host). */
static void tw_cap_checked(tw_rank_env* env, tw_context_t ctx, tw_device_plan_t dp,
                           const tw_cap_cfg* c, tw_cbuf* b, int32_t nt, tw_index_type itype,
                           void* out, uint16_t* host, const char* what) {
  const size_t n_out = (size_t)nt * c->hidden;
  CHECK_OK(tw__fill_bf16(out, n_out + 8, 0xFFFF, env->stream));
  const tw_status st = tw_cap_call(env, ctx, dp, c, b, nt, itype, out);
  CHECKF(st == TW_SUCCESS, "rank %d %s: %s (%s)", env->rank, what, tw_status_string(st),
         tw_last_error());
  CHECK_CUDA(cudaStreamSynchronize(env->stream));
  const tw_status ck = tw_context_check(ctx);
  CHECKF(ck == TW_SUCCESS, "rank %d %s: tw_context_check: %s (%s)", env->rank, what,
         tw_status_string(ck), tw_last_error());
  if (n_out > 0) CHECK_CUDA(cudaMemcpy(host, out, n_out * 2, cudaMemcpyDeviceToHost));
}

/* Capturable against eager on the same inputs: bits equal, every element finite. */
static void tw_cap_compare(tw_rank_env* env, const tw_cbuf* b, size_t n_out, int hidden,
                           const char* what) {
  int nan_seen = 0;
  for (size_t i = 0; i < n_out; i++) nan_seen += !isfinite(tw_bf2f(b->h_c[i]));
  CHECKF(nan_seen == 0, "rank %d %s: %d output elements of the capturable call not finite",
         env->rank, what, nan_seen);
  size_t first = n_out;
  for (size_t i = 0; i < n_out && first == n_out; i++)
    if (b->h_c[i] != b->h_e[i]) first = i;
  CHECKF(first == n_out,
         "rank %d %s: the capturable call differs from the eager one (first at token %zu, "
         "column %zu: %04x vs %04x)",
         env->rank, what, first / (size_t)hidden, first % (size_t)hidden,
         first < n_out ? b->h_c[first] : 0, first < n_out ? b->h_e[first] : 0);
}

/* Mean time per call of `reps` calls of one mode on the same inputs, us. */
static double tw_cap_time(tw_rank_env* env, tw_context_t ctx, tw_device_plan_t dp,
                          const tw_cap_cfg* c, tw_cbuf* b, int32_t nt, void* out, int reps) {
  CHECK_CUDA(cudaStreamSynchronize(env->stream));
  (void)tw_rank_sum(env, 0); /* start together */
  const double t0 = tw__now_seconds();
  for (int i = 0; i < reps; i++) CHECK_OK(tw_cap_call(env, ctx, dp, c, b, nt, TW_INDEX_INT32, out));
  CHECK_CUDA(cudaStreamSynchronize(env->stream));
  const double us = (tw__now_seconds() - t0) * 1e6 / reps;
  CHECK_OK(tw_context_check(ctx));
  return us;
}

/* Routing `it` of a configuration: token counts changing (all full, one rank empty, one rank 1
 * token, odd counts, all empty, all 1 token), routers in turn. */
static tw_status tw_cap_routing(const tw_problem* p, int it, uint64_t seed, int32_t* tokens,
                                tw_routing_t* rt) {
  tw_token_counts(it, p->world_size, p->max_tokens, seed, tokens);
  for (int r = 0; r < p->world_size; r++) {
    if (it == 4) tokens[r] = (tokens[r] | 1) <= p->max_tokens ? tokens[r] | 1 : p->max_tokens;
    if (it == 5) tokens[r] = 0;
    if (it == 6) tokens[r] = 1;
  }
  const tw_router router = it % 3 == 0   ? TW_ROUTER_BALANCED
                           : it % 3 == 1 ? TW_ROUTER_MODERATE_SKEW
                                         : TW_ROUTER_STRESS_SKEW;
  return tw_make_routing(p, router, tokens, seed, rt);
}

/* A CUDA graph of one capturable call (tokens[rank] tokens), replayed `replays` times with a new
 * routing of the same token counts each time, against an eager call on the same inputs. */
static void tw_cap_graph(tw_rank_env* env, const tw_problem* p, const tw_cap_cfg* c,
                         tw_context_t ce, tw_device_plan_t de, tw_context_t cg, tw_device_plan_t dg,
                         tw_cbuf* b, int replays) {
  int32_t tokens[TW_MAX_RANKS];
  for (int r = 0; r < env->nranks; r++) tokens[r] = p->max_tokens - 1 - r % 3;
  const int32_t nt = tokens[env->rank];
  const size_t n_out = (size_t)nt * c->hidden;
  /* The layer under capture on the eager context: refused, and the capture is still good. */
  cudaGraph_t graph = NULL;
  cudaGraphExec_t exec = NULL;
  CHECK_CUDA(cudaStreamBeginCapture(env->stream, cudaStreamCaptureModeThreadLocal));
  if (c->layer)
    CHECK_STATUS(tw_moe_layer(ce, de, b->x, b->ids, TW_INDEX_INT32, (const float*)b->w, nt, b->w13,
                              b->w2, b->out_e, env->stream),
                 TW_ERR_UNSUPPORTED);
  const tw_status st = tw_cap_call(env, cg, dg, c, b, nt, TW_INDEX_INT32, b->out_c);
  CHECKF(st == TW_SUCCESS, "rank %d: capture: %s (%s)", env->rank, tw_status_string(st),
         tw_last_error());
  CHECK_CUDA(cudaStreamEndCapture(env->stream, &graph));
  if (graph != NULL && st == TW_SUCCESS) {
    CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    /* Every rank's graph is on the device before any rank launches one (tilewave.h, rule 4). */
    if (exec != NULL) CHECK_CUDA(cudaGraphUpload(exec, env->stream));
    CHECK_CUDA(cudaStreamSynchronize(env->stream));
  }
  (void)tw_rank_sum(env, 0); /* a barrier */
  int wrong = 0;
  double replay_s = 0.0;
  for (int i = 0; i < replays && exec != NULL; i++) {
    tw_routing_t rt = NULL;
    const uint64_t seed = 7000 + (uint64_t)i * 31;
    const tw_router router = i % 3 == 0 ? TW_ROUTER_STRESS_SKEW : TW_ROUTER_BALANCED;
    CHECK_OK(tw_make_routing(p, router, tokens, seed, &rt));
    if (rt == NULL) break;
    /* New inputs into the graph's buffers, in the stream's order (synchronous copies). */
    tw_upload_routed_inputs(env, p, rt, seed ^ 0xabc, 0, b->h_x, b->h_ids64, b->x, b->ids, b->w);
    CHECK_OK(tw__fill_bf16(b->out_c, n_out + 8, 0xFFFF, env->stream));
    CHECK_CUDA(cudaStreamSynchronize(env->stream));
    const double t0 = tw__now_seconds();
    CHECK_CUDA(cudaGraphLaunch(exec, env->stream));
    CHECK_CUDA(cudaStreamSynchronize(env->stream));
    replay_s += tw__now_seconds() - t0;
    if (n_out > 0) CHECK_CUDA(cudaMemcpy(b->h_c, b->out_c, n_out * 2, cudaMemcpyDeviceToHost));
    if (i % 20 == 19) CHECK_OK(tw_context_check(cg));
    tw_cap_checked(env, ce, de, c, b, nt, TW_INDEX_INT32, b->out_e, b->h_e,
                   "eager beside a replay");
    int diff = 0;
    for (size_t k = 0; k < n_out; k++) diff |= b->h_c[k] != b->h_e[k];
    wrong += diff;
    tw_routing_destroy(rt);
  }
  CHECKF(wrong == 0, "rank %d: %d of %d replays differ from the eager calls", env->rank, wrong,
         replays);
  CHECK_OK(tw_context_check(cg));
  /* An eager capturable call after the replays continues the sequence. */
  tw_cap_checked(env, cg, dg, c, b, nt, TW_INDEX_INT32, b->out_c, b->h_c, "eager after replays");
  tw_cap_compare(env, b, n_out, c->hidden, "eager after replays");
  if (env->rank == 0 && exec != NULL)
    printf("  graph of the %s: %d replays, %.1f us per replay (launch to synchronised)\n",
           c->layer ? "layer" : "dispatch + combine", replays, replay_s * 1e6 / replays);
  if (exec != NULL) cudaGraphExecDestroy(exec);
  if (graph != NULL) cudaGraphDestroy(graph);
}

static void tw_run_cap_cfg(tw_rank_env* env, const tw_cap_cfg* c, int ci) {
  tw_problem p = tw_rank_problem(env, c->hidden, c->ffn, c->experts, c->top_k, c->max_tokens);
  CHECK_OK(tw_problem_validate(&p));
  tw_context_t ce = NULL, cg = NULL;
  CHECK_OK(tw_cap_contexts(env, &p, c, 0, &ce, &cg));
  tw_device_plan_t de = NULL, dg = NULL;
  if (ce != NULL) CHECK_OK(tw_device_plan_create(ce, &de));
  if (cg != NULL) CHECK_OK(tw_device_plan_create(cg, &dg));
  tw_cbuf b;
  const int ok = tw_cbuf_alloc(&p, &b) && de != NULL && dg != NULL;
  CHECK(ok);
  if (ok) {
    tw_cap_weights(env, &p, 300 + (uint64_t)ci, &b);
    /* The static plan fits: E W C rows. */
    tw_context_memory m = TW_CONTEXT_MEMORY_INIT;
    CHECK_OK(tw_context_memory_get(cg, &m));
    const int64_t E = p.experts / p.world_size, C = (c->capacity + 127) / 128 * 128;
    CHECKF(m.rows_max >= E * p.world_size * C, "rank %d: rows_max %lld below E W C = %lld",
           env->rank, (long long)m.rows_max, (long long)(E * p.world_size * C));
    tw_plan_summary s;
    CHECK_OK(tw_device_plan_summary_get(dg, &s));
    CHECK(s.rows == E * p.world_size * C);
    if (env->rank == 0)
      printf(
          "  cfg %d (%s, E %d H %d F %d k %d, tokens <= %d, capacity %d): capturable context "
          "%.2f MiB per rank, static plan %lld rows, %lld tiles\n",
          ci, c->layer ? "layer" : "dispatch + combine", p.experts, p.hidden, p.ffn, p.top_k,
          p.max_tokens, c->capacity, m.total_bytes / 1048576.0, (long long)s.rows,
          (long long)s.tiles);
  }
  for (int it = 0; ok && it < c->iters; it++) {
    int32_t tokens[TW_MAX_RANKS];
    tw_routing_t rt = NULL;
    const uint64_t seed = 4000 + (uint64_t)ci * 100 + (uint64_t)it;
    CHECK_OK(tw_cap_routing(&p, it, seed, tokens, &rt));
    if (rt == NULL) break;
    const int id64 = it % 2;
    const tw_index_type itype = id64 ? TW_INDEX_INT64 : TW_INDEX_INT32;
    tw_upload_routed_inputs(env, &p, rt, seed * 3 + 1, id64, b.h_x, b.h_ids64, b.x, b.ids, b.w);
    const int32_t nt = tokens[env->rank];
    char what[64];
    snprintf(what, sizeof what, "cfg %d iter %d (%d tokens)", ci, it, nt);
    tw_cap_checked(env, ce, de, c, &b, nt, itype, b.out_e, b.h_e, what);
    tw_cap_checked(env, cg, dg, c, &b, nt, itype, b.out_c, b.h_c, what);
    tw_cap_compare(env, &b, (size_t)nt * c->hidden, c->hidden, what);
    /* Twice in a row on the capturable context: the mask of the previous call never leaks. */
    tw_cap_checked(env, cg, dg, c, &b, nt, itype, b.out_c, b.h_c, what);
    tw_cap_compare(env, &b, (size_t)nt * c->hidden, c->hidden, what);
    tw_routing_destroy(rt);
  }
  /* Time per call on full token counts (balanced): eager (its host round trip included) and
   * capturable (its masks included). */
  if (ok) {
    int32_t tokens[TW_MAX_RANKS];
    for (int r = 0; r < env->nranks; r++) tokens[r] = p.max_tokens;
    tw_routing_t rt = NULL;
    CHECK_OK(tw_make_routing(&p, TW_ROUTER_BALANCED, tokens, 99, &rt));
    if (rt != NULL) {
      tw_upload_routed_inputs(env, &p, rt, 98, 0, b.h_x, b.h_ids64, b.x, b.ids, b.w);
      const int reps = 20;
      (void)tw_cap_time(env, ce, de, c, &b, p.max_tokens, b.out_e, 2);
      const double te = tw_cap_time(env, ce, de, c, &b, p.max_tokens, b.out_e, reps);
      (void)tw_cap_time(env, cg, dg, c, &b, p.max_tokens, b.out_c, 2);
      const double tc = tw_cap_time(env, cg, dg, c, &b, p.max_tokens, b.out_c, reps);
      if (env->rank == 0)
        printf(
            "  cfg %d time per call, %d tokens per rank: eager %.1f us, capturable %.1f us "
            "(%.2fx)\n",
            ci, p.max_tokens, te, tc, te > 0 ? tc / te : 0.0);
      tw_routing_destroy(rt);
    }
    tw_cap_graph(env, &p, c, ce, de, cg, dg, &b, 60);
  }
  tw_cbuf_free(&b);
  CHECK_OK(tw_device_plan_destroy(de));
  CHECK_OK(tw_device_plan_destroy(dg));
  CHECK_OK(tw_context_destroy(ce));
  CHECK_OK(tw_context_destroy(cg));
}

/* Dispatch + combine: hidden == ffn. Capacity max_tokens (no routing overflows), rounded to
 * 2 bands per group at 256 tokens, so most groups end in a partial band and many bands are
 * empty. */
static void test_dispatch_combine_matches_eager(tw_rank_env* env) {
  static const tw_cap_cfg cfgs[] = {
      {8, 1024, 1024, 2, 256, 256, 0, 8},
      {16, 2048, 2048, 4, 96, 96, 0, 7},
  };
  for (int i = 0; i < (int)(sizeof cfgs / sizeof cfgs[0]); i++) tw_run_cap_cfg(env, &cfgs[i], i);
}

static void test_layer_matches_eager(tw_rank_env* env) {
  static const tw_cap_cfg cfgs[] = {
      {8, 1024, 512, 2, 256, 256, 1, 8},
      {16, 2048, 768, 2, 160, 160, 1, 7},
  };
  for (int i = 0; i < (int)(sizeof cfgs / sizeof cfgs[0]); i++)
    tw_run_cap_cfg(env, &cfgs[i], 10 + i);
}

/* Rank `culprit` routes every token to experts 0 and 1: 256 rows for each from one source,
 * above a capacity of 128. The call is enqueued everywhere; tw_context_check reports the
 * overflow on every rank; after a reset the next call is right again. */
static void test_capacity_overflow(tw_rank_env* env) {
  const tw_cap_cfg c = {8, 1024, 512, 2, 256, 128, 1, 0};
  tw_problem p = tw_rank_problem(env, c.hidden, c.ffn, c.experts, c.top_k, c.max_tokens);
  tw_context_t ce = NULL, cg = NULL;
  CHECK_OK(tw_cap_contexts(env, &p, &c, 1000, &ce, &cg));
  tw_device_plan_t de = NULL, dg = NULL;
  if (ce != NULL) CHECK_OK(tw_device_plan_create(ce, &de));
  if (cg != NULL) CHECK_OK(tw_device_plan_create(cg, &dg));
  tw_cbuf b;
  const int ok = tw_cbuf_alloc(&p, &b) && de != NULL && dg != NULL;
  CHECK(ok);
  const int culprit = env->nranks - 1, T = p.max_tokens, K = p.top_k;
  int32_t tokens[TW_MAX_RANKS];
  for (int r = 0; r < env->nranks; r++) tokens[r] = T;
  tw_routing_t rt = NULL;
  CHECK_OK(tw_make_routing(&p, TW_ROUTER_BALANCED, tokens, 55, &rt));
  if (ok && rt != NULL) {
    tw_cap_weights(env, &p, 56, &b);
    for (int round = 0; round < 2; round++) {
      tw_upload_routed_inputs(env, &p, rt, 57, 0, b.h_x, b.h_ids64, b.x, b.ids, b.w);
      if (env->rank == culprit) {
        int32_t* ids = (int32_t*)malloc((size_t)T * K * 4);
        for (int t = 0; t < T; t++)
          for (int j = 0; j < K; j++) ids[t * K + j] = j;
        CHECK_CUDA(cudaMemcpy(b.ids, ids, (size_t)T * K * 4, cudaMemcpyHostToDevice));
        free(ids);
      }
      /* Enqueued (its combine half may already see the failed dispatch on the culprit). */
      const tw_status st = tw_cap_call(env, cg, dg, &c, &b, T, TW_INDEX_INT32, b.out_c);
      CHECKF(st == TW_SUCCESS || (env->rank == culprit && st == TW_ERR_CAPACITY),
             "rank %d: the overflowing call: %s (%s)", env->rank, tw_status_string(st),
             tw_last_error());
      CHECK_CUDA(cudaStreamSynchronize(env->stream));
      const tw_status ck = tw_context_check(cg);
      char needle[32];
      snprintf(needle, sizeof needle, "rank %d", culprit);
      CHECKF(ck == TW_ERR_CAPACITY && strstr(tw_last_error(), needle) != NULL &&
                 strstr(tw_last_error(), "capacity of 128") != NULL,
             "rank %d round %d: tw_context_check gave %s (%s), expected TW_ERR_CAPACITY naming "
             "rank %d and the capacity",
             env->rank, round, tw_status_string(ck), tw_last_error(), culprit);
      /* Refused until reset, then right again. */
      CHECK_STATUS(tw_cap_call(env, cg, dg, &c, &b, T, TW_INDEX_INT32, b.out_c), TW_ERR_STATE);
      CHECK_OK(tw_context_reset(cg));
      tw_upload_routed_inputs(env, &p, rt, 58 + (uint64_t)round, 0, b.h_x, b.h_ids64, b.x, b.ids,
                              b.w);
      tw_cap_checked(env, ce, de, &c, &b, T, TW_INDEX_INT32, b.out_e, b.h_e, "eager after reset");
      tw_cap_checked(env, cg, dg, &c, &b, T, TW_INDEX_INT32, b.out_c, b.h_c, "after the reset");
      tw_cap_compare(env, &b, (size_t)T * c.hidden, c.hidden, "after the reset");
    }
  }
  tw_routing_destroy(rt);
  tw_cbuf_free(&b);
  CHECK_OK(tw_device_plan_destroy(de));
  CHECK_OK(tw_device_plan_destroy(dg));
  CHECK_OK(tw_context_destroy(ce));
  CHECK_OK(tw_context_destroy(cg));
}

/* What the capturable mode refuses, each before anything is enqueued, on every rank alike. */
static void test_refusals(tw_rank_env* env) {
  tw_problem p = tw_rank_problem(env, 1024, 512, 8, 2, 64);
  tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
  tw_context_t ctx = NULL;
  cc.dataflow = TW_DATAFLOW_REDUCE;
  cc.dispatch_capacity = p.max_tokens + 1;
  CHECK_STATUS(tw_rank_context_create(env, &p, &cc, &ctx), TW_ERR_INVALID_ARGUMENT);
  CHECK(strstr(tw_last_error(), "dispatch_capacity") != NULL);
  cc.dispatch_capacity = 64;
  cc.dataflow = TW_DATAFLOW_ADD;
  CHECK_STATUS(tw_rank_context_create(env, &p, &cc, &ctx), TW_ERR_UNSUPPORTED);
  CHECK(ctx == NULL);
  cc.dataflow = TW_DATAFLOW_REDUCE;
  cc.layer = 1;
  CHECK_OK(tw_rank_context_create(env, &p, &cc, &ctx));
  if (ctx == NULL) return;
  tw_device_plan_t dp = NULL;
  CHECK_OK(tw_device_plan_create(ctx, &dp));
  /* Weights of the documented shapes (never read: no token anywhere). */
  void* w = NULL;
  CHECK_CUDA(cudaMalloc(&w, (size_t)(p.experts / p.world_size) * 2 * p.ffn * p.hidden * 2));
  tw_plan_config pc = TW_PLAN_CONFIG_INIT;
  tw_layer_options lo = TW_LAYER_OPTIONS_INIT;
  lo.plan_config = &pc;
  CHECK_STATUS(
      tw_moe_layer_ex(ctx, dp, NULL, NULL, TW_INDEX_INT32, NULL, 0, w, w, NULL, &lo, env->stream),
      TW_ERR_UNSUPPORTED);
  tw_dispatch_options dop = TW_DISPATCH_OPTIONS_INIT;
  dop.plan_config = &pc;
  CHECK_STATUS(
      tw_moe_dispatch_ex(ctx, dp, NULL, NULL, TW_INDEX_INT32, NULL, 0, NULL, &dop, env->stream),
      TW_ERR_UNSUPPORTED);
  /* Nothing enqueued: a call with no tokens anywhere runs and checks. */
  CHECK_OK(tw_moe_layer(ctx, dp, NULL, NULL, TW_INDEX_INT32, NULL, 0, w, w, NULL, env->stream));
  CHECK_CUDA(cudaStreamSynchronize(env->stream));
  CHECK_OK(tw_context_check(ctx));
  /* An upload replaces the static plan: the capturable dispatch refuses that device plan. */
  int32_t tokens[TW_MAX_RANKS];
  for (int r = 0; r < env->nranks; r++) tokens[r] = 4;
  tw_routing_t rt = NULL;
  tw_plan_t plan = NULL;
  CHECK_OK(tw_make_routing(&p, TW_ROUTER_BALANCED, tokens, 5, &rt));
  if (rt != NULL) CHECK_OK(tw_plan_create(&p, rt, env->rank, NULL, &plan));
  if (plan != NULL) {
    CHECK_OK(tw_device_plan_upload(dp, plan, rt, env->stream));
    CHECK_STATUS(
        tw_moe_layer(ctx, dp, NULL, NULL, TW_INDEX_INT32, NULL, 0, w, w, NULL, env->stream),
        TW_ERR_STATE);
    CHECK(strstr(tw_last_error(), "static plan") != NULL);
  }
  CHECK_CUDA(cudaStreamSynchronize(env->stream));
  tw_plan_destroy(plan);
  tw_routing_destroy(rt);
  cudaFree(w);
  CHECK_OK(tw_device_plan_destroy(dp));
  CHECK_OK(tw_context_destroy(ctx));
}

static const tw_rank_case kCases[] = {
    {"dispatch_combine_matches_eager", test_dispatch_combine_matches_eager},
    {"layer_matches_eager", test_layer_matches_eager},
    {"capacity_overflow", test_capacity_overflow},
    {"refusals", test_refusals},
};

int main(int argc, char** argv) {
  return tw_rank_test_main(argc, argv, kCases, (int)(sizeof kCases / sizeof kCases[0]), 900);
}
