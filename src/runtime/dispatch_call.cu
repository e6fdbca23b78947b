/*
 * dispatch_call.cu: the sequence of one eager dispatch call (tw_moe_dispatch): from a rank's
 * top-k ids and weights on the GPU to its plan on the device and every token row in the
 * expert-input buffer of its experts' ranks. The host sees only the count vector of each rank.
 *
 * On the caller's stream S (dispatch.h has the counters, dispatch.cu the kernels):
 *   S: [wait for the previous call] -> credit (1 CTA) -> count + offsets -> counts to the host
 *   host: wait for the counts, all-gather them (team), plan from the count matrix, upload the
 *         plan's arrays, agree with every rank that planning worked (team)
 *   S: place (slot_row, weights, destination rows) -> copy (rows to peers, padding zero, then
 *      arrivals) -> wait (1 CTA: every source's rows) -> done
 * Every grid is at most the call's SM budget. Deadlock freedom: the only waits on the device are
 * the copy kernel's for the destinations' credits, raised before their counts reached their
 * hosts (so before the all-gather every rank has passed), and the wait kernel's for the sources'
 * arrivals, which every source's copy raises after waiting for nothing but those credits; on an
 * in-process team each rank's kernels keep within its budget and the budgets fit the GPU.
 *
 * Failures: an id out of range or repeated within a token, a token count out of range or a bad
 * pointer on any rank fails the call on every rank, before anything is sent, with the context
 * still usable (each rank's counters advanced alike); a context that has failed on any rank is
 * refused the same way and stays failed on every rank. A plan or upload that fails on one rank
 * fails the call on every rank after the second agreement, also before anything is sent. A
 * failure past that point (a CUDA error, a wait past the timeout) leaves the context failed
 * until tw_context_reset(), as a failed combine does.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "context.h"

static_assert(sizeof(tw_dev_error) == kGatherHead * 4, "the all-gather's head is a tw_dev_error");

/* Local checks whose failure every rank learns through the all-gather (tw_dev_error.where). */
enum {
  kLocalTokens = -1,
  kLocalPointer = -2,
  kLocalAlignment = -3,
  kLocalFailed = -4,
  kLocalExtra = -5 /* a whole-layer call's own refusal (tw__dispatch_extra) */
};

/* The credit and wait kernels' arguments (dispatch.h) of this context. */
static tw_dispatch_signal_args tw__signal_args(tw_context_t ctx, tw_trace* trace) {
  tw_dispatch_signal_args sg;
  memset(&sg, 0, sizeof sg);
  sg.peers = ctx->dpeers;
  sg.lay = ctx->dlay;
  sg.rank = ctx->rank;
  sg.world = ctx->world;
  sg.epochs = ctx->d_epochs;
  sg.err = ctx->err;
  sg.timeout_ns = (uint64_t)ctx->timeout_ms * 1000000ull;
  sg.trace = trace;
  return sg;
}

/* The count plan's device part beyond tw__device_plan_copy's: the scan's tables (slot_base,
 * send_row0) and this rank's padding ranges, after checks that keep every write in bounds:
 * this rank's rows of each expert fit the expert's rank's buffer, and its slot rows fit its own
 * receive and layout rows; banded (a layer call): also the banded copy's units and send_off. */
static tw_status tw__dispatch_upload(tw_device_plan_t d, const struct tw_plan* plan,
                                     const int32_t* counts, int32_t tokens, int banded,
                                     cudaStream_t stream) {
  tw_context_t ctx = d->ctx;
  const int32_t ET = ctx->problem.experts, E = ctx->local_experts, W = ctx->world;
  int64_t units = 0;
  TW_TRY(tw__device_plan_check(d, plan, tokens, &units, "tw_moe_dispatch"));
  const int32_t* mine = counts + (size_t)ctx->rank * ET;
  for (int32_t g = 0; g < ET; g++) {
    const int64_t c = mine[g];
    if (c == 0) continue;
    const int64_t sr0 = plan->send_row0[g], sb = plan->slot_base[g];
    if (sr0 < 0 || sr0 + c > ctx->rows_max)
      return tw__fail(TW_ERR_CAPACITY,
                      "tw_moe_dispatch: rank %d's %lld rows for expert %d start at row %lld of "
                      "rank %d's buffer of %lld rows",
                      ctx->rank, (long long)c, g, (long long)sr0, g / E, (long long)ctx->rows_max);
    if (sb < 0 || sb + c > (int64_t)plan->recv_rows + plan->rows)
      return tw__fail(TW_ERR_INTERNAL,
                      "tw_moe_dispatch: slot rows %lld..%lld of expert %d outside %d receive + %d "
                      "local rows",
                      (long long)sb, (long long)(sb + c), g, plan->recv_rows, plan->rows);
  }
  /* Padding: the tail of the last band of every padded remote group (rows past its valid ones
   * that belong to nobody; in the band a remote group shares with the local group they are
   * local rows). */
  int32_t n = 0;
  int64_t pad_rows = 0;
  for (int32_t i = 0; i < plan->num_bands; i++) {
    const tw_band* b = &plan->layout_bands[i];
    if (b->dest == ctx->rank || b->valid_rows >= b->rows ||
        plan->row_src[b->row0 + b->valid_rows].owner >= 0)
      continue;
    if (n >= E * W)
      return tw__fail(TW_ERR_INTERNAL, "tw_moe_dispatch: more than %d padding ranges", E * W);
    d->h_pads[1 + 2 * n] = b->row0 + b->valid_rows;
    d->h_pads[2 + 2 * n] = b->rows - b->valid_rows;
    pad_rows += b->rows - b->valid_rows;
    n++;
  }
  d->h_pads[0] = n;
  d->uploaded = 0;
  if (banded)
    TW_TRY(tw__plan_copy_units(plan, counts, d->h_pads + 1, n, d->h_send_off, d->h_copy_units,
                               d->copy_units_max, &d->num_copy_units));
  TW_TRY(tw__device_plan_copy(d, plan, tokens, units, stream));
  if (banded) {
    TW_CUDA_TRY(cudaMemcpyAsync(d->send_off, d->h_send_off, (size_t)ET * 4, cudaMemcpyHostToDevice,
                                stream));
    if (d->num_copy_units > 0)
      TW_CUDA_TRY(cudaMemcpyAsync(d->copy_units, d->h_copy_units,
                                  (size_t)d->num_copy_units * sizeof(tw_copy_unit),
                                  cudaMemcpyHostToDevice, stream));
  }
  /* Pageable copies: staged before they return, so the plan and h_pads may change after. */
  TW_CUDA_TRY(cudaMemcpyAsync(d->slot_base, plan->slot_base, (size_t)ET * 4, cudaMemcpyHostToDevice,
                              stream));
  TW_CUDA_TRY(cudaMemcpyAsync(d->send_row0, plan->send_row0, (size_t)ET * 4, cudaMemcpyHostToDevice,
                              stream));
  TW_CUDA_TRY(
      cudaMemcpyAsync(d->pads, d->h_pads, (size_t)(1 + 2 * n) * 4, cudaMemcpyHostToDevice, stream));
  d->pad_rows = pad_rows;
  return TW_SUCCESS;
}

/* The first failing rank's row of the all-gather as a status and message (every rank composes
 * the same one). */
static tw_status tw__dispatch_refusal(tw_context_t ctx, int32_t failing, int32_t first,
                                      const int32_t* row, const char* lead) {
  const int32_t K = ctx->problem.top_k;
  const tw_status st = (tw_status)row[0];
  const int32_t where = row[1], index = row[2];
  if (where == kLocalTokens)
    return tw__fail(st,
                    "%s: rank %d passed %d tokens; give 0..%d (problem max_tokens). %d of %d "
                    "ranks refused; nothing was sent",
                    lead, first, row[2], ctx->problem.max_tokens, failing, ctx->world);
  if (where == kLocalPointer)
    return tw__fail(st,
                    "%s: rank %d passed a NULL x, topk_ids or topk_weights with %d tokens; "
                    "nothing was sent",
                    lead, first, row[2]);
  if (where == kLocalAlignment)
    return tw__fail(st, "%s: rank %d's x is not 16-byte aligned; nothing was sent", lead, first);
  if (where == kLocalExtra) {
    const int32_t bad = row[2];
    return tw__fail(st,
                    "%s: rank %d passed%s%s%s%s; give device buffers of the documented shapes, "
                    "16-byte aligned. %d of %d ranks refused; nothing was sent, the context stays "
                    "usable",
                    lead, first, bad & TW__LAYER_NULL_W13 ? " a NULL w13" : "",
                    bad & TW__LAYER_NULL_W2 ? " a NULL w2" : "",
                    bad & TW__LAYER_NULL_OUT ? " a NULL out with tokens > 0" : "",
                    bad & TW__LAYER_UNALIGNED ? " a w13, w2 or out not 16-byte aligned" : "",
                    failing, ctx->world);
  }
  if (where == kLocalFailed)
    return tw__fail(st,
                    "%s: rank %d: an earlier call failed on the device (%s); call "
                    "tw_context_reset() on every rank first",
                    lead, first, tw_status_string(st));
  if (st == TW_ERR_DUPLICATE_EXPERT)
    return tw__fail(st,
                    "%s: rank %d: token %d names expert %d in slots %d and %d "
                    "(topk_ids[%d] and [%d]); %d of %d ranks refused, nothing was sent, the "
                    "context stays usable",
                    lead, first, index / K, row[3], row[4] % K, index % K, row[4], index, failing,
                    ctx->world);
  if (where == TW_CHECK_WEIGHT)
    return tw__fail(st,
                    "%s: rank %d: topk_weights[%d] (token %d, slot %d) is not finite (bits "
                    "0x%08x); give finite gate weights. %d of %d ranks refused, nothing was sent, "
                    "the context stays usable",
                    lead, first, index, index / K, index % K, (unsigned)row[3], failing,
                    ctx->world);
  if (st == TW_ERR_EXPERT_ID)
    return tw__fail(st,
                    "%s: rank %d: topk_ids[%d] (token %d, slot %d) = %d is outside 0..%d; "
                    "%d of %d ranks refused, nothing was sent, the context stays usable",
                    lead, first, index, index / K, index % K, row[3], row[4] - 1, failing,
                    ctx->world);
  return tw__fail(st != TW_SUCCESS ? st : TW_ERR_INTERNAL,
                  "%s: rank %d's count pass failed (where %d, index %d); nothing was sent", lead,
                  first, where, index);
}

/* The capturable mode (tw_context_config.dispatch_capacity > 0): the static plan uploaded at
 * tw_device_plan_create, no host read of routing data, no event query under capture, no host
 * collective, everything on the caller's stream S (no fork):
 *   S: [eager: wait for the previous call] -> credit -> count + offsets -> place (slot_row,
 *      weights, send_row: p < capacity, else TW_CHECK_CAPACITY) -> copy (rows, the live counts
 *      into the experts' ranks' windows, arrivals) -> wait (every source's rows and counts) ->
 *      mask (live rows per band, the tiles with live rows for GEMM2 and GEMM1)
 * Deadlock freedom as the eager sequence's without the all-gather: in call e a copy kernel waits
 * for the destinations' credits of call e, each raised by the destination's first kernel of call
 * e, which waits for nothing but that rank's call e - 1 (ended, by induction); the wait kernel
 * waits for the sources' copies of call e, which wait for nothing but those credits. Refusals
 * here are local (no rank can tell the others before anything is sent): the peers' calls then
 * time out, which tw_context_check reports; bad ids and overflows fail on the device, and the
 * check reports the cause on every rank. */
static tw_status tw__dispatch_run_static(tw_context_t ctx, tw_device_plan_t d, const void* x,
                                         const void* topk_ids, tw_index_type id_type,
                                         const float* topk_weights, int32_t tokens,
                                         void** expert_in, const tw_dispatch_options* opt,
                                         const tw__dispatch_extra* extra, cudaStream_t stream,
                                         const char* who) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  {
    const cudaError_t ce = cudaStreamIsCapturing(stream, &capture);
    if (ce != cudaSuccess)
      return tw__fail(TW_ERR_CUDA, "%s: cudaStreamIsCapturing: %s", who, cudaGetErrorString(ce));
  }
  if (capture == cudaStreamCaptureStatusInvalidated)
    return tw__fail(TW_ERR_STATE,
                    "%s: the stream's capture was invalidated by an earlier call; end it "
                    "(cudaStreamEndCapture) and capture again",
                    who);
  const int capturing = capture == cudaStreamCaptureStatusActive;
  if (opt->plan_config != NULL)
    return tw__fail(TW_ERR_UNSUPPORTED,
                    "%s: the context has a dispatch capacity, whose plan is static (made by "
                    "tw_device_plan_create for the context's sm_budget); pass plan_config = NULL",
                    who);
  int32_t budget = 0;
  TW_TRY(tw__call_budget(who, opt->sm_budget, ctx->sm_budget, &budget));
  if (!d->is_static)
    return tw__fail(TW_ERR_STATE,
                    "%s: the device plan no longer holds the static plan of the context's dispatch "
                    "capacity (tw_device_plan_upload replaced it); create another device plan",
                    who);
  const tw_problem* p = &ctx->problem;
  const int32_t K = p->top_k, ET = p->experts, rank = ctx->rank;
  if (tokens < 0 || tokens > p->max_tokens)
    return tw__fail(tokens < 0 ? TW_ERR_INVALID_SIZE : TW_ERR_CAPACITY,
                    "%s: rank %d passed %d tokens; give 0..%d (problem max_tokens). Nothing was "
                    "sent; the peers' calls time out",
                    who, rank, tokens, p->max_tokens);
  if (tokens > 0 && (x == NULL || topk_ids == NULL || topk_weights == NULL))
    return tw__fail(TW_ERR_NULL_POINTER,
                    "%s: rank %d passed a NULL x, topk_ids or topk_weights with %d tokens; nothing "
                    "was sent; the peers' calls time out",
                    who, rank, tokens);
  if (tokens > 0 && ((uintptr_t)x & 15) != 0)
    return tw__fail(TW_ERR_ALIGNMENT,
                    "%s: rank %d's x is not 16-byte aligned; nothing was sent; the peers' calls "
                    "time out",
                    who, rank);
  if (extra != NULL && extra->status != TW_SUCCESS)
    return tw__fail(
        (tw_status)extra->status,
        "%s: rank %d passed%s%s%s%s; give device buffers of the documented shapes, "
        "16-byte aligned. Nothing was sent; the peers' calls time out",
        who, rank, extra->bad & TW__LAYER_NULL_W13 ? " a NULL w13" : "",
        extra->bad & TW__LAYER_NULL_W2 ? " a NULL w2" : "",
        extra->bad & TW__LAYER_NULL_OUT ? " a NULL out with tokens > 0" : "",
        extra->bad & TW__LAYER_UNALIGNED ? " a w13, w2 or out not 16-byte aligned" : "");
  if (ctx->failed)
    return tw__fail(TW_ERR_STATE,
                    "%s: an earlier call failed; call tw_context_check() and tw_context_reset() "
                    "on every rank first",
                    who);
  /* A completed earlier call that failed (never blocks; not under capture). */
  if (!capturing && ctx->have_call && cudaEventQuery(ctx->ev_err_copied) == cudaSuccess &&
      ctx->h_err->status != 0) {
    ctx->failed = 1;
    return tw__report(ctx, ctx->h_err, who);
  }
  const int32_t slots = tokens * K; /* max_tokens * K fits int32 */
  const uint64_t timeout_ns = (uint64_t)ctx->timeout_ms * 1000000ull;
  TW_DEVICE_SCOPE(ctx);

  /* Calls are ordered on the context (a captured call by its graph's stream, tilewave.h). From
   * here a failure leaves the ranks' counters out of step. */
  if (ctx->have_call && !capturing) TW_CUDA_TRY(cudaStreamWaitEvent(stream, ctx->ev_call_done, 0));
  if (!capturing) ctx->failed = ctx->failed_enqueue = 1;
  /* No trace: a captured graph may not keep the buffer's address. */
  const tw_dispatch_signal_args sg = tw__signal_args(ctx, NULL);
  TW_TRY(tw__dispatch_credit_launch(&sg, stream));

  /* Count and place on the device; a bad id or weight or an overflow fails the context's record
   * (no host sees the counts). */
  tw_dispatch_scan_args sa;
  memset(&sa, 0, sizeof sa);
  sa.ids = topk_ids;
  sa.id64 = id_type == TW_INDEX_INT64;
  sa.slots = slots;
  sa.top_k = K;
  sa.experts = ET;
  tw__dispatch_chunks(slots, &sa.chunks, &sa.chunk_slots);
  sa.chunk_hist = ctx->d_chunk_hist;
  sa.counts = ctx->d_counts;
  sa.weights_in = topk_weights; /* a NaN or infinite weight fails the call too */
  sa.err = ctx->err;
  sa.rank = rank;
  sa.capacity = ctx->capacity;
  TW_TRY(tw__dispatch_count_launch(&sa, budget, stream));
  sa.slot_base = d->slot_base;
  sa.send_row0 = d->send_row0;
  sa.weights_in = topk_weights;
  sa.slot_row = d->slot_row;
  sa.weights_out = d->weights;
  sa.send_row = d->send_row;
  TW_TRY(tw__dispatch_place_launch(&sa, budget, stream));
  tw_dispatch_copy_args cp;
  memset(&cp, 0, sizeof cp);
  cp.peers = ctx->dpeers;
  cp.lay = ctx->dlay;
  cp.x = (const uint16_t*)x;
  cp.ids = topk_ids;
  cp.id64 = sa.id64;
  cp.send_row = d->send_row;
  cp.pads = d->pads; /* none: every group of the static plan is whole bands */
  cp.pad_rows = 0;
  cp.slots = slots;
  cp.top_k = K;
  cp.hidden = p->hidden;
  cp.local_experts = ctx->local_experts;
  cp.rank = rank;
  cp.world = ctx->world;
  cp.epochs = ctx->d_epochs;
  cp.err = ctx->err;
  cp.timeout_ns = timeout_ns;
  cp.done = ctx->d_done;
  cp.counts = ctx->d_counts;
  cp.experts = ET;
  cp.capacity = ctx->capacity;
  TW_TRY(tw__dispatch_copy_launch(&cp, budget, stream));
  TW_TRY(tw__dispatch_wait_launch(&sg, stream));
  tw_dispatch_mask_args ma;
  memset(&ma, 0, sizeof ma);
  ma.live = (const uint32_t*)((char*)ctx->dwin.local + ctx->dlay.live);
  ma.band_group = d->band_group;
  ma.band_first = d->band_first;
  ma.bands = d->bands;
  ma.num_bands = d->num_bands;
  ma.tiles = d->tiles;
  ma.num_tiles = d->num_tiles;
  ma.live_tiles = d->live_tiles;
  if (ctx->layer) {
    ma.tiles1 = d->gemm1_tiles;
    ma.num_tiles1 = d->num_gemm1_tiles;
    ma.live_tiles1 = d->live_gemm1_tiles;
  }
  ma.band_live = d->band_live;
  ma.live_counts = d->live_counts;
  TW_TRY(tw__dispatch_mask_launch(&ma, stream));
  d->tokens = tokens; /* the reduction's of the combine that follows */
  if (expert_in != NULL) *expert_in = (char*)ctx->dwin.local + ctx->dlay.rows;
  if (capturing) {
    d->captured = 1; /* its arrays' addresses are in the graph */
    return TW_SUCCESS;
  }
  TW_CUDA_TRY(cudaEventRecord(ctx->ev_call_done, stream));
  TW_CUDA_TRY(cudaStreamWaitEvent(ctx->s_aux, ctx->ev_call_done, 0));
  TW_CUDA_TRY(cudaMemcpyAsync(ctx->h_err, ctx->err, sizeof(tw_dev_error), cudaMemcpyDeviceToHost,
                              ctx->s_aux));
  TW_CUDA_TRY(cudaEventRecord(ctx->ev_err_copied, ctx->s_aux));
  ctx->have_call = 1;
  ctx->failed = ctx->failed_enqueue = 0;
  return TW_SUCCESS;
}

tw_status tw__dispatch_run(tw_context_t ctx, tw_device_plan_t d, const void* x,
                           const void* topk_ids, tw_index_type id_type, const float* topk_weights,
                           int32_t tokens, void** expert_in, const tw_dispatch_options* options,
                           tw__dispatch_extra* extra, cudaStream_t stream) {
  const char* who = extra != NULL && extra->who != NULL ? extra->who : "tw_moe_dispatch";
  TW_CHECK_NULL(ctx);
  TW_CHECK_NULL(d);
  if (expert_in != NULL) *expert_in = NULL;
  tw_dispatch_options opt = TW_DISPATCH_OPTIONS_INIT;
  if (options != NULL) {
    TW_TRY(tw__check_header("tw_dispatch_options", options->size, sizeof(tw_dispatch_options),
                            options->magic, TW_DISPATCH_OPTIONS_MAGIC, options->version));
    opt = *options;
  }
  if (!ctx->dispatch)
    return tw__fail(TW_ERR_STATE,
                    "%s: the context was created without dispatch; set "
                    "tw_context_config.dispatch = 1 on every rank",
                    who);
  if (d->ctx != ctx)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "%s: the device plan belongs to another context", who);
  if (id_type != TW_INDEX_INT32 && id_type != TW_INDEX_INT64)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "%s: id_type %d; give TW_INDEX_INT32 or TW_INDEX_INT64", who, (int)id_type);
  if (ctx->capacity > 0)
    return tw__dispatch_run_static(ctx, d, x, topk_ids, id_type, topk_weights, tokens, expert_in,
                                   &opt, extra, stream, who);
  /* A failed context refuses the call, but through the all-gather below: the ranks may learn
   * of a failure at different times, and a rank that left early would leave the others
   * waiting in the collective. */
  const int earlier = !ctx->failed && ctx->have_call &&
                      cudaEventQuery(ctx->ev_err_copied) == cudaSuccess && ctx->h_err->status != 0;
  const int was_failed = ctx->failed || earlier;
  int32_t budget = 0;
  TW_TRY(tw__call_budget(who, opt.sm_budget, ctx->sm_budget, &budget));
  /* The plan's config: the caller's (checked as tw_plan_create checks it), planned for the
   * context's dataflow. */
  tw_plan_config pc = TW_PLAN_CONFIG_INIT;
  if (opt.plan_config != NULL) {
    const tw_plan_config* given = opt.plan_config;
    const size_t v1_size = offsetof(tw_plan_config, schedule);
    const size_t v2_size = offsetof(tw_plan_config, dataflow);
    const size_t v3_size = offsetof(tw_plan_config, sm_budget);
    const size_t known = given->size == v1_size || given->size == v2_size || given->size == v3_size
                             ? given->size
                             : sizeof(tw_plan_config);
    TW_TRY(tw__check_header("tw_plan_config", given->size, known, given->magic,
                            TW_PLAN_CONFIG_MAGIC, given->version));
    memcpy(&pc, given, given->size);
    pc.size = sizeof pc;
    if (given->size > offsetof(tw_plan_config, dataflow) &&
        given->dataflow != TW_DATAFLOW_DEFAULT && given->dataflow != ctx->dataflow)
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "%s: plan_config.dataflow is %s, the context runs %s; leave it "
                      "TW_DATAFLOW_DEFAULT",
                      who, tw__dataflow_name(given->dataflow), tw__dataflow_name(ctx->dataflow));
  } else {
    pc.sm_budget = ctx->sm_budget; /* the budget of the combine calls that follow */
  }
  pc.dataflow = ctx->dataflow;

  /* Checks whose failure every rank learns (the all-gather): no rank leaves before it. */
  const tw_problem* p = &ctx->problem;
  const int32_t K = p->top_k, ET = p->experts, W = ctx->world, rank = ctx->rank;
  int32_t local = TW_SUCCESS, local_where = 0;
  if (was_failed) {
    local = earlier ? ctx->h_err->status : TW_ERR_STATE;
    local_where = kLocalFailed;
  } else if (tokens < 0 || tokens > p->max_tokens) {
    local = tokens < 0 ? TW_ERR_INVALID_SIZE : TW_ERR_CAPACITY;
    local_where = kLocalTokens;
  } else if (tokens > 0 && (x == NULL || topk_ids == NULL || topk_weights == NULL)) {
    local = TW_ERR_NULL_POINTER;
    local_where = kLocalPointer;
  } else if (tokens > 0 && ((uintptr_t)x & 15) != 0) {
    local = TW_ERR_ALIGNMENT;
    local_where = kLocalAlignment;
  } else if (extra != NULL && extra->status != TW_SUCCESS) {
    local = extra->status;
    local_where = kLocalExtra;
  }
  const int32_t slots = local == TW_SUCCESS ? tokens * K : 0; /* max_tokens * K fits int32 */
  const uint64_t timeout_ns = (uint64_t)ctx->timeout_ms * 1000000ull;
  TW_DEVICE_SCOPE(ctx);

  /* Calls are ordered on the context (as tw_moe_combine's): the credit below says this rank's
   * buffer is free, which holds once its previous calls, the GEMM that read it among them, are
   * done. From here a failure leaves the ranks' counters out of step: mark the context failed
   * until the refusals below, which every rank takes alike. */
  if (ctx->have_call) TW_CUDA_TRY(cudaStreamWaitEvent(stream, ctx->ev_call_done, 0));
  ctx->failed = 1;
  /* An eager call (never captured): traced when the context traces. */
  const tw_dispatch_signal_args sg = tw__signal_args(ctx, ctx->trace);
  TW_TRY(tw__dispatch_credit_launch(&sg, stream));

  /* Count pass and offsets, then the counts and the record to the host. */
  tw_dispatch_scan_args sa;
  memset(&sa, 0, sizeof sa);
  sa.ids = topk_ids;
  sa.id64 = id_type == TW_INDEX_INT64;
  sa.slots = slots;
  sa.top_k = K;
  sa.experts = ET;
  tw__dispatch_chunks(slots, &sa.chunks, &sa.chunk_slots);
  sa.chunk_hist = ctx->d_chunk_hist;
  sa.counts = ctx->d_counts;
  sa.weights_in = topk_weights;
  sa.err = ctx->d_verr;
  sa.rank = rank;
  sa.trace = ctx->trace;
  TW_CUDA_TRY(cudaMemsetAsync(ctx->d_verr, 0, sizeof(tw_dev_error), stream));
  TW_TRY(tw__dispatch_count_launch(&sa, budget, stream));
  int32_t* row = ctx->h_row;
  TW_CUDA_TRY(
      cudaMemcpyAsync(row, ctx->d_verr, sizeof(tw_dev_error), cudaMemcpyDeviceToHost, stream));
  TW_CUDA_TRY(cudaMemcpyAsync(row + kGatherHead, ctx->d_counts, (size_t)ET * 4,
                              cudaMemcpyDeviceToHost, stream));
  TW_CUDA_TRY(cudaEventRecord(ctx->ev_counts, stream));
  TW_CUDA_TRY(cudaEventSynchronize(ctx->ev_counts));
  if (local != TW_SUCCESS) {
    row[0] = local;
    row[1] = local_where;
    row[2] = local_where == kLocalExtra ? extra->bad : tokens;
  }
  row[5] = rank;
  row[6] = slots / K;
  const size_t row_words = (size_t)kGatherHead + ET;
  int32_t* all = ctx->h_all;
  TW_TRY(ctx->team->ops->allgather(ctx->team, row, all, row_words * 4));

  /* Refusals every rank agrees on: a bad id or argument anywhere; counts that do not add up
   * to whole tokens (a bug). */
  int32_t failing = 0, first = -1;
  for (int32_t r = 0; r < W; r++)
    if (all[(size_t)r * row_words] != 0) {
      failing++;
      if (first < 0) first = r;
    }
  if (first >= 0) {
    /* A failed context is the refusal to report: every rank must reset, whatever else. */
    int any_failed = 0;
    for (int32_t r = W - 1; r >= 0; r--)
      if (all[(size_t)r * row_words + 1] == kLocalFailed) {
        any_failed = 1;
        first = r;
      }
    ctx->failed = any_failed; /* alike on every rank */
    return tw__dispatch_refusal(ctx, failing, first, all + (size_t)first * row_words, who);
  }
  int32_t* counts = all + (size_t)W * row_words; /* (W, ET), after the rows */
  for (int32_t r = 0; r < W; r++) {
    const int32_t* rc = all + (size_t)r * row_words + kGatherHead;
    int64_t sum = 0;
    for (int32_t g = 0; g < ET; g++) sum += rc[g];
    if (sum != (int64_t)all[(size_t)r * row_words + 6] * K) {
      ctx->failed = 0;
      return tw__fail(TW_ERR_INTERNAL, "%s: rank %d counted %lld slots for %d tokens of top_k %d",
                      who, r, (long long)sum, all[(size_t)r * row_words + 6], K);
    }
    memcpy(counts + (size_t)r * ET, rc, (size_t)ET * 4);
  }

  /* The plan from the count matrix, uploaded; then every rank learns whether all did it. */
  tw_plan_t plan = NULL;
  tw_status st = tw__plan_create_from_counts(p, counts, rank, &pc, &plan);
  const int banded = extra != NULL && extra->banded && d->copy_units != NULL;
  if (st == TW_SUCCESS) st = tw__dispatch_upload(d, plan, counts, tokens, banded, stream);
  /* An overlapped layer: the copy's CTAs, given (below the budget: GEMM1 runs beside them) or
   * the model's (model_copy.c; 0: the dispatch before GEMM1, where overlap is predicted not to
   * pay). */
  int32_t copy_ctas = 0;
  if (st == TW_SUCCESS && banded) {
    copy_ctas = extra->copy_ctas;
    if (copy_ctas < 0) {
      int64_t own = 0, sent = 0; /* rows to this rank's experts, to every rank's */
      for (int32_t g = 0; g < ET; g++) {
        const int32_t c = counts[(size_t)rank * ET + g];
        sent += c;
        if (g / ctx->local_experts == rank) own += c;
      }
      tw_copy_model_in in;
      in.gemm1_flops = 4.0 * plan->rows * (double)p->hidden * p->ffn;
      in.weight_bytes = 4.0 * ctx->local_experts * (double)p->hidden * p->ffn;
      in.local_bytes = 2.0 * p->hidden * (double)own;
      in.remote_bytes = 2.0 * p->hidden * (double)(sent - own);
      in.local_experts = ctx->local_experts;
      in.budget = budget;
      in.ranks_per_gpu = ctx->team->shared_gpu ? W : 1;
      copy_ctas = tw__model_copy_ctas(&plan->hardware, &in);
    }
    if (copy_ctas > budget - 1) copy_ctas = budget - 1;
  }
  tw_plan_destroy(plan);
  int64_t worst = st;
  /* Keep this rank's message: the collective below must not overwrite it. */
  char why[512];
  snprintf(why, sizeof why, "%s", st != TW_SUCCESS ? tw_last_error() : "");
  TW_TRY(tw__team_max_i64(ctx->team, &worst, 1));
  if (worst != TW_SUCCESS) {
    d->uploaded = 0;
    ctx->failed = 0;
    if (st != TW_SUCCESS) return tw__fail(st, "%s", why);
    return tw__fail((tw_status)worst,
                    "%s: another rank could not plan or upload this call (%s); its "
                    "error says why. Nothing was sent",
                    who, tw_status_string((tw_status)worst));
  }

  /* Place, copy (and arrivals), wait for the peers' rows. */
  sa.slot_base = d->slot_base;
  sa.send_row0 = d->send_row0;
  sa.weights_in = topk_weights;
  sa.slot_row = d->slot_row;
  sa.weights_out = d->weights;
  sa.send_row = d->send_row;
  sa.err = ctx->err;
  if (banded) {
    sa.send_off = d->send_off;
    sa.send_slot = d->send_slot;
  }
  TW_TRY(tw__dispatch_place_launch(&sa, budget, stream));
  tw_dispatch_copy_args cp;
  memset(&cp, 0, sizeof cp);
  cp.peers = ctx->dpeers;
  cp.lay = ctx->dlay;
  cp.x = (const uint16_t*)x;
  cp.ids = topk_ids;
  cp.id64 = sa.id64;
  cp.send_row = d->send_row;
  cp.pads = d->pads;
  cp.pad_rows = d->pad_rows;
  cp.slots = slots;
  cp.top_k = K;
  cp.hidden = p->hidden;
  cp.local_experts = ctx->local_experts;
  cp.rank = rank;
  cp.world = W;
  cp.epochs = ctx->d_epochs;
  cp.err = ctx->err;
  cp.timeout_ns = timeout_ns;
  cp.done = ctx->d_done;
  cp.trace = ctx->trace;
  if (expert_in != NULL) *expert_in = (char*)ctx->dwin.local + ctx->dlay.rows;
  /* A layer's copy is always banded: a peer may overlap (its GEMM1 then waits on the band
   * counters this rank's copy raises) whether this rank does or not. */
  cp.skip_unit = -1;
  if (banded) {
    cp.units = d->copy_units;
    cp.num_units = d->num_copy_units;
    cp.send_slot = d->send_slot;
    if (ctx->fault == TW_FAULT_DROP_COPY_UNIT) {
      cp.skip_unit = ctx->fault_index;
      ctx->fault = TW_FAULT_NONE;
    }
  }
  if (copy_ctas > 0) {
    /* On s_comm, forked after the place pass; the caller's GEMM1 runs on S beside it and
     * tw__dispatch_finish joins. The context stays marked failed until then. */
    TW_CUDA_TRY(cudaEventRecord(ctx->ev_copy_fork, stream));
    TW_CUDA_TRY(cudaStreamWaitEvent(ctx->s_comm, ctx->ev_copy_fork, 0));
    TW_TRY(tw__dispatch_copy_launch(&cp, copy_ctas, ctx->s_comm));
    TW_CUDA_TRY(cudaEventRecord(ctx->ev_copy_join, ctx->s_comm));
    extra->copy_ctas_used = copy_ctas;
    d->uploaded = 1;
    return TW_SUCCESS;
  }
  TW_TRY(tw__dispatch_copy_launch(&cp, budget, stream));
  return tw__dispatch_finish(ctx, d, 0, stream);
}

tw_status tw__dispatch_finish(tw_context_t ctx, tw_device_plan_t d, int joined_copy,
                              cudaStream_t stream) {
  if (joined_copy) TW_CUDA_TRY(cudaStreamWaitEvent(stream, ctx->ev_copy_join, 0));
  const tw_dispatch_signal_args sg = tw__signal_args(ctx, ctx->trace);
  TW_TRY(tw__dispatch_wait_launch(&sg, stream));
  TW_CUDA_TRY(cudaEventRecord(ctx->ev_call_done, stream));
  /* Error record to the host off the caller's path (the next call looks at it). */
  TW_CUDA_TRY(cudaStreamWaitEvent(ctx->s_aux, ctx->ev_call_done, 0));
  TW_CUDA_TRY(cudaMemcpyAsync(ctx->h_err, ctx->err, sizeof(tw_dev_error), cudaMemcpyDeviceToHost,
                              ctx->s_aux));
  TW_CUDA_TRY(cudaEventRecord(ctx->ev_err_copied, ctx->s_aux));
  ctx->have_call = 1;
  ctx->failed = 0;
  d->uploaded = 1;
  return TW_SUCCESS;
}

extern "C" tw_status tw_moe_dispatch_ex(tw_context_t ctx, tw_device_plan_t d, const void* x,
                                        const void* topk_ids, tw_index_type id_type,
                                        const float* topk_weights, int32_t tokens, void** expert_in,
                                        const tw_dispatch_options* options, cudaStream_t stream) {
  tw__clear_error();
  return tw__dispatch_run(ctx, d, x, topk_ids, id_type, topk_weights, tokens, expert_in, options,
                          NULL, stream);
}

extern "C" tw_status tw_moe_dispatch(tw_context_t ctx, tw_device_plan_t dplan, const void* x,
                                     const void* topk_ids, tw_index_type id_type,
                                     const float* topk_weights, int32_t tokens, void** expert_in,
                                     cudaStream_t stream) {
  return tw_moe_dispatch_ex(ctx, dplan, x, topk_ids, id_type, topk_weights, tokens, expert_in, NULL,
                            stream);
}
