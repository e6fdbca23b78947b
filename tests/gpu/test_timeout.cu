/*
 * test_timeout.cu: a missing signal turns into TW_ERR_TIMEOUT on every rank within the bound,
 * never a hang or a trap, and tw_context_reset() makes the context correct again.
 *
 * Faults (injected into one rank's consumer for one call):
 *  - skip unit: one transfer unit is neither written nor announced, so its owner's reduction
 *    waits for an arrival that never comes;
 *  - band stuck: one unit waits for one tile more than its bands ever get, as if the producer
 *    had skipped a publish; that consumer times out, and then its owner's reduction does too.
 * After each fault: tw_context_check() returns TW_ERR_TIMEOUT on both ranks within a few
 * timeouts, the next call is refused with TW_ERR_STATE, and after tw_context_reset() the output
 * is bit-identical to the one from before the fault. Every case runs with both ways the
 * consumer copies (bulk and registers).
 *
 * Host-side failures, each on a team of its own (an in-process team made for the case, or an NCCL
 * communicator split off the run's, aborted at the end) with a short team timeout:
 *  - a rank stops calling (a dead peer): the others' tw_context_check returns TW_ERR_TIMEOUT
 *    naming it within the device and team timeouts, their reset fails at once, the late rank's
 *    check fails at once too, calls are refused, and every destroy returns promptly;
 *  - a rank calls tw_context_abort while the others wait in tw_context_check: they fail with
 *    TW_ERR_ABORTED at once (the team timeout is 30 s), the aborting rank's check and reset
 *    return TW_ERR_ABORTED without waiting, and every destroy returns promptly.
 * Exits 77 with fewer than 2 GPUs (or, with --in-process W, without a GPU).
 */
#include "overlap_common.h"

#define TW_TEST_TIMEOUT_MS 300

typedef struct tw_fixture {
  tw_problem p;
  tw_context_t ctx;
  tw_device_plan_t dp;
  tw_routing_t rt;
  tw_plan_t plan;
  void *expert_in, *w2, *out;
  uint16_t *good, *now;
  size_t n_out;
  int units; /* transfer units this rank's consumer sends per call */
} tw_fixture;

static int tw_fixture_init(tw_rank_env* env, tw_fixture* fx, int copy) {
  memset(fx, 0, sizeof *fx);
  const tw_problem p = tw_rank_problem(env, 512, 256, 8, 2, 256);
  fx->p = p;
  tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
  cc.timeout_ms = TW_TEST_TIMEOUT_MS;
  cc.consumer_copy = copy;
  CHECK_OK(tw_rank_context_create(env, &p, &cc, &fx->ctx));
  if (fx->ctx == NULL) return 0;
  tw_context_info info;
  CHECK_OK(tw_context_info_get(fx->ctx, &info));
  CHECK(info.timeout_ms == TW_TEST_TIMEOUT_MS);
  CHECK_OK(tw_device_plan_create(fx->ctx, &fx->dp));
  int32_t tokens[TW_MAX_RANKS];
  for (int r = 0; r < env->nranks; r++) tokens[r] = p.max_tokens;
  CHECK_OK(tw_make_routing(&p, TW_ROUTER_BALANCED, tokens, 31337, &fx->rt));
  tw_plan_config pc = TW_PLAN_CONFIG_INIT;
  pc.comm_ctas = 4;
  pc.coalesce = 2;
  CHECK_OK(tw_plan_create(&p, fx->rt, env->rank, &pc, &fx->plan));
  if (fx->dp == NULL || fx->plan == NULL) return 0;
  /* Units = remote bands x units per band: the faults below name units that exist. */
  const int chunks = (fx->plan->col_tiles + info.unit_tiles - 1) / info.unit_tiles;
  fx->units = fx->plan->num_remote_tiles / fx->plan->col_tiles * chunks;
  CHECKF(fx->units >= 2, "rank %d sends %d units; the faults need 2", env->rank, fx->units);
  const int E = p.experts / p.world_size;
  fx->n_out = (size_t)p.max_tokens * p.hidden;
  uint16_t* in = (uint16_t*)malloc((size_t)fx->plan->rows * p.ffn * 2 + 2);
  uint16_t* w2 = (uint16_t*)malloc((size_t)E * p.hidden * p.ffn * 2);
  tw_fill_expert_in(fx->plan, 5, in);
  tw_fill_w2(&p, env->rank, 6, w2);
  CHECK_CUDA(cudaMalloc(&fx->expert_in, (size_t)fx->plan->rows * p.ffn * 2 + 16));
  CHECK_CUDA(cudaMalloc(&fx->w2, (size_t)E * p.hidden * p.ffn * 2));
  CHECK_CUDA(cudaMalloc(&fx->out, fx->n_out * 2));
  CHECK_CUDA(
      cudaMemcpy(fx->expert_in, in, (size_t)fx->plan->rows * p.ffn * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(fx->w2, w2, (size_t)E * p.hidden * p.ffn * 2, cudaMemcpyHostToDevice));
  free(in);
  free(w2);
  CHECK_OK(tw_device_plan_upload(fx->dp, fx->plan, fx->rt, env->stream));
  fx->good = (uint16_t*)malloc(fx->n_out * 2);
  fx->now = (uint16_t*)malloc(fx->n_out * 2);
  return fx->good != NULL && fx->now != NULL;
}

static void tw_fixture_free(tw_fixture* fx) {
  cudaFree(fx->expert_in);
  cudaFree(fx->w2);
  cudaFree(fx->out);
  free(fx->good);
  free(fx->now);
  tw_plan_destroy(fx->plan);
  tw_routing_destroy(fx->rt);
  CHECK_OK(tw_device_plan_destroy(fx->dp));
  CHECK_OK(tw_context_destroy(fx->ctx));
}

/* A clean call; its output is copied to `host`. */
static void tw_clean_call(tw_rank_env* env, tw_fixture* fx, uint16_t* host) {
  CHECK_OK(tw__fill_bf16(fx->out, fx->n_out, 0xFFFF, env->stream));
  CHECK_OK(tw_moe_combine(fx->ctx, fx->dp, fx->expert_in, fx->w2, fx->out, env->stream));
  CHECK_OK(tw_context_check(fx->ctx));
  CHECK_CUDA(cudaMemcpy(host, fx->out, fx->n_out * 2, cudaMemcpyDeviceToHost));
}

/* Injects `fault` on rank `victim`, checks that both ranks see TW_ERR_TIMEOUT in time, that
 * calls are refused until reset, and that the call after the reset is correct again. */
static void tw_fault_round(tw_rank_env* env, tw_fixture* fx, int fault, int victim, int unit) {
  if (env->rank == victim) CHECK_OK(tw__context_inject_fault(fx->ctx, fault, unit));
  const double t0 = tw__now_seconds();
  CHECK_OK(tw_moe_combine(fx->ctx, fx->dp, fx->expert_in, fx->w2, fx->out, env->stream));
  CHECK_STATUS(tw_context_check(fx->ctx), TW_ERR_TIMEOUT);
  const double waited = tw__now_seconds() - t0;
  const char* detail = tw_last_error();
  CHECKF(strstr(detail, "timed out") != NULL, "detail does not say what timed out: %s", detail);
  if (env->rank == 0)
    printf("  fault %d on rank %d: TW_ERR_TIMEOUT after %.2f s: %s\n", fault, victim, waited,
           detail);
  /* Bound: the victim's wait, then its owner's wait, each one timeout, plus slack. */
  CHECKF(waited < 3.0 * TW_TEST_TIMEOUT_MS / 1000.0 + 2.0, "took %.2f s", waited);
  CHECK_STATUS(tw_moe_combine(fx->ctx, fx->dp, fx->expert_in, fx->w2, fx->out, env->stream),
               TW_ERR_STATE);
  CHECK_OK(tw_context_reset(fx->ctx));
  /* Nothing trapped: the CUDA context is alive (a stream of this rank, not the device: on an
   * in-process team the other ranks' calls may already be running again). */
  CHECK_CUDA(cudaStreamSynchronize(env->stream));
  CHECK_CUDA(cudaGetLastError());
  for (int rep = 0; rep < 3; rep++) {
    tw_clean_call(env, fx, fx->now);
    CHECKF(memcmp(fx->good, fx->now, fx->n_out * 2) == 0,
           "rank %d: output after reset differs from the one before the fault", env->rank);
  }
}

static const int kCopies[] = {TW_CONSUMER_COPY_BULK, TW_CONSUMER_COPY_REGISTERS};

static void test_missing_arrival_times_out_everywhere(tw_rank_env* env) {
  for (int c = 0; c < 2; c++) {
    if (!tw_test_copy_wanted(kCopies[c])) continue;
    tw_fixture fx;
    if (tw_fixture_init(env, &fx, kCopies[c])) {
      tw_clean_call(env, &fx, fx.good);
      tw_fault_round(env, &fx, TW_FAULT_SKIP_UNIT, 0, 0);
      tw_fault_round(env, &fx, TW_FAULT_SKIP_UNIT, 1, fx.units - 1);
    }
    tw_fixture_free(&fx);
  }
}

static void test_missing_band_publish_times_out_everywhere(tw_rank_env* env) {
  for (int c = 0; c < 2; c++) {
    if (!tw_test_copy_wanted(kCopies[c])) continue;
    tw_fixture fx;
    if (tw_fixture_init(env, &fx, kCopies[c])) {
      tw_clean_call(env, &fx, fx.good);
      tw_fault_round(env, &fx, TW_FAULT_BAND_STUCK, 1, 0);
      tw_fault_round(env, &fx, TW_FAULT_BAND_STUCK, 0, fx.units - 1);
      /* Several clean calls in flight after the resets. */
      for (int i = 0; i < 8; i++)
        CHECK_OK(tw_moe_combine(fx.ctx, fx.dp, fx.expert_in, fx.w2, fx.out, env->stream));
      CHECK_OK(tw_context_check(fx.ctx));
      CHECK_CUDA(cudaMemcpy(fx.now, fx.out, fx.n_out * 2, cudaMemcpyDeviceToHost));
      CHECK(memcmp(fx.good, fx.now, fx.n_out * 2) == 0);
    }
    tw_fixture_free(&fx);
  }
}

/* ---- host-side failures, on a team of the case's own ---------------------------------------- */

/* The case's team: in-process, one created by rank 0 and shared through a static (the verdict
 * team's barrier orders the hand-over); over NCCL, a communicator split off the run's, with the
 * team timeout from the environment (one process per rank: setenv is safe here). */
static tw_team_t g_case_team = NULL;

static int tw_case_team_open(tw_rank_env* env, int team_timeout_ms, tw_rank_env* out) {
  *out = *env;
  if (env->team != NULL) {
    if (env->rank == 0) {
      int sms = 0;
      CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
      g_case_team = NULL;
      CHECK_OK(tw__team_local_create(env->nranks, 0, sms, team_timeout_ms, &g_case_team));
    }
    CHECK_OK(tw__team_barrier(env->verdict));
    out->team = g_case_team;
    return out->team != NULL;
  }
  char v[32];
  snprintf(v, sizeof v, "%d", team_timeout_ms);
  setenv("TW_TEAM_TIMEOUT_MS", v, 1);
  out->comm = NULL;
  CHECK(ncclCommSplit(env->comm, 0, env->rank, &out->comm, NULL) == ncclSuccess);
  return out->comm != NULL;
}

/* After every context on it is destroyed: the in-process team is freed, the communicator aborted
 * (ncclCommAbort ends the all-gathers a timed-out rank left on its device). */
static void tw_case_team_close(tw_rank_env* env, tw_rank_env* team_env) {
  if (env->team != NULL) {
    CHECK_OK(tw__team_barrier(env->verdict));
    if (env->rank == 0) { /* the only writer of g_case_team */
      if (g_case_team != NULL) CHECK_OK(tw_team_destroy(g_case_team));
      g_case_team = NULL;
    }
    CHECK_OK(tw__team_barrier(env->verdict));
    return;
  }
  if (team_env->comm != NULL) CHECK(ncclCommAbort(team_env->comm) == ncclSuccess);
  unsetenv("TW_TEAM_TIMEOUT_MS");
}

#define TW_TEST_TEAM_TIMEOUT_MS 1500

/* A rank that stops calling: every other rank learns it within the timeouts, nothing hangs. */
static void test_dead_peer_fails_check_and_destroy_returns(tw_rank_env* env) {
  tw_rank_env tenv;
  if (!tw_case_team_open(env, TW_TEST_TEAM_TIMEOUT_MS, &tenv)) {
    tw_case_team_close(env, &tenv);
    return;
  }
  const int victim = env->nranks - 1;
  tw_fixture fx;
  if (tw_fixture_init(&tenv, &fx, TW_CONSUMER_COPY_BULK)) {
    tw_clean_call(&tenv, &fx, fx.good);
    double t0 = tw__now_seconds();
    if (env->rank != victim) {
      /* One more call, which the victim does not join: its waits time out on the device, then
       * the check's collective times out on the host. */
      CHECK_OK(tw_moe_combine(fx.ctx, fx.dp, fx.expert_in, fx.w2, fx.out, env->stream));
      CHECK_STATUS(tw_context_check(fx.ctx), TW_ERR_TIMEOUT);
      const double waited = tw__now_seconds() - t0;
      char expect[32];
      snprintf(expect, sizeof expect, "rank %d", victim);
      CHECKF(strstr(tw_last_error(), expect) != NULL &&
                 strstr(tw_last_error(), "TW_TEAM_TIMEOUT_MS") != NULL,
             "rank %d: the detail names neither the missing rank nor the variable: %s", env->rank,
             tw_last_error());
      if (env->rank == 0)
        printf("  dead rank %d: check failed after %.2f s: %s\n", victim, waited, tw_last_error());
      CHECKF(waited < 3.0 * TW_TEST_TIMEOUT_MS / 1000.0 + TW_TEST_TEAM_TIMEOUT_MS / 1000.0 + 2.0,
             "rank %d: the check took %.2f s", env->rank, waited);
      t0 = tw__now_seconds();
      CHECK_STATUS(tw_context_reset(fx.ctx), TW_ERR_TIMEOUT);
      CHECKF(tw__now_seconds() - t0 < 0.5, "rank %d: reset on a broken team took %.2f s", env->rank,
             tw__now_seconds() - t0);
    } else {
      /* The dead rank comes back late: the team is broken and says so at once. */
      usleep((useconds_t)(3 * TW_TEST_TIMEOUT_MS + TW_TEST_TEAM_TIMEOUT_MS + 1500) * 1000u);
      t0 = tw__now_seconds();
      CHECK_STATUS(tw_context_check(fx.ctx), TW_ERR_TIMEOUT);
      CHECKF(tw__now_seconds() - t0 < 0.5, "late rank: check took %.2f s", tw__now_seconds() - t0);
      CHECK_STATUS(tw_context_reset(fx.ctx), TW_ERR_TIMEOUT);
    }
    /* Calls are refused on every rank. */
    CHECK_STATUS(tw_moe_combine(fx.ctx, fx.dp, fx.expert_in, fx.w2, fx.out, env->stream),
                 TW_ERR_STATE);
  }
  const double t1 = tw__now_seconds();
  tw_fixture_free(&fx);
  CHECKF(tw__now_seconds() - t1 < 3.0 * TW_TEST_TIMEOUT_MS / 1000.0 + 2.0,
         "rank %d: destroy took %.2f s", env->rank, tw__now_seconds() - t1);
  tw_case_team_close(env, &tenv);
}

/* tw_context_abort on one rank: the others fail fast, nobody waits out a timeout. */
static void test_abort_fails_peers_fast(tw_rank_env* env) {
  const int team_timeout_ms = 30000;
  tw_rank_env tenv;
  if (!tw_case_team_open(env, team_timeout_ms, &tenv)) {
    tw_case_team_close(env, &tenv);
    return;
  }
  tw_fixture fx;
  if (tw_fixture_init(&tenv, &fx, TW_CONSUMER_COPY_REGISTERS)) {
    tw_clean_call(&tenv, &fx, fx.good);
    if (env->rank == 0) {
      usleep(300 * 1000); /* the others are in their check by now */
      CHECK_OK(tw_context_abort(fx.ctx));
      CHECK_OK(tw_context_abort(fx.ctx)); /* idempotent */
      double t0 = tw__now_seconds();
      CHECK_STATUS(tw_context_check(fx.ctx), TW_ERR_ABORTED);
      CHECK_STATUS(tw_context_reset(fx.ctx), TW_ERR_ABORTED);
      CHECKF(tw__now_seconds() - t0 < 0.2, "aborted rank: check and reset took %.2f s",
             tw__now_seconds() - t0);
    } else {
      const double t0 = tw__now_seconds();
      CHECK_OK(tw_moe_combine(fx.ctx, fx.dp, fx.expert_in, fx.w2, fx.out, env->stream));
      CHECK_STATUS(tw_context_check(fx.ctx), TW_ERR_ABORTED);
      const double waited = tw__now_seconds() - t0;
      CHECKF(strstr(tw_last_error(), "rank 0") != NULL &&
                 strstr(tw_last_error(), "tw_context_abort") != NULL,
             "rank %d: the detail does not name the aborting rank: %s", env->rank, tw_last_error());
      if (env->rank == 1)
        printf("  abort on rank 0: rank 1's check failed after %.2f s: %s\n", waited,
               tw_last_error());
      /* The call's device waits for rank 0 end by their timeout; the host side at once. */
      CHECKF(waited < 3.0 * TW_TEST_TIMEOUT_MS / 1000.0 + 2.0, "rank %d: check took %.2f s",
             env->rank, waited);
      const double t1 = tw__now_seconds();
      CHECK_STATUS(tw_context_reset(fx.ctx), TW_ERR_ABORTED);
      CHECKF(tw__now_seconds() - t1 < 0.5, "rank %d: reset took %.2f s", env->rank,
             tw__now_seconds() - t1);
    }
    CHECK_STATUS(tw_moe_combine(fx.ctx, fx.dp, fx.expert_in, fx.w2, fx.out, env->stream),
                 TW_ERR_STATE);
  }
  const double t1 = tw__now_seconds();
  tw_fixture_free(&fx);
  CHECKF(tw__now_seconds() - t1 < 3.0 * TW_TEST_TIMEOUT_MS / 1000.0 + 2.0,
         "rank %d: destroy took %.2f s", env->rank, tw__now_seconds() - t1);
  tw_case_team_close(env, &tenv);
}

static const tw_rank_case kCases[] = {
    {"missing_arrival_times_out_everywhere", test_missing_arrival_times_out_everywhere},
    {"missing_band_publish_times_out_everywhere", test_missing_band_publish_times_out_everywhere},
    {"dead_peer_fails_check_and_destroy_returns", test_dead_peer_fails_check_and_destroy_returns},
    {"abort_fails_peers_fast", test_abort_fails_peers_fast},
};

int main(int argc, char** argv) {
  return tw_rank_test_main(argc, argv, kCases, (int)(sizeof kCases / sizeof kCases[0]), 300);
}
