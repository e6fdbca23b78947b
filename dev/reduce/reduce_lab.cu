/*
 * reduce_lab.cu: a single-GPU lab for the owner's weighted reduction (src/kernels/reduce.cu):
 *   out[t] = sum_j w[t][j] * row(slot_row[t * k + j])     (fp32 fmaf in slot order, bf16 result)
 * Only the data part is here (no arrival waits, no credits); the debug-tag path is compiled in
 * (off while timing, checked once per variant) so register counts match the real kernel.
 *
 * Variants, one idea each against v0:
 *   v0  the kernel as it was: one 16-byte vector per thread, `it / vpr` in 64 bits, slot_row and
 *       weight loaded per slot before that slot's row load, grid capped at 4 CTAs x 256 per SM
 *   v1  v0 with 32-bit index arithmetic (hypothesis a)
 *   v2  v0 with the grid capped at 6 CTAs per SM, the most that fit at its 40 registers
 *       (hypothesis c: more threads, so more loads in flight)
 *   v3  v0 with all k slot rows and weights loaded first, then all k row loads (hypothesis b)
 *   v4  a group of G lanes per token (G = 32, or 16/8 when the row is short): slot rows and
 *       weights loaded once per token (int32 rows in registers, the address formed at each
 *       load), then KC x U independent 16-byte loads per lane (KC >= k slots x U vectors,
 *       KC x U = 8); the (token, pass of G x U vectors) items split into equal contiguous
 *       ranges, one per group; persistent grid of 4 CTAs x 256 per SM; no division per vector
 *   v5  v4 with KC x U = 4 and 6 CTAs per SM (fewer loads per thread, more threads)
 *   v6  v4 with KC x U = 16 and 2 CTAs per SM (more loads per thread, fewer threads)
 *   v7  v4 with whole tokens dealt to groups round-robin instead of equal ranges of passes
 *   v8  v0 with (a) + (b) + (c) together: indices first, then k row loads; no division in the
 *       loop (token and vector advance by a precomputed stride); grid = all CTAs that fit
 *   v9  v8 with weak loads that skip L1 allocation (ld.global.L1::no_allocate) instead of
 *       __ldcg, which compiles to a strong (relaxed.gpu) load: does the strong load cost?
 *   v10 v4 with the same weak loads
 *   v11 v4 with cp.async.cg (weak, L1-bypassing) copies into shared memory, then the sums
 *   v12 v8 with cp.async.cg copies into shared memory
 *   v13 v8 with __ldcg plus an L2 prefetch hint (ld.global.cg.L2::256B)
 *   copy  cudaMemcpyAsync D2D moving the same bytes (read + write) as the reduction
 * Every variant's output must equal v0's bit for bit (same fp32 operation order).
 *
 * Build: part of the CMake build (target reduce_lab), or
 *   nvcc -O3 -arch=sm_90a -std=c++17 dev/reduce/reduce_lab.cu -o reduce_lab
 * Run:   ./reduce_lab [reps [shape]]  prints a markdown table (cold = L2 flushed before each
 *        launch; warm = right after the other variants read the same rows)
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "lab_common.cuh"

struct lab_err {
  int32_t status, index;
  uint32_t seen, target;
};

struct lab_args {
  const char* recv;        /* (recv_rows, hidden) bf16 receive rows */
  const uint16_t* c;       /* (local_rows, hidden) bf16 local GEMM rows */
  const int32_t* slot_row; /* (tokens, top_k) */
  const float* weights;    /* (tokens, top_k) */
  uint16_t* out;           /* (tokens, hidden) */
  int32_t tokens, top_k, hidden, recv_rows, col_tiles, debug_tags;
  uint32_t* tags;        /* (recv_rows) */
  uint32_t* hits;        /* (recv_rows) */
  uint32_t* debug_slots; /* (tokens, top_k) */
  lab_err* err;
};

__device__ __forceinline__ void lab_report(lab_err* e, int32_t index, uint32_t seen,
                                           uint32_t target) {
  if (atomicCAS(&e->status, 0, 1) == 0) {
    e->index = index;
    e->seen = seen;
    e->target = target;
  }
}

__device__ __forceinline__ int4 pack_bf16x8(const float* acc) {
  __align__(16) __nv_bfloat162 o[4];
#pragma unroll
  for (int i = 0; i < 4; i++) o[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  return *reinterpret_cast<int4*>(o);
}

/* Row loads. LD 0: __ldcg (L2 only; SASS LDG.E.128.STRONG.GPU). LD 1: weak, no L1 allocation
 * (LDG.E.128.NA). LD 2: __ldcg with a 256-byte L2 prefetch (LDG.E.128.LTC256B.STRONG.GPU). */
template <int LD>
__device__ __forceinline__ int4 ld_row(const int4* p) {
  if constexpr (LD == 0) {
    return __ldcg(p);
  } else {
    int4 v;
    if constexpr (LD == 1)
      asm volatile("ld.global.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "l"(p));
    else
      asm volatile("ld.global.cg.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "l"(p));
    return v;
  }
}

/* cp.async.cg: a weak 16-byte copy global -> shared that bypasses L1 (LDGSTS.E.BYPASS.128). */
__device__ __forceinline__ void cp_async16(int4* smem, const int4* g) {
  const unsigned sa = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa), "l"(g) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
}

/* Row r's first vector: receive window below recv_rows, local GEMM rows above. */
__device__ __forceinline__ const int4* slot_src(const lab_args& a, int r, size_t row_bytes) {
  return reinterpret_cast<const int4*>(r < a.recv_rows ? a.recv + (size_t)r * row_bytes
                                                       : reinterpret_cast<const char*>(a.c) +
                                                             (size_t)(r - a.recv_rows) * row_bytes);
}

/* The per-(token, slot) debug check, as in the real kernel. */
__device__ __forceinline__ void debug_slot(const lab_args& a, int t, int j, int r) {
  uint32_t seen = 0xFFFF0000u;
  if (r < a.recv_rows) {
    const uint32_t h = __ldcg(&a.hits[r]), tag = __ldcg(&a.tags[r]);
    seen = (tag << 16) | (h & 0xFFFFu);
    if (h != (uint32_t)a.col_tiles) lab_report(a.err, t * a.top_k + j, h, (uint32_t)a.col_tiles);
    a.hits[r] = 0;
    a.tags[r] = 0;
  }
  a.debug_slots[(size_t)t * a.top_k + j] = seen;
}

/* ---- v0 / v1 / v2: the original loop; IDX32 selects 32-bit index arithmetic ---------------- */
template <bool IDX32, int MINB>
__global__ void __launch_bounds__(256, MINB) k_orig(const lab_args a) {
  const int vpr = a.hidden / 8;
  const size_t row_bytes = (size_t)a.hidden * 2;
  const char* recv = a.recv;
  const char* local = reinterpret_cast<const char*>(a.c);
  const int64_t items = (int64_t)a.tokens * vpr;
  for (int64_t it = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; it < items;
       it += (int64_t)gridDim.x * blockDim.x) {
    int t, q;
    if (IDX32) {
      t = (int)((uint32_t)it / (uint32_t)vpr);
      q = (int)((uint32_t)it - (uint32_t)t * (uint32_t)vpr);
    } else {
      t = (int)(it / vpr);
      q = (int)(it - (int64_t)t * vpr);
    }
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int j = 0; j < a.top_k; j++) {
      const int r = a.slot_row[(size_t)t * a.top_k + j];
      const float w = a.weights[(size_t)t * a.top_k + j];
      const char* row = r < a.recv_rows ? recv + (size_t)r * row_bytes
                                        : local + (size_t)(r - a.recv_rows) * row_bytes;
      tw__acc_bf16x8(acc, __ldcg(reinterpret_cast<const int4*>(row) + q), w);
      if (a.debug_tags && q == 0) debug_slot(a, t, j, r);
    }
    reinterpret_cast<int4*>(a.out + (size_t)t * a.hidden)[q] = pack_bf16x8(acc);
  }
}

/* ---- v3: v0 with the slot indices and weights loaded first, then all k row loads ---------- */
template <int K>
__global__ void __launch_bounds__(256) k_hoist(const lab_args a) {
  const int vpr = a.hidden / 8;
  const size_t row_bytes = (size_t)a.hidden * 2;
  const char* recv = a.recv;
  const char* local = reinterpret_cast<const char*>(a.c);
  const int64_t items = (int64_t)a.tokens * vpr;
  for (int64_t it = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; it < items;
       it += (int64_t)gridDim.x * blockDim.x) {
    const int t = (int)(it / vpr), q = (int)(it - (int64_t)t * vpr);
    int r[K];
    float w[K];
#pragma unroll
    for (int j = 0; j < K; j++) {
      r[j] = __ldg(&a.slot_row[(size_t)t * K + j]);
      w[j] = __ldg(&a.weights[(size_t)t * K + j]);
    }
    int4 x[K];
#pragma unroll
    for (int j = 0; j < K; j++) {
      const char* row = r[j] < a.recv_rows ? recv + (size_t)r[j] * row_bytes
                                           : local + (size_t)(r[j] - a.recv_rows) * row_bytes;
      x[j] = __ldcg(reinterpret_cast<const int4*>(row) + q);
    }
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < K; j++) tw__acc_bf16x8(acc, x[j], w[j]);
    if (a.debug_tags && q == 0)
      for (int j = 0; j < K; j++) debug_slot(a, t, j, r[j]);
    reinterpret_cast<int4*>(a.out + (size_t)t * a.hidden)[q] = pack_bf16x8(acc);
  }
}

/* ---- v8, v9, v12, v13: v0's thread per vector with (a) + (b) + (c) ------------------------- */
template <int K, int LD>
__global__ void __launch_bounds__(256) k_flat(const lab_args a) {
  const int vpr = a.hidden / 8;
  const size_t row_bytes = (size_t)a.hidden * 2;
  /* This thread's first (token, vector) and the grid's stride in the same terms: one division
   * per thread, then the pair advances by adding (carry from q into t at most once). */
  const int64_t first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  int t = (int)(first / vpr), q = (int)(first - (int64_t)t * vpr);
  const int st = (int)(stride / vpr), sq = (int)(stride - (int64_t)st * vpr);
  for (; t < a.tokens; t += st, q += sq, t += q >= vpr, q -= q >= vpr ? vpr : 0) {
    int r[K];
    float w[K];
#pragma unroll
    for (int j = 0; j < K; j++) {
      r[j] = __ldg(&a.slot_row[(size_t)t * K + j]);
      w[j] = __ldg(&a.weights[(size_t)t * K + j]);
    }
    int4 x[K];
    if constexpr (LD == 3) {
      extern __shared__ int4 stage[]; /* (K, 256) */
#pragma unroll
      for (int j = 0; j < K; j++)
        cp_async16(&stage[j * 256 + threadIdx.x], slot_src(a, r[j], row_bytes) + q);
      cp_async_wait_all();
#pragma unroll
      for (int j = 0; j < K; j++) x[j] = stage[j * 256 + threadIdx.x];
    } else {
#pragma unroll
      for (int j = 0; j < K; j++) x[j] = ld_row<LD>(slot_src(a, r[j], row_bytes) + q);
    }
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < K; j++) tw__acc_bf16x8(acc, x[j], w[j]);
    if (a.debug_tags && q == 0)
      for (int j = 0; j < K; j++) debug_slot(a, t, j, r[j]);
    reinterpret_cast<int4*>(a.out + (size_t)t * a.hidden)[q] = pack_bf16x8(acc);
  }
}

/* ---- v4..v7: a group of G lanes per token, KC x U loads in flight per lane ----------------- */

/* A token's slots, held in registers while the group walks its row (k <= KC). */
template <int KC>
struct slots {
  int r[KC];
  float w[KC];
};

/* Loads token t's slots (unless GENERIC) and, when `check`, does its debug-tag checks. */
template <int KC, bool GENERIC>
__device__ __forceinline__ void load_slots(const lab_args& a, int t, int gl, int G, bool check,
                                           slots<KC>& s) {
  const int k = a.top_k;
  if constexpr (!GENERIC) {
#pragma unroll
    for (int j = 0; j < KC; j++) {
      s.r[j] = 0;
      s.w[j] = 0.f;
      if (j < k) {
        s.r[j] = __ldg(&a.slot_row[(size_t)t * k + j]);
        s.w[j] = __ldg(&a.weights[(size_t)t * k + j]);
      }
    }
  }
  if (check && a.debug_tags)
    for (int j = gl; j < k; j += G) debug_slot(a, t, j, __ldg(&a.slot_row[(size_t)t * k + j]));
}

/* One pass over vectors v0 + u * G (u < U) of token t: KC x U independent loads, then the sums in
 * slot order. GENERIC (k > KC): KC slots at a time, their indices re-read (L1) per chunk. */
template <int KC, int U, bool GENERIC, int LD>
__device__ __forceinline__ void token_pass(const lab_args& a, const slots<KC>& s, int t, int v0,
                                           int G, int vpr) {
  const int k = a.top_k;
  const size_t row_bytes = (size_t)a.hidden * 2;
  const int4 zero = make_int4(0, 0, 0, 0);
  int4* dst = reinterpret_cast<int4*>(a.out + (size_t)t * a.hidden);
  if constexpr (!GENERIC) {
    int4 x[KC][U];
#pragma unroll
    for (int j = 0; j < KC; j++)
#pragma unroll
      for (int u = 0; u < U; u++) {
        const int v = v0 + u * G;
        if constexpr (LD == 3) {          /* cp.async into this thread's own stage slots */
          extern __shared__ int4 stage[]; /* (KC * U, 256) */
          if (j < k && v < vpr)
            cp_async16(&stage[(j * U + u) * 256 + threadIdx.x], slot_src(a, s.r[j], row_bytes) + v);
        } else {
          x[j][u] = (j < k && v < vpr) ? ld_row<LD>(slot_src(a, s.r[j], row_bytes) + v) : zero;
        }
      }
    if constexpr (LD == 3) {
      extern __shared__ int4 stage[];
      cp_async_wait_all();
#pragma unroll
      for (int j = 0; j < KC; j++)
#pragma unroll
        for (int u = 0; u < U; u++) x[j][u] = stage[(j * U + u) * 256 + threadIdx.x];
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int v = v0 + u * G;
      if (v < vpr) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < KC; j++)
          if (j < k) tw__acc_bf16x8(acc, x[j][u], s.w[j]);
        dst[v] = pack_bf16x8(acc);
      }
    }
  } else {
    float acc[U][8];
#pragma unroll
    for (int u = 0; u < U; u++)
#pragma unroll
      for (int i = 0; i < 8; i++) acc[u][i] = 0.f;
    for (int j0 = 0; j0 < k; j0 += KC) {
      int r[KC];
      float w[KC];
      int4 x[KC][U];
#pragma unroll
      for (int j = 0; j < KC; j++) {
        r[j] = 0;
        w[j] = 0.f;
        if (j0 + j < k) {
          r[j] = __ldg(&a.slot_row[(size_t)t * k + j0 + j]);
          w[j] = __ldg(&a.weights[(size_t)t * k + j0 + j]);
        }
      }
#pragma unroll
      for (int j = 0; j < KC; j++)
#pragma unroll
        for (int u = 0; u < U; u++) {
          const int v = v0 + u * G;
          x[j][u] = (j0 + j < k && v < vpr)
                        ? ld_row < LD == 3 ? 0 : LD > (slot_src(a, r[j], row_bytes) + v)
                        : zero;
        }
#pragma unroll
      for (int j = 0; j < KC; j++)
        if (j0 + j < k)
#pragma unroll
          for (int u = 0; u < U; u++) tw__acc_bf16x8(acc[u], x[j][u], w[j]);
    }
#pragma unroll
    for (int u = 0; u < U; u++)
      if (v0 + u * G < vpr) dst[v0 + u * G] = pack_bf16x8(acc[u]);
  }
}

/* v4..v6: tokens dealt to groups round-robin; each group walks its token's whole row. */
template <int KC, int U, bool GENERIC, int MINB>
__global__ void __launch_bounds__(256, MINB) k_group(const lab_args a, int G) {
  const int vpr = a.hidden / 8;
  const int gpc = 256 / G; /* groups per CTA */
  const int gl = threadIdx.x & (G - 1);
  const int ngroups = gridDim.x * gpc;
  for (int t = blockIdx.x * gpc + threadIdx.x / G; t < a.tokens; t += ngroups) {
    slots<KC> s;
    load_slots<KC, GENERIC>(a, t, gl, G, true, s);
    for (int v0 = gl; v0 < vpr; v0 += G * U) token_pass<KC, U, GENERIC, 0>(a, s, t, v0, G, vpr);
  }
}

/* v7: (token, pass) items split into equal contiguous ranges, one per group: every group gets
 * the same work within one pass, also when there are fewer tokens than groups. */
template <int KC, int U, bool GENERIC, int MINB, int LD>
__global__ void __launch_bounds__(256, MINB) k_slice(const lab_args a, int G) {
  const int vpr = a.hidden / 8;
  const int gpc = 256 / G;
  const int gl = threadIdx.x & (G - 1);
  const int ngroups = gridDim.x * gpc, g = blockIdx.x * gpc + threadIdx.x / G;
  const int passes = (vpr + G * U - 1) / (G * U); /* per token */
  const int64_t items = (int64_t)a.tokens * passes;
  const int64_t per = (items + ngroups - 1) / ngroups;
  int64_t i = (int64_t)g * per;
  const int64_t end = min(i + per, items);
  if (i >= end) return;
  int t = (int)(i / passes), p = (int)(i - (int64_t)t * passes);
  slots<KC> s;
  bool fresh = true;
  for (; i < end; i++) {
    if (fresh) load_slots<KC, GENERIC>(a, t, gl, G, p == 0, s); /* pass 0's group checks tags */
    fresh = false;
    token_pass<KC, U, GENERIC, LD>(a, s, t, gl + p * G * U, G, vpr);
    if (++p == passes) {
      p = 0;
      t++;
      fresh = true;
    }
  }
}

/* ---- host side ---------------------------------------------------------------------------- */
__global__ void fill_bf16(uint16_t* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    const float f = ((int)(x & 0xFFFFF) - 0x80000) * (1.0f / 0x80000); /* [-1, 1) */
    p[i] = __bfloat16_as_ushort(__float2bfloat16_rn(f));
  }
}

__global__ void count_diff(const uint4* a, const uint4* b, size_t n, unsigned long long* cnt) {
  unsigned long long c = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const uint4 x = a[i], y = b[i];
    c += (x.x != y.x) + (x.y != y.y) + (x.z != y.z) + (x.w != y.w);
  }
  if (c) atomicAdd(cnt, c);
}

struct shape {
  int tokens, hidden, k;
};

struct variant {
  const char* name;
  int id;
};

static int g_sms = 132;

/* Lanes per token: whole warps unless the row is shorter than a warp's KC x U pass. */
static int group_lanes(int vpr, int U) {
  int G = 32;
  while (G > 8 && G * U > vpr) G /= 2;
  return G;
}

template <int KC, int U, int MINB, bool GENERIC, int LD>
static void launch_group(const lab_args& a, bool slice, cudaStream_t s) {
  const int G = group_lanes(a.hidden / 8, U);
  const int gpc = 256 / G;
  long long grid = (a.tokens + gpc - 1) / gpc;
  grid = std::max<long long>(std::min<long long>(grid, (long long)g_sms * MINB), 1);
  if (slice)
    k_slice<KC, U, GENERIC, MINB, LD>
        <<<(unsigned)((long long)g_sms * MINB), 256, LD == 3 ? KC * U * 256 * 16 : 0, s>>>(a, G);
  else
    k_group<KC, U, GENERIC, MINB><<<(unsigned)grid, 256, 0, s>>>(a, G);
}

/* KC = slots held per pass (power of two >= k, at most MAXL), U = MAXL / KC vectors per slot. */
template <int MAXL, int MINB, int LD = 0>
static void dispatch_group(const lab_args& a, bool slice, cudaStream_t s) {
  const int k = a.top_k;
  if (k <= 1) return launch_group<1, MAXL, MINB, false, LD>(a, slice, s);
  if (k <= 2) return launch_group<2, MAXL / 2, MINB, false, LD>(a, slice, s);
  if constexpr (MAXL >= 8) {
    if (k <= 4) return launch_group<4, MAXL / 4, MINB, false, LD>(a, slice, s);
    if (k <= 8) return launch_group<8, MAXL / 8, MINB, false, LD>(a, slice, s);
    return launch_group<8, MAXL / 8, MINB, true, LD>(a, slice, s);
  } else {
    if (k <= 4) return launch_group<4, 1, MINB, false, LD>(a, slice, s);
    return launch_group<4, 1, MINB, true, LD>(a, slice, s);
  }
}

/* v8 family: every CTA that fits at once (occupancy of this instantiation and its stage). */
template <int K, int LD>
static void launch_flat_k(const lab_args& a, cudaStream_t s) {
  const size_t smem = LD == 3 ? (size_t)K * 256 * 16 : 0;
  static int per_sm = 0;
  if (!per_sm) CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k_flat<K, LD>, 256, smem));
  const long long items = (long long)a.tokens * (a.hidden / 8);
  const long long grid = std::min<long long>((items + 255) / 256, (long long)g_sms * per_sm);
  k_flat<K, LD><<<(unsigned)std::max<long long>(grid, 1), 256, smem, s>>>(a);
}

template <int LD>
static void launch_flat(const lab_args& a, cudaStream_t s) {
  switch (a.top_k) {
    case 1:
      return launch_flat_k<1, LD>(a, s);
    case 2:
      return launch_flat_k<2, LD>(a, s);
    case 3:
      return launch_flat_k<3, LD>(a, s);
    case 4:
      return launch_flat_k<4, LD>(a, s);
    case 5:
      return launch_flat_k<5, LD>(a, s);
    case 6:
      return launch_flat_k<6, LD>(a, s);
    case 7:
      return launch_flat_k<7, LD>(a, s);
    case 8:
      return launch_flat_k<8, LD>(a, s);
    default:
      fprintf(stderr, "v8: k %d not instantiated\n", a.top_k);
      exit(1);
  }
}

static void launch(int id, const lab_args& a, cudaStream_t s) {
  const long long items = (long long)a.tokens * (a.hidden / 8);
  long long grid = (items + 255) / 256;
  switch (id) {
    case 0:
      grid = std::min<long long>(grid, (long long)g_sms * 4);
      k_orig<false, 1><<<(unsigned)grid, 256, 0, s>>>(a);
      break;
    case 1:
      grid = std::min<long long>(grid, (long long)g_sms * 4);
      k_orig<true, 1><<<(unsigned)grid, 256, 0, s>>>(a);
      break;
    case 2:
      grid = std::min<long long>(grid, (long long)g_sms * 6);
      k_orig<false, 6><<<(unsigned)grid, 256, 0, s>>>(a);
      break;
    case 3:
      grid = std::min<long long>(grid, (long long)g_sms * 4);
      switch (a.top_k) {
        case 1:
          k_hoist<1><<<(unsigned)grid, 256, 0, s>>>(a);
          break;
        case 2:
          k_hoist<2><<<(unsigned)grid, 256, 0, s>>>(a);
          break;
        case 4:
          k_hoist<4><<<(unsigned)grid, 256, 0, s>>>(a);
          break;
        case 6:
          k_hoist<6><<<(unsigned)grid, 256, 0, s>>>(a);
          break;
        case 8:
          k_hoist<8><<<(unsigned)grid, 256, 0, s>>>(a);
          break;
        default:
          fprintf(stderr, "v3: k %d not instantiated\n", a.top_k);
          exit(1);
      }
      break;
    case 4:
      dispatch_group<8, 4>(a, true, s);
      break;
    case 5:
      dispatch_group<4, 6>(a, true, s);
      break;
    case 6:
      dispatch_group<16, 2>(a, true, s);
      break;
    case 7:
      dispatch_group<8, 4>(a, false, s);
      break;
    case 8:
      launch_flat<0>(a, s);
      break;
    case 9:
      launch_flat<1>(a, s);
      break;
    case 10:
      dispatch_group<8, 4, 1>(a, true, s);
      break;
    case 11:
      dispatch_group<8, 4, 3>(a, true, s);
      break;
    case 12:
      launch_flat<3>(a, s);
      break;
    case 13:
      launch_flat<2>(a, s);
      break;
    default:
      break;
  }
  CK(cudaGetLastError());
}

static const variant kVariants[] = {{"v0", 0},   {"v1", 1},   {"v2", 2},   {"v3", 3},  {"v4", 4},
                                    {"v5", 5},   {"v6", 6},   {"v7", 7},   {"v8", 8},  {"v9", 9},
                                    {"v10", 10}, {"v11", 11}, {"v12", 12}, {"v13", 13}};
static const int kNumVariants = (int)(sizeof kVariants / sizeof kVariants[0]);

/* Build the owner's slot_row as the planner lays it out for rank 0 of 2: experts 0..E-1 local,
 * E..2E-1 on the peer. Receive rows: the peer's experts in order, tokens ascending inside each.
 * Local rows: per local expert, the peer's tokens' rows first (padded to 128, sent away), then
 * ours. Slot order j: the router's order (random expert order). */
static void build_slots(const shape& sh, std::mt19937_64& rng, std::vector<int32_t>& slot,
                        std::vector<float>& w, int& recv_rows, int& local_rows) {
  const int ET = std::max(64, 2 * sh.k), E = ET / 2, T = sh.tokens, K = sh.k;
  std::vector<int> ids((size_t)T * K);
  std::vector<int> perm(ET);
  for (int e = 0; e < ET; e++) perm[e] = e;
  for (int t = 0; t < T; t++) {
    for (int j = 0; j < K; j++) { /* partial Fisher-Yates: K distinct experts */
      const int p = j + (int)(rng() % (uint64_t)(ET - j));
      std::swap(perm[j], perm[p]);
      ids[(size_t)t * K + j] = perm[j];
    }
  }
  std::vector<int> cnt(ET, 0);
  for (int x : ids) cnt[x]++;
  std::vector<int> base(ET, 0);
  int r = 0;
  for (int g = E; g < ET; g++) base[g] = r, r += cnt[g];
  recv_rows = r;
  int l = 0;
  for (int e = 0; e < E; e++) {
    l += (cnt[e] + 127) / 128 * 128; /* the peer's rows through this expert, about as many */
    base[e] = recv_rows + l;
    l += cnt[e];
  }
  local_rows = l;
  std::vector<int> run(ET, 0);
  slot.resize((size_t)T * K);
  w.resize((size_t)T * K);
  std::uniform_real_distribution<float> uw(0.01f, 1.0f);
  for (int t = 0; t < T; t++)
    for (int j = 0; j < K; j++) {
      const int g = ids[(size_t)t * K + j];
      slot[(size_t)t * K + j] = base[g] + run[g]++;
      w[(size_t)t * K + j] = uw(rng);
    }
}

static double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int main(int argc, char** argv) {
  const int reps = argc > 1 ? atoi(argv[1]) : 30, warm = 3;
  const int only = argc > 2 ? atoi(argv[2]) : -1; /* one shape (index), e.g. for a profiler */
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  g_sms = prop.multiProcessorCount;
  printf("# reduce lab: %s, %d SMs, L2 %d MB, reps %d (median)\n\n", prop.name, g_sms,
         prop.l2CacheSize >> 20, reps);

  const shape shapes[] = {{8192, 4096, 2},  {8192, 8192, 2},  {16384, 4096, 2}, {16384, 8192, 2},
                          {16384, 1024, 8}, {16384, 2048, 4}, {16384, 2048, 6}, {1024, 2048, 4},
                          {1024, 768, 2},   {8192, 512, 2},   {8192, 7168, 8},  {4096, 2056, 3}};
  const size_t flush_bytes = 256u << 20;
  char* flush;
  CK(cudaMalloc(&flush, flush_bytes));
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  const int nv = kNumVariants + 1; /* + copy */
  const int nev = 2 * nv * (reps + warm);
  std::vector<cudaEvent_t> ev(nev);
  for (auto& e : ev) CK(cudaEventCreate(&e));
  unsigned long long* d_cnt;
  CK(cudaMalloc(&d_cnt, 8));
  lab_err* d_err;
  CK(cudaMalloc(&d_err, sizeof(lab_err)));

  std::mt19937_64 rng(12345);
  printf("| tokens | hidden | k | MB moved | L2 | copy us (TB/s) |");
  for (int v = 0; v < kNumVariants; v++) printf(" %s us (TB/s, x copy) |", kVariants[v].name);
  printf("\n|---|---|---|---|---|---|");
  for (int v = 0; v < kNumVariants; v++) printf("---|");
  printf("\n");
  fflush(stdout);
  int failures = 0;

  int si = -1;
  for (const shape& sh : shapes) {
    if (++si != only && only >= 0) continue;
    std::vector<int32_t> slot;
    std::vector<float> w;
    int recv_rows, local_rows;
    build_slots(sh, rng, slot, w, recv_rows, local_rows);
    const size_t row_bytes = (size_t)sh.hidden * 2, nslots = (size_t)sh.tokens * sh.k;
    const size_t out_bytes = (size_t)sh.tokens * row_bytes;
    const double bytes = (double)nslots * row_bytes + (double)out_bytes;
    char *recv, *local, *out_ref, *out;
    int32_t* d_slot;
    float* d_w;
    uint32_t *tags, *hits, *dbg, *dbg_ref;
    char *csrc, *cdst;
    const size_t copy_bytes = (size_t)(bytes / 2);
    CK(cudaMalloc(&recv, (size_t)recv_rows * row_bytes + 16));
    CK(cudaMalloc(&local, (size_t)local_rows * row_bytes + 16));
    CK(cudaMalloc(&out_ref, out_bytes));
    CK(cudaMalloc(&out, out_bytes));
    CK(cudaMalloc(&d_slot, nslots * 4));
    CK(cudaMalloc(&d_w, nslots * 4));
    CK(cudaMalloc(&tags, (size_t)recv_rows * 4 + 4));
    CK(cudaMalloc(&hits, (size_t)recv_rows * 4 + 4));
    CK(cudaMalloc(&dbg, nslots * 4));
    CK(cudaMalloc(&dbg_ref, nslots * 4));
    CK(cudaMalloc(&csrc, copy_bytes));
    CK(cudaMalloc(&cdst, copy_bytes));
    fill_bf16<<<1024, 256>>>((uint16_t*)recv, (size_t)recv_rows * sh.hidden, rng());
    fill_bf16<<<1024, 256>>>((uint16_t*)local, (size_t)local_rows * sh.hidden, rng());
    CK(cudaMemset(csrc, 1, copy_bytes));
    CK(cudaMemcpy(d_slot, slot.data(), nslots * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_w, w.data(), nslots * 4, cudaMemcpyHostToDevice));

    lab_args a;
    memset(&a, 0, sizeof a);
    a.recv = recv;
    a.c = (const uint16_t*)local;
    a.slot_row = d_slot;
    a.weights = d_w;
    a.tokens = sh.tokens;
    a.top_k = sh.k;
    a.hidden = sh.hidden;
    a.recv_rows = recv_rows;
    a.col_tiles = 7;
    a.tags = tags;
    a.hits = hits;
    a.debug_slots = dbg;
    a.err = d_err;

    /* Correctness: every variant with the debug tags on (hits = col_tiles, tags = 1 + row % 3)
     * must give v0's output and observed slots, clear the tags, and report nothing. */
    std::vector<uint32_t> h_tags(recv_rows + 1);
    for (int i = 0; i <= recv_rows; i++) h_tags[i] = 1 + i % 3;
    std::vector<uint32_t> h_hits(recv_rows + 1, 7u), z(recv_rows + 1);
    for (int v = 0; v < kNumVariants; v++) {
      if (kVariants[v].id == 3 && sh.k != 1 && sh.k != 2 && sh.k != 4 && sh.k != 6 && sh.k != 8)
        continue;
      lab_args d = a;
      d.out = (uint16_t*)(v == 0 ? out_ref : out);
      d.debug_slots = v == 0 ? dbg_ref : dbg;
      d.debug_tags = 1;
      if (v == 2 && sh.tokens > 4096) h_hits[recv_rows / 2] = 5; /* one planted miscount */
      CK(cudaMemcpy(tags, h_tags.data(), (size_t)(recv_rows + 1) * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(hits, h_hits.data(), (size_t)(recv_rows + 1) * 4, cudaMemcpyHostToDevice));
      h_hits[recv_rows / 2] = 7;
      CK(cudaMemset(d_err, 0, sizeof(lab_err)));
      CK(cudaMemset(out, 0xFF, out_bytes));
      launch(kVariants[v].id, d, s);
      CK(cudaStreamSynchronize(s));
      lab_err he;
      CK(cudaMemcpy(&he, d_err, sizeof he, cudaMemcpyDeviceToHost));
      std::vector<uint32_t> th(recv_rows + 1), hh(recv_rows + 1);
      CK(cudaMemcpy(th.data(), tags, (size_t)recv_rows * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(hh.data(), hits, (size_t)recv_rows * 4, cudaMemcpyDeviceToHost));
      th[recv_rows] = hh[recv_rows] = 0;
      const bool planted = v == 2 && sh.tokens > 4096;
      bool ok = th == z && hh == z && (he.status != 0) == planted;
      if (v > 0) {
        CK(cudaMemset(d_cnt, 0, 8));
        count_diff<<<1024, 256>>>((const uint4*)out_ref, (const uint4*)out, out_bytes / 16, d_cnt);
        unsigned long long nd = 0;
        CK(cudaMemcpy(&nd, d_cnt, 8, cudaMemcpyDeviceToHost));
        std::vector<uint32_t> s0(nslots), s1(nslots);
        CK(cudaMemcpy(s0.data(), dbg_ref, nslots * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(s1.data(), dbg, nslots * 4, cudaMemcpyDeviceToHost));
        if (planted) { /* the planted row reads 5 instead of 7 */
          for (size_t i = 0; i < nslots; i++)
            if (slot[i] == recv_rows / 2) s1[i] = (s1[i] & 0xFFFF0000u) | 7u;
        }
        ok = ok && nd == 0 && s0 == s1;
        if (nd) fprintf(stderr, "%s: %llu words differ from v0\n", kVariants[v].name, nd);
      }
      if (!ok) {
        fprintf(stderr, "FAIL %s at (%d, %d, %d): err %d\n", kVariants[v].name, sh.tokens,
                sh.hidden, sh.k, he.status);
        failures++;
      }
    }

    /* Timing: interleaved variants, each rep cold (flushed) and warm. */
    a.debug_tags = 0;
    a.out = (uint16_t*)out;
    for (int mode = 0; mode < 2; mode++) {
      std::vector<std::vector<float>> t(nv);
      int e = 0;
      for (int r = 0; r < reps + warm; r++) {
        for (int v = 0; v < nv; v++) {
          if (v < kNumVariants && kVariants[v].id == 3 && sh.k != 1 && sh.k != 2 && sh.k != 4 &&
              sh.k != 6 && sh.k != 8) {
            e += 2;
            continue;
          }
          if (mode == 0) CK(cudaMemsetAsync(flush, r + v, flush_bytes, s));
          CK(cudaEventRecord(ev[e], s));
          if (v < kNumVariants)
            launch(kVariants[v].id, a, s);
          else
            CK(cudaMemcpyAsync(cdst, csrc, copy_bytes, cudaMemcpyDeviceToDevice, s));
          CK(cudaEventRecord(ev[e + 1], s));
          e += 2;
        }
      }
      CK(cudaStreamSynchronize(s));
      e = 0;
      for (int r = 0; r < reps + warm; r++)
        for (int v = 0; v < nv; v++, e += 2) {
          if (v < kNumVariants && kVariants[v].id == 3 && sh.k != 1 && sh.k != 2 && sh.k != 4 &&
              sh.k != 6 && sh.k != 8)
            continue;
          float ms;
          CK(cudaEventElapsedTime(&ms, ev[e], ev[e + 1]));
          if (r >= warm) t[v].push_back(ms * 1000.f);
        }
      const double tc = median(t[nv - 1]);
      printf("| %d | %d | %d | %.1f | %s | %.1f (%.2f) |", sh.tokens, sh.hidden, sh.k, bytes / 1e6,
             mode == 0 ? "cold" : "warm", tc, bytes / tc / 1e6);
      for (int v = 0; v < kNumVariants; v++) {
        if (t[v].empty()) {
          printf(" - |");
          continue;
        }
        const double us = median(t[v]);
        printf(" %.1f (%.2f, %.2f) |", us, bytes / us / 1e6, tc / us);
      }
      printf("\n");
      fflush(stdout);
    }
    CK(cudaFree(recv));
    CK(cudaFree(local));
    CK(cudaFree(out_ref));
    CK(cudaFree(out));
    CK(cudaFree(d_slot));
    CK(cudaFree(d_w));
    CK(cudaFree(tags));
    CK(cudaFree(hits));
    CK(cudaFree(dbg));
    CK(cudaFree(dbg_ref));
    CK(cudaFree(csrc));
    CK(cudaFree(cdst));
  }
  printf("\n%s: %d failure(s)\n", failures ? "FAILED" : "all variants bit-identical to v0",
         failures);
  return failures ? 1 : 0;
}
