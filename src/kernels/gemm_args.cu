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
