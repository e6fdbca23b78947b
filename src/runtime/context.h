/*
 * context.h: a context's state and the helpers its three files share (internal; CUDA C++
 * translation units of src/runtime only): context.cu (life cycle, checks, reset),
 * device_plan.cu (device copies of plans) and combine_call.cu (the launch sequence of one call).
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
  uint16_t* c;             /* (rows_max, hidden) bf16 GEMM output */
  uint32_t* unit_next;     /* consumer's unit claims; the start of the small-state block below
                              (one allocation), zeroed with the band counters */
  uint32_t* band_counters; /* (bands_max), kClaimWords after unit_next */
  uint32_t* reduce_done;   /* reduction CTA completion counter */
  tw_call_state* call_state; /* epoch and arrival targets (combine.h), advanced on the device */
  tw_dev_error* err;       /* device error record */
  uint32_t* debug_slots;   /* (slots_max) */
  tw_dev_error* h_err;     /* pinned copy of *err after each call */

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

  uint64_t epoch; /* calls with communication since the last reset, enqueued eagerly (the add
                     dataflow's buffer choice; the kernels count on the device, call_state) */
  int failed;         /* a device error was seen, or failed_enqueue: calls refused until reset */
  int failed_enqueue; /* a call failed after enqueueing part of its work (not under capture) */
  int have_call;                        /* ev_call_done / ev_err_copied refer to a real call */
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
  int32_t* h_seg_unit0;  /* host staging of seg_unit0 */
  int32_t* h_seg_split0; /* host staging of seg_split0 (in h_seg_unit0's allocation) */
  uint32_t* recv_units;   /* (TW_MAX_RANKS) device: units from each source per call */
  uint32_t* h_recv_units; /* host staging of recv_units (in h_seg_unit0's allocation) */
  int captured;           /* a captured call uses it: its sizes are fixed (tw_device_plan_upload) */
  int uploaded;
  int32_t rows, recv_rows, num_tiles, num_bands, total_units, tokens, comm_ctas;
  int32_t recv_bands[TW_MAX_RANKS];
};

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

#endif /* TW_CONTEXT_H */
