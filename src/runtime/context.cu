/*
 * context.cu: the life cycle of a tilewave context (one per rank): creation over a team (the
 * caller's NCCL communicator, or an in-process team: team.h), its window, internal streams and
 * counters, the collective check and reset, and the test hooks. device_plan.cu holds the device
 * copies of plans, combine_call.cu the launch sequence of one call.
 *
 * Errors found on the device (a bounded wait that expired, a debug-tag mismatch) land in a
 * device error record; after each call an auxiliary stream copies it to pinned host memory,
 * where the next call looks at it without blocking. tw_context_check() is the collective,
 * blocking way to learn the outcome on every rank.
 *
 * Every kernel is launched once at context creation so that lazy module loading never stalls a
 * launch while another kernel spins (docs/hardware.md).
 */
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "context.h"

/* ---- helpers ------------------------------------------------------------------------------ */

static const char* tw__where_name(int where) {
  switch (where) {
    case TW_WAIT_BAND:
      return "consumer wait for a band's tiles";
    case TW_WAIT_COPY:
      return "consumer wait for a bulk load";
    case TW_WAIT_ARRIVAL:
      return "reduction wait for a source's arrivals";
    case TW_WAIT_CREDIT:
      return "consumer wait for an owner's credit";
    case TW_CHECK_TAGS:
      return "debug-tag check of a received row";
    case TW_CHECK_ARRIVALS:
      return "reduction's count of a source's arrivals";
    case TW_CHECK_PLAN:
      return "reduction's check of a source's plan";
    case TW_CHECK_CONSUMER:
      return "reduction's check of this rank's consumer";
    case TW_WAIT_DISPATCH_CREDIT:
      return "dispatch wait for a destination's credit";
    case TW_WAIT_DISPATCH_ARRIVAL:
      return "dispatch wait for a source's rows";
    case TW_CHECK_CAPACITY:
      return "dispatch capacity of a group";
    case TW_WAIT_BAND_ROWS:
      return "GEMM1 wait for a band's dispatched rows";
    default:
      return "device wait";
  }
}

tw_status tw__report(tw_context_t ctx, const tw_dev_error* e, const char* how) {
  if (e->where == TW_CHECK_ARRIVALS)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "%s: rank %d: %s: source rank %d delivered %u units where this rank's plan "
                    "expects %u in total: the ranks planned this call from different routings or "
                    "problems (every rank must plan from the same routing). Call "
                    "tw_context_reset() on every rank before the next call",
                    how, e->rank, tw__where_name(e->where), e->index, e->seen, e->target);
  if (e->where == TW_CHECK_PLAN)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "%s: rank %d: %s: source rank %d sent rows planned with fingerprint %08x, "
                    "this rank planned the call with %08x: the ranks planned this call from "
                    "different routings, counts or problems (every rank must plan from the same "
                    "one). Call tw_context_reset() on every rank before the next call",
                    how, e->rank, tw__where_name(e->where), e->index, e->seen, e->target);
  if (e->where == TW_CHECK_CONSUMER)
    return tw__fail(TW_ERR_INTERNAL,
                    "%s: rank %d: this call's consumer took %u of its %u units and read call %d "
                    "of the call state: it ran outside its call (a bug; please report it with "
                    "the call's mode and whether it was captured). Call tw_context_reset() on "
                    "every rank before the next call",
                    how, e->rank, e->seen, e->target, e->index);
  if (e->where == TW_CHECK_CAPACITY)
    return tw__fail(TW_ERR_CAPACITY,
                    "%s: rank %d: token %d (slot %d) is one more row for expert %u than its "
                    "capacity of %u rows per source rank; nothing past the capacity was sent and "
                    "the call's outputs are wrong. Create the contexts with a larger "
                    "tw_context_config.dispatch_capacity, then call tw_context_reset() on every "
                    "rank",
                    how, e->rank, e->index / ctx->problem.top_k, e->index % ctx->problem.top_k,
                    e->seen, e->target);
  if (e->where == TW_CHECK_WEIGHT)
    return tw__fail((tw_status)e->status,
                    "%s: rank %d: topk_weights[%d] (token %d, slot %d) is not finite (bits "
                    "0x%08x); the call's outputs are wrong. Give finite gate weights, then call "
                    "tw_context_reset() on every rank",
                    how, e->rank, e->index, e->index / ctx->problem.top_k,
                    e->index % ctx->problem.top_k, e->seen);
  if (e->where == TW_CHECK_ID &&
      (e->status == TW_ERR_EXPERT_ID || e->status == TW_ERR_DUPLICATE_EXPERT))
    return tw__fail(
        (tw_status)e->status,
        "%s: rank %d: topk_ids[%d] (token %d, slot %d) = %u is %s; its rows were not "
        "sent and the call's outputs are wrong. Fix the ids, then call "
        "tw_context_reset() on every rank",
        how, e->rank, e->index, e->index / ctx->problem.top_k, e->index % ctx->problem.top_k,
        e->seen,
        e->status == TW_ERR_EXPERT_ID ? "outside the experts" : "an expert the token names twice");
  tw_status s = e->status == TW_ERR_INTERNAL ? TW_ERR_INTERNAL : TW_ERR_TIMEOUT;
  if (e->where == TW_CHECK_ID)
    return tw__fail(s,
                    "%s: rank %d: the dispatch's place pass met expert id %u at slot %d, outside "
                    "0..%u, after its count pass had accepted every id; a bug (or topk_ids "
                    "changed during the call). Call tw_context_reset() before the next call",
                    how, e->rank, e->seen, e->index, e->target - 1);
  if (e->where == TW_WAIT_BAND_ROWS)
    return tw__fail(s,
                    "%s: rank %d: GEMM1 waited %d ms for band counter %d: %u of its %u rows "
                    "arrived. A source rank's dispatch did not send them (it did not take part, "
                    "failed, or planned from other counts), or the timeout (TW_TIMEOUT_MS) is too "
                    "short. Call tw_context_reset() on every rank before the next call",
                    how, e->rank, ctx->timeout_ms, e->index, e->seen, e->target);
  if (e->where == TW_CHECK_TAGS)
    return tw__fail(s,
                    "%s: rank %d: %s: (token, slot) %d: row arrived %u times per column tile's "
                    "worth, expected %u; the combine plan or the transport is wrong. Call "
                    "tw_context_reset() before the next call",
                    how, e->rank, tw__where_name(e->where), e->index, e->seen, e->target);
  return tw__fail(s,
                  "%s: rank %d: %s (index %d) timed out after %d ms: counter %u, waiting for %u. "
                  "A rank did not take part in the call, a producer did not publish, or the "
                  "timeout (TW_TIMEOUT_MS) is too short for this shape. Call tw_context_reset() "
                  "on every rank before the next call",
                  how, e->rank, tw__where_name(e->where), e->index, ctx->timeout_ms, e->seen,
                  e->target);
}

tw_status tw__sync_all(tw_context_t ctx) {
  if (ctx->have_call) TW_CUDA_TRY(cudaEventSynchronize(ctx->ev_call_done));
  TW_CUDA_TRY(cudaStreamSynchronize(ctx->s_comm));
  TW_CUDA_TRY(cudaStreamSynchronize(ctx->s_aux));
  TW_CUDA_TRY(cudaStreamSynchronize(ctx->s_zero));
  return TW_SUCCESS;
}

/* Zeroes every counter, the debug tags and the error record (not the receive rows), and the add
 * dataflow's output buffers (a failed call may have added into either). */
static tw_status tw__zero_state(tw_context_t ctx) {
  TW_CUDA_TRY(cudaStreamSynchronize(ctx->s_zero));
  TW_CUDA_TRY(cudaMemsetAsync((char*)ctx->win.local + ctx->lay.arrive, 0,
                              ctx->lay.bytes - ctx->lay.arrive, ctx->s_aux));
  if (ctx->lay.out_bytes > 0)
    TW_CUDA_TRY(cudaMemsetAsync((char*)ctx->win.local + ctx->lay.out, 0, 2 * ctx->lay.out_bytes,
                                ctx->s_aux));
  if (ctx->dispatch) {
    TW_CUDA_TRY(cudaMemsetAsync((char*)ctx->dwin.local + ctx->dlay.credit, 0,
                                ctx->dlay.bytes - ctx->dlay.credit, ctx->s_aux));
    TW_CUDA_TRY(cudaMemsetAsync(ctx->d_done, 0, 4, ctx->s_aux));
    TW_CUDA_TRY(cudaMemsetAsync(ctx->d_epochs, 0, 8, ctx->s_aux));
  }
  ctx->out_buf = -1;
  ctx->dirty_tokens[0] = ctx->dirty_tokens[1] = 0;
  TW_CUDA_TRY(
      cudaMemsetAsync(ctx->unit_next, 0, (kClaimWords + (size_t)ctx->bands_max) * 4, ctx->s_aux));
  TW_CUDA_TRY(cudaMemsetAsync(ctx->reduce_done, 0, 4, ctx->s_aux));
  TW_CUDA_TRY(cudaMemsetAsync(ctx->call_state, 0, sizeof(tw_call_state), ctx->s_aux));
  TW_CUDA_TRY(cudaMemsetAsync(ctx->err, 0, sizeof(tw_dev_error), ctx->s_aux));
  TW_CUDA_TRY(cudaStreamSynchronize(ctx->s_aux));
  memset(ctx->h_err, 0, sizeof(tw_dev_error));
  ctx->epoch = 0;
  ctx->failed = 0;
  ctx->failed_enqueue = 0;
  ctx->have_call = 0;
  ctx->fault = TW_FAULT_NONE;
  return TW_SUCCESS;
}

void tw__consumer_args_init(const struct tw_context* ctx, tw_consumer_args* ca) {
  memset(ca, 0, sizeof *ca);
  ca->peers = ctx->peers;
  ca->lay = ctx->lay;
  ca->local_win = (char*)ctx->win.local;
  ca->c = ctx->c;
  ca->band_counters = ctx->band_counters;
  ca->unit_next = ctx->unit_next;
  ca->col_tiles = ctx->col_tiles;
  ca->tiles_per_unit = ctx->tiles_per_unit;
  ca->unit_chunks = ctx->unit_chunks;
  ca->tail_parts = ctx->tail_parts;
  ca->copy = ctx->copy;
  ca->tn = ctx->tn;
  ca->hidden = ctx->problem.hidden;
  ca->rank = ctx->rank;
  ca->world = ctx->world;
  ca->state = ctx->call_state;
  ca->err = ctx->err;
}

tw_status tw__call_budget(const char* who, int32_t requested, int32_t context_budget,
                          int32_t* budget) {
  *budget = requested > 0 ? requested : context_budget;
  if (requested < 0 || *budget < 2 || *budget > context_budget)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "%s: sm_budget %d; must be 2..%d (the context's sm_budget), or 0 for the "
                    "context's",
                    who, requested, context_budget);
  return TW_SUCCESS;
}

void tw__reduce_args_init(const struct tw_context* ctx, tw_reduce_args* ra) {
  memset(ra, 0, sizeof *ra);
  ra->lay = ctx->lay;
  ra->peers = ctx->peers;
  ra->local_win = (char*)ctx->win.local;
  ra->c = ctx->c;
  ra->hidden = ctx->problem.hidden;
  ra->top_k = ctx->problem.top_k;
  ra->col_tiles = ctx->col_tiles;
  ra->done = ctx->reduce_done;
  ra->state = ctx->call_state;
  ra->err = ctx->err;
}

/* Launches every kernel once (lazy loading; see the file comment) on tiny inputs. */
static tw_status tw__warm_up(tw_context_t ctx) {
  const int64_t F = ctx->problem.ffn;
  void *a = NULL, *b = NULL, *c = NULL, *g1 = NULL;
  tw_tile* tile = NULL;
  uint32_t* counter = NULL;
  tw_status st = TW_SUCCESS;
  cudaError_t e = cudaMalloc(&a, (size_t)ctx->tm * F * 2);
  if (e == cudaSuccess) e = cudaMalloc(&b, (size_t)ctx->tn * F * 2);
  if (e == cudaSuccess) e = cudaMalloc(&c, (size_t)ctx->tm * ctx->tn * 2);
  if (e == cudaSuccess) e = cudaMalloc((void**)&tile, sizeof(tw_tile));
  if (e == cudaSuccess) e = cudaMalloc((void**)&counter, 4);
  /* The layer's GEMM1 on one tile: a (tm, 64), w13 (2 x 128, 64), h (tm, 128), all zeros. */
  const size_t g1_a = (size_t)ctx->tm * 64, g1_w = 2 * (size_t)TW_GEMM1_TN * 64;
  const size_t g1_bytes = (g1_a + g1_w + (size_t)ctx->tm * TW_GEMM1_TN) * 2;
  if (e == cudaSuccess && ctx->layer) e = cudaMalloc(&g1, g1_bytes);
  if (e == cudaSuccess && ctx->layer) e = cudaMemsetAsync(g1, 0, g1_bytes, ctx->s_aux);
  if (e == cudaSuccess) e = cudaMemsetAsync(a, 0, (size_t)ctx->tm * F * 2, ctx->s_aux);
  if (e == cudaSuccess) e = cudaMemsetAsync(b, 0, (size_t)ctx->tn * F * 2, ctx->s_aux);
  /* Nobody reads the band counter, but the producer's release adds to it (initcheck). */
  if (e == cudaSuccess) e = cudaMemsetAsync(counter, 0, 4, ctx->s_aux);
  tw_tile h_tile;
  memset(&h_tile, 0, sizeof h_tile);
  h_tile.rows = ctx->tm;
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(tile, &h_tile, sizeof h_tile, cudaMemcpyHostToDevice, ctx->s_aux);
  if (e != cudaSuccess) {
    st = tw__fail(TW_ERR_OUT_OF_MEMORY, "tw_context_create: warm-up buffers: %s",
                  cudaGetErrorString(e));
    goto done;
  }
  {
    tw_gemm_args g;
    const tw_gemm_shape shape = {ctx->tm, (int32_t)F, ctx->tn, 1, ctx->tm, ctx->tn};
    st = tw__gemm_args_init(&g, &shape, a, b, c, tile, 1, 1, TW_SIGNAL_GPU, counter);
    if (st != TW_SUCCESS) goto done;
    /* The kernel the calls will launch. */
    g.variant = ctx->dataflow == TW_DATAFLOW_ADD ? TW_GEMM_VARIANT_ADD : ctx->gemm_variant;
    st = tw__gemm_launch(&g, ctx->s_aux);
    if (st != TW_SUCCESS) goto done;

    tw_consumer_args ca;
    tw__consumer_args_init(ctx, &ca);
    ca.timeout_ns = 1000000;
    st = tw__consumer_launch(&ca, 1, 0, ctx->s_aux);
    if (st != TW_SUCCESS) goto done;

    /* world = 1: no waits, no credits. */
    tw_reduce_args ra;
    tw__reduce_args_init(ctx, &ra);
    ra.world = 1;
    ra.timeout_ns = 1000000;
    int32_t grid = 0, cap = 0;
    st = tw__reduce_launch(&ra, 1, 1, &grid, &cap, ctx->s_aux);
    if (st != TW_SUCCESS) goto done;
    st = tw__fill_bf16(c, 1, 0, ctx->s_aux);
    if (st != TW_SUCCESS) goto done;
    if (ctx->dispatch) {
      /* 32 slots of expert 0, one per token (a is zero), outputs into c; no waits, no signals
       * (world 0). */
      tw_dispatch_scan_args sa;
      memset(&sa, 0, sizeof sa);
      sa.ids = a;
      sa.slots = 32;
      sa.top_k = 1;
      sa.experts = ctx->problem.experts;
      sa.chunks = 1;
      sa.chunk_slots = 32;
      sa.chunk_hist = ctx->d_chunk_hist;
      sa.counts = ctx->d_counts;
      sa.err = ctx->d_verr;
      st = tw__dispatch_count_launch(&sa, 1, ctx->s_aux);
      if (st != TW_SUCCESS) goto done;
      int32_t* out = (int32_t*)c;
      sa.slot_base = (const int32_t*)a;
      sa.send_row0 = (const int32_t*)a;
      sa.weights_in = (const float*)a;
      sa.slot_row = out;
      sa.send_row = out + 32;
      sa.weights_out = (float*)(out + 64);
      st = tw__dispatch_place_launch(&sa, 1, ctx->s_aux);
      if (st != TW_SUCCESS) goto done;
      tw_dispatch_signal_args sg;
      memset(&sg, 0, sizeof sg);
      sg.peers = ctx->dpeers;
      sg.lay = ctx->dlay;
      sg.err = ctx->err;
      st = tw__dispatch_credit_launch(&sg, ctx->s_aux);
      if (st == TW_SUCCESS) st = tw__dispatch_wait_launch(&sg, ctx->s_aux);
      if (st != TW_SUCCESS) goto done;
      tw_dispatch_copy_args cp;
      memset(&cp, 0, sizeof cp);
      cp.peers = ctx->dpeers;
      cp.lay = ctx->dlay;
      cp.x = (const uint16_t*)a;
      cp.ids = a;
      cp.send_row = out;
      cp.pads = ctx->d_zero;
      cp.top_k = 1;
      cp.hidden = 8;
      cp.local_experts = 1;
      cp.done = ctx->d_done;
      cp.err = ctx->err;
      st = tw__dispatch_copy_launch(&cp, 1, ctx->s_aux);
      if (st != TW_SUCCESS) goto done;
      /* The capturable mode's mask: no bands, no tiles; writes its two counts into c. */
      tw_dispatch_mask_args ma;
      memset(&ma, 0, sizeof ma);
      ma.live = (const uint32_t*)a;
      ma.band_group = ma.band_first = (const int32_t*)a;
      ma.bands = (const tw_band*)a;
      ma.tiles = (const tw_tile*)a;
      ma.live_tiles = (tw_tile*)c;
      ma.band_live = ma.live_counts = (int32_t*)c;
      st = tw__dispatch_mask_launch(&ma, ctx->s_aux);
      if (st != TW_SUCCESS) goto done;
    }
    if (ctx->layer) {
      /* The kernel tw_moe_layer launches (variant 0, the context's band height). */
      uint16_t* g1a = (uint16_t*)g1;
      tw_gemm1_args ga;
      st = tw__gemm1_args_init(&ga, g1a, g1a + g1_a, g1a + g1_a + g1_w, ctx->tm, 64, TW_GEMM1_TN, 1,
                               tile, 1, ctx->tm);
      if (st == TW_SUCCESS) {
        ga.grid = 1;
        st = tw__gemm1_swiglu_launch(&ga, ctx->s_aux);
      }
      if (st != TW_SUCCESS) goto done;
    }
  }
  e = cudaStreamSynchronize(ctx->s_aux);
  if (e != cudaSuccess)
    st = tw__fail(TW_ERR_CUDA, "tw_context_create: warm-up kernels failed: %s",
                  cudaGetErrorString(e));
done:
  cudaStreamSynchronize(ctx->s_aux);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  cudaFree(tile);
  cudaFree(counter);
  cudaFree(g1);
  return st;
}

/* Releases whatever exists; collective when the window exists (bounded: a broken team's window
 * is left to its backend, team.h). While the team has a collective it gave up on still on the
 * device (an NCCL all-gather waiting for a lost rank), device memory is not freed: any free
 * would wait for it. Streams and events are destroyed either way (neither waits). */
static void tw__context_free(tw_context_t ctx) {
  if (ctx == NULL) return;
  int busy = 0;
  if (ctx->team != NULL) {
    if (ctx->dwin.local != NULL) ctx->team->ops->window_destroy(ctx->team, &ctx->dwin);
    if (ctx->win.local != NULL) ctx->team->ops->window_destroy(ctx->team, &ctx->win);
    busy = ctx->team->ops->device_busy(ctx->team);
    if (busy)
      TW_WARN(
          "tw_context_destroy: rank %d: a host collective of the %s team that gave up on a lost "
          "rank is still on the device; the context's device memory is not freed (abort the "
          "communicator before destroying the context to free it)",
          ctx->rank, ctx->team->kind);
    ctx->team->ops->release(ctx->team);
  }
  if (!busy) {
    cudaFree(ctx->c);
    cudaFree(ctx->h);
    cudaFree(ctx->unit_next);
    cudaFree(ctx->peers);
    cudaFree(ctx->dpeers);
    cudaFree(ctx->d_chunk_hist);
    cudaFree(ctx->trace);
    cudaFreeHost(ctx->h_err);
    cudaFreeHost(ctx->h_row);
  }
  free(ctx->h_all);
  if (ctx->ev_counts) cudaEventDestroy(ctx->ev_counts);
  if (ctx->ev_copy_fork) cudaEventDestroy(ctx->ev_copy_fork);
  if (ctx->ev_copy_join) cudaEventDestroy(ctx->ev_copy_join);
  cudaEvent_t* evs[] = {&ctx->ev_start,     &ctx->ev_gemm_done,  &ctx->ev_comm_done,
                        &ctx->ev_call_done, &ctx->ev_err_copied, &ctx->ev_zeroed,
                        &ctx->t_start,      &ctx->t_gemm_end,    &ctx->t_comm_start,
                        &ctx->t_comm_end,   &ctx->t_red_start,   &ctx->t_red_end,
                        &ctx->t_end,        &ctx->t_zero_end};
  for (size_t i = 0; i < sizeof evs / sizeof evs[0]; i++)
    if (*evs[i]) cudaEventDestroy(*evs[i]);
  if (ctx->s_comm) cudaStreamDestroy(ctx->s_comm);
  if (ctx->s_aux) cudaStreamDestroy(ctx->s_aux);
  if (ctx->s_zero) cudaStreamDestroy(ctx->s_zero);
  free(ctx);
}

/* ---- context ------------------------------------------------------------------------------ */

static tw_status tw__context_init(tw_context_t ctx) {
  const tw_problem* p = &ctx->problem;
  const int64_t H = p->hidden, W = ctx->world, E = ctx->local_experts;
  const int64_t kk = p->top_k < E ? p->top_k : E; /* a token's rows on one rank */
  const int64_t max_rows_tokens = W * (int64_t)p->max_tokens * kk;
  ctx->rows_max = max_rows_tokens + E * W * (ctx->tm - 1) + ctx->tm;
  ctx->bands_max = max_rows_tokens / ctx->tm + E * W + 1;
  ctx->slots_max = (int64_t)p->max_tokens * p->top_k;
  ctx->recv_rows_max = ctx->slots_max;
  /* The capturable mode's static plan: E W groups of `capacity` rows, (W - 1) E of them received
   * from the other ranks; every buffer sized by rows_max holds the larger of the two. */
  if (ctx->capacity > 0) {
    const int64_t static_rows = E * W * (int64_t)ctx->capacity;
    if (static_rows > ctx->rows_max) ctx->rows_max = static_rows;
    if (static_rows / ctx->tm > ctx->bands_max) ctx->bands_max = static_rows / ctx->tm;
    if ((W - 1) * E * (int64_t)ctx->capacity > ctx->recv_rows_max)
      ctx->recv_rows_max = (W - 1) * E * (int64_t)ctx->capacity;
  }
  const int64_t gemm1_cols = ctx->layer ? tw__ceil_div(p->ffn, TW_GEMM1_TN) : 0;
  if (ctx->bands_max * ctx->col_tiles > INT32_MAX || ctx->bands_max * gemm1_cols > INT32_MAX ||
      ctx->rows_max > INT32_MAX)
    return tw__fail(TW_ERR_CAPACITY,
                    "tw_context_create: max_tokens %d (and dispatch_capacity) give up to %lld rows "
                    "per rank, beyond the int32 indices of the plan; lower max_tokens or the "
                    "capacity",
                    p->max_tokens, (long long)ctx->rows_max);

  /* Reduce: the receive rows. Add: two output buffers, then the zeros peers copy from (up to 32
   * MiB: a copy-engine copy that long runs near its peak rate, docs/hardware.md). */
  const int add = ctx->dataflow == TW_DATAFLOW_ADD;
  const uint64_t out_bytes =
      tw__align((uint64_t)(p->max_tokens > 0 ? p->max_tokens : 1) * H * 2, 4096);
  tw_window_layout* L = &ctx->lay;
  L->data = 0;
  L->out =
      add ? 0
          : tw__align((uint64_t)(ctx->recv_rows_max > 0 ? ctx->recv_rows_max : 1) * H * 2, 4096);
  L->out_bytes = add ? out_bytes : 0;
  L->zeros = L->out + 2 * L->out_bytes;
  L->zeros_bytes = add && W > 1 ? (out_bytes < (32u << 20) ? out_bytes : (32u << 20)) : 0;
  L->arrive = L->zeros + L->zeros_bytes;
  L->credit = L->arrive + tw__align((uint64_t)W * 4, 128);
  L->ready = L->credit + tw__align((uint64_t)W * 4, 128);
  L->plan_fp = L->ready + 128;
  L->tags = L->plan_fp + tw__align((uint64_t)W * 8, 128);
  L->hits = L->tags + tw__align((uint64_t)ctx->recv_rows_max * 4 + 4, 128);
  L->bytes = tw__align(L->hits + tw__align((uint64_t)ctx->recv_rows_max * 4 + 4, 128), 4096);

  /* Before anything is sized by it, every rank must hold the same problem: a peer sizes its window
   * and output by its own, and rows another rank sends land by offsets from its plan (max of v and
   * of -v tells whether all ranks agree). */
  {
    const tw_problem* q = &ctx->problem;
    const int64_t mine[6] = {q->hidden, q->ffn,        q->experts,
                             q->top_k,  q->max_tokens, (int64_t)ctx->tm << 32 | ctx->tn};
    int64_t v[12];
    for (int i = 0; i < 6; i++) v[2 * i] = mine[i], v[2 * i + 1] = -mine[i];
    TW_TRY(tw__team_max_i64(ctx->team, v, 12));
    for (int i = 0; i < 6; i++)
      if (v[2 * i] != -v[2 * i + 1]) {
        static const char* const names[6] = {
            "hidden", "ffn", "experts", "top_k", "max_tokens", "tile (tile_m << 32 | tile_n)"};
        return tw__fail(TW_ERR_INVALID_ARGUMENT,
                        "tw_context_create: the ranks' problems differ in %s (%lld here, %lld to "
                        "%lld over all ranks); every rank must pass the same problem",
                        names[i], (long long)mine[i], (long long)-v[2 * i + 1],
                        (long long)v[2 * i]);
      }
  }
  /* Every rank must cut bands into the same units (the owners count them) and run the same
   * dataflow: compare (max of v and of -v tells min and max over the ranks). */
  {
    int64_t v[14] = {ctx->tiles_per_unit, -ctx->tiles_per_unit, ctx->tail_bands, -ctx->tail_bands,
                     ctx->tail_parts,     -ctx->tail_parts,     ctx->dataflow,   -ctx->dataflow,
                     ctx->dispatch,       -ctx->dispatch,       ctx->layer,      -ctx->layer,
                     ctx->capacity,       -ctx->capacity};
    int64_t mine[14];
    memcpy(mine, v, sizeof v);
    TW_TRY(tw__team_max_i64(ctx->team, v, 14));
    if (v[0] != mine[0] || v[1] != mine[1])
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "tw_context_create: ranks use different consumer unit widths (%lld here, "
                      "%lld to %lld over all ranks); give every rank the same unit_tiles / "
                      "TW_CONSUMER_TILES_PER_UNIT",
                      (long long)mine[0], (long long)-v[1], (long long)v[0]);
    if (v[2] != mine[2] || v[3] != mine[3] || v[4] != mine[4] || v[5] != mine[5])
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "tw_context_create: ranks split their last bands differently (%lld bands in "
                      "%lld parts here; %lld..%lld bands, %lld..%lld parts over all ranks); give "
                      "every rank the same TW_CONSUMER_TAIL_BANDS and TW_CONSUMER_TAIL_PARTS",
                      (long long)mine[2], (long long)mine[4], (long long)-v[3], (long long)v[2],
                      (long long)-v[5], (long long)v[4]);
    if (v[6] != mine[6] || v[7] != mine[7])
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "tw_context_create: ranks run different combine dataflows (%s here); give "
                      "every rank the same tw_context_config.dataflow / TW_COMBINE_DATAFLOW",
                      tw__dataflow_name(ctx->dataflow));
    if (v[8] != mine[8] || v[9] != mine[9])
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "tw_context_create: tw_context_config.dispatch is %d here but differs on "
                      "another rank; give every rank the same",
                      ctx->dispatch);
    if (v[10] != mine[10] || v[11] != mine[11])
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "tw_context_create: tw_context_config.layer is %d here but differs on "
                      "another rank; give every rank the same",
                      ctx->layer);
    if (v[12] != mine[12] || v[13] != mine[13])
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "tw_context_create: the dispatch capacity is %d rows here (%lld..%lld over "
                      "all ranks); give every rank the same tw_context_config.dispatch_capacity",
                      ctx->capacity, (long long)-v[13], (long long)v[12]);
  }
  TW_CUDA_TRY(cudaStreamCreateWithFlags(&ctx->s_comm, cudaStreamNonBlocking));
  TW_CUDA_TRY(cudaStreamCreateWithFlags(&ctx->s_aux, cudaStreamNonBlocking));
  TW_CUDA_TRY(cudaStreamCreateWithFlags(&ctx->s_zero, cudaStreamNonBlocking));
  cudaEvent_t* sync_evs[] = {&ctx->ev_start,     &ctx->ev_gemm_done,  &ctx->ev_comm_done,
                             &ctx->ev_call_done, &ctx->ev_err_copied, &ctx->ev_zeroed};
  for (size_t i = 0; i < sizeof sync_evs / sizeof sync_evs[0]; i++)
    TW_CUDA_TRY(cudaEventCreateWithFlags(sync_evs[i], cudaEventDisableTiming));
  if (ctx->timing) {
    cudaEvent_t* t_evs[] = {&ctx->t_start,    &ctx->t_gemm_end,  &ctx->t_comm_start,
                            &ctx->t_comm_end, &ctx->t_red_start, &ctx->t_red_end,
                            &ctx->t_end,      &ctx->t_zero_end};
    for (size_t i = 0; i < sizeof t_evs / sizeof t_evs[0]; i++)
      TW_CUDA_TRY(cudaEventCreate(t_evs[i]));
  }

  /* The window (collective; zero-filled), and its peer addresses where the kernels read them. */
  TW_TRY(ctx->team->ops->window_create(ctx->team, L->bytes, &ctx->win));
  TW_CUDA_TRY(cudaMalloc((void**)&ctx->peers, sizeof(char*) * (size_t)W));
  TW_CUDA_TRY(
      cudaMemcpy(ctx->peers, ctx->win.peers, sizeof(char*) * (size_t)W, cudaMemcpyHostToDevice));
  ctx->state_bytes += (int64_t)sizeof(char*) * W;

  /* Dispatch: the expert-input rows peers write (every row a plan can have) and the counters
   * (dispatch.h), in a window of their own; the scan's state; the all-gather's rows. */
  if (ctx->dispatch) {
    tw_dispatch_layout* D = &ctx->dlay;
    D->rows = 0;
    D->credit = tw__align((uint64_t)ctx->rows_max * H * 2, 4096);
    D->arrive = D->credit + tw__align((uint64_t)W * 4, 128);
    D->live = D->arrive + tw__align((uint64_t)W * 4, 128);
    /* The band counters of an overlapped layer (tw_band_counter's bound). */
    D->band_words = ctx->layer ? (uint32_t)(ctx->rows_max / ctx->tm + E + 1) : 0u;
    D->band_arrive = D->live + tw__align((uint64_t)E * W * 4, 128);
    D->bytes = tw__align(D->band_arrive + tw__align((uint64_t)D->band_words * 4, 128), 4096);
    TW_TRY(ctx->team->ops->window_create(ctx->team, D->bytes, &ctx->dwin));
    TW_CUDA_TRY(cudaMalloc((void**)&ctx->dpeers, sizeof(char*) * (size_t)W));
    TW_CUDA_TRY(cudaMemcpy(ctx->dpeers, ctx->dwin.peers, sizeof(char*) * (size_t)W,
                           cudaMemcpyHostToDevice));
    const size_t ET = (size_t)p->experts;
    const size_t hist_bytes = tw__align((uint64_t)TW_DISPATCH_MAX_CHUNKS * ET * 4, 256);
    const size_t counts_bytes = tw__align(ET * 4, 256);
    char* m = NULL;
    TW_CUDA_TRY(cudaMalloc((void**)&m, hist_bytes + counts_bytes + 64));
    ctx->d_chunk_hist = (int32_t*)m;
    ctx->d_counts = (uint32_t*)(m + hist_bytes);
    ctx->d_verr = (tw_dev_error*)(m + hist_bytes + counts_bytes); /* 32 bytes */
    ctx->d_zero = (int32_t*)(m + hist_bytes + counts_bytes + 32);
    ctx->d_done = (uint32_t*)(m + hist_bytes + counts_bytes + 36);
    ctx->d_epochs = (uint32_t*)(m + hist_bytes + counts_bytes + 40); /* 8 bytes */
    TW_CUDA_TRY(cudaMemset(m, 0, hist_bytes + counts_bytes + 64));
    ctx->state_bytes += (int64_t)(sizeof(char*) * (size_t)W + hist_bytes + counts_bytes + 64);
    TW_CUDA_TRY(cudaHostAlloc((void**)&ctx->h_row, (kGatherHead + ET) * 4, cudaHostAllocDefault));
    /* The rows of every rank, then the count matrix (W, experts) taken out of them. */
    ctx->h_all = (int32_t*)malloc((size_t)W * (kGatherHead + 2 * ET) * 4);
    if (ctx->h_all == NULL)
      return tw__fail(TW_ERR_OUT_OF_MEMORY, "tw_context_create: dispatch host buffers");
    TW_CUDA_TRY(cudaEventCreateWithFlags(&ctx->ev_counts, cudaEventDisableTiming));
    TW_CUDA_TRY(cudaEventCreateWithFlags(&ctx->ev_copy_fork, cudaEventDisableTiming));
    TW_CUDA_TRY(cudaEventCreateWithFlags(&ctx->ev_copy_join, cudaEventDisableTiming));
  }

  /* Local buffers: GEMM output, then one block of small state. */
  cudaError_t e = cudaMalloc((void**)&ctx->c, (size_t)ctx->rows_max * H * 2);
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_OUT_OF_MEMORY,
                    "tw_context_create: GEMM output of %lld rows x %lld: %s; lower max_tokens",
                    (long long)ctx->rows_max, (long long)H, cudaGetErrorString(e));
  /* The small state: unit claims and band counters, then (32-word aligned) the call state, the
   * reduction's completion counter, the error record (8 words) and the debug slots. */
  static_assert(sizeof(tw_dev_error) == 32, "tw_dev_error must stay 32 bytes (8 words)");
  const size_t state_words = tw__align(kClaimWords + (uint64_t)ctx->bands_max, 32);
  const size_t call_words = tw__align(sizeof(tw_call_state) / 4, 32);
  const size_t n_state = state_words + call_words + 32 + (size_t)ctx->slots_max;
  e = cudaMalloc((void**)&ctx->unit_next, n_state * 4);
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_OUT_OF_MEMORY, "tw_context_create: %zu bytes of state: %s", n_state * 4,
                    cudaGetErrorString(e));
  ctx->band_counters = ctx->unit_next + kClaimWords;
  ctx->call_state = (tw_call_state*)(ctx->unit_next + state_words);
  uint32_t* next = ctx->unit_next + state_words + call_words;
  ctx->reduce_done = next + 8;
  ctx->err = (tw_dev_error*)(next + 16); /* 32 bytes */
  ctx->debug_slots = next + 32;
  ctx->state_bytes += (int64_t)(n_state * 4);
  /* The layer: GEMM1's output, GEMM2's input. */
  if (ctx->layer) {
    e = cudaMalloc((void**)&ctx->h, (size_t)ctx->rows_max * p->ffn * 2);
    if (e != cudaSuccess)
      return tw__fail(TW_ERR_OUT_OF_MEMORY,
                      "tw_context_create: GEMM1 output of %lld rows x %d: %s; lower max_tokens",
                      (long long)ctx->rows_max, p->ffn, cudaGetErrorString(e));
  }
  TW_CUDA_TRY(cudaHostAlloc((void**)&ctx->h_err, sizeof(tw_dev_error), cudaHostAllocDefault));
  TW_CUDA_TRY(cudaMemsetAsync(ctx->unit_next, 0, n_state * 4, ctx->s_aux));
  TW_CUDA_TRY(cudaStreamSynchronize(ctx->s_aux));

  /* Ranks that share a GPU must all be resident at once, or a rank's spinning consumer or
   * reduction could hold the SMs a peer's producer needs to let it finish: every call keeps
   * within its budget, so the budgets must add up to at most the GPU's SMs. */
  if (ctx->team->shared_gpu) {
    int64_t budget = ctx->sm_budget;
    TW_TRY(tw__team_sum_i64(ctx->team, &budget, 1));
    if (budget > ctx->sm_count)
      return tw__fail(TW_ERR_UNSUPPORTED,
                      "tw_context_create: the %d ranks on this GPU ask for %lld SMs in all (this "
                      "rank %d), more than its %d; give each rank sm_budget <= %d (0 picks that)",
                      ctx->world, (long long)budget, ctx->sm_budget, ctx->sm_count,
                      ctx->sm_count / ctx->world);
  }
  /* TW_ADD_ZEROING=copy zeroes the next output buffer with this rank's copy engine, from the next
   * rank's zeros (a copy within one GPU is a kernel and would wait for the SMs). The
   * zeros stay in every add window whatever the zeroing, so that all ranks' layouts agree. */
  if (ctx->dataflow == TW_DATAFLOW_ADD && W > 1 && !ctx->zero_in_producer) {
    ctx->peer_zeros = (const char*)ctx->win.peers[(ctx->rank + 1) % W] + L->zeros;
  }
  TW_TRY(tw__warm_up(ctx));
  TW_TRY(tw__zero_state(ctx));
  /* Nobody may write into a peer's window before that peer has zeroed it. */
  TW_TRY(tw__team_barrier(ctx->team));
  return TW_SUCCESS;
}

static tw_status tw__context_create_checked(const tw_problem* problem, tw__team* team,
                                            const tw_context_config* config, tw_context_t* out,
                                            int* team_taken) {
  TW_TRY(tw_problem_validate(problem));
  tw_context_config cfg = TW_CONTEXT_CONFIG_INIT;
  if (config != NULL) {
    /* A config that ends before `dataflow`, `sm_budget`, `dispatch`, `layer` or
     * `dispatch_capacity` (built against an
     * earlier tilewave.h) is read up to there; the rest keeps its defaults. */
    const size_t v1_size = offsetof(tw_context_config, dataflow);
    const size_t v2_size = offsetof(tw_context_config, sm_budget);
    const size_t v3_size = offsetof(tw_context_config, dispatch);
    const size_t v4_size = offsetof(tw_context_config, layer);
    const size_t v5_size = offsetof(tw_context_config, dispatch_capacity);
    TW_TRY(tw__check_header("tw_context_config", config->size,
                            config->size == v1_size || config->size == v2_size ||
                                    config->size == v3_size || config->size == v4_size ||
                                    config->size == v5_size
                                ? config->size
                                : sizeof(tw_context_config),
                            config->magic, TW_CONTEXT_CONFIG_MAGIC, config->version));
    memcpy(&cfg, config, config->size);
    cfg.size = sizeof cfg;
  }
  int32_t dataflow = TW_DATAFLOW_REDUCE;
  TW_TRY(tw__dataflow_resolve("tw_context_create", cfg.dataflow, &dataflow));
  if (cfg.timeout_ms < 0 || cfg.debug_tags < 0 || cfg.debug_tags > 1 || cfg.max_comm_ctas < 0 ||
      cfg.max_comm_ctas > TW_MAX_COMM_CTAS || (cfg.timing != 0 && cfg.timing != 1) ||
      cfg.unit_tiles < 0 || cfg.consumer_copy < TW_CONSUMER_COPY_DEFAULT ||
      cfg.consumer_copy > TW_CONSUMER_COPY_BULK || (cfg.dispatch != 0 && cfg.dispatch != 1) ||
      (cfg.layer != 0 && cfg.layer != 1))
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_context_create: config timeout_ms %d (>= 0), debug_tags %d (0 or 1), "
                    "max_comm_ctas %d (0..%d), timing %d (0 or 1), unit_tiles %d (>= 0), "
                    "consumer_copy %d (0..2), dispatch %d (0 or 1), layer %d (0 or 1): one is out "
                    "of range",
                    cfg.timeout_ms, cfg.debug_tags, cfg.max_comm_ctas, TW_MAX_COMM_CTAS, cfg.timing,
                    cfg.unit_tiles, cfg.consumer_copy, cfg.dispatch, cfg.layer);
  if (cfg.dispatch_capacity < 0 || cfg.dispatch_capacity > problem->max_tokens)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_context_create: dispatch_capacity %d; give 0 (eager dispatch) or 1..%d "
                    "(problem max_tokens: no source sends an expert more rows than it has tokens)",
                    cfg.dispatch_capacity, problem->max_tokens);
  /* The layer runs the dispatch as its first step; a capacity selects the dispatch's mode. */
  if (cfg.layer || cfg.dispatch_capacity > 0) cfg.dispatch = 1;
  if (cfg.layer && problem->hidden % 64 != 0)
    return tw__fail(TW_ERR_ALIGNMENT,
                    "tw_context_create: layer = 1 needs hidden a multiple of 64 (GEMM1's K slice; "
                    "got %d); pad the hidden dimension of x and w13 with zeros",
                    problem->hidden);
  const int32_t sm_budget = cfg.sm_budget > 0 ? cfg.sm_budget : team->default_budget;
  if (cfg.sm_budget < 0 || sm_budget < 2 || sm_budget > team->sm_count)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_context_create: sm_budget %d (%d resolved); must be 2..%d, the GPU's SMs "
                    "(a call needs one producer and one consumer SM), or 0 for the default (%d)",
                    cfg.sm_budget, sm_budget, team->sm_count, team->default_budget);
  int copy = cfg.consumer_copy;
  if (copy == TW_CONSUMER_COPY_DEFAULT) {
    int32_t choice = 0; /* the table's choices: bulk, registers */
    TW_TRY(tw__tunable_choice("tw_context_create", TW_TUNE_CONSUMER_COPY, &choice));
    copy = choice == 1 ? TW_CONSUMER_COPY_REGISTERS : TW_CONSUMER_COPY_BULK;
  }

  /* The producer's kernel version: a switch for side-by-side runs (sm90_gemm.cu lists them; 0:
   * the library's default). */
  int32_t gemm_variant = 0;
  TW_TRY(tw__tunable_int("tw_context_create", TW_TUNE_GEMM_VARIANT, &gemm_variant));
  const int debug_tags =
      cfg.debug_tags ? cfg.debug_tags : (tw__tunable_int_lenient(TW_TUNE_DEBUG_TAGS, 0) != 0);
  int zero_in_producer = 0;
  if (dataflow == TW_DATAFLOW_ADD) {
    /* What the add dataflow cannot do, each with the way out. */
    const char* why =
        problem->top_k > 2
            ? "it sums a token's rows in the order they land, which is exact for top_k 1 or 2 "
              "only; use TW_DATAFLOW_REDUCE"
        : debug_tags ? "debug tags count rows in receive buffers, which it has none of; turn them "
                       "off or use TW_DATAFLOW_REDUCE"
        : gemm_variant != 0 && gemm_variant != TW_GEMM_VARIANT_ADD
            ? "it adds rows in the producer's variant 4 epilogue; use TW_GEMM_VARIANT 0 or 4"
            : NULL;
    if (why == NULL && cfg.dispatch)
      why =
          "tw_moe_dispatch and tw_moe_layer build plans for the reduce dataflow only so far; use "
          "TW_DATAFLOW_REDUCE with dispatch = 1 or layer = 1";
    if (why != NULL)
      return tw__fail(TW_ERR_UNSUPPORTED,
                      "tw_context_create: the add dataflow does not run here: %s", why);
    /* How the next output buffer is zeroed: by the producer's two idle warps (default: SM stores
     * inside the GEMM, no link traffic) or the copy engine (no SM, but NVLink bytes beside the
     * consumer's: slower over the grid, dev/NOTES.md). */
    int32_t zeroing = 0; /* the table's choices: producer, copy */
    TW_TRY(tw__tunable_choice("tw_context_create", TW_TUNE_ADD_ZEROING, &zeroing));
    zero_in_producer = zeroing != 1;
    /* On one GPU a device-to-device copy runs on the SMs, beside kernels that wait for it. */
    if (!zero_in_producer && team->in_process)
      return tw__fail(TW_ERR_UNSUPPORTED,
                      "tw_context_create: TW_ADD_ZEROING=copy needs a copy engine between GPUs; "
                      "on an in-process team use `producer` (or unset it)");
  }
  /* The consumer's tail split (0 bands or 1 part: every band is one unit per column chunk; 0
   * parts, the default: by the band's size). */
  int32_t tail_bands = 0, tail_parts = 0;
  TW_TRY(tw__tunable_int("tw_context_create", TW_TUNE_CONSUMER_TAIL_BANDS, &tail_bands));
  TW_TRY(tw__tunable_int("tw_context_create", TW_TUNE_CONSUMER_TAIL_PARTS, &tail_parts));
  if (tail_parts == 0)
    tail_parts = tw__tail_parts_default(tw__resolve_tile_m(problem), problem->hidden);

  const int32_t world = team->world, rank = team->rank, device = team->device;
  if (world != problem->world_size)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_context_create: problem world_size %d but the %s team has %d ranks",
                    problem->world_size, team->kind, world);
  if (problem->ffn % 64 != 0)
    return tw__fail(TW_ERR_ALIGNMENT,
                    "tw_context_create: ffn %d must be a multiple of 64 for the producer",
                    problem->ffn);

  tw__device_guard guard(device);
  if (guard.status != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "tw_context_create: cudaSetDevice(%d): %s", device,
                    cudaGetErrorString(guard.status));

  tw_context_t ctx = (tw_context_t)calloc(1, sizeof(struct tw_context));
  if (ctx == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "tw_context_create: out of host memory");
  ctx->problem = *problem;
  ctx->team = team;
  *team_taken = 1;
  ctx->rank = rank;
  ctx->world = world;
  ctx->device = device;
  ctx->local_experts = problem->experts / world;
  ctx->tm = tw__resolve_tile_m(problem);
  ctx->tn = tw__resolve_tile_n(problem);
  ctx->col_tiles = (int32_t)tw__ceil_div(problem->hidden, ctx->tn);
  ctx->copy = copy;
  ctx->gemm_variant = gemm_variant;
  /* Bulk copies move a whole band best: its rows are one contiguous run at both ends. */
  const int64_t tpu_default = copy == TW_CONSUMER_COPY_BULK ? ctx->col_tiles : 1;
  int64_t tpu = cfg.unit_tiles > 0
                    ? cfg.unit_tiles
                    : tw__tunable_int_lenient(TW_TUNE_CONSUMER_TILES_PER_UNIT, tpu_default);
  ctx->tiles_per_unit = (int32_t)(tpu < 1 ? 1 : tpu > ctx->col_tiles ? ctx->col_tiles : tpu);
  ctx->unit_chunks = (int32_t)tw__ceil_div(ctx->col_tiles, ctx->tiles_per_unit);
  ctx->tail_bands = tail_bands;
  ctx->tail_parts = tail_parts;
  int64_t tmo =
      cfg.timeout_ms > 0 ? cfg.timeout_ms : tw__tunable_int_lenient(TW_TUNE_TIMEOUT_MS, 0);
  ctx->timeout_ms = (int32_t)(tmo > 0 && tmo < INT32_MAX ? tmo : TW_DEFAULT_TIMEOUT_MS);
  ctx->debug_tags = debug_tags;
  ctx->max_comm_ctas = cfg.max_comm_ctas > 0 ? cfg.max_comm_ctas : TW_MAX_COMM_CTAS;
  ctx->timing = cfg.timing;
  ctx->sm_count = team->sm_count;
  ctx->sm_budget = sm_budget;
  if (ctx->max_comm_ctas >= sm_budget) ctx->max_comm_ctas = sm_budget - 1;
  ctx->dataflow = dataflow;
  ctx->zero_in_producer = zero_in_producer;
  ctx->dispatch = cfg.dispatch;
  ctx->layer = cfg.layer;
  ctx->capacity = (int32_t)(tw__ceil_div(cfg.dispatch_capacity, ctx->tm) * ctx->tm);
  tw_status st = tw__context_init(ctx);
  if (st != TW_SUCCESS) {
    tw__context_free(ctx); /* releases the team view too */
    return st;
  }
  TW_INFO(
      "context: rank %d/%d (%s team) on device %d, %d of %d SMs, window %llu bytes, timeout "
      "%d ms%s",
      rank, world, team->kind, device, ctx->sm_budget, ctx->sm_count,
      (unsigned long long)ctx->lay.bytes, ctx->timeout_ms, ctx->debug_tags ? ", debug tags" : "");
  *out = ctx;
  return TW_SUCCESS;
}

/* Everything of tw_context_create after the team: `team` is this rank's view, owned from here
 * on (released on failure). */
static tw_status tw__context_create(const tw_problem* problem, tw__team* team,
                                    const tw_context_config* config, tw_context_t* out) {
  int team_taken = 0;
  tw_status st = tw__context_create_checked(problem, team, config, out, &team_taken);
  if (st != TW_SUCCESS && !team_taken) team->ops->release(team);
  return st;
}

extern "C" tw_status tw_context_create(const tw_problem* problem, ncclComm_t comm,
                                       const tw_context_config* config, tw_context_t* out) {
  tw__clear_error();
  TW_CHECK_NULL(problem);
  TW_CHECK_NULL(comm);
  TW_CHECK_NULL(out);
  *out = NULL;
  TW_TRY(tw_problem_validate(problem));
  tw__team* team = NULL;
  TW_TRY(tw__team_nccl_create(comm, &team));
  return tw__context_create(problem, team, config, out);
}

extern "C" tw_status tw_context_create_on_team(const tw_problem* problem, tw_team_t team,
                                               int32_t rank, const tw_context_config* config,
                                               tw_context_t* out) {
  tw__clear_error();
  TW_CHECK_NULL(problem);
  TW_CHECK_NULL(team);
  TW_CHECK_NULL(out);
  *out = NULL;
  TW_TRY(tw_problem_validate(problem));
  tw__team* view = NULL;
  TW_TRY(tw__team_local_join(team, rank, &view));
  /* Every later call sets the context's device for its duration; creation leaves it set. */
  const cudaError_t e = cudaSetDevice(view->device);
  if (e != cudaSuccess) {
    view->ops->release(view);
    return tw__fail(TW_ERR_CUDA, "tw_context_create_on_team: cudaSetDevice(%d): %s", view->device,
                    cudaGetErrorString(e));
  }
  return tw__context_create(problem, view, config, out);
}

extern "C" tw_status tw_context_destroy(tw_context_t ctx) {
  tw__clear_error();
  if (ctx == NULL) return TW_SUCCESS;
  tw_status st = TW_SUCCESS;
  {
    tw__device_guard guard(ctx->device);
    st = tw__sync_all(ctx);
    tw__context_free(ctx);
  }
  return st;
}

extern "C" tw_status tw_context_info_get(tw_context_t ctx, tw_context_info* info) {
  tw__clear_error();
  TW_CHECK_NULL(ctx);
  TW_CHECK_NULL(info);
  memset(info, 0, sizeof *info);
  info->rank = ctx->rank;
  info->world_size = ctx->world;
  info->device = ctx->device;
  info->sm_count = ctx->sm_count;
  info->timeout_ms = ctx->timeout_ms;
  info->debug_tags = ctx->debug_tags;
  info->max_comm_ctas = ctx->max_comm_ctas;
  info->window_bytes = (int64_t)ctx->lay.bytes;
  info->unit_tiles = ctx->tiles_per_unit;
  info->consumer_copy = ctx->copy;
  info->dataflow = ctx->dataflow;
  info->sm_budget = ctx->sm_budget;
  info->in_process = ctx->team->in_process;
  int v = 0;
  if (ncclGetVersion(&v) == ncclSuccess) info->nccl_version = v;
  return TW_SUCCESS;
}

extern "C" tw_status tw_context_memory_get(tw_context_t ctx, tw_context_memory* m) {
  tw__clear_error();
  TW_CHECK_NULL(ctx);
  TW_CHECK_NULL(m);
  TW_TRY(tw__check_header("tw_context_memory", m->size, sizeof(tw_context_memory), m->magic,
                          TW_CONTEXT_MEMORY_MAGIC, m->version));
  const tw_problem* p = &ctx->problem;
  m->rows_max = ctx->rows_max;
  m->window_bytes = (int64_t)ctx->lay.bytes;
  m->dispatch_bytes = ctx->dispatch ? (int64_t)ctx->dlay.bytes : 0;
  m->gemm2_out_bytes = ctx->rows_max * p->hidden * 2;
  m->h_bytes = ctx->layer ? ctx->rows_max * p->ffn * 2 : 0;
  m->state_bytes = ctx->state_bytes;
  m->plan_bytes = (int64_t)tw__device_plan_bytes(ctx);
  m->total_bytes = m->window_bytes + m->dispatch_bytes + m->gemm2_out_bytes + m->h_bytes +
                   m->state_bytes + m->plan_bytes;
  return TW_SUCCESS;
}

/* A context whose team is broken (or that this rank aborted) refuses collectives at once, and
 * its calls too (ctx->failed; reset then says why). */
static tw_status tw__team_usable(tw_context_t ctx, const char* how) {
  if (ctx->team->aborted) {
    ctx->failed = 1;
    return tw__fail(TW_ERR_ABORTED,
                    "%s: this rank aborted the context (tw_context_abort); destroy it on every "
                    "rank",
                    how);
  }
  const tw_status st = ctx->team->ops->state(ctx->team);
  if (st != TW_SUCCESS) ctx->failed = 1;
  return st;
}

/* A team collective of the context; a failure marks the context failed (the team is broken). */
static tw_status tw__team_collective(tw_context_t ctx, tw_status st) {
  if (st != TW_SUCCESS) ctx->failed = 1;
  return st;
}

extern "C" tw_status tw_context_abort(tw_context_t ctx) {
  tw__clear_error();
  if (ctx == NULL) return TW_SUCCESS;
  if (ctx->team->aborted) return TW_SUCCESS;
  TW_DEVICE_SCOPE(ctx); /* an NCCL team writes the peers' abort words from this device */
  ctx->team->aborted = 1;
  ctx->failed = 1;
  char why[160];
  snprintf(why, sizeof why, "rank %d of %d aborted the context (tw_context_abort)", ctx->rank,
           ctx->world);
  ctx->team->ops->abort(ctx->team, why);
  TW_INFO("context: %s", why);
  return TW_SUCCESS;
}

extern "C" tw_status tw_context_check(tw_context_t ctx) {
  tw__clear_error();
  TW_CHECK_NULL(ctx);
  TW_DEVICE_SCOPE(ctx);
  TW_TRY(tw__team_usable(ctx, "tw_context_check"));
  TW_TRY(tw__sync_all(ctx));
  /* The record is complete once the context's work is (synchronised above). */
  tw_dev_error all[TW_MAX_RANKS];
  /* On the context's own stream: the legacy default stream would also wait for the caller's
   * blocking streams, where another in-process rank's call may be waiting for this rank. */
  TW_CUDA_TRY(cudaMemcpyAsync(ctx->h_err, ctx->err, sizeof(tw_dev_error), cudaMemcpyDeviceToHost,
                              ctx->s_aux));
  TW_CUDA_TRY(cudaStreamSynchronize(ctx->s_aux));
  TW_TRY(tw__team_collective(
      ctx, ctx->team->ops->allgather(ctx->team, ctx->h_err, all, sizeof(tw_dev_error))));
  int failing = 0, first = -1, cause = -1;
  for (int r = 0; r < ctx->world; r++) {
    if (all[r].status != 0) {
      failing++;
      if (first < 0) first = r;
      /* A rank's own failure (a capacity overflow, a bad id) makes its peers' waits for it time
       * out: report the cause, not a consequence. */
      if (cause < 0 && all[r].status != TW_ERR_TIMEOUT) cause = r;
    }
  }
  if (cause >= 0) first = cause;
  /* TW_DEBUG=INFO: every failing rank's record (the report below names one). */
  for (int r = 0; r < ctx->world && failing > 1 && tw__log_level() >= TW_LOG_INFO; r++)
    if (all[r].status != 0)
      TW_INFO("tw_context_check: rank %d: %s (index %d): counter %u, target %u", all[r].rank,
              tw__where_name(all[r].where), all[r].index, all[r].seen, all[r].target);
  if (first < 0) {
    if (ctx->failed_enqueue)
      return tw__fail(TW_ERR_STATE,
                      "tw_context_check: an earlier call failed after part of it was enqueued "
                      "(its kernels and the peers' are out of step); call tw_context_reset() on "
                      "every rank");
    return TW_SUCCESS;
  }
  ctx->failed = 1;
  char how[96];
  snprintf(how, sizeof how, "tw_context_check: %d of %d ranks failed; first", failing, ctx->world);
  return tw__report(ctx, &all[first], how);
}

extern "C" tw_status tw_context_output(tw_context_t ctx, void** out) {
  tw__clear_error();
  TW_CHECK_NULL(ctx);
  TW_CHECK_NULL(out);
  *out = NULL;
  if (ctx->dataflow != TW_DATAFLOW_ADD)
    return tw__fail(TW_ERR_STATE,
                    "tw_context_output: the context runs the reduce dataflow, whose output is the "
                    "`out` passed to tw_moe_combine");
  if (ctx->out_buf < 0)
    return tw__fail(TW_ERR_STATE,
                    "tw_context_output: no call has added an output since the context was created "
                    "or reset");
  *out = (char*)ctx->win.local + tw__out_offset(ctx, ctx->out_buf);
  return TW_SUCCESS;
}

extern "C" tw_status tw_context_reset(tw_context_t ctx) {
  tw__clear_error();
  TW_CHECK_NULL(ctx);
  TW_DEVICE_SCOPE(ctx);
  /* Every wait is bounded, so every kernel of every rank ends; after the first barrier none is
   * left running anywhere, after the second every rank has zeroed its state. */
  TW_TRY(tw__team_usable(ctx, "tw_context_reset"));
  TW_TRY(tw__sync_all(ctx));
  TW_TRY(tw__team_collective(ctx, tw__team_barrier(ctx->team)));
  TW_TRY(tw__zero_state(ctx));
  TW_TRY(tw__team_collective(ctx, tw__team_barrier(ctx->team)));
  return TW_SUCCESS;
}

extern "C" tw_status tw_context_timings(tw_context_t ctx, tw_combine_timings* t) {
  tw__clear_error();
  TW_CHECK_NULL(ctx);
  TW_CHECK_NULL(t);
  memset(t, 0, sizeof *t);
  if (!ctx->timing)
    return tw__fail(TW_ERR_STATE,
                    "tw_context_timings: the context was created without timing; set "
                    "tw_context_config.timing = 1");
  if (!ctx->have_call)
    return tw__fail(TW_ERR_STATE, "tw_context_timings: no call since creation or reset");
  TW_DEVICE_SCOPE(ctx);
  TW_CUDA_TRY(cudaEventSynchronize(ctx->t_end));
  TW_CUDA_TRY(cudaEventElapsedTime(&t->total_ms, ctx->t_start, ctx->t_end));
  const int m = ctx->last_mode;
  if (m != TW_COMBINE_COMM_ONLY)
    TW_CUDA_TRY(cudaEventElapsedTime(&t->gemm_ms, ctx->t_start, ctx->t_gemm_end));
  if (m != TW_COMBINE_GEMM_ONLY) {
    TW_CUDA_TRY(cudaEventElapsedTime(&t->comm_ms, ctx->t_comm_start, ctx->t_comm_end));
    TW_CUDA_TRY(cudaEventElapsedTime(&t->reduce_ms, ctx->t_red_start, ctx->t_red_end));
  }
  return TW_SUCCESS;
}

extern "C" tw_status tw__context_timeline(tw_context_t ctx, tw_combine_timings* t,
                                          float* comm_end_ms, float* reduce_start_ms,
                                          float* zero_end_ms) {
  TW_CHECK_NULL(comm_end_ms);
  TW_CHECK_NULL(reduce_start_ms);
  TW_CHECK_NULL(zero_end_ms);
  *comm_end_ms = *reduce_start_ms = *zero_end_ms = 0.f;
  TW_TRY(tw_context_timings(ctx, t)); /* checks, and waits for the call */
  if (ctx->last_mode == TW_COMBINE_GEMM_ONLY) return TW_SUCCESS;
  TW_DEVICE_SCOPE(ctx);
  TW_CUDA_TRY(cudaEventElapsedTime(comm_end_ms, ctx->t_start, ctx->t_comm_end));
  TW_CUDA_TRY(cudaEventElapsedTime(reduce_start_ms, ctx->t_start, ctx->t_red_start));
  if (ctx->dataflow == TW_DATAFLOW_ADD && ctx->last_zero_copied) {
    TW_CUDA_TRY(cudaEventSynchronize(ctx->t_zero_end));
    TW_CUDA_TRY(cudaEventElapsedTime(zero_end_ms, ctx->t_start, ctx->t_zero_end));
  }
  return TW_SUCCESS;
}

/* ---- internal hooks (runtime.h) ----------------------------------------------------------- */

extern "C" tw_status tw__context_counters(tw_context_t ctx, cudaStream_t stream,
                                          tw__counters* out) {
  tw__clear_error();
  TW_CHECK_NULL(ctx);
  TW_CHECK_NULL(out);
  TW_DEVICE_SCOPE(ctx);
  TW_TRY(tw__sync_all(ctx));
  TW_CUDA_TRY(cudaStreamSynchronize(stream));
  tw_call_state st;
  tw_dev_error err;
  const size_t w = (size_t)ctx->world * 4;
  const char* win = (const char*)ctx->win.local;
  memset(out, 0, sizeof *out);
  TW_CUDA_TRY(cudaMemcpyAsync(&st, ctx->call_state, sizeof st, cudaMemcpyDeviceToHost, ctx->s_aux));
  TW_CUDA_TRY(cudaMemcpyAsync(&err, ctx->err, sizeof err, cudaMemcpyDeviceToHost, ctx->s_aux));
  TW_CUDA_TRY(
      cudaMemcpyAsync(out->arrived, win + ctx->lay.arrive, w, cudaMemcpyDeviceToHost, ctx->s_aux));
  TW_CUDA_TRY(
      cudaMemcpyAsync(out->credits, win + ctx->lay.credit, w, cudaMemcpyDeviceToHost, ctx->s_aux));
  TW_CUDA_TRY(cudaStreamSynchronize(ctx->s_aux));
  out->epoch = st.epoch;
  out->consumer_units = st.consumer_units;
  out->consumer_epoch = st.consumer_epoch;
  memcpy(out->target, st.arrive_target, w);
  memcpy(out->announced, st.announced, w);
  out->err_status = err.status;
  out->err_where = err.where;
  out->err_index = err.index;
  out->err_seen = err.seen;
  out->err_target = err.target;
  return TW_SUCCESS;
}

extern "C" tw_status tw__context_last_launch(tw_context_t ctx, tw__launch_record* record) {
  TW_CHECK_NULL(ctx);
  TW_CHECK_NULL(record);
  if (!ctx->have_call)
    return tw__fail(TW_ERR_STATE, "tw__context_last_launch: no call since creation or reset");
  *record = ctx->last_launch;
  return TW_SUCCESS;
}

extern "C" tw_status tw__context_inject_fault(tw_context_t ctx, int kind, int index) {
  TW_CHECK_NULL(ctx);
  if (kind < TW_FAULT_NONE || kind > TW_FAULT_DROP_COPY_UNIT || index < 0)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "tw__context_inject_fault: kind %d, index %d", kind,
                    index);
  ctx->fault = kind;
  ctx->fault_index = index;
  return TW_SUCCESS;
}

extern "C" tw_status tw__context_debug_slots(tw_context_t ctx, uint32_t* host, int64_t count) {
  TW_CHECK_NULL(ctx);
  TW_CHECK_NULL(host);
  if (!ctx->debug_tags)
    return tw__fail(TW_ERR_STATE, "tw__context_debug_slots: debug tags are off");
  if (count != ctx->last_tokens * ctx->problem.top_k)
    return tw__fail(TW_ERR_INVALID_SIZE, "tw__context_debug_slots: count %lld, last call had %lld",
                    (long long)count, (long long)(ctx->last_tokens * ctx->problem.top_k));
  TW_DEVICE_SCOPE(ctx);
  TW_TRY(tw__sync_all(ctx));
  if (count > 0)
    TW_CUDA_TRY(cudaMemcpy(host, ctx->debug_slots, (size_t)count * 4, cudaMemcpyDeviceToHost));
  return TW_SUCCESS;
}

extern "C" tw_status tw_context_dispatch_buffer(tw_context_t ctx, void** rows, int64_t* rows_max) {
  tw__clear_error();
  TW_CHECK_NULL(ctx);
  if (rows != NULL) *rows = NULL;
  if (rows_max != NULL) *rows_max = 0;
  if (!ctx->dispatch)
    return tw__fail(TW_ERR_STATE,
                    "tw_context_dispatch_buffer: the context was created without dispatch; set "
                    "tw_context_config.dispatch = 1");
  if (rows != NULL) *rows = (char*)ctx->dwin.local + ctx->dlay.rows;
  if (rows_max != NULL) *rows_max = ctx->rows_max;
  return TW_SUCCESS;
}

/* ---- tracing (runtime.h; the records: src/core/trace.h) ----------------------------------- */

/* The cursor is 32 bits and the buffer is one allocation. */
static const int64_t kTraceCapacityMax = (int64_t)1 << 28;

#ifndef TW_TRACE_HOOKS
#define TW_TRACE_HOOKS 1
#endif

extern "C" int tw__trace_hooks(void) {
  return TW_TRACE_HOOKS;
}

extern "C" tw_status tw__context_trace(tw_context_t ctx, int64_t capacity) {
  TW_CHECK_NULL(ctx);
  if (capacity < 0 || capacity > kTraceCapacityMax)
    return tw__fail(TW_ERR_INVALID_SIZE, "tw__context_trace: capacity %lld; must be 0..%lld",
                    (long long)capacity, (long long)kTraceCapacityMax);
  /* Without the hooks the kernels would record nothing: say so instead of an empty trace. */
  if (capacity > 0 && !TW_TRACE_HOOKS)
    return tw__fail(TW_ERR_UNSUPPORTED,
                    "tw__context_trace: this build has the trace hooks compiled out "
                    "(-DTW_TRACE_HOOKS=OFF); rebuild with -DTW_TRACE_HOOKS=ON (the default)");
  TW_DEVICE_SCOPE(ctx);
  TW_TRY(tw__sync_all(ctx)); /* no kernel of this context still writes into the old buffer */
  /* Stream-ordered allocation on the context's own stream: cudaMalloc / cudaFree may wait for
   * the whole device, where another in-process rank's call may be waiting for this rank. */
  if (ctx->trace != NULL) TW_CUDA_TRY(cudaFreeAsync(ctx->trace, ctx->s_aux));
  ctx->trace = NULL;
  ctx->trace_capacity = 0;
  if (capacity == 0) {
    TW_CUDA_TRY(cudaStreamSynchronize(ctx->s_aux));
    return TW_SUCCESS;
  }
  const size_t bytes = sizeof(tw_trace) + (size_t)capacity * sizeof(tw_trace_record);
  void* p = NULL;
  if (cudaMallocAsync(&p, bytes, ctx->s_aux) != cudaSuccess) {
    (void)cudaGetLastError();
    cudaStreamSynchronize(ctx->s_aux);
    return tw__fail(TW_ERR_OUT_OF_MEMORY,
                    "tw__context_trace: %zu bytes of device memory for %lld records", bytes,
                    (long long)capacity);
  }
  tw_trace h;
  memset(&h, 0, sizeof h);
  h.capacity = (uint32_t)capacity;
  cudaError_t e = cudaMemcpyAsync(p, &h, sizeof h, cudaMemcpyHostToDevice, ctx->s_aux);
  const cudaError_t e2 = cudaStreamSynchronize(ctx->s_aux); /* h is on this stack */
  if (e == cudaSuccess) e = e2;
  if (e != cudaSuccess) {
    cudaFreeAsync(p, ctx->s_aux);
    cudaStreamSynchronize(ctx->s_aux);
    return tw__fail(TW_ERR_CUDA, "tw__context_trace: %s", cudaGetErrorString(e));
  }
  ctx->trace = (tw_trace*)p;
  ctx->trace_capacity = capacity;
  return TW_SUCCESS;
}

extern "C" tw_status tw__context_trace_clear(tw_context_t ctx, cudaStream_t stream) {
  TW_CHECK_NULL(ctx);
  if (ctx->trace == NULL) return tw__fail(TW_ERR_STATE, "tw__context_trace_clear: tracing is off");
  TW_DEVICE_SCOPE(ctx);
  /* After the last call's kernels (its consumer stream joined the call's stream before this). */
  if (ctx->have_call) TW_CUDA_TRY(cudaStreamWaitEvent(stream, ctx->ev_call_done, 0));
  TW_CUDA_TRY(cudaMemsetAsync(&ctx->trace->cursor, 0, sizeof(uint32_t), stream));
  return TW_SUCCESS;
}

extern "C" tw_status tw__context_trace_read(tw_context_t ctx, tw_trace_record* out, int64_t max,
                                            int64_t* count, int64_t* dropped) {
  TW_CHECK_NULL(ctx);
  TW_CHECK_NULL(count);
  TW_CHECK_NULL(dropped);
  *count = *dropped = 0;
  if (max > 0) TW_CHECK_NULL(out);
  if (ctx->trace == NULL) return tw__fail(TW_ERR_STATE, "tw__context_trace_read: tracing is off");
  TW_DEVICE_SCOPE(ctx);
  TW_TRY(tw__sync_all(ctx));
  tw_trace h;
  TW_CUDA_TRY(cudaMemcpyAsync(&h, ctx->trace, sizeof h, cudaMemcpyDeviceToHost, ctx->s_aux));
  TW_CUDA_TRY(cudaStreamSynchronize(ctx->s_aux));
  const int64_t taken = (int64_t)h.cursor;
  const int64_t held = taken < ctx->trace_capacity ? taken : ctx->trace_capacity;
  *dropped = taken - held;
  const int64_t n = held < max ? held : (max > 0 ? max : 0);
  if (n > 0) {
    TW_CUDA_TRY(cudaMemcpyAsync(out, ctx->trace + 1, (size_t)n * sizeof(tw_trace_record),
                                cudaMemcpyDeviceToHost, ctx->s_aux));
    TW_CUDA_TRY(cudaStreamSynchronize(ctx->s_aux));
  }
  *count = n;
  return TW_SUCCESS;
}
