/*
 * team.c: the collectives both team backends share, built on the backend's all-gather (team.h):
 * a barrier, and the max and sum of a few int64 values over the ranks.
 */
#include <stdlib.h>

#include "core.h"
#include "team.h"

tw_status tw__team_barrier(tw__team* t) {
  int32_t word = 0, all[TW_MAX_RANKS];
  return t->ops->allgather(t, &word, all, sizeof word);
}

static tw_status tw__team_reduce_i64(tw__team* t, int64_t* v, int n, int max) {
  enum { kMax = 32 };
  if (n < 1 || n > kMax)
    return tw__fail(TW_ERR_INTERNAL, "team: a reduction of %d values (1..%d)", n, kMax);
  int64_t* all = (int64_t*)malloc(sizeof(int64_t) * (size_t)n * (size_t)t->world);
  if (all == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "team: host memory");
  tw_status st = t->ops->allgather(t, v, all, sizeof(int64_t) * (size_t)n);
  if (st == TW_SUCCESS) {
    for (int i = 0; i < n; i++) {
      int64_t acc = all[i];
      for (int32_t r = 1; r < t->world; r++) {
        const int64_t x = all[(size_t)r * n + i];
        acc = max ? (x > acc ? x : acc) : acc + x;
      }
      v[i] = acc;
    }
  }
  free(all);
  return st;
}

tw_status tw__team_max_i64(tw__team* t, int64_t* v, int n) {
  return tw__team_reduce_i64(t, v, n, 1);
}

tw_status tw__team_sum_i64(tw__team* t, int64_t* v, int n) {
  return tw__team_reduce_i64(t, v, n, 0);
}
