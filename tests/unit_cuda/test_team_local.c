/*
 * test_team_local.c: the in-process team's host collectives (src/runtime/team_local.c), on the
 * CPU: they meet in shared host memory and make no CUDA call, so this runs on any machine (it
 * links the CUDA libraries but never touches a device). One thread per rank. Checks:
 *  - all-gathers of several sizes give every rank every rank's bytes, round after round;
 *  - a rank that stops calling (a dead peer): the others' collective fails with TW_ERR_TIMEOUT
 *    naming that rank within the team timeout plus slack, and from then on every rank's
 *    collectives (the late rank's too) fail at once with the same status;
 *  - a rank that aborts: the ranks waiting in a collective fail with TW_ERR_ABORTED naming it at
 *    once (long before the timeout), and so does every later collective and the state query;
 *  - bad arguments and a team destroyed while views exist are refused.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "core.h"
#include "team.h"
#include "tw_test.h"

enum { kMaxWorld = 8 };

static void tw_sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* What one rank's thread does and records. */
typedef struct tw_rank_job {
  tw__team* view;
  int world, rank;
  int mode; /* 0: all-gathers; 1: dead-peer round; 2: abort round */
  int victim, delay_ms;
  /* results */
  int bad;         /* wrong bytes seen (mode 0) */
  tw_status first; /* status of the round's collective */
  double first_s;  /* seconds it took */
  tw_status later; /* status of a collective after the round */
  double later_s;
  tw_status state; /* the state query after the round */
  char why[512];   /* tw_last_error() of the round's collective */
} tw_rank_job;

static void* tw_rank_thread(void* arg) {
  tw_rank_job* j = (tw_rank_job*)arg;
  tw__team* v = j->view;
  if (j->mode == 0) {
    for (int round = 0; round < 200; round++) {
      const size_t n = (size_t)1 + (size_t)(round % 7) * 5; /* 1..31 int64 values */
      int64_t mine[32], all[32 * kMaxWorld];
      for (size_t i = 0; i < n; i++)
        mine[i] = (int64_t)j->rank * 1000003 + round * 101 + (int64_t)i;
      if (v->ops->allgather(v, mine, all, n * sizeof(int64_t)) != TW_SUCCESS) {
        j->bad++;
        continue;
      }
      for (int r = 0; r < j->world; r++)
        for (size_t i = 0; i < n; i++)
          j->bad += all[(size_t)r * n + i] != (int64_t)r * 1000003 + round * 101 + (int64_t)i;
      int64_t s = j->rank + 1;
      if (tw__team_sum_i64(v, &s, 1) != TW_SUCCESS || s != (int64_t)j->world * (j->world + 1) / 2)
        j->bad++;
    }
    j->first = tw__team_barrier(v);
    return NULL;
  }
  /* One good barrier first: every rank is in, so the failure below is the round's own. */
  if (tw__team_barrier(v) != TW_SUCCESS) j->bad++;
  if (j->rank == j->victim) {
    tw_sleep_ms(j->delay_ms);
    if (j->mode == 2) {
      v->ops->abort(v, "rank 0 of 3 aborted the context (tw_context_abort)");
      j->first = TW_ERR_ABORTED; /* what the victim itself reports afterwards */
    }
  }
  const double t0 = tw__now_seconds();
  if (!(j->mode == 2 && j->rank == j->victim)) {
    j->first = tw__team_barrier(v);
    snprintf(j->why, sizeof j->why, "%s", tw_last_error());
  }
  j->first_s = tw__now_seconds() - t0;
  const double t1 = tw__now_seconds();
  int64_t x = 1;
  j->later = tw__team_max_i64(v, &x, 1);
  j->later_s = tw__now_seconds() - t1;
  j->state = v->ops->state(v);
  return NULL;
}

/* Runs `mode` on a fresh team of `world` ranks with the given timeout; jobs[] gets the results. */
static void tw_run_team(int world, int timeout_ms, int mode, int victim, int delay_ms,
                        tw_rank_job* jobs) {
  tw_team_t team = NULL;
  CHECK_OK(tw__team_local_create(world, 0, 132, timeout_ms, &team));
  if (team == NULL) return;
  pthread_t th[kMaxWorld];
  for (int r = 0; r < world; r++) {
    memset(&jobs[r], 0, sizeof jobs[r]);
    jobs[r].world = world;
    jobs[r].rank = r;
    jobs[r].mode = mode;
    jobs[r].victim = victim;
    jobs[r].delay_ms = delay_ms;
    CHECK_OK(tw__team_local_join(team, r, &jobs[r].view));
  }
  /* A second view of a rank is refused while the first exists. */
  tw__team* again = NULL;
  CHECK_STATUS(tw__team_local_join(team, 0, &again), TW_ERR_STATE);
  for (int r = 0; r < world; r++) CHECK(jobs[r].view != NULL);
  for (int r = 0; r < world; r++) pthread_create(&th[r], NULL, tw_rank_thread, &jobs[r]);
  for (int r = 0; r < world; r++) pthread_join(th[r], NULL);
  CHECK_STATUS(tw_team_destroy(team), TW_ERR_STATE); /* views still exist */
  for (int r = 0; r < world; r++) {
    CHECK(jobs[r].view->ops->device_busy(jobs[r].view) == 0);
    jobs[r].view->ops->release(jobs[r].view);
  }
  CHECK_OK(tw_team_destroy(team));
}

static void test_allgather_rounds(void) {
  for (int world = 1; world <= kMaxWorld; world++) {
    tw_rank_job jobs[kMaxWorld];
    tw_run_team(world, 10000, 0, -1, 0, jobs);
    for (int r = 0; r < world; r++) {
      CHECKF(jobs[r].bad == 0, "world %d rank %d: %d wrong values", world, r, jobs[r].bad);
      CHECK_OK(jobs[r].first);
    }
  }
}

static void test_dead_peer_times_out_everywhere(void) {
  const int world = 3, timeout_ms = 300, victim = 2;
  tw_rank_job jobs[kMaxWorld];
  tw_run_team(world, timeout_ms, 1, victim, 3 * timeout_ms, jobs);
  for (int r = 0; r < world; r++) {
    const tw_rank_job* j = &jobs[r];
    CHECK(j->bad == 0);
    CHECK_STATUS(j->first, TW_ERR_TIMEOUT);
    CHECK_STATUS(j->later, TW_ERR_TIMEOUT);
    CHECK_STATUS(j->state, TW_ERR_TIMEOUT);
    CHECKF(strstr(j->why, "for rank 2") != NULL && strstr(j->why, "TW_TEAM_TIMEOUT_MS") != NULL,
           "rank %d: the detail does not name the missing rank and the variable: %s", r, j->why);
    if (r != victim)
      CHECKF(j->first_s >= 0.9 * timeout_ms / 1000.0 && j->first_s < timeout_ms / 1000.0 + 1.0,
             "rank %d waited %.3f s, timeout %d ms", r, j->first_s, timeout_ms);
    else /* the late rank finds the team broken at once */
      CHECKF(j->first_s < 0.1, "late rank waited %.3f s", j->first_s);
    CHECKF(j->later_s < 0.1, "rank %d: a collective on a broken team took %.3f s", r, j->later_s);
  }
  printf("  dead peer: ranks 0 and 1 gave up after %.3f / %.3f s: %s\n", jobs[0].first_s,
         jobs[1].first_s, jobs[0].why);
}

static void test_abort_fails_peers_fast(void) {
  const int world = 3, timeout_ms = 20000, victim = 0, delay_ms = 200;
  tw_rank_job jobs[kMaxWorld];
  tw_run_team(world, timeout_ms, 2, victim, delay_ms, jobs);
  for (int r = 0; r < world; r++) {
    const tw_rank_job* j = &jobs[r];
    CHECK(j->bad == 0);
    CHECK_STATUS(j->first, TW_ERR_ABORTED);
    CHECK_STATUS(j->later, TW_ERR_ABORTED);
    CHECK_STATUS(j->state, TW_ERR_ABORTED);
    CHECKF(j->later_s < 0.1, "rank %d: a collective after the abort took %.3f s", r, j->later_s);
    if (r != victim) {
      CHECKF(strstr(j->why, "rank 0 of 3 aborted") != NULL, "rank %d: detail %s", r, j->why);
      /* Woken by the abort, not by the 20 s timeout. */
      CHECKF(j->first_s < delay_ms / 1000.0 + 2.0, "rank %d waited %.3f s", r, j->first_s);
    }
  }
  printf("  abort: ranks 1 and 2 failed after %.3f / %.3f s: %s\n", jobs[1].first_s,
         jobs[2].first_s, jobs[1].why);
}

/* Two ranks entering collectives of different sizes break the team for both (TW_ERR_TIMEOUT). */
static void* tw_mismatch_thread(void* arg) {
  tw_rank_job* j = (tw_rank_job*)arg;
  int64_t v[2] = {1, 2}, all[2 * kMaxWorld];
  const double t0 = tw__now_seconds();
  j->first = j->view->ops->allgather(j->view, v, all, j->rank == 0 ? 8 : 16);
  j->first_s = tw__now_seconds() - t0;
  snprintf(j->why, sizeof j->why, "%s", tw_last_error());
  return NULL;
}

static void test_mismatched_collectives_break_the_team(void) {
  tw_team_t team = NULL;
  CHECK_OK(tw__team_local_create(2, 0, 132, 20000, &team));
  if (team == NULL) return;
  tw_rank_job jobs[2];
  pthread_t th[2];
  memset(jobs, 0, sizeof jobs);
  for (int r = 0; r < 2; r++) {
    jobs[r].rank = r;
    CHECK_OK(tw__team_local_join(team, r, &jobs[r].view));
  }
  for (int r = 0; r < 2; r++) pthread_create(&th[r], NULL, tw_mismatch_thread, &jobs[r]);
  for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < 2; r++) {
    CHECK_STATUS(jobs[r].first, TW_ERR_TIMEOUT);
    CHECKF(jobs[r].first_s < 2.0, "rank %d waited %.3f s", r, jobs[r].first_s);
    CHECKF(strstr(jobs[r].why, "different orders") != NULL, "rank %d: %s", r, jobs[r].why);
    jobs[r].view->ops->release(jobs[r].view);
  }
  CHECK_OK(tw_team_destroy(team));
}

static void test_bad_arguments(void) {
  tw_team_t team = NULL;
  CHECK_STATUS(tw__team_local_create(0, 0, 132, 100, &team), TW_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(tw__team_local_create(TW_MAX_RANKS + 1, 0, 132, 100, &team),
               TW_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(tw__team_local_create(2, 0, 132, 0, &team), TW_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(tw__team_local_create(2, 0, 0, 100, &team), TW_ERR_INVALID_ARGUMENT);
  CHECK(team == NULL);
  CHECK_OK(tw__team_local_create(2, 0, 132, 100, &team));
  tw__team* v = NULL;
  CHECK_STATUS(tw__team_local_join(team, 2, &v), TW_ERR_INVALID_ARGUMENT);
  CHECK_OK(tw__team_local_join(team, 1, &v));
  if (v != NULL) {
    CHECK(v->timeout_ms == 100 && v->world == 2 && v->rank == 1 && v->in_process == 1);
    CHECK_OK(v->ops->state(v));
    v->ops->release(v);
  }
  CHECK_OK(tw_team_destroy(team));
  /* The status table knows the new code. */
  CHECK(strncmp(tw_status_string(TW_ERR_ABORTED), "TW_ERR_ABORTED:", 15) == 0);
}

TW_TEST_MAIN(TW_TEST(test_allgather_rounds), TW_TEST(test_dead_peer_times_out_everywhere),
             TW_TEST(test_abort_fails_peers_fast),
             TW_TEST(test_mismatched_collectives_break_the_team), TW_TEST(test_bad_arguments))
