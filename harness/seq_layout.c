/*
 * seq_layout.c: the sequential layer's all-to-all offsets from the count matrix (seq_layout.h).
 */
#include "seq_layout.h"

#include "core.h"

tw_status tw__seq_offsets_compute(int32_t world, int32_t local_experts, int32_t me,
                                  const int32_t* counts, int64_t slots, int64_t recv_max,
                                  tw__seq_offsets* o) {
  const int W = world, E = local_experts;
  const size_t ET = (size_t)W * E;
  const int32_t* c = counts;
  int64_t sum = 0;
  for (size_t g = 0; g < ET; g++) sum += c[(size_t)me * ET + g];
  if (sum != slots)
    return tw__fail(TW_ERR_EXPERT_ID,
                    "sequential layer: rank %d counted %lld slots of %lld (an id out of range)", me,
                    (long long)sum, (long long)slots);
  for (int d = 0, g = 0; d < W; d++) {
    o->send_off[d] = d == 0 ? 0 : o->send_off[d - 1] + o->send_rows[d - 1];
    o->send_rows[d] = 0;
    for (int e = 0; e < E; e++, g++) o->send_rows[d] += c[(size_t)me * ET + g];
  }
  o->recv_rows = 0;
  o->ngroups = 0;
  for (int src = 0; src < W; src++) {
    o->recv_off[src] = o->recv_rows;
    o->recv_from[src] = 0;
    for (int e = 0; e < E; e++) {
      const int32_t m = c[(size_t)src * ET + (size_t)me * E + e];
      if (m > 0) {
        o->g_e[o->ngroups] = e, o->g_m[o->ngroups] = m;
        o->g_row0[o->ngroups++] = o->recv_rows + o->recv_from[src];
      }
      o->recv_from[src] += m;
    }
    o->recv_rows += o->recv_from[src];
    /* Source src's rows for me start after its slots of lower experts in its send order. */
    int64_t before = 0;
    for (size_t g = 0; g < (size_t)me * E; g++) before += c[(size_t)src * ET + g];
    o->at_src[src] = before;
  }
  if (o->recv_rows > recv_max)
    return tw__fail(TW_ERR_CAPACITY, "sequential layer: rank %d receives %lld rows of %lld", me,
                    (long long)o->recv_rows, (long long)recv_max);
  for (int d = 0; d < W; d++) {
    int64_t before = 0; /* the rows of lower source ranks for d */
    for (int src = 0; src < me; src++)
      for (int e = 0; e < E; e++) before += c[(size_t)src * ET + (size_t)d * E + e];
    o->at_dest[d] = before;
  }
  return TW_SUCCESS;
}
