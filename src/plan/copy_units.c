/*
 * copy_units.c: the units of the layer's banded copy (tw__plan_copy_units, plan.h), from a rank's
 * plan and the count matrix alone; the destinations' layouts follow from the same matrix
 * (layout.c), so no rank needs another's plan.
 */
#include <string.h>

#include "core.h"
#include "plan.h"

int64_t tw__copy_units_max(const tw_problem* p, int32_t tm) {
  if (p == NULL || tm < 1 || p->world_size < 1) return 0;
  const int64_t slots = (int64_t)p->max_tokens * p->top_k;
  return slots / tm + 2 * (int64_t)p->experts +
         (int64_t)(p->experts / p->world_size) * p->world_size + 1;
}

static tw_status tw__unit_add(tw_copy_unit* units, int32_t capacity, int32_t* n, int32_t dest,
                              int32_t row0, int32_t slot0, int32_t rows, int32_t band) {
  if (*n >= capacity)
    return tw__fail(TW_ERR_INVALID_SIZE, "copy units: more than the %d this problem allows",
                    capacity);
  tw_copy_unit* u = &units[(*n)++];
  memset(u, 0, sizeof *u);
  u->dest = dest;
  u->row0 = row0;
  u->slot0 = slot0;
  u->rows = rows;
  u->band = band;
  return TW_SUCCESS;
}

tw_status tw__plan_copy_units(const struct tw_plan* plan, const int32_t* counts,
                              const int32_t* pads, int32_t npads, int32_t* send_off,
                              tw_copy_unit* units, int32_t capacity, int32_t* num_units) {
  TW_CHECK_NULL(plan);
  TW_CHECK_NULL(counts);
  TW_CHECK_NULL(send_off);
  TW_CHECK_NULL(units);
  TW_CHECK_NULL(num_units);
  if (npads > 0) TW_CHECK_NULL(pads);
  *num_units = 0;
  const int32_t ET = plan->problem.experts, W = plan->problem.world_size;
  const int32_t E = plan->local_experts, TM = plan->tm, rank = plan->rank;
  const int32_t* mine = counts + (size_t)rank * ET;
  int32_t off = 0;
  for (int32_t g = 0; g < ET; g++) {
    send_off[g] = off;
    off += mine[g];
  }
  int32_t n = 0;
  for (int32_t e = 0; e < E; e++) {
    const int32_t r0 = plan->expert_row0[e]; /* this rank's expert e */
    for (int32_t q = 1; q <= W; q++) {
      const int32_t dst = (rank + q) % W, g = dst * E + e, c = mine[g];
      const int32_t row0 = plan->send_row0[g], slot0 = send_off[g];
      for (int32_t p = 0; p < c;) {
        const int32_t row = row0 + p;
        const int32_t band_row0 = dst != rank ? row : r0 + (row - r0) / TM * TM;
        const int32_t room = band_row0 + TM - row, rows = c - p < room ? c - p : room;
        TW_TRY(tw__unit_add(units, capacity, &n, dst, row, slot0 + p, rows,
                            tw_band_counter(band_row0, e, TM)));
        p += rows;
      }
    }
    for (int32_t i = 0; i < npads; i++) {
      const int32_t row = pads[2 * i], rows = pads[2 * i + 1];
      if (row < r0 || row >= r0 + plan->expert_rows[e]) continue;
      TW_TRY(tw__unit_add(units, capacity, &n, rank, row, -1, rows,
                          tw_band_counter(r0 + (row - r0) / TM * TM, e, TM)));
    }
  }
  *num_units = n;
  return TW_SUCCESS;
}
