/*
 * bench_gemm1.cu: `tilewave bench gemm1`, GEMM1 + SwiGLU (tw__gemm1_swiglu_launch) against
 * cuBLAS on one GPU.
 *
 * Per shape (rows of one rank, hidden H, expert FFN F, local experts E; rows split evenly over the
 * experts, back to back), on the same inputs: ours fused; ours unfused (our GEMM with N = 2F to
 * bf16, then the SwiGLU kernel); cuBLAS per expert in a loop (cublasGemmEx, N = 2F, bf16 out) +
 * SwiGLU; cublasGemmGroupedBatchedEx + SwiGLU; one cuBLAS GEMM over all rows against one weight
 * matrix + SwiGLU (the envelope: it reads one expert's weights, not E). The SwiGLU kernel is
 * harness/swiglu.cu's (vLLM's silu_and_mul in effect). Times are medians of --iters CUDA-event
 * timed reps after --warmup, the calls interleaved rep by rep with a rotating start (as in `bench
 * gemm`); TFLOP/s count 2 x rows x 2F x H. The roofline is max(FLOPs / the dense rate, the E
 * experts' w13 bytes / the HBM read rate); "ours / roofline" is roofline time / our time. Every
 * shape's fused output is checked against cuBLAS loop + SwiGLU (bf16 intermediate, so within a
 * few bf16 ulps) in a "#wrong" column.
 */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "baseline.h"
#include "bench_common.h"
#include "bench_gemm_common.h"
#include "cli.h"
#include "cli_args.h"
#include "core.h"
#include "kernels.h"
#include "plan.h"
#include "progress.h"
#include "swiglu.h"

namespace {

enum Call { kOurs, kOursUnfused, kLoop, kGrouped, kConcat, kNumCalls };

struct Gemm1Opts {
  int rows = 0, hidden = 0, ffn = 0, experts = 0; /* one shape; 0 = the model grid */
  const char* model = nullptr;
  int tm = 128; /* band height: 128 or 64 (GEMM1's 64 x 128 tiles) */
  int grid = 0, variant = 0;
  int reps = 20, warmup = 3, delay_us = 0, check = 1;
  double dense_tflops = 793.0; /* HARDWARE.md: cuBLAS bf16 8192^3 on one H200 */
  double hbm_gbps = 4100.0;    /* HARDWARE.md: weight streaming of a memory-bound grouped GEMM */
};

struct Gemm1Shape {
  const char* model;
  int rows, hidden, ffn, experts;
};

/* The target models with their expert widths (hidden, F, routed experts, top-k) and the local
 * experts of one rank at the usual expert-parallel width; rows = tokens x top-k / ranks at two
 * batch sizes. `tilewave plan --model` knows qwen1.5-moe-a2.7b (src/plan/problem.c); the other
 * two are the published configs (Mixtral-8x7B: 4096 / 14336 / 8 / top-2; DeepSeek-V3: 7168 /
 * 2048 / 256 routed / top-8). */
struct Gemm1Model {
  const char* name;
  int hidden, ffn, local_experts, rows[3]; /* 0: none */
};
const Gemm1Model kModels[] = {
    {"qwen1.5-moe-a2.7b", 2048, 1408, 30, {8192, 32768, 0}}, /* EP 2: 60 experts, top-4 */
    {"mixtral-8x7b", 4096, 14336, 4, {4096, 16384, 0}},      /* EP 2: 8 experts, top-2 */
    /* EP 8: 256 experts, top-8; 512 rows: 16 an expert, decode-like, weight-bound */
    {"deepseek-v3", 7168, 2048, 32, {512, 4096, 16384}},
};

#define G1_CUDA(expr)                                                                 \
  do {                                                                                \
    cudaError_t e_ = (expr);                                                          \
    if (e_ != cudaSuccess) {                                                          \
      fprintf(stderr, "bench gemm1: %s failed: %s\n", #expr, cudaGetErrorString(e_)); \
      return -1;                                                                      \
    }                                                                                 \
  } while (0)

/* Counts elements of x that differ from y by more than (|x| + |y|) / 64 + abs_tol: a few bf16
 * ulps, since y rounds gate and up to bf16 before SwiGLU and x does not. */
__global__ void g1_compare(const __nv_bfloat16* x, const __nv_bfloat16* y, size_t n, float abs_tol,
                           unsigned long long* wrong) {
  unsigned long long local = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const float a = __bfloat162float(x[i]), b = __bfloat162float(y[i]);
    if (!(fabsf(a - b) <= (fabsf(a) + fabsf(b)) * (1.0f / 64) + abs_tol)) local++;
  }
  if (local) atomicAdd(wrong, local);
}

int bench_shape(const Gemm1Shape& sh, const Gemm1Opts& o, cublasHandle_t hd, cudaStream_t s) {
  const int E = sh.experts, H = sh.hidden, F = sh.ffn, F2 = 2 * sh.ffn;
  /* Even layout: expert e gets rows / E rows (the first rows % E one more), back to back. */
  std::vector<int> m(E), row0(E);
  std::vector<tw_band> bands;
  for (int e = 0, r = 0; e < E; e++) {
    m[e] = sh.rows / E + (e < sh.rows % E);
    row0[e] = r;
    r += m[e];
    for (int i = 0; i < m[e]; i += o.tm) {
      tw_band b;
      memset(&b, 0, sizeof b);
      b.expert = e;
      b.row0 = row0[e] + i;
      b.rows = std::min(o.tm, m[e] - i);
      bands.push_back(b);
    }
  }
  const int nb = (int)bands.size();
  int group = 1;
  if (tw__tile_group_resolve(&group) != TW_SUCCESS) {
    fprintf(stderr, "bench gemm1: %s\n", tw_last_error());
    return -1;
  }
  /* Fused: 128 output columns a tile; unfused (ours): 256 of the 2F columns. */
  const int cols = (F + TW_GEMM1_TN - 1) / TW_GEMM1_TN, cols2 = (F2 + 255) / 256;
  std::vector<tw_tile> tiles((size_t)nb * cols), tiles2((size_t)nb * cols2);
  tw__tiles_from_bands(bands.data(), nb, cols, TW_GEMM1_TN, group, nb - 1, tiles.data());
  tw__tiles_from_bands(bands.data(), nb, cols2, 256, group, nb - 1, tiles2.data());

  const size_t a_elems = (size_t)sh.rows * H, w_elems = (size_t)E * F2 * H;
  const size_t h_elems = (size_t)sh.rows * F, gu_elems = (size_t)sh.rows * F2;
  __nv_bfloat16 *A = nullptr, *W = nullptr, *Hout = nullptr, *Href = nullptr, *GU = nullptr;
  tw_tile *dtiles = nullptr, *dtiles2 = nullptr;
  unsigned long long* wrong = nullptr;
  void** ptrs = nullptr;
  G1_CUDA(cudaMalloc(&A, a_elems * 2));
  G1_CUDA(cudaMalloc(&W, w_elems * 2));
  G1_CUDA(cudaMalloc(&Hout, h_elems * 2));
  G1_CUDA(cudaMalloc(&Href, h_elems * 2));
  G1_CUDA(cudaMalloc(&GU, gu_elems * 2));
  G1_CUDA(cudaMalloc(&dtiles, tiles.size() * sizeof(tw_tile)));
  G1_CUDA(cudaMalloc(&dtiles2, tiles2.size() * sizeof(tw_tile)));
  G1_CUDA(cudaMalloc(&wrong, 8));
  G1_CUDA(cudaMalloc(&ptrs, 3 * (size_t)E * sizeof(void*)));
  G1_CUDA(cudaMemcpy(dtiles, tiles.data(), tiles.size() * sizeof(tw_tile), cudaMemcpyHostToDevice));
  G1_CUDA(
      cudaMemcpy(dtiles2, tiles2.data(), tiles2.size() * sizeof(tw_tile), cudaMemcpyHostToDevice));
  /* Activations in [-1, 1), weights scaled by 2 / sqrt(H): projections of order 1, where silu is
   * neither linear nor zero. */
  if (tw__baseline_fill_random(A, a_elems, 1234, 1.f, s) != TW_SUCCESS ||
      tw__baseline_fill_random(W, w_elems, 98765, 2.f / sqrtf((float)H), s) != TW_SUCCESS) {
    fprintf(stderr, "bench gemm1: %s\n", tw_last_error());
    return -1;
  }

  tw_gemm1_args g;
  tw__gemm1_args_init(&g, A, W, Hout, sh.rows, H, F, E, dtiles, (int)tiles.size(), o.tm);
  g.grid = o.grid;
  g.variant = o.variant;
  tw_gemm_args g2;
  const tw_gemm_shape gs2 = {sh.rows, H, F2, E, 128, 256};
  if (tw__gemm_args_init(&g2, &gs2, A, W, GU, dtiles2, (int)tiles2.size(), o.grid, TW_SIGNAL_NONE,
                         nullptr) != TW_SUCCESS) {
    fprintf(stderr, "bench gemm1: %s\n", tw_last_error());
    return -1;
  }
  auto swiglu = [&](__nv_bfloat16* out) -> int {
    return tw__swiglu_launch(GU, 0, out, sh.rows, F, s) == TW_SUCCESS ? 0 : -1;
  };
  const float one = 1.f, zero = 0.f;
  auto ours = [&]() -> int { return tw__gemm1_swiglu_launch(&g, s) == TW_SUCCESS ? 0 : -1; };
  auto ours_unfused = [&]() -> int {
    return tw__gemm_launch(&g2, s) == TW_SUCCESS ? swiglu(Hout) : -1;
  };
  /* Row-major (m_e, 2F) = A_e W13_e^T is column-major (2F, m_e) = W13_e^T' A_e^T'. */
  auto loop_into = [&](__nv_bfloat16* out) -> int {
    for (int e = 0; e < E; e++) {
      if (m[e] == 0) continue;
      if (cublasGemmEx(hd, CUBLAS_OP_T, CUBLAS_OP_N, F2, m[e], H, &one, W + (size_t)e * F2 * H,
                       CUDA_R_16BF, H, A + (size_t)row0[e] * H, CUDA_R_16BF, H, &zero,
                       GU + (size_t)row0[e] * F2, CUDA_R_16BF, F2, CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS)
        return -1;
    }
    return swiglu(out);
  };
  auto loop = [&]() -> int { return loop_into(Hout); };
  std::vector<cublasOperation_t> ta, tb;
  std::vector<int> gm, gn, gk, lda, ldb, ldc, gsize;
  std::vector<float> alphas, betas;
  std::vector<void*> hp;
  for (int e = 0; e < E; e++) {
    if (m[e] == 0) continue;
    ta.push_back(CUBLAS_OP_T);
    tb.push_back(CUBLAS_OP_N);
    gm.push_back(F2);
    gn.push_back(m[e]);
    gk.push_back(H);
    lda.push_back(H);
    ldb.push_back(H);
    ldc.push_back(F2);
    gsize.push_back(1);
    alphas.push_back(1.f);
    betas.push_back(0.f);
  }
  const int groups = (int)gm.size();
  for (int e = 0; e < E; e++)
    if (m[e]) hp.push_back(W + (size_t)e * F2 * H);
  for (int e = 0; e < E; e++)
    if (m[e]) hp.push_back(A + (size_t)row0[e] * H);
  for (int e = 0; e < E; e++)
    if (m[e]) hp.push_back(GU + (size_t)row0[e] * F2);
  G1_CUDA(cudaMemcpy(ptrs, hp.data(), hp.size() * sizeof(void*), cudaMemcpyHostToDevice));
  auto grouped = [&]() -> int {
    if (cublasGemmGroupedBatchedEx(
            hd, ta.data(), tb.data(), gm.data(), gn.data(), gk.data(), alphas.data(),
            (const void* const*)ptrs, CUDA_R_16BF, lda.data(), (const void* const*)(ptrs + groups),
            CUDA_R_16BF, ldb.data(), betas.data(), (void* const*)(ptrs + 2 * groups), CUDA_R_16BF,
            ldc.data(), groups, gsize.data(), CUBLAS_COMPUTE_32F) != CUBLAS_STATUS_SUCCESS)
      return -1;
    return swiglu(Hout);
  };
  auto concat = [&]() -> int {
    if (cublasGemmEx(hd, CUBLAS_OP_T, CUBLAS_OP_N, F2, sh.rows, H, &one, W, CUDA_R_16BF, H, A,
                     CUDA_R_16BF, H, &zero, GU, CUDA_R_16BF, F2, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS)
      return -1;
    return swiglu(Hout);
  };

  /* Correctness of this configuration: ours fused against cuBLAS loop + SwiGLU, over an output
   * first filled with a large finite value (bf16 0x7f7f), so that an unwritten row counts. */
  unsigned long long nwrong = 0;
  if (o.check) {
    G1_CUDA(cudaMemsetAsync(Hout, 0x7f, h_elems * 2, s));
    if (loop_into(Href) != 0 || ours() != 0) {
      fprintf(stderr, "bench gemm1: reference or kernel failed: %s\n", tw_last_error());
      return -1;
    }
    G1_CUDA(cudaMemsetAsync(wrong, 0, 8, s));
    g1_compare<<<1024, 256, 0, s>>>(Hout, Href, h_elems, 1e-3f, wrong);
    G1_CUDA(cudaMemcpyAsync(&nwrong, wrong, 8, cudaMemcpyDeviceToHost, s));
    G1_CUDA(cudaStreamSynchronize(s));
  }
  const std::vector<std::function<int()>> fns = {ours, ours_unfused, loop, grouped, concat};
  std::vector<double> us;
  if (!twb_time_interleaved(fns, o.warmup, o.reps, o.delay_us, s, us)) {
    fprintf(stderr, "bench gemm1: a timed call failed: %s\n", tw_last_error());
    return -1;
  }
  G1_CUDA(cudaStreamSynchronize(s));

  const double flop = 2.0 * sh.rows * (double)F2 * H;
  const double wbytes = (double)w_elems * 2;
  const double t_flop = flop / (o.dense_tflops * 1e6), t_mem = wbytes / (o.hbm_gbps * 1e3);
  const double roof = std::max(t_flop, t_mem);
  char cell[kNumCalls][32];
  for (int c = 0; c < kNumCalls; c++)
    snprintf(cell[c], sizeof cell[c], "%8.1f %4.0f", us[c], flop / us[c] * 1e-6);
  const double best_cublas = std::min(us[kLoop], us[kGrouped]);
  char wrong_s[24];
  snprintf(wrong_s, sizeof wrong_s, o.check ? "%llu" : "-", nwrong);
  printf(
      "| %s | %5d | %4d | %5d | %3d | %s | %s | %s | %s | %s | %7.1f %s | %4.2f | %4.2f | %s |\n",
      sh.model, sh.rows, H, F, E, cell[kOurs], cell[kOursUnfused], cell[kLoop], cell[kGrouped],
      cell[kConcat], roof, t_flop >= t_mem ? "flop" : "mem", roof / us[kOurs],
      best_cublas / us[kOurs], wrong_s);
  fflush(stdout);
  cudaFree(A);
  cudaFree(W);
  cudaFree(Hout);
  cudaFree(Href);
  cudaFree(GU);
  cudaFree(dtiles);
  cudaFree(dtiles2);
  cudaFree(wrong);
  cudaFree(ptrs);
  return nwrong == 0 ? 0 : 1;
}

void usage(FILE* f) {
  fprintf(f,
          "usage: tilewave bench gemm1 [--model NAME | --rows R --hidden H --ffn F --experts E]\n"
          "                            [--tile-m 128] [--grid P] [--variant V] [--iters 20]\n"
          "                            [--warmup 3] [--delay-us 0] [--no-check]\n"
          "                            [--dense-tflops 793] [--hbm-gbps 4100]\n"
          "GEMM1 + SwiGLU of R rows: h (R, F) = silu(a w_gate^T) * (a w_up^T), w13 (E, 2F, H)\n"
          "gate rows first; the rows split evenly over the E experts, in bands of --tile-m\n"
          "rows (64: the 64 x 128 tiles). Without a shape, the models qwen1.5-moe-a2.7b\n"
          "(H 2048, F 1408, 30 local experts; rows 8192, 32768), mixtral-8x7b (4096, 14336, 4;\n"
          "4096, 16384) and deepseek-v3 (7168, 2048, 32; 512, 4096, 16384); --model NAME runs\n"
          "one of them. Columns: ours fused; ours unfused (our GEMM N = 2F to bf16, then the\n"
          "SwiGLU kernel); cuBLAS per-expert loop, grouped, and one GEMM over all rows against\n"
          "one expert's weights (the envelope), each + SwiGLU; roofline = max(FLOPs / dense\n"
          "rate, E x 2F x H x 2 weight bytes / HBM rate) and which bound it is; roofline / ours;\n"
          "the faster of cuBLAS loop and grouped / ours; #wrong (ours vs cuBLAS loop + SwiGLU).\n"
          "--variant V: producer version (default env TW_GEMM_VARIANT, else 0, the library's).\n");
}

void usage_cb(FILE* f, void*) {
  usage(f);
}

}  // namespace

extern "C" int tw_cli_bench_gemm1(int argc, char** argv) {
  Gemm1Opts o;
  int32_t variant = 0;
  if (tw__tunable_int("bench gemm1", TW_TUNE_GEMM_VARIANT, &variant) != TW_SUCCESS) {
    fprintf(stderr, "%s\n", tw_last_error());
    return 2;
  }
  o.variant = variant;
  int no_check = 0;
  tw_cli_arg args[] = {
      tw__cli_int("--rows", &o.rows, 1, TW_CLI_TOKENS_MAX),
      tw__cli_hidden(&o.hidden),
      tw__cli_ffn(&o.ffn),
      tw__cli_experts(&o.experts),
      tw__cli_string("--model", &o.model),
      tw__cli_int("--grid", &o.grid, 0, 1 << 16),
      tw__cli_alias(tw__cli_tile_m(&o.tm), "--tm"),
      tw__cli_int("--variant", &o.variant, 0, 5),
      tw__cli_alias(tw__cli_iters(&o.reps), "--reps"),
      tw__cli_warmup(&o.warmup),
      tw__cli_delay_us(&o.delay_us),
      tw__cli_bool("--no-check", &no_check),
      tw__cli_double("--dense-tflops", &o.dense_tflops, 0.0, 1e6, 1),
      tw__cli_double("--hbm-gbps", &o.hbm_gbps, 0.0, 1e6, 1),
  };
  const int rc_args = tw__cli_parse("tilewave bench gemm1", argc, argv, args,
                                    (int)(sizeof args / sizeof args[0]), usage_cb, nullptr);
  if (rc_args != 0) return rc_args == 1 ? 0 : rc_args;
  if (no_check) o.check = 0;
  if (o.tm != 64 && o.tm != 128)
    return tw__cli_usage_error("tilewave bench gemm1", "--tile-m must be 64 or 128");
  std::vector<Gemm1Shape> shapes;
  if (o.rows || o.hidden || o.ffn || o.experts) {
    if (o.rows <= 0 || o.hidden <= 0 || o.ffn <= 0 || o.experts <= 0 || o.model != nullptr)
      return tw__cli_usage_error("tilewave bench gemm1",
                                 "one shape needs all of --rows, --hidden, --ffn and --experts "
                                 "(and no --model)");
    shapes.push_back({"-", o.rows, o.hidden, o.ffn, o.experts});
  } else {
    for (const Gemm1Model& md : kModels) {
      if (o.model != nullptr && strcmp(o.model, md.name) != 0) continue;
      for (int rows : md.rows)
        if (rows > 0) shapes.push_back({md.name, rows, md.hidden, md.ffn, md.local_experts});
    }
    if (shapes.empty())
      return tw__cli_usage_error("tilewave bench gemm1",
                                 "unknown --model; use qwen1.5-moe-a2.7b, mixtral-8x7b or "
                                 "deepseek-v3");
  }
  cudaDeviceProp prop;
  cublasHandle_t hd;
  cudaStream_t s;
  if (twb_cublas_setup("bench gemm1", &prop, &s, &hd) != 0) return 1;
  printf(
      "# bench gemm1 on %s (%d SMs), grid %d, variant %d, tm %d, even layout, median of %d reps, "
      "%d us idle before each call; roofline at %.0f TFLOP/s and %.0f GB/s\n",
      prop.name, prop.multiProcessorCount, o.grid, o.variant, o.tm, o.reps, o.delay_us,
      o.dense_tflops, o.hbm_gbps);
  printf(
      "| model | rows | H | F | E | ours us TF/s | ours unfused us TF/s | cuBLAS loop+SwiGLU us "
      "TF/s | cuBLAS grouped+SwiGLU us TF/s | cuBLAS concat+SwiGLU us TF/s | roofline us, bound | "
      "roofline/ours | best cuBLAS/ours | #wrong |\n");
  printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  int rc = 0;
  twb_progress pr;
  twb_progress_begin(&pr, "bench gemm1", "shape", (int)shapes.size());
  for (size_t i = 0; i < shapes.size(); i++) {
    const Gemm1Shape& sh = shapes[i];
    twb_progress_start(&pr, (int)i, "%s rows %d H %d F %d E %d", sh.model, sh.rows, sh.hidden,
                       sh.ffn, sh.experts);
    const int r = bench_shape(sh, o, hd, s);
    if (r < 0) {
      rc = 1;
      (void)cudaGetLastError();
    }
    if (r > 0) rc = 1;
  }
  cublasDestroy(hd);
  cudaStreamDestroy(s);
  return rc;
}
