/*
 * runtime.h: internal view of a tilewave context (test hooks and introspection). The public API
 * is in tilewave.h; nothing here is stable.
 */
#ifndef TW_RUNTIME_H
#define TW_RUNTIME_H

#include <stdint.h>

#include "tilewave.h"
#include "trace.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Test hooks: faults injected on purpose (one call only). */
typedef enum tw_fault {
  TW_FAULT_NONE = 0,
  TW_FAULT_SKIP_UNIT = 1,  /* unit `index` is neither written nor announced: its owner times out */
  TW_FAULT_BAND_STUCK = 2, /* unit `index` waits for one more tile than its bands will ever get,
                              as if the producer had skipped a publish */
  TW_FAULT_DROP_COPY_UNIT = 3 /* the next layer call's banded copy skips its unit `index` (neither
                                 written nor announced): a GEMM1 beside the dispatch at its
                                 destination times out on that band */
} tw_fault;

/* The grids the last call launched, against its SM budget (tests: no launch exceeds it). */
typedef struct tw__launch_record {
  int32_t budget;        /* SMs the call could occupy */
  int32_t producer_ctas; /* P (0: none) */
  int32_t consumer_ctas; /* C (0: none), concurrent with the producer */
  int32_t reduce_ctas;   /* the reduction's grid, after both (0: none) */
  int32_t reduce_cap;    /* the most it could have had: budget, or budget x CTAs per SM that fit
                            when the budget is a whole GPU of its own */
  int32_t gemm1_ctas;    /* GEMM1's grid in the last tw_moe_layer or tw__layer_gemm1 (0: no
                            tiles); set by those only, so a later combine call leaves it */
  int32_t dispatch_ctas; /* the last tw_moe_layer's banded copy beside GEMM1 (0: the dispatch
                            ran before GEMM1) */
} tw__launch_record;

tw_status tw__context_last_launch(tw_context_t ctx, tw__launch_record* record);

/* What the device counts for one context (after the context's work so far and `stream`'s have
 * completed), for tests and diagnosis: the call state (combine.h: calls with communication since
 * the last reset, this call's consumer's units and epoch), per source rank the running arrival
 * target and the arrivals counted in this rank's window, per owner rank the units this rank's
 * consumers announced to it and the owner's credits in this rank's window (world entries each,
 * running totals), and the device error record. */
typedef struct tw__counters {
  uint32_t epoch, consumer_units, consumer_epoch;
  uint32_t target[TW_MAX_RANKS], arrived[TW_MAX_RANKS];
  uint32_t announced[TW_MAX_RANKS], credits[TW_MAX_RANKS];
  int32_t err_status, err_where, err_index;
  uint32_t err_seen, err_target;
} tw__counters;

tw_status tw__context_counters(tw_context_t ctx, cudaStream_t stream, tw__counters* out);

/* Injects a consumer fault (tw_fault) into this rank's next overlapped/unfused call only. */
tw_status tw__context_inject_fault(tw_context_t ctx, int kind, int index);

/* Debug tags of the last call (needs TW_DEBUG_TAGS_CHECK): waits for the call, then copies
 * (tokens, top_k) words: (source rank + 1) << 16 | arrivals per column tile for a row received
 * from another rank, 0xFFFF0000 for a local row. */
tw_status tw__context_debug_slots(tw_context_t ctx, uint32_t* host, int64_t count);

/* The last call's timeline (needs config.timing = 1; waits for the call): its phase times (as
 * tw_context_timings) and, in ms from its start, when the consumer ended, when the reduction
 * started (its stream had waited for both the producer and the consumer) and, under the add
 * dataflow, when the copies that zero the next call's output buffer ended (they run beside the
 * call, on a copy engine); each 0 where the call had no such phase. */
tw_status tw__context_timeline(tw_context_t ctx, tw_combine_timings* t, float* comm_end_ms,
                               float* reduce_start_ms, float* zero_end_ms);

/* The work of the uploaded plan: producer tiles and consumer transfer units per call (the index
 * ranges of the trace's tile and unit records). */
tw_status tw__device_plan_work(tw_device_plan_t d, int32_t* tiles, int32_t* units);
/* The GEMM1 tile list of the uploaded plan (layer contexts; host copy, valid until the next
 * upload or dispatch): *num_tiles of them (0 and NULL on other contexts). */
tw_status tw__device_plan_gemm1_tiles(tw_device_plan_t d, const tw_tile** tiles,
                                      int32_t* num_tiles);

/* The layer's GEMM1 + SwiGLU alone, as tw_moe_layer runs it between its dispatch and its
 * combine: h (rows, ffn) = silu(expert_in w_gate^T) * (expert_in w_up^T) over dplan's GEMM1 tile
 * list (the plan the last dispatch or upload put there), a grid of at most sm_budget CTAs (0: the
 * context's), on `stream`. h NULL: the context's own (tw__context_layer_h). Not collective; the
 * caller orders it after the dispatch and before the combine (same stream). Needs layer = 1. */
tw_status tw__layer_gemm1(tw_context_t ctx, tw_device_plan_t dplan, const void* expert_in,
                          const void* w13, void* h, int32_t sm_budget, cudaStream_t stream);
/* The context's GEMM1 output h (rows_max, ffn) bf16, which tw_moe_layer writes and reads. */
tw_status tw__context_layer_h(tw_context_t ctx, void** h);

/* Tracing (src/core/trace.h; what `tilewave trace` uses). capacity > 0: a device buffer of that
 * many 16-byte records (replacing any earlier one, empty), which every eager call of this context
 * fills from then on (producer, consumer, reduction, dispatch and GEMM1 events; a call captured in
 * a CUDA graph is never traced, so no graph holds the buffer); 0: tracing off, the buffer freed.
 * Waits for the context's work first. Not collective. */
tw_status tw__context_trace(tw_context_t ctx, int64_t capacity);
/* 1 where the kernels' trace hooks are compiled in (the default), 0 in a -DTW_TRACE_HOOKS=OFF
 * build, where tw__context_trace refuses capacities > 0 (TW_ERR_UNSUPPORTED). */
int tw__trace_hooks(void);
/* Empties the buffer in `stream` order, after the context's last call (the next call's records
 * start at slot 0). TW_ERR_STATE when tracing is off. */
tw_status tw__context_trace_clear(tw_context_t ctx, cudaStream_t stream);
/* Waits for the context's work, then copies up to `max` records (in the order their slots were
 * taken) to `out`: *count of them; *dropped: the records that did not fit since the last clear
 * (the cursor past the capacity). TW_ERR_STATE when tracing is off. */
tw_status tw__context_trace_read(tw_context_t ctx, tw_trace_record* out, int64_t max,
                                 int64_t* count, int64_t* dropped);

#ifdef __cplusplus
}
#endif

#endif /* TW_RUNTIME_H */
