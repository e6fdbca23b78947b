/*
 * test_trace.cu: a traced call (tw__context_trace, src/core/trace.h) computes exactly what an
 * untraced one does, and its records account for the plan's work exactly once:
 *  - every tile of the plan has one begin and one publish, on CTA t mod P, begin before publish;
 *  - every transfer unit has one claim, one band-ready and one copy record, on one CTA, in that
 *    order, at most one credit record; the announcements add up to the units; each of the C
 *    consumer CTAs ends once;
 *  - every reduction CTA of the launch begins, sees its arrivals and ends once (reduce dataflow);
 *  - a full buffer keeps `capacity` records and counts the rest as dropped (the output still
 *    identical); a call captured in a CUDA graph is not traced; tracing off again leaves the
 *    buffer alone.
 * Both consumer copy modes and both dataflows. A whole layer call (tw_moe_layer: dispatch, GEMM1 +
 * SwiGLU, GEMM2 + combine) traced gives the untraced out and h bit for bit, and its records
 * account for every kernel's work exactly once:
 *  - the dispatch: each scan CTA begins and ends once per pass (count, place; the same CTAs in
 *    both), each copy CTA begins, ends its credit wait and ends once, in that order, their rows
 *    adding up to the rank's slots, one release of the arrivals (index W); the wait kernel begins
 *    once and sees every source once;
 *  - every GEMM1 tile of the uploaded list begins and is stored once, on CTA t mod its grid;
 *  - the combine's records as above;
 *  - stream order holds between the kernels: the place pass before the copy, every source's rows
 *    before GEMM1's first tile, GEMM1's last tile before GEMM2's first.
 * Two ranks on two GPUs over NCCL, or --in-process W on one GPU (W = 1 too); exits 77 without
 * the GPUs, or in a build whose trace hooks are compiled out (-DTW_TRACE_HOOKS=OFF).
 */
#include "overlap_common.h"

typedef struct tw_tr_fixture {
  tw_problem p;
  tw_context_t ctx;
  tw_device_plan_t dp;
  tw_routing_t rt;
  tw_plan_t plan;
  void *expert_in, *w2, *out;
  uint16_t *ref, *now;
  size_t n_out;
  int add;
  int32_t tiles, units;
} tw_tr_fixture;

static int tw_tr_init(tw_rank_env* env, tw_tr_fixture* fx, int copy, int dataflow) {
  memset(fx, 0, sizeof *fx);
  const tw_problem p = tw_rank_problem(env, 1024, 512, 8, 2, 256);
  fx->p = p;
  fx->add = dataflow == TW_DATAFLOW_ADD;
  tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
  cc.consumer_copy = copy;
  cc.dataflow = dataflow;
  CHECK_OK(tw_rank_context_create(env, &p, &cc, &fx->ctx));
  if (fx->ctx == NULL) return 0;
  CHECK_OK(tw_device_plan_create(fx->ctx, &fx->dp));
  int32_t tokens[TW_MAX_RANKS];
  for (int r = 0; r < env->nranks; r++) tokens[r] = p.max_tokens;
  CHECK_OK(tw_make_routing(&p, TW_ROUTER_MODERATE_SKEW, tokens, 4242, &fx->rt));
  tw_plan_config pc = TW_PLAN_CONFIG_INIT;
  pc.comm_ctas = 4;
  pc.coalesce = 2;
  pc.dataflow = dataflow;
  CHECK_OK(tw_plan_create(&p, fx->rt, env->rank, &pc, &fx->plan));
  if (fx->dp == NULL || fx->plan == NULL) return 0;
  const int E = p.experts / p.world_size;
  fx->n_out = (size_t)p.max_tokens * p.hidden;
  uint16_t* in = (uint16_t*)malloc((size_t)fx->plan->rows * p.ffn * 2 + 2);
  uint16_t* w2 = (uint16_t*)malloc((size_t)E * p.hidden * p.ffn * 2);
  tw_fill_expert_in(fx->plan, 21, in);
  tw_fill_w2(&p, env->rank, 22, w2);
  CHECK_CUDA(cudaMalloc(&fx->expert_in, (size_t)fx->plan->rows * p.ffn * 2 + 16));
  CHECK_CUDA(cudaMalloc(&fx->w2, (size_t)E * p.hidden * p.ffn * 2));
  CHECK_CUDA(cudaMalloc(&fx->out, fx->n_out * 2));
  CHECK_CUDA(
      cudaMemcpy(fx->expert_in, in, (size_t)fx->plan->rows * p.ffn * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(fx->w2, w2, (size_t)E * p.hidden * p.ffn * 2, cudaMemcpyHostToDevice));
  free(in);
  free(w2);
  CHECK_OK(tw_device_plan_upload(fx->dp, fx->plan, fx->rt, env->stream));
  CHECK_OK(tw__device_plan_work(fx->dp, &fx->tiles, &fx->units));
  fx->ref = (uint16_t*)malloc(fx->n_out * 2);
  /* Pinned: replays are read back with a copy queued behind them (docs/runtime.md, graphs). */
  if (cudaMallocHost((void**)&fx->now, fx->n_out * 2) != cudaSuccess) fx->now = NULL;
  return fx->ref != NULL && fx->now != NULL;
}

static void tw_tr_free(tw_tr_fixture* fx) {
  cudaFree(fx->expert_in);
  cudaFree(fx->w2);
  cudaFree(fx->out);
  free(fx->ref);
  cudaFreeHost(fx->now);
  tw_plan_destroy(fx->plan);
  tw_routing_destroy(fx->rt);
  CHECK_OK(tw_device_plan_destroy(fx->dp));
  CHECK_OK(tw_context_destroy(fx->ctx));
}

/* One call (output poisoned first), checked on every rank; its output to `host`. */
static void tw_tr_call(tw_rank_env* env, tw_tr_fixture* fx, uint16_t* host) {
  if (!fx->add) CHECK_OK(tw__fill_bf16(fx->out, fx->n_out, 0xFFFF, env->stream));
  CHECK_OK(tw_moe_combine(fx->ctx, fx->dp, fx->expert_in, fx->w2, fx->add ? NULL : fx->out,
                          env->stream));
  CHECK_OK(tw_context_check(fx->ctx));
  void* src = fx->out;
  if (fx->add) CHECK_OK(tw_context_output(fx->ctx, &src));
  CHECK_CUDA(cudaMemcpy(host, src, fx->n_out * 2, cudaMemcpyDeviceToHost));
}

/* Counts records of `kind` per index in [0, n): count[i], and the CTA of the last one. */
static void tw_tr_count(const tw_trace_record* rec, int64_t nrec, int kind, int64_t n, int* count,
                        int* cta, uint64_t* ns) {
  memset(count, 0, sizeof(int) * (size_t)n);
  for (int64_t i = 0; i < nrec; i++) {
    if (rec[i].kind != kind || rec[i].index >= (uint64_t)n) continue;
    count[rec[i].index]++;
    cta[rec[i].index] = rec[i].cta;
    ns[rec[i].index] = rec[i].ns;
  }
}

/* The records of one traced call against the plan and the launch. */
static void tw_tr_check_records(tw_rank_env* env, const tw_tr_fixture* fx,
                                const tw_trace_record* rec, int64_t n) {
  tw__launch_record l;
  CHECK_OK(tw__context_last_launch(fx->ctx, &l));
  const int64_t T = fx->tiles, U = fx->units;
  const int64_t M = (T > U ? T : U) + l.reduce_ctas + 64;
  int *c1 = (int*)calloc((size_t)M, sizeof(int)), *c2 = (int*)calloc((size_t)M, sizeof(int));
  int *k1 = (int*)calloc((size_t)M, sizeof(int)), *k2 = (int*)calloc((size_t)M, sizeof(int));
  uint64_t *t1 = (uint64_t*)calloc((size_t)M, 8), *t2 = (uint64_t*)calloc((size_t)M, 8);
  int *c3 = (int*)calloc((size_t)M, sizeof(int)), *k3 = (int*)calloc((size_t)M, sizeof(int));
  uint64_t* t3 = (uint64_t*)calloc((size_t)M, 8);
  if (!c1 || !c2 || !k1 || !k2 || !t1 || !t2 || !c3 || !k3 || !t3) {
    CHECK(!"host memory");
    goto done;
  }
  for (int64_t i = 0; i < n; i++)
    CHECKF(rec[i].kind >= TW_TRACE_TILE_BEGIN && rec[i].kind < TW_TRACE_KIND_COUNT,
           "record %lld has kind %d", (long long)i, rec[i].kind);
  {
    /* Tiles: one begin and one publish each, on CTA t mod P, in order. */
    const int64_t grid = l.producer_ctas < T ? l.producer_ctas : T;
    tw_tr_count(rec, n, TW_TRACE_TILE_BEGIN, T, c1, k1, t1);
    tw_tr_count(rec, n, TW_TRACE_TILE_PUBLISH, T, c2, k2, t2);
    int bad = 0;
    for (int64_t t = 0; t < T; t++) {
      const int ok =
          c1[t] == 1 && c2[t] == 1 && k1[t] == k2[t] && k1[t] == t % grid && t1[t] <= t2[t];
      if (!ok && bad++ < 5)
        fprintf(stderr, "  rank %d tile %lld: %d begins, %d publishes, CTAs %d/%d (P %lld)\n",
                env->rank, (long long)t, c1[t], c2[t], k1[t], k2[t], (long long)grid);
    }
    CHECKF(bad == 0, "rank %d: %d of %lld tiles not traced exactly once", env->rank, bad,
           (long long)T);
  }
  {
    /* Units: one claim, bands and copy each on one consumer CTA, in order; credits at most one. */
    tw_tr_count(rec, n, TW_TRACE_UNIT_CLAIM, U, c1, k1, t1);
    tw_tr_count(rec, n, TW_TRACE_UNIT_BANDS, U, c2, k2, t2);
    tw_tr_count(rec, n, TW_TRACE_UNIT_COPY, U, c3, k3, t3);
    int bad = 0;
    for (int64_t u = 0; u < U; u++) {
      const int ok = c1[u] == 1 && c2[u] == 1 && c3[u] == 1 && k1[u] == k2[u] && k2[u] == k3[u] &&
                     k1[u] < l.consumer_ctas && t1[u] <= t2[u] && t2[u] <= t3[u];
      if (!ok && bad++ < 5)
        fprintf(stderr, "  rank %d unit %lld: %d claims, %d bands, %d copies, CTAs %d/%d/%d\n",
                env->rank, (long long)u, c1[u], c2[u], c3[u], k1[u], k2[u], k3[u]);
    }
    CHECKF(bad == 0, "rank %d: %d of %lld units not traced exactly once", env->rank, bad,
           (long long)U);
    tw_tr_count(rec, n, TW_TRACE_UNIT_CREDIT, U, c1, k1, t1);
    int credits = 0;
    for (int64_t u = 0; u < U; u++) {
      CHECK(c1[u] <= 1);
      credits += c1[u];
    }
    /* A CTA waits for an owner's credit once, before its first unit to that owner. */
    CHECK(credits <= l.consumer_ctas * env->nranks);
    CHECK(U == 0 || credits >= 1);
    int64_t announced = 0;
    for (int64_t i = 0; i < n; i++)
      if (rec[i].kind == TW_TRACE_ANNOUNCE) {
        announced += rec[i].index >> 8;
        CHECK((int)(rec[i].index & 0xFF) != env->rank && (int)(rec[i].index & 0xFF) < env->nranks);
      }
    CHECKF(announced == U, "rank %d: %lld units announced, the plan has %lld", env->rank,
           (long long)announced, (long long)U);
    /* Consumer CTAs end once each. */
    tw_tr_count(rec, n, TW_TRACE_CONSUMER_END, l.consumer_ctas, c1, k1, t1);
    memset(c2, 0, sizeof(int) * (size_t)M);
    for (int64_t i = 0; i < n; i++)
      if (rec[i].kind == TW_TRACE_CONSUMER_END && rec[i].cta < l.consumer_ctas) c2[rec[i].cta]++;
    for (int c = 0; c < l.consumer_ctas; c++)
      CHECKF(c2[c] == 1, "consumer CTA %d: %d ends", c, c2[c]);
  }
  {
    /* Reduction CTAs: begin, arrivals, end once each (none under the add dataflow). */
    int r[3] = {0, 0, 0}, bad = 0;
    for (int k = 0; k < 3; k++) {
      memset(c1, 0, sizeof(int) * (size_t)M);
      for (int64_t i = 0; i < n; i++)
        if (rec[i].kind == TW_TRACE_REDUCE_BEGIN + k) {
          r[k]++;
          if (rec[i].cta < M) c1[rec[i].cta]++;
        }
      for (int c = 0; c < l.reduce_ctas; c++) bad += c1[c] != 1;
    }
    CHECKF(bad == 0 && r[0] == l.reduce_ctas && r[1] == l.reduce_ctas && r[2] == l.reduce_ctas,
           "rank %d: reduction records %d/%d/%d for %d CTAs", env->rank, r[0], r[1], r[2],
           l.reduce_ctas);
    CHECK(fx->add ? l.reduce_ctas == 0 : l.reduce_ctas >= 1);
  }
done:
  free(c1), free(c2), free(c3), free(k1), free(k2), free(k3), free(t1), free(t2), free(t3);
}

static void tw_tr_round(tw_rank_env* env, int copy, int dataflow) {
  tw_tr_fixture fx;
  if (tw_tr_init(env, &fx, copy, dataflow)) {
    tw_tr_call(env, &fx, fx.ref); /* untraced */
    const int64_t cap = 1 << 16;
    CHECK_OK(tw__context_trace(fx.ctx, cap));
    CHECK_OK(tw__context_trace_clear(fx.ctx, env->stream));
    tw_tr_call(env, &fx, fx.now); /* traced */
    CHECKF(memcmp(fx.ref, fx.now, fx.n_out * 2) == 0,
           "rank %d: the traced call's output differs from the untraced one", env->rank);
    tw_trace_record* rec = (tw_trace_record*)malloc(sizeof(tw_trace_record) * (size_t)cap);
    int64_t n = 0, dropped = -1;
    CHECK_OK(tw__context_trace_read(fx.ctx, rec, cap, &n, &dropped));
    CHECK(dropped == 0);
    CHECKF(n >= 2 * (int64_t)fx.tiles + 3 * (int64_t)fx.units, "rank %d: %lld records", env->rank,
           (long long)n);
    if (rec) tw_tr_check_records(env, &fx, rec, n);
    if (env->rank == 0)
      printf("  copy %d, dataflow %d: %d tiles, %d units, %lld records\n", copy, dataflow, fx.tiles,
             fx.units, (long long)n);

    /* A second traced call after a clear: the same records again, exactly once. */
    CHECK_OK(tw__context_trace_clear(fx.ctx, env->stream));
    tw_tr_call(env, &fx, fx.now);
    CHECK(memcmp(fx.ref, fx.now, fx.n_out * 2) == 0);
    CHECK_OK(tw__context_trace_read(fx.ctx, rec, cap, &n, &dropped));
    if (rec) tw_tr_check_records(env, &fx, rec, n);

    /* Full buffer: capacity records kept, the rest counted, the output unchanged. */
    CHECK_OK(tw__context_trace(fx.ctx, 5));
    tw_tr_call(env, &fx, fx.now);
    CHECK(memcmp(fx.ref, fx.now, fx.n_out * 2) == 0);
    int64_t n5 = -1, dropped5 = -1;
    CHECK_OK(tw__context_trace_read(fx.ctx, rec, cap, &n5, &dropped5));
    /* (A call's count varies a little: announcements and credit waits follow the claims.) */
    const int64_t least = 2 * (int64_t)fx.tiles + 3 * (int64_t)fx.units;
    CHECKF(n5 == 5 && n5 + dropped5 >= least, "rank %d: kept %lld, dropped %lld, at least %lld",
           env->rank, (long long)n5, (long long)dropped5, (long long)least);
    for (int64_t i = 0; rec && i < n5; i++)
      CHECK(rec[i].kind >= TW_TRACE_TILE_BEGIN && rec[i].kind < TW_TRACE_KIND_COUNT);

    /* Off: calls no longer write; reading says so. */
    CHECK_OK(tw__context_trace(fx.ctx, 0));
    tw_tr_call(env, &fx, fx.now);
    CHECK(memcmp(fx.ref, fx.now, fx.n_out * 2) == 0);
    CHECK_STATUS(tw__context_trace_read(fx.ctx, rec, cap, &n, &dropped), TW_ERR_STATE);
    CHECK_STATUS(tw__context_trace_clear(fx.ctx, env->stream), TW_ERR_STATE);
    free(rec);
  }
  tw_tr_free(&fx);
}

static void test_traced_call_identical_and_complete(tw_rank_env* env) {
  tw_tr_round(env, TW_CONSUMER_COPY_BULK, TW_DATAFLOW_REDUCE);
  tw_tr_round(env, TW_CONSUMER_COPY_REGISTERS, TW_DATAFLOW_REDUCE);
}

static void test_traced_call_add_dataflow(tw_rank_env* env) {
  tw_tr_round(env, TW_CONSUMER_COPY_BULK, TW_DATAFLOW_ADD);
  tw_tr_round(env, TW_CONSUMER_COPY_REGISTERS, TW_DATAFLOW_ADD);
}

/* A call captured while tracing is on is not traced: the graph never holds the buffer. */
static void test_captured_call_not_traced(tw_rank_env* env) {
  tw_tr_fixture fx;
  if (tw_tr_init(env, &fx, TW_CONSUMER_COPY_BULK, TW_DATAFLOW_REDUCE)) {
    tw_tr_call(env, &fx, fx.ref);
    CHECK_OK(tw__context_trace(fx.ctx, 1 << 16));
    CHECK_OK(tw__context_trace_clear(fx.ctx, env->stream));
    /* Capture on a stream of this rank; the call's first kernel waits for the clear above. */
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    CHECK_CUDA(cudaStreamBeginCapture(env->stream, cudaStreamCaptureModeThreadLocal));
    CHECK_OK(tw_moe_combine(fx.ctx, fx.dp, fx.expert_in, fx.w2, fx.out, env->stream));
    CHECK_CUDA(cudaStreamEndCapture(env->stream, &graph));
    if (graph != NULL) CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    /* Every rank's graph on the device before any rank launches one (tilewave.h, rule 4). */
    if (exec != NULL) CHECK_CUDA(cudaGraphUpload(exec, env->stream));
    CHECK_CUDA(cudaStreamSynchronize(env->stream));
    (void)tw_rank_sum(env, 0);
    for (int i = 0; i < 3 && exec != NULL; i++) {
      CHECK_OK(tw__fill_bf16(fx.out, fx.n_out, 0xFFFF, env->stream));
      CHECK_CUDA(cudaGraphLaunch(exec, env->stream));
      CHECK_CUDA(
          cudaMemcpyAsync(fx.now, fx.out, fx.n_out * 2, cudaMemcpyDeviceToHost, env->stream));
      CHECK_CUDA(cudaStreamSynchronize(env->stream));
      CHECK(memcmp(fx.ref, fx.now, fx.n_out * 2) == 0);
    }
    CHECK_OK(tw_context_check(fx.ctx));
    int64_t n = -1, dropped = -1;
    const int64_t cap = 1 << 16;
    tw_trace_record* rec = (tw_trace_record*)malloc(sizeof(tw_trace_record) * (size_t)cap);
    CHECK_OK(tw__context_trace_read(fx.ctx, rec, cap, &n, &dropped));
    CHECKF(n == 0 && dropped == 0, "rank %d: %lld records from replays", env->rank,
           (long long)(n + dropped));
    if (exec != NULL) cudaGraphExecDestroy(exec);
    if (graph != NULL) cudaGraphDestroy(graph);
    /* Eager calls after the replays are traced again. */
    tw_tr_call(env, &fx, fx.now);
    CHECK(memcmp(fx.ref, fx.now, fx.n_out * 2) == 0);
    CHECK_OK(tw__context_trace_read(fx.ctx, rec, cap, &n, &dropped));
    CHECK(dropped == 0 && n >= 2 * (int64_t)fx.tiles + 3 * (int64_t)fx.units);
    if (rec) tw_tr_check_records(env, &fx, rec, n);
    free(rec);
  }
  tw_tr_free(&fx);
}

/* ---- the whole layer ---- */

/* One layer call, out poisoned first; out (tokens x H) and h (rows x F) to the host. */
static void tw_tr_layer_call(tw_rank_env* env, tw_context_t ctx, tw_device_plan_t dp,
                             const tw_problem* p, int32_t tokens, void* x, void* ids, void* w,
                             void* w13, void* w2, void* out, uint16_t* h_out, uint16_t* h_h,
                             size_t* n_h) {
  const size_t n_out = (size_t)tokens * p->hidden;
  CHECK_OK(tw__fill_bf16(out, n_out + 8, 0xFFFF, env->stream));
  CHECK_OK(tw_moe_layer(ctx, dp, x, ids, TW_INDEX_INT32, (const float*)w, tokens, w13, w2, out,
                        env->stream));
  CHECK_OK(tw_context_check(ctx));
  if (n_out > 0) CHECK_CUDA(cudaMemcpy(h_out, out, n_out * 2, cudaMemcpyDeviceToHost));
  tw_plan_summary sum;
  CHECK_OK(tw_device_plan_summary_get(dp, &sum));
  void* h = NULL;
  CHECK_OK(tw__context_layer_h(ctx, &h));
  *n_h = (size_t)sum.rows * p->ffn;
  if (*n_h > 0) CHECK_CUDA(cudaMemcpy(h_h, h, *n_h * 2, cudaMemcpyDeviceToHost));
}

/* Per CTA of `kind` (index ignored): how many records and the time of the last one; the CTAs
 * seen are 0..*ctas-1. Records of CTAs >= max are counted in *beyond. */
static void tw_tr_per_cta(const tw_trace_record* rec, int64_t n, int kind, int match_index,
                          uint32_t index, int max, int* count, uint64_t* ns, int* ctas,
                          int* beyond) {
  memset(count, 0, sizeof(int) * (size_t)max);
  *ctas = 0;
  *beyond = 0;
  for (int64_t i = 0; i < n; i++) {
    if (rec[i].kind != kind || (match_index && rec[i].index != index)) continue;
    if (rec[i].cta >= max) {
      (*beyond)++;
      continue;
    }
    count[rec[i].cta]++;
    ns[rec[i].cta] = rec[i].ns;
    if (rec[i].cta + 1 > *ctas) *ctas = rec[i].cta + 1;
  }
}

/* The earliest / latest record of a kind (UINT64_MAX / 0 when there is none). */
static uint64_t tw_tr_first(const tw_trace_record* rec, int64_t n, int kind) {
  uint64_t t = UINT64_MAX;
  for (int64_t i = 0; i < n; i++)
    if (rec[i].kind == kind && rec[i].ns < t) t = rec[i].ns;
  return t;
}
static uint64_t tw_tr_last(const tw_trace_record* rec, int64_t n, int kind) {
  uint64_t t = 0;
  for (int64_t i = 0; i < n; i++)
    if (rec[i].kind == kind && rec[i].ns > t) t = rec[i].ns;
  return t;
}

/* The dispatch's and GEMM1's records of a traced layer call. */
static void tw_tr_check_layer_records(tw_rank_env* env, tw_context_t ctx, tw_device_plan_t dp,
                                      int32_t slots, int budget, const tw_trace_record* rec,
                                      int64_t n) {
  enum { kMax = 1024 };
  int* c = (int*)calloc(kMax, sizeof(int));
  int* c2 = (int*)calloc(kMax, sizeof(int));
  int* c3 = (int*)calloc(kMax, sizeof(int));
  uint64_t* t1 = (uint64_t*)calloc(kMax, 8);
  uint64_t* t2 = (uint64_t*)calloc(kMax, 8);
  uint64_t* t3 = (uint64_t*)calloc(kMax, 8);
  if (!c || !c2 || !c3 || !t1 || !t2 || !t3) {
    CHECK(!"host memory");
    goto done;
  }
  {
    /* Scan: per pass, CTAs 0..n-1 begin and end once each, begin before end; both passes on the
     * same CTAs, within the budget. */
    int ctas[2] = {0, 0};
    for (int pass = 0; pass < 2; pass++) {
      int nb = 0, ne = 0, beyond = 0;
      tw_tr_per_cta(rec, n, TW_TRACE_SCAN_BEGIN, 1, (uint32_t)pass, kMax, c, t1, &nb, &beyond);
      tw_tr_per_cta(rec, n, TW_TRACE_SCAN_END, 1, (uint32_t)pass, kMax, c2, t2, &ne, &beyond);
      CHECK(beyond == 0);
      int bad = 0;
      for (int k = 0; k < nb || k < ne; k++) bad += c[k] != 1 || c2[k] != 1 || t1[k] > t2[k];
      CHECKF(bad == 0 && nb == ne && nb <= budget && (slots == 0 || nb >= 1),
             "rank %d scan pass %d: %d CTAs begin, %d end, %d not once (budget %d)", env->rank,
             pass, nb, ne, bad, budget);
      ctas[pass] = nb;
    }
    CHECKF(ctas[0] == ctas[1], "rank %d: count pass on %d CTAs, place on %d", env->rank, ctas[0],
           ctas[1]);
    for (int64_t i = 0; i < n; i++)
      if (rec[i].kind == TW_TRACE_SCAN_BEGIN || rec[i].kind == TW_TRACE_SCAN_END)
        CHECK(rec[i].index <= 1);
  }
  {
    /* Copy CTAs: begin, credit, end once each, in order; their rows are the rank's slots. */
    int nb = 0, nc = 0, ne = 0, beyond = 0;
    tw_tr_per_cta(rec, n, TW_TRACE_SEND_BEGIN, 0, 0, kMax, c, t1, &nb, &beyond);
    tw_tr_per_cta(rec, n, TW_TRACE_SEND_CREDIT, 0, 0, kMax, c2, t2, &nc, &beyond);
    tw_tr_per_cta(rec, n, TW_TRACE_SEND_END, 0, 0, kMax, c3, t3, &ne, &beyond);
    CHECK(beyond == 0);
    int bad = 0;
    for (int k = 0; k < nb || k < nc || k < ne; k++)
      bad += c[k] != 1 || c2[k] != 1 || c3[k] != 1 || t1[k] > t2[k] || t2[k] > t3[k];
    CHECKF(bad == 0 && nb == nc && nb == ne && nb >= 1 && nb <= budget,
           "rank %d: copy CTAs %d/%d/%d, %d not once in order (budget %d)", env->rank, nb, nc, ne,
           bad, budget);
    int64_t rows = 0, arrive = 0;
    for (int64_t i = 0; i < n; i++) {
      if (rec[i].kind == TW_TRACE_SEND_END) rows += rec[i].index;
      if (rec[i].kind == TW_TRACE_SEND_ARRIVE) {
        arrive++;
        CHECK((int)rec[i].index == env->nranks);
      }
    }
    CHECKF(rows == slots, "rank %d: the copy CTAs sent %lld rows, the rank has %d slots", env->rank,
           (long long)rows, slots);
    CHECKF(arrive == 1, "rank %d: %lld releases of the arrivals", env->rank, (long long)arrive);
    /* The copy follows the place pass in stream order. */
    CHECK(tw_tr_last(rec, n, TW_TRACE_SCAN_END) <= tw_tr_first(rec, n, TW_TRACE_SEND_BEGIN));
  }
  {
    /* The wait: one begin, every source's arrival once, after it. */
    int begins = 0;
    uint64_t t0 = 0;
    memset(c, 0, sizeof(int) * kMax);
    for (int64_t i = 0; i < n; i++) {
      if (rec[i].kind == TW_TRACE_RECV_BEGIN) begins++, t0 = rec[i].ns;
      if (rec[i].kind == TW_TRACE_RECV_ARRIVED && rec[i].index < (uint32_t)kMax) {
        c[rec[i].index]++;
        t1[rec[i].index] = rec[i].ns;
      }
    }
    CHECK(begins == 1);
    int bad = 0;
    for (int s = 0; s < kMax; s++) bad += c[s] != (s < env->nranks) || (c[s] && t1[s] < t0);
    CHECKF(bad == 0, "rank %d: %d sources not seen exactly once after the wait began", env->rank,
           bad);
  }
  {
    /* GEMM1: every tile of the list once, on CTA t mod its grid, begin before store; beside the
     * copy or after it, before GEMM2's first tile. */
    const tw_tile* g1 = NULL;
    int32_t T1 = 0;
    CHECK_OK(tw__device_plan_gemm1_tiles(dp, &g1, &T1));
    tw__launch_record l;
    CHECK_OK(tw__context_last_launch(ctx, &l));
    int* cb = (int*)calloc((size_t)T1 + 1, sizeof(int));
    int* cp = (int*)calloc((size_t)T1 + 1, sizeof(int));
    int* kb = (int*)calloc((size_t)T1 + 1, sizeof(int));
    int* kp = (int*)calloc((size_t)T1 + 1, sizeof(int));
    uint64_t* tb = (uint64_t*)calloc((size_t)T1 + 1, 8);
    uint64_t* tp = (uint64_t*)calloc((size_t)T1 + 1, 8);
    int foreign = 0, max_cta = -1;
    for (int64_t i = 0; cb && cp && kb && kp && tb && tp && i < n; i++) {
      if (rec[i].kind != TW_TRACE_GEMM1_BEGIN && rec[i].kind != TW_TRACE_GEMM1_PUBLISH) continue;
      if (rec[i].index >= (uint32_t)T1) {
        foreign++;
        continue;
      }
      const int pub = rec[i].kind == TW_TRACE_GEMM1_PUBLISH;
      (pub ? cp : cb)[rec[i].index]++;
      (pub ? kp : kb)[rec[i].index] = rec[i].cta;
      (pub ? tp : tb)[rec[i].index] = rec[i].ns;
      if (rec[i].cta > max_cta) max_cta = rec[i].cta;
    }
    /* GEMM1 on the SMs the copy leaves (every SM when the model put the dispatch before it). */
    const int room = budget - l.dispatch_ctas;
    const int grid = T1 < room ? T1 : room;
    CHECKF(l.gemm1_ctas == grid && l.dispatch_ctas >= 0,
           "rank %d: GEMM1 ran on %d CTAs beside %d copy CTAs, %d tiles on a budget of %d",
           env->rank, l.gemm1_ctas, l.dispatch_ctas, T1, budget);
    int bad = 0;
    for (int32_t t = 0; cb && cp && kb && kp && tb && tp && t < T1; t++) {
      const int ok =
          cb[t] == 1 && cp[t] == 1 && kb[t] == kp[t] && kb[t] == t % grid && tb[t] <= tp[t];
      if (!ok && bad++ < 5)
        fprintf(stderr, "  rank %d GEMM1 tile %d: %d begins, %d stores, CTAs %d/%d (grid %d)\n",
                env->rank, t, cb[t], cp[t], kb[t], kp[t], grid);
    }
    CHECKF(bad == 0 && foreign == 0,
           "rank %d: %d of %d GEMM1 tiles not traced exactly once, %d "
           "outside the list",
           env->rank, bad, T1, foreign);
    CHECK(max_cta < grid);
    if (T1 > 0) {
      /* After the place pass (stream order); beside the copy, the arrival wait after GEMM1 (the
       * join), else GEMM1 after every source's rows. */
      CHECK(tw_tr_last(rec, n, TW_TRACE_SCAN_END) <= tw_tr_first(rec, n, TW_TRACE_GEMM1_BEGIN));
      if (l.dispatch_ctas > 0)
        CHECK(tw_tr_last(rec, n, TW_TRACE_GEMM1_PUBLISH) <=
              tw_tr_first(rec, n, TW_TRACE_RECV_BEGIN));
      else
        CHECK(tw_tr_last(rec, n, TW_TRACE_RECV_ARRIVED) <=
              tw_tr_first(rec, n, TW_TRACE_GEMM1_BEGIN));
      const uint64_t g2 = tw_tr_first(rec, n, TW_TRACE_TILE_BEGIN);
      if (g2 != UINT64_MAX) CHECK(tw_tr_last(rec, n, TW_TRACE_GEMM1_PUBLISH) <= g2);
    }
    free(cb), free(cp), free(kb), free(kp), free(tb), free(tp);
  }
done:
  free(c), free(c2), free(c3), free(t1), free(t2), free(t3);
}

static void test_traced_layer_identical_and_complete(tw_rank_env* env) {
  const tw_problem p = tw_rank_problem(env, 1024, 512, 8, 2, 256);
  tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
  cc.layer = 1;
  cc.dataflow = TW_DATAFLOW_REDUCE;
  tw_context_t ctx = NULL;
  CHECK_OK(tw_rank_context_create(env, &p, &cc, &ctx));
  if (ctx == NULL) return;
  tw_context_info info;
  CHECK_OK(tw_context_info_get(ctx, &info));
  tw_device_plan_t dp = NULL;
  CHECK_OK(tw_device_plan_create(ctx, &dp));
  int64_t rows_max = 0;
  CHECK_OK(tw_context_dispatch_buffer(ctx, NULL, &rows_max));
  const size_t T = (size_t)p.max_tokens, H = (size_t)p.hidden, F = (size_t)p.ffn;
  const size_t K = (size_t)p.top_k, E = (size_t)(p.experts / p.world_size);
  void *x = NULL, *ids = NULL, *w = NULL, *w13 = NULL, *w2 = NULL, *out = NULL;
  CHECK_CUDA(cudaMalloc(&x, T * H * 2 + 16));
  CHECK_CUDA(cudaMalloc(&ids, T * K * 8 + 8));
  CHECK_CUDA(cudaMalloc(&w, T * K * 4 + 4));
  CHECK_CUDA(cudaMalloc(&w13, E * 2 * F * H * 2));
  CHECK_CUDA(cudaMalloc(&w2, E * H * F * 2));
  CHECK_CUDA(cudaMalloc(&out, T * H * 2 + 16));
  uint16_t* h_x = (uint16_t*)malloc(T * H * 2 + 16);
  int64_t* h_ids64 = (int64_t*)malloc(T * K * 8 + 8);
  uint16_t* h_w13 = (uint16_t*)malloc(E * 2 * F * H * 2);
  uint16_t* h_w2 = (uint16_t*)malloc(E * H * F * 2);
  uint16_t *ref = (uint16_t*)malloc(T * H * 2 + 16), *now = (uint16_t*)malloc(T * H * 2 + 16);
  uint16_t* ref_h = (uint16_t*)malloc((size_t)rows_max * F * 2 + 16);
  uint16_t* now_h = (uint16_t*)malloc((size_t)rows_max * F * 2 + 16);
  tw_routing_t rt = NULL;
  int32_t tokens[TW_MAX_RANKS];
  for (int r = 0; r < env->nranks; r++) tokens[r] = r % 2 ? p.max_tokens - 37 : p.max_tokens;
  CHECK_OK(tw_make_routing(&p, TW_ROUTER_MODERATE_SKEW, tokens, 777, &rt));
  if (dp != NULL && rt != NULL && h_x && h_ids64 && h_w13 && h_w2 && ref && now && ref_h && now_h) {
    /* Weights times 2^-4 (exact in bf16): SwiGLU in its curved part, no overflow. */
    for (size_t i = 0; i < E * 2 * F * H; i++)
      h_w13[i] = tw_f2bf(0.0625f * tw_uniform_bf16(91, (uint64_t)env->rank, i, 3));
    for (size_t i = 0; i < E * H * F; i++)
      h_w2[i] = tw_f2bf(0.0625f * tw_uniform_bf16(92, (uint64_t)env->rank, i, 4));
    CHECK_CUDA(cudaMemcpy(w13, h_w13, E * 2 * F * H * 2, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(w2, h_w2, E * H * F * 2, cudaMemcpyHostToDevice));
    tw_upload_routed_inputs(env, &p, rt, 4321, 0, h_x, h_ids64, x, ids, w);
    const int32_t nt = tokens[env->rank];
    size_t n_h = 0, n_h2 = 0;
    tw_tr_layer_call(env, ctx, dp, &p, nt, x, ids, w, w13, w2, out, ref, ref_h, &n_h); /* off */
    const int64_t cap = 1 << 17;
    CHECK_OK(tw__context_trace(ctx, cap));
    tw_trace_record* rec = (tw_trace_record*)malloc(sizeof(tw_trace_record) * (size_t)cap);
    for (int round = 0; round < 2 && rec != NULL; round++) {
      CHECK_OK(tw__context_trace_clear(ctx, env->stream));
      tw_tr_layer_call(env, ctx, dp, &p, nt, x, ids, w, w13, w2, out, now, now_h, &n_h2);
      CHECKF(memcmp(ref, now, (size_t)nt * H * 2) == 0,
             "rank %d round %d: the traced layer's out differs from the untraced one", env->rank,
             round);
      CHECKF(n_h == n_h2 && memcmp(ref_h, now_h, n_h * 2) == 0,
             "rank %d round %d: the traced layer's h differs from the untraced one", env->rank,
             round);
      int64_t n = 0, dropped = -1;
      CHECK_OK(tw__context_trace_read(ctx, rec, cap, &n, &dropped));
      CHECK(dropped == 0);
      tw_tr_fixture fx;
      memset(&fx, 0, sizeof fx);
      fx.ctx = ctx;
      CHECK_OK(tw__device_plan_work(dp, &fx.tiles, &fx.units));
      tw_tr_check_records(env, &fx, rec, n);
      tw_tr_check_layer_records(env, ctx, dp, nt * p.top_k, info.sm_budget, rec, n);
      if (env->rank == 0 && round == 0)
        printf("  layer: %d tiles, %d units, %lld records\n", fx.tiles, fx.units, (long long)n);
    }
    /* Off again: the same bits, nothing recorded. */
    CHECK_OK(tw__context_trace(ctx, 0));
    tw_tr_layer_call(env, ctx, dp, &p, nt, x, ids, w, w13, w2, out, now, now_h, &n_h2);
    CHECK(memcmp(ref, now, (size_t)nt * H * 2) == 0);
    free(rec);
  }
  tw_routing_destroy(rt);
  void* dev[] = {x, ids, w, w13, w2, out};
  for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) cudaFree(dev[i]);
  free(h_x), free(h_ids64), free(h_w13), free(h_w2), free(ref), free(now), free(ref_h);
  free(now_h);
  CHECK_OK(tw_device_plan_destroy(dp));
  CHECK_OK(tw_context_destroy(ctx));
}

static const tw_rank_case kCases[] = {
    {"traced_call_identical_and_complete", test_traced_call_identical_and_complete},
    {"traced_call_add_dataflow", test_traced_call_add_dataflow},
    {"captured_call_not_traced", test_captured_call_not_traced},
    {"traced_layer_identical_and_complete", test_traced_layer_identical_and_complete},
};

int main(int argc, char** argv) {
  if (!tw__trace_hooks()) {
    printf("the trace hooks are compiled out (-DTW_TRACE_HOOKS=OFF): skipped\n");
    return 77;
  }
  return tw_rank_test_main(argc, argv, kCases, (int)(sizeof kCases / sizeof kCases[0]), 600);
}
