/*
 * test_tp.cu: the tensor-parallel runtime (tw_moe_combine_tp) over a TP x EP world: each rank
 * computes GEMM2 partial sums over its F slice for every row routed to its EP group, GatherRS
 * sums its block over the TP group and stores the reduced rows at their owners, and the owners'
 * weighted reduction sums the k slots. Run as `--in-process W` (W ranks on one GPU; ctest: W = 2
 * and 4) or without arguments (two GPUs over NCCL). Configurations by world: W = 2: TP 2 and
 * TP 1 x EP 2; W = 4: TP 4, TP 2 x EP 2 and TP 1 x EP 4; W = 1: TP 1. Checks:
 *  - out of the overlapped call against the CPU reference (tw__ref_tp_gemm2_gatherrs, partial
 *    sums rounded to bf16 as the producer stores them) within bf16 tolerance, over several calls
 *    with token counts that shrink and grow, empty ranks, top_k 2 and 4 and two tile widths;
 *  - the overlapped and the unfused call (GatherRS after the producer) bit for bit, with `out`
 *    poisoned before every call so that a row the call does not write shows;
 *  - the plan's C (tw_tp_plan_summary.tp_comm_ctas) in 1..c_max for tp > 1, and a call with a
 *    forced C = 1 the same bits;
 *  - refusals with the status that names the fix: tp x ep != world_size, an ffn that does not
 *    split into 64-wide K slices, experts % ep, a config the TP context has no use for, modes
 *    other than overlap / unfused, a plan of another rank or of another tw_parallel; the
 *    context works after them;
 *  - a rank that does not call: the others' waits time out and tw_tp_context_check reports
 *    TW_ERR_TIMEOUT on every rank, after which calls are refused.
 * Exits 77 without a GPU (in-process) or with fewer than 2 GPUs (NCCL).
 */
#include "overlap_common.h"
#include "plan_tp.h"
#include "reference.h"

/* This rank's TP context on the run's team. */
static tw_status tw_tp_rank_context(const tw_rank_env* env, const tw_problem* p,
                                    const tw_parallel* par, const tw_context_config* cc,
                                    tw_tp_context_t* ctx) {
  return env->team != NULL ? tw_tp_context_create_on_team(p, par, env->team, env->rank, cc, ctx)
                           : tw_tp_context_create(p, par, env->comm, cc, ctx);
}

typedef struct tw_tp_case {
  int tp, hidden, ffn, experts, top_k, max_tokens, iters;
} tw_tp_case;

/* |gpu - ref| for the bf16 output: one bf16 rounding of out apart (1/128 relative), plus the
 * GPU's extra rounding of each reduced row (half an ulp of y; |y| reaches ~25 here). Returns 0
 * within that, 1 within the loose bound, 2 beyond it. Between the two: a partial sum whose bf16
 * rounding the producer's other fp32 order inside its K slice flipped (one ulp of a partial, up
 * to 0.125 times a gate weight; about one in 10^5 partials), allowed at a few values per call. A
 * lost, doubled or misplaced row or partial is off by the size of a row value (~5) over a whole
 * row. */
static int tw_tp_off(uint16_t gpu, uint16_t ref) {
  const double a = tw_bf2f(gpu), r = tw_bf2f(ref), d = fabs(a - r);
  if (d <= 0.08 + 0.012 * fabs(r)) return 0;
  return d <= 0.5 + 0.02 * fabs(r) ? 1 : 2;
}

static void tw_tp_run_case(tw_rank_env* env, const tw_tp_case* c, uint64_t seed) {
  const int W = env->nranks, tp = c->tp, ep = W / tp;
  tw_problem p = tw_test_problem(W, c->hidden, c->ffn, c->experts, c->top_k, c->max_tokens, 0, 0);
  tw_parallel par = TW_PARALLEL_INIT;
  par.tp = tp;
  par.ep = ep;
  tw_tp_context_t ctx = NULL;
  CHECK_OK(tw_tp_rank_context(env, &p, &par, NULL, &ctx));
  if (ctx == NULL) return;
  tw_tp_device_plan_t dp = NULL;
  CHECK_OK(tw_tp_device_plan_create(ctx, &dp));
  const int H = p.hidden, F = p.ffn, K = p.top_k, S = F / tp, E = p.experts / ep;
  const int g = env->rank / tp, q = env->rank % tp;
  /* The context's default budget: the GPU's SMs, shared by the ranks of an in-process team. */
  int sm_budget = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sm_budget, cudaDevAttrMultiProcessorCount, 0));
  if (env->team != NULL) sm_budget /= W;
  const uint64_t salt_h = seed * 7 + 1, salt_w = seed * 7 + 2;
  /* Host inputs of the reference: every owner's h (tokens, K, F) and every expert's w2. */
  float* w2f = (float*)malloc((size_t)p.experts * H * F * sizeof(float));
  float* hf[TW_MAX_RANKS];
  uint16_t* ref[TW_MAX_RANKS];
  for (int r = 0; r < W; r++) {
    hf[r] = (float*)malloc((size_t)p.max_tokens * K * F * sizeof(float) + 4);
    ref[r] = (uint16_t*)malloc((size_t)p.max_tokens * H * 2 + 2);
  }
  for (int e = 0; e < p.experts; e++)
    for (int n = 0; n < H; n++)
      for (int f = 0; f < F; f++) w2f[((size_t)e * H + n) * F + f] = tw_w2_value(salt_w, e, n, f);
  /* This rank's w2: the F slice q of its group's experts. */
  uint16_t* h_w2 = (uint16_t*)malloc((size_t)E * H * S * 2);
  for (int e = 0; e < E; e++)
    for (int n = 0; n < H; n++)
      for (int f = 0; f < S; f++)
        h_w2[((size_t)e * H + n) * S + f] =
            tw_f2bf(w2f[((size_t)(g * E + e) * H + n) * F + q * S + f]);
  /* The largest TP plan: tp blocks of an EP rank's worst case (tp_context.cu). */
  const int64_t tm = 128, kk = K < E ? K : E;
  const int64_t rows_cap = tp * (ep * (int64_t)p.max_tokens * kk + E * ep * (tm - 1) + tm);
  void *d_in = NULL, *d_w2 = NULL, *d_out = NULL;
  CHECK_CUDA(cudaMalloc(&d_in, (size_t)rows_cap * S * 2));
  CHECK_CUDA(cudaMalloc(&d_w2, (size_t)E * H * S * 2));
  CHECK_CUDA(cudaMalloc(&d_out, (size_t)p.max_tokens * H * 2 + 16));
  CHECK_CUDA(cudaMemcpy(d_w2, h_w2, (size_t)E * H * S * 2, cudaMemcpyHostToDevice));
  uint16_t* h_in = (uint16_t*)malloc((size_t)rows_cap * S * 2);
  uint16_t* out_a = (uint16_t*)malloc((size_t)p.max_tokens * H * 2 + 2);
  uint16_t* out_b = (uint16_t*)malloc((size_t)p.max_tokens * H * 2 + 2);
  uint16_t* out_c = (uint16_t*)malloc((size_t)p.max_tokens * H * 2 + 2);

  for (int it = 0; it < c->iters && dp != NULL; it++) {
    int32_t tokens[TW_MAX_RANKS];
    tw_token_counts(it, W, p.max_tokens, seed, tokens);
    tw_routing_t rt = NULL;
    CHECK_OK(tw_make_routing(&p, TW_ROUTER_MODERATE_SKEW, tokens, seed * 131 + it, &rt));
    if (rt == NULL) break;
    tw_tp_plan_t plan = NULL;
    tw_plan_config pc = TW_PLAN_CONFIG_INIT;
    pc.dataflow = TW_DATAFLOW_REDUCE; /* whatever TW_COMBINE_DATAFLOW says */
    pc.sm_budget = sm_budget;         /* the TP model plans C for the SMs the call gets */
    CHECK_OK(tw_tp_plan_create(&p, &par, rt, env->rank, &pc, &plan));
    if (plan == NULL) {
      tw_routing_destroy(rt);
      break;
    }
    tw_tp_plan_summary sum = TW_TP_PLAN_SUMMARY_INIT;
    CHECK_OK(tw_tp_plan_summary_get(plan, &sum));
    if (tp > 1 && sum.rows > 0)
      CHECKF(sum.tp_comm_ctas >= 1 && sum.tp_comm_ctas <= plan->hw.c_max, "C %d", sum.tp_comm_ctas);
    /* GEMM2 input: row i of the layout is (owner, token, slot)'s h, columns of slice q. */
    CHECK((int64_t)plan->rows <= rows_cap);
    for (int32_t r = 0; r < plan->rows && r < rows_cap; r++) {
      const tw_row_src* s = &plan->row_src[r];
      for (int f = 0; f < S; f++)
        h_in[(size_t)r * S + f] =
            s->owner < 0 ? 0 : tw_f2bf(tw_h_value(salt_h, s->owner, s->token, s->slot, q * S + f));
    }
    if (plan->rows > 0)
      CHECK_CUDA(cudaMemcpy(d_in, h_in, (size_t)plan->rows * S * 2, cudaMemcpyHostToDevice));
    CHECK_OK(tw_tp_device_plan_upload(dp, plan, rt, env->stream));
    const int32_t n = tokens[env->rank];
    uint16_t* outs[3] = {out_a, out_b, out_c};
    for (int m = 0; m < 3; m++) {
      tw_combine_options opt = TW_COMBINE_OPTIONS_INIT;
      opt.mode = m == 1 ? TW_COMBINE_UNFUSED : TW_COMBINE_OVERLAP;
      opt.comm_ctas = m == 2 ? 1 : 0;
      CHECK_OK(tw__fill_bf16(d_out, (size_t)p.max_tokens * H, 0xFFFF, env->stream));
      CHECK_OK(tw_moe_combine_tp(ctx, dp, d_in, d_w2, d_out, &opt, env->stream));
      CHECK_OK(tw_tp_context_check(ctx));
      if (n > 0)
        CHECK_CUDA(cudaMemcpyAsync(outs[m], d_out, (size_t)n * H * 2, cudaMemcpyDeviceToHost,
                                   env->stream));
      CHECK_CUDA(cudaStreamSynchronize(env->stream));
    }
    CHECK(memcmp(out_a, out_b, (size_t)n * H * 2) == 0);
    CHECK(memcmp(out_a, out_c, (size_t)n * H * 2) == 0);
    /* The reference of the whole world (every rank computes it; only its own tokens are read). */
    for (int r = 0; r < W; r++) {
      int32_t nt = 0;
      const int32_t* ids = NULL;
      const float* ws = NULL;
      CHECK_OK(tw_routing_rank(rt, r, &nt, &ids, &ws));
      for (int t = 0; t < nt; t++)
        for (int j = 0; j < K; j++)
          for (int f = 0; f < F; f++)
            hf[r][((size_t)t * K + j) * F + f] = tw_h_value(salt_h, r, t, j, f);
    }
    CHECK_OK(tw__ref_tp_gemm2_gatherrs(rt, tp, 1, hf, w2f, ref));
    int64_t off[3] = {0, 0, 0};
    for (int64_t i = 0; i < (int64_t)n * H; i++) {
      const int k = tw_tp_off(out_a[i], ref[env->rank][i]);
      if (k > 0 && off[1] + off[2] < 4)
        fprintf(stderr, "  rank %d tp %d it %d: token %lld col %lld: %g, reference %g\n", env->rank,
                tp, it, (long long)(i / H), (long long)(i % H), tw_bf2f(out_a[i]),
                tw_bf2f(ref[env->rank][i]));
      off[k]++;
    }
    CHECKF(off[2] == 0 && off[1] <= 2 + (int64_t)n * H / 10000,
           "rank %d: of %lld values %lld off the reference, %lld of them far", env->rank,
           (long long)n * H, (long long)(off[1] + off[2]), (long long)off[2]);
    tw_tp_plan_destroy(plan);
    tw_routing_destroy(rt);
  }
  CHECK_OK(tw_tp_device_plan_destroy(dp));
  CHECK_OK(tw_tp_context_destroy(ctx));
  cudaFree(d_in);
  cudaFree(d_w2);
  cudaFree(d_out);
  free(h_in);
  free(h_w2);
  free(w2f);
  free(out_a);
  free(out_b);
  free(out_c);
  for (int r = 0; r < W; r++) {
    free(hf[r]);
    free(ref[r]);
  }
}

/* Every tp that divides the world, one case each: hidden 512 (128-wide tiles, 4 column tiles,
 * 2 splits) and top_k 2, then hidden 2048 (256-wide tiles) and top_k 4. */
static void tw_tp_all_configs(tw_rank_env* env, int wide) {
  const int W = env->nranks;
  for (int tp = W; tp >= 1; tp--) {
    if (W % tp != 0) continue;
    tw_tp_case c;
    c.tp = tp;
    c.hidden = wide ? 2048 : 512;
    c.ffn = 512; /* K slices of 256 (tp 2), 128 (tp 4) */
    c.experts = 8;
    c.top_k = wide ? 4 : 2;
    c.max_tokens = wide ? 40 : 64;
    c.iters = wide ? 3 : 5;
    if (env->rank == 0)
      printf("  tp %d x ep %d, hidden %d, top_k %d\n", tp, W / tp, c.hidden, c.top_k);
    tw_tp_run_case(env, &c, 11 + (uint64_t)tp + (wide ? 100 : 0));
  }
}

static void test_tp_against_reference(tw_rank_env* env) {
  tw_tp_all_configs(env, 0);
}

static void test_tp_wide_tiles(tw_rank_env* env) {
  tw_tp_all_configs(env, 1);
}

static void test_tp_refusals(tw_rank_env* env) {
  const int W = env->nranks;
  tw_problem p = tw_test_problem(W, 512, 512, 8, 2, 32, 0, 0);
  tw_tp_context_t ctx = NULL;
  /* tp x ep != world_size. */
  tw_parallel par = TW_PARALLEL_INIT;
  par.tp = W;
  par.ep = 2;
  CHECK_STATUS(tw_tp_rank_context(env, &p, &par, NULL, &ctx), TW_ERR_INVALID_SIZE);
  CHECK(ctx == NULL);
  CHECK(strstr(tw_last_error(), "world_size") != NULL);
  /* ffn / tp not a multiple of 64 (tp 2: 448 = 2 x 224). */
  if (W % 2 == 0) {
    tw_problem bad = p;
    bad.ffn = 448;
    par.tp = 2;
    par.ep = 0;
    CHECK_STATUS(tw_tp_rank_context(env, &bad, &par, NULL, &ctx), TW_ERR_ALIGNMENT);
    CHECK(strstr(tw_last_error(), "pad ffn") != NULL);
  }
  /* experts % ep (6 experts over ep = 4: the TP part is fine, the EP part is not). */
  if (W == 4) {
    tw_problem bad = p;
    bad.experts = 6;
    par.tp = 1;
    par.ep = 4;
    CHECK_STATUS(tw_tp_rank_context(env, &bad, &par, NULL, &ctx), TW_ERR_INDIVISIBLE);
  }
  /* A config field the TP context has no use for (refused on every rank before any collective). */
  par.tp = W;
  par.ep = 1;
  tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
  cc.dataflow = TW_DATAFLOW_ADD;
  CHECK_STATUS(tw_tp_rank_context(env, &p, &par, &cc, &ctx), TW_ERR_UNSUPPORTED);
  CHECK(ctx == NULL);
  /* A good context; then calls and uploads it must refuse, and a call that works after them. */
  CHECK_OK(tw_tp_rank_context(env, &p, &par, NULL, &ctx));
  if (ctx == NULL) return;
  tw_tp_device_plan_t dp = NULL;
  CHECK_OK(tw_tp_device_plan_create(ctx, &dp));
  int32_t tokens[TW_MAX_RANKS];
  for (int r = 0; r < W; r++) tokens[r] = 16 + r;
  tw_routing_t rt = NULL;
  CHECK_OK(tw_make_routing(&p, TW_ROUTER_BALANCED, tokens, 5, &rt));
  tw_tp_plan_t plan = NULL, other = NULL, split1 = NULL;
  CHECK_OK(tw_tp_plan_create(&p, &par, rt, env->rank, NULL, &plan));
  CHECK_OK(tw_tp_plan_create(&p, &par, rt, (env->rank + 1) % W, NULL, &other));
  tw_parallel par1 = par;
  par1.splits = 1;
  CHECK_OK(tw_tp_plan_create(&p, &par1, rt, env->rank, NULL, &split1));
  CHECK_STATUS(tw_moe_combine_tp(ctx, dp, NULL, NULL, NULL, NULL, env->stream), TW_ERR_STATE);
  if (W > 1)
    CHECK_STATUS(tw_tp_device_plan_upload(dp, other, rt, env->stream), TW_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(tw_tp_device_plan_upload(dp, split1, rt, env->stream), TW_ERR_INVALID_ARGUMENT);
  CHECK(strstr(tw_last_error(), "tw_parallel") != NULL);
  CHECK_OK(tw_tp_device_plan_upload(dp, plan, rt, env->stream));
  const int S = p.ffn / W, H = p.hidden;
  void *d_in = NULL, *d_w2 = NULL, *d_out = NULL;
  CHECK_CUDA(cudaMalloc(&d_in, (size_t)(plan ? plan->rows : 1) * S * 2 + 16));
  CHECK_CUDA(cudaMalloc(&d_w2, (size_t)p.experts * H * S * 2));
  CHECK_CUDA(cudaMalloc(&d_out, (size_t)p.max_tokens * H * 2));
  CHECK_CUDA(cudaMemset(d_in, 0, (size_t)(plan ? plan->rows : 1) * S * 2 + 16));
  CHECK_CUDA(cudaMemset(d_w2, 0, (size_t)p.experts * H * S * 2));
  tw_combine_options opt = TW_COMBINE_OPTIONS_INIT;
  opt.mode = TW_COMBINE_GEMM_ONLY;
  CHECK_STATUS(tw_moe_combine_tp(ctx, dp, d_in, d_w2, d_out, &opt, env->stream),
               TW_ERR_UNSUPPORTED);
  opt.mode = TW_COMBINE_OVERLAP;
  opt.comm_ctas = TW_MAX_COMM_CTAS + 1;
  CHECK_STATUS(tw_moe_combine_tp(ctx, dp, d_in, d_w2, d_out, &opt, env->stream),
               TW_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(tw_moe_combine_tp(ctx, dp, d_in, d_w2, NULL, NULL, env->stream),
               TW_ERR_NULL_POINTER);
  /* Zero inputs: the call works and every output value is +0 or -0. */
  CHECK_OK(tw__fill_bf16(d_out, (size_t)p.max_tokens * H, 0xFFFF, env->stream));
  CHECK_OK(tw_moe_combine_tp(ctx, dp, d_in, d_w2, d_out, NULL, env->stream));
  CHECK_OK(tw_tp_context_check(ctx));
  const int32_t n = tokens[env->rank];
  uint16_t* h = (uint16_t*)malloc((size_t)n * H * 2);
  CHECK_CUDA(cudaMemcpy(h, d_out, (size_t)n * H * 2, cudaMemcpyDeviceToHost));
  int64_t nonzero = 0;
  for (int64_t i = 0; i < (int64_t)n * H; i++) nonzero += (h[i] & 0x7FFF) != 0;
  CHECK(nonzero == 0);
  free(h);
  tw_tp_plan_destroy(plan);
  tw_tp_plan_destroy(other);
  tw_tp_plan_destroy(split1);
  tw_routing_destroy(rt);
  CHECK_OK(tw_tp_device_plan_destroy(dp));
  CHECK_OK(tw_tp_context_destroy(ctx));
  cudaFree(d_in);
  cudaFree(d_w2);
  cudaFree(d_out);
}

/* A rank that does not take part: every other rank's waits end at the timeout (the reduction
 * waits for that rank's GatherRS), tw_tp_context_check then fails on every rank (the absent one
 * learns it from the others' error words), and later calls are refused. */
static void test_tp_missing_rank(tw_rank_env* env) {
  const int W = env->nranks;
  if (W < 2) return; /* nobody to wait for */
  tw_problem p = tw_test_problem(W, 512, 512, 8, 2, 32, 0, 0);
  tw_parallel par = TW_PARALLEL_INIT;
  par.tp = W % 2 == 0 ? 2 : 1;
  tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
  cc.timeout_ms = 300;
  tw_tp_context_t ctx = NULL;
  CHECK_OK(tw_tp_rank_context(env, &p, &par, &cc, &ctx));
  if (ctx == NULL) return;
  tw_tp_device_plan_t dp = NULL;
  CHECK_OK(tw_tp_device_plan_create(ctx, &dp));
  int32_t tokens[TW_MAX_RANKS];
  for (int r = 0; r < W; r++) tokens[r] = 20;
  tw_routing_t rt = NULL;
  CHECK_OK(tw_make_routing(&p, TW_ROUTER_BALANCED, tokens, 9, &rt));
  tw_tp_plan_t plan = NULL;
  CHECK_OK(tw_tp_plan_create(&p, &par, rt, env->rank, NULL, &plan));
  if (plan != NULL) CHECK_OK(tw_tp_device_plan_upload(dp, plan, rt, env->stream));
  const int S = p.ffn / par.tp, H = p.hidden;
  const size_t in_bytes = (size_t)(plan ? plan->rows : 1) * S * 2 + 16;
  void *d_in = NULL, *d_w2 = NULL, *d_out = NULL;
  CHECK_CUDA(cudaMalloc(&d_in, in_bytes));
  CHECK_CUDA(cudaMalloc(&d_w2, (size_t)p.experts * H * S * 2));
  CHECK_CUDA(cudaMalloc(&d_out, (size_t)p.max_tokens * H * 2));
  CHECK_CUDA(cudaMemset(d_in, 0, in_bytes));
  CHECK_CUDA(cudaMemset(d_w2, 0, (size_t)p.experts * H * S * 2));
  if (env->rank != 0 && plan != NULL)
    CHECK_OK(tw_moe_combine_tp(ctx, dp, d_in, d_w2, d_out, NULL, env->stream));
  CHECK_STATUS(tw_tp_context_check(ctx), TW_ERR_TIMEOUT);
  CHECK(strstr(tw_last_error(), "timed out") != NULL);
  if (plan != NULL)
    CHECK_STATUS(tw_moe_combine_tp(ctx, dp, d_in, d_w2, d_out, NULL, env->stream), TW_ERR_STATE);
  tw_tp_plan_destroy(plan);
  tw_routing_destroy(rt);
  CHECK_OK(tw_tp_device_plan_destroy(dp));
  CHECK_OK(tw_tp_context_destroy(ctx));
  cudaFree(d_in);
  cudaFree(d_w2);
  cudaFree(d_out);
}

int main(int argc, char** argv) {
  static const tw_rank_case cases[] = {
      {"tp_refusals", test_tp_refusals},
      {"tp_against_reference", test_tp_against_reference},
      {"tp_wide_tiles", test_tp_wide_tiles},
      {"tp_missing_rank", test_tp_missing_rank},
  };
  return tw_rank_test_main(argc, argv, cases, (int)(sizeof cases / sizeof cases[0]), 600);
}
