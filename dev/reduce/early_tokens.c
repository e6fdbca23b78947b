/* early_tokens.c: how much of the owner's reduction could start before the producer ends.
 *
 * For each of rank 0's tokens: the producer's progress (the last tile of the band that holds each
 * of its k rows, as a fraction of the tile list of whichever rank computes that row) at which all
 * k rows exist; transfer delays are ignored. Prints the share of tokens complete by 50 / 75 / 90 /
 * 95% of the producer's span, on real plans of the grid (balanced routing, seed 1).
 *
 * Part of the CMake build (target early_tokens: build/early_tokens), or, from the repository root
 * after a CPU build (build/libtilewave_host.a):
 *   gcc -O2 -Iinclude -Isrc/core -Isrc/plan dev/reduce/early_tokens.c build/libtilewave_host.a \
 *       -lm -lpthread -o build/early_tokens && build/early_tokens
 */
#include <stdio.h>
#include <stdlib.h>

#include "plan.h"
#include "tilewave.h"

/* Per band of a plan: (last tile of the band + 1) / tiles, the producer's progress when the band
 * is complete. */
static double* band_progress(const struct tw_plan* q) {
  double* p = calloc((size_t)q->num_bands, sizeof(double));
  if (p == NULL) exit(1);
  for (int i = 0; i < q->num_tiles; i++) p[q->tiles[i].band] = (double)(i + 1) / q->num_tiles;
  return p;
}

static void run(int tokens, int hidden, int experts, int sched) {
  tw_problem p = TW_PROBLEM_INIT;
  p.hidden = hidden;
  p.ffn = 2048;
  p.experts = experts;
  p.top_k = 2;
  p.world_size = 2;
  p.max_tokens = tokens;
  tw_routing_t rt = NULL;
  tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
  cfg.schedule = sched;
  tw_plan_t own = NULL, peer = NULL; /* rank 0 (the owner measured here) and rank 1 */
  if (tw_routing_generate(&p, TW_ROUTER_BALANCED, 0.0, tokens, 1, &rt) != TW_SUCCESS ||
      tw_plan_create(&p, rt, 0, &cfg, &own) != TW_SUCCESS ||
      tw_plan_create(&p, rt, 1, &cfg, &peer) != TW_SUCCESS) {
    fprintf(stderr, "early_tokens: %s\n", tw_last_error());
    exit(1);
  }
  /* Progress at which each row exists: local rows by rank 0's bands, received rows by the rank 1
   * bands that send them (their offset in rank 0's receive buffer names the rows). */
  double* local = calloc((size_t)own->rows, sizeof(double));
  double* recv = calloc((size_t)(own->recv_rows > 0 ? own->recv_rows : 1), sizeof(double));
  double* bp = band_progress(own);
  for (int b = 0; b < own->num_bands; b++)
    for (int k = 0; k < own->bands[b].rows; k++) local[own->bands[b].row0 + k] = bp[b];
  free(bp);
  bp = band_progress(peer);
  for (int b = 0; b < peer->num_bands; b++) {
    if (peer->bands[b].dest != 0) continue;
    const long r0 = (long)(peer->bands[b].dest_offset / (2L * hidden));
    for (int k = 0; k < peer->bands[b].valid_rows; k++) recv[r0 + k] = bp[b];
  }
  free(bp);
  const double th[4] = {0.5, 0.75, 0.9, 0.95};
  int cnt[4] = {0, 0, 0, 0};
  for (int t = 0; t < tokens; t++) {
    double done = 0;
    for (int j = 0; j < 2; j++) {
      const int row = own->slot_row[t * 2 + j];
      const double v = row < own->recv_rows ? recv[row] : local[row - own->recv_rows];
      if (v > done) done = v;
    }
    for (int i = 0; i < 4; i++) cnt[i] += done <= th[i];
  }
  printf(
      "tokens %5d N %d E %2d %-12s complete by 50%%: %4.1f%%  75%%: %4.1f%%  90%%: %4.1f%%  "
      "95%%: %4.1f%%\n",
      tokens, hidden, experts, sched == TW_SCHEDULE_EXPERT_MAJOR ? "expert-major" : "remote-first",
      100.0 * cnt[0] / tokens, 100.0 * cnt[1] / tokens, 100.0 * cnt[2] / tokens,
      100.0 * cnt[3] / tokens);
  free(local);
  free(recv);
  tw_plan_destroy(own);
  tw_plan_destroy(peer);
  tw_routing_destroy(rt);
}

int main(void) {
  const int es[5] = {4, 8, 16, 32, 64};
  for (int i = 0; i < 5; i++)
    for (int sch = TW_SCHEDULE_REMOTE_FIRST; sch <= TW_SCHEDULE_EXPERT_MAJOR; sch++)
      run(8192, 8192, es[i], sch);
  for (int i = 0; i < 5; i += 2) run(16384, 8192, es[i], TW_SCHEDULE_EXPERT_MAJOR);
  for (int i = 0; i < 5; i += 2) run(8192, 4096, es[i], TW_SCHEDULE_EXPERT_MAJOR);
  return 0;
}
