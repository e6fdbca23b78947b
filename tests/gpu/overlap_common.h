/*
 * overlap_common.h: what the multi-rank GPU tests of GEMM2 + combine share (test_overlap.cu,
 * test_timeout.cu, test_combine_add.cu): a per-rank harness whose test verdicts are agreed on by
 * all ranks, seeded inputs that are a pure function of (owner, token, slot) and (expert, n, f) so
 * that any rank can rebuild any row on the host, plan/upload helpers and a double-precision
 * reference.
 *
 * Each binary runs its cases on one of two teams (tw_rank_test_main):
 *  - no arguments: two ranks on two GPUs, one process each (forked before any CUDA call, which
 *    is why the GPU count comes from tw__gpu_count_forked()), over NCCL; skipped with fewer GPUs;
 *  - `--in-process W`: W ranks in this process on GPU 0, one thread each, on an in-process team
 *    (tw_team_create); skipped without a GPU.
 * A case must not synchronise the whole device while a call is in flight: in-process, the other
 * ranks' calls are on the same device and may be waiting for this rank.
 */
#ifndef TW_OVERLAP_COMMON_H
#define TW_OVERLAP_COMMON_H

#include <cuda_runtime.h>
#include <nccl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
#include <math.h>

#include <pthread.h>
#include <time.h>

#include "tilewave.h"
#include "core.h"
#include "plan.h"
#include "kernels.h"
#include "runtime.h"
#include "spawn.h"
#include "team.h"
#include "tw_test_gpu.h"
#include "tw_test_random.h"

/* Host wall clock, milliseconds (monotonic). */
static inline double tw_test_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* TW_TEST_COPY=bulk or =registers: the cases that run both ways of copying (the consumer's bulk
 * and register paths) run that one only, e.g. for a sanitizer run on one path. */
static inline int tw_test_copy_wanted(int copy) {
  const char* e = getenv("TW_TEST_COPY");
  if (e == NULL || e[0] == '\0') return 1;
  if (strcmp(e, "bulk") != 0 && strcmp(e, "registers") != 0) {
    CHECKF(0, "TW_TEST_COPY=%s: bulk or registers (a typo must not skip both paths)", e);
    return 1;
  }
  return strcmp(e, copy == TW_CONSUMER_COPY_BULK ? "bulk" : "registers") == 0;
}

typedef struct tw_rank_env {
  int rank, nranks;
  ncclComm_t comm;   /* NCCL team: this rank's communicator (NULL in-process) */
  tw_team_t team;    /* in-process team the contexts are created on (NULL over NCCL) */
  tw_team_t team2;   /* in-process: a second team, for a second context per rank */
  tw__team* verdict; /* in-process: this rank's view of a second team, for the harness's sums */
  cudaStream_t stream;
  int32_t* d_flag; /* one int for agreeing on verdicts */
} tw_rank_env;

/* This rank's context on the run's team. */
static inline tw_status tw_rank_context_create(const tw_rank_env* env, const tw_problem* p,
                                               const tw_context_config* cc, tw_context_t* ctx) {
  return env->team != NULL ? tw_context_create_on_team(p, env->team, env->rank, cc, ctx)
                           : tw_context_create(p, env->comm, cc, ctx);
}

/* A second context of this rank, beside the first (an in-process team holds one context per
 * rank; a communicator holds several). */
static inline tw_status tw_rank_context_create_second(const tw_rank_env* env, const tw_problem* p,
                                                      const tw_context_config* cc,
                                                      tw_context_t* ctx) {
  return env->team2 != NULL ? tw_context_create_on_team(p, env->team2, env->rank, cc, ctx)
                            : tw_context_create(p, env->comm, cc, ctx);
}

/* A test problem for this run's world: the expert count rounded up to a multiple of the ranks
 * (the cases name counts for two ranks). */
static inline tw_problem tw_rank_problem(const tw_rank_env* env, int32_t H, int32_t F, int32_t E,
                                         int32_t K, int32_t max_tokens) {
  const int32_t W = env->nranks;
  return tw_test_problem(W, H, F, (E + W - 1) / W * W, K, max_tokens, 0, 0);
}

/* The sum over ranks of `mine`; -1 when the ranks could not agree. */
static inline int32_t tw_rank_sum(tw_rank_env* env, int32_t mine) {
  if (env->verdict != NULL) {
    int64_t v = mine;
    return tw__team_sum_i64(env->verdict, &v, 1) == TW_SUCCESS ? (int32_t)v : -1;
  }
  int32_t all = 0;
  if (cudaMemcpy(env->d_flag, &mine, 4, cudaMemcpyHostToDevice) != cudaSuccess ||
      ncclAllReduce(env->d_flag, env->d_flag, 1, ncclInt32, ncclSum, env->comm, env->stream) !=
          ncclSuccess ||
      cudaStreamSynchronize(env->stream) != cudaSuccess ||
      cudaMemcpy(&all, env->d_flag, 4, cudaMemcpyDeviceToHost) != cudaSuccess)
    return -1;
  return all;
}

typedef struct tw_rank_case {
  const char* name;
  void (*fn)(tw_rank_env* env);
} tw_rank_case;

/* Runs the cases on this rank; a case passes only if it passed on every rank (the failure
 * counts are summed with an all-reduce). Rank 0 prints the verdicts and "N passed, N failed". */
static inline int tw_rank_run_cases(tw_rank_env* env, const tw_rank_case* cases, int n) {
  int passed = 0, failed = 0, skipped = 0;
  /* TW_TEST_CASE=S runs only the cases whose name contains S (sanitizer runs at full size). */
  const char* only = getenv("TW_TEST_CASE");
  for (int i = 0; i < n; i++) {
    if (only != NULL && only[0] != '\0' && strstr(cases[i].name, only) == NULL) {
      skipped++;
      if (env->rank == 0) printf("[ SKIP ] %s (TW_TEST_CASE=%s)\n", cases[i].name, only);
      continue;
    }
    tw_test_failures_ = 0;
    if (env->rank == 0) printf("[ RUN  ] %s\n", cases[i].name);
    fflush(stdout);
    double t0 = tw__now_seconds();
    cases[i].fn(env);
    const int32_t mine = tw_test_failures_;
    int32_t all = tw_rank_sum(env, mine);
    if (all < 0) {
      fprintf(stderr, "rank %d: cannot agree on the verdict of %s\n", env->rank, cases[i].name);
      all = mine + 1;
    }
    if (all == 0) {
      passed++;
      if (env->rank == 0) printf("[  OK  ] %s (%.1f s)\n", cases[i].name, tw__now_seconds() - t0);
    } else {
      failed++;
      if (env->rank == 0)
        printf("[ FAIL ] %s (%d checks failed over all ranks)\n", cases[i].name, all);
    }
    fflush(stdout);
  }
  if (env->rank == 0)
    printf("%d passed, %d failed, %d skipped\n(%d ranks, %s)\n", passed, failed, skipped,
           env->nranks, env->team != NULL ? "in-process team on one GPU" : "NCCL, one GPU each");
  fflush(stdout);
  return failed;
}

/* Sets up NCCL for one rank and runs the cases. */
static inline int tw_rank_main(int rank, int nranks, const ncclUniqueId* id,
                               const tw_rank_case* cases, int n) {
  tw_rank_env env;
  memset(&env, 0, sizeof env);
  env.rank = rank;
  env.nranks = nranks;
  if (ncclCommInitRank(&env.comm, nranks, *id, rank) != ncclSuccess) {
    fprintf(stderr, "rank %d: ncclCommInitRank failed\n", rank);
    return TW_ERR_NCCL;
  }
  if (cudaStreamCreateWithFlags(&env.stream, cudaStreamNonBlocking) != cudaSuccess ||
      cudaMalloc((void**)&env.d_flag, 4) != cudaSuccess)
    return TW_ERR_CUDA;
  int failed = tw_rank_run_cases(&env, cases, n);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    fprintf(stderr, "rank %d: device error at exit: %s\n", rank, cudaGetErrorString(e));
    failed++;
  }
  ncclCommDestroy(env.comm);
  return failed ? TW_ERR_INTERNAL : 0;
}

/* The cases of one 2-GPU test binary, passed to every rank through the spawner. */
typedef struct tw_case_list {
  const tw_rank_case* cases;
  int n;
} tw_case_list;

static inline int tw__case_list_rank(int rank, int nranks, const ncclUniqueId* id, void* arg) {
  const tw_case_list* l = (const tw_case_list*)arg;
  return tw_rank_main(rank, nranks, id, l->cases, l->n);
}

/* A 2-GPU run: skips (exit 77) with fewer than 2 GPUs, else runs the cases on two spawned
 * ranks, each bounded by timeout_s. */
static inline int tw_two_rank_main(const tw_rank_case* cases, int n, int timeout_s) {
  const int gpus = tw__gpu_count_forked();
  if (gpus < 2) {
    printf("needs 2 GPUs, found %d: skipped\n0 passed, 0 failed\n", gpus < 0 ? 0 : gpus);
    return TW_TEST_SKIP;
  }
  tw_case_list l = {cases, n};
  tw_status st = tw__spawn_local_ranks(2, tw__case_list_rank, &l, timeout_s);
  if (st != TW_SUCCESS) {
    printf("FAILED: %s (%s)\n", tw_status_string(st), tw_last_error());
    return 1;
  }
  return 0;
}

/* ---- in-process ranks ---------------------------------------------------------------------- */

typedef struct tw_local_rank {
  tw_rank_env env;
  const tw_case_list* cases;
  int failed;
} tw_local_rank;

static inline void* tw__local_rank_thread(void* arg) {
  tw_local_rank* r = (tw_local_rank*)arg;
  tw_rank_env* env = &r->env;
  r->failed = 1;
  if (cudaSetDevice(0) != cudaSuccess ||
      cudaStreamCreateWithFlags(&env->stream, cudaStreamNonBlocking) != cudaSuccess) {
    fprintf(stderr, "rank %d: no stream on GPU 0\n", env->rank);
    return NULL;
  }
  r->failed = tw_rank_run_cases(env, r->cases->cases, r->cases->n);
  if (cudaStreamSynchronize(env->stream) != cudaSuccess) r->failed++;
  cudaStreamDestroy(env->stream);
  return NULL;
}

/* W ranks as threads of this process on GPU 0, over an in-process team. */
static inline int tw_in_process_main(const tw_rank_case* cases, int n, int world) {
  /* Every rank's streams need hardware queues of their own (tw_team_create checks); this must
   * be set before the first CUDA call of the process. */
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  if (tw_test_gpu_count() < 1) {
    printf("needs 1 GPU, found 0: skipped\n0 passed, 0 failed\n");
    return TW_TEST_SKIP;
  }
  tw_team_t team = NULL, team2 = NULL, verdicts = NULL;
  tw_status st = tw_team_create(world, 0, &team);
  if (st == TW_SUCCESS) st = tw_team_create(world, 0, &team2);
  if (st == TW_SUCCESS) st = tw_team_create(world, 0, &verdicts);
  if (st != TW_SUCCESS) {
    printf("FAILED: tw_team_create(%d): %s (%s)\n", world, tw_status_string(st), tw_last_error());
    return 1;
  }
  tw_case_list l = {cases, n};
  tw_local_rank ranks[TW_MAX_RANKS];
  pthread_t threads[TW_MAX_RANKS];
  int failed = 0;
  memset(ranks, 0, sizeof ranks);
  for (int r = 0; r < world; r++) {
    ranks[r].env.rank = r;
    ranks[r].env.nranks = world;
    ranks[r].env.team = team;
    ranks[r].env.team2 = team2;
    ranks[r].cases = &l;
    if (tw__team_local_join(verdicts, r, &ranks[r].env.verdict) != TW_SUCCESS) {
      printf("FAILED: joining the verdict team: %s\n", tw_last_error());
      return 1;
    }
  }
  for (int r = 0; r < world; r++)
    if (pthread_create(&threads[r], NULL, tw__local_rank_thread, &ranks[r]) != 0) {
      printf("FAILED: pthread_create for rank %d\n", r);
      return 1;
    }
  for (int r = 0; r < world; r++) {
    pthread_join(threads[r], NULL);
    failed += ranks[r].failed != 0;
    ranks[r].env.verdict->ops->release(ranks[r].env.verdict);
  }
  if (tw_team_destroy(team) != TW_SUCCESS || tw_team_destroy(team2) != TW_SUCCESS ||
      tw_team_destroy(verdicts) != TW_SUCCESS) {
    printf("FAILED: tw_team_destroy: %s\n", tw_last_error());
    failed++;
  }
  return failed ? 1 : 0;
}

/* A multi-rank test binary's main: no arguments, two ranks on two GPUs over NCCL; `--in-process
 * W`, W ranks on one GPU. Anything else is a usage error (exit 2). */
static inline int tw_rank_test_main(int argc, char** argv, const tw_rank_case* cases, int n,
                                    int timeout_s) {
  if (argc == 1) return tw_two_rank_main(cases, n, timeout_s);
  const int world = argc == 3 && strcmp(argv[1], "--in-process") == 0 ? atoi(argv[2]) : 0;
  if (world < 1 || world > 8) {
    fprintf(stderr, "usage: %s [--in-process W]   (W ranks on one GPU, 1..8)\n", argv[0]);
    return 2;
  }
  return tw_in_process_main(cases, n, world);
}

/* ---- seeded data ---------------------------------------------------------------------------- */

static inline uint64_t tw_mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

/* Uniform in [-1, 1), already rounded to bf16 (returned as float, exactly representable). */
static inline float tw_uniform_bf16(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  uint64_t h = tw_mix64(a * 0x9e3779b97f4a7c15ull ^ tw_mix64(b + 0x1234567ull) ^
                        tw_mix64(c * 31 + 7) ^ tw_mix64(d * 1000003ull + 11));
  float v = (float)((double)(h >> 11) / 9007199254740992.0 * 2.0 - 1.0);
  uint32_t bits;
  memcpy(&bits, &v, 4);
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  memcpy(&v, &bits, 4);
  return v;
}

static inline uint16_t tw_f2bf(float v) {
  uint32_t bits;
  memcpy(&bits, &v, 4);
  if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu)) return 0x7FC0;
  return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

static inline float tw_bf2f(uint16_t b) {
  uint32_t bits = (uint32_t)b << 16;
  float v;
  memcpy(&v, &bits, 4);
  return v;
}

/* GEMM2 input value of (owner, token, slot) at column f, for data set `salt`. */
static inline float tw_h_value(uint64_t salt, int owner, int token, int slot, int f) {
  return tw_uniform_bf16(salt, ((uint64_t)owner << 40) | ((uint64_t)token << 8) | (uint64_t)slot,
                         (uint64_t)f, 1);
}

/* w2 of global expert g at (n, f). */
static inline float tw_w2_value(uint64_t salt, int g, int n, int f) {
  return tw_uniform_bf16(salt ^ 0x5555, (uint64_t)g, (uint64_t)n, (uint64_t)f);
}

/* Token counts of iteration `it`: shrinking and growing, with empty ranks now and then. */
static inline void tw_token_counts(int it, int nranks, int max_tokens, uint64_t seed,
                                   int32_t* tokens) {
  for (int r = 0; r < nranks; r++) {
    uint64_t h = tw_mix64(seed * 131 + (uint64_t)it * 17 + (uint64_t)r);
    tokens[r] = (int32_t)(h % (uint64_t)(max_tokens + 1));
  }
  if (it == 0)
    for (int r = 0; r < nranks; r++) tokens[r] = max_tokens;
  if (it == 1) tokens[nranks - 1] = 0;
  if (it == 2) tokens[0] = 0;
  if (it == 3) tokens[0] = 1;
}

/* x[owner][t][h] of data set `salt`: the token rows a dispatch sends, bf16 in [-1, 1). */
static inline float tw_x_value(uint64_t salt, int owner, int t, int h) {
  return tw_uniform_bf16(salt, ((uint64_t)owner << 32) | (uint64_t)t, (uint64_t)h, 2);
}

/* This rank's x (values tw_x_value), expert ids (int32, or int64 through h_ids64) and weights
 * of routing rt to the device buffers x, ids and w; h_x and h_ids64 are host staging of the
 * routing's capacity. */
static inline void tw_upload_routed_inputs(tw_rank_env* env, const tw_problem* p, tw_routing_t rt,
                                           uint64_t salt, int id64, uint16_t* h_x, int64_t* h_ids64,
                                           void* x, void* ids, void* w) {
  int32_t n = 0;
  const int32_t* rank_ids = NULL;
  const float* ws = NULL;
  CHECK_OK(tw_routing_rank(rt, env->rank, &n, &rank_ids, &ws));
  const int H = p->hidden, K = p->top_k;
  for (int t = 0; t < n; t++)
    for (int h = 0; h < H; h++) h_x[(size_t)t * H + h] = tw_f2bf(tw_x_value(salt, env->rank, t, h));
  if (n == 0) return;
  CHECK_CUDA(cudaMemcpy(x, h_x, (size_t)n * H * 2, cudaMemcpyHostToDevice));
  if (id64) {
    for (int64_t i = 0; i < (int64_t)n * K; i++) h_ids64[i] = rank_ids[i];
    CHECK_CUDA(cudaMemcpy(ids, h_ids64, (size_t)n * K * 8, cudaMemcpyHostToDevice));
  } else {
    CHECK_CUDA(cudaMemcpy(ids, rank_ids, (size_t)n * K * 4, cudaMemcpyHostToDevice));
  }
  CHECK_CUDA(cudaMemcpy(w, ws, (size_t)n * K * 4, cudaMemcpyHostToDevice));
}

/* A routing whose rank r keeps the first tokens[r] tokens of a seeded generated routing. */
static inline tw_status tw_make_routing(const tw_problem* p, tw_router router,
                                        const int32_t* tokens, uint64_t seed, tw_routing_t* out) {
  tw_routing_t full = NULL;
  tw_status st = tw_routing_generate(p, router, 0.0, p->max_tokens, seed, &full);
  if (st != TW_SUCCESS) return st;
  const int32_t* ids[TW_MAX_RANKS];
  const float* ws[TW_MAX_RANKS];
  for (int r = 0; r < p->world_size; r++) {
    int32_t n = 0;
    st = tw_routing_rank(full, r, &n, &ids[r], &ws[r]);
    if (st != TW_SUCCESS) break;
  }
  if (st == TW_SUCCESS) st = tw_routing_create(p, tokens, ids, ws, out);
  tw_routing_destroy(full);
  return st;
}

/* Builds this rank's GEMM2 input ((plan rows, F) bf16, padding rows zero) on the host. */
static inline void tw_fill_expert_in(const struct tw_plan* plan, uint64_t salt, uint16_t* host) {
  const int F = plan->problem.ffn;
  for (int32_t r = 0; r < plan->rows; r++) {
    const tw_row_src* s = &plan->row_src[r];
    for (int f = 0; f < F; f++)
      host[(size_t)r * F + f] =
          s->owner < 0 ? 0 : tw_f2bf(tw_h_value(salt, s->owner, s->token, s->slot, f));
  }
}

/* (E_local, H, F) w2 of this rank's experts. */
static inline void tw_fill_w2(const tw_problem* p, int rank, uint64_t salt, uint16_t* host) {
  const int E = p->experts / p->world_size;
  for (int e = 0; e < E; e++)
    for (int n = 0; n < p->hidden; n++)
      for (int f = 0; f < p->ffn; f++)
        host[((size_t)e * p->hidden + n) * p->ffn + f] =
            tw_f2bf(tw_w2_value(salt, rank * E + e, n, f));
}

/* Reference out[t] of one token of `rank`, in double from the same bf16 inputs, with the
 * expert rows rounded to bf16 as the GEMM output is. */
static inline void tw_reference_token(const tw_problem* p, tw_routing_t rt, int rank, int t,
                                      uint64_t salt_h, uint64_t salt_w, double* out) {
  int32_t n_tok = 0;
  const int32_t* ids = NULL;
  const float* ws = NULL;
  tw_routing_rank(rt, rank, &n_tok, &ids, &ws);
  const int H = p->hidden, F = p->ffn, K = p->top_k;
  float* h = (float*)malloc(sizeof(float) * (size_t)F);
  for (int n = 0; n < H; n++) out[n] = 0.0;
  for (int j = 0; j < K; j++) {
    const int g = ids[(size_t)t * K + j];
    const double w = ws[(size_t)t * K + j];
    for (int f = 0; f < F; f++) h[f] = tw_h_value(salt_h, rank, t, j, f);
    for (int n = 0; n < H; n++) {
      double acc = 0.0;
      for (int f = 0; f < F; f++) acc += (double)h[f] * (double)tw_w2_value(salt_w, g, n, f);
      out[n] += w * (double)tw_bf2f(tw_f2bf((float)acc));
    }
  }
  free(h);
}

#endif /* TW_OVERLAP_COMMON_H */
