/*
 * layer_call.cu: the sequence of one whole-layer call (tw_moe_layer), eager mode, reduce
 * dataflow: the dispatch, GEMM1 + SwiGLU, then GEMM2 + combine, all on the caller's stream S.
 *
 *   S: dispatch (dispatch_call.cu: counts -> host plan from the all-gathered counts, uploaded with
 *      GEMM1's tile list and the banded copy's units -> the copy, band by band, into the experts'
 *      ranks' buffers -> wait for every source's rows)
 *      -> GEMM1 + SwiGLU (budget CTAs, over the buffer into the context's h)
 *      -> tw_moe_combine_ex on h (producer, consumer, reduction: combine_call.cu)
 * or, with the dispatch beside GEMM1 (tw_layer_options.dispatch_ctas, or the model's choice):
 *   S: ... place pass -> fork -> GEMM1 on budget - C CTAs, each tile waiting for its band's rows
 *      -> join -> the arrival wait (passes at once) -> tw_moe_combine_ex on h
 *   s_comm: the copy on C CTAs
 *
 * Ordering: GEMM1 follows the dispatch's wait kernel in stream order, so it reads every row of
 * the buffer after the arrivals were acquired (a kernel boundary also orders those generic-proxy
 * stores before GEMM1's TMA loads); beside the copy, each tile's producer thread acquires its
 * band's counter and fences the async proxy instead (sm90_gemm.cu). The combine's call-done event comes after GEMM1 on S, and the
 * next dispatch raises its credit (peers may overwrite the buffer) only after that event: no peer
 * writes into the buffer while GEMM1 reads it. h is written by GEMM1 and read by GEMM2 of the same
 * call; the next call's GEMM1 starts after this call's combine (the context orders its calls).
 *
 * SM budget: every kernel keeps within the call's budget: the dispatch's (its own checks), GEMM1's
 * grid (at most budget CTAs, one per SM; budget - C beside the copy's C), the combine's (P + C <=
 * budget; C < budget holds because the plan is made for this budget). Beside the copy GEMM1
 * waits for the sources' copies, which wait for nothing but the destinations' credits (raised
 * before any GEMM1 of this call) and run on SMs the budgets leave them.
 *
 * The capturable mode (a context with a dispatch capacity): the dispatch is dispatch_call.cu's
 * static one (no host read, no collective), GEMM1 and GEMM2 run the tiles with live rows its mask
 * kernel listed, and the whole call may be captured in a CUDA graph; S forks only inside the
 * combine (combine_call.cu), which joins before it returns. Its refusals are local (the peers time
 * out; tw_context_check reports).
 *
 * Failures: whatever can differ between ranks (tokens, ids, pointers) is agreed on in the
 * dispatch's all-gather, so every rank refuses alike before anything is sent and the context
 * stays usable. Arguments that are the same on every rank in a correct program (the options,
 * the context's config) are refused before anything collective. A failure after the dispatch
 * (a launch error, a refused combine) leaves the peers' combines waiting for this rank until
 * their timeout: the context is failed until tw_context_reset(), as after a failed combine.
 */
#include <stdio.h>
#include <string.h>

#include "context.h"

extern "C" tw_status tw__layer_gemm1(tw_context_t ctx, tw_device_plan_t d, const void* expert_in,
                                     const void* w13, void* h, int32_t sm_budget,
                                     cudaStream_t stream) {
  return tw__layer_gemm1_ex(ctx, d, expert_in, w13, h, sm_budget, 0, stream);
}

tw_status tw__layer_gemm1_ex(tw_context_t ctx, tw_device_plan_t d, const void* expert_in,
                             const void* w13, void* h, int32_t sm_budget, int wait_bands,
                             cudaStream_t stream) {
  TW_CHECK_NULL(ctx);
  TW_CHECK_NULL(d);
  if (!ctx->layer)
    return tw__fail(TW_ERR_STATE,
                    "tw__layer_gemm1: the context was created without layer; set "
                    "tw_context_config.layer = 1");
  if (d->ctx != ctx)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw__layer_gemm1: the device plan belongs to another context");
  if (!d->uploaded)
    return tw__fail(TW_ERR_STATE, "tw__layer_gemm1: no plan uploaded (run the dispatch first)");
  const int32_t budget = sm_budget > 0 ? sm_budget : ctx->sm_budget;
  if (sm_budget < 0 || budget > ctx->sm_budget)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "tw__layer_gemm1: sm_budget %d; must be 0..%d",
                    sm_budget, ctx->sm_budget);
  if (h == NULL) h = ctx->h;
  ctx->last_launch.gemm1_ctas = budget < d->num_gemm1_tiles ? budget : d->num_gemm1_tiles;
  if (d->num_gemm1_tiles == 0) return TW_SUCCESS; /* no rows on this rank's experts */
  TW_DEVICE_SCOPE(ctx);
  tw_gemm1_args g;
  TW_TRY(tw__gemm1_args_init(&g, expert_in, w13, h, d->rows, ctx->problem.hidden, ctx->problem.ffn,
                             ctx->local_experts, d->gemm1_tiles, d->num_gemm1_tiles, ctx->tm));
  g.grid = budget; /* persistent: CTA j takes tiles j, j + budget, ... (never more than tiles) */
  /* The static plan: the tiles with live rows of the last dispatch (its mask kernel). */
  if (d->is_static) {
    g.tiles = d->live_gemm1_tiles;
    g.live_tiles = d->live_counts + 1;
  }
  /* Eager layers only: a capturable one may be captured, and no graph may keep the buffer's
   * address. */
  g.trace = ctx->capacity > 0 ? NULL : ctx->trace;
  if (wait_bands) {
    g.band_arrived = (const uint32_t*)((const char*)ctx->dwin.local + ctx->dlay.band_arrive);
    g.err = ctx->err;
    g.timeout_ns = (uint64_t)ctx->timeout_ms * 1000000ull;
    g.rank = ctx->rank;
  }
  return tw__gemm1_swiglu_launch(&g, stream);
}

extern "C" tw_status tw__context_layer_h(tw_context_t ctx, void** h) {
  TW_CHECK_NULL(ctx);
  TW_CHECK_NULL(h);
  *h = ctx->h;
  if (!ctx->layer)
    return tw__fail(TW_ERR_STATE, "tw__context_layer_h: the context was created without layer");
  return TW_SUCCESS;
}

extern "C" tw_status tw_moe_layer_ex(tw_context_t ctx, tw_device_plan_t d, const void* x,
                                     const void* topk_ids, tw_index_type id_type,
                                     const float* topk_weights, int32_t tokens, const void* w13,
                                     const void* w2, void* out, const tw_layer_options* options,
                                     cudaStream_t stream) {
  tw__clear_error();
  TW_CHECK_NULL(ctx);
  TW_CHECK_NULL(d);
  tw_layer_options opt = TW_LAYER_OPTIONS_INIT;
  if (options != NULL) {
    TW_TRY(tw__check_header("tw_layer_options", options->size, sizeof(tw_layer_options),
                            options->magic, TW_LAYER_OPTIONS_MAGIC, options->version));
    opt = *options;
  }
  /* Refusals before anything collective: the same on every rank of a correct program. */
  if (!ctx->layer)
    return tw__fail(TW_ERR_STATE,
                    "tw_moe_layer: the context was created without layer; set "
                    "tw_context_config.layer = 1 on every rank");
  if (d->ctx != ctx)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_moe_layer: the device plan belongs to another context");
  if (opt.mode != TW_COMBINE_OVERLAP && opt.mode != TW_COMBINE_UNFUSED)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_moe_layer: mode %d; give TW_COMBINE_OVERLAP or TW_COMBINE_UNFUSED (the "
                    "GEMM-only and comm-only modes are timing modes of tw_moe_combine_ex)",
                    (int)opt.mode);
  int32_t budget = 0;
  TW_TRY(tw__call_budget("tw_moe_layer", opt.sm_budget, ctx->sm_budget, &budget));
  if (opt.dispatch_ctas < TW_LAYER_DISPATCH_SEQUENTIAL || opt.dispatch_ctas >= budget)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_moe_layer: dispatch_ctas %d; give TW_LAYER_DISPATCH_AUTO (0, the "
                    "model's choice), TW_LAYER_DISPATCH_SEQUENTIAL (-1) or 1..%d (below the call's "
                    "sm_budget %d)",
                    opt.dispatch_ctas, budget - 1, budget);
  if (opt.comm_ctas < 0 || opt.comm_ctas > ctx->max_comm_ctas || opt.comm_ctas >= budget)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_moe_layer: comm_ctas %d; must be 0 (the plan's) or 1..%d (the context's "
                    "max_comm_ctas, below the call's sm_budget %d)",
                    opt.comm_ctas,
                    ctx->max_comm_ctas < budget - 1 ? ctx->max_comm_ctas : budget - 1, budget);
  /* The plan is made for the call's budget, so that its C leaves the producer SMs. A config of
   * an unknown size goes to the dispatch as given, which refuses it. */
  tw_plan_config pc = TW_PLAN_CONFIG_INIT;
  const tw_plan_config* plan_config = &pc;
  if (opt.plan_config != NULL) {
    const tw_plan_config* given = opt.plan_config;
    const size_t known = given->size;
    if (known == offsetof(tw_plan_config, schedule) ||
        known == offsetof(tw_plan_config, dataflow) ||
        known == offsetof(tw_plan_config, sm_budget) || known == sizeof(tw_plan_config)) {
      if (known == sizeof(tw_plan_config) && given->sm_budget != 0 && given->sm_budget != budget)
        return tw__fail(TW_ERR_INVALID_ARGUMENT,
                        "tw_moe_layer: plan_config.sm_budget %d differs from the call's %d; "
                        "leave it 0 (the call's)",
                        given->sm_budget, budget);
      memcpy(&pc, given, known);
      pc.size = sizeof pc;
    } else {
      plan_config = given;
    }
  }
  pc.sm_budget = budget;
  /* The capturable mode plans once (the static plan): no per-call config. */
  if (ctx->capacity > 0 && opt.plan_config != NULL)
    return tw__fail(TW_ERR_UNSUPPORTED,
                    "tw_moe_layer: the context has a dispatch capacity, whose plan is static (made "
                    "by tw_device_plan_create for the context's sm_budget); pass plan_config = "
                    "NULL");
  if (ctx->capacity > 0) plan_config = NULL;
  /* The static plan's C was chosen for the context's budget: a smaller one must leave the
   * producer SMs, or the combine half would refuse after the dispatch went out. */
  if (ctx->capacity > 0 && d->is_static && d->total_units > 0 &&
      (opt.comm_ctas > 0 ? opt.comm_ctas : d->comm_ctas) >= budget)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_moe_layer: the static plan's %d consumer CTAs leave none of the call's %d "
                    "SMs to the producer; pass a larger sm_budget or a smaller comm_ctas",
                    opt.comm_ctas > 0 ? opt.comm_ctas : d->comm_ctas, budget);
  if (ctx->capacity == 0) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    const cudaError_t ce = cudaStreamIsCapturing(stream, &capture);
    if (ce != cudaSuccess)
      return tw__fail(TW_ERR_CUDA, "tw_moe_layer: cudaStreamIsCapturing: %s",
                      cudaGetErrorString(ce));
    if (capture != cudaStreamCaptureStatusNone)
      return tw__fail(TW_ERR_UNSUPPORTED,
                      "tw_moe_layer: the stream is capturing; the eager layer reads the counts "
                      "on the host and cannot be captured in a CUDA graph (create the contexts "
                      "with tw_context_config.dispatch_capacity > 0 for a capturable layer)");
  }
  /* The layer's own operands, refused through the dispatch's all-gather (they may differ
   * between ranks). */
  tw__dispatch_extra extra;
  memset(&extra, 0, sizeof extra);
  extra.who = "tw_moe_layer";
  if (w13 == NULL) extra.bad |= TW__LAYER_NULL_W13;
  if (w2 == NULL) extra.bad |= TW__LAYER_NULL_W2;
  if (out == NULL && tokens > 0) extra.bad |= TW__LAYER_NULL_OUT;
  if (((uintptr_t)w13 | (uintptr_t)w2 | (uintptr_t)out) % 16 != 0) extra.bad |= TW__LAYER_UNALIGNED;
  extra.status = extra.bad == 0                     ? TW_SUCCESS
                 : extra.bad == TW__LAYER_UNALIGNED ? TW_ERR_ALIGNMENT
                                                    : TW_ERR_NULL_POINTER;

  /* The eager mode overlaps the dispatch with GEMM1 where told to or where the model predicts
   * that it pays (the capturable one runs them in turn: its GEMM1 tiles are those with live rows,
   * known after every arrival). */
  if (ctx->capacity == 0) {
    extra.banded = 1;
    extra.copy_ctas = opt.dispatch_ctas == TW_LAYER_DISPATCH_SEQUENTIAL ? 0
                      : opt.dispatch_ctas > 0                           ? opt.dispatch_ctas
                                                                        : -1;
  }

  TW_DEVICE_SCOPE(ctx);
  tw_dispatch_options dopt = TW_DISPATCH_OPTIONS_INIT;
  dopt.plan_config = plan_config;
  dopt.sm_budget = budget;
  void* expert_in = NULL;
  TW_TRY(tw__dispatch_run(ctx, d, x, topk_ids, id_type, topk_weights, tokens, &expert_in, &dopt,
                          &extra, stream));
  const int32_t copy_ctas = extra.copy_ctas_used;
  ctx->last_launch.dispatch_ctas = copy_ctas;

  /* Every rank's dispatch has succeeded: from here a failure leaves the peers' combines waiting
   * for this rank. Overlapped, GEMM1 takes the SMs the copy leaves and waits per tile for its
   * band's rows; then the copy joins and the dispatch ends (its arrival wait passes at once). */
  const char* half = "GEMM1 + SwiGLU";
  tw_status st =
      tw__layer_gemm1_ex(ctx, d, expert_in, w13, ctx->h, budget - copy_ctas, copy_ctas > 0, stream);
  if (st == TW_SUCCESS && copy_ctas > 0) {
    half = "dispatch";
    st = tw__dispatch_finish(ctx, d, 1, stream);
  }
  if (st == TW_SUCCESS) {
    tw_combine_options co = TW_COMBINE_OPTIONS_INIT;
    co.mode = opt.mode;
    co.comm_ctas = opt.comm_ctas;
    co.sm_budget = budget;
    half = "GEMM2 + combine";
    st = tw_moe_combine_ex(ctx, d, ctx->h, w2, out, &co, stream);
  }
  if (st != TW_SUCCESS) {
    char why[512];
    snprintf(why, sizeof why, "%s", tw_last_error());
    /* Under capture nothing has run: the capture fails, the context stays as it was. */
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &cs) != cudaSuccess || cs == cudaStreamCaptureStatusNone)
      ctx->failed = ctx->failed_enqueue = 1;
    return tw__fail(st,
                    "tw_moe_layer: rank %d: the %s half failed after the dispatch (%s); the "
                    "peers' calls wait for this rank until their timeout. Call "
                    "tw_context_reset() on every rank",
                    ctx->rank, half, why);
  }
  return TW_SUCCESS;
}

extern "C" tw_status tw_moe_layer(tw_context_t ctx, tw_device_plan_t dplan, const void* x,
                                  const void* topk_ids, tw_index_type id_type,
                                  const float* topk_weights, int32_t tokens, const void* w13,
                                  const void* w2, void* out, cudaStream_t stream) {
  return tw_moe_layer_ex(ctx, dplan, x, topk_ids, id_type, topk_weights, tokens, w13, w2, out, NULL,
                         stream);
}
