/*
 * test_baseline.cu: the sequential and chunked baselines against the double-precision reference, on
 * 2 GPUs (one forked process per rank; exit 77 with fewer).
 *
 * Each rank builds the plan's layout input from per-(token, slot) GEMM2 inputs h that are exact
 * bf16 values, so the reference sees the very numbers the GPU multiplies. The only rounding on the
 * GPU side is the bf16 GEMM output and the bf16 result, each at most 2^-9 relative, so |out - ref|
 * <= 2^-8 (mag + |ref|) holds with room for the fp32 sums; a row sent to the wrong place, a missing
 * transfer or a wrong weight breaks it by orders of magnitude. Outputs are poisoned with NaN before
 * every run.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <nccl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "baseline.h"
#include "kernels.h"
#include "plan.h"
#include "reference.h"
#include "spawn.h"
#include "tw_test.h"
#include "tw_test_random.h"

typedef struct case_cfg {
  int hidden, ffn, experts, topk, tokens;
  tw_router router;
  uint64_t seed;
} case_cfg;

static uint64_t rng_next(uint64_t* s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* Uniform in [-scale, scale), rounded to the nearest bf16 (returned as float and as bits). */
static float rng_bf16(uint64_t* s, float scale, uint16_t* bits) {
  const float u = (float)(rng_next(s) >> 40) * (1.0f / 16777216.0f);
  *bits = tw__ref_f32_to_bf16((2.f * u - 1.f) * scale);
  return tw__ref_bf16_to_f32(*bits);
}

#define RANK_CHECK(cond, ...)                                                                     \
  do {                                                                                            \
    if (!(cond)) {                                                                                \
      fprintf(stderr, "  rank %d: CHECK failed at %s:%d: %s: ", rank, __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                                               \
      fprintf(stderr, "\n");                                                                      \
      failures++;                                                                                 \
    }                                                                                             \
  } while (0)

/* Compares a device (tokens, H) bf16 output with the reference; returns the mismatch count. */
static int compare(int rank, const char* what, const void* dout, const double* ref,
                   const double* mag, int64_t n) {
  uint16_t* h = (uint16_t*)malloc(sizeof(uint16_t) * (size_t)(n ? n : 1));
  int bad = 0;
  if (cudaMemcpy(h, dout, sizeof(uint16_t) * (size_t)n, cudaMemcpyDeviceToHost) != cudaSuccess) {
    fprintf(stderr, "  rank %d: %s: copy back failed\n", rank, what);
    free(h);
    return 1;
  }
  for (int64_t i = 0; i < n; i++) {
    const double v = tw__ref_bf16_to_f32(h[i]);
    const double tol = ldexp(mag[i] + fabs(ref[i]), -8) + 1e-6;
    if (!(fabs(v - ref[i]) <= tol)) {
      if (bad < 5)
        fprintf(stderr, "  rank %d: %s: element %lld = %.6g, reference %.6g (tol %.3g)\n", rank,
                what, (long long)i, v, ref[i], tol);
      bad++;
    }
  }
  free(h);
  return bad;
}

static int rank_body(int rank, int world, const ncclUniqueId* id, void* arg) {
  const case_cfg* cfg = (const case_cfg*)arg;
  int failures = 0;
  tw_problem p =
      tw_test_problem(world, cfg->hidden, cfg->ffn, cfg->experts, cfg->topk, cfg->tokens, 0, 0);
  tw_routing_t routing = NULL;
  if (tw_routing_generate(&p, cfg->router, 0.0, cfg->tokens, cfg->seed, &routing) != TW_SUCCESS) {
    fprintf(stderr, "rank %d: routing: %s\n", rank, tw_last_error());
    return 1;
  }
  tw_plan_t* plans = (tw_plan_t*)calloc((size_t)world, sizeof(tw_plan_t));
  for (int r = 0; r < world; r++)
    if (tw_plan_create(&p, routing, r, NULL, &plans[r]) != TW_SUCCESS) {
      fprintf(stderr, "rank %d: plan %d: %s\n", rank, r, tw_last_error());
      return 1;
    }
  const struct tw_plan* mine = plans[rank];
  const int H = p.hidden, F = p.ffn, K = p.top_k, E = mine->local_experts;

  /* Inputs on every rank from one seed: h for every (owner, token, slot), w2 for every expert. */
  uint64_t s = cfg->seed * 7919u + 17u;
  float** h = (float**)calloc((size_t)world, sizeof(float*));
  uint16_t** hb = (uint16_t**)calloc((size_t)world, sizeof(uint16_t*));
  for (int o = 0; o < world; o++) {
    const size_t n = (size_t)routing->tokens[o] * K * F;
    h[o] = (float*)malloc(sizeof(float) * (n ? n : 1));
    hb[o] = (uint16_t*)malloc(sizeof(uint16_t) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) h[o][i] = rng_bf16(&s, 1.0f, &hb[o][i]);
  }
  const size_t wn = (size_t)p.experts * H * F;
  float* w2 = (float*)malloc(sizeof(float) * wn);
  uint16_t* w2b = (uint16_t*)malloc(sizeof(uint16_t) * wn);
  for (size_t i = 0; i < wn; i++) w2[i] = rng_bf16(&s, 1.0f / sqrtf((float)F), &w2b[i]);

  /* This rank's GEMM input in the plan's layout; padding rows get a non-zero value that must never
   * reach an output. */
  uint16_t* a = (uint16_t*)malloc(sizeof(uint16_t) * (size_t)mine->rows * F);
  for (int32_t r = 0; r < mine->rows; r++) {
    const tw_row_src* src = &mine->row_src[r];
    for (int f = 0; f < F; f++)
      a[(size_t)r * F + f] = src->owner < 0
                                 ? tw__ref_f32_to_bf16(1000.f)
                                 : hb[src->owner][((size_t)src->token * K + src->slot) * F + f];
  }

  /* Reference for this rank's tokens. */
  double** ref = (double**)calloc((size_t)world, sizeof(double*));
  double** mag = (double**)calloc((size_t)world, sizeof(double*));
  for (int o = 0; o < world; o++) {
    ref[o] = (double*)calloc((size_t)routing->tokens[o] * H + 1, sizeof(double));
    mag[o] = (double*)calloc((size_t)routing->tokens[o] * H + 1, sizeof(double));
  }
  if (tw__ref_gemm2_combine(routing, (const float* const*)h, w2, ref, mag) != TW_SUCCESS) {
    fprintf(stderr, "rank %d: reference: %s\n", rank, tw_last_error());
    return 1;
  }

  ncclComm_t comm;
  if (ncclCommInitRank(&comm, world, *id, rank) != ncclSuccess) return 1;
  cudaStream_t st;
  cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  void *da = NULL, *dw = NULL, *dout = NULL;
  const int32_t tokens = routing->tokens[rank];
  const int64_t nout = (int64_t)tokens * H;
  cudaMalloc(&da, sizeof(uint16_t) * (size_t)mine->rows * F + 16);
  cudaMalloc(&dw, sizeof(uint16_t) * (size_t)E * H * F);
  cudaMalloc(&dout, sizeof(uint16_t) * (size_t)nout + 16);
  cudaMemcpy(da, a, sizeof(uint16_t) * (size_t)mine->rows * F, cudaMemcpyHostToDevice);
  /* Local experts of this rank are global experts rank*E .. rank*E + E - 1. */
  cudaMemcpy(dw, w2b + (size_t)rank * E * H * F, sizeof(uint16_t) * (size_t)E * H * F,
             cudaMemcpyHostToDevice);

  tw_baseline_t b = NULL;
  tw_status status =
      tw__baseline_create((const struct tw_plan* const*)plans, world, rank, routing, comm, &b);
  RANK_CHECK(status == TW_SUCCESS, "tw__baseline_create: %s", tw_last_error());
  int32_t* fence = NULL;
  cudaMalloc((void**)&fence, 64);
  cudaMemset(fence, 0, 64);
  if (b) {
    /* 0: sequential, -1: with the grouped GEMM, -2: with the packed exchange, > 0: chunked with
     * that many rows per chunk. */
    const int32_t chunks[] = {0, -1, -2, 128, 256, 1 << 20};
    for (int c = 0; c < 6; c++) {
      tw__fill_bf16(dout, (size_t)nout, 0x7FC1u, st);
      /* Ranks start together, as the baselines' contract requires between calls. */
      ncclAllReduce(fence, fence + 1, 1, ncclInt32, ncclSum, comm, st);
      status = chunks[c] == 0    ? tw__baseline_sequential(b, da, dw, dout, st)
               : chunks[c] == -1 ? tw__baseline_sequential_grouped(b, da, dw, dout, st)
               : chunks[c] == -2 ? tw__baseline_sequential_packed(b, da, dw, dout, st)
                                 : tw__baseline_chunked(b, da, dw, dout, chunks[c], st);
      RANK_CHECK(status == TW_SUCCESS, "run %d: %s", c, tw_last_error());
      RANK_CHECK(cudaStreamSynchronize(st) == cudaSuccess, "run %d: stream failed", c);
      char what[64];
      snprintf(what, sizeof what,
               chunks[c] == 0    ? "sequential"
               : chunks[c] == -1 ? "sequential grouped"
               : chunks[c] == -2 ? "sequential packed"
                                 : "chunked %d",
               chunks[c]);
      const int bad = compare(rank, what, dout, ref[rank], mag[rank], nout);
      RANK_CHECK(bad == 0, "%s: %d of %lld elements off", what, bad, (long long)nout);
    }
    /* The comparison helper: identical buffers give 0; one changed element gives its share. */
    double rel = -1;
    uint32_t* scratch = NULL;
    cudaMalloc((void**)&scratch, 16);
    status = tw__baseline_rel_diff(dout, dout, (size_t)nout, scratch, st, &rel);
    RANK_CHECK(status == TW_SUCCESS && rel == 0.0, "rel_diff(x, x) = %g", rel);
    if (nout > 0) {
      uint16_t* hx = (uint16_t*)malloc(sizeof(uint16_t) * (size_t)nout);
      void* dx = NULL;
      cudaMalloc(&dx, sizeof(uint16_t) * (size_t)nout);
      cudaMemcpy(hx, dout, sizeof(uint16_t) * (size_t)nout, cudaMemcpyDeviceToHost);
      double maxabs = 0;
      for (int64_t i = 0; i < nout; i++)
        maxabs = fmax(maxabs, fabs((double)tw__ref_bf16_to_f32(hx[i])));
      /* Move the middle element by about half the largest magnitude. */
      const int64_t mid = nout / 2;
      const float old = tw__ref_bf16_to_f32(hx[mid]);
      hx[mid] = tw__ref_f32_to_bf16(old + (float)(0.5 * maxabs));
      const double expect = fabs((double)tw__ref_bf16_to_f32(hx[mid]) - old) / maxabs;
      cudaMemcpy(dx, hx, sizeof(uint16_t) * (size_t)nout, cudaMemcpyHostToDevice);
      status = tw__baseline_rel_diff(dx, dout, (size_t)nout, scratch, st, &rel);
      RANK_CHECK(status == TW_SUCCESS && fabs(rel - expect) <= 1e-6 * expect,
                 "rel_diff with one changed element = %g, expected %g", rel, expect);
      hx[mid] = 0x7FC1u; /* NaN */
      cudaMemcpy(dx, hx, sizeof(uint16_t) * (size_t)nout, cudaMemcpyHostToDevice);
      status = tw__baseline_rel_diff(dx, dout, (size_t)nout, scratch, st, &rel);
      RANK_CHECK(status == TW_SUCCESS && isinf(rel), "rel_diff with a NaN = %g, expected inf", rel);
      cudaFree(dx);
      free(hx);
    }
    tw__baseline_destroy(b);
    cudaFree(scratch);
  }
  cudaStreamSynchronize(st);
  ncclCommDestroy(comm);
  cudaFree(da), cudaFree(dw), cudaFree(dout), cudaFree(fence);
  for (int r = 0; r < world; r++) tw_plan_destroy(plans[r]);
  tw_routing_destroy(routing);
  return failures == 0 ? 0 : 1;
}

static void run_case(case_cfg cfg) {
  tw_status st = tw__spawn_local_ranks(2, rank_body, &cfg, 300);
  CHECKF(st == TW_SUCCESS, "%s: %s", tw_status_string(st), tw_last_error());
}

static void sequential_and_chunked_balanced(void) {
  run_case((case_cfg){256, 192, 8, 2, 300, TW_ROUTER_BALANCED, 11});
}

/* Skew leaves some (expert, owner) groups empty or tiny and others many bands long. */
static void sequential_and_chunked_stress_skew(void) {
  run_case((case_cfg){128, 64, 16, 4, 513, TW_ROUTER_STRESS_SKEW, 12});
}

/* Few tokens: most groups are empty, one band each at most. */
static void sequential_and_chunked_sparse(void) {
  run_case((case_cfg){64, 32, 4, 1, 5, TW_ROUTER_BALANCED, 13});
}

int main(void) {
  /* Count GPUs in a child: CUDA must stay uninitialised here for the ranks' fork. */
  const int gpus = tw__gpu_count_forked();
  if (gpus < 2) {
    printf("needs 2 GPUs, found %d: skipped\n0 passed, 0 failed\n", gpus < 0 ? 0 : gpus);
    return TW_TEST_SKIP;
  }
  static const tw_test_case cases[] = {TW_TEST(sequential_and_chunked_balanced),
                                       TW_TEST(sequential_and_chunked_stress_skew),
                                       TW_TEST(sequential_and_chunked_sparse)};
  return tw_test_run(cases, (int)(sizeof cases / sizeof cases[0]));
}
