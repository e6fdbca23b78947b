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
 * consumer copies (bulk and registers). Exits 77 with fewer than 2 GPUs (or, with
 * --in-process W, without a GPU).
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

static const tw_rank_case kCases[] = {
    {"missing_arrival_times_out_everywhere", test_missing_arrival_times_out_everywhere},
    {"missing_band_publish_times_out_everywhere", test_missing_band_publish_times_out_everywhere},
};

int main(int argc, char** argv) {
  return tw_rank_test_main(argc, argv, kCases, (int)(sizeof kCases / sizeof kCases[0]), 300);
}
