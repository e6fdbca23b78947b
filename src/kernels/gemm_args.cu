/*
 * gemm_args.cu: the builder of the producer's arguments (kernels.h). Host code only; a .cu so
 * that it builds with the other launchers of src/kernels.
 */
#include <string.h>

#include "core.h"
#include "kernels.h"

extern "C" tw_gemm_shape tw__gemm_shape_of_plan(const struct tw_plan* plan) {
  tw_gemm_shape s;
  memset(&s, 0, sizeof s);
  if (plan == NULL) return s;
  s.rows = plan->rows;
  s.k = plan->problem.ffn;
  s.n = plan->problem.hidden;
  s.experts = plan->local_experts;
  s.tm = plan->tm;
  s.tn = plan->tn;
  return s;
}

extern "C" tw_status tw__gemm_args_init(tw_gemm_args* g, const tw_gemm_shape* shape, const void* a,
                                        const void* b, void* c, const tw_tile* tiles,
                                        int32_t num_tiles, int32_t grid, tw_signal_scope scope,
                                        uint32_t* band_counters) {
  if (g == NULL || shape == NULL)
    return tw__fail(TW_ERR_NULL_POINTER, "tw__gemm_args_init: NULL %s",
                    g == NULL ? "args" : "shape");
  memset(g, 0, sizeof *g);
  if (shape->rows < 0 || num_tiles < 0 || grid < 0 || shape->k < 1 || shape->n < 1 ||
      shape->experts < 1 || shape->tm < 1 || shape->tn < 1)
    return tw__fail(TW_ERR_INVALID_SIZE,
                    "tw__gemm_args_init: rows %d, k %d, n %d, experts %d, tile %d x %d, %d tiles, "
                    "grid %d; rows, tiles and grid must be >= 0, the others >= 1",
                    shape->rows, shape->k, shape->n, shape->experts, shape->tm, shape->tn,
                    num_tiles, grid);
  g->a = a;
  g->b = b;
  g->c = c;
  g->rows = shape->rows;
  g->k = shape->k;
  g->n = shape->n;
  g->experts = shape->experts;
  g->tiles = tiles;
  g->num_tiles = num_tiles;
  g->tm = shape->tm;
  g->tn = shape->tn;
  g->grid = grid;
  g->scope = scope;
  g->band_counters = band_counters;
  g->epilogue = TW_EPILOGUE_STORE;
  g->variant = 0;
  return TW_SUCCESS;
}

extern "C" tw_status tw__gemm1_args_init(tw_gemm1_args* g, const void* a, const void* w13, void* h,
                                         int32_t rows, int32_t hidden, int32_t ffn, int32_t experts,
                                         const tw_tile* tiles, int32_t num_tiles, int32_t tm) {
  if (g == NULL) return tw__fail(TW_ERR_NULL_POINTER, "tw__gemm1_args_init: NULL args");
  memset(g, 0, sizeof *g);
  g->a = a;
  g->w13 = w13;
  g->h = h;
  g->rows = rows;
  g->hidden = hidden;
  g->ffn = ffn;
  g->experts = experts;
  g->tiles = tiles;
  g->num_tiles = num_tiles;
  g->tm = tm;
  return TW_SUCCESS;
}

extern "C" tw_status tw__gemm1_tiles_of_plan(const struct tw_plan* plan, tw_tile* tiles,
                                             int32_t capacity, int32_t* num_tiles) {
  TW_CHECK_NULL(plan);
  TW_CHECK_NULL(num_tiles);
  *num_tiles = 0;
  const int32_t ffn = plan->problem.ffn;
  if (ffn < 1 || plan->num_bands < 0)
    return tw__fail(TW_ERR_INVALID_SIZE, "tw__gemm1_tiles_of_plan: ffn %d, %d bands", ffn,
                    plan->num_bands);
  const int32_t cols = (ffn + TW_GEMM1_TN - 1) / TW_GEMM1_TN;
  const int64_t n = (int64_t)plan->num_bands * cols;
  if (n > INT32_MAX)
    return tw__fail(TW_ERR_INVALID_SIZE, "tw__gemm1_tiles_of_plan: %lld tiles (%d bands x %d)",
                    (long long)n, plan->num_bands, cols);
  if (tiles != NULL && capacity < n)
    return tw__fail(TW_ERR_INVALID_SIZE,
                    "tw__gemm1_tiles_of_plan: room for %d tiles, the plan has %lld (%d bands x %d "
                    "column tiles); call with tiles NULL for the count",
                    capacity, (long long)n, plan->num_bands, cols);
  *num_tiles = (int32_t)n;
  if (tiles == NULL || n == 0) return TW_SUCCESS;
  /* Layout order: expert by expert, so each expert's weights stream from memory once; span_end
   * nb - 1 lets a group take bands of any destination (GEMM1 publishes nothing). */
  const tw_band* bands = plan->layout_bands != NULL ? plan->layout_bands : plan->bands;
  tw__tiles_from_bands(bands, plan->num_bands, cols, TW_GEMM1_TN, plan->tile_group,
                       plan->num_bands - 1, tiles);
  return TW_SUCCESS;
}
