/*
 * bench_gemm.cu: `tilewave bench gemm`, the producer GEMM against cuBLAS on one GPU.
 *
 * Per shape (rows per rank, K, N, local experts E, balanced routing), in the same process and on
 * the same inputs: our grouped GEMM with band signals on and off; cuBLAS per expert in a loop
 * (cublasGemmEx); cublasGemmGroupedBatchedEx; and one cuBLAS GEMM over all rows concatenated
 * against a single weight matrix (the envelope a grouped GEMM can at best reach). Times are the
 * median of --reps CUDA-event timed runs after --warmup runs; TFLOP/s count 2 x rows x N x K.
 * Every run's output is checked against the cuBLAS per-expert output (a "#wrong" column, as
 * nccl-tests does), so a fast wrong kernel cannot pass unnoticed. The roofline of a grouped GEMM
 * is max(its FLOPs at the concatenated GEMM's measured rate, which is the concat call's time,
 * and the bytes it must move: every expert's weights, the inputs and the outputs, at the device
 * read rate --hbm-gbps), not the concatenated GEMM alone: that one reads one weight matrix.
 */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "bench_common.h"
#include "bench_gemm_common.h"
#include "cli.h"
#include "cli_args.h"
#include "core.h"
#include "kernels.h"
#include "plan.h"
#include "progress.h"

namespace {

/* The five timed calls, in the order they run within a rep and print in a row. */
enum Call { kOurs, kOursSignals, kLoop, kGrouped, kConcat, kNumCalls };
static const char* const kCallNames[kNumCalls] = {"ours", "signals", "loop", "grouped", "concat"};
static const unsigned kAllCalls = (1u << kNumCalls) - 1;

struct BenchOpts {
  int rows = 0, k = 0, n = 0, experts = 0; /* one shape; 0 = the default grid */
  int tm = 128, tn = 0; /* tn 0: the planner's choice (256 for N >= 2048, else 128); with
                           --even: 256 where n % 256 == 0, else 128 */
  int grid = 0;
  int variant = 0;
  int reps = 20, warmup = 3;
  int delay_us = 0; /* device idle (a one-thread spin) before each timed call, outside its time */
  int check = 1;
  int plan = 1;    /* 1: the planner's layout (2 ranks, balanced top-2, rank 0); 0: even split */
  int regroup = 0; /* the planned layout's rows with --even's tile order (one pass per expert) */
  unsigned only = kAllCalls; /* which of the five calls to time (--only) */
  double hbm_gbps = 4100.0;  /* HARDWARE.md: weight streaming of a memory-bound grouped GEMM */
};

struct Shape {
  int rows, k, n, experts;
};

#define BENCH_CUDA(expr)                                                             \
  do {                                                                               \
    cudaError_t e_ = (expr);                                                         \
    if (e_ != cudaSuccess) {                                                         \
      fprintf(stderr, "bench gemm: %s failed: %s\n", #expr, cudaGetErrorString(e_)); \
      return -1;                                                                     \
    }                                                                                \
  } while (0)

/* Fills n bf16 values with a cheap hash of the index, in [-1, 1): nonzero, deterministic. */
__global__ void bench_fill_random(__nv_bfloat16* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint32_t x = (uint32_t)i * 2654435761u ^ seed;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    p[i] = __float2bfloat16((float)(x & 0xFFFF) / 32768.0f - 1.0f);
  }
}

/* Counts elements of a (bf16) that differ from b by more than bf16 rounding of both plus a
 * small absolute term. */
__global__ void bench_compare(const __nv_bfloat16* a, const __nv_bfloat16* b, size_t n,
                              float abs_tol, unsigned long long* wrong) {
  unsigned long long local = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const float x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    if (!(fabsf(x - y) <= (fabsf(y) + fabsf(x)) * (1.0f / 128) + abs_tol)) local++;
  }
  if (local) atomicAdd(wrong, local);
}

/* The planner's layout and schedule for rank 0 of a 2-rank balanced top-2 routing whose rank 0
 * receives about `rows` rows: experts' rows (padding included) and the tile list. Returns false
 * (with a message) if planning fails. */
bool planned_layout(Shape& sh, int tm, int tn, std::vector<int>& m, std::vector<int>& row0,
                    std::vector<tw_tile>& tiles, int& bands, int& out_tn) {
  tw_problem prob = TW_PROBLEM_INIT;
  prob.world_size = 2;
  prob.hidden = sh.n;
  prob.ffn = sh.k;
  prob.experts = 2 * sh.experts;
  prob.top_k = 2;
  prob.max_tokens = sh.rows / 2;
  prob.tile_m = tm;
  prob.tile_n = tn;
  tw_routing_t rt = nullptr;
  tw_plan_t pl = nullptr;
  if (tw_routing_generate(&prob, TW_ROUTER_BALANCED, 0.0, sh.rows / 2, 1, &rt) != TW_SUCCESS ||
      tw_plan_create(&prob, rt, 0, nullptr, &pl) != TW_SUCCESS) {
    fprintf(stderr, "bench gemm: planning failed: %s\n", tw_last_error());
    tw_routing_destroy(rt);
    return false;
  }
  sh.rows = pl->rows;
  m.assign(pl->expert_rows, pl->expert_rows + sh.experts);
  row0.assign(pl->expert_row0, pl->expert_row0 + sh.experts);
  tiles.assign(pl->tiles, pl->tiles + pl->num_tiles);
  bands = pl->num_bands;
  out_tn = pl->tn;
  tw_plan_destroy(pl);
  tw_routing_destroy(rt);
  return true;
}

/* The layout of one shape: each expert's rows (m, row0), the tile list in execution order, the
 * band count and the tile width (tn: --tile-n, else the planner's or --even's choice); the
 * planned layout sets sh.rows (padding included). Returns false (with a message) if planning
 * fails. */
bool shape_layout(Shape& sh, const BenchOpts& o, int tm, int& tn, std::vector<int>& m,
                  std::vector<int>& row0, std::vector<tw_tile>& tiles, int& bands) {
  tn = o.tn ? o.tn : (sh.n % 256 == 0 ? 256 : 128);
  int r = 0;
  bands = 0;
  if (o.plan) {
    if (!planned_layout(sh, tm, o.tn, m, row0, tiles, bands, tn)) return false;
  }
  const int col_tiles = (sh.n + tn - 1) / tn;
  /* Even layout: expert e gets rows/E rows (the first rows % E experts one more), back to
   * back. Its tiles, and with --regroup the planned layout's, come from the planner's grouping
   * (tw__tiles_from_bands) over bands expert by expert in index order, all of one destination:
   * each expert's bands share groups, one pass over its weights. That is the planner's
   * expert-major rule without its order of experts and the lead of the last two, so --regroup
   * measures the tile order apart from the rows and --even the rows (whole bands where rows/E is
   * a multiple of tm). */
  if (!o.plan || o.regroup) {
    int group = 1;
    if (tw__tile_group_resolve(&group) != TW_SUCCESS) {
      fprintf(stderr, "bench gemm: %s\n", tw_last_error());
      return false;
    }
    std::vector<tw_band> bl;
    for (int e = 0; e < sh.experts; e++) {
      if (!o.plan) {
        m[e] = sh.rows / sh.experts + (e < sh.rows % sh.experts);
        row0[e] = r;
        r += m[e];
      }
      for (int i = 0; i < m[e]; i += tm) {
        tw_band bd;
        memset(&bd, 0, sizeof bd);
        bd.expert = e;
        bd.row0 = row0[e] + i;
        bd.rows = std::min(tm, m[e] - i);
        bl.push_back(bd);
      }
    }
    bands = (int)bl.size();
    tiles.resize(bl.size() * col_tiles);
    tw__tiles_from_bands(bl.data(), bands, col_tiles, tn, group, -1, tiles.data());
  }
  return true;
}

/* One table row: the calls' times (0: not timed), TFLOP/s, ratios and the check's count. */
void print_row(const Shape& sh, const BenchOpts& o, int tn, const double* us, double tile_rows,
               unsigned long long nwrong) {
  const double flop = 2.0 * sh.rows * (double)sh.n * sh.k;
  char cell[kNumCalls][32], vs_concat[16], vs_loop[16], wrong_s[24], roof[40], vs_roof[16];
  for (int c = 0; c < kNumCalls; c++) {
    if (c == kOursSignals && us[c] > 0 && us[kOurs] > 0)
      snprintf(cell[c], sizeof cell[c], "%7.1f %+5.1f%%", us[c],
               100.0 * (us[c] - us[kOurs]) / us[kOurs]);
    else if (c == kOursSignals)
      snprintf(cell[c], sizeof cell[c], "%14s", "-");
    else if (us[c] > 0)
      snprintf(cell[c], sizeof cell[c], "%7.1f %5.0f", us[c], flop / us[c] * 1e-6);
    else
      snprintf(cell[c], sizeof cell[c], "%13s", "-");
  }
  auto speedup = [&](char* dst, size_t len, Call base) {
    if (us[kOurs] > 0 && us[base] > 0)
      snprintf(dst, len, "%5.2f", us[base] / us[kOurs]);
    else
      snprintf(dst, len, "%5s", "-");
  };
  speedup(vs_concat, sizeof vs_concat, kConcat);
  speedup(vs_loop, sizeof vs_loop, kLoop);
  /* Roofline: needs the concat call's time (the measured dense rate on these rows). */
  const double bytes =
      2.0 * ((double)sh.experts * sh.n * sh.k + (double)sh.rows * sh.k + (double)sh.rows * sh.n);
  const double t_mem = bytes / (o.hbm_gbps * 1e3);
  if (us[kConcat] > 0) {
    const double t_roof = us[kConcat] > t_mem ? us[kConcat] : t_mem;
    snprintf(roof, sizeof roof, "%7.1f %s", t_roof, us[kConcat] > t_mem ? "flops" : "bytes");
    if (us[kOurs] > 0)
      snprintf(vs_roof, sizeof vs_roof, "%5.3f", t_roof / us[kOurs]);
    else
      snprintf(vs_roof, sizeof vs_roof, "%5s", "-");
  } else {
    snprintf(roof, sizeof roof, "%13s", "-");
    snprintf(vs_roof, sizeof vs_roof, "%5s", "-");
  }
  snprintf(wrong_s, sizeof wrong_s, o.check ? "%llu" : "-", nwrong);
  printf(
      "| %5d | %4d | %4d | %2d | %3d | %s | %s | %s | %s | %s | %s | %5.3f | %s | %s | %s | %s |\n",
      sh.rows, sh.k, sh.n, sh.experts, tn, cell[kOurs], cell[kOursSignals], cell[kLoop],
      cell[kGrouped], cell[kConcat], vs_concat, tile_rows, vs_loop, roof, vs_roof, wrong_s);
}

int bench_shape(Shape sh, const BenchOpts& o, cublasHandle_t h, cudaStream_t s) {
  const int tm = o.tm;
  int tn = 0, bands = 0;
  std::vector<int> m(sh.experts), row0(sh.experts);
  std::vector<tw_tile> tiles;
  if (!shape_layout(sh, o, tm, tn, m, row0, tiles, bands)) return -1;
  const int col_tiles = (sh.n + tn - 1) / tn;
  /* Rows the tiles compute per column over the layout's rows: at equal speed per tile, the bound
   * on ours / concat that the experts' partial last bands set. */
  const double tile_rows = (double)tiles.size() * tm / col_tiles / sh.rows;
  const size_t a_elems = (size_t)sh.rows * sh.k, b_elems = (size_t)sh.experts * sh.n * sh.k;
  const size_t c_elems = (size_t)sh.rows * sh.n;
  __nv_bfloat16 *A = nullptr, *B = nullptr, *C = nullptr, *Cref = nullptr;
  tw_tile* dtiles = nullptr;
  uint32_t* counters = nullptr;
  unsigned long long* wrong = nullptr;
  void** ptrs = nullptr; /* device pointer arrays for the grouped cuBLAS call */
  BENCH_CUDA(cudaMalloc(&A, a_elems * 2));
  BENCH_CUDA(cudaMalloc(&B, b_elems * 2));
  BENCH_CUDA(cudaMalloc(&C, c_elems * 2));
  BENCH_CUDA(cudaMalloc(&Cref, c_elems * 2));
  BENCH_CUDA(cudaMalloc(&dtiles, tiles.size() * sizeof(tw_tile)));
  BENCH_CUDA(cudaMalloc(&counters, (size_t)bands * 4));
  BENCH_CUDA(cudaMalloc(&wrong, 8));
  BENCH_CUDA(cudaMalloc(&ptrs, 3 * (size_t)sh.experts * sizeof(void*)));
  BENCH_CUDA(
      cudaMemcpy(dtiles, tiles.data(), tiles.size() * sizeof(tw_tile), cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemset(counters, 0, (size_t)bands * 4));
  bench_fill_random<<<1024, 256, 0, s>>>(A, a_elems, 1234u);
  bench_fill_random<<<1024, 256, 0, s>>>(B, b_elems, 98765u);
  BENCH_CUDA(cudaGetLastError());

  tw_gemm_args g;
  const tw_gemm_shape gs = {sh.rows, sh.k, sh.n, sh.experts, tm, tn};
  if (tw__gemm_args_init(&g, &gs, A, B, C, dtiles, (int)tiles.size(), o.grid, TW_SIGNAL_NONE,
                         nullptr) != TW_SUCCESS) {
    fprintf(stderr, "bench gemm: %s\n", tw_last_error());
    return -1;
  }
  g.variant = o.variant;
  tw_gemm_args g_sig = g;
  g_sig.scope = TW_SIGNAL_GPU;
  g_sig.band_counters = counters;

  const float one = 1.f, zero = 0.f;
  auto loop = [&]() -> int {
    for (int e = 0; e < sh.experts; e++) {
      if (m[e] == 0) continue;
      if (cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, sh.n, m[e], sh.k, &one,
                       B + (size_t)e * sh.n * sh.k, CUDA_R_16BF, sh.k, A + (size_t)row0[e] * sh.k,
                       CUDA_R_16BF, sh.k, &zero, Cref + (size_t)row0[e] * sh.n, CUDA_R_16BF, sh.n,
                       CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS)
        return -1;
    }
    return 0;
  };
  /* Grouped: one group per non-empty expert. */
  std::vector<cublasOperation_t> ta, tb;
  std::vector<int> gm, gn, gk, lda, ldb, ldc, gsize;
  std::vector<float> alphas, betas;
  std::vector<void*> hp;
  for (int e = 0; e < sh.experts; e++) {
    if (m[e] == 0) continue;
    ta.push_back(CUBLAS_OP_T);
    tb.push_back(CUBLAS_OP_N);
    gm.push_back(sh.n);
    gn.push_back(m[e]);
    gk.push_back(sh.k);
    lda.push_back(sh.k);
    ldb.push_back(sh.k);
    ldc.push_back(sh.n);
    gsize.push_back(1);
    alphas.push_back(1.f);
    betas.push_back(0.f);
  }
  const int groups = (int)gm.size();
  for (int e = 0; e < sh.experts; e++)
    if (m[e]) hp.push_back(B + (size_t)e * sh.n * sh.k);
  for (int e = 0; e < sh.experts; e++)
    if (m[e]) hp.push_back(A + (size_t)row0[e] * sh.k);
  for (int e = 0; e < sh.experts; e++)
    if (m[e]) hp.push_back(C + (size_t)row0[e] * sh.n);
  BENCH_CUDA(cudaMemcpy(ptrs, hp.data(), hp.size() * sizeof(void*), cudaMemcpyHostToDevice));
  auto grouped = [&]() -> int {
    return cublasGemmGroupedBatchedEx(h, ta.data(), tb.data(), gm.data(), gn.data(), gk.data(),
                                      alphas.data(), (const void* const*)ptrs, CUDA_R_16BF,
                                      lda.data(), (const void* const*)(ptrs + groups), CUDA_R_16BF,
                                      ldb.data(), betas.data(), (void* const*)(ptrs + 2 * groups),
                                      CUDA_R_16BF, ldc.data(), groups, gsize.data(),
                                      CUBLAS_COMPUTE_32F) == CUBLAS_STATUS_SUCCESS
               ? 0
               : -1;
  };
  auto concat = [&]() -> int {
    return cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, sh.n, sh.rows, sh.k, &one, B, CUDA_R_16BF,
                        sh.k, A, CUDA_R_16BF, sh.k, &zero, C, CUDA_R_16BF, sh.n, CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS
               ? 0
               : -1;
  };
  auto ours = [&]() -> int { return tw__gemm_launch(&g, s) == TW_SUCCESS ? 0 : -1; };
  auto ours_sig = [&]() -> int { return tw__gemm_launch(&g_sig, s) == TW_SUCCESS ? 0 : -1; };

  /* Correctness of this very configuration: ours vs the per-expert loop, over an output first
   * filled with a large finite value (bf16 0x7f7f), so that a row left unwritten counts as
   * wrong. */
  unsigned long long nwrong = 0;
  if (o.check) {
    BENCH_CUDA(cudaMemsetAsync(C, 0x7f, c_elems * 2, s));
    if (loop() != 0 || ours() != 0) {
      fprintf(stderr, "bench gemm: reference or kernel failed: %s\n", tw_last_error());
      return -1;
    }
    BENCH_CUDA(cudaMemset(wrong, 0, 8));
    bench_compare<<<1024, 256, 0, s>>>(C, Cref, c_elems, 1e-2f, wrong);
    BENCH_CUDA(cudaMemcpy(&nwrong, wrong, 8, cudaMemcpyDeviceToHost));
  }
  /* The chosen calls (all five by default) interleaved rep by rep, in Call order. */
  const std::function<int()> all[kNumCalls] = {ours, ours_sig, loop, grouped, concat};
  std::vector<std::function<int()>> fns;
  for (int c = 0; c < kNumCalls; c++)
    if (o.only >> c & 1) fns.push_back(all[c]);
  std::vector<double> timed;
  if (!twb_time_interleaved(fns, o.warmup, o.reps, o.delay_us, s, timed)) {
    fprintf(stderr, "bench gemm: a timed call failed: %s\n", tw_last_error());
    return -1;
  }
  double us[kNumCalls] = {0}; /* 0: not timed (--only), printed as "-" */
  for (int c = 0, i = 0; c < kNumCalls; c++)
    if (o.only >> c & 1) us[c] = timed[i++];
  BENCH_CUDA(cudaStreamSynchronize(s));
  print_row(sh, o, tn, us, tile_rows, nwrong);
  fflush(stdout);
  cudaFree(A);
  cudaFree(B);
  cudaFree(C);
  cudaFree(Cref);
  cudaFree(dtiles);
  cudaFree(counters);
  cudaFree(wrong);
  cudaFree(ptrs);
  return nwrong == 0 ? 0 : 1;
}

void usage(FILE* f) {
  fprintf(
      f,
      "usage: tilewave bench gemm [--rows R --ffn F --hidden H --experts E] [--tile-m 128]\n"
      "                           [--tile-n TN] [--grid P] [--variant V] [--iters 20]\n"
      "                           [--warmup 3] [--delay-us 0] [--no-check] [--even | --regroup]\n"
      "                           [--only ours,signals,loop,grouped,concat] [--hbm-gbps 4100]\n"
      "GEMM2 of R rows: K = --ffn F, N = --hidden H (aliases --k, --n; --tm, --tn for\n"
      "--tile-m, --tile-n; --reps for --iters). --tile-n: default the planner's choice.\n"
      "Without a shape, runs the default grid: rows 16384 and 32768, F 2048, H 4096 and\n"
      "8192, E 4..64, and rows 8192, F 1408, H 2048, E 30. Layout: the planner's for rank 0\n"
      "of 2 ranks, balanced top-2 routing (rows include its padding), its tile order.\n"
      "--even: rows/E rows an expert (whole bands where E divides rows by 128); --even and\n"
      "--regroup (the planned rows): tiles grouped per expert, one pass over its weights.\n"
      "--delay-us U: U us of a nearly idle device before each timed call (as `tilewave\n"
      "bench` does, default 300 there); 0 (default): the calls back to back, a sustained load.\n"
      "tile rows / rows: rows the tiles compute per column over the layout's rows (at equal\n"
      "speed per tile, the bound that the experts' partial last bands put on ours / concat).\n"
      "--variant V: producer version (src/kernels/sm90_gemm.cu; default env TW_GEMM_VARIANT,\n"
      "else 0, the library's choice).\n"
      "roofline = max(concat's time, (E x N x K + rows x K + rows x N) x 2 bytes at\n"
      "--hbm-gbps, default 4100); roofline/ours = roofline time / our time (1: at the limit).\n"
      "--only LIST: time only these calls (the others print \"-\"), e.g. `--only ours,concat`\n"
      "to profile one kernel of each under Nsight Compute; the check still runs the loop.\n");
}

}  // namespace

static void usage_cb(FILE* f, void*) {
  usage(f);
}

/* --only "ours,concat" -> the mask of those calls (dst: unsigned); NULL, or what to give on an
 * unknown or empty name. */
static const char* parse_only(const char* list, void* dst) {
  unsigned* mask = (unsigned*)dst;
  static const char* want = "a comma-separated subset of ours,signals,loop,grouped,concat";
  *mask = 0;
  for (const char* p = list; *p;) {
    const char* end = strchr(p, ',');
    size_t len = end ? (size_t)(end - p) : strlen(p);
    int c = 0;
    while (c < kNumCalls && !(strlen(kCallNames[c]) == len && !strncmp(p, kCallNames[c], len))) c++;
    if (c == kNumCalls) return want;
    *mask |= 1u << c;
    p += len + (end != nullptr);
  }
  return *mask != 0 ? nullptr : want;
}

extern "C" int tw_cli_bench_gemm(int argc, char** argv) {
  BenchOpts o;
  /* The producer version the context would launch (TW_GEMM_VARIANT) unless --variant says. */
  int32_t variant = 0;
  if (tw__tunable_int("bench gemm", TW_TUNE_GEMM_VARIANT, &variant) != TW_SUCCESS) {
    fprintf(stderr, "%s\n", tw_last_error());
    return 2;
  }
  o.variant = variant;
  int no_check = 0, even = 0;
  tw_cli_arg args[] = {
      tw__cli_int("--rows", &o.rows, 1, TW_CLI_TOKENS_MAX),
      tw__cli_alias(tw__cli_ffn(&o.k), "--k"),
      tw__cli_alias(tw__cli_hidden(&o.n), "--n"),
      tw__cli_experts(&o.experts),
      tw__cli_alias(tw__cli_tile_m(&o.tm), "--tm"),
      tw__cli_alias(tw__cli_tile_n(&o.tn), "--tn"),
      tw__cli_int("--grid", &o.grid, 0, 1 << 16),
      tw__cli_int("--variant", &o.variant, 0, 5),
      tw__cli_alias(tw__cli_iters(&o.reps), "--reps"),
      tw__cli_warmup(&o.warmup),
      tw__cli_delay_us(&o.delay_us),
      tw__cli_bool("--no-check", &no_check),
      tw__cli_custom("--only", &o.only, parse_only),
      tw__cli_bool("--even", &even),
      tw__cli_bool("--regroup", &o.regroup),
      tw__cli_double("--hbm-gbps", &o.hbm_gbps, 1.0, 1e6, 1),
  };
  const int rc_args = tw__cli_parse("tilewave bench gemm", argc, argv, args,
                                    (int)(sizeof args / sizeof args[0]), usage_cb, nullptr);
  if (rc_args != 0) return rc_args == 1 ? 0 : rc_args;
  if (no_check) o.check = 0;
  if (even) o.plan = 0;
  std::vector<Shape> shapes;
  if (o.rows || o.k || o.n || o.experts) {
    if (o.rows <= 0 || o.k <= 0 || o.n <= 0 || o.experts <= 0) {
      return tw__cli_usage_error("tilewave bench gemm",
                                 "one shape needs all of --rows, --ffn, --hidden and --experts");
    }
    shapes.push_back({o.rows, o.k, o.n, o.experts});
  } else {
    for (int rows : {16384, 32768})
      for (int n : {4096, 8192})
        for (int e : {4, 8, 16, 32, 64}) shapes.push_back({rows, 2048, n, e});
    shapes.push_back({8192, 1408, 2048, 30});
  }
  cudaDeviceProp prop;
  cublasHandle_t h;
  cudaStream_t s;
  if (twb_cublas_setup("bench gemm", &prop, &s, &h) != 0) return 1;
  printf(
      "# bench gemm on %s (%d SMs), grid %d, variant %d, tm %d, %s layout, median of %d reps, "
      "%d us idle before each call\n",
      prop.name, prop.multiProcessorCount, o.grid, o.variant, o.tm,
      !o.plan ? "even" : (o.regroup ? "planned (regrouped per expert)" : "planned"), o.reps,
      o.delay_us);
  printf(
      "| rows | K | N | E | tn | ours us TF/s | +signals us, cost | cuBLAS loop us TF/s | "
      "cuBLAS grouped us TF/s | cuBLAS concat us TF/s | ours/concat | tile rows / rows | "
      "speedup vs loop | roofline us, bound | roofline/ours | #wrong |\n");
  printf(
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | "
      "--- |\n");
  int rc = 0;
  twb_progress pr;
  twb_progress_begin(&pr, "bench gemm", "shape", (int)shapes.size());
  for (size_t i = 0; i < shapes.size(); i++) {
    const Shape& sh = shapes[i];
    twb_progress_start(&pr, (int)i, "rows %d K %d N %d E %d", sh.rows, sh.k, sh.n, sh.experts);
    int r = bench_shape(sh, o, h, s);
    if (r < 0) {
      rc = 1;
      (void)cudaGetLastError();
    }
    if (r > 0) rc = 1;
  }
  cublasDestroy(h);
  cudaStreamDestroy(s);
  return rc;
}
