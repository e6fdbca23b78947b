/*
 * segments.c: the combine plan's transfer segments: runs of consecutive bands of one group that
 * the consumer sends as one contiguous remote write (tw__plan_build_segments). The model rebuilds
 * them once per candidate coalescing factor (model.c); building never allocates.
 */
#include <stdint.h>

#include "core.h"
#include "plan.h"

tw_status tw__plan_build_segments(struct tw_plan* plan, int32_t coalesce) {
  TW_CHECK_NULL(plan);
  if (coalesce < 1)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "coalesce (%d) must be at least 1 band per segment; pass 0 in the config to "
                    "let the model choose",
                    coalesce);
  /* Every segment is a run of consecutive schedule indices: a group's bands are consecutive in
   * the schedule and a segment never leaves its group. A new segment starts at a group boundary,
   * at the first and the last band of a destination's stream, right after the first band (so the
   * first segment stays one band), and when the open segment holds `coalesce` bands. The one-
   * band first segment gets the destination going as early as possible; the one-band last
   * segment keeps the tail transfer, which nothing can hide, short. */
  const int32_t rank = plan->rank;
  int32_t nseg = 0;
  for (int32_t i = 0; i < plan->num_bands; i++) {
    tw_band* b = &plan->bands[i];
    if (b->dest == rank) {
      b->segment = -1;
      continue;
    }
    int32_t d = b->dest;
    const tw_band* prev = i > 0 ? &plan->bands[i - 1] : NULL;
    int start = nseg == 0 || prev == NULL || prev->dest != d || prev->expert != b->expert ||
                i == plan->stream_first[d] || i == plan->stream_last[d] ||
                i - 1 == plan->stream_first[d] || plan->segments[nseg - 1].nbands >= coalesce;
    if (start) {
      tw_segment* s = &plan->segments[nseg++];
      s->band0 = i;
      s->nbands = 1;
      s->dest = d;
      s->src_row0 = b->row0;
      s->valid_rows = b->valid_rows;
      s->ready_tiles = plan->col_tiles;
      s->dest_offset = b->dest_offset;
    } else {
      tw_segment* s = &plan->segments[nseg - 1];
      s->nbands++;
      s->valid_rows += b->valid_rows;
      s->ready_tiles += plan->col_tiles;
    }
    b->segment = nseg - 1;
  }
  plan->coalesce = coalesce;
  plan->num_segments = nseg;
  return TW_SUCCESS;
}
