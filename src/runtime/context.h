/*
 * context.h: a context's state and the helpers its files share (internal; CUDA C++ translation
 * units of src/runtime only): context.cu (life cycle, checks, reset), device_plan.cu (device
 * copies of plans), combine_call.cu (the launch sequence of one combine call) and
 * dispatch_call.cu (that of one dispatch call).
 */
#ifndef TW_CONTEXT_H
#define TW_CONTEXT_H

#include <cuda.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "checks.h"
#include "combine.h"
#include "core.h"
#include "dispatch.h"
#include "kernels.h"
#include "plan.h"
#include "runtime.h"
#include "team.h"
#include "tilewave.h"

/* The consumer's claim counter sits alone in a 128-byte line ahead of the band counters: the
 * producer's releases and the consumer's polls on those never contend with the claims. */
static const size_t kClaimWords = 32;

struct tw_context {
  tw_problem problem;
  tw__team* team; /* this rank's view of its team (owned; the communicator under it is not) */
  int32_t rank, world, device, sm_count;
  int32_t sm_budget; /* SMs a call occupies at most (config.sm_budget resolved) */
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

  /* Symmetric window: receive rows, arrivals, credits, debug tags (combine.h); peers is a device
   * copy of win.peers for the kernels. */
  tw_window_layout lay;
  tw__window win;
  char** peers; /* (world) device */

  /* Local device memory. */
  uint16_t* c;               /* (rows_max, hidden) bf16 GEMM output */
  uint32_t* unit_next;       /* consumer's unit claims; the start of the small-state block below
                                (one allocation), zeroed with the band counters */
  uint32_t* band_counters;   /* (bands_max), kClaimWords after unit_next */
  uint32_t* reduce_done;     /* reduction CTA completion counter */
  tw_call_state* call_state; /* epoch and arrival targets (combine.h), advanced on the device */
  tw_dev_error* err;         /* device error record */
  uint32_t* debug_slots;     /* (slots_max) */
  tw_dev_error* h_err;       /* pinned copy of *err after each call */

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

  /* Dispatch (tw_context_config.dispatch = 1; zero / NULL otherwise): a second window holding
   * the expert-input rows peers write and the dispatch counters (dispatch.h), and the scan's
   * state. */
  int32_t dispatch;
  tw_dispatch_layout dlay;
  tw__window dwin;
  char** dpeers;         /* (world) device copy of dwin.peers */
  int32_t* d_chunk_hist; /* (TW_DISPATCH_MAX_CHUNKS, experts) the scan's histograms */
  uint32_t* d_counts;    /* (experts) this rank's slots per global expert */
  tw_dev_error* d_verr;  /* the count pass's record of bad ids (not the context's: a bad id
                            fails one call on every rank, the context stays usable) */
  int32_t* d_zero;       /* one int 0: an empty padding list (warm-up) */
  uint32_t* d_done;      /* the copy kernel's CTA completion counter (zero between launches) */
  int32_t* h_row;        /* pinned: this rank's row of the all-gather (kGatherHead + experts) */
  int32_t* h_all;        /* (world, kGatherHead + experts) host rows, then the count matrix
                            (world, experts) */
  cudaEvent_t ev_counts; /* the counts and the record copied to h_row */
  /* An overlapped layer's fork of the banded copy onto s_comm and its join (layer_call.cu). */
  cudaEvent_t ev_copy_fork, ev_copy_join;
  uint32_t* d_epochs; /* (2) the dispatch's targets (dispatch.h), zero after a reset */
  /* The capturable mode (tw_context_config.dispatch_capacity > 0; 0 = eager): rows of every
   * (local expert, source) group of the static plan, the capacity rounded up to TM. */
  int32_t capacity;

  /* The layer (tw_context_config.layer = 1, which implies dispatch; 0 / NULL otherwise): GEMM1's
   * output, GEMM2's input of tw_moe_layer. */
  int32_t layer;
  uint16_t* h;         /* (rows_max, ffn) bf16 */
  int64_t state_bytes; /* device memory of the small state, scan tables and peer tables
                          (tw_context_memory_get) */

  uint64_t epoch;     /* calls with communication since the last reset, enqueued eagerly (the add
                         dataflow's buffer choice; the kernels count on the device, call_state) */
  int failed;         /* a device error was seen, or failed_enqueue: calls refused until reset */
  int failed_enqueue; /* a call failed after enqueueing part of its work (not under capture) */
  int have_call;      /* ev_call_done / ev_err_copied refer to a real call */
  int last_mode;
  tw__launch_record last_launch; /* the grids of the last call (runtime.h) */
  int64_t last_tokens;
  int fault, fault_index;
  tw_trace* trace;        /* (16 + 16 * trace_capacity bytes) device trace buffer; NULL = off */
  int64_t trace_capacity; /* records it holds */
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
  int32_t* h_seg_unit0;   /* host staging of seg_unit0 */
  int32_t* h_seg_split0;  /* host staging of seg_split0 (in h_seg_unit0's allocation) */
  uint32_t* recv_units;   /* (TW_MAX_RANKS) device: units from each source per call */
  uint32_t* h_recv_units; /* host staging of recv_units (in h_seg_unit0's allocation) */
  uint64_t* plan_fp;      /* device: the plan's fingerprint (struct tw_plan), after recv_units */
  int captured;           /* a captured call uses it: its sizes are fixed (tw_device_plan_upload) */
  int uploaded;
  int32_t rows, recv_rows, num_tiles, num_bands, total_units, tokens, comm_ctas;
  int32_t recv_bands[TW_MAX_RANKS];
  tw_plan_summary summary; /* of the plan last uploaded */
  int32_t* h_expert_rows;  /* (3, local experts): row0, rows, real_rows of the plan last uploaded */
  /* Dispatch (contexts with dispatch only; NULL otherwise): the count-plan's tables and the
   * scan's per-slot destination rows. */
  int32_t* slot_base; /* (experts) */
  int32_t* send_row0; /* (experts) */
  int32_t* pads;      /* (1 + 2 E W) count, then (first row, rows) padding ranges */
  int32_t* send_row;  /* (slots_max) */
  int32_t* h_pads;    /* host staging of pads */
  int64_t pad_rows;   /* rows in those ranges */
  /* The layer (contexts with layer only; NULL otherwise): GEMM1's tile list of the plan last
   * uploaded (tw__plan_gemm1_tiles: its bands in layout order, ceil(ffn / TW_GEMM1_TN) column
   * tiles each), on the device and its host staging. */
  tw_tile* gemm1_tiles;   /* (bands_max * ceil(ffn / TW_GEMM1_TN)) */
  tw_tile* h_gemm1_tiles; /* host staging, same size */
  int32_t num_gemm1_tiles;
  /* The banded copy of an overlapped layer (eager layer contexts; NULL otherwise; dispatch.h):
   * the units of the plan last uploaded (this rank's rows to every rank, then its padding) and
   * where each group's slots start in send_slot. */
  tw_copy_unit* copy_units;   /* (copy_units_max) */
  tw_copy_unit* h_copy_units; /* host staging, same size (send_off's staging after it) */
  int32_t* send_off;          /* (experts) */
  int32_t* h_send_off;
  int32_t* send_slot; /* (slots_max) the place pass's */
  int32_t num_copy_units, copy_units_max;
  /* The capturable mode (contexts with a dispatch capacity; NULL otherwise): is_static while the
   * device plan holds the static plan uploaded at its creation (an upload replaces it); each
   * band's group and first row in it (static), and the mask's outputs of the last dispatch
   * (dispatch.h): live rows per band, the tiles of GEMM2 and GEMM1 with live rows, their counts.
   * A GEMM1 tile's band indexes the schedule's bands here (the mask reads band_live by it). */
  int is_static;
  int32_t* band_group;       /* (bands_max) */
  int32_t* band_first;       /* (bands_max) */
  int32_t* band_live;        /* (bands_max) */
  tw_tile* live_tiles;       /* (bands_max * col_tiles) */
  tw_tile* live_gemm1_tiles; /* (bands_max * ceil(ffn / TW_GEMM1_TN)), layer contexts */
  int32_t* live_counts;      /* (2) GEMM2's and GEMM1's live tiles */
};

/* Words ahead of the counts in a rank's row of the dispatch all-gather: the count pass's
 * tw_dev_error (status, where, index, seen, target, rank), with the rank's tokens in word 6 and
 * a local refusal (dispatch_call.cu) in place of the record's first three words. */
enum { kGatherHead = 8 };

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

static inline uint64_t tw__align(uint64_t v, uint64_t a) {
  return (v + a - 1) / a * a;
}

/* The add dataflow's output buffer `buf` (0 or 1): its byte offset in every rank's window. */
static inline uint64_t tw__out_offset(const struct tw_context* ctx, int buf) {
  return ctx->lay.out + (uint64_t)buf * ctx->lay.out_bytes;
}

/* Waits for everything this context has enqueued. */
tw_status tw__sync_all(tw_context_t ctx);
/* A device error record as a status with its message; `how` names the caller. */
tw_status tw__report(tw_context_t ctx, const tw_dev_error* e, const char* how);
/* The context's part of the consumer's / reduction's arguments (window, GEMM output, counters,
 * shape, error word); callers add the plan's part and the timeout. */
void tw__consumer_args_init(const struct tw_context* ctx, tw_consumer_args* ca);
void tw__reduce_args_init(const struct tw_context* ctx, tw_reduce_args* ra);
/* A call's SM budget: `requested` (the call's option; 0 = the context's), which must lie in
 * 2..context_budget (TW_ERR_INVALID_ARGUMENT naming the range otherwise). */
tw_status tw__call_budget(const char* who, int32_t requested, int32_t context_budget,
                          int32_t* budget);
/* Checks a plan against the context and the device plan's capacity (rank, problem, dataflow,
 * tokens, sizes, every band and segment in bounds) and cuts its segments into consumer units
 * (d->h_seg_unit0 / h_seg_split0); *units = their count. `what` leads the messages. */
tw_status tw__device_plan_check(tw_device_plan_t d, const struct tw_plan* plan, int32_t tokens,
                                int64_t* units, const char* what);
/* After tw__device_plan_check: copies tiles, bands, segments and units (and, on a layer
 * context, GEMM1's tile list) on `stream` and sets the device plan's sizes, receive counts and
 * summary. The per-token arrays are the caller's. */
tw_status tw__device_plan_copy(tw_device_plan_t d, const struct tw_plan* plan, int32_t tokens,
                               int64_t units, cudaStream_t stream);
/* Bytes of device memory tw_device_plan_create allocates for one device plan on ctx. */
size_t tw__device_plan_bytes(const struct tw_context* ctx);

/* What a whole-layer call adds to the dispatch's checks: a refusal of this rank that every rank
 * learns through the dispatch's all-gather, before anything is sent. */
typedef struct tw__dispatch_extra {
  const char* who; /* leads the messages: "tw_moe_layer" */
  int32_t status;  /* TW_SUCCESS, or this rank's refusal */
  int32_t bad;     /* what was refused (tw__layer_bad bits), for the message */
  /* A layer call (eager layer contexts): the banded copy, which raises the band counters a
   * peer's overlapped GEMM1 waits for. copy_ctas: 0 on the caller's stream with the budget's
   * CTAs, then the arrival wait (the dispatch before GEMM1); > 0 on that many CTAs of the
   * context's s_comm, forked from the caller's stream and not joined, so that the caller's GEMM1
   * runs beside it (the caller then calls tw__dispatch_finish(..., 1, ...)); -1 the model's
   * choice of the two (model_copy.c). Without banded: the slot-order copy (the dispatch alone). */
  int32_t banded;
  int32_t copy_ctas;
  int32_t copy_ctas_used; /* out: the CTAs the forked copy runs on (0: not forked) */
} tw__dispatch_extra;

/* tw__dispatch_extra.bad: the layer's operands a rank refused. */
enum tw__layer_bad {
  TW__LAYER_NULL_W13 = 1,
  TW__LAYER_NULL_W2 = 2,
  TW__LAYER_NULL_OUT = 4, /* with tokens > 0 */
  TW__LAYER_UNALIGNED = 8 /* w13, w2 or out not 16-byte aligned */
};

/* The dispatch of tw_moe_dispatch_ex, with `extra` (NULL: none) among the local checks every rank
 * agrees on. */
tw_status tw__dispatch_run(tw_context_t ctx, tw_device_plan_t d, const void* x,
                           const void* topk_ids, tw_index_type id_type, const float* topk_weights,
                           int32_t tokens, void** expert_in, const tw_dispatch_options* options,
                           tw__dispatch_extra* extra, cudaStream_t stream);

/* GEMM1 + SwiGLU of a layer call over d's tiles on `sm_budget` CTAs (tw__layer_gemm1, runtime.h);
 * wait_bands: each tile first waits for its band's rows (the overlapped layer's banded copy). */
tw_status tw__layer_gemm1_ex(tw_context_t ctx, tw_device_plan_t d, const void* expert_in,
                             const void* w13, void* h, int32_t sm_budget, int wait_bands,
                             cudaStream_t stream);

/* The end of an eager dispatch: (joined_copy: the caller's stream waits for the forked banded
 * copy) the wait for every source's arrivals, the call-done event, the error record's copy, and
 * the context marked usable again. */
tw_status tw__dispatch_finish(tw_context_t ctx, tw_device_plan_t d, int joined_copy,
                              cudaStream_t stream);

#endif /* TW_CONTEXT_H */
