/* early_tokens.c: how much of the owner's reduction could start before the producer ends.
 *
 * For each of rank 0's tokens: the producer's progress (the last tile of the band that holds each
 * of its k rows, as a fraction of the tile list of whichever rank computes that row) at which all
 * k rows exist; transfer delays are ignored. Prints the share of tokens complete by 50 / 75 / 90 /
 * 95% of the producer's span, on real plans of the grid (balanced routing, seed 1).
 *
 * Build and run from the repository root after a CPU build (build/libtilewave_host.a):
 *   gcc -O2 -Iinclude -Isrc/core -Isrc/plan dev/reduce/early_tokens.c build/libtilewave_host.a \
 *       -lm -lpthread -o build/early_tokens && build/early_tokens
 */
#include <stdio.h>
#include <stdlib.h>
#include "plan.h"
#include "tilewave.h"
static void run(int tokens, int hidden, int experts, int sched) {
  tw_problem p = TW_PROBLEM_INIT;
  p.hidden = hidden;
  p.ffn = 2048;
  p.experts = experts;
  p.top_k = 2;
  p.world_size = 2;
  p.max_tokens = tokens;
  tw_routing_t rt = NULL;
  tw_routing_generate(&p, TW_ROUTER_BALANCED, 0.0, tokens, 1, &rt);
  tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
  cfg.schedule = sched;
  tw_plan_t pl[2];
  for (int r = 0; r < 2; r++) tw_plan_create(&p, rt, r, &cfg, &pl[r]);
  /* progress of each row on each rank: last tile index of its band / num_tiles */
  double* rowp[2];
  for (int r = 0; r < 2; r++) {
    struct tw_plan* q = pl[r];
    rowp[r] = calloc(q->rows, sizeof(double));
    int* last = calloc(q->num_bands, sizeof(int));
    for (int i = 0; i < q->num_tiles; i++) last[q->tiles[i].band] = i;
    for (int b = 0; b < q->num_bands; b++)
      for (int k = 0; k < q->bands[b].rows; k++)
        rowp[r][q->bands[b].row0 + k] = (double)(last[b] + 1) / q->num_tiles;
    free(last);
  }
  for (int o = 0; o < 1; o++) {
    struct tw_plan* q = pl[o];
    struct tw_plan* s = pl[1 - o];
    /* receive row -> progress on the source */
    double* recvp = calloc(q->recv_rows > 0 ? q->recv_rows : 1, sizeof(double));
    const long rb = 2L * hidden;
    int* last = calloc(s->num_bands, sizeof(int));
    for (int i = 0; i < s->num_tiles; i++) last[s->tiles[i].band] = i;
    for (int b = 0; b < s->num_bands; b++) {
      if (s->bands[b].dest != o) continue;
      long r0 = s->bands[b].dest_offset / rb;
      for (int k = 0; k < s->bands[b].valid_rows; k++)
        recvp[r0 + k] = (double)(last[b] + 1) / s->num_tiles;
    }
    int cnt[4] = {0, 0, 0, 0};
    const double th[4] = {0.5, 0.75, 0.9, 0.95};
    for (int t = 0; t < tokens; t++) {
      double done = 0;
      for (int j = 0; j < 2; j++) {
        int row = q->slot_row[t * 2 + j];
        double v = row < q->recv_rows ? recvp[row] : rowp[o][row - q->recv_rows];
        if (v > done) done = v;
      }
      for (int i = 0; i < 4; i++) cnt[i] += done <= th[i];
    }
    printf(
        "tokens %5d N %d E %2d %-12s complete by 50%%: %4.1f%%  75%%: %4.1f%%  90%%: %4.1f%%  "
        "95%%: %4.1f%%\n",
        tokens, hidden, experts,
        sched == TW_SCHEDULE_EXPERT_MAJOR ? "expert-major" : "remote-first",
        100.0 * cnt[0] / tokens, 100.0 * cnt[1] / tokens, 100.0 * cnt[2] / tokens,
        100.0 * cnt[3] / tokens);
    free(recvp);
    free(last);
  }
  for (int r = 0; r < 2; r++) {
    free(rowp[r]);
    tw_plan_destroy(pl[r]);
  }
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
