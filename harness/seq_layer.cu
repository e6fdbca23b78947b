/*
 * seq_layer.cu: the sequential MoE layer on an in-process team (seq_layer.h): permute (histogram,
 * CUB's stable radix sort, row scatter), copy all-to-all, cuBLAS GEMM1, SwiGLU, cuBLAS GEMM2,
 * copy all-to-all back, weighted sum; and the row check of `bench dispatch`.
 *
 * Row layouts, rank r of W, E local experts, global expert g on rank g / E:
 *   send (slots, H):  this rank's slots sorted by g (stable: token order within g), so each
 *                     destination's rows are one block, expert-major;
 *   recv (rows, H):   source-major, then local expert, then the source's token order; GEMM group
 *                     (s, e) is one contiguous block of it;
 *   ret (slots, H):   GEMM2's rows back in the send order, so slot i's row is ret[pos[i]].
 * The host learns only the count matrix (W, E_total) per call, as an engine's all_to_all_single
 * needs its split sizes.
 */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cub/device/device_radix_sort.cuh>

#include "checks.h"
#include "core.h"
#include "seq_layer.h"
#include "seq_layout.h"
#include "swiglu.h"

/* What every rank all-gathers at creation: where its peers copy to, and what they wait on. */
typedef struct tw__seq_peer {
  void* recv;         /* (recv_max, H) */
  void* ret;          /* (slots_max, H) */
  cudaEvent_t sent;   /* after this rank's dispatch copies */
  cudaEvent_t copied; /* after this rank's return copies */
} tw__seq_peer;

struct tw__seq_layer {
  tw__team* team;
  int32_t W, rank, E, ET, H, F, K, max_tokens;
  int64_t slots_max, recv_max;
  void *send, *recv, *gu, *h, *out2, *ret;      /* recv == send and ret == out2 at world 1 */
  int32_t* d_counts;                            /* (ET) */
  int32_t* h_counts;                            /* (ET) pinned */
  int32_t* all_counts;                          /* (W, ET) host */
  int32_t *keys_out, *vals_in, *vals_out, *pos; /* (slots_max) */
  void* sort_tmp;
  size_t sort_bytes;
  int sort_bits;
  cudaEvent_t ev_counts, ev_sent, ev_copied;
  tw__seq_peer* peers; /* (W) */
  cublasHandle_t blas;
  /* grouped GEMMs: the device pointer tables of both GEMMs, 6 x W x E, staged in pinned memory */
  void** h_ptrs;
  void** d_ptrs;
  cublasOperation_t* gop; /* (2, W x E) host: transa, transb */
  int* gi;                /* (7, W x E) host: m, n, k, lda, ldb, ldc, group size */
  float* galpha;          /* (2, W x E): ones, zeros */
  int ready;              /* created on every rank: destroy meets the peers */
  int64_t bytes;
  /* the last call's layout */
  int32_t tokens;
  int64_t recv_rows;
  int64_t* send_off;  /* (W) my send block for destination d */
  int64_t* send_rows; /* (W) */
  int64_t* recv_off;  /* (W) my receive block from source s */
  int64_t* recv_from; /* (W) */
  int64_t* at_dest;   /* (W) where my block starts in destination d's receive buffer */
  int64_t* at_src;    /* (W) where source s's rows for me start in its send order */
  int32_t ngroups;
  int32_t *g_e, *g_m; /* (W x E) non-empty groups: local expert, rows */
  int64_t* g_row0;    /* (W x E) first receive row */
};

/* ---- kernels --------------------------------------------------------------------------------- */

/* counts[g] += slots naming expert g; ids out of range are not counted (the host then sees a sum
 * below tokens x top_k and fails). */
__global__ void tw__seq_hist_kernel(const int32_t* __restrict__ ids, int64_t n, int32_t et,
                                    int32_t* __restrict__ counts) {
  extern __shared__ int32_t sh[];
  for (int g = threadIdx.x; g < et; g += blockDim.x) sh[g] = 0;
  __syncthreads();
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int32_t g = ids[i];
    if (g >= 0 && g < et) atomicAdd(&sh[g], 1);
  }
  __syncthreads();
  for (int g = threadIdx.x; g < et; g += blockDim.x)
    if (sh[g]) atomicAdd(&counts[g], sh[g]);
}

/* One warp per sorted position p: the row of slot order[p]'s token to dst[p]; pos[slot] = p. */
__global__ void tw__seq_scatter_kernel(const uint4* __restrict__ x,
                                       const int32_t* __restrict__ order, int64_t n, int32_t top_k,
                                       int32_t vecs, uint4* __restrict__ dst,
                                       int32_t* __restrict__ pos) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
  for (int64_t p = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; p < n; p += warps) {
    const int32_t slot = order[p];
    const uint4* src = x + (int64_t)(slot / top_k) * vecs;
    uint4* out = dst + p * vecs;
    for (int v = lane; v < vecs; v += 32) out[v] = src[v];
    if (lane == 0) pos[slot] = (int32_t)p;
  }
}

/* One block per token: out[t] = bf16(sum_j w[t][j] * rows[pos[t k + j]]), fp32 in slot order. */
__global__ void tw__seq_wsum_kernel(const uint4* __restrict__ rows, const int32_t* __restrict__ pos,
                                    const float* __restrict__ w, int32_t top_k, int32_t vecs,
                                    uint4* __restrict__ out) {
  const int64_t t = blockIdx.x;
  for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int j = 0; j < top_k; j++) {
      const float gw = w[t * top_k + j];
      const uint4 r = rows[(int64_t)pos[t * top_k + j] * vecs + v];
      const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&r);
      for (int q = 0; q < 4; q++) {
        const float2 f = __bfloat1622float2(b[q]);
        acc[2 * q] += gw * f.x;
        acc[2 * q + 1] += gw * f.y;
      }
    }
    uint4 o;
    __nv_bfloat162* ob = reinterpret_cast<__nv_bfloat162*>(&o);
    for (int q = 0; q < 4; q++) ob[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
    out[t * vecs + v] = o;
  }
}

/* One warp per row: rows[i] against x_ranks[src[2i]][src[2i+1]] (zero where src[2i] < 0). */
__global__ void tw__seq_check_kernel(const uint4* __restrict__ rows, int64_t nrows,
                                     const int32_t* __restrict__ src,
                                     const void* const* __restrict__ x_ranks, int32_t vecs,
                                     unsigned long long* __restrict__ wrong) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
  for (int64_t i = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; i < nrows;
       i += warps) {
    const int32_t s = src[2 * i], t = src[2 * i + 1];
    const uint4* want = s >= 0 ? static_cast<const uint4*>(x_ranks[s]) + (int64_t)t * vecs : NULL;
    int bad = 0;
    for (int v = lane; v < vecs; v += 32) {
      const uint4 a = rows[i * vecs + v];
      const uint4 b = want ? want[v] : make_uint4(0u, 0u, 0u, 0u);
      bad |= a.x != b.x || a.y != b.y || a.z != b.z || a.w != b.w;
    }
    if (__any_sync(0xffffffffu, bad) && lane == 0) atomicAdd(wrong, 1ull);
  }
}

static unsigned tw__seq_blocks(int64_t work, int64_t per_block) {
  const int64_t b = (work + per_block - 1) / per_block;
  return (unsigned)(b < 1 ? 1 : b > 4096 ? 4096 : b);
}

/* ---- creation -------------------------------------------------------------------------------- */

static tw_status tw__seq_alloc(tw__seq_layer_t s, void** p, size_t bytes) {
  TW_CUDA_TRY(cudaMalloc(p, bytes + 256));
  s->bytes += (int64_t)bytes + 256;
  return TW_SUCCESS;
}

static tw_status tw__seq_create(tw__seq_layer_t s, const tw_problem* p, int ffn) {
  const int W = s->W, E = s->E;
  s->H = p->hidden, s->F = ffn, s->K = p->top_k, s->ET = p->experts, s->max_tokens = p->max_tokens;
  const int64_t T = p->max_tokens, K = p->top_k, H = p->hidden;
  s->slots_max = T * K;
  /* A token's k distinct experts put at most min(k, E) rows on one rank. */
  s->recv_max = W == 1 ? s->slots_max : (int64_t)W * T * (K < E ? K : E);
  TW_TRY(tw__seq_alloc(s, &s->send, (size_t)s->slots_max * H * 2));
  if (W > 1)
    TW_TRY(tw__seq_alloc(s, &s->recv, (size_t)s->recv_max * H * 2));
  else
    s->recv = s->send;
  if (ffn > 0) {
    TW_TRY(tw__seq_alloc(s, &s->gu, (size_t)s->recv_max * 2 * ffn * 2));
    TW_TRY(tw__seq_alloc(s, &s->h, (size_t)s->recv_max * ffn * 2));
    TW_TRY(tw__seq_alloc(s, &s->out2, (size_t)s->recv_max * H * 2));
    if (W > 1)
      TW_TRY(tw__seq_alloc(s, &s->ret, (size_t)s->slots_max * H * 2));
    else
      s->ret = s->out2;
    if (cublasCreate(&s->blas) != CUBLAS_STATUS_SUCCESS) {
      s->blas = NULL;
      return tw__fail(TW_ERR_CUDA, "sequential layer: cublasCreate failed");
    }
    const size_t g = (size_t)W * E;
    TW_CUDA_TRY(cudaMallocHost((void**)&s->h_ptrs, 6 * g * sizeof(void*)));
    TW_TRY(tw__seq_alloc(s, (void**)&s->d_ptrs, 6 * g * sizeof(void*)));
    s->gop = (cublasOperation_t*)calloc(2 * g, sizeof(cublasOperation_t));
    s->gi = (int*)calloc(7 * g, sizeof(int));
    s->galpha = (float*)calloc(2 * g, sizeof(float));
    if (s->gop == NULL || s->gi == NULL || s->galpha == NULL)
      return tw__fail(TW_ERR_OUT_OF_MEMORY, "sequential layer: host memory");
    for (size_t i = 0; i < g; i++) {
      s->galpha[i] = 1.f; /* alphas; the betas stay 0 */
      s->gop[i] = CUBLAS_OP_T, s->gop[g + i] = CUBLAS_OP_N;
    }
  }
  TW_TRY(tw__seq_alloc(s, (void**)&s->d_counts, (size_t)s->ET * 4));
  TW_CUDA_TRY(cudaMallocHost((void**)&s->h_counts, (size_t)s->ET * 4));
  const size_t n = (size_t)s->slots_max;
  TW_TRY(tw__seq_alloc(s, (void**)&s->keys_out, n * 4));
  TW_TRY(tw__seq_alloc(s, (void**)&s->vals_in, n * 4));
  TW_TRY(tw__seq_alloc(s, (void**)&s->vals_out, n * 4));
  TW_TRY(tw__seq_alloc(s, (void**)&s->pos, n * 4));
  {
    int32_t* iota = (int32_t*)malloc(n * 4 + 4);
    if (iota == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "sequential layer: host memory");
    for (size_t i = 0; i < n; i++) iota[i] = (int32_t)i;
    const cudaError_t e = cudaMemcpy(s->vals_in, iota, n * 4, cudaMemcpyHostToDevice);
    free(iota);
    TW_CUDA_TRY(e);
  }
  s->sort_bits = 1;
  while ((1 << s->sort_bits) < s->ET) s->sort_bits++;
  TW_CUDA_TRY(cub::DeviceRadixSort::SortPairs(NULL, s->sort_bytes, (const int32_t*)NULL,
                                              s->keys_out, s->vals_in, s->vals_out, (int64_t)n, 0,
                                              s->sort_bits));
  TW_TRY(tw__seq_alloc(s, &s->sort_tmp, s->sort_bytes));
  TW_CUDA_TRY(cudaEventCreateWithFlags(&s->ev_counts, cudaEventDisableTiming));
  TW_CUDA_TRY(cudaEventCreateWithFlags(&s->ev_sent, cudaEventDisableTiming));
  TW_CUDA_TRY(cudaEventCreateWithFlags(&s->ev_copied, cudaEventDisableTiming));
  s->all_counts = (int32_t*)calloc((size_t)W * s->ET, sizeof(int32_t));
  s->peers = (tw__seq_peer*)calloc((size_t)W, sizeof(tw__seq_peer));
  int64_t* l = (int64_t*)calloc(6 * (size_t)W + (size_t)W * E, sizeof(int64_t));
  s->g_e = (int32_t*)calloc(2 * (size_t)W * E, sizeof(int32_t));
  if (s->all_counts == NULL || s->peers == NULL || l == NULL || s->g_e == NULL) {
    free(l);
    return tw__fail(TW_ERR_OUT_OF_MEMORY, "sequential layer: host memory");
  }
  s->send_off = l, s->send_rows = l + W, s->recv_off = l + 2 * W, s->recv_from = l + 3 * W;
  s->at_dest = l + 4 * W, s->at_src = l + 5 * W, s->g_row0 = l + 6 * W;
  s->g_m = s->g_e + (size_t)W * E;
  return TW_SUCCESS;
}

tw_status tw__seq_layer_create(const tw_problem* p, tw__team* team, int ffn, tw__seq_layer_t* out) {
  TW_CHECK_NULL(p);
  TW_CHECK_NULL(team);
  TW_CHECK_NULL(out);
  *out = NULL;
  if (p->world_size != team->world || p->experts % team->world != 0 || p->hidden % 8 != 0 ||
      ffn % 8 != 0)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "sequential layer: world %d, team of %d, experts %d, hidden %d, ffn %d",
                    p->world_size, team->world, p->experts, p->hidden, ffn);
  tw__seq_layer_t s = (tw__seq_layer_t)calloc(1, sizeof *s);
  if (s == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "sequential layer: host memory");
  s->team = team, s->W = team->world, s->rank = team->rank, s->E = p->experts / team->world;
  tw_status st = tw__seq_create(s, p, ffn);
  /* Collective even after a local failure, so that no rank waits for this one. */
  tw__seq_peer mine = {s->recv, s->ret, s->ev_sent, s->ev_copied};
  int64_t bad = st != TW_SUCCESS;
  const tw_status st2 = tw__team_max_i64(team, &bad, 1);
  if (st == TW_SUCCESS && st2 != TW_SUCCESS) st = st2;
  if (st == TW_SUCCESS && bad)
    st = tw__fail(TW_ERR_INTERNAL, "sequential layer: another rank failed its setup");
  if (st == TW_SUCCESS) st = team->ops->allgather(team, &mine, s->peers, sizeof mine);
  if (st != TW_SUCCESS) {
    tw__seq_layer_destroy(s);
    return st;
  }
  s->ready = 1;
  *out = s;
  return TW_SUCCESS;
}

void tw__seq_layer_destroy(tw__seq_layer_t s) {
  if (s == NULL) return;
  /* This rank's copies into the peers are done, then every rank's into this one. */
  if (s->ev_sent) cudaEventSynchronize(s->ev_sent);
  if (s->ev_copied) cudaEventSynchronize(s->ev_copied);
  if (s->ready) (void)tw__team_barrier(s->team);
  void* dev[] = {s->send,     s->W > 1 ? s->recv : NULL,
                 s->gu,       s->h,
                 s->out2,     s->W > 1 ? s->ret : NULL,
                 s->d_counts, s->keys_out,
                 s->vals_in,  s->vals_out,
                 s->pos,      s->sort_tmp,
                 s->d_ptrs};
  for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) cudaFree(dev[i]);
  cudaFreeHost(s->h_counts);
  cudaFreeHost(s->h_ptrs);
  if (s->ev_counts) cudaEventDestroy(s->ev_counts);
  if (s->ev_sent) cudaEventDestroy(s->ev_sent);
  if (s->ev_copied) cudaEventDestroy(s->ev_copied);
  if (s->blas) cublasDestroy(s->blas);
  free(s->all_counts);
  free(s->peers);
  free(s->send_off);
  free(s->g_e);
  free(s->gop);
  free(s->gi);
  free(s->galpha);
  free(s);
}

/* ---- one call -------------------------------------------------------------------------------- */

/* The layout of this call from the all-gathered counts (host; seq_layout.c). */
static tw_status tw__seq_layout(tw__seq_layer_t s) {
  tw__seq_offsets o;
  memset(&o, 0, sizeof o);
  o.send_off = s->send_off, o.send_rows = s->send_rows, o.recv_off = s->recv_off;
  o.recv_from = s->recv_from, o.at_dest = s->at_dest, o.at_src = s->at_src;
  o.g_e = s->g_e, o.g_m = s->g_m, o.g_row0 = s->g_row0;
  TW_TRY(tw__seq_offsets_compute(s->W, s->E, s->rank, s->all_counts, (int64_t)s->tokens * s->K,
                                 s->recv_max, &o));
  s->ngroups = o.ngroups;
  s->recv_rows = o.recv_rows;
  return TW_SUCCESS;
}

/* Each rank's copies of `bytes_of(d)` into the peers, an event, the barrier, the waits. */
static tw_status tw__seq_exchange(tw__seq_layer_t s, int back, cudaStream_t stream) {
  const size_t row = (size_t)s->H * 2;
  for (int d = 0; d < s->W; d++) {
    /* dispatch: my block for d into d's receive buffer; back: source d's block into its ret */
    const int64_t rows = back ? s->recv_from[d] : s->send_rows[d];
    if (rows == 0) continue;
    char* dst = (char*)(back ? s->peers[d].ret : s->peers[d].recv) +
                (size_t)(back ? s->at_src[d] : s->at_dest[d]) * row;
    const char* src = (const char*)(back ? s->out2 : s->send) +
                      (size_t)(back ? s->recv_off[d] : s->send_off[d]) * row;
    TW_CUDA_TRY(cudaMemcpyAsync(dst, src, (size_t)rows * row, cudaMemcpyDeviceToDevice, stream));
  }
  cudaEvent_t mine = back ? s->ev_copied : s->ev_sent;
  TW_CUDA_TRY(cudaEventRecord(mine, stream));
  TW_TRY(tw__team_barrier(s->team)); /* every rank's record precedes every wait below */
  for (int src = 0; src < s->W; src++)
    if (src != s->rank)
      TW_CUDA_TRY(cudaStreamWaitEvent(stream, back ? s->peers[src].copied : s->peers[src].sent, 0));
  return TW_SUCCESS;
}

static tw_status tw__seq_permute_exchange(tw__seq_layer_t s, const void* x, const int32_t* ids,
                                          int32_t tokens, cudaStream_t stream) {
  if (tokens < 0 || tokens > s->max_tokens)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "sequential layer: %d tokens; capacity %d", tokens,
                    s->max_tokens);
  if (tokens > 0 && (x == NULL || ids == NULL))
    return tw__fail(TW_ERR_NULL_POINTER, "sequential layer: x or topk_ids is NULL");
  s->tokens = tokens;
  const int64_t n = (int64_t)tokens * s->K;
  TW_CUDA_TRY(cudaMemsetAsync(s->d_counts, 0, (size_t)s->ET * 4, stream));
  if (n > 0) {
    tw__seq_hist_kernel<<<tw__seq_blocks(n, 256 * 16), 256, (size_t)s->ET * 4, stream>>>(
        ids, n, s->ET, s->d_counts);
    TW_CUDA_TRY(cudaGetLastError());
  }
  TW_CUDA_TRY(
      cudaMemcpyAsync(s->h_counts, s->d_counts, (size_t)s->ET * 4, cudaMemcpyDeviceToHost, stream));
  TW_CUDA_TRY(cudaEventRecord(s->ev_counts, stream));
  /* The sort and the scatter need no counts: they run while the host gathers them. */
  if (n > 0) {
    size_t bytes = s->sort_bytes;
    TW_CUDA_TRY(cub::DeviceRadixSort::SortPairs(s->sort_tmp, bytes, ids, s->keys_out, s->vals_in,
                                                s->vals_out, n, 0, s->sort_bits, stream));
    const int32_t vecs = s->H / 8;
    tw__seq_scatter_kernel<<<tw__seq_blocks(n, 8), 256, 0, stream>>>(
        (const uint4*)x, s->vals_out, n, s->K, vecs, (uint4*)s->send, s->pos);
    TW_CUDA_TRY(cudaGetLastError());
  }
  TW_CUDA_TRY(cudaEventSynchronize(s->ev_counts));
  TW_TRY(s->team->ops->allgather(s->team, s->h_counts, s->all_counts, (size_t)s->ET * 4));
  TW_TRY(tw__seq_layout(s));
  if (s->W > 1) TW_TRY(tw__seq_exchange(s, 0, stream));
  return TW_SUCCESS;
}

tw_status tw__seq_dispatch(tw__seq_layer_t s, const void* x, const int32_t* topk_ids,
                           int32_t tokens, cudaStream_t stream) {
  TW_CHECK_NULL(s);
  return tw__seq_permute_exchange(s, x, topk_ids, tokens, stream);
}

#define TW__SEQ_BLAS(expr)                                                                 \
  do {                                                                                     \
    const cublasStatus_t tw__b = (expr);                                                   \
    if (tw__b != CUBLAS_STATUS_SUCCESS)                                                    \
      return tw__fail(TW_ERR_CUDA, "sequential layer: %s failed: cuBLAS status %d", #expr, \
                      (int)tw__b);                                                         \
  } while (0)

/* One GEMM of the layer over the call's groups: C (m, n_out) = A (m, k) W_e^T, W (E, n_out, k),
 * A and C rows at the groups' receive rows. which: 0 GEMM1, 1 GEMM2 (its pointer tables). */
static tw_status tw__seq_gemm(tw__seq_layer_t s, tw__seq_form form, int which, const void* w,
                              const void* a, void* c, int n_out, int k, cudaStream_t stream) {
  const int G = s->ngroups;
  if (G == 0) return TW_SUCCESS;
  const float one = 1.f, zero = 0.f;
  const __nv_bfloat16* W = (const __nv_bfloat16*)w;
  const __nv_bfloat16* A = (const __nv_bfloat16*)a;
  __nv_bfloat16* C = (__nv_bfloat16*)c;
  /* Row-major (m, n_out) = A W_e^T is column-major (n_out, m) = W_e^T' A^T'. */
  if (form == TW__SEQ_LOOP) {
    for (int i = 0; i < G; i++)
      TW__SEQ_BLAS(cublasGemmEx(s->blas, CUBLAS_OP_T, CUBLAS_OP_N, n_out, s->g_m[i], k, &one,
                                W + (size_t)s->g_e[i] * n_out * k, CUDA_R_16BF, k,
                                A + (size_t)s->g_row0[i] * k, CUDA_R_16BF, k, &zero,
                                C + (size_t)s->g_row0[i] * n_out, CUDA_R_16BF, n_out,
                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return TW_SUCCESS;
  }
  const size_t cap = (size_t)s->W * s->E;
  void** hp = s->h_ptrs + (size_t)which * 3 * cap;
  void** dp = s->d_ptrs + (size_t)which * 3 * cap;
  int* gi = s->gi;
  int *gm = gi, *gn = gi + cap, *gk = gi + 2 * cap, *lda = gi + 3 * cap, *ldb = gi + 4 * cap;
  int *ldc = gi + 5 * cap, *gsize = gi + 6 * cap;
  for (int i = 0; i < G; i++) {
    hp[i] = (void*)(W + (size_t)s->g_e[i] * n_out * k);
    hp[cap + i] = (void*)(A + (size_t)s->g_row0[i] * k);
    hp[2 * cap + i] = (void*)(C + (size_t)s->g_row0[i] * n_out);
    gm[i] = n_out, gn[i] = s->g_m[i], gk[i] = k;
    lda[i] = k, ldb[i] = k, ldc[i] = n_out, gsize[i] = 1;
  }
  /* The pinned table is rewritten only in a later call, after that call's counts have reached
   * the host, i.e. after this copy. */
  TW_CUDA_TRY(cudaMemcpyAsync(dp, hp, 3 * cap * sizeof(void*), cudaMemcpyHostToDevice, stream));
  TW__SEQ_BLAS(cublasGemmGroupedBatchedEx(
      s->blas, s->gop, s->gop + cap, gm, gn, gk, s->galpha, (const void* const*)dp, CUDA_R_16BF,
      lda, (const void* const*)(dp + cap), CUDA_R_16BF, ldb, s->galpha + cap,
      (void* const*)(dp + 2 * cap), CUDA_R_16BF, ldc, G, gsize, CUBLAS_COMPUTE_32F));
  return TW_SUCCESS;
}

tw_status tw__seq_layer_run(tw__seq_layer_t s, const void* x, const int32_t* topk_ids,
                            const float* weights, int32_t tokens, const void* w13, const void* w2,
                            void* out, tw__seq_form form, cudaStream_t stream) {
  TW_CHECK_NULL(s);
  if (s->F == 0 || s->blas == NULL)
    return tw__fail(TW_ERR_STATE, "sequential layer: created for the dispatch only (ffn 0)");
  if (form != TW__SEQ_LOOP && form != TW__SEQ_GROUPED)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "sequential layer: form %d", (int)form);
  if (tokens > 0 && (weights == NULL || out == NULL || w13 == NULL || w2 == NULL))
    return tw__fail(TW_ERR_NULL_POINTER, "sequential layer: weights, out, w13 or w2 is NULL");
  TW_TRY(tw__seq_permute_exchange(s, x, topk_ids, tokens, stream));
  if (cublasSetStream(s->blas, stream) != CUBLAS_STATUS_SUCCESS)
    return tw__fail(TW_ERR_CUDA, "sequential layer: cublasSetStream failed");
  TW_TRY(tw__seq_gemm(s, form, 0, w13, s->recv, s->gu, 2 * s->F, s->H, stream));
  if (s->recv_rows > 0) TW_TRY(tw__swiglu_launch(s->gu, 0, s->h, s->recv_rows, s->F, stream));
  TW_TRY(tw__seq_gemm(s, form, 1, w2, s->h, s->out2, s->H, s->F, stream));
  if (s->W > 1) TW_TRY(tw__seq_exchange(s, 1, stream));
  if (tokens > 0) {
    tw__seq_wsum_kernel<<<(unsigned)tokens, 128, 0, stream>>>((const uint4*)s->ret, s->pos, weights,
                                                              s->K, s->H / 8, (uint4*)out);
    TW_CUDA_TRY(cudaGetLastError());
  }
  return TW_SUCCESS;
}

tw_status tw__seq_recv_rows(tw__seq_layer_t s, const void** recv, int64_t* rows) {
  TW_CHECK_NULL(s);
  if (recv) *recv = s->recv;
  if (rows) *rows = s->recv_rows;
  return TW_SUCCESS;
}

int64_t tw__seq_layer_bytes(tw__seq_layer_t s) {
  return s ? s->bytes : 0;
}

tw_status tw__seq_check_rows(const void* rows, int64_t nrows, const int32_t* src,
                             const void* const* x_ranks, int32_t hidden, unsigned long long* wrong,
                             cudaStream_t stream) {
  if (nrows == 0) return TW_SUCCESS;
  TW_CHECK_NULL(rows);
  TW_CHECK_NULL(src);
  TW_CHECK_NULL(x_ranks);
  TW_CHECK_NULL(wrong);
  tw__seq_check_kernel<<<tw__seq_blocks(nrows, 8), 256, 0, stream>>>((const uint4*)rows, nrows, src,
                                                                     x_ranks, hidden / 8, wrong);
  TW_CUDA_TRY(cudaGetLastError());
  return TW_SUCCESS;
}
