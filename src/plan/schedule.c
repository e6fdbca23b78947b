/*
 * schedule.c: the order in which the producer computes a plan's bands and tiles.
 *
 * The rules (second paper, Algorithm 1, with the choices fixed in plan.h and docs/model.md): experts
 * sorted by remote band count (descending, ties by index; layout.c), then either remote-first
 * (the second paper's: every remote band's column tiles, expert by expert, then every local
 * band's tiles, same expert order) or expert-major (expert by expert, each its remote bands,
 * groups in layout order, then its local bands; with three experts or more the last two go
 * remote, remote, local, local, so that the last remote bands are ready one expert's local bands
 * before the end, which the consumer needs to send them; dev/NOTES.md has the measurements).
 * Remote-first starts the transfers earliest; expert-major reads each expert's weights in one
 * pass (but the last two's) where remote-first reads those of every expert with remote and local
 * rows twice, once per pass. Both are permutations of the bands in layout order (kept in
 * layout_bands), so the model can try both on one layout (tw__plan_set_schedule). Either way a
 * group's bands are consecutive in the schedule, which is what a segment needs (segments.c). The
 * tiles follow the bands in groups of up to tile_group bands of one expert (and, under
 * remote-first, one destination), column by column (TW_TILE_GROUP_DEFAULT).
 */
#include <stdint.h>
#include <string.h>

#include "core.h"
#include "plan.h"

/* Whether band j may join the tile group that band i (i < j, consecutive bands) starts: one
 * expert (one weight matrix), so that the group's tiles read each weight column tile at about the
 * same time, the later bands from L2; and one destination unless j <= span_end. Expert-major sets
 * span_end to the schedule's last remote band: an expert's remote and local bands then share
 * groups, so its weights come from device memory once (dev/NOTES.md section 25), at the price of
 * publishing its remote bands up to a group's columns later; but no band after the last remote one
 * joins a remote group, since the consumer's tail needs that band early (the lead of
 * tw__plan_set_schedule, or the last expert where there is none). Remote-first puts every remote
 * tile first: span_end -1, one destination per group. */
static int tw__same_group(const tw_band* bands, int32_t i, int32_t j, int32_t span_end) {
  return bands[i].expert == bands[j].expert && (bands[i].dest == bands[j].dest || j <= span_end);
}

void tw__tiles_from_bands(const tw_band* bands, int32_t nb, int32_t cols, int32_t tn,
                          int32_t tile_group, int32_t span_end, tw_tile* tiles) {
  const int32_t group = tile_group > 1 ? tile_group : 1;
  for (int32_t i = 0, t = 0, flip = 0; i < nb;) {
    int32_t g = 1;
    while (g < group && i + g < nb && tw__same_group(bands, i, i + g, span_end)) g++;
    for (int32_t c = 0; c < cols; c++) {
      const int32_t col = flip ? cols - 1 - c : c;
      for (int32_t j = i; j < i + g; j++, t++)
        tiles[t] = (tw_tile){.row0 = bands[j].row0,
                             .rows = bands[j].rows,
                             .expert = bands[j].expert,
                             .col0 = col * tn,
                             .band = j};
    }
    i += g;
    flip = group > 1 && i < nb && tw__same_group(bands, i - 1, i, span_end) ? !flip : 0;
  }
}

tw_status tw__plan_set_schedule(struct tw_plan* plan, int32_t schedule) {
  TW_CHECK_NULL(plan);
  if (schedule != TW_SCHEDULE_REMOTE_FIRST && schedule != TW_SCHEDULE_EXPERT_MAJOR)
    return tw__fail(
        TW_ERR_INVALID_ARGUMENT,
        "schedule %d: give TW_SCHEDULE_REMOTE_FIRST (1) or TW_SCHEDULE_EXPERT_MAJOR (2)", schedule);
  if (plan->layout_bands == NULL) {
    if (plan->schedule == schedule) return TW_SUCCESS;
    return tw__fail(TW_ERR_STATE,
                    "plan: no bands in layout order to build schedule %d from (a plan built by "
                    "hand keeps its own order); build the plan with tw_plan_create",
                    schedule);
  }
  const int32_t E = plan->local_experts, rank = plan->rank, W = plan->problem.world_size;
  const tw_band* lb = plan->layout_bands;
  /* Expert-major: each expert's bands as the layout has them (remote groups, then the local one),
   * but the last two experts' remote parts before their local parts. Remote-first: two passes
   * over expert_order, [expert_band0, expert_local_band0) then [expert_local_band0,
   * expert_band0 + 1). */
  int32_t nb = 0;
  for (int32_t pass = 0; pass < 2; pass++) {
    if (pass == 1 && schedule == TW_SCHEDULE_EXPERT_MAJOR) break;
    for (int32_t i = 0; i < E; i++) {
      const int32_t e = plan->expert_order[i];
      int32_t b0 = plan->expert_band0[e], b1 = plan->expert_band0[e + 1];
      if (schedule == TW_SCHEDULE_REMOTE_FIRST) {
        if (pass == 0)
          b1 = plan->expert_local_band0[e];
        else
          b0 = plan->expert_local_band0[e];
      } else if (i == E - 2 && E >= 3) {
        /* The last two experts: both remote parts, then both local ones. */
        for (int32_t part = 0; part < 2; part++)
          for (int32_t j = i; j < E; j++) {
            const int32_t x = plan->expert_order[j];
            const int32_t c0 = part ? plan->expert_local_band0[x] : plan->expert_band0[x];
            const int32_t c1 = part ? plan->expert_band0[x + 1] : plan->expert_local_band0[x];
            if (c1 > c0) memcpy(&plan->bands[nb], &lb[c0], (size_t)(c1 - c0) * sizeof *lb);
            nb += c1 > c0 ? c1 - c0 : 0;
          }
        break;
      }
      if (b1 > b0) {
        memcpy(&plan->bands[nb], &lb[b0], (size_t)(b1 - b0) * sizeof *lb);
        nb += b1 - b0;
      }
    }
  }
  if (nb != plan->num_bands)
    return tw__fail(TW_ERR_INTERNAL, "plan: schedule %d holds %d of %d bands", schedule, nb,
                    plan->num_bands);
  /* Streams and remote tile count over the whole order: under expert-major a destination's
   * bands are spread over the schedule, with local bands between them. */
  int32_t nremote = 0;
  for (int32_t d = 0; d < W; d++) plan->stream_first[d] = plan->stream_last[d] = -1;
  for (int32_t i = 0; i < nb; i++) {
    const int32_t d = plan->bands[i].dest;
    if (d == rank) continue;
    nremote++;
    if (plan->stream_first[d] < 0) plan->stream_first[d] = i;
    plan->stream_last[d] = i;
  }
  plan->num_remote_tiles = nremote * plan->col_tiles;
  /* Tiles: bands in schedule order, in the groups of tw__tiles_from_bands; under expert-major
   * an expert's bands of any destination share groups up to the last remote band. */
  int32_t span_end = -1;
  for (int32_t d = 0; d < W && schedule == TW_SCHEDULE_EXPERT_MAJOR; d++)
    if (plan->stream_last[d] > span_end) span_end = plan->stream_last[d];
  tw__tiles_from_bands(plan->bands, nb, plan->col_tiles, plan->tn, plan->tile_group, span_end,
                       plan->tiles);
  plan->num_segments = 0; /* the bands' segment fields are -1 (copied from layout_bands) */
  plan->schedule = schedule;
  return TW_SUCCESS;
}

tw_status tw__plan_gemm1_tiles(const struct tw_plan* plan, int32_t tn, tw_tile* tiles,
                               int32_t capacity, int32_t* num_tiles) {
  TW_CHECK_NULL(plan);
  TW_CHECK_NULL(num_tiles);
  *num_tiles = 0;
  const int32_t ffn = plan->problem.ffn, nb = plan->num_bands;
  if (ffn < 1 || nb < 0 || tn < 1)
    return tw__fail(TW_ERR_INVALID_SIZE, "GEMM1 tiles: ffn %d, %d bands, tile width %d", ffn, nb,
                    tn);
  const int32_t cols = (ffn + tn - 1) / tn;
  const int64_t n = (int64_t)nb * cols;
  if (n > INT32_MAX)
    return tw__fail(TW_ERR_INVALID_SIZE, "GEMM1 tiles: %lld (%d bands x %d columns)",
                    (long long)n, nb, cols);
  if (tiles != NULL && capacity < n)
    return tw__fail(TW_ERR_INVALID_SIZE,
                    "GEMM1 tiles: room for %d, the plan has %lld (%d bands x %d column tiles); "
                    "pass tiles NULL for the count",
                    capacity, (long long)n, nb, cols);
  *num_tiles = (int32_t)n;
  if (tiles == NULL || n == 0) return TW_SUCCESS;
  const tw_band* bands = plan->layout_bands != NULL ? plan->layout_bands : plan->bands;
  TW_CHECK_NULL(bands);
  tw__tiles_from_bands(bands, nb, cols, tn, plan->tile_group, nb - 1, tiles);
  return TW_SUCCESS;
}
