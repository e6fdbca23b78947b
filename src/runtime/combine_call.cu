/*
 * combine_call.cu: the launch sequence of one GEMM2 + combine call.
 *
 * On the caller's stream S and the context's communication stream K:
 *   S: record start -> producer (P = budget - C CTAs) -> wait(consumer done) -> reduction -> done
 *   K: wait(start) [unfused: wait(producer done)] -> consumer (C CTAs) -> consumer done
 * The producer is enqueued first and nothing but the next call's consumer ever follows a
 * consumer on K (docs/hardware.md, co-residency: a kernel queued behind a spinning consumer can
 * block a producer that shares its hardware queue). Deadlock freedom: in call i a consumer waits
 * only for its own producer (never waits) and for the owners' reductions of call i - 1; a
 * reduction waits for its own consumer (stream order, so it never holds SMs the consumer needs)
 * and for the peers' consumers of call i. By induction over calls nothing waits in a cycle. On an
 * in-process team the ranks share one GPU: each call keeps within its SM budget and the budgets
 * add up to at most the GPU's SMs (checked at creation), so every rank's kernels find SMs.
 *
 * CUDA graphs: what changes from call to call (the epoch, the arrival targets) lives on the
 * device (tw_call_state, advanced by the call's first kernel), so a captured call replays
 * correctly. Under capture the call makes no query, no wait on an event of an earlier eager call
 * and no copy of the error record (tw_context_check reads it), and every kernel is on S: the
 * consumer is the producer's programmatic dependent (tw__enqueue_captured), so a graph of the
 * call is one chain. A failed capture enqueues nothing that runs: the context stays usable.
 */
#include <stdlib.h>
#include <string.h>

#include "context.h"

/* cuStreamWriteValue32 through the runtime's driver entry point (nothing links libcuda directly);
 * resolved once per process. */
typedef CUresult (*tw__write_value_fn)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

static tw_status tw__stream_write_value(cudaStream_t stream, void* addr, uint32_t value) {
  static tw__write_value_fn fn = NULL;
  if (fn == NULL) {
    void* p = NULL;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    cudaError_t e =
        cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", &p, 12000, cudaEnableDefault, &q);
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || p == NULL)
      return tw__fail(TW_ERR_CUDA,
                      "tw_moe_combine: cuStreamWriteValue32 not found in the driver (%s); the add "
                      "dataflow needs a driver for CUDA 12.0 or newer",
                      cudaGetErrorString(e));
    fn = (tw__write_value_fn)p;
  }
  /* Default flags: a system-scope memory fence before the write, after the stream's earlier
   * work (the zeroing copies) has completed. */
  const CUresult r = fn((CUstream)stream, (CUdeviceptr)addr, value, CU_STREAM_WRITE_VALUE_DEFAULT);
  if (r != CUDA_SUCCESS)
    return tw__fail(TW_ERR_CUDA,
                    "tw_moe_combine: cuStreamWriteValue32 failed (%d); the add dataflow needs "
                    "stream memory operations (CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS)",
                    (int)r);
  return TW_SUCCESS;
}

/* The add dataflow: once output buffer `buf` is zero (in `stream` order), ready = e (ctx->epoch):
 * peers may add into it in call e + 1. The stream write fences at system scope first. */
static tw_status tw__raise_ready(tw_context_t ctx, cudaStream_t stream, int buf) {
  TW_TRY(
      tw__stream_write_value(stream, (char*)ctx->win.local + ctx->lay.ready, (uint32_t)ctx->epoch));
  ctx->dirty_tokens[buf] = 0;
  return TW_SUCCESS;
}

/* The add dataflow, at the end of call e (ctx->epoch), when its producer does not zero: zeroes
 * output buffer `buf` (call e - 1's output, valid until call e started) on the context's zeroing
 * stream, then ready = e (peers may add into it in call e + 1) and ev_zeroed (this rank's producer
 * of call e + 1 waits for it). TW_ADD_ZEROING=copy: from call e's start, with this rank's copy
 * engine pulling the next rank's zeros over NVLink (no SM: a kernel here would wait for the
 * producer's and consumer's SMs). A comm-only call (a timing mode: it has no producer)
 * zeroes with a memset after it has ended, so that its time is the consumer's alone. */
static tw_status tw__zero_next_output(tw_context_t ctx, int buf, int after_call) {
  char* dst = (char*)ctx->win.local + tw__out_offset(ctx, buf);
  const size_t bytes = (size_t)ctx->dirty_tokens[buf] * (size_t)ctx->problem.hidden * 2;
  TW_CUDA_TRY(cudaStreamWaitEvent(ctx->s_zero, after_call ? ctx->ev_call_done : ctx->ev_start, 0));
  if (after_call) {
    if (bytes > 0) TW_CUDA_TRY(cudaMemsetAsync(dst, 0, bytes, ctx->s_zero));
  } else if (ctx->peer_zeros != NULL) {
    for (size_t at = 0; at < bytes; at += ctx->lay.zeros_bytes) {
      const size_t n = bytes - at < ctx->lay.zeros_bytes ? bytes - at : ctx->lay.zeros_bytes;
      TW_CUDA_TRY(
          cudaMemcpyAsync(dst + at, ctx->peer_zeros, n, cudaMemcpyDeviceToDevice, ctx->s_zero));
    }
  } else if (bytes > 0) { /* one rank: no peer to copy from, and no consumer beside the GEMM */
    TW_CUDA_TRY(cudaMemsetAsync(dst, 0, bytes, ctx->s_zero));
  }
  if (ctx->timing) TW_CUDA_TRY(cudaEventRecord(ctx->t_zero_end, ctx->s_zero));
  TW_TRY(tw__raise_ready(ctx, ctx->s_zero, buf));
  TW_CUDA_TRY(cudaEventRecord(ctx->ev_zeroed, ctx->s_zero));
  ctx->last_zero_copied = 1;
  return TW_SUCCESS;
}

/* The producer and consumer of a captured call (reduce dataflow, no timing), on the caller's
 * stream S alone: the consumer is the producer's programmatic dependent (it starts once every
 * producer CTA has started, and its end waits for the producer's), so the graph is one chain and
 * runs on the stream it is launched on. With a fork, a graph runs the branch on an internal
 * stream of its choosing, whose hardware queue another rank's spinning kernels may hold on an
 * in-process team: replays stalled at W >= 3 (dev/NOTES.md section 29). Unfused and comm-only
 * calls are plain launches in order. */
static tw_status tw__enqueue_captured(const tw_gemm_args* g, const tw_consumer_args* ca, int C,
                                      int mode, cudaStream_t stream) {
  const int gemm = mode != TW_COMBINE_COMM_ONLY;
  if (gemm) TW_TRY(tw__gemm_launch(g, stream));
  if (C > 0) TW_TRY(tw__consumer_launch(ca, C, gemm && mode == TW_COMBINE_OVERLAP, stream));
  return TW_SUCCESS;
}

extern "C" tw_status tw_moe_combine_ex(tw_context_t ctx, tw_device_plan_t d, const void* expert_in,
                                       const void* w2, void* out, const tw_combine_options* options,
                                       cudaStream_t stream) {
  tw__clear_error();
  TW_CHECK_NULL(ctx);
  TW_CHECK_NULL(d);
  tw_combine_options opt = TW_COMBINE_OPTIONS_INIT;
  if (options != NULL) {
    /* Options that end before `sm_budget` (an earlier tilewave.h) take the context's. */
    const size_t v1_size = offsetof(tw_combine_options, sm_budget);
    TW_TRY(tw__check_header("tw_combine_options", options->size,
                            options->size == v1_size ? v1_size : sizeof(tw_combine_options),
                            options->magic, TW_COMBINE_OPTIONS_MAGIC, options->version));
    memcpy(&opt, options, options->size);
    opt.size = sizeof opt;
  }
  const tw_combine_mode mode = opt.mode;
  if (mode != TW_COMBINE_OVERLAP && mode != TW_COMBINE_UNFUSED && mode != TW_COMBINE_GEMM_ONLY &&
      mode != TW_COMBINE_COMM_ONLY)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "tw_moe_combine: unknown mode %d", (int)mode);
  if (mode != TW_COMBINE_COMM_ONLY) {
    TW_CHECK_NULL(expert_in);
    TW_CHECK_NULL(w2);
  }
  const int add = ctx->dataflow == TW_DATAFLOW_ADD;
  if (add && out != NULL)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_moe_combine: the add dataflow writes the output into the context's window; "
                    "pass out = NULL and read it with tw_context_output()");
  if (mode != TW_COMBINE_GEMM_ONLY && d->tokens > 0 && !add) TW_CHECK_NULL(out);
  if (d->ctx != ctx)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_moe_combine: the device plan belongs to another context");
  if (!d->uploaded)
    return tw__fail(TW_ERR_STATE, "tw_moe_combine: upload a plan first (tw_device_plan_upload)");
  if (ctx->failed)
    return tw__fail(TW_ERR_STATE, ctx->failed_enqueue
                                      ? "tw_moe_combine: an earlier call failed after part of it "
                                        "was enqueued; call tw_context_reset() on every rank first"
                                      : "tw_moe_combine: an earlier call failed on the device; "
                                        "call tw_context_reset() on every rank first");
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  {
    const cudaError_t ce = cudaStreamIsCapturing(stream, &capture);
    if (ce != cudaSuccess)
      return tw__fail(TW_ERR_CUDA, "tw_moe_combine: cudaStreamIsCapturing: %s",
                      cudaGetErrorString(ce));
  }
  if (capture == cudaStreamCaptureStatusInvalidated)
    return tw__fail(TW_ERR_STATE,
                    "tw_moe_combine: the stream's capture was invalidated by an earlier call; end "
                    "it (cudaStreamEndCapture) and capture again");
  const int capturing = capture == cudaStreamCaptureStatusActive;
  if (capturing && add)
    return tw__fail(TW_ERR_UNSUPPORTED,
                    "tw_moe_combine: the add dataflow cannot be captured in a CUDA graph (its two "
                    "output buffers alternate on the host); capture a context of the reduce "
                    "dataflow");
  if (capturing && ctx->timing)
    return tw__fail(TW_ERR_UNSUPPORTED,
                    "tw_moe_combine: a context with timing cannot be captured (its timings are "
                    "read from eager calls' events); create it with tw_context_config.timing = 0");
  /* A completed earlier call that failed: report it now (never blocks; not under capture, where
   * a query is not allowed). */
  if (!capturing && ctx->have_call && cudaEventQuery(ctx->ev_err_copied) == cudaSuccess &&
      ctx->h_err->status != 0) {
    ctx->failed = 1;
    return tw__report(ctx, ctx->h_err, "tw_moe_combine: an earlier call failed");
  }
  int32_t budget = 0;
  TW_TRY(tw__call_budget("tw_moe_combine", opt.sm_budget, ctx->sm_budget, &budget));
  /* A call that sends nothing needs no consumer, unless the add dataflow receives rows: there
   * the consumer's CTA 0 waits for the arrivals that end the call. */
  int receives = 0;
  for (int s = 0; s < ctx->world; s++) receives |= d->recv_bands[s] > 0;
  const int moves = d->total_units > 0 || (add && receives);
  int C = 0;
  if (moves) {
    C = opt.comm_ctas > 0 ? opt.comm_ctas : d->comm_ctas;
    if (C < 1) C = d->total_units > 0 ? TW_DEFAULT_COMM_CTAS : 1;
    if (C > ctx->max_comm_ctas) {
      if (opt.comm_ctas > 0)
        return tw__fail(TW_ERR_INVALID_ARGUMENT,
                        "tw_moe_combine: comm_ctas %d above the context's max_comm_ctas %d",
                        opt.comm_ctas, ctx->max_comm_ctas);
      C = ctx->max_comm_ctas;
    }
    if (C >= budget)
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "tw_moe_combine: %d consumer CTAs leave none of the call's %d SMs to the "
                      "producer; plan with tw_plan_config.sm_budget = %d, or pass a smaller "
                      "comm_ctas",
                      C, budget, budget);
  }
  /* Every kernel of the call stays within the budget: P + C of the concurrent pair, and the
   * reduction after them. */
  const int P = budget - C;
  TW_DEVICE_SCOPE(ctx);
  const int timing = ctx->timing;

  tw_gemm_args g;
  const tw_gemm_shape shape = {d->rows, ctx->problem.ffn, ctx->problem.hidden, ctx->local_experts,
                               ctx->tm, ctx->tn};
  TW_TRY(tw__gemm_args_init(&g, &shape, expert_in, w2, ctx->c, d->tiles, d->num_tiles, P,
                            TW_SIGNAL_GPU, ctx->band_counters));
  g.variant = ctx->gemm_variant;
  /* The static plan of the capturable dispatch: the producer runs the tiles with live rows of
   * the last dispatch into dplan (its mask kernel wrote them, earlier in stream order). */
  if (d->is_static) {
    g.tiles = d->live_tiles;
    g.live_tiles = d->live_counts;
  }
  /* Tracing (runtime.h): eager calls only, so that no graph keeps the buffer's address. */
  tw_trace* const trace = capturing ? NULL : ctx->trace;
  g.trace = trace;
  ctx->last_launch.budget = budget;
  ctx->last_launch.producer_ctas = mode == TW_COMBINE_COMM_ONLY ? 0 : P;
  ctx->last_launch.consumer_ctas = mode == TW_COMBINE_GEMM_ONLY ? 0 : C;
  ctx->last_launch.reduce_ctas = 0;
  ctx->last_launch.reduce_cap = 0;

  /* Calls are ordered on the context whatever stream each comes on: this one starts after the
   * previous call's last kernel (whose stream had joined its consumer), so that its counter
   * zeroing and its producer's writes to the GEMM output never overlap that call. On the same
   * stream the wait is already implied. A captured call is ordered by the stream its graph is
   * launched on (tilewave.h). */
  if (ctx->have_call && !capturing) TW_CUDA_TRY(cudaStreamWaitEvent(stream, ctx->ev_call_done, 0));
  if (mode == TW_COMBINE_GEMM_ONLY) {
    /* No consumer will reset band counters, so the producer must not touch them. */
    g.scope = TW_SIGNAL_NONE;
    g.band_counters = NULL;
    if (timing) TW_CUDA_TRY(cudaEventRecord(ctx->t_start, stream));
    TW_TRY(tw__gemm_launch(&g, stream));
    if (timing) {
      TW_CUDA_TRY(cudaEventRecord(ctx->t_gemm_end, stream));
      TW_CUDA_TRY(cudaEventRecord(ctx->t_end, stream));
    }
    if (!capturing) {
      TW_CUDA_TRY(cudaEventRecord(ctx->ev_call_done, stream));
      ctx->have_call = 1;
    }
    ctx->last_mode = mode;
    return TW_SUCCESS;
  }

  /* From here on a failure leaves the ranks' counters out of step: mark the context failed
   * (under capture nothing runs until the graph is launched, and a failed capture never is). */
  const uint64_t epoch = ctx->epoch + 1;
  if (!capturing) ctx->epoch = epoch;
  if (!capturing) ctx->failed = ctx->failed_enqueue = 1;
  const uint64_t timeout_ns = (uint64_t)ctx->timeout_ms * 1000000ull;

  tw_consumer_args ca;
  tw__consumer_args_init(ctx, &ca);
  ca.bands = d->bands;
  ca.segments = d->segments;
  ca.seg_unit0 = d->seg_unit0;
  ca.seg_split0 = d->seg_split0;
  ca.total_units = d->total_units;
  ca.plan_fp = d->plan_fp;
  ca.band_live = d->is_static ? d->band_live : NULL; /* the same mask: only live rows leave */
  ca.wait_bands = mode != TW_COMBINE_COMM_ONLY;
  ca.debug_tags = ctx->debug_tags;
  ca.trace = trace;
  /* The add dataflow: this call's output buffer (combine.h, `ready`). */
  const int buf = (int)(epoch & 1);
  if (add) {
    ca.row_token = d->row_token;
    ca.out_offset = tw__out_offset(ctx, buf);
    g.row_weight = d->row_weight;
    g.add_out = (char*)ctx->win.local + ca.out_offset;
    g.row_token = d->row_token;
    g.bands = d->bands;
    g.rank = ctx->rank;
  }
  ca.fault = ctx->fault;
  ca.fault_index = ctx->fault_index;
  ca.timeout_ns = timeout_ns;
  ctx->fault = TW_FAULT_NONE;

  /* The call's first kernel: zeroed band counters and unit claims (adjacent), so that the
   * consumer waits for this call's publishes only, and the call state advanced. The previous
   * call's producer is done here (stream order), and so is its consumer (the join before that
   * call's reduction). */
  TW_TRY(tw__call_begin_launch(ctx->call_state, d->recv_units, ctx->world, ctx->unit_next,
                               (int64_t)kClaimWords + d->num_bands, ca.band_live,
                               (int64_t)kClaimWords, (uint32_t)ctx->col_tiles, stream));
  /* The add dataflow: the producer adds into this call's buffer, which the previous call zeroed
   * (on the zeroing stream, or in its producer: then ev_zeroed is older, or was never recorded,
   * and the wait is a no-op). */
  if (add) TW_CUDA_TRY(cudaStreamWaitEvent(stream, ctx->ev_zeroed, 0));
  /* The producer zeroes the other buffer (the previous call's output, valid until this call
   * started) for the next call (unless TW_ADD_ZEROING=copy); a stream write after it sets ready. */
  /* A call without tiles launches no producer (nothing for its warps to run in): the buffer is
   * then zeroed after the call, like a comm-only call's (the soak found stale sums there). */
  const int producer_runs = mode != TW_COMBINE_COMM_ONLY && d->num_tiles > 0;
  const int zero_in_producer = add && ctx->zero_in_producer && producer_runs;
  if (zero_in_producer) {
    g.zero = (char*)ctx->win.local + tw__out_offset(ctx, buf ^ 1);
    g.zero_vectors = ctx->dirty_tokens[buf ^ 1] * ctx->problem.hidden * 2 / 16;
  }
  if (!capturing) TW_CUDA_TRY(cudaEventRecord(ctx->ev_start, stream));
  if (timing) TW_CUDA_TRY(cudaEventRecord(ctx->t_start, stream));
  if (capturing) {
    TW_TRY(tw__enqueue_captured(&g, &ca, C, mode, stream));
  } else {
    /* S: producer first (co-residency), K: consumer after `start` (or after the producer). */
    if (mode != TW_COMBINE_COMM_ONLY) TW_TRY(tw__gemm_launch(&g, stream));
    if (zero_in_producer) TW_TRY(tw__raise_ready(ctx, stream, buf ^ 1));
    if (timing) TW_CUDA_TRY(cudaEventRecord(ctx->t_gemm_end, stream));
    if (mode == TW_COMBINE_UNFUSED) {
      TW_CUDA_TRY(cudaEventRecord(ctx->ev_gemm_done, stream));
      TW_CUDA_TRY(cudaStreamWaitEvent(ctx->s_comm, ctx->ev_gemm_done, 0));
    } else {
      TW_CUDA_TRY(cudaStreamWaitEvent(ctx->s_comm, ctx->ev_start, 0));
    }
    if (C > 0) {
      if (timing) TW_CUDA_TRY(cudaEventRecord(ctx->t_comm_start, ctx->s_comm));
      TW_TRY(tw__consumer_launch(&ca, C, 0, ctx->s_comm));
      if (timing) TW_CUDA_TRY(cudaEventRecord(ctx->t_comm_end, ctx->s_comm));
      TW_CUDA_TRY(cudaEventRecord(ctx->ev_comm_done, ctx->s_comm));
    } else if (timing) { /* nothing to move: no consumer, its phase is empty */
      TW_CUDA_TRY(cudaEventRecord(ctx->t_comm_start, stream));
      TW_CUDA_TRY(cudaEventRecord(ctx->t_comm_end, stream));
    }
    /* The reduction starts only once this rank's consumer has finished. It spins on the peers'
     * consumers; if it could start earlier, its CTAs could fill every SM of this GPU before the
     * local consumer became resident, while the peer's reduction did the same to the peer's
     * consumer: a cycle through SM resources (seen in unfused mode, where both kernels become
     * ready together when the producer ends). This join also orders the next call's producer,
     * which overwrites the GEMM output, after the consumer's reads. */
    if (C > 0) TW_CUDA_TRY(cudaStreamWaitEvent(stream, ctx->ev_comm_done, 0));
  }
  if (timing) TW_CUDA_TRY(cudaEventRecord(ctx->t_red_start, stream));
  /* The add dataflow ends with the consumer: it waited for the arrivals (no credits there). */
  if (!add) {
    tw_reduce_args ra;
    tw__reduce_args_init(ctx, &ra);
    ra.slot_row = d->slot_row;
    ra.weights = d->weights;
    ra.out = (uint16_t*)out;
    ra.tokens = d->tokens;
    ra.recv_rows = d->recv_rows;
    ra.plan_fp = d->plan_fp;
    ra.recv_units = d->recv_units;
    ra.consumer_units = C > 0 ? d->total_units : 0;
    ra.rank = ctx->rank;
    ra.world = ctx->world;
    ra.debug_tags = ctx->debug_tags;
    ra.debug_slots = ctx->debug_slots;
    ra.timeout_ns = timeout_ns;
    ra.trace = trace;
    /* On a whole GPU of its own the reduction fills every SM with as many CTAs as fit (it is
     * bound by device memory); under a smaller budget, or beside other ranks on one GPU, at
     * most one CTA per budgeted SM, so that it never holds SMs another kernel waits for. */
    const int whole_gpu = budget == ctx->sm_count && !ctx->team->shared_gpu;
    TW_TRY(tw__reduce_launch(&ra, budget, whole_gpu ? 0 : 1, &ctx->last_launch.reduce_ctas,
                             &ctx->last_launch.reduce_cap, stream));
  }
  if (timing) TW_CUDA_TRY(cudaEventRecord(ctx->t_red_end, stream));
  if (timing) TW_CUDA_TRY(cudaEventRecord(ctx->t_end, stream));
  if (capturing) {
    /* Everything forked (K) has joined S above; the graph holds no copy of the error record. */
    d->captured = 1;
    ctx->last_mode = mode;
    ctx->last_tokens = d->tokens;
    return TW_SUCCESS;
  }
  TW_CUDA_TRY(cudaEventRecord(ctx->ev_call_done, stream));
  /* Error record to the host off the caller's path. */
  TW_CUDA_TRY(cudaStreamWaitEvent(ctx->s_aux, ctx->ev_call_done, 0));
  TW_CUDA_TRY(cudaMemcpyAsync(ctx->h_err, ctx->err, sizeof(tw_dev_error), cudaMemcpyDeviceToHost,
                              ctx->s_aux));
  TW_CUDA_TRY(cudaEventRecord(ctx->ev_err_copied, ctx->s_aux));
  if (add) {
    /* This call writes rows [0, tokens) of its buffer; the other one, the previous call's output,
     * is zeroed during this call (by its producer, above, or here), for the next call. */
    ctx->dirty_tokens[buf] = d->tokens;
    ctx->last_zero_copied = 0;
    if (!zero_in_producer) TW_TRY(tw__zero_next_output(ctx, buf ^ 1, !producer_runs));
    ctx->out_buf = buf;
  }
  ctx->have_call = 1;
  ctx->last_mode = mode;
  ctx->last_tokens = d->tokens;
  ctx->failed = ctx->failed_enqueue = 0;
  return TW_SUCCESS;
}

extern "C" tw_status tw_moe_combine(tw_context_t ctx, tw_device_plan_t dplan, const void* expert_in,
                                    const void* w2, void* out, cudaStream_t stream) {
  return tw_moe_combine_ex(ctx, dplan, expert_in, w2, out, NULL, stream);
}
