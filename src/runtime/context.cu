/*
 * context.cu: the runtime of GEMM2 + combine: a context per rank over the caller's NCCL
 * communicator (symmetric receive window, device communicator, internal streams, counters),
 * device copies of plans, and the launch sequence of one call.
 *
 * One call, on the caller's stream S and the context's communication stream K:
 *   S: record start -> producer (P = SMs - C CTAs) -> wait(consumer done) -> reduction -> done
 *   K: wait(start) [unfused: wait(producer done)] -> consumer (C CTAs) -> consumer done
 * The producer is enqueued first and nothing but the next call's consumer ever follows a
 * consumer on K (HARDWARE.md, co-residency: a kernel queued behind a spinning consumer can block
 * a producer that shares its hardware queue). Deadlock freedom: in call i a consumer waits only
 * for its own producer (never waits) and for the owners' reductions of call i - 1; a reduction
 * waits for its own consumer (stream order, so it never holds SMs the consumer needs) and for
 * the peers' consumers of call i. By induction over calls nothing waits in a cycle. Every kernel is
 * launched once at context creation so that lazy module loading never stalls a launch while another
 * kernel spins.
 *
 * Errors found on the device (a bounded wait that expired, a debug-tag mismatch) land in a
 * device error record; after each call an auxiliary stream copies it to pinned host memory,
 * where the next call looks at it without blocking. tw_context_check() is the collective,
 * blocking way to learn the outcome on every rank.
 *
 * This file is C++ only because NCCL's device-communicator API (nccl_device.h) is; the public
 * entry points are extern "C".
 */
#include <cuda.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "combine.h"
#include "checks.h"
#include "core.h"
#include "kernels.h"
#include "plan.h"
#include "runtime.h"
#include "tilewave.h"

/* The consumer's claim counter sits alone in a 128-byte line ahead of the band counters: the
 * producer's releases and the consumer's polls on those never contend with the claims. */
static const size_t kClaimWords = 32;

struct tw_context {
  tw_problem problem;
  ncclComm_t comm; /* borrowed */
  int32_t rank, world, device, sm_count;
  int32_t timeout_ms, debug_tags, max_comm_ctas, timing;
  int32_t tm, tn, col_tiles, local_experts;
  int32_t tiles_per_unit; /* consumer unit width in column tiles (TW_CONSUMER_TILES_PER_UNIT) */
  int32_t unit_chunks;    /* ceil(col_tiles / tiles_per_unit) */
  /* The last tail_bands bands of every destination stream go as tail_parts row parts each, so
   * that the band the producer finishes last is not one CTA's copy after the GEMM has ended
   * (TW_CONSUMER_TAIL_BANDS / TW_CONSUMER_TAIL_PARTS; the owners count the units). */
  int32_t tail_bands, tail_parts;
  int32_t copy;          /* tw_consumer_copy: REGISTERS or BULK */
  int32_t dataflow;      /* TW_DATAFLOW_REDUCE or TW_DATAFLOW_ADD */
  int32_t gemm_variant;  /* producer kernel version (TW_GEMM_VARIANT; 0 = the library's) */
  int64_t rows_max;      /* GEMM output rows any plan of this problem can need */
  int64_t bands_max;     /* bands (and segments) any plan can have */
  int64_t slots_max;     /* max_tokens * top_k */
  int64_t recv_rows_max; /* rows other ranks can send here in one call */

  /* Symmetric window: receive rows, arrivals, credits, debug tags (combine.h). */
  tw_window_layout lay;
  void* win_buf;
  ncclWindow_t win;
  int win_registered;
  ncclDevComm dev_comm;
  int dev_comm_created;

  /* Local device memory. */
  uint16_t* c;             /* (rows_max, hidden) bf16 GEMM output */
  uint32_t* unit_next;     /* consumer's unit claims; the start of the small-state block below
                              (one allocation), zeroed with the band counters */
  uint32_t* band_counters; /* (bands_max), kClaimWords after unit_next */
  uint32_t* reduce_done;   /* reduction CTA completion counter */
  tw_dev_error* err;       /* device error record */
  tw_dev_error* err_all;   /* (world) gathered records (tw_context_check) */
  uint32_t* debug_slots;   /* (slots_max) */
  int32_t* scratch;        /* barrier word */
  tw_dev_error* h_err;     /* pinned copy of *err after each call */
  tw_dev_error* h_err_all; /* pinned (world) */

  /* The add dataflow: the output buffer the last call added into (0 or 1; -1: none since the
   * last reset), the rows each buffer has had written since it was last zeroed, and a peer's
   * zeros this rank's copy engine pulls to zero its next buffer under TW_ADD_ZEROING=copy. */
  int32_t out_buf;
  int64_t dirty_tokens[2];
  const void* peer_zeros; /* NULL with one rank: a memset zeroes instead */
  int zero_in_producer;   /* the producer's idle warps zero (default), else the copy engine */
  int last_zero_copied;   /* the last call zeroed with the copy engine (t_zero_end is valid) */

  cudaStream_t s_comm; /* consumer */
  cudaStream_t s_aux;  /* error copies, barriers, warm-up */
  cudaStream_t s_zero; /* the add dataflow's zeroing: copies and a stream write only, no kernel */
  cudaEvent_t ev_start, ev_gemm_done, ev_comm_done, ev_call_done, ev_err_copied, ev_zeroed;
  cudaEvent_t t_start, t_gemm_end, t_comm_start, t_comm_end, t_red_start, t_red_end, t_end,
      t_zero_end;

  uint64_t epoch;                       /* calls with communication since the last reset */
  uint32_t arrive_target[TW_MAX_RANKS]; /* cumulative arrivals expected from each source */
  int failed;                           /* a device error was seen; calls refused until reset */
  int have_call;                        /* ev_call_done / ev_err_copied refer to a real call */
  int last_mode;
  int64_t last_tokens;
  int fault, fault_index;
};

struct tw_device_plan {
  tw_context_t ctx;
  void* mem;            /* one device allocation holding the arrays below */
  tw_tile* tiles;       /* (tiles_max) */
  tw_band* bands;       /* (bands_max) */
  tw_segment* segments; /* (bands_max) */
  int32_t* seg_unit0;   /* (bands_max + 1) */
  int32_t* seg_split0;  /* (bands_max) */
  int32_t* slot_row;    /* (slots_max) */
  float* weights;       /* (slots_max) */
  int32_t* row_token;   /* (rows_max) the add dataflow: each row's token at its owner, -1 pad */
  float* row_weight;    /* (rows_max) the add dataflow: each row's gate weight, 0 for padding */
  int32_t* h_row_token; /* host staging of both (one allocation; add dataflow only) */
  float* h_row_weight;
  int32_t* h_seg_unit0;  /* host staging of seg_unit0 */
  int32_t* h_seg_split0; /* host staging of seg_split0 (in h_seg_unit0's allocation) */
  int uploaded;
  int32_t rows, recv_rows, num_tiles, num_bands, total_units, tokens, comm_ctas;
  int32_t recv_bands[TW_MAX_RANKS];
};

/* ---- helpers ------------------------------------------------------------------------------ */

/* Makes the context's device current for the scope of a call and restores the caller's. */
struct tw__device_guard {
  int prev = -1;
  cudaError_t status = cudaSuccess;
  explicit tw__device_guard(int dev) {
    if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
    if (prev != dev) status = cudaSetDevice(dev);
  }
  ~tw__device_guard() {
    int cur = -1;
    if (prev >= 0 && cudaGetDevice(&cur) == cudaSuccess && cur != prev) cudaSetDevice(prev);
  }
};

#define TW_DEVICE_SCOPE(ctx)                                                                \
  tw__device_guard tw__guard((ctx)->device);                                                \
  if (tw__guard.status != cudaSuccess)                                                      \
  return tw__fail(TW_ERR_CUDA, "%s: cudaSetDevice(%d) failed: %s", __func__, (ctx)->device, \
                  cudaGetErrorString(tw__guard.status))

static uint64_t tw__align(uint64_t v, uint64_t a) {
  return (v + a - 1) / a * a;
}

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
    default:
      return "device wait";
  }
}

static tw_status tw__report(tw_context_t ctx, const tw_dev_error* e, const char* how) {
  tw_status s = e->status == TW_ERR_INTERNAL ? TW_ERR_INTERNAL : TW_ERR_TIMEOUT;
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

/* All ranks reach this point before any leaves (a one-word all-reduce on the aux stream). */
static tw_status tw__barrier(tw_context_t ctx) {
  TW_NCCL_TRY(
      ncclAllReduce(ctx->scratch, ctx->scratch, 1, ncclInt32, ncclSum, ctx->comm, ctx->s_aux));
  TW_CUDA_TRY(cudaStreamSynchronize(ctx->s_aux));
  return TW_SUCCESS;
}

/* Waits for everything this context has enqueued. */
static tw_status tw__sync_all(tw_context_t ctx) {
  if (ctx->have_call) TW_CUDA_TRY(cudaEventSynchronize(ctx->ev_call_done));
  TW_CUDA_TRY(cudaStreamSynchronize(ctx->s_comm));
  TW_CUDA_TRY(cudaStreamSynchronize(ctx->s_aux));
  TW_CUDA_TRY(cudaStreamSynchronize(ctx->s_zero));
  return TW_SUCCESS;
}

/* The add dataflow's output buffer `buf` (0 or 1): its byte offset in every rank's window. */
static uint64_t tw__out_offset(const struct tw_context* ctx, int buf) {
  return ctx->lay.out + (uint64_t)buf * ctx->lay.out_bytes;
}

/* Zeroes every counter, the debug tags and the error record (not the receive rows), and the add
 * dataflow's output buffers (a failed call may have added into either). */
static tw_status tw__zero_state(tw_context_t ctx) {
  TW_CUDA_TRY(cudaStreamSynchronize(ctx->s_zero));
  TW_CUDA_TRY(cudaMemsetAsync((char*)ctx->win_buf + ctx->lay.arrive, 0,
                              ctx->lay.bytes - ctx->lay.arrive, ctx->s_aux));
  if (ctx->lay.out_bytes > 0)
    TW_CUDA_TRY(
        cudaMemsetAsync((char*)ctx->win_buf + ctx->lay.out, 0, 2 * ctx->lay.out_bytes, ctx->s_aux));
  ctx->out_buf = -1;
  ctx->dirty_tokens[0] = ctx->dirty_tokens[1] = 0;
  TW_CUDA_TRY(
      cudaMemsetAsync(ctx->unit_next, 0, (kClaimWords + (size_t)ctx->bands_max) * 4, ctx->s_aux));
  TW_CUDA_TRY(cudaMemsetAsync(ctx->reduce_done, 0, 4, ctx->s_aux));
  TW_CUDA_TRY(cudaMemsetAsync(ctx->err, 0, sizeof(tw_dev_error), ctx->s_aux));
  TW_CUDA_TRY(cudaStreamSynchronize(ctx->s_aux));
  memset(ctx->h_err, 0, sizeof(tw_dev_error));
  ctx->epoch = 0;
  memset(ctx->arrive_target, 0, sizeof ctx->arrive_target);
  ctx->failed = 0;
  ctx->have_call = 0;
  ctx->fault = TW_FAULT_NONE;
  return TW_SUCCESS;
}

/* The context's part of the consumer's arguments (window, GEMM output, counters, shape, error
 * word); callers add the plan's part and the timeout. */
static void tw__consumer_args_init(const struct tw_context* ctx, tw_consumer_args* ca) {
  memset(ca, 0, sizeof *ca);
  ca->win = ctx->win;
  ca->lay = ctx->lay;
  ca->local_win = (char*)ctx->win_buf;
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
  ca->err = ctx->err;
}

/* The context's part of the reduction's arguments (window, GEMM output, shape, completion
 * counter, error word); callers add the plan's part, world and rank, and the timeout. */
static void tw__reduce_args_init(const struct tw_context* ctx, tw_reduce_args* ra) {
  memset(ra, 0, sizeof *ra);
  ra->lay = ctx->lay;
  ra->win = ctx->win;
  ra->local_win = (char*)ctx->win_buf;
  ra->c = ctx->c;
  ra->hidden = ctx->problem.hidden;
  ra->top_k = ctx->problem.top_k;
  ra->col_tiles = ctx->col_tiles;
  ra->done = ctx->reduce_done;
  ra->err = ctx->err;
}

/* Launches every kernel once (lazy loading; see the file comment) on tiny inputs. */
static tw_status tw__warm_up(tw_context_t ctx) {
  const int64_t F = ctx->problem.ffn;
  void *a = NULL, *b = NULL, *c = NULL;
  tw_tile* tile = NULL;
  uint32_t* counter = NULL;
  tw_status st = TW_SUCCESS;
  cudaError_t e = cudaMalloc(&a, (size_t)ctx->tm * F * 2);
  if (e == cudaSuccess) e = cudaMalloc(&b, (size_t)ctx->tn * F * 2);
  if (e == cudaSuccess) e = cudaMalloc(&c, (size_t)ctx->tm * ctx->tn * 2);
  if (e == cudaSuccess) e = cudaMalloc((void**)&tile, sizeof(tw_tile));
  if (e == cudaSuccess) e = cudaMalloc((void**)&counter, 4);
  if (e == cudaSuccess) e = cudaMemsetAsync(a, 0, (size_t)ctx->tm * F * 2, ctx->s_aux);
  if (e == cudaSuccess) e = cudaMemsetAsync(b, 0, (size_t)ctx->tn * F * 2, ctx->s_aux);
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
    memset(&g, 0, sizeof g);
    g.a = a;
    g.b = b;
    g.c = c;
    g.rows = ctx->tm;
    g.k = (int32_t)F;
    g.n = ctx->tn;
    g.experts = 1;
    g.tiles = tile;
    g.num_tiles = 1;
    g.tm = ctx->tm;
    g.tn = ctx->tn;
    g.grid = 1;
    g.scope = TW_SIGNAL_GPU;
    g.band_counters = counter;
    g.epilogue = TW_EPILOGUE_STORE;
    /* The kernel the calls will launch. */
    g.variant = ctx->dataflow == TW_DATAFLOW_ADD ? TW_GEMM_VARIANT_ADD : ctx->gemm_variant;
    st = tw__gemm_launch(&g, ctx->s_aux);
    if (st != TW_SUCCESS) goto done;

    tw_consumer_args ca;
    tw__consumer_args_init(ctx, &ca);
    ca.timeout_ns = 1000000;
    st = tw__consumer_launch(&ca, 1, ctx->s_aux);
    if (st != TW_SUCCESS) goto done;

    /* world = 1: no waits, no credits. */
    tw_reduce_args ra;
    tw__reduce_args_init(ctx, &ra);
    ra.world = 1;
    ra.timeout_ns = 1000000;
    st = tw__reduce_launch(&ra, ctx->sm_count, ctx->s_aux);
    if (st != TW_SUCCESS) goto done;
    st = tw__fill_bf16(c, 1, 0, ctx->s_aux);
    if (st != TW_SUCCESS) goto done;
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
  return st;
}

/* Releases whatever exists; collective when the window or the device communicator exist. */
static void tw__context_free(tw_context_t ctx) {
  if (ctx == NULL) return;
  if (ctx->dev_comm_created) ncclDevCommDestroy(ctx->comm, &ctx->dev_comm);
  if (ctx->win_registered) ncclCommWindowDeregister(ctx->comm, ctx->win);
  if (ctx->win_buf) ncclMemFree(ctx->win_buf);
  cudaFree(ctx->c);
  cudaFree(ctx->unit_next);
  cudaFreeHost(ctx->h_err);
  cudaFreeHost(ctx->h_err_all);
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
  if (ctx->bands_max * ctx->col_tiles > INT32_MAX || ctx->rows_max > INT32_MAX)
    return tw__fail(TW_ERR_CAPACITY,
                    "tw_context_create: max_tokens %d gives up to %lld rows per rank, beyond the "
                    "int32 indices of the plan; lower max_tokens",
                    p->max_tokens, (long long)ctx->rows_max);

  /* Reduce: the receive rows. Add: two output buffers, then the zeros peers copy from (up to 32
   * MiB: a copy-engine copy that long runs near its peak rate, HARDWARE.md). */
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
  L->tags = L->ready + 128;
  L->hits = L->tags + tw__align((uint64_t)ctx->recv_rows_max * 4 + 4, 128);
  L->bytes = tw__align(L->hits + tw__align((uint64_t)ctx->recv_rows_max * 4 + 4, 128), 4096);

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

  /* Symmetric window (collective), then the device communicator (collective). */
  TW_NCCL_TRY(ncclMemAlloc(&ctx->win_buf, L->bytes));
  TW_NCCL_TRY(ncclCommWindowRegister(ctx->comm, ctx->win_buf, L->bytes, &ctx->win,
                                     NCCL_WIN_COLL_SYMMETRIC));
  ctx->win_registered = 1;
  ncclDevCommRequirements reqs;
  memset(&reqs, 0, sizeof reqs);
  TW_NCCL_TRY(ncclDevCommCreate(ctx->comm, &reqs, &ctx->dev_comm));
  ctx->dev_comm_created = 1;

  /* Local buffers: GEMM output, then one block of small state. */
  cudaError_t e = cudaMalloc((void**)&ctx->c, (size_t)ctx->rows_max * H * 2);
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_OUT_OF_MEMORY,
                    "tw_context_create: GEMM output of %lld rows x %lld: %s; lower max_tokens",
                    (long long)ctx->rows_max, (long long)H, cudaGetErrorString(e));
  const size_t n_state =
      kClaimWords + (size_t)ctx->bands_max + 64 + (size_t)(W + 1) * 8 + ctx->slots_max;
  e = cudaMalloc((void**)&ctx->unit_next, n_state * 4);
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_OUT_OF_MEMORY, "tw_context_create: %zu bytes of state: %s", n_state * 4,
                    cudaGetErrorString(e));
  /* Word offsets below (and n_state above) give each error record 8 words. */
  static_assert(sizeof(tw_dev_error) == 32, "tw_dev_error must stay 32 bytes (8 words)");
  ctx->band_counters = ctx->unit_next + kClaimWords;
  uint32_t* next = ctx->unit_next + tw__align(kClaimWords + (uint64_t)ctx->bands_max, 32);
  ctx->reduce_done = next + 8;
  ctx->scratch = (int32_t*)(next + 16);
  ctx->err = (tw_dev_error*)(next + 24); /* 32 bytes */
  ctx->err_all = (tw_dev_error*)(next + 32);
  ctx->debug_slots = next + 32 + (size_t)W * 8;
  TW_CUDA_TRY(cudaHostAlloc((void**)&ctx->h_err, sizeof(tw_dev_error), cudaHostAllocDefault));
  TW_CUDA_TRY(cudaHostAlloc((void**)&ctx->h_err_all, (size_t)W * sizeof(tw_dev_error),
                            cudaHostAllocDefault));
  TW_CUDA_TRY(cudaMemsetAsync(ctx->win_buf, 0, L->bytes, ctx->s_aux));
  TW_CUDA_TRY(cudaMemsetAsync(ctx->unit_next, 0, n_state * 4, ctx->s_aux));
  TW_CUDA_TRY(cudaStreamSynchronize(ctx->s_aux));

  /* Every rank must cut bands into the same units (the owners count them): compare. */
  {
    int32_t mine[8] = {ctx->tiles_per_unit, -ctx->tiles_per_unit, ctx->tail_bands, -ctx->tail_bands,
                       ctx->tail_parts,     -ctx->tail_parts,     ctx->dataflow,   -ctx->dataflow};
    int32_t all[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    TW_CUDA_TRY(cudaMemcpy(ctx->scratch, mine, sizeof mine, cudaMemcpyHostToDevice));
    TW_NCCL_TRY(
        ncclAllReduce(ctx->scratch, ctx->scratch, 8, ncclInt32, ncclMax, ctx->comm, ctx->s_aux));
    TW_CUDA_TRY(cudaMemcpyAsync(all, ctx->scratch, sizeof all, cudaMemcpyDeviceToHost, ctx->s_aux));
    TW_CUDA_TRY(cudaStreamSynchronize(ctx->s_aux));
    if (all[0] != mine[0] || all[1] != mine[1])
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "tw_context_create: ranks use different consumer unit widths (%d here, %d to "
                      "%d over all ranks); give every rank the same unit_tiles / "
                      "TW_CONSUMER_TILES_PER_UNIT",
                      mine[0], -all[1], all[0]);
    if (all[2] != mine[2] || all[3] != mine[3] || all[4] != mine[4] || all[5] != mine[5])
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "tw_context_create: ranks split their last bands differently (%d bands in %d "
                      "parts here; %d..%d bands, %d..%d parts over all ranks); give every rank the "
                      "same TW_CONSUMER_TAIL_BANDS and TW_CONSUMER_TAIL_PARTS",
                      mine[2], mine[4], -all[3], all[2], -all[5], all[4]);
    if (all[6] != mine[6] || all[7] != mine[7])
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "tw_context_create: ranks run different combine dataflows (%s here); give "
                      "every rank the same tw_context_config.dataflow / TW_COMBINE_DATAFLOW",
                      tw__dataflow_name(ctx->dataflow));
  }
  /* TW_ADD_ZEROING=copy zeroes the next output buffer with this rank's copy engine, from the next
   * rank's zeros (a copy within one GPU is a kernel and would wait for the SMs: runs 42, 44). The
   * zeros stay in every add window whatever the zeroing, so that all ranks' layouts agree. */
  if (ctx->dataflow == TW_DATAFLOW_ADD && W > 1 && !ctx->zero_in_producer) {
    void* peer = NULL;
    TW_TRY(tw__window_peer_pointer(ctx->win, L->zeros, (int)((ctx->rank + 1) % W), ctx->scratch,
                                   &peer, ctx->s_aux));
    ctx->peer_zeros = peer;
  }
  TW_TRY(tw__warm_up(ctx));
  TW_TRY(tw__zero_state(ctx));
  /* Nobody may write into a peer's window before that peer has zeroed it. */
  TW_TRY(tw__barrier(ctx));
  return TW_SUCCESS;
}

extern "C" tw_status tw_context_create(const tw_problem* problem, ncclComm_t comm,
                                       const tw_context_config* config, tw_context_t* out) {
  tw__clear_error();
  TW_CHECK_NULL(problem);
  TW_CHECK_NULL(comm);
  TW_CHECK_NULL(out);
  *out = NULL;
  TW_TRY(tw_problem_validate(problem));
  tw_context_config cfg = TW_CONTEXT_CONFIG_INIT;
  if (config != NULL) {
    /* A config that ends before `dataflow` (built against the earlier tilewave.h) is read up to
     * there and runs TW_DATAFLOW_DEFAULT. */
    const size_t v1_size = offsetof(tw_context_config, dataflow);
    TW_TRY(tw__check_header("tw_context_config", config->size,
                            config->size == v1_size ? v1_size : sizeof(tw_context_config),
                            config->magic, TW_CONTEXT_CONFIG_MAGIC, config->version));
    memcpy(&cfg, config, config->size);
    cfg.size = sizeof cfg;
  }
  int32_t dataflow = TW_DATAFLOW_REDUCE;
  TW_TRY(tw__dataflow_resolve("tw_context_create", cfg.dataflow, &dataflow));
  if (cfg.timeout_ms < 0 || cfg.debug_tags < 0 || cfg.debug_tags > 1 || cfg.max_comm_ctas < 0 ||
      cfg.max_comm_ctas > TW_MAX_COMM_CTAS || (cfg.timing != 0 && cfg.timing != 1) ||
      cfg.unit_tiles < 0 || cfg.consumer_copy < TW_CONSUMER_COPY_DEFAULT ||
      cfg.consumer_copy > TW_CONSUMER_COPY_BULK)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_context_create: config timeout_ms %d (>= 0), debug_tags %d (0 or 1), "
                    "max_comm_ctas %d (0..%d), timing %d (0 or 1), unit_tiles %d (>= 0), "
                    "consumer_copy %d (0..2): one is out of range",
                    cfg.timeout_ms, cfg.debug_tags, cfg.max_comm_ctas, TW_MAX_COMM_CTAS, cfg.timing,
                    cfg.unit_tiles, cfg.consumer_copy);
  int copy = cfg.consumer_copy;
  if (copy == TW_CONSUMER_COPY_DEFAULT) {
    const char* env = getenv("TW_CONSUMER_COPY");
    if (env == NULL || env[0] == '\0' || strcmp(env, "bulk") == 0)
      copy = TW_CONSUMER_COPY_BULK;
    else if (strcmp(env, "registers") == 0)
      copy = TW_CONSUMER_COPY_REGISTERS;
    else
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "tw_context_create: TW_CONSUMER_COPY='%s'; use `bulk` or `registers` (or "
                      "unset it)",
                      env);
  }

  /* The producer's kernel version: a switch for side-by-side runs (sm90_gemm.cu lists them; 0:
   * the library's default). */
  int gemm_variant = 0;
  TW_TRY(tw__env_int_in("tw_context_create", "TW_GEMM_VARIANT", 0, 5, 0, &gemm_variant));
  const int debug_tags = cfg.debug_tags ? cfg.debug_tags : (tw__env_int("TW_DEBUG_TAGS", 0) != 0);
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
    if (why != NULL)
      return tw__fail(TW_ERR_UNSUPPORTED,
                      "tw_context_create: the add dataflow does not run here: %s", why);
    /* How the next output buffer is zeroed: by the producer's two idle warps (default: SM stores
     * inside the GEMM, no link traffic) or the copy engine (no SM, but NVLink bytes beside the
     * consumer's; run 45: 0.9632 against 0.9774 of the reduce dataflow's time over the grid). */
    const char* z = getenv("TW_ADD_ZEROING");
    if (z != NULL && z[0] != '\0' && strcmp(z, "copy") != 0 && strcmp(z, "producer") != 0)
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "tw_context_create: TW_ADD_ZEROING='%s'; use `copy` or `producer` (or unset "
                      "it)",
                      z);
    zero_in_producer = z == NULL || strcmp(z, "copy") != 0;
  }
  /* The consumer's tail split (0 bands or 1 part: every band is one unit per column chunk; 0
   * parts, the default: by the band's size). */
  int tail_bands = 0, tail_parts = 0;
  TW_TRY(tw__env_int_in("tw_context_create", "TW_CONSUMER_TAIL_BANDS", 0, 1 << 20,
                        TW_DEFAULT_TAIL_BANDS, &tail_bands));
  TW_TRY(tw__env_int_in("tw_context_create", "TW_CONSUMER_TAIL_PARTS", 0, 64, 0, &tail_parts));
  if (tail_parts == 0)
    tail_parts = tw__tail_parts_default(tw__resolve_tile_m(problem), problem->hidden);

  /* The device communicator's layout is version-bound: headers and library must agree. */
  int nccl_version = 0;
  TW_NCCL_TRY(ncclGetVersion(&nccl_version));
  if (nccl_version != NCCL_VERSION_CODE)
    return tw__fail(TW_ERR_NCCL,
                    "tw_context_create: the NCCL library loaded at run time is version %d but "
                    "tilewave was built against NCCL headers %d (%d.%d.%d); rebuild with "
                    "TW_NCCL_ROOT pointing at the NCCL you run with, or load that one (rpath, "
                    "LD_LIBRARY_PATH)",
                    nccl_version, NCCL_VERSION_CODE, NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH);

  int world = 0, rank = 0, device = 0;
  TW_NCCL_TRY(ncclCommCount(comm, &world));
  TW_NCCL_TRY(ncclCommUserRank(comm, &rank));
  TW_NCCL_TRY(ncclCommCuDevice(comm, &device));
  if (world != problem->world_size)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_context_create: problem world_size %d but the communicator has %d ranks",
                    problem->world_size, world);
  if (world > TW_MAX_RANKS)
    return tw__fail(TW_ERR_UNSUPPORTED, "tw_context_create: %d ranks; at most %d", world,
                    TW_MAX_RANKS);
  ncclTeam_t lsa = ncclTeamLsa(comm);
  if (lsa.nRanks != world)
    return tw__fail(TW_ERR_UNSUPPORTED,
                    "tw_context_create: only %d of %d ranks share this rank's NVLink domain; the "
                    "NVLink transport needs all ranks in one (multi-node GIN is not built yet)",
                    lsa.nRanks, world);
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
  ctx->comm = comm;
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
  int64_t tpu =
      cfg.unit_tiles > 0 ? cfg.unit_tiles : tw__env_int("TW_CONSUMER_TILES_PER_UNIT", tpu_default);
  ctx->tiles_per_unit = (int32_t)(tpu < 1 ? 1 : tpu > ctx->col_tiles ? ctx->col_tiles : tpu);
  ctx->unit_chunks = (int32_t)tw__ceil_div(ctx->col_tiles, ctx->tiles_per_unit);
  ctx->tail_bands = tail_bands;
  ctx->tail_parts = tail_parts;
  int64_t tmo = cfg.timeout_ms > 0 ? cfg.timeout_ms : tw__env_int("TW_TIMEOUT_MS", 0);
  ctx->timeout_ms = (int32_t)(tmo > 0 && tmo < INT32_MAX ? tmo : TW_DEFAULT_TIMEOUT_MS);
  ctx->debug_tags = debug_tags;
  ctx->max_comm_ctas = cfg.max_comm_ctas > 0 ? cfg.max_comm_ctas : TW_MAX_COMM_CTAS;
  ctx->timing = cfg.timing;
  cudaError_t e = cudaDeviceGetAttribute(&ctx->sm_count, cudaDevAttrMultiProcessorCount, device);
  tw_status st = TW_SUCCESS;
  if (e != cudaSuccess)
    st = tw__fail(TW_ERR_CUDA, "tw_context_create: SM count: %s", cudaGetErrorString(e));
  else if (ctx->sm_count < 2)
    st = tw__fail(TW_ERR_UNSUPPORTED, "tw_context_create: %d SMs; need at least 2", ctx->sm_count);
  if (ctx->max_comm_ctas >= ctx->sm_count) ctx->max_comm_ctas = ctx->sm_count - 1;
  ctx->dataflow = dataflow;
  ctx->zero_in_producer = zero_in_producer;
  if (st == TW_SUCCESS) st = tw__context_init(ctx);
  if (st != TW_SUCCESS) {
    tw__context_free(ctx);
    return st;
  }
  TW_INFO("context: rank %d/%d on device %d, %d SMs, window %llu bytes, timeout %d ms%s", rank,
          world, device, ctx->sm_count, (unsigned long long)ctx->lay.bytes, ctx->timeout_ms,
          ctx->debug_tags ? ", debug tags" : "");
  *out = ctx;
  return TW_SUCCESS;
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
  int v = 0;
  if (ncclGetVersion(&v) == ncclSuccess) info->nccl_version = v;
  return TW_SUCCESS;
}

extern "C" tw_status tw_context_check(tw_context_t ctx) {
  tw__clear_error();
  TW_CHECK_NULL(ctx);
  TW_DEVICE_SCOPE(ctx);
  TW_TRY(tw__sync_all(ctx));
  TW_NCCL_TRY(
      ncclAllGather(ctx->err, ctx->err_all, sizeof(tw_dev_error), ncclChar, ctx->comm, ctx->s_aux));
  TW_CUDA_TRY(cudaMemcpyAsync(ctx->h_err_all, ctx->err_all,
                              (size_t)ctx->world * sizeof(tw_dev_error), cudaMemcpyDeviceToHost,
                              ctx->s_aux));
  TW_CUDA_TRY(cudaStreamSynchronize(ctx->s_aux));
  int failing = 0, first = -1;
  for (int r = 0; r < ctx->world; r++) {
    if (ctx->h_err_all[r].status != 0) {
      failing++;
      if (first < 0) first = r;
    }
  }
  if (first < 0) return TW_SUCCESS;
  ctx->failed = 1;
  char how[96];
  snprintf(how, sizeof how, "tw_context_check: %d of %d ranks failed; first", failing, ctx->world);
  return tw__report(ctx, &ctx->h_err_all[first], how);
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
  *out = (char*)ctx->win_buf + tw__out_offset(ctx, ctx->out_buf);
  return TW_SUCCESS;
}

extern "C" tw_status tw_context_reset(tw_context_t ctx) {
  tw__clear_error();
  TW_CHECK_NULL(ctx);
  TW_DEVICE_SCOPE(ctx);
  /* Every wait is bounded, so every kernel of every rank ends; after the first barrier none is
   * left running anywhere, after the second every rank has zeroed its state. */
  TW_TRY(tw__sync_all(ctx));
  TW_TRY(tw__barrier(ctx));
  TW_TRY(tw__zero_state(ctx));
  TW_TRY(tw__barrier(ctx));
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

/* ---- device plans ------------------------------------------------------------------------- */

extern "C" tw_status tw_device_plan_create(tw_context_t ctx, tw_device_plan_t* out) {
  tw__clear_error();
  TW_CHECK_NULL(ctx);
  TW_CHECK_NULL(out);
  *out = NULL;
  TW_DEVICE_SCOPE(ctx);
  tw_device_plan_t d = (tw_device_plan_t)calloc(1, sizeof(struct tw_device_plan));
  if (d == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "tw_device_plan_create: host memory");
  d->ctx = ctx;
  const size_t nt = (size_t)ctx->bands_max * ctx->col_tiles, nb = (size_t)ctx->bands_max;
  const size_t ns = (size_t)ctx->slots_max;
  size_t off_tiles = 0;
  size_t off_bands = tw__align(off_tiles + nt * sizeof(tw_tile), 256);
  size_t off_segs = tw__align(off_bands + nb * sizeof(tw_band), 256);
  size_t off_unit0 = tw__align(off_segs + nb * sizeof(tw_segment), 256);
  size_t off_slot = tw__align(off_unit0 + (2 * nb + 1) * 4, 256);
  size_t off_w = tw__align(off_slot + ns * 4 + 4, 256);
  /* The add dataflow's per-row token and weight. */
  const size_t nr = ctx->dataflow == TW_DATAFLOW_ADD ? (size_t)ctx->rows_max : 0;
  size_t off_tok = tw__align(off_w + ns * 4 + 4, 256);
  size_t off_rw = tw__align(off_tok + nr * 4, 256);
  size_t bytes = off_rw + nr * 4 + 4;
  d->h_seg_unit0 = (int32_t*)malloc((2 * nb + 1) * 4);
  if (nr > 0) d->h_row_token = (int32_t*)malloc(nr * 8);
  cudaError_t e = cudaMalloc(&d->mem, bytes);
  if (e != cudaSuccess || d->h_seg_unit0 == NULL || (nr > 0 && d->h_row_token == NULL)) {
    free(d->h_seg_unit0);
    free(d->h_row_token);
    if (e == cudaSuccess) cudaFree(d->mem);
    free(d);
    return tw__fail(TW_ERR_OUT_OF_MEMORY, "tw_device_plan_create: %zu bytes: %s", bytes,
                    cudaGetErrorString(e));
  }
  char* m = (char*)d->mem;
  d->tiles = (tw_tile*)(m + off_tiles);
  d->bands = (tw_band*)(m + off_bands);
  d->segments = (tw_segment*)(m + off_segs);
  d->seg_unit0 = (int32_t*)(m + off_unit0);
  d->seg_split0 = d->seg_unit0 + nb + 1;
  d->h_seg_split0 = d->h_seg_unit0 + nb + 1;
  d->slot_row = (int32_t*)(m + off_slot);
  d->weights = (float*)(m + off_w);
  if (nr > 0) {
    d->row_token = (int32_t*)(m + off_tok);
    d->row_weight = (float*)(m + off_rw);
    d->h_row_weight = (float*)(d->h_row_token + nr);
  }
  *out = d;
  return TW_SUCCESS;
}

extern "C" tw_status tw_device_plan_destroy(tw_device_plan_t d) {
  tw__clear_error();
  if (d == NULL) return TW_SUCCESS;
  {
    tw__device_guard guard(d->ctx->device);
    /* A call may still read the arrays. */
    tw__sync_all(d->ctx);
    cudaFree(d->mem);
  }
  free(d->h_seg_unit0);
  free(d->h_row_token);
  free(d);
  return TW_SUCCESS;
}

extern "C" tw_status tw_device_plan_upload(tw_device_plan_t d, tw_plan_t plan, tw_routing_t routing,
                                           cudaStream_t stream) {
  tw__clear_error();
  TW_CHECK_NULL(d);
  TW_CHECK_NULL(plan);
  TW_CHECK_NULL(routing);
  tw_context_t ctx = d->ctx;
  const tw_problem* p = &ctx->problem;
  const tw_problem* q = &plan->problem;
  if (plan->rank != ctx->rank)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_device_plan_upload: plan is for rank %d, the context is rank %d; upload "
                    "this rank's plan",
                    plan->rank, ctx->rank);
  if (q->world_size != p->world_size || q->hidden != p->hidden || q->ffn != p->ffn ||
      q->experts != p->experts || q->top_k != p->top_k || plan->tm != ctx->tm ||
      plan->tn != ctx->tn)
    return tw__fail(
        TW_ERR_INVALID_ARGUMENT,
        "tw_device_plan_upload: plan problem (W %d, H %d, F %d, E %d, k %d, tile %dx%d) "
        "differs from the context's (W %d, H %d, F %d, E %d, k %d, tile %dx%d)",
        q->world_size, q->hidden, q->ffn, q->experts, q->top_k, plan->tm, plan->tn, p->world_size,
        p->hidden, p->ffn, p->experts, p->top_k, ctx->tm, ctx->tn);
  if (plan->dataflow != ctx->dataflow)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_device_plan_upload: the plan was predicted for the %s dataflow, the "
                    "context runs %s; set tw_plan_config.dataflow to the context's",
                    tw__dataflow_name(plan->dataflow), tw__dataflow_name(ctx->dataflow));
  int32_t tokens = 0;
  const int32_t* ids = NULL;
  const float* weights = NULL;
  TW_TRY(tw_routing_rank(routing, ctx->rank, &tokens, &ids, &weights));
  if (tokens > p->max_tokens)
    return tw__fail(TW_ERR_CAPACITY,
                    "tw_device_plan_upload: %d tokens on rank %d, the context holds at most %d "
                    "(problem max_tokens)",
                    tokens, ctx->rank, p->max_tokens);
  if (plan->rows > ctx->rows_max || plan->num_bands > ctx->bands_max ||
      plan->num_segments > ctx->bands_max || plan->recv_rows > ctx->recv_rows_max ||
      (int64_t)plan->num_tiles != (int64_t)plan->num_bands * ctx->col_tiles)
    return tw__fail(TW_ERR_CAPACITY,
                    "tw_device_plan_upload: plan has %d rows, %d bands, %d segments, %d tiles, %d "
                    "receive rows; the context holds %lld rows, %lld bands, %lld receive rows",
                    plan->rows, plan->num_bands, plan->num_segments, plan->num_tiles,
                    plan->recv_rows, (long long)ctx->rows_max, (long long)ctx->bands_max,
                    (long long)ctx->recv_rows_max);
  /* Consistency checks that keep every remote and local access in bounds. */
  const int64_t row_bytes = (int64_t)p->hidden * 2;
  const int64_t recv_cap = ctx->recv_rows_max * row_bytes;
  for (int32_t i = 0; i < plan->num_bands; i++) {
    const tw_band* b = &plan->bands[i];
    if (b->row0 < 0 || b->valid_rows < 0 || b->valid_rows > b->rows ||
        b->row0 + b->rows > plan->rows || b->dest < 0 || b->dest >= ctx->world ||
        (b->dest != ctx->rank && ctx->dataflow == TW_DATAFLOW_REDUCE &&
         (b->dest_offset < 0 || b->dest_offset % row_bytes != 0 ||
          b->dest_offset + (int64_t)b->valid_rows * row_bytes > recv_cap)))
      return tw__fail(TW_ERR_INTERNAL,
                      "tw_device_plan_upload: band %d (rows %d+%d, valid %d, dest %d, offset %lld) "
                      "is out of bounds",
                      i, b->row0, b->rows, b->valid_rows, b->dest, (long long)b->dest_offset);
  }
  for (int32_t s = 0; s < plan->num_segments; s++) {
    const tw_segment* sg = &plan->segments[s];
    if (sg->band0 < 0 || sg->nbands < 1 || sg->band0 + sg->nbands > plan->num_bands ||
        sg->dest < 0 || sg->dest >= ctx->world || sg->dest == ctx->rank)
      return tw__fail(TW_ERR_INTERNAL, "tw_device_plan_upload: segment %d is malformed", s);
  }
  const int64_t units = tw__consumer_units(plan, ctx->tail_bands, ctx->tail_parts, ctx->unit_chunks,
                                           d->h_seg_unit0, d->h_seg_split0);
  if (units < 0)
    return tw__fail(TW_ERR_INTERNAL,
                    "tw_device_plan_upload: the segments cannot be cut into units");
  if (units > INT32_MAX)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_device_plan_upload: %lld consumer units do not fit 32 bits; use fewer "
                    "TW_CONSUMER_TAIL_PARTS or wider units (TW_CONSUMER_TILES_PER_UNIT)",
                    (long long)units);
  const int64_t nslots = (int64_t)tokens * p->top_k;
  for (int64_t i = 0; i < nslots; i++) {
    if (plan->slot_row[i] < 0 || plan->slot_row[i] >= plan->recv_rows + plan->rows)
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "tw_device_plan_upload: slot %lld points at row %d outside %d receive + %d "
                      "local rows; the plan and the routing do not belong together",
                      (long long)i, plan->slot_row[i], plan->recv_rows, plan->rows);
  }
  /* The add dataflow: each row's token at its owner and its gate weight (rows of padding: -1
   * and 0); a remote band's valid rows must all belong to its destination. */
  if (ctx->dataflow == TW_DATAFLOW_ADD) {
    int32_t owner_tokens[TW_MAX_RANKS];
    const float* owner_w[TW_MAX_RANKS];
    for (int r = 0; r < ctx->world; r++) {
      const int32_t* ids_r = NULL;
      TW_TRY(tw_routing_rank(routing, r, &owner_tokens[r], &ids_r, &owner_w[r]));
    }
    for (int32_t i = 0; i < plan->rows; i++) {
      const tw_row_src src = plan->row_src[i];
      d->h_row_token[i] = -1;
      d->h_row_weight[i] = 0.f;
      if (src.owner < 0) continue;
      if (src.owner >= ctx->world || src.token < 0 || src.token >= owner_tokens[src.owner] ||
          src.slot < 0 || src.slot >= p->top_k)
        return tw__fail(TW_ERR_INVALID_ARGUMENT,
                        "tw_device_plan_upload: row %d names token %d slot %d of rank %d, which "
                        "the routing does not hold; the plan and the routing do not belong "
                        "together",
                        i, src.token, src.slot, src.owner);
      d->h_row_token[i] = src.token;
      d->h_row_weight[i] = owner_w[src.owner][(int64_t)src.token * p->top_k + src.slot];
    }
    for (int32_t i = 0; i < plan->num_bands; i++) {
      const tw_band* b = &plan->bands[i];
      for (int32_t r = b->row0; r < b->row0 + b->valid_rows; r++)
        if (plan->row_src[r].owner != b->dest)
          return tw__fail(TW_ERR_INTERNAL,
                          "tw_device_plan_upload: band %d sends row %d to rank %d, whose token it "
                          "is not (owner %d)",
                          i, r, b->dest, plan->row_src[r].owner);
    }
  }
  int32_t recv_from[TW_MAX_RANKS];
  for (int s = 0; s < ctx->world; s++) {
    recv_from[s] = s == ctx->rank ? 0 : plan->recv_bands[s];
    if (recv_from[s] < 0)
      return tw__fail(TW_ERR_INTERNAL, "tw_device_plan_upload: recv_bands[%d] < 0", s);
  }

  TW_DEVICE_SCOPE(ctx);
  /* Pageable copies: each returns once the source is staged, so the host plan may go away. */
  if (plan->num_tiles > 0)
    TW_CUDA_TRY(cudaMemcpyAsync(d->tiles, plan->tiles, (size_t)plan->num_tiles * sizeof(tw_tile),
                                cudaMemcpyHostToDevice, stream));
  if (plan->num_bands > 0)
    TW_CUDA_TRY(cudaMemcpyAsync(d->bands, plan->bands, (size_t)plan->num_bands * sizeof(tw_band),
                                cudaMemcpyHostToDevice, stream));
  if (plan->num_segments > 0)
    TW_CUDA_TRY(cudaMemcpyAsync(d->segments, plan->segments,
                                (size_t)plan->num_segments * sizeof(tw_segment),
                                cudaMemcpyHostToDevice, stream));
  TW_CUDA_TRY(cudaMemcpyAsync(d->seg_unit0, d->h_seg_unit0, (size_t)(plan->num_segments + 1) * 4,
                              cudaMemcpyHostToDevice, stream));
  if (plan->num_segments > 0)
    TW_CUDA_TRY(cudaMemcpyAsync(d->seg_split0, d->h_seg_split0, (size_t)plan->num_segments * 4,
                                cudaMemcpyHostToDevice, stream));
  if (nslots > 0) {
    TW_CUDA_TRY(cudaMemcpyAsync(d->slot_row, plan->slot_row, (size_t)nslots * 4,
                                cudaMemcpyHostToDevice, stream));
    TW_CUDA_TRY(
        cudaMemcpyAsync(d->weights, weights, (size_t)nslots * 4, cudaMemcpyHostToDevice, stream));
  }
  if (ctx->dataflow == TW_DATAFLOW_ADD && plan->rows > 0) {
    TW_CUDA_TRY(cudaMemcpyAsync(d->row_token, d->h_row_token, (size_t)plan->rows * 4,
                                cudaMemcpyHostToDevice, stream));
    TW_CUDA_TRY(cudaMemcpyAsync(d->row_weight, d->h_row_weight, (size_t)plan->rows * 4,
                                cudaMemcpyHostToDevice, stream));
  }
  d->rows = plan->rows;
  d->recv_rows = plan->recv_rows;
  d->num_tiles = plan->num_tiles;
  d->num_bands = plan->num_bands;
  d->total_units = (int32_t)units;
  d->tokens = tokens;
  d->comm_ctas = plan->comm_ctas;
  memcpy(d->recv_bands, recv_from, sizeof(int32_t) * (size_t)ctx->world);
  d->uploaded = 1;
  return TW_SUCCESS;
}

/* ---- the call ----------------------------------------------------------------------------- */

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
      tw__stream_write_value(stream, (char*)ctx->win_buf + ctx->lay.ready, (uint32_t)ctx->epoch));
  ctx->dirty_tokens[buf] = 0;
  return TW_SUCCESS;
}

/* The add dataflow, at the end of call e (ctx->epoch), when its producer does not zero: zeroes
 * output buffer `buf` (call e - 1's output, valid until call e started) on the context's zeroing
 * stream, then ready = e (peers may add into it in call e + 1) and ev_zeroed (this rank's producer
 * of call e + 1 waits for it). TW_ADD_ZEROING=copy: from call e's start, with this rank's copy
 * engine pulling the next rank's zeros over NVLink (no SM: a kernel here would wait for the
 * producer's and consumer's SMs, run 42). A comm-only call (a timing mode: it has no producer)
 * zeroes with a memset after it has ended, so that its time is the consumer's alone. */
static tw_status tw__zero_next_output(tw_context_t ctx, int buf, int after_call) {
  char* dst = (char*)ctx->win_buf + tw__out_offset(ctx, buf);
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

extern "C" tw_status tw_moe_combine_ex(tw_context_t ctx, tw_device_plan_t d, const void* expert_in,
                                       const void* w2, void* out, const tw_combine_options* options,
                                       cudaStream_t stream) {
  tw__clear_error();
  TW_CHECK_NULL(ctx);
  TW_CHECK_NULL(d);
  tw_combine_options opt = TW_COMBINE_OPTIONS_INIT;
  if (options != NULL) {
    TW_TRY(tw__check_header("tw_combine_options", options->size, sizeof(tw_combine_options),
                            options->magic, TW_COMBINE_OPTIONS_MAGIC, options->version));
    opt = *options;
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
    return tw__fail(TW_ERR_STATE,
                    "tw_moe_combine: an earlier call failed on the device; call "
                    "tw_context_reset() on every rank first");
  /* A completed earlier call that failed: report it now (never blocks). */
  if (ctx->have_call && cudaEventQuery(ctx->ev_err_copied) == cudaSuccess &&
      ctx->h_err->status != 0) {
    ctx->failed = 1;
    return tw__report(ctx, ctx->h_err, "tw_moe_combine: an earlier call failed");
  }
  int C = opt.comm_ctas > 0 ? opt.comm_ctas : d->comm_ctas;
  if (C < 1) C = TW_DEFAULT_COMM_CTAS;
  if (C > ctx->max_comm_ctas) {
    if (opt.comm_ctas > 0)
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "tw_moe_combine: comm_ctas %d above the context's max_comm_ctas %d",
                      opt.comm_ctas, ctx->max_comm_ctas);
    C = ctx->max_comm_ctas;
  }
  const int P = ctx->sm_count - C;
  TW_DEVICE_SCOPE(ctx);
  const int timing = ctx->timing;

  tw_gemm_args g;
  memset(&g, 0, sizeof g);
  g.a = expert_in;
  g.b = w2;
  g.c = ctx->c;
  g.rows = d->rows;
  g.k = ctx->problem.ffn;
  g.n = ctx->problem.hidden;
  g.experts = ctx->local_experts;
  g.tiles = d->tiles;
  g.num_tiles = d->num_tiles;
  g.tm = ctx->tm;
  g.tn = ctx->tn;
  g.grid = P;
  g.scope = TW_SIGNAL_GPU;
  g.band_counters = ctx->band_counters;
  g.epilogue = TW_EPILOGUE_STORE;
  g.variant = ctx->gemm_variant;

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
    TW_CUDA_TRY(cudaEventRecord(ctx->ev_call_done, stream));
    ctx->have_call = 1;
    ctx->last_mode = mode;
    return TW_SUCCESS;
  }

  /* From here on a failure leaves the ranks' counters out of step: mark the context failed. */
  ctx->epoch++;
  for (int s = 0; s < ctx->world; s++) {
    ctx->arrive_target[s] += (uint32_t)tw__owner_units(d->recv_bands[s], ctx->tail_bands,
                                                       ctx->tail_parts, ctx->unit_chunks);
  }
  ctx->failed = 1;
  const uint64_t timeout_ns = (uint64_t)ctx->timeout_ms * 1000000ull;

  tw_consumer_args ca;
  tw__consumer_args_init(ctx, &ca);
  ca.bands = d->bands;
  ca.segments = d->segments;
  ca.seg_unit0 = d->seg_unit0;
  ca.seg_split0 = d->seg_split0;
  ca.total_units = d->total_units;
  ca.wait_bands = mode != TW_COMBINE_COMM_ONLY;
  ca.credit_target = (uint32_t)(ctx->epoch - 1);
  ca.debug_tags = ctx->debug_tags;
  /* The add dataflow: this call's output buffer (combine.h, `ready`). */
  const int buf = (int)(ctx->epoch & 1);
  if (add) {
    ca.row_token = d->row_token;
    ca.out_offset = tw__out_offset(ctx, buf);
    g.row_weight = d->row_weight;
    g.add_out = (char*)ctx->win_buf + ca.out_offset;
    g.row_token = d->row_token;
    g.bands = d->bands;
    g.rank = ctx->rank;
    memcpy(ca.arrive_target, ctx->arrive_target, sizeof ca.arrive_target);
  }
  ca.fault = ctx->fault;
  ca.fault_index = ctx->fault_index;
  ca.timeout_ns = timeout_ns;
  ctx->fault = TW_FAULT_NONE;

  /* Every call starts from zeroed band counters and unit claims (one memset: they are adjacent):
   * the consumer waits for this call's publishes only. The previous call's producer is done here
   * (stream order), and so is its consumer (the join before that call's reduction). */
  TW_CUDA_TRY(cudaMemsetAsync(ctx->unit_next, 0, (kClaimWords + (size_t)d->num_bands) * 4, stream));
  /* The add dataflow: the producer adds into this call's buffer, which the previous call zeroed
   * (on the zeroing stream, or in its producer: then ev_zeroed is older, or was never recorded,
   * and the wait is a no-op). */
  if (add) TW_CUDA_TRY(cudaStreamWaitEvent(stream, ctx->ev_zeroed, 0));
  /* The producer zeroes the other buffer (the previous call's output, valid until this call
   * started) for the next call (unless TW_ADD_ZEROING=copy); a stream write after it sets ready. */
  const int zero_in_producer = add && ctx->zero_in_producer && mode != TW_COMBINE_COMM_ONLY;
  if (zero_in_producer) {
    g.zero = (char*)ctx->win_buf + tw__out_offset(ctx, buf ^ 1);
    g.zero_vectors = ctx->dirty_tokens[buf ^ 1] * ctx->problem.hidden * 2 / 16;
  }
  /* S: producer first (co-residency), K: consumer after `start` (or after the producer). */
  TW_CUDA_TRY(cudaEventRecord(ctx->ev_start, stream));
  if (timing) TW_CUDA_TRY(cudaEventRecord(ctx->t_start, stream));
  if (mode != TW_COMBINE_COMM_ONLY) TW_TRY(tw__gemm_launch(&g, stream));
  if (zero_in_producer) TW_TRY(tw__raise_ready(ctx, stream, buf ^ 1));
  if (timing) TW_CUDA_TRY(cudaEventRecord(ctx->t_gemm_end, stream));
  if (mode == TW_COMBINE_UNFUSED) {
    TW_CUDA_TRY(cudaEventRecord(ctx->ev_gemm_done, stream));
    TW_CUDA_TRY(cudaStreamWaitEvent(ctx->s_comm, ctx->ev_gemm_done, 0));
  } else {
    TW_CUDA_TRY(cudaStreamWaitEvent(ctx->s_comm, ctx->ev_start, 0));
  }
  if (timing) TW_CUDA_TRY(cudaEventRecord(ctx->t_comm_start, ctx->s_comm));
  TW_TRY(tw__consumer_launch(&ca, C, ctx->s_comm));
  if (timing) TW_CUDA_TRY(cudaEventRecord(ctx->t_comm_end, ctx->s_comm));
  TW_CUDA_TRY(cudaEventRecord(ctx->ev_comm_done, ctx->s_comm));
  /* The reduction starts only once this rank's consumer has finished. It spins on the peers'
   * consumers; if it could start earlier, its CTAs could fill every SM of this GPU before the
   * local consumer became resident, while the peer's reduction did the same to the peer's
   * consumer: a cycle through SM resources (seen in unfused mode, where both kernels become
   * ready together when the producer ends). This join also orders the next call's producer,
   * which overwrites the GEMM output, after the consumer's reads. */
  TW_CUDA_TRY(cudaStreamWaitEvent(stream, ctx->ev_comm_done, 0));
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
    ra.rank = ctx->rank;
    ra.world = ctx->world;
    ra.debug_tags = ctx->debug_tags;
    ra.debug_slots = ctx->debug_slots;
    memcpy(ra.arrive_target, ctx->arrive_target, sizeof ra.arrive_target);
    ra.timeout_ns = timeout_ns;
    TW_TRY(tw__reduce_launch(&ra, ctx->sm_count, stream));
  }
  if (timing) TW_CUDA_TRY(cudaEventRecord(ctx->t_red_end, stream));
  if (timing) TW_CUDA_TRY(cudaEventRecord(ctx->t_end, stream));
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
    if (!zero_in_producer) TW_TRY(tw__zero_next_output(ctx, buf ^ 1, mode == TW_COMBINE_COMM_ONLY));
    ctx->out_buf = buf;
  }
  ctx->have_call = 1;
  ctx->last_mode = mode;
  ctx->last_tokens = d->tokens;
  ctx->failed = 0;
  return TW_SUCCESS;
}

extern "C" tw_status tw_moe_combine(tw_context_t ctx, tw_device_plan_t dplan, const void* expert_in,
                                    const void* w2, void* out, cudaStream_t stream) {
  return tw_moe_combine_ex(ctx, dplan, expert_in, w2, out, NULL, stream);
}

/* ---- internal hooks (runtime.h) ----------------------------------------------------------- */

extern "C" tw_status tw__context_inject_fault(tw_context_t ctx, int kind, int index) {
  TW_CHECK_NULL(ctx);
  if (kind < TW_FAULT_NONE || kind > TW_FAULT_BAND_STUCK || index < 0)
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
