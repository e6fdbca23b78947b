/*
 * tp_context.cu: the tensor-parallel runtime: a TP x EP context per rank (tw_parallel over a team),
 * device copies of TP plans (plan_tp.h) and the launch sequence of one call, tw_moe_combine_tp.
 *
 * One call, on the caller's stream S and the context's communication stream K:
 *   S: call begin -> record start -> producer (P = budget - C CTAs, the TP plan's split-major
 *      tiles over K = ffn / tp; each tile's counter is its split's) -> wait(GatherRS done) ->
 *      the owners' weighted reduction (reduce.cu, unchanged) -> done
 *   K: wait(start) [unfused: wait(producer done)] -> GatherRS (C CTAs, gatherrs.cu)
 * GatherRS sums the rank's block over its TP group and stores every reduced row at its owner:
 * the owner's receive rows (the EP plan's dest_offset) or, for the rank's own tokens, its reduced
 * rows, which the reduction reads as the EP runtime's local GEMM output. The EP part's send is so
 * fused into GatherRS's store (one pass over the reduced rows instead of a store and a copy).
 *
 * Deadlock freedom as in combine_call.cu: a producer waits for nothing; a GatherRS of call e waits
 * for its TP peers' producers of call e and for every owner's reduction of call e - 1; a
 * reduction waits for its own GatherRS (stream order) and every rank's GatherRS of call e. On an
 * in-process team every call keeps within its SM budget and the budgets add up to at most the
 * GPU's SMs (checked at creation). The partial sums a rank's TP peers read are overwritten only
 * by its next call's producer, which starts after its reduction, which has seen every rank's
 * arrival, which every rank sends after all its GatherRS CTAs have finished (gatherrs.h).
 *
 * Segment counters are cumulative (never zeroed while the context lives): a peer may poll this
 * rank's counters for call e + 1 before this rank's call e + 1 has begun, so a zeroing could
 * never be ordered before that peer's reads. The host keeps the running target; every TP rank of
 * a group plans the same tiles per split. So calls cannot be captured in a CUDA graph.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "context.h"
#include "gatherrs.h"
#include "plan_tp.h"
#include "tunables.h"

struct tw_tp_context {
  tw_problem problem;
  tw_parallel par; /* resolved */
  tw__team* team;  /* owned view */
  int32_t rank, world, device, sm_count, sm_budget, timeout_ms, max_comm_ctas;
  int32_t group, tp_index, local_experts, ffn_slice, tm, tn, col_tiles;
  int64_t block_rows_max; /* rows of one block: an EP rank's worst case in the EP world of ep */
  int64_t rows_max;       /* tp blocks */
  int64_t tiles_max, comm_tiles_max, slots_max, recv_rows_max;

  /* Window: receive rows (lay.data), partial sums (part_off), segment counters (seg_off),
   * arrivals and credits (lay.arrive, lay.credit). */
  tw_window_layout lay;
  uint64_t part_off, seg_off;
  tw__window win;
  char** peers; /* (world) device copy of win.peers */

  uint16_t* red;             /* (block_rows_max, hidden) bf16: reduced rows of own tokens */
  char* state_mem;           /* one allocation: the small state below */
  tw_call_state* call_state; /* epoch, arrival targets (advanced by the call's first kernel) */
  tw_call_state* warm_state; /* the warm-up's */
  tw_dev_error* err;
  uint32_t* gather_done; /* GatherRS CTA completion counter */
  uint32_t* reduce_done; /* reduction CTA completion counter */
  uint32_t* recv_units;  /* (world) arrivals per call from each rank: 1, 0 for itself */
  tw_dev_error* h_err;   /* pinned copy of *err after each call */

  cudaStream_t s_comm, s_aux;
  cudaEvent_t ev_start, ev_gemm_done, ev_comm_done, ev_call_done, ev_err_copied;
  uint32_t seg_target; /* cumulative tiles per split over the calls so far */
  int failed, have_call;
};

struct tw_tp_device_plan {
  tw_tp_context_t ctx;
  void* mem;
  tw_tile* tiles;              /* (tiles_max) band = the tile's split */
  tw_tp_comm_tile* comm_tiles; /* (comm_tiles_max) */
  int32_t* dst_rank;           /* (block_rows_max) */
  int32_t* dst_row;            /* (block_rows_max) */
  int32_t* slot_row;           /* (slots_max) */
  float* weights;              /* (slots_max) */
  int uploaded;
  int32_t rows, num_tiles, num_comm_tiles, tiles_per_split, block_row0, block_rows, recv_rows,
      tokens, comm_ctas;
};

/* ---- errors -------------------------------------------------------------------------------- */

static const char* tw__tp_where_name(int where) {
  switch (where) {
    case TW_WAIT_SEGMENT:
      return "GatherRS wait for a TP peer's split";
    case TW_WAIT_TP_CREDIT:
      return "GatherRS wait for an owner's credit";
    case TW_WAIT_ARRIVAL:
      return "reduction wait for a rank's GatherRS";
    default:
      return "device wait";
  }
}

static tw_status tw__tp_report(const struct tw_tp_context* ctx, const tw_dev_error* e,
                               const char* how) {
  if (e->where == TW_CHECK_ARRIVALS)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "%s: rank %d: rank %d announced %u calls where this rank expects %u: the "
                    "ranks' calls are out of step (every rank must make every call). Destroy the "
                    "TP context on every rank",
                    how, e->rank, e->index, e->seen, e->target);
  return tw__fail(TW_ERR_TIMEOUT,
                  "%s: rank %d: %s (index %d) timed out after %d ms: counter %u, waiting for %u. "
                  "A rank did not take part in the call, the ranks planned from different "
                  "routings, or the timeout (TW_TIMEOUT_MS) is too short for this shape. Destroy "
                  "the TP context on every rank",
                  how, e->rank, tw__tp_where_name(e->where), e->index, ctx->timeout_ms, e->seen,
                  e->target);
}

/* ---- context -------------------------------------------------------------------------------- */

static tw_status tw__tp_sync_all(struct tw_tp_context* ctx) {
  if (ctx->have_call) TW_CUDA_TRY(cudaEventSynchronize(ctx->ev_call_done));
  TW_CUDA_TRY(cudaStreamSynchronize(ctx->s_comm));
  TW_CUDA_TRY(cudaStreamSynchronize(ctx->s_aux));
  return TW_SUCCESS;
}

static void tw__tp_context_free(struct tw_tp_context* ctx) {
  if (ctx == NULL) return;
  int busy = 0;
  if (ctx->team != NULL) {
    if (ctx->win.local != NULL) ctx->team->ops->window_destroy(ctx->team, &ctx->win);
    busy = ctx->team->ops->device_busy(ctx->team);
    ctx->team->ops->release(ctx->team);
  }
  if (!busy) { /* see tw__context_free: a lost collective on the device would block a free */
    cudaFree(ctx->peers);
    cudaFree(ctx->red);
    cudaFree(ctx->state_mem);
    cudaFreeHost(ctx->h_err);
  }
  cudaEvent_t evs[] = {ctx->ev_start, ctx->ev_gemm_done, ctx->ev_comm_done, ctx->ev_call_done,
                       ctx->ev_err_copied};
  for (size_t i = 0; i < sizeof evs / sizeof evs[0]; i++)
    if (evs[i]) cudaEventDestroy(evs[i]);
  if (ctx->s_comm) cudaStreamDestroy(ctx->s_comm);
  if (ctx->s_aux) cudaStreamDestroy(ctx->s_aux);
  free(ctx);
}

/* The GatherRS arguments the context fixes; the call adds the plan's and the target. */
static void tw__tp_gather_args_init(const struct tw_tp_context* ctx, tw_gatherrs_args* ga) {
  memset(ga, 0, sizeof *ga);
  ga->peers = ctx->peers;
  ga->local_win = (char*)ctx->win.local;
  ga->part_off = ctx->part_off;
  ga->seg_off = ctx->seg_off;
  ga->data_off = ctx->lay.data;
  ga->arrive_off = ctx->lay.arrive;
  ga->credit_off = ctx->lay.credit;
  ga->red = ctx->red;
  ga->hidden = ctx->problem.hidden;
  ga->tp = ctx->par.tp;
  ga->group = ctx->group;
  ga->rank = ctx->rank;
  ga->world = ctx->world;
  ga->state = ctx->call_state;
  ga->done = ctx->gather_done;
  ga->err = ctx->err;
  ga->timeout_ns = (uint64_t)ctx->timeout_ms * 1000000ull;
}

static void tw__tp_reduce_args_init(const struct tw_tp_context* ctx, tw_reduce_args* ra) {
  memset(ra, 0, sizeof *ra);
  ra->lay = ctx->lay;
  ra->peers = ctx->peers;
  ra->local_win = (char*)ctx->win.local;
  ra->c = ctx->red;
  ra->hidden = ctx->problem.hidden;
  ra->top_k = ctx->problem.top_k;
  ra->col_tiles = ctx->col_tiles;
  ra->rank = ctx->rank;
  ra->world = ctx->world;
  ra->done = ctx->reduce_done;
  ra->state = ctx->call_state;
  ra->err = ctx->err;
  ra->timeout_ns = (uint64_t)ctx->timeout_ms * 1000000ull;
}

/* Launches every kernel of a call once on tiny inputs (lazy loading: context.cu's file comment),
 * with no waits and no signals to any peer. */
static tw_status tw__tp_warm_up(struct tw_tp_context* ctx) {
  const int64_t K = ctx->ffn_slice;
  void *a = NULL, *b = NULL, *c = NULL;
  tw_tile* tile = NULL;
  tw_status st = TW_SUCCESS;
  cudaError_t e = cudaMalloc(&a, (size_t)ctx->tm * K * 2);
  if (e == cudaSuccess) e = cudaMalloc(&b, (size_t)ctx->tn * K * 2);
  if (e == cudaSuccess) e = cudaMalloc(&c, (size_t)ctx->tm * ctx->tn * 2);
  if (e == cudaSuccess) e = cudaMalloc((void**)&tile, sizeof(tw_tile));
  if (e == cudaSuccess) e = cudaMemsetAsync(a, 0, (size_t)ctx->tm * K * 2, ctx->s_aux);
  if (e == cudaSuccess) e = cudaMemsetAsync(b, 0, (size_t)ctx->tn * K * 2, ctx->s_aux);
  tw_tile h_tile;
  memset(&h_tile, 0, sizeof h_tile);
  h_tile.rows = ctx->tm;
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(tile, &h_tile, sizeof h_tile, cudaMemcpyHostToDevice, ctx->s_aux);
  if (e != cudaSuccess) {
    st = tw__fail(TW_ERR_OUT_OF_MEMORY, "tw_tp_context_create: warm-up buffers: %s",
                  cudaGetErrorString(e));
  } else {
    tw_gemm_args g;
    const tw_gemm_shape shape = {ctx->tm, (int32_t)K, ctx->tn, 1, ctx->tm, ctx->tn};
    /* The warm-up's counter: the (zero) GatherRS completion word, back to zero below. */
    st = tw__gemm_args_init(&g, &shape, a, b, c, tile, 1, 1, TW_SIGNAL_SYS, ctx->gather_done);
    if (st == TW_SUCCESS) st = tw__gemm_launch(&g, ctx->s_aux);
    if (st == TW_SUCCESS)
      st = tw__call_begin_launch(ctx->warm_state, ctx->recv_units, 1, ctx->gather_done, 1, NULL, 0,
                                 0, ctx->s_aux);
    /* World 1, no tiles: no credit wait, no arrivals. */
    tw_gatherrs_args ga;
    tw__tp_gather_args_init(ctx, &ga);
    ga.tp = 1;
    ga.group = 0;
    ga.rank = 0;
    ga.world = 1;
    ga.state = ctx->warm_state;
    if (st == TW_SUCCESS) st = tw__gatherrs_launch(&ga, 1, ctx->s_aux);
    tw_reduce_args ra;
    tw__tp_reduce_args_init(ctx, &ra);
    ra.rank = 0;
    ra.world = 1;
    ra.state = ctx->warm_state;
    int32_t grid = 0, cap = 0;
    if (st == TW_SUCCESS) st = tw__reduce_launch(&ra, 1, 1, &grid, &cap, ctx->s_aux);
    /* The poisoning kernel tests run between calls (context.cu's warm-up does the same). */
    if (st == TW_SUCCESS) st = tw__fill_bf16(c, 1, 0, ctx->s_aux);
    e = cudaStreamSynchronize(ctx->s_aux);
    if (st == TW_SUCCESS && e != cudaSuccess)
      st = tw__fail(TW_ERR_CUDA, "tw_tp_context_create: warm-up kernels failed: %s",
                    cudaGetErrorString(e));
  }
  cudaStreamSynchronize(ctx->s_aux);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  cudaFree(tile);
  return st;
}

/* Sizes, window, state, streams, warm-up; collective. */
static tw_status tw__tp_context_init(struct tw_tp_context* ctx) {
  const tw_problem* p = &ctx->problem;
  const int64_t H = p->hidden, W = ctx->world, ep = ctx->par.ep, E = ctx->local_experts;
  /* One block is the layout of an EP rank in the EP world of ep ranks (context.cu's bound with
   * W = ep and experts / ep local experts). */
  const int64_t kk = p->top_k < E ? p->top_k : E;
  const int64_t max_rows_tokens = ep * (int64_t)p->max_tokens * kk;
  const int64_t bands_block = max_rows_tokens / ctx->tm + E * ep + 1;
  ctx->block_rows_max = max_rows_tokens + E * ep * (ctx->tm - 1) + ctx->tm;
  ctx->rows_max = ctx->par.tp * ctx->block_rows_max;
  ctx->tiles_max = ctx->par.tp * bands_block * ctx->col_tiles;
  int64_t chunks = 0; /* column chunks of all splits */
  const int64_t split_cols = (int64_t)(ctx->col_tiles / ctx->par.splits) * ctx->tn;
  for (int32_t s = 0; s < ctx->par.splits; s++) {
    const int64_t c0 = s * split_cols, c1 = c0 + split_cols < H ? c0 + split_cols : H;
    chunks += tw__ceil_div(c1 - c0, ctx->par.comm_tile_n);
  }
  ctx->comm_tiles_max = (ctx->block_rows_max / ctx->par.comm_tile_m + 1) * chunks;
  ctx->slots_max = (int64_t)p->max_tokens * p->top_k;
  ctx->recv_rows_max = ctx->slots_max;
  if (ctx->rows_max > INT32_MAX || ctx->tiles_max > INT32_MAX || ctx->comm_tiles_max > INT32_MAX)
    return tw__fail(TW_ERR_CAPACITY,
                    "tw_tp_context_create: max_tokens %d gives up to %lld rows per rank over %d "
                    "blocks, beyond the int32 indices of the plan; lower max_tokens",
                    p->max_tokens, (long long)ctx->rows_max, ctx->par.tp);

  tw_window_layout* L = &ctx->lay;
  memset(L, 0, sizeof *L);
  L->data = 0;
  ctx->part_off =
      tw__align((uint64_t)(ctx->recv_rows_max > 0 ? ctx->recv_rows_max : 1) * H * 2, 4096);
  ctx->seg_off = ctx->part_off + tw__align((uint64_t)ctx->rows_max * H * 2, 4096);
  L->arrive = ctx->seg_off + tw__align((uint64_t)ctx->col_tiles * 4, 128);
  L->credit = L->arrive + tw__align((uint64_t)W * 4, 128);
  L->tags = L->hits = L->credit + tw__align((uint64_t)W * 4, 128); /* no debug tags: empty */
  L->bytes = tw__align(L->tags, 4096);

  TW_CUDA_TRY(cudaStreamCreateWithFlags(&ctx->s_comm, cudaStreamNonBlocking));
  TW_CUDA_TRY(cudaStreamCreateWithFlags(&ctx->s_aux, cudaStreamNonBlocking));
  cudaEvent_t* evs[] = {&ctx->ev_start, &ctx->ev_gemm_done, &ctx->ev_comm_done, &ctx->ev_call_done,
                        &ctx->ev_err_copied};
  for (size_t i = 0; i < sizeof evs / sizeof evs[0]; i++)
    TW_CUDA_TRY(cudaEventCreateWithFlags(evs[i], cudaEventDisableTiming));

  /* Collective, zero-filled: every counter starts at 0. */
  TW_TRY(ctx->team->ops->window_create(ctx->team, L->bytes, &ctx->win));
  TW_CUDA_TRY(cudaMalloc((void**)&ctx->peers, sizeof(char*) * (size_t)W));
  TW_CUDA_TRY(
      cudaMemcpy(ctx->peers, ctx->win.peers, sizeof(char*) * (size_t)W, cudaMemcpyHostToDevice));
  cudaError_t e = cudaMalloc((void**)&ctx->red, (size_t)ctx->block_rows_max * H * 2);
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_OUT_OF_MEMORY,
                    "tw_tp_context_create: reduced rows (%lld x %lld bf16): %s; lower max_tokens",
                    (long long)ctx->block_rows_max, (long long)H, cudaGetErrorString(e));
  /* The small state, each piece on its own 128-byte lines; the first `zeroed` bytes are what the
   * warm-up leaves to be zeroed again (everything but recv_units). */
  const size_t o_call = 0, o_warm = tw__align(sizeof(tw_call_state), 128);
  const size_t o_err = o_warm + tw__align(sizeof(tw_call_state), 128);
  const size_t o_gdone = o_err + tw__align(sizeof(tw_dev_error), 128);
  const size_t o_rdone = o_gdone + 128, zeroed = o_rdone + 128;
  const size_t state_bytes = zeroed + tw__align((uint64_t)W * 4, 128);
  TW_CUDA_TRY(cudaMalloc((void**)&ctx->state_mem, state_bytes));
  ctx->call_state = (tw_call_state*)(ctx->state_mem + o_call);
  ctx->warm_state = (tw_call_state*)(ctx->state_mem + o_warm);
  ctx->err = (tw_dev_error*)(ctx->state_mem + o_err);
  ctx->gather_done = (uint32_t*)(ctx->state_mem + o_gdone);
  ctx->reduce_done = (uint32_t*)(ctx->state_mem + o_rdone);
  ctx->recv_units = (uint32_t*)(ctx->state_mem + zeroed);
  TW_CUDA_TRY(cudaMemsetAsync(ctx->state_mem, 0, state_bytes, ctx->s_aux));
  uint32_t units[TW_MAX_RANKS];
  for (int32_t s = 0; s < ctx->world; s++) units[s] = s == ctx->rank ? 0u : 1u;
  TW_CUDA_TRY(
      cudaMemcpyAsync(ctx->recv_units, units, (size_t)W * 4, cudaMemcpyHostToDevice, ctx->s_aux));
  TW_CUDA_TRY(cudaHostAlloc((void**)&ctx->h_err, sizeof(tw_dev_error), cudaHostAllocDefault));
  memset(ctx->h_err, 0, sizeof(tw_dev_error));
  TW_CUDA_TRY(cudaStreamSynchronize(ctx->s_aux));

  if (ctx->team->shared_gpu) { /* context.cu: the budgets of one GPU's ranks must all fit */
    int64_t budget = ctx->sm_budget;
    TW_TRY(tw__team_sum_i64(ctx->team, &budget, 1));
    if (budget > ctx->sm_count)
      return tw__fail(TW_ERR_UNSUPPORTED,
                      "tw_tp_context_create: the %d ranks on this GPU ask for %lld SMs in all "
                      "(this rank %d), more than its %d; give each rank sm_budget <= %d (0 picks "
                      "that)",
                      ctx->world, (long long)budget, ctx->sm_budget, ctx->sm_count,
                      ctx->sm_count / ctx->world);
  }
  TW_TRY(tw__tp_warm_up(ctx));
  /* The warm-up's producer counted into gather_done and its call begin zeroed it again; zero
   * everything once more so that the first call starts from a clean state. */
  TW_CUDA_TRY(cudaMemsetAsync(ctx->state_mem, 0, zeroed, ctx->s_aux));
  TW_CUDA_TRY(cudaStreamSynchronize(ctx->s_aux));
  /* Nobody may write into a peer's window before that peer has created it. */
  TW_TRY(tw__team_barrier(ctx->team));
  return TW_SUCCESS;
}

/* Everything of creation after the team view (owned from here on, released on failure). */
static tw_status tw__tp_context_create(const tw_problem* problem, const tw_parallel* parallel,
                                       tw__team* team, const tw_context_config* config,
                                       tw_tp_context_t* out) {
  tw_parallel par;
  tw_status st = tw__parallel_resolve(problem, parallel, &par);
  tw_context_config cfg = TW_CONTEXT_CONFIG_INIT;
  if (st == TW_SUCCESS && config != NULL) {
    st = tw__check_header("tw_context_config", config->size, sizeof(tw_context_config),
                          config->magic, TW_CONTEXT_CONFIG_MAGIC, config->version);
    if (st == TW_SUCCESS) cfg = *config;
  }
  if (st == TW_SUCCESS && team->world != problem->world_size)
    st = tw__fail(TW_ERR_INVALID_ARGUMENT,
                  "tw_tp_context_create: problem world_size %d (tp %d x ep %d) but the %s team "
                  "has %d ranks; the team must hold the whole TP x EP world",
                  problem->world_size, par.tp, par.ep, team->kind, team->world);
  if (st == TW_SUCCESS && (cfg.timeout_ms < 0 || cfg.max_comm_ctas < 0 ||
                           cfg.max_comm_ctas > TW_MAX_COMM_CTAS || cfg.sm_budget < 0))
    st = tw__fail(TW_ERR_INVALID_ARGUMENT,
                  "tw_tp_context_create: config timeout_ms %d (>= 0), max_comm_ctas %d (0..%d), "
                  "sm_budget %d (>= 0): one is out of range",
                  cfg.timeout_ms, cfg.max_comm_ctas, TW_MAX_COMM_CTAS, cfg.sm_budget);
  if (st == TW_SUCCESS) {
    const char* what = cfg.dataflow == TW_DATAFLOW_ADD       ? "the add dataflow (dataflow = ADD)"
                       : cfg.debug_tags                      ? "debug tags (debug_tags)"
                       : cfg.timing                          ? "timing events (timing)"
                       : cfg.dispatch || cfg.layer           ? "the dispatch and the layer calls"
                       : cfg.unit_tiles || cfg.consumer_copy ? "the EP consumer's unit_tiles and "
                                                               "consumer_copy"
                                                             : NULL;
    if (what != NULL)
      st = tw__fail(TW_ERR_UNSUPPORTED,
                    "tw_tp_context_create: a TP context has no %s; leave that field 0 (only "
                    "timeout_ms, max_comm_ctas and sm_budget apply)",
                    what);
  }
  const int32_t budget = cfg.sm_budget > 0 ? cfg.sm_budget : team->default_budget;
  if (st == TW_SUCCESS && (budget < 2 || budget > team->sm_count))
    st = tw__fail(TW_ERR_INVALID_ARGUMENT,
                  "tw_tp_context_create: sm_budget %d (%d resolved); must be 2..%d, the GPU's SMs "
                  "(one producer and one GatherRS SM), or 0 for the default (%d)",
                  cfg.sm_budget, budget, team->sm_count, team->default_budget);
  struct tw_tp_context* ctx = NULL;
  if (st == TW_SUCCESS) {
    ctx = (struct tw_tp_context*)calloc(1, sizeof *ctx);
    if (ctx == NULL)
      st = tw__fail(TW_ERR_OUT_OF_MEMORY, "tw_tp_context_create: out of host memory");
  }
  if (st != TW_SUCCESS) {
    team->ops->release(team);
    return st;
  }
  ctx->problem = *problem;
  ctx->par = par;
  ctx->team = team;
  ctx->rank = team->rank;
  ctx->world = team->world;
  ctx->device = team->device;
  ctx->sm_count = team->sm_count;
  ctx->sm_budget = budget;
  const int64_t tmo =
      cfg.timeout_ms > 0 ? cfg.timeout_ms : tw__tunable_int_lenient(TW_TUNE_TIMEOUT_MS, 0);
  ctx->timeout_ms = (int32_t)(tmo > 0 && tmo < INT32_MAX ? tmo : TW_DEFAULT_TIMEOUT_MS);
  ctx->max_comm_ctas = cfg.max_comm_ctas > 0 ? cfg.max_comm_ctas : TW_MAX_COMM_CTAS;
  if (ctx->max_comm_ctas >= budget) ctx->max_comm_ctas = budget - 1;
  ctx->group = ctx->rank / par.tp;
  ctx->tp_index = ctx->rank % par.tp;
  ctx->local_experts = problem->experts / par.ep;
  ctx->ffn_slice = problem->ffn / par.tp;
  ctx->tm = tw__resolve_tile_m(problem);
  ctx->tn = tw__resolve_tile_n(problem);
  ctx->col_tiles = (int32_t)tw__ceil_div(problem->hidden, ctx->tn);
  {
    tw__device_guard guard(ctx->device);
    st = guard.status == cudaSuccess
             ? TW_SUCCESS
             : tw__fail(TW_ERR_CUDA, "tw_tp_context_create: cudaSetDevice(%d): %s", ctx->device,
                        cudaGetErrorString(guard.status));
    /* Every rank must run the same problem and parallel: compare max of v and of -v. */
    int64_t v[16] = {problem->hidden,
                     -problem->hidden,
                     problem->ffn,
                     -problem->ffn,
                     problem->experts,
                     -problem->experts,
                     problem->top_k,
                     -problem->top_k,
                     problem->max_tokens,
                     -problem->max_tokens,
                     par.tp,
                     -par.tp,
                     par.splits,
                     -par.splits,
                     (int64_t)par.comm_tile_m << 32 | par.comm_tile_n,
                     -((int64_t)par.comm_tile_m << 32 | par.comm_tile_n)};
    int64_t mine[16];
    memcpy(mine, v, sizeof v);
    if (st == TW_SUCCESS) st = tw__team_max_i64(team, v, 16);
    if (st == TW_SUCCESS && memcmp(v, mine, sizeof v) != 0)
      st = tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_tp_context_create: the ranks' problems or tw_parallel differ (hidden, ffn, "
                    "experts, top_k, max_tokens, tp, splits or comm tiles); every rank must pass "
                    "the same");
    if (st == TW_SUCCESS) st = tw__tp_context_init(ctx);
  }
  if (st != TW_SUCCESS) {
    tw__tp_context_free(ctx);
    return st;
  }
  TW_INFO(
      "tp context: rank %d/%d = (group %d, tp index %d) of tp %d x ep %d, %d of %d SMs, window "
      "%llu bytes",
      ctx->rank, ctx->world, ctx->group, ctx->tp_index, par.tp, par.ep, ctx->sm_budget,
      ctx->sm_count, (unsigned long long)ctx->lay.bytes);
  *out = ctx;
  return TW_SUCCESS;
}

extern "C" tw_status tw_tp_context_create(const tw_problem* problem, const tw_parallel* parallel,
                                          ncclComm_t comm, const tw_context_config* config,
                                          tw_tp_context_t* out) {
  tw__clear_error();
  TW_CHECK_NULL(out);
  *out = NULL;
  TW_CHECK_NULL(problem);
  TW_CHECK_NULL(parallel);
  TW_CHECK_NULL(comm);
  TW_TRY(tw_parallel_validate(problem, parallel));
  tw__team* team = NULL;
  TW_TRY(tw__team_nccl_create(comm, &team));
  return tw__tp_context_create(problem, parallel, team, config, out);
}

extern "C" tw_status tw_tp_context_create_on_team(const tw_problem* problem,
                                                  const tw_parallel* parallel, tw_team_t team,
                                                  int32_t rank, const tw_context_config* config,
                                                  tw_tp_context_t* out) {
  tw__clear_error();
  TW_CHECK_NULL(out);
  *out = NULL;
  TW_CHECK_NULL(problem);
  TW_CHECK_NULL(parallel);
  TW_CHECK_NULL(team);
  TW_TRY(tw_parallel_validate(problem, parallel));
  tw__team* view = NULL;
  TW_TRY(tw__team_local_join(team, rank, &view));
  const cudaError_t e = cudaSetDevice(view->device);
  if (e != cudaSuccess) {
    view->ops->release(view);
    return tw__fail(TW_ERR_CUDA, "tw_tp_context_create_on_team: cudaSetDevice(%d): %s",
                    view->device, cudaGetErrorString(e));
  }
  return tw__tp_context_create(problem, parallel, view, config, out);
}

extern "C" tw_status tw_tp_context_destroy(tw_tp_context_t ctx) {
  tw__clear_error();
  if (ctx == NULL) return TW_SUCCESS;
  tw_status st = TW_SUCCESS;
  {
    tw__device_guard guard(ctx->device);
    st = tw__tp_sync_all(ctx);
    tw__tp_context_free(ctx);
  }
  return st;
}

extern "C" tw_status tw_tp_context_check(tw_tp_context_t ctx) {
  tw__clear_error();
  TW_CHECK_NULL(ctx);
  TW_DEVICE_SCOPE(ctx);
  tw_status st = ctx->team->ops->state(ctx->team);
  if (st != TW_SUCCESS) {
    ctx->failed = 1;
    return st;
  }
  TW_TRY(tw__tp_sync_all(ctx));
  TW_CUDA_TRY(cudaMemcpyAsync(ctx->h_err, ctx->err, sizeof(tw_dev_error), cudaMemcpyDeviceToHost,
                              ctx->s_aux));
  TW_CUDA_TRY(cudaStreamSynchronize(ctx->s_aux));
  tw_dev_error all[TW_MAX_RANKS];
  st = ctx->team->ops->allgather(ctx->team, ctx->h_err, all, sizeof(tw_dev_error));
  if (st != TW_SUCCESS) {
    ctx->failed = 1;
    return st;
  }
  int failing = 0, first = -1;
  for (int r = 0; r < ctx->world; r++)
    if (all[r].status != 0) {
      failing++;
      if (first < 0) first = r;
    }
  if (first < 0) {
    if (ctx->failed)
      return tw__fail(TW_ERR_STATE,
                      "tw_tp_context_check: an earlier call failed after part of it was "
                      "enqueued; destroy the TP context on every rank");
    return TW_SUCCESS;
  }
  ctx->failed = 1;
  char how[96];
  snprintf(how, sizeof how, "tw_tp_context_check: %d of %d ranks failed; first", failing,
           ctx->world);
  return tw__tp_report(ctx, &all[first], how);
}

/* ---- device plans -----------------------------------------------------------------------------
 */

extern "C" tw_status tw_tp_device_plan_create(tw_tp_context_t ctx, tw_tp_device_plan_t* out) {
  tw__clear_error();
  TW_CHECK_NULL(out);
  *out = NULL;
  TW_CHECK_NULL(ctx);
  TW_DEVICE_SCOPE(ctx);
  const size_t o_tiles = 0;
  const size_t o_comm = tw__align(o_tiles + (size_t)ctx->tiles_max * sizeof(tw_tile), 256);
  const size_t o_rank =
      tw__align(o_comm + (size_t)ctx->comm_tiles_max * sizeof(tw_tp_comm_tile), 256);
  const size_t o_row = tw__align(o_rank + (size_t)ctx->block_rows_max * 4, 256);
  const size_t o_slot = tw__align(o_row + (size_t)ctx->block_rows_max * 4, 256);
  const size_t o_w = tw__align(o_slot + (size_t)ctx->slots_max * 4 + 4, 256);
  const size_t bytes = tw__align(o_w + (size_t)ctx->slots_max * 4 + 4, 256);
  struct tw_tp_device_plan* d = (struct tw_tp_device_plan*)calloc(1, sizeof *d);
  if (d == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "tw_tp_device_plan_create: host memory");
  const cudaError_t e = cudaMalloc(&d->mem, bytes);
  if (e != cudaSuccess) {
    free(d);
    return tw__fail(TW_ERR_OUT_OF_MEMORY, "tw_tp_device_plan_create: %zu bytes: %s", bytes,
                    cudaGetErrorString(e));
  }
  char* m = (char*)d->mem;
  d->ctx = ctx;
  d->tiles = (tw_tile*)(m + o_tiles);
  d->comm_tiles = (tw_tp_comm_tile*)(m + o_comm);
  d->dst_rank = (int32_t*)(m + o_rank);
  d->dst_row = (int32_t*)(m + o_row);
  d->slot_row = (int32_t*)(m + o_slot);
  d->weights = (float*)(m + o_w);
  *out = d;
  return TW_SUCCESS;
}

extern "C" tw_status tw_tp_device_plan_destroy(tw_tp_device_plan_t d) {
  tw__clear_error();
  if (d == NULL) return TW_SUCCESS;
  {
    tw__device_guard guard(d->ctx->device);
    cudaFree(d->mem);
  }
  free(d);
  return TW_SUCCESS;
}

extern "C" tw_status tw_tp_device_plan_upload(tw_tp_device_plan_t d, tw_tp_plan_t plan,
                                              tw_routing_t routing, cudaStream_t stream) {
  tw__clear_error();
  TW_CHECK_NULL(d);
  TW_CHECK_NULL(plan);
  TW_CHECK_NULL(routing);
  struct tw_tp_context* ctx = d->ctx;
  const struct tw_tp_plan* pl = plan;
  const tw_problem* p = &ctx->problem;
  const tw_problem* q = &pl->problem;
  if (pl->rank != ctx->rank)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_tp_device_plan_upload: the plan is rank %d's, the context rank %d's; "
                    "plan with tw_tp_plan_create(..., rank = %d, ...)",
                    pl->rank, ctx->rank, ctx->rank);
  if (q->world_size != p->world_size || q->hidden != p->hidden || q->ffn != p->ffn ||
      q->experts != p->experts || q->top_k != p->top_k || q->max_tokens != p->max_tokens ||
      pl->tm != ctx->tm || pl->tn != ctx->tn)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_tp_device_plan_upload: the plan's problem (world %d, hidden %d, ffn %d, "
                    "experts %d, top_k %d, max_tokens %d) is not the context's (%d, %d, %d, %d, "
                    "%d, %d); plan with the context's problem",
                    q->world_size, q->hidden, q->ffn, q->experts, q->top_k, q->max_tokens,
                    p->world_size, p->hidden, p->ffn, p->experts, p->top_k, p->max_tokens);
  if (pl->par.tp != ctx->par.tp || pl->par.ep != ctx->par.ep || pl->par.splits != ctx->par.splits ||
      pl->par.comm_tile_m != ctx->par.comm_tile_m || pl->par.comm_tile_n != ctx->par.comm_tile_n)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_tp_device_plan_upload: the plan's tw_parallel (tp %d, ep %d, splits %d, "
                    "comm tile %d x %d) is not the context's (%d, %d, %d, %d x %d); plan with the "
                    "context's",
                    pl->par.tp, pl->par.ep, pl->par.splits, pl->par.comm_tile_m,
                    pl->par.comm_tile_n, ctx->par.tp, ctx->par.ep, ctx->par.splits,
                    ctx->par.comm_tile_m, ctx->par.comm_tile_n);
  const struct tw_plan* ep = pl->ep_plan;
  const int32_t R0 = pl->block_row0[pl->tp_index];
  const int32_t block_rows = pl->block_row0[pl->tp_index + 1] - R0;
  if (pl->rows > ctx->rows_max || pl->num_tiles > ctx->tiles_max ||
      pl->num_comm_tiles > ctx->comm_tiles_max || ep->rows != block_rows ||
      block_rows > ctx->block_rows_max || ep->recv_rows > ctx->recv_rows_max ||
      pl->num_segments != ctx->par.splits)
    return tw__fail(TW_ERR_CAPACITY,
                    "tw_tp_device_plan_upload: the plan (%d rows, %d tiles, %d comm tiles, block "
                    "%d rows, %d receive rows) exceeds the context's worst case (%lld, %lld, "
                    "%lld, %lld, %lld) or is inconsistent; plan from a routing within "
                    "max_tokens",
                    pl->rows, pl->num_tiles, pl->num_comm_tiles, block_rows, ep->recv_rows,
                    (long long)ctx->rows_max, (long long)ctx->tiles_max,
                    (long long)ctx->comm_tiles_max, (long long)ctx->block_rows_max,
                    (long long)ctx->recv_rows_max);
  int32_t tokens = 0;
  const int32_t* ids = NULL;
  const float* weights = NULL;
  TW_TRY(tw_routing_rank(routing, ctx->rank, &tokens, &ids, &weights));
  if (tokens > p->max_tokens)
    return tw__fail(TW_ERR_CAPACITY,
                    "tw_tp_device_plan_upload: rank %d has %d tokens, above max_tokens %d",
                    ctx->rank, tokens, p->max_tokens);
  const int64_t nslots = (int64_t)tokens * p->top_k;
  for (int64_t i = 0; i < nslots; i++)
    if (ep->slot_row[i] < 0 || ep->slot_row[i] >= ep->recv_rows + ep->rows)
      return tw__fail(TW_ERR_INTERNAL,
                      "tw_tp_device_plan_upload: slot %lld names row %d, outside the %d receive "
                      "and %d local rows",
                      (long long)i, ep->slot_row[i], ep->recv_rows, ep->rows);
  /* The producer's counters are the splits': every tile names its split in `band`. */
  const int32_t per_split = pl->num_segments > 0 ? pl->segments[0].ntiles : 0;
  for (int32_t s = 0; s < pl->num_segments; s++)
    if (pl->segments[s].ntiles != per_split || pl->segments[s].tile0 != s * per_split)
      return tw__fail(TW_ERR_INTERNAL,
                      "tw_tp_device_plan_upload: split %d has %d tiles, split 0 %d", s,
                      pl->segments[s].ntiles, per_split);
  for (int32_t c = 0; c < pl->num_comm_tiles; c++) {
    const tw_tp_comm_tile* t = &pl->comm_tiles[c];
    if (t->row0 < R0 || t->rows < 1 || t->row0 + t->rows > R0 + block_rows || t->col0 < 0 ||
        t->cols < 8 || t->cols % 8 != 0 || t->col0 % 8 != 0 || t->col0 + t->cols > p->hidden ||
        t->split < 0 || t->split >= pl->num_segments)
      return tw__fail(TW_ERR_INTERNAL, "tw_tp_device_plan_upload: comm tile %d out of its block",
                      c);
  }
  tw_tile* h_tiles = (tw_tile*)malloc(((size_t)pl->num_tiles + 1) * sizeof(tw_tile));
  int32_t* h_dst = (int32_t*)malloc(((size_t)block_rows + 1) * 2 * sizeof(int32_t));
  if (h_tiles == NULL || h_dst == NULL) {
    free(h_tiles);
    free(h_dst);
    return tw__fail(TW_ERR_OUT_OF_MEMORY, "tw_tp_device_plan_upload: host staging");
  }
  for (int32_t i = 0; i < pl->num_tiles; i++) {
    h_tiles[i] = pl->tiles[i];
    h_tiles[i].band = per_split > 0 ? i / per_split : 0;
  }
  tw_status st = tw__tp_plan_destinations(pl, ctx->recv_rows_max, h_dst, h_dst + block_rows);
  {
    tw__device_guard guard(ctx->device);
    d->uploaded = 0;
    /* From pageable memory: each copy has read its source when it returns (the staging may go). */
    cudaError_t e = cudaSuccess;
    if (st == TW_SUCCESS && pl->num_tiles > 0)
      e = cudaMemcpyAsync(d->tiles, h_tiles, (size_t)pl->num_tiles * sizeof(tw_tile),
                          cudaMemcpyHostToDevice, stream);
    if (st == TW_SUCCESS && e == cudaSuccess && pl->num_comm_tiles > 0)
      e = cudaMemcpyAsync(d->comm_tiles, pl->comm_tiles,
                          (size_t)pl->num_comm_tiles * sizeof(tw_tp_comm_tile),
                          cudaMemcpyHostToDevice, stream);
    if (st == TW_SUCCESS && e == cudaSuccess && block_rows > 0) {
      e = cudaMemcpyAsync(d->dst_rank, h_dst, (size_t)block_rows * 4, cudaMemcpyHostToDevice,
                          stream);
      if (e == cudaSuccess)
        e = cudaMemcpyAsync(d->dst_row, h_dst + block_rows, (size_t)block_rows * 4,
                            cudaMemcpyHostToDevice, stream);
    }
    if (st == TW_SUCCESS && e == cudaSuccess && nslots > 0) {
      e = cudaMemcpyAsync(d->slot_row, ep->slot_row, (size_t)nslots * 4, cudaMemcpyHostToDevice,
                          stream);
      if (e == cudaSuccess)
        e = cudaMemcpyAsync(d->weights, weights, (size_t)nslots * 4, cudaMemcpyHostToDevice,
                            stream);
    }
    if (st == TW_SUCCESS && e != cudaSuccess)
      st = tw__fail(TW_ERR_CUDA, "tw_tp_device_plan_upload: copy: %s", cudaGetErrorString(e));
  }
  free(h_tiles);
  free(h_dst);
  if (st != TW_SUCCESS) return st;
  d->rows = pl->rows;
  d->num_tiles = pl->num_tiles;
  d->num_comm_tiles = pl->num_comm_tiles;
  d->tiles_per_split = per_split;
  d->block_row0 = R0;
  d->block_rows = block_rows;
  d->recv_rows = ep->recv_rows;
  d->tokens = tokens;
  d->comm_ctas = pl->tp_comm_ctas;
  d->uploaded = 1;
  return TW_SUCCESS;
}

/* ---- the call ------------------------------------------------------------------------------- */

extern "C" tw_status tw_moe_combine_tp(tw_tp_context_t ctx, tw_tp_device_plan_t d,
                                       const void* expert_in, const void* w2, void* out,
                                       const tw_combine_options* options, cudaStream_t stream) {
  tw__clear_error();
  TW_CHECK_NULL(ctx);
  TW_CHECK_NULL(d);
  tw_combine_options opt = TW_COMBINE_OPTIONS_INIT;
  if (options != NULL) {
    TW_TRY(tw__check_header("tw_combine_options", options->size, sizeof(tw_combine_options),
                            options->magic, TW_COMBINE_OPTIONS_MAGIC, options->version));
    opt = *options;
  }
  if (opt.mode != TW_COMBINE_OVERLAP && opt.mode != TW_COMBINE_UNFUSED)
    return tw__fail(TW_ERR_UNSUPPORTED,
                    "tw_moe_combine_tp: mode %d; the TP call runs TW_COMBINE_OVERLAP or "
                    "TW_COMBINE_UNFUSED (GatherRS after the producer)",
                    (int)opt.mode);
  if (d->ctx != ctx)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_moe_combine_tp: the device plan belongs to another TP context");
  if (!d->uploaded)
    return tw__fail(TW_ERR_STATE,
                    "tw_moe_combine_tp: upload a plan first (tw_tp_device_plan_upload)");
  if (d->rows > 0) {
    TW_CHECK_NULL(expert_in);
    TW_CHECK_NULL(w2);
  }
  if (d->tokens > 0) TW_CHECK_NULL(out);
  if (((uintptr_t)expert_in | (uintptr_t)w2 | (uintptr_t)out) % 16 != 0)
    return tw__fail(TW_ERR_ALIGNMENT,
                    "tw_moe_combine_tp: expert_in, w2 and out must be 16-byte aligned");
  if (ctx->failed)
    return tw__fail(TW_ERR_STATE,
                    "tw_moe_combine_tp: an earlier call failed; destroy the TP context on every "
                    "rank and create another");
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  TW_CUDA_TRY(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone)
    return tw__fail(TW_ERR_UNSUPPORTED,
                    "tw_moe_combine_tp: a TP call cannot be captured in a CUDA graph (its split "
                    "counters' targets are the host's); call it eagerly");
  if (ctx->have_call && cudaEventQuery(ctx->ev_err_copied) == cudaSuccess &&
      ctx->h_err->status != 0) {
    ctx->failed = 1;
    return tw__tp_report(ctx, ctx->h_err, "tw_moe_combine_tp: an earlier call failed");
  }
  int32_t budget = 0;
  TW_TRY(tw__call_budget("tw_moe_combine_tp", opt.sm_budget, ctx->sm_budget, &budget));
  if (opt.comm_ctas < 0 || opt.comm_ctas > ctx->max_comm_ctas)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_moe_combine_tp: comm_ctas %d; must be 0 (the plan's) or 1..%d (the "
                    "context's max_comm_ctas)",
                    opt.comm_ctas, ctx->max_comm_ctas);
  /* The plan's C, but no more CTAs than GatherRS tiles (the rest would only exit; the producer
   * gets their SMs), and at least one (0 when tp = 1 or the block is empty: one CTA still
   * announces the call). */
  int C = opt.comm_ctas > 0 ? opt.comm_ctas : d->comm_ctas;
  if (opt.comm_ctas == 0 && C > d->num_comm_tiles) C = d->num_comm_tiles;
  if (C < 1) C = 1;
  if (opt.comm_ctas == 0 && C > ctx->max_comm_ctas) C = ctx->max_comm_ctas;
  if (C >= budget)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_moe_combine_tp: %d GatherRS CTAs leave none of the call's %d SMs to the "
                    "producer; plan with tw_plan_config.sm_budget = %d, or pass a smaller "
                    "comm_ctas",
                    C, budget, budget);
  const int P = budget - C;
  TW_DEVICE_SCOPE(ctx);

  tw_gemm_args g;
  const tw_gemm_shape shape = {d->rows, ctx->ffn_slice, ctx->problem.hidden, ctx->local_experts,
                               ctx->tm, ctx->tn};
  TW_TRY(tw__gemm_args_init(&g, &shape, expert_in, w2, (char*)ctx->win.local + ctx->part_off,
                            d->tiles, d->num_tiles, P, TW_SIGNAL_SYS,
                            (uint32_t*)((char*)ctx->win.local + ctx->seg_off)));

  /* From here on a failure leaves the ranks' counters out of step. */
  ctx->failed = 1;
  if (ctx->have_call) TW_CUDA_TRY(cudaStreamWaitEvent(stream, ctx->ev_call_done, 0));
  TW_TRY(tw__call_begin_launch(ctx->call_state, ctx->recv_units, ctx->world, ctx->gather_done, 0,
                               NULL, 0, 0, stream));
  TW_CUDA_TRY(cudaEventRecord(ctx->ev_start, stream));
  TW_TRY(tw__gemm_launch(&g, stream));
  if (opt.mode == TW_COMBINE_UNFUSED) {
    TW_CUDA_TRY(cudaEventRecord(ctx->ev_gemm_done, stream));
    TW_CUDA_TRY(cudaStreamWaitEvent(ctx->s_comm, ctx->ev_gemm_done, 0));
  } else {
    TW_CUDA_TRY(cudaStreamWaitEvent(ctx->s_comm, ctx->ev_start, 0));
  }
  tw_gatherrs_args ga;
  tw__tp_gather_args_init(ctx, &ga);
  ga.tiles = d->comm_tiles;
  ga.num_tiles = d->num_comm_tiles;
  ga.dst_rank = d->dst_rank;
  ga.dst_row = d->dst_row;
  ga.block_row0 = d->block_row0;
  ga.seg_target = ctx->seg_target + (uint32_t)d->tiles_per_split; /* wraps with the counters */
  TW_TRY(tw__gatherrs_launch(&ga, C, ctx->s_comm));
  TW_CUDA_TRY(cudaEventRecord(ctx->ev_comm_done, ctx->s_comm));
  /* The reduction starts once this rank's GatherRS has ended (combine_call.cu says why). */
  TW_CUDA_TRY(cudaStreamWaitEvent(stream, ctx->ev_comm_done, 0));
  tw_reduce_args ra;
  tw__tp_reduce_args_init(ctx, &ra);
  ra.slot_row = d->slot_row;
  ra.weights = d->weights;
  ra.out = (uint16_t*)out;
  ra.tokens = d->tokens;
  ra.recv_rows = d->recv_rows;
  int32_t grid = 0, cap = 0;
  const int whole_gpu = budget == ctx->sm_count && !ctx->team->shared_gpu;
  TW_TRY(tw__reduce_launch(&ra, budget, whole_gpu ? 0 : 1, &grid, &cap, stream));
  TW_CUDA_TRY(cudaEventRecord(ctx->ev_call_done, stream));
  TW_CUDA_TRY(cudaStreamWaitEvent(ctx->s_aux, ctx->ev_call_done, 0));
  TW_CUDA_TRY(cudaMemcpyAsync(ctx->h_err, ctx->err, sizeof(tw_dev_error), cudaMemcpyDeviceToHost,
                              ctx->s_aux));
  TW_CUDA_TRY(cudaEventRecord(ctx->ev_err_copied, ctx->s_aux));
  ctx->seg_target = ga.seg_target;
  ctx->have_call = 1;
  ctx->failed = 0;
  return TW_SUCCESS;
}
