/*
 * kernels.h: host-side launchers of tilewave's CUDA kernels (internal). Each launcher validates
 * its arguments, launches on the given stream and returns a tw_status; none synchronises.
 */
#ifndef TW_KERNELS_H
#define TW_KERNELS_H

#include <cuda_runtime.h>
#include <stdint.h>

#include "tilewave.h"
#include "plan.h"
#include "trace.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Fills n bf16 values with `bits` (poisoning outputs before a test run). */
tw_status tw__fill_bf16(void* dst, size_t n, uint16_t bits, cudaStream_t stream);

/* ---- Producer: persistent grouped GEMM over a tile list ------------------------------------ */

typedef enum tw_signal_scope {
  TW_SIGNAL_NONE = 0, /* no counters (GEMM1, or GEMM alone) */
  TW_SIGNAL_GPU = 1,  /* consumer on the same GPU: red.release.gpu */
  TW_SIGNAL_SYS = 2   /* counters or data read by a peer GPU: red.release.sys */
} tw_signal_scope;

typedef enum tw_epilogue {
  TW_EPILOGUE_STORE = 0, /* C = A B^T */
  TW_EPILOGUE_SWIGLU = 1 /* GEMM1: B holds [gate | up] (2N rows); C = silu(A Bg^T) * (A Bu^T) */
} tw_epilogue;

typedef struct tw_gemm_args {
  const void* a;      /* (rows, k) bf16 row-major: the layout's rows */
  const void* b;      /* (experts, n_b, k) bf16: nn.Linear weight per expert, n_b = n, or
                         2n for TW_EPILOGUE_SWIGLU */
  void* c;            /* (rows, n) bf16 row-major */
  int32_t rows, k, n; /* n: output columns */
  int32_t experts;
  const tw_tile* tiles; /* (num_tiles) device array, execution order */
  int32_t num_tiles;
  /* Device int (NULL: off): the launch runs tiles [0, min(*live_tiles, num_tiles)), a count an
   * earlier kernel on the stream wrote (the capturable dispatch's list of tiles with live rows,
   * dispatch.h); the grid is still sized from num_tiles. */
  const int32_t* live_tiles;
  int32_t tm, tn; /* tile shape the tiles were planned for */
  int32_t grid;   /* P: persistent CTAs (CTA j takes tiles j, j+P, ...); 0 = all SMs */
  tw_signal_scope scope;
  uint32_t* band_counters; /* (num_bands) device; +1 per finished tile of the band; NULL if none */
  tw_epilogue epilogue;
  /* The add dataflow (TW_DATAFLOW_ADD; variant 4 only, NULL / 0 otherwise): row_weight scales
   * each row before its bf16 rounding (row_weight[row], 0 for padding); then each row of this
   * rank's tokens (a band of dest == rank, or a row past a remote band's valid_rows) is added
   * into add_out[row_token[row]] (bulk add, bf16) instead of stored, padding rows (row_token -1)
   * are dropped, and the remote rows are stored to c for the consumer as before. */
  const float* row_weight;  /* (rows) */
  void* add_out;            /* (tokens of this rank, n) bf16, zero before the call */
  const int32_t* row_token; /* (rows) token index at the row's owner; -1 for padding */
  const tw_band* bands;     /* (bands) the plan's bands (dest, valid_rows) */
  int32_t rank;
  /* Zeroed by the producer warpgroup's two idle warps, each CTA its share (NULL: nothing); 16-byte
   * aligned. The add dataflow's next output buffer (unless TW_ADD_ZEROING=copy). */
  void* zero;
  int64_t zero_vectors; /* 16-byte vectors */
  int32_t variant;      /* kernel version (sm90_gemm.cu header): 0 = default (5 at tn 128 and 4
                           at tn 256 where they cover the shape, else 1), 1 = simple (WMMA, any supported
                           shape), 2..5 = TMA + wgmma with different epilogues; 1..5 for tests/benches */
  tw_trace* trace;      /* device trace buffer (trace.h): each tile's begin and publish; NULL =
                           off */
  /* An overlapped layer's GEMM1 (NULL: off): before a tile's first load one thread waits until
   * band_arrived[tw_band_counter(tile.row0, tile.expert, tm)] >= tile.rows (acquire .sys; the
   * dispatch's banded copy, dispatch.h), bounded by timeout_ns; a timeout is recorded in err and
   * the tile computed anyway (the call has failed; nothing waits forever). */
  const uint32_t* band_arrived;
  struct tw_dev_error* err; /* sync.cuh */
  uint64_t timeout_ns;
  int32_t levers; /* lab levers of GEMM1 + SwiGLU (TW_GEMM1_LEVER_*; 0: none) */
} tw_gemm_args;

/* Lab levers of GEMM1 + SwiGLU's 128 x 128 kernel (variant 5 only; dev/gemm/NOTES.md v21), one
 * at a time or all three, for A/Bs against the default: 3 pipeline stages instead of 4; the gate
 * and up rows of a stage as one TMA box of a 3D view of w13 instead of two; silu through
 * tanh.approx (not bit-equal; the other two are). */
#define TW_GEMM1_LEVER_STAGES3 1
#define TW_GEMM1_LEVER_ONE_BOX 2
#define TW_GEMM1_LEVER_TANH 4
#define TW_GEMM1_LEVER_ALL 7

/* The GEMM a producer launch computes: C (rows, n) = A (rows, k) x B_e^T per expert, over tiles
 * of tm x tn. For GEMM2 k = ffn, n = hidden, experts = the rank's local experts. */
typedef struct tw_gemm_shape {
  int32_t rows, k, n, experts;
  int32_t tm, tn;
} tw_gemm_shape;

/* GEMM2's shape of a plan: its rows (padding included), K = problem.ffn, N = problem.hidden, its
 * local experts and resolved tile. */
tw_gemm_shape tw__gemm_shape_of_plan(const struct tw_plan* plan);

/* The one builder of producer arguments: zeroes *g, then sets the operands, the shape, the tile
 * list (device array, execution order), the persistent grid (0 = all SMs), the signal scope and
 * the band counters (NULL for TW_SIGNAL_NONE, or set later by the caller); the epilogue is
 * TW_EPILOGUE_STORE, the variant 0 (the library's choice), the add dataflow's fields and `zero`
 * unset: callers set those after. Returns TW_ERR_NULL_POINTER for a NULL g or shape and
 * TW_ERR_INVALID_SIZE for a negative rows, num_tiles or grid or a k, n, experts, tm or tn below 1;
 * the launcher checks the rest. */
tw_status tw__gemm_args_init(tw_gemm_args* g, const tw_gemm_shape* shape, const void* a,
                             const void* b, void* c, const tw_tile* tiles, int32_t num_tiles,
                             int32_t grid, tw_signal_scope scope, uint32_t* band_counters);

/* Launches the producer. It only ever increments counters: after e launches (and no reset) band
 * b's counter reads e * col_tiles. In tw_moe_combine the consumer's last CTA zeroes them after
 * each call (combine.h). */
tw_status tw__gemm_launch(const tw_gemm_args* args, cudaStream_t stream);

/* The only variant with the add dataflow's epilogue (one bulk operation per row, each row to its
 * own token; v5's tensor stores write whole boxes of consecutive rows): tw__gemm_launch takes it
 * for variant 0 when a call adds, and the context's warm-up loads it. */
#define TW_GEMM_VARIANT_ADD 4

/* Resident CTAs per SM (cudaOccupancyMaxActiveBlocksPerMultiprocessor, with each kernel's shared
 * memory) of the producer tw__gemm_launch runs for a tile shape and variant (0: the default),
 * and of the consumer with a copy mode (tw_consumer_copy; 0: bulk): `tilewave calibrate`'s
 * occ_comp and occ_comm. The runtime launches one CTA per SM of each. */
tw_status tw__gemm_occupancy(int32_t tm, int32_t tn, int32_t variant, int* ctas_per_sm);
tw_status tw__consumer_occupancy(int copy, int* ctas_per_sm);

/* ---- GEMM1 + SwiGLU: the producer family with the gate and up projections fused ------------
 *
 * h (rows, ffn) = silu(a w_gate^T) * (a w_up^T) per expert over a tile list, fp32 accumulation,
 * silu(x) = x / (1 + exp(-x)) in fp32, one rounding to bf16 at the end. A tile is up to tm rows
 * of one expert by TW_GEMM1_TN output columns; its accumulator holds 2 TW_GEMM1_TN columns, the
 * gate rows [col0, col0 + TW_GEMM1_TN) and the up rows [ffn + col0, ...) of w13, loaded as two
 * TMA boxes per stage into one B tile (no weight re-layout), and the epilogue pairs column j with
 * j + TW_GEMM1_TN. An ffn that is not a multiple of TW_GEMM1_TN is fine: the last column tile's
 * extra accumulator columns read other weight rows (or TMA's zero fill) and are never stored. No
 * tile signals (GEMM1 has no consumer). Zero input rows (the layout's padding) give zero output
 * rows: silu(0) * 0 = 0. */

/* Output columns of one GEMM1 tile (256 accumulator columns: the gate and the up half). */
#define TW_GEMM1_TN 128

typedef struct tw_gemm1_args {
  const void* a;   /* (rows, hidden) bf16 row-major: the layout's rows, padding rows zero */
  const void* w13; /* (experts, 2 ffn, hidden) bf16, the vLLM/SGLang fused-MoE layout: expert e's
                      gate projection in rows [0, ffn), its up projection in rows [ffn, 2 ffn) */
  void* h;         /* (rows, ffn) bf16 row-major: the SwiGLU output, GEMM2's input */
  int32_t rows, hidden, ffn, experts;
  const tw_tile* tiles; /* (num_tiles) device array, execution order: row0, rows (<= tm) and
                           expert of a band, col0 a multiple of TW_GEMM1_TN below ffn
                           (tw__plan_gemm1_tiles); band is not read */
  int32_t num_tiles;
  const int32_t* live_tiles; /* as tw_gemm_args.live_tiles; NULL: all num_tiles */
  int32_t tm;      /* band height of the layout: 128 (128 x 128 tiles) or 64 (64 x 128 tiles) */
  int32_t grid;    /* P: persistent CTAs (CTA j takes tiles j, j+P, ...); 0 = all SMs */
  int32_t variant; /* 0 = default (5), 1 = simple (WMMA), 2..5 the wgmma epilogues of
                      tw_gemm_args.variant; all give the same bits but 1 */
  tw_trace* trace; /* device trace buffer (trace.h): each tile's begin and store
                      (TW_TRACE_GEMM1_*); NULL = off */
  /* An overlapped layer: each tile waits for its band's rows (tw_gemm_args.band_arrived). */
  const uint32_t* band_arrived;
  struct tw_dev_error* err; /* sync.cuh */
  uint64_t timeout_ns;
  int32_t rank;   /* recorded with a timeout */
  int32_t levers; /* lab levers (TW_GEMM1_LEVER_*; 0: none) */
} tw_gemm1_args;

/* Sets *g from the operands and the shape (zeroing the rest: grid 0, variant 0, trace NULL).
 * Returns TW_ERR_NULL_POINTER for a NULL g; the launcher checks the values. */
tw_status tw__gemm1_args_init(tw_gemm1_args* g, const void* a, const void* w13, void* h,
                              int32_t rows, int32_t hidden, int32_t ffn, int32_t experts,
                              const tw_tile* tiles, int32_t num_tiles, int32_t tm);

/* GEMM1's tile list for a plan: tw__plan_gemm1_tiles(plan, TW_GEMM1_TN, ...) (plan.h). */

/* Launches GEMM1 + SwiGLU on stream (no synchronisation). Refuses, naming the fix: hidden not a
 * multiple of 64 (the K slice) or ffn not a multiple of 8 (TW_ERR_ALIGNMENT), tm other than 64 or
 * 128, a variant outside 0..5 (TW_ERR_UNSUPPORTED / TW_ERR_INVALID_ARGUMENT), operands not 16-byte
 * aligned, more than 2^31 - 1 weight rows. */
tw_status tw__gemm1_swiglu_launch(const tw_gemm1_args* args, cudaStream_t stream);

/* The unfused GEMM1's first half through the same kernel family: c (rows, n) fp32 = A B_e^T, the
 * accumulators unrounded (the wgmma kernel of 128 x 256 tiles with direct stores; args->c is a
 * float array). Only tm 128, tn 256, TW_EPILOGUE_STORE, no signals, no add dataflow and no
 * zeroing. With n = 2 ffn, B = w13 and tw__swiglu_launch (harness) after it, it gives the fused
 * kernel's bits (tests/gpu/test_gemm1.cu). */
tw_status tw__gemm_f32_launch(const tw_gemm_args* args, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* TW_KERNELS_H */
