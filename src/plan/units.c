/*
 * units.c: how the consumer cuts a plan's segments into transfer units, and how many units an
 * owner therefore receives. The sender (the device plan upload) and the owner (its arrival
 * target) must agree exactly, without exchanging counts: both follow from the bands, so both use
 * the first two functions below, and the plan invariant tests check them over random worlds of
 * 1-8 ranks. The third is the default row-part count, which every rank derives from the problem.
 *
 * A band is unit_chunks units (column chunks of the consumer's unit width). The last tail_bands
 * bands of each destination stream are also cut into tail_parts row parts: at the end of a call
 * they are all that is left to send, and whole each would be one CTA's copy while the pool's
 * other CTAs idle (dev/NOTES.md sections 15-16; the defaults and their measurements: plan.h).
 */
#include "plan.h"

int64_t tw__consumer_units(const struct tw_plan* plan, int32_t tail_bands, int32_t tail_parts,
                           int32_t unit_chunks, int32_t* seg_unit0, int32_t* seg_split0) {
  const int32_t world = plan->problem.world_size;
  if (world < 1 || world > TW_MAX_RANKS || tail_bands < 0 || tail_parts < 1 || unit_chunks < 1)
    return -1;
  /* Segments come in schedule order, so a stream's last bands are a suffix of the stream and of
   * every segment they fall in: count each stream's bands, then walk. */
  int64_t stream_bands[TW_MAX_RANKS] = {0}, seen[TW_MAX_RANKS] = {0};
  for (int32_t s = 0; s < plan->num_segments; s++) {
    const tw_segment* sg = &plan->segments[s];
    if (sg->dest < 0 || sg->dest >= world || sg->nbands < 1) return -1;
    stream_bands[sg->dest] += sg->nbands;
  }
  int64_t units = 0;
  for (int32_t s = 0; s < plan->num_segments; s++) {
    const tw_segment* sg = &plan->segments[s];
    const int64_t first = stream_bands[sg->dest] - tail_bands - seen[sg->dest];
    const int32_t split0 = (int32_t)(first < 0 ? 0 : first > sg->nbands ? sg->nbands : first);
    seen[sg->dest] += sg->nbands;
    seg_unit0[s] = (int32_t)units; /* the caller rejects a total beyond 32 bits */
    seg_split0[s] = split0;
    units += ((int64_t)split0 + (int64_t)(sg->nbands - split0) * tail_parts) * unit_chunks;
  }
  seg_unit0[plan->num_segments] = (int32_t)units;
  return units;
}

int64_t tw__owner_units(int64_t bands, int32_t tail_bands, int32_t tail_parts,
                        int32_t unit_chunks) {
  const int64_t tail = bands < tail_bands ? bands : tail_bands;
  return (bands + tail * (tail_parts - 1)) * unit_chunks;
}

int32_t tw__tail_parts_default(int32_t tm, int32_t hidden) {
  const int64_t band_bytes = (int64_t)tm * hidden * 2; /* bf16 rows */
  return band_bytes >= (int64_t)TW_TAIL_MAX_PARTS * TW_TAIL_PART_MIN_BYTES ? TW_TAIL_MAX_PARTS : 1;
}
