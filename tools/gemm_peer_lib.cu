/*
 * gemm_peer_lib.cu: libtw_gemm_peer.so, a bench-only shared library that launches the producer
 * GEMM (GEMM2, and GEMM1 + SwiGLU) on caller-given device pointers and per-expert row ranges, so
 * that bench/gemm_peers.py can time it on the very torch tensors it hands DeepGEMM, in the same
 * process, through ctypes.
 *
 * Not part of libtilewave: it links the internal launchers (tw__gemm_launch,
 * tw__gemm1_swiglu_launch) from the static library and exports only the twpeer_* functions
 * below. A handle holds the uploaded tile list and the launcher's arguments, so that a timed call
 * is one kernel launch with no host-to-device copy. The tile list is the one the library builds
 * for these rows: each expert's rows cut into bands of tm rows from its first row (the last band
 * partial), the bands in expert order, grouped by tw__tiles_from_bands with the planner's tile
 * group (TW_TILE_GROUP unless the caller names one), the tile width the planner would choose
 * unless the caller names one.
 *
 * Every function returns a tw_status (0 = success); twpeer_last_error() says what was wrong. The
 * arguments are checked before any CUDA call, so the checks run on machines without a GPU.
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "bench_common.h" /* tw__bench_delay */
#include "core.h"
#include "kernels.h"
#include "plan.h"
#include "swiglu.h"

#define TWPEER_API extern "C" __attribute__((visibility("default")))

namespace {

enum PeerKind { kGemm2 = 2, kGemm1 = 1 };

struct Peer {
  PeerKind kind;
  tw_gemm_args g2;  /* kGemm2 */
  tw_gemm1_args g1; /* kGemm1 */
  tw_tile* tiles;   /* device copy of the tile list */
  int32_t num_tiles, tm, tn, tile_group;
};

/* The checks both kinds share: the row ranges lie inside the tensor and do not overlap when
 * sorted by expert (the layout is expert-major, each expert's rows contiguous). */
tw_status check_rows(const char* who, int64_t rows_total, int32_t experts, const int32_t* row0,
                     const int32_t* rows) {
  if (row0 == NULL || rows == NULL)
    return tw__fail(TW_ERR_NULL_POINTER, "%s: row0 and rows must be host arrays of %d entries", who,
                    experts);
  if (rows_total < 0 || rows_total > INT32_MAX)
    return tw__fail(TW_ERR_INVALID_SIZE, "%s: rows_total %lld must be in 0..%d", who,
                    (long long)rows_total, INT32_MAX);
  int64_t end = 0;
  for (int32_t e = 0; e < experts; e++) {
    if (rows[e] < 0 || row0[e] < 0 || (int64_t)row0[e] + rows[e] > rows_total)
      return tw__fail(TW_ERR_INVALID_SIZE,
                      "%s: expert %d's rows [%d, %d + %d) are not inside the tensor's %lld rows",
                      who, e, row0[e], row0[e], rows[e], (long long)rows_total);
    if (rows[e] > 0 && row0[e] < end)
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "%s: expert %d's rows start at %d, inside expert %d's; give each expert's "
                      "rows in expert order, one range each",
                      who, e, row0[e], e - 1);
    if (rows[e] > 0) end = (int64_t)row0[e] + rows[e];
  }
  return TW_SUCCESS;
}

/* Bands of tm rows per expert in expert order, then the library's grouping into tiles of tn
 * output columns over `cols` column tiles. */
std::vector<tw_tile> make_tiles(int32_t experts, const int32_t* row0, const int32_t* rows,
                                int32_t tm, int32_t tn, int32_t cols, int32_t group) {
  std::vector<tw_band> bands;
  for (int32_t e = 0; e < experts; e++)
    for (int32_t i = 0; i < rows[e]; i += tm) {
      tw_band b;
      memset(&b, 0, sizeof b);
      b.expert = e;
      b.row0 = row0[e] + i;
      b.rows = rows[e] - i < tm ? rows[e] - i : tm;
      b.valid_rows = b.rows;
      b.segment = -1;
      b.dest_offset = -1;
      bands.push_back(b);
    }
  const int32_t nb = (int32_t)bands.size();
  std::vector<tw_tile> tiles((size_t)nb * cols);
  if (nb > 0) tw__tiles_from_bands(bands.data(), nb, cols, tn, group, nb - 1, tiles.data());
  return tiles;
}

/* Uploads the tiles and stores the handle (on failure frees what it made). */
tw_status finish(const char* who, Peer* p, const std::vector<tw_tile>& tiles, void** out) {
  p->num_tiles = (int32_t)tiles.size();
  p->tiles = NULL;
  if (!tiles.empty()) {
    cudaError_t e = cudaMalloc(&p->tiles, tiles.size() * sizeof(tw_tile));
    if (e == cudaSuccess)
      e = cudaMemcpy(p->tiles, tiles.data(), tiles.size() * sizeof(tw_tile),
                     cudaMemcpyHostToDevice);
    if (e != cudaSuccess) {
      cudaFree(p->tiles);
      delete p;
      return tw__fail(TW_ERR_CUDA, "%s: cannot upload %zu tiles: %s", who, tiles.size(),
                      cudaGetErrorString(e));
    }
  }
  *out = p;
  return TW_SUCCESS;
}

tw_status resolve_group(const char* who, int32_t requested, int32_t* group) {
  if (requested == 0) return tw__tile_group_resolve(group);
  if (requested < 1 || requested > 64)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "%s: tile_group %d; pass 1..64, or 0 for the "
                    "planner's (TW_TILE_GROUP, default %d)",
                    who, requested, TW_TILE_GROUP_DEFAULT);
  *group = requested;
  return TW_SUCCESS;
}

/* The checks both creators share (tile height, variant, grid, tile group, row ranges); on
 * success *group is the tile group to use. */
tw_status check_common(const char* who, int32_t tm, int32_t variant, int32_t grid,
                       int32_t tile_group, int64_t rows_total, int32_t experts, const int32_t* row0,
                       const int32_t* rows, int32_t* group) {
  if (tm != 64 && tm != 128)
    return tw__fail(TW_ERR_UNSUPPORTED, "%s: tm %d; use 64 or 128", who, tm);
  if (grid < 0 || variant < 0 || variant > 5)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "%s: grid %d (>= 0), variant %d (0..5)", who, grid,
                    variant);
  TW_TRY(resolve_group(who, tile_group, group));
  return check_rows(who, rows_total, experts, row0, rows);
}

}  // namespace

/* GEMM2: c (rows_total, n) = a (rows_total, k) w_e^T for the rows [row0[e], row0[e] + rows[e]) of
 * every expert e; rows outside every range are neither read into an output nor written.
 * [in]  a (rows_total, k) bf16, w (experts, n, k) bf16 (nn.Linear weights), device
 * [out] c (rows_total, n) bf16, device
 * [in]  row0, rows: host arrays of `experts` entries
 * tm 64 or 128; tn 128, 256 or 0 (the planner's: 256 for n >= 2048); variant 0 (the library's) to
 * 5; grid 0 (all SMs) or a CTA count; tile_group 0 (the planner's) or 1..64. */
TWPEER_API int twpeer_gemm2_create(const void* a, const void* w, void* c, int64_t rows_total,
                                   int32_t k, int32_t n, int32_t experts, const int32_t* row0,
                                   const int32_t* rows, int32_t tm, int32_t tn, int32_t variant,
                                   int32_t grid, int32_t tile_group, void** handle) {
  static const char* who = "twpeer_gemm2_create";
  tw__clear_error();
  TW_CHECK_NULL(handle);
  *handle = NULL;
  if (a == NULL || w == NULL || c == NULL)
    return tw__fail(TW_ERR_NULL_POINTER, "%s: a, w and c must be device pointers", who);
  if (k < 64 || k % 64 != 0 || n < 8 || n % 8 != 0 || experts < 1)
    return tw__fail(TW_ERR_ALIGNMENT,
                    "%s: k %d (a multiple of 64), n %d (a multiple of 8), "
                    "experts %d (>= 1)",
                    who, k, n, experts);
  if (tn == 0) {
    tw_problem p = TW_PROBLEM_INIT;
    p.hidden = n; /* GEMM2's output width is the model's hidden size */
    tn = tw__resolve_tile_n(&p);
  }
  if (tn != 128 && tn != 256)
    return tw__fail(TW_ERR_UNSUPPORTED, "%s: tn %d; use 128, 256 or 0", who, tn);
  int32_t group = 0;
  TW_TRY(check_common(who, tm, variant, grid, tile_group, rows_total, experts, row0, rows, &group));
  Peer* p = new Peer();
  p->kind = kGemm2;
  p->tm = tm;
  p->tn = tn;
  p->tile_group = group;
  const std::vector<tw_tile> tiles =
      make_tiles(experts, row0, rows, tm, tn, (n + tn - 1) / tn, group);
  TW_TRY(finish(who, p, tiles, handle));
  const tw_gemm_shape gs = {(int32_t)rows_total, k, n, experts, tm, tn};
  tw_status st =
      tw__gemm_args_init(&p->g2, &gs, a, w, c, p->tiles, p->num_tiles, grid, TW_SIGNAL_NONE, NULL);
  p->g2.variant = variant;
  if (st != TW_SUCCESS) {
    cudaFree(p->tiles);
    delete p;
    *handle = NULL;
  }
  return st;
}

/* GEMM1 + SwiGLU: h (rows_total, ffn) = silu(a w_gate^T) * (a w_up^T) over the same row ranges,
 * w13 (experts, 2 ffn, hidden) with the gate rows first (vLLM's layout). tm 64 or 128 (64 x 128
 * or 128 x 128 output tiles); variant, grid and tile_group as for GEMM2. */
TWPEER_API int twpeer_gemm1_create(const void* a, const void* w13, void* h, int64_t rows_total,
                                   int32_t hidden, int32_t ffn, int32_t experts,
                                   const int32_t* row0, const int32_t* rows, int32_t tm,
                                   int32_t variant, int32_t grid, int32_t tile_group,
                                   void** handle) {
  static const char* who = "twpeer_gemm1_create";
  tw__clear_error();
  TW_CHECK_NULL(handle);
  *handle = NULL;
  if (a == NULL || w13 == NULL || h == NULL)
    return tw__fail(TW_ERR_NULL_POINTER, "%s: a, w13 and h must be device pointers", who);
  if (hidden < 64 || hidden % 64 != 0 || ffn < 8 || ffn % 8 != 0 || experts < 1)
    return tw__fail(TW_ERR_ALIGNMENT,
                    "%s: hidden %d (a multiple of 64), ffn %d (a multiple "
                    "of 8), experts %d (>= 1)",
                    who, hidden, ffn, experts);
  int32_t group = 0;
  TW_TRY(check_common(who, tm, variant, grid, tile_group, rows_total, experts, row0, rows, &group));
  Peer* p = new Peer();
  p->kind = kGemm1;
  p->tm = tm;
  p->tn = TW_GEMM1_TN;
  p->tile_group = group;
  const std::vector<tw_tile> tiles = make_tiles(experts, row0, rows, tm, TW_GEMM1_TN,
                                                (ffn + TW_GEMM1_TN - 1) / TW_GEMM1_TN, group);
  TW_TRY(finish(who, p, tiles, handle));
  tw__gemm1_args_init(&p->g1, a, w13, h, (int32_t)rows_total, hidden, ffn, experts, p->tiles,
                      p->num_tiles, tm);
  p->g1.grid = grid;
  p->g1.variant = variant;
  return TW_SUCCESS;
}

/* Launches the handle's kernel on `stream` (a cudaStream_t; NULL: the legacy default stream). */
TWPEER_API int twpeer_launch(void* handle, void* stream) {
  tw__clear_error();
  TW_CHECK_NULL(handle);
  const Peer* p = static_cast<const Peer*>(handle);
  if (p->num_tiles == 0) return TW_SUCCESS; /* no rows: nothing to compute */
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return p->kind == kGemm2 ? tw__gemm_launch(&p->g2, s) : tw__gemm1_swiglu_launch(&p->g1, s);
}

/* GEMM1's lab levers (kernels.h, TW_GEMM1_LEVER_*; 0: none) for the handle's later launches;
 * the launch refuses a set it has no instance of. GEMM2 handles refuse any. */
TWPEER_API int twpeer_set_levers(void* handle, int32_t levers) {
  tw__clear_error();
  TW_CHECK_NULL(handle);
  Peer* p = static_cast<Peer*>(handle);
  if (p->kind != kGemm1 && levers != 0)
    return tw__fail(TW_ERR_UNSUPPORTED, "twpeer_set_levers: levers are GEMM1's");
  p->g1.levers = levers;
  return TW_SUCCESS;
}

/* The handle's tile count, tile shape and tile group (any output may be NULL). */
TWPEER_API int twpeer_info(const void* handle, int32_t* num_tiles, int32_t* tm, int32_t* tn,
                           int32_t* tile_group) {
  tw__clear_error();
  TW_CHECK_NULL(handle);
  const Peer* p = static_cast<const Peer*>(handle);
  if (num_tiles) *num_tiles = p->num_tiles;
  if (tm) *tm = p->tm;
  if (tn) *tn = p->tn;
  if (tile_group) *tile_group = p->tile_group;
  return TW_SUCCESS;
}

TWPEER_API void twpeer_destroy(void* handle) {
  Peer* p = static_cast<Peer*>(handle);
  if (p == NULL) return;
  cudaFree(p->tiles);
  delete p;
}

/* A one-thread spin of `us` microseconds on `stream` (tw__bench_delay): the idle device before
 * each timed call, as `tilewave bench gemm --delay-us` has it. */
TWPEER_API int twpeer_delay(void* stream, int32_t us) {
  tw__clear_error();
  return tw__bench_delay(static_cast<cudaStream_t>(stream), us);
}

/* h (rows, ffn) = silu(gu[:, :ffn]) * gu[:, ffn:] from a bf16 (rows, 2 ffn) GEMM output
 * (harness/swiglu.cu, vLLM's silu_and_mul): the activation a peer without a fused epilogue
 * runs after its GEMM1. */
TWPEER_API int twpeer_swiglu(const void* gu, void* h, int64_t rows, int32_t ffn, void* stream) {
  tw__clear_error();
  return tw__swiglu_launch(gu, 0, h, rows, ffn, static_cast<cudaStream_t>(stream));
}

TWPEER_API const char* twpeer_last_error(void) {
  return tw_last_error();
}
