/*
 * baseline.cu: the sequential (cuBLAS + NCCL) and chunked (cuBLAS + copy engine) return paths, and
 * the weighted reduction they share (see baseline.h for what each one models).
 *
 * Both walk the plan's bands, so they compute exactly the rows the overlapped path computes and
 * write exactly the receive layout it writes: a band's valid rows go to recv(dest) +
 * band.dest_offset. Consecutive bands of one (expert, owner) group whose rows are contiguous at
 * both ends merge into one transfer; the sender and the receiver run the same merge over the same
 * band list (the sender's plan), so the NCCL send and receive sequences match.
 *
 * Its length: both paths share the band walk, the merge and the reduction; they are kept in one
 * file so that the two sides of every transfer stay next to each other.
 */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "baseline.h"
#include "checks.h"
#include "core.h"

/* One transfer or GEMM range over the layout: rows [row0, row0 + rows) of local expert `expert`;
 * for a transfer, its first `valid_rows` rows go to rank `peer` at byte `dest_offset` of its
 * receive buffer. */
typedef struct tw__bl_range {
  int32_t expert;
  int32_t row0;
  int32_t rows;
  int32_t valid_rows;
  int32_t peer;
  int32_t pad_;
  int64_t dest_offset;
} tw__bl_range;

/* What is exchanged at creation so that peers can write into this rank's receive buffer. */
typedef struct tw__bl_ipc {
  cudaIpcMemHandle_t handle; /* of the receive buffer */
  uint64_t ptr;              /* its address in the owning process */
  int64_t pid;               /* owning process: same process means no IPC, use ptr */
  int32_t device;
  char pad_[256 - sizeof(cudaIpcMemHandle_t) - 8 - 8 - 4];
} tw__bl_ipc;

struct tw_baseline {
  int32_t rank, world;
  int32_t experts;       /* E: local experts */
  int32_t hidden, ffn;   /* H, F */
  int32_t rows;          /* layout rows, padding included */
  int32_t recv_rows;     /* rows other ranks send here */
  int32_t tokens, top_k; /* this rank's tokens */
  size_t row_bytes;      /* H x 2 */
  ncclComm_t comm;       /* not owned */
  cublasHandle_t cublas;

  int32_t* expert_row0; /* (E) host */
  int32_t* expert_rows; /* (E) host */

  /* The same per-expert GEMMs as one cublasGemmGroupedBatchedEx call: one group per non-empty
   * expert, host arrays of the shapes, and device pointer tables cached per (a, w) pair. */
  int32_t num_groups;
  cublasOperation_t* g_transa; /* (num_groups) */
  cublasOperation_t* g_transb; /* (num_groups) */
  int* g_m;                    /* (num_groups) H */
  int* g_n;                    /* (num_groups) rows of the expert */
  int* g_k;                    /* (num_groups) F */
  int* g_ld_w;                 /* (num_groups) F */
  int* g_ld_a;                 /* (num_groups) F */
  int* g_ld_c;                 /* (num_groups) H */
  int* g_size;                 /* (num_groups) 1 */
  int32_t* g_expert;           /* (num_groups) local expert of each group */
  float* g_alpha;              /* (num_groups) 1 */
  float* g_beta;               /* (num_groups) 0 */
  struct {
    const void* a;
    const void* w;
    void** table; /* device: (3, num_groups) pointers: W_e, A_e, C_e */
  } g_cache[8];
  int32_t g_cache_next;

  tw__bl_range* sends; /* (num_sends) merged remote transfers of this rank, schedule order */
  int32_t num_sends;
  tw__bl_range* recvs; /* (num_recvs) merged transfers to this rank, by source, its order */
  int32_t num_recvs;

  /* Packed exchange: per peer, this rank's rows bound there gathered into one block in the order of
   * the peer's receive buffer, then one ncclSend and one ncclRecv per peer. */
  int32_t packed_ok;          /* 1 when every peer's region is contiguous at both ends */
  int32_t pack_rows;          /* rows sent to all peers */
  void* pack;                 /* (pack_rows, H) bf16 device */
  int32_t* pack_map;          /* (pack_rows) device: layout row of each packed row */
  int64_t* peer_send_row0;    /* (world) first packed row bound to each peer */
  int64_t* peer_send_rows;    /* (world) rows bound to each peer */
  int64_t* peer_recv_off;     /* (world) byte offset of each source's region in recv */
  int64_t* peer_recv_bytes;   /* (world) bytes from each source */
  tw__bl_range* remote_bands; /* (num_remote_bands) this rank's remote bands, schedule order */
  int32_t num_remote_bands;
  tw__bl_range* local_gemms; /* (num_local_gemms) merged local row ranges */
  int32_t num_local_gemms;

  /* Chunk plan for the chunked baseline, rebuilt when chunk_rows changes. */
  int32_t chunk_rows;
  int32_t num_chunks;
  int32_t* chunk_gemm0;      /* (num_remote_bands + 1) first GEMM range of chunk c in chunk_gemms */
  int32_t* chunk_copy0;      /* (num_remote_bands + 1) first copy of chunk c in chunk_copies */
  tw__bl_range* chunk_gemms; /* (num_remote_bands) */
  tw__bl_range* chunk_copies; /* (num_remote_bands) */

  void* c;              /* (rows, H) bf16 device: GEMM output */
  void* recv;           /* (recv_rows, H) bf16 device, cudaMalloc (IPC-exportable) */
  void** peer_recv;     /* (world) peers' receive buffers mapped here; [rank] unused */
  int32_t* peer_opened; /* (world) 1 where peer_recv came from cudaIpcOpenMemHandle */
  int32_t* slot_row;    /* (tokens, k) device */
  float* weights;       /* (tokens, k) device */
  int32_t* fence;       /* (1) device: payload of the cross-rank fence */
  cudaStream_t copy_stream;
  cudaEvent_t* chunk_events; /* (num_remote_bands + 1) */
  cudaEvent_t copies_done;
  /* Phase events (tw__baseline_set_timing): recorded only while timing is on; timed = 1 once a
   * call has recorded all of them. */
  int32_t timing, timed;
  cudaEvent_t t_ev[5]; /* TW__BL_T_* */
};

enum { TW__BL_T_START, TW__BL_T_GEMM_END, TW__BL_T_COMM_END, TW__BL_T_RED_START, TW__BL_T_END };

/* ---- kernels --------------------------------------------------------------------------------- */

/* out[t, :] = sum_j w[t, j] * row(slot_row[t, j]); 8 columns (16 bytes) per thread, fp32 sums in
 * slot order. grid.x walks tokens, grid.y column blocks. */
__global__ void tw__bl_reduce_kernel(const __nv_bfloat16* __restrict__ local,
                                     const __nv_bfloat16* __restrict__ recv,
                                     const int32_t* __restrict__ slot_row,
                                     const float* __restrict__ weights, __nv_bfloat16* out,
                                     int32_t tokens, int32_t k, int32_t hidden, int32_t recv_rows) {
  const int32_t vecs = hidden / 8;
  for (int32_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    for (int32_t v = blockIdx.y * blockDim.x + threadIdx.x; v < vecs; v += gridDim.y * blockDim.x) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int32_t j = 0; j < k; j++) {
        const int32_t r = slot_row[(int64_t)t * k + j];
        const float w = weights[(int64_t)t * k + j];
        const __nv_bfloat16* row =
            r < recv_rows ? recv + (int64_t)r * hidden : local + (int64_t)(r - recv_rows) * hidden;
        const uint4 raw = reinterpret_cast<const uint4*>(row)[v];
        const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
        for (int i = 0; i < 4; i++) {
          const float2 f = __bfloat1622float2(h2[i]);
          acc[2 * i] = fmaf(w, f.x, acc[2 * i]); /* the runtime's reduction's exact order */
          acc[2 * i + 1] = fmaf(w, f.y, acc[2 * i + 1]);
        }
      }
      uint4 o;
      __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
      for (int i = 0; i < 4; i++) o2[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
      reinterpret_cast<uint4*>(out + (int64_t)t * hidden)[v] = o;
    }
  }
}

/* dst row j = src row map[j], 16 bytes per thread. */
__global__ void tw__bl_gather_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                     const int32_t* __restrict__ map, int32_t rows, int32_t vecs) {
  const int64_t n = (int64_t)rows * vecs;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t row = i / vecs, v = i - row * vecs;
    dst[i] = src[(int64_t)map[row] * vecs + v];
  }
}

/* scratch[0] = max |x - ref| bits, scratch[1] = max |ref| bits. Non-negative floats order like
 * their bit patterns, so atomicMax on the bits is a float max; a non-finite x or ref stores +Inf.
 */
__global__ void tw__bl_diff_kernel(const __nv_bfloat16* __restrict__ x,
                                   const __nv_bfloat16* __restrict__ ref, size_t n,
                                   uint32_t* scratch) {
  float dmax = 0.f, rmax = 0.f;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float a = __bfloat162float(x[i]), b = __bfloat162float(ref[i]);
    float d = fabsf(a - b);
    if (!isfinite(a) || !isfinite(b)) d = INFINITY;
    dmax = fmaxf(dmax, d);
    rmax = fmaxf(rmax, fabsf(b));
  }
  for (int off = 16; off > 0; off >>= 1) {
    dmax = fmaxf(dmax, __shfl_xor_sync(0xffffffffu, dmax, off));
    rmax = fmaxf(rmax, __shfl_xor_sync(0xffffffffu, rmax, off));
  }
  if ((threadIdx.x & 31) == 0) {
    atomicMax(&scratch[0], __float_as_uint(dmax));
    atomicMax(&scratch[1], __float_as_uint(rmax));
  }
}

__device__ __forceinline__ uint64_t tw__bl_mix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* Value i depends only on (seed, i): the same buffer comes out for any grid. */
__global__ void tw__bl_fill_kernel(__nv_bfloat16* dst, size_t n, uint64_t seed, float scale) {
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint64_t h = tw__bl_mix(seed * 0x632BE59BD9B4E019ull + i);
    const float u = (float)(h >> 40) * (1.0f / 16777216.0f); /* [0, 1) */
    dst[i] = __float2bfloat16_rn((2.f * u - 1.f) * scale);
  }
}

/* ---- plan walking ---------------------------------------------------------------------------- */

/* Appends band b of `plan` to the range list, merging it into the last range when it continues that
 * range at both ends (same expert and owner, the last range fully valid so far, rows and
 * destination offsets contiguous). Returns the new count. */
static int32_t tw__bl_append(tw__bl_range* list, int32_t n, const tw_band* b, size_t row_bytes,
                             int merge_dest) {
  if (n > 0) {
    tw__bl_range* last = &list[n - 1];
    const int contiguous_rows =
        last->row0 + last->rows == b->row0 && last->expert == b->expert && last->peer == b->dest;
    const int contiguous_dest =
        !merge_dest ||
        (last->valid_rows == last->rows &&
         last->dest_offset + (int64_t)last->valid_rows * (int64_t)row_bytes == b->dest_offset);
    if (contiguous_rows && contiguous_dest) {
      last->rows += b->rows;
      last->valid_rows += b->valid_rows;
      return n;
    }
  }
  tw__bl_range r;
  memset(&r, 0, sizeof r);
  r.expert = b->expert;
  r.row0 = b->row0;
  r.rows = b->rows;
  r.valid_rows = b->valid_rows;
  r.peer = b->dest;
  r.dest_offset = b->dest_offset;
  list[n] = r;
  return n + 1;
}

/* The transfers of `plan`'s rank to rank `dest`: its bands bound there (with valid rows), in band
 * order, merged. Sender and receiver both call this on the sender's plan. Returns the count. */
static int32_t tw__bl_collect(const struct tw_plan* plan, int32_t dest, tw__bl_range* list,
                              size_t row_bytes) {
  int32_t n = 0;
  for (int32_t i = 0; i < plan->num_bands; i++) {
    const tw_band* band = &plan->bands[i];
    if (band->dest == dest && band->valid_rows > 0) n = tw__bl_append(list, n, band, row_bytes, 1);
  }
  return n;
}

/* Builds the chunk plan: remote bands in schedule order, cut into chunks of at least chunk_rows
 * rows (whole bands); per chunk, its GEMM ranges (bands merged by expert and row contiguity) and
 * its copies (merged as transfers). */
static void tw__bl_build_chunks(tw_baseline_t b, int32_t chunk_rows) {
  int32_t nc = 0, ng = 0, ncp = 0, acc = 0;
  for (int32_t i = 0; i < b->num_remote_bands; i++) {
    const tw__bl_range* rb = &b->remote_bands[i];
    if (acc == 0) {
      b->chunk_gemm0[nc] = ng;
      b->chunk_copy0[nc] = ncp;
      nc++;
    }
    tw_band band;
    memset(&band, 0, sizeof band);
    band.expert = rb->expert;
    band.row0 = rb->row0;
    band.rows = rb->rows;
    band.valid_rows = rb->valid_rows;
    band.dest = rb->peer;
    band.dest_offset = rb->dest_offset;
    /* A new chunk starts new lists, so ranges never span chunks. */
    const int32_t g0 = b->chunk_gemm0[nc - 1], c0 = b->chunk_copy0[nc - 1];
    ng = g0 + tw__bl_append(b->chunk_gemms + g0, ng - g0, &band, b->row_bytes, 0);
    ncp = c0 + tw__bl_append(b->chunk_copies + c0, ncp - c0, &band, b->row_bytes, 1);
    acc += rb->rows;
    if (acc >= chunk_rows) acc = 0;
  }
  b->chunk_gemm0[nc] = ng;
  b->chunk_copy0[nc] = ncp;
  b->num_chunks = nc;
  b->chunk_rows = chunk_rows;
}

/* ---- create / destroy ------------------------------------------------------------------------ */

static tw_status tw__bl_alloc_host(void** p, size_t bytes) {
  *p = calloc(1, bytes ? bytes : 1);
  if (*p == NULL)
    return tw__fail(TW_ERR_OUT_OF_MEMORY, "baseline: host allocation of %zu bytes failed", bytes);
  return TW_SUCCESS;
}

static int tw__bl_cmp_offset(const void* x, const void* y) {
  const int64_t a = ((const tw__bl_range*)x)->dest_offset,
                c = ((const tw__bl_range*)y)->dest_offset;
  return a < c ? -1 : a > c ? 1 : 0;
}

/* Sorts a peer's transfers by destination offset and checks that they tile one contiguous byte
 * range; returns its start (or -1 when they do not) and adds its size to *bytes. */
static int64_t tw__bl_contiguous(tw__bl_range* list, int32_t n, size_t row_bytes, int64_t* bytes) {
  qsort(list, (size_t)n, sizeof *list, tw__bl_cmp_offset);
  *bytes = 0;
  for (int32_t i = 0; i < n; i++) {
    if (i > 0 && list[i].dest_offset !=
                     list[i - 1].dest_offset + (int64_t)list[i - 1].valid_rows * (int64_t)row_bytes)
      return -1;
    *bytes += (int64_t)list[i].valid_rows * (int64_t)row_bytes;
  }
  return n > 0 ? list[0].dest_offset : 0;
}

/* The packed exchange's gather map and per-peer regions (see struct tw_baseline). The planner lays
 * each source's rows for one owner out contiguously, so packing is always possible with its plans;
 * packed_ok = 0 (and the packed calls refuse) if a plan ever breaks that. */
static tw_status tw__bl_build_packed(tw_baseline_t b) {
  const int32_t W = b->world;
  TW_TRY(tw__bl_alloc_host((void**)&b->peer_send_row0, sizeof(int64_t) * W));
  TW_TRY(tw__bl_alloc_host((void**)&b->peer_send_rows, sizeof(int64_t) * W));
  TW_TRY(tw__bl_alloc_host((void**)&b->peer_recv_off, sizeof(int64_t) * W));
  TW_TRY(tw__bl_alloc_host((void**)&b->peer_recv_bytes, sizeof(int64_t) * W));
  int64_t rows = 0;
  for (int32_t i = 0; i < b->num_sends; i++) rows += b->sends[i].valid_rows;
  int32_t* map = NULL;
  tw__bl_range* tmp = NULL;
  TW_TRY(tw__bl_alloc_host((void**)&map, sizeof(int32_t) * (size_t)(rows ? rows : 1)));
  const int32_t nmax = b->num_sends > b->num_recvs ? b->num_sends : b->num_recvs;
  if (tw__bl_alloc_host((void**)&tmp, sizeof(tw__bl_range) * (size_t)(nmax ? nmax : 1)) !=
      TW_SUCCESS) {
    free(map);
    return TW_ERR_OUT_OF_MEMORY;
  }
  int ok = 1;
  int64_t j = 0;
  for (int32_t d = 0; d < W; d++) {
    int32_t n = 0;
    for (int32_t i = 0; i < b->num_sends; i++)
      if (b->sends[i].peer == d) tmp[n++] = b->sends[i];
    int64_t bytes = 0;
    if (tw__bl_contiguous(tmp, n, b->row_bytes, &bytes) < 0) ok = 0;
    b->peer_send_row0[d] = j;
    for (int32_t i = 0; i < n; i++)
      for (int32_t r = 0; r < tmp[i].valid_rows; r++) map[j++] = tmp[i].row0 + r;
    b->peer_send_rows[d] = j - b->peer_send_row0[d];
    n = 0;
    for (int32_t i = 0; i < b->num_recvs; i++)
      if (b->recvs[i].peer == d) tmp[n++] = b->recvs[i];
    b->peer_recv_off[d] = tw__bl_contiguous(tmp, n, b->row_bytes, &b->peer_recv_bytes[d]);
    if (b->peer_recv_off[d] < 0) ok = 0;
  }
  free(tmp);
  b->packed_ok = ok;
  b->pack_rows = (int32_t)rows;
  cudaError_t e = cudaMalloc(&b->pack, (size_t)rows * b->row_bytes + 256);
  if (e == cudaSuccess) e = cudaMalloc((void**)&b->pack_map, sizeof(int32_t) * (size_t)rows + 16);
  if (e == cudaSuccess && rows > 0)
    e = cudaMemcpy(b->pack_map, map, sizeof(int32_t) * (size_t)rows, cudaMemcpyHostToDevice);
  free(map);
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "baseline: packed-exchange buffers: %s", cudaGetErrorString(e));
  return TW_SUCCESS;
}

static tw_status tw__bl_create(tw_baseline_t b, const struct tw_plan* const* plans, int32_t world,
                               int32_t rank, tw_routing_t routing, ncclComm_t comm) {
  const struct tw_plan* plan = plans[rank];
  const tw_problem* p = &plan->problem;
  b->rank = rank;
  b->world = world;
  b->experts = plan->local_experts;
  b->hidden = p->hidden;
  b->ffn = p->ffn;
  b->rows = plan->rows;
  b->recv_rows = plan->recv_rows;
  b->top_k = p->top_k;
  b->row_bytes = (size_t)p->hidden * 2;
  b->comm = comm;
  b->chunk_rows = -1;

  const int32_t* ids = NULL;
  const float* gate = NULL;
  TW_TRY(tw_routing_rank(routing, rank, &b->tokens, &ids, &gate));
  (void)ids;

  const int32_t E = b->experts, nb = plan->num_bands;
  TW_TRY(tw__bl_alloc_host((void**)&b->expert_row0, sizeof(int32_t) * E));
  TW_TRY(tw__bl_alloc_host((void**)&b->expert_rows, sizeof(int32_t) * E));
  memcpy(b->expert_row0, plan->expert_row0, sizeof(int32_t) * E);
  memcpy(b->expert_rows, plan->expert_rows, sizeof(int32_t) * E);
  TW_TRY(tw__bl_alloc_host((void**)&b->g_transa, sizeof(cublasOperation_t) * E));
  TW_TRY(tw__bl_alloc_host((void**)&b->g_transb, sizeof(cublasOperation_t) * E));
  TW_TRY(tw__bl_alloc_host((void**)&b->g_m, sizeof(int) * E));
  TW_TRY(tw__bl_alloc_host((void**)&b->g_n, sizeof(int) * E));
  TW_TRY(tw__bl_alloc_host((void**)&b->g_k, sizeof(int) * E));
  TW_TRY(tw__bl_alloc_host((void**)&b->g_ld_w, sizeof(int) * E));
  TW_TRY(tw__bl_alloc_host((void**)&b->g_ld_a, sizeof(int) * E));
  TW_TRY(tw__bl_alloc_host((void**)&b->g_ld_c, sizeof(int) * E));
  TW_TRY(tw__bl_alloc_host((void**)&b->g_size, sizeof(int) * E));
  TW_TRY(tw__bl_alloc_host((void**)&b->g_expert, sizeof(int32_t) * E));
  TW_TRY(tw__bl_alloc_host((void**)&b->g_alpha, sizeof(float) * E));
  TW_TRY(tw__bl_alloc_host((void**)&b->g_beta, sizeof(float) * E));
  for (int32_t e = 0; e < E; e++) {
    if (b->expert_rows[e] <= 0) continue;
    const int32_t g = b->num_groups++;
    /* Same operand mapping as tw__bl_gemm_range. */
    b->g_transa[g] = CUBLAS_OP_T;
    b->g_transb[g] = CUBLAS_OP_N;
    b->g_m[g] = b->hidden;
    b->g_n[g] = b->expert_rows[e];
    b->g_k[g] = b->ffn;
    b->g_ld_w[g] = b->ffn;
    b->g_ld_a[g] = b->ffn;
    b->g_ld_c[g] = b->hidden;
    b->g_size[g] = 1;
    b->g_expert[g] = e;
    b->g_alpha[g] = 1.f;
    b->g_beta[g] = 0.f;
  }

  /* This rank's side: remote bands (schedule order), local GEMM ranges, and the sends, collected
   * per destination exactly as that destination collects its receives from us. */
  TW_TRY(tw__bl_alloc_host((void**)&b->remote_bands, sizeof(tw__bl_range) * nb));
  TW_TRY(tw__bl_alloc_host((void**)&b->sends, sizeof(tw__bl_range) * nb));
  TW_TRY(tw__bl_alloc_host((void**)&b->local_gemms, sizeof(tw__bl_range) * nb));
  for (int32_t i = 0; i < nb; i++) {
    const tw_band* band = &plan->bands[i];
    if (band->rows <= 0) continue;
    if (band->dest != rank) {
      if (band->dest < 0 || band->dest >= world || band->dest_offset < 0)
        return tw__fail(TW_ERR_INTERNAL, "baseline: band %d has destination %d, offset %lld", i,
                        band->dest, (long long)band->dest_offset);
      tw__bl_range r = {band->expert, band->row0, band->rows,       band->valid_rows,
                        band->dest,   0,          band->dest_offset};
      b->remote_bands[b->num_remote_bands++] = r;
    } else {
      b->num_local_gemms = tw__bl_append(b->local_gemms, b->num_local_gemms, band, b->row_bytes, 0);
    }
  }
  for (int32_t d = 0; d < world; d++)
    if (d != rank) b->num_sends += tw__bl_collect(plan, d, b->sends + b->num_sends, b->row_bytes);

  /* Receive side: every other rank's bands bound here, in that rank's order. */
  int64_t max_recv = 0;
  for (int32_t s = 0; s < world; s++)
    if (s != rank) max_recv += plans[s]->num_bands;
  TW_TRY(tw__bl_alloc_host((void**)&b->recvs, sizeof(tw__bl_range) * (size_t)max_recv));
  int64_t recv_valid = 0;
  for (int32_t s = 0; s < world; s++) {
    if (s == rank) continue;
    if (plans[s]->problem.hidden != p->hidden || plans[s]->rank != s)
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "tw__baseline_create: plans[%d] is not rank %d's plan of the same problem; "
                      "pass every rank's plan in rank order",
                      s, s);
    const int32_t first = b->num_recvs;
    b->num_recvs += tw__bl_collect(plans[s], rank, b->recvs + first, b->row_bytes);
    for (int32_t i = first; i < b->num_recvs; i++) {
      b->recvs[i].peer = s; /* the source, for ncclRecv */
      recv_valid += b->recvs[i].valid_rows;
    }
  }
  if (recv_valid != b->recv_rows)
    return tw__fail(TW_ERR_INTERNAL,
                    "baseline: peers' plans send %lld rows here but this plan expects %d",
                    (long long)recv_valid, b->recv_rows);

  TW_TRY(tw__bl_build_packed(b));

  /* Chunk plan storage. */
  const int32_t nrb = b->num_remote_bands;
  TW_TRY(tw__bl_alloc_host((void**)&b->chunk_gemm0, sizeof(int32_t) * (nrb + 1)));
  TW_TRY(tw__bl_alloc_host((void**)&b->chunk_copy0, sizeof(int32_t) * (nrb + 1)));
  TW_TRY(tw__bl_alloc_host((void**)&b->chunk_gemms, sizeof(tw__bl_range) * (nrb + 1)));
  TW_TRY(tw__bl_alloc_host((void**)&b->chunk_copies, sizeof(tw__bl_range) * (nrb + 1)));
  TW_TRY(tw__bl_alloc_host((void**)&b->chunk_events, sizeof(cudaEvent_t) * (nrb + 1)));
  TW_TRY(tw__bl_alloc_host((void**)&b->peer_recv, sizeof(void*) * world));
  TW_TRY(tw__bl_alloc_host((void**)&b->peer_opened, sizeof(int32_t) * world));

  /* Device state. */
  TW_CUDA_TRY(cudaMalloc(&b->c, (size_t)b->rows * b->row_bytes + 256));
  TW_CUDA_TRY(cudaMalloc(&b->recv, (size_t)b->recv_rows * b->row_bytes + 256));
  const size_t nslots = (size_t)b->tokens * (size_t)b->top_k;
  TW_CUDA_TRY(cudaMalloc((void**)&b->slot_row, sizeof(int32_t) * nslots + 16));
  TW_CUDA_TRY(cudaMalloc((void**)&b->weights, sizeof(float) * nslots + 16));
  TW_CUDA_TRY(cudaMalloc((void**)&b->fence, 256));
  if (nslots > 0) {
    TW_CUDA_TRY(
        cudaMemcpy(b->slot_row, plan->slot_row, sizeof(int32_t) * nslots, cudaMemcpyHostToDevice));
    TW_CUDA_TRY(cudaMemcpy(b->weights, gate, sizeof(float) * nslots, cudaMemcpyHostToDevice));
  }
  TW_CUDA_TRY(cudaMemset(b->fence, 0, 256));
  TW_CUDA_TRY(cudaStreamCreateWithFlags(&b->copy_stream, cudaStreamNonBlocking));
  for (int32_t i = 0; i <= nrb; i++)
    TW_CUDA_TRY(cudaEventCreateWithFlags(&b->chunk_events[i], cudaEventDisableTiming));
  TW_CUDA_TRY(cudaEventCreateWithFlags(&b->copies_done, cudaEventDisableTiming));
  for (int i = 0; i < 5; i++) TW_CUDA_TRY(cudaEventCreate(&b->t_ev[i]));
  TW_CUBLAS_TRY(cublasCreate(&b->cublas));

  /* Exchange receive buffers: IPC handles where ranks are processes, raw pointers (and peer access)
   * where they share this process. */
  int device = 0;
  TW_CUDA_TRY(cudaGetDevice(&device));
  tw__bl_ipc mine;
  memset(&mine, 0, sizeof mine);
  TW_CUDA_TRY(cudaIpcGetMemHandle(&mine.handle, b->recv));
  mine.ptr = (uint64_t)(uintptr_t)b->recv;
  mine.pid = (int64_t)getpid();
  mine.device = device;
  tw__bl_ipc* all = NULL;
  TW_TRY(tw__bl_alloc_host((void**)&all, sizeof(tw__bl_ipc) * world));
  void* dev_ipc = NULL;
  tw_status st = TW_SUCCESS;
  if (cudaMalloc(&dev_ipc, sizeof(tw__bl_ipc) * (world + 1)) != cudaSuccess) {
    free(all);
    return tw__fail(TW_ERR_OUT_OF_MEMORY, "baseline: cudaMalloc of the IPC exchange failed");
  }
  cudaStream_t s0 = NULL;
  cudaError_t ce = cudaMemcpy(dev_ipc, &mine, sizeof mine, cudaMemcpyHostToDevice);
  ncclResult_t nr = ncclSuccess;
  if (ce == cudaSuccess) {
    nr = ncclAllGather(dev_ipc, (char*)dev_ipc + sizeof mine, sizeof mine, ncclUint8, comm, s0);
    if (nr == ncclSuccess) ce = cudaStreamSynchronize(s0);
    if (nr == ncclSuccess && ce == cudaSuccess)
      ce = cudaMemcpy(all, (char*)dev_ipc + sizeof mine, sizeof(tw__bl_ipc) * world,
                      cudaMemcpyDeviceToHost);
  }
  cudaFree(dev_ipc);
  if (nr != ncclSuccess)
    st = tw__fail(TW_ERR_NCCL, "baseline: allgather of receive-buffer handles failed: %s",
                  ncclGetErrorString(nr));
  else if (ce != cudaSuccess)
    st = tw__fail(TW_ERR_CUDA, "baseline: handle exchange failed: %s", cudaGetErrorString(ce));
  for (int32_t r = 0; st == TW_SUCCESS && r < world; r++) {
    if (r == rank) continue;
    if (all[r].pid == mine.pid) {
      ce = cudaDeviceEnablePeerAccess(all[r].device, 0);
      if (ce == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();
        ce = cudaSuccess;
      }
      if (ce != cudaSuccess && all[r].device != device)
        st = tw__fail(TW_ERR_CUDA, "baseline: peer access to device %d failed: %s", all[r].device,
                      cudaGetErrorString(ce));
      b->peer_recv[r] = (void*)(uintptr_t)all[r].ptr;
    } else {
      ce = cudaIpcOpenMemHandle(&b->peer_recv[r], all[r].handle, cudaIpcMemLazyEnablePeerAccess);
      if (ce != cudaSuccess)
        st = tw__fail(TW_ERR_CUDA,
                      "baseline: cudaIpcOpenMemHandle of rank %d's receive buffer failed: %s; the "
                      "copy-engine baseline needs peer-accessible GPUs",
                      r, cudaGetErrorString(ce));
      else
        b->peer_opened[r] = 1;
    }
  }
  free(all);
  return st;
}

extern "C" tw_status tw__baseline_create(const struct tw_plan* const* plans, int32_t world,
                                         int32_t rank, tw_routing_t routing, ncclComm_t comm,
                                         tw_baseline_t* baseline) {
  TW_CHECK_NULL(plans);
  TW_CHECK_NULL(routing);
  TW_CHECK_NULL(baseline);
  *baseline = NULL;
  if (world < 1 || rank < 0 || rank >= world)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "tw__baseline_create: rank %d of world %d", rank,
                    world);
  for (int32_t r = 0; r < world; r++)
    if (plans[r] == NULL)
      return tw__fail(TW_ERR_NULL_POINTER, "tw__baseline_create: plans[%d] is NULL", r);
  if (plans[rank]->problem.world_size != world)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw__baseline_create: the plan is for %d ranks, the call says %d",
                    plans[rank]->problem.world_size, world);
  if (plans[rank]->problem.dtype != TW_BF16)
    return tw__fail(TW_ERR_UNSUPPORTED, "tw__baseline_create: only bf16 is supported");
  tw_baseline_t b = (tw_baseline_t)calloc(1, sizeof(struct tw_baseline));
  if (b == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "tw__baseline_create: out of host memory");
  tw_status st = tw__bl_create(b, plans, world, rank, routing, comm);
  if (st != TW_SUCCESS) {
    char saved[1024];
    snprintf(saved, sizeof saved, "%s", tw_last_error());
    tw__baseline_destroy(b);
    return tw__fail(st, "%s", saved);
  }
  *baseline = b;
  return TW_SUCCESS;
}

extern "C" tw_status tw__baseline_destroy(tw_baseline_t b) {
  if (b == NULL) return TW_SUCCESS;
  if (b->peer_recv && b->peer_opened)
    for (int32_t r = 0; r < b->world; r++)
      if (b->peer_opened[r]) cudaIpcCloseMemHandle(b->peer_recv[r]);
  if (b->cublas) cublasDestroy(b->cublas);
  if (b->chunk_events)
    for (int32_t i = 0; i <= b->num_remote_bands; i++)
      if (b->chunk_events[i]) cudaEventDestroy(b->chunk_events[i]);
  if (b->copies_done) cudaEventDestroy(b->copies_done);
  for (int i = 0; i < 5; i++)
    if (b->t_ev[i]) cudaEventDestroy(b->t_ev[i]);
  if (b->copy_stream) cudaStreamDestroy(b->copy_stream);
  cudaFree(b->c);
  cudaFree(b->recv);
  cudaFree(b->slot_row);
  cudaFree(b->weights);
  cudaFree(b->fence);
  free(b->expert_row0);
  free(b->expert_rows);
  for (int i = 0; i < 8; i++) cudaFree(b->g_cache[i].table);
  free(b->g_transa);
  free(b->g_transb);
  free(b->g_m);
  free(b->g_n);
  free(b->g_k);
  free(b->g_ld_w);
  free(b->g_ld_a);
  free(b->g_ld_c);
  free(b->g_size);
  free(b->g_expert);
  free(b->g_alpha);
  free(b->g_beta);
  free(b->sends);
  free(b->recvs);
  cudaFree(b->pack);
  cudaFree(b->pack_map);
  free(b->peer_send_row0);
  free(b->peer_send_rows);
  free(b->peer_recv_off);
  free(b->peer_recv_bytes);
  free(b->remote_bands);
  free(b->local_gemms);
  free(b->chunk_gemm0);
  free(b->chunk_copy0);
  free(b->chunk_gemms);
  free(b->chunk_copies);
  free(b->chunk_events);
  free(b->peer_recv);
  free(b->peer_opened);
  free(b);
  return TW_SUCCESS;
}

/* ---- the pieces ------------------------------------------------------------------------------ */

/* C[row0 : row0 + rows, :] = A[row0 : row0 + rows, :] W_e^T, all row-major. cuBLAS is column-major:
 * the same memory is C^T (H x rows, ld H) = W_e (F x H view, ld F, op T) times A^T (F x rows view,
 * ld F, op N). */
static tw_status tw__bl_gemm_range(tw_baseline_t b, const void* a, const void* w, int32_t expert,
                                   int32_t row0, int32_t rows) {
  if (rows <= 0) return TW_SUCCESS;
  const float alpha = 1.f, beta = 0.f;
  const char* wa = (const char*)w + (size_t)expert * b->hidden * b->ffn * 2;
  const char* aa = (const char*)a + (size_t)row0 * b->ffn * 2;
  char* cc = (char*)b->c + (size_t)row0 * b->row_bytes;
  TW_CUBLAS_TRY(cublasGemmEx(b->cublas, CUBLAS_OP_T, CUBLAS_OP_N, b->hidden, rows, b->ffn, &alpha,
                             wa, CUDA_R_16BF, b->ffn, aa, CUDA_R_16BF, b->ffn, &beta, cc,
                             CUDA_R_16BF, b->hidden, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return TW_SUCCESS;
}

static tw_status tw__bl_check_io(tw_baseline_t b, const void* a, const void* w, const void* out) {
  TW_CHECK_NULL(b);
  if (a == NULL || w == NULL || (out == NULL && b->tokens > 0))
    return tw__fail(TW_ERR_NULL_POINTER, "baseline: a, w and out must be device pointers");
  return TW_SUCCESS;
}

extern "C" tw_status tw__baseline_gemm(tw_baseline_t b, const void* a, const void* w,
                                       cudaStream_t stream) {
  TW_TRY(tw__bl_check_io(b, a, w, b ? b->c : NULL));
  TW_CUBLAS_TRY(cublasSetStream(b->cublas, stream));
  for (int32_t e = 0; e < b->experts; e++)
    TW_TRY(tw__bl_gemm_range(b, a, w, e, b->expert_row0[e], b->expert_rows[e]));
  return TW_SUCCESS;
}

extern "C" tw_status tw__baseline_exchange(tw_baseline_t b, cudaStream_t stream) {
  TW_CHECK_NULL(b);
  if (b->world == 1) return TW_SUCCESS;
  /* One group: NCCL matches the sends and receives of one peer pair in posting order, which is the
   * sender's band order on both sides (see the file comment). */
  TW_NCCL_TRY(ncclGroupStart());
  for (int32_t i = 0; i < b->num_sends; i++) {
    const tw__bl_range* s = &b->sends[i];
    ncclResult_t r =
        ncclSend((const char*)b->c + (size_t)s->row0 * b->row_bytes,
                 (size_t)s->valid_rows * b->row_bytes, ncclUint8, s->peer, b->comm, stream);
    if (r != ncclSuccess) {
      ncclGroupEnd();
      return tw__fail(TW_ERR_NCCL, "baseline: ncclSend to %d failed: %s", s->peer,
                      ncclGetErrorString(r));
    }
  }
  for (int32_t i = 0; i < b->num_recvs; i++) {
    const tw__bl_range* s = &b->recvs[i];
    ncclResult_t r = ncclRecv((char*)b->recv + s->dest_offset, (size_t)s->valid_rows * b->row_bytes,
                              ncclUint8, s->peer, b->comm, stream);
    if (r != ncclSuccess) {
      ncclGroupEnd();
      return tw__fail(TW_ERR_NCCL, "baseline: ncclRecv from %d failed: %s", s->peer,
                      ncclGetErrorString(r));
    }
  }
  TW_NCCL_TRY(ncclGroupEnd());
  return TW_SUCCESS;
}

extern "C" tw_status tw__baseline_exchange_packed(tw_baseline_t b, cudaStream_t stream) {
  TW_CHECK_NULL(b);
  if (b->world == 1) return TW_SUCCESS;
  if (!b->packed_ok)
    return tw__fail(TW_ERR_UNSUPPORTED,
                    "baseline: a peer's rows are not contiguous in its receive buffer; use the "
                    "per-group exchange");
  if (b->pack_rows > 0) {
    const int32_t vecs = b->hidden / 8;
    const int64_t n = (int64_t)b->pack_rows * vecs;
    const int blocks = (int)((n + 255) / 256 < 8192 ? (n + 255) / 256 : 8192);
    tw__bl_gather_kernel<<<blocks, 256, 0, stream>>>((const uint4*)b->c, (uint4*)b->pack,
                                                     b->pack_map, b->pack_rows, vecs);
    TW_CUDA_TRY(cudaGetLastError());
  }
  TW_NCCL_TRY(ncclGroupStart());
  for (int32_t d = 0; d < b->world; d++) {
    if (d == b->rank) continue;
    ncclResult_t r = ncclSuccess;
    if (b->peer_send_rows[d] > 0)
      r = ncclSend((const char*)b->pack + (size_t)b->peer_send_row0[d] * b->row_bytes,
                   (size_t)b->peer_send_rows[d] * b->row_bytes, ncclUint8, d, b->comm, stream);
    if (r == ncclSuccess && b->peer_recv_bytes[d] > 0)
      r = ncclRecv((char*)b->recv + b->peer_recv_off[d], (size_t)b->peer_recv_bytes[d], ncclUint8,
                   d, b->comm, stream);
    if (r != ncclSuccess) {
      ncclGroupEnd();
      return tw__fail(TW_ERR_NCCL, "baseline: packed exchange with rank %d failed: %s", d,
                      ncclGetErrorString(r));
    }
  }
  TW_NCCL_TRY(ncclGroupEnd());
  return TW_SUCCESS;
}

extern "C" tw_status tw__baseline_reduce(tw_baseline_t b, const void* local, const void* recv,
                                         void* out, cudaStream_t stream) {
  TW_CHECK_NULL(b);
  if (b->tokens == 0) return TW_SUCCESS;
  if (local == NULL || recv == NULL || out == NULL)
    return tw__fail(TW_ERR_NULL_POINTER, "tw__baseline_reduce: local, recv and out are required");
  const int32_t vecs = b->hidden / 8;
  const int threads = vecs < 128 ? 32 * ((vecs + 31) / 32) : 128;
  const dim3 grid((unsigned)(b->tokens < (1 << 24) ? b->tokens : (1 << 24)),
                  (unsigned)((vecs + threads - 1) / threads));
  tw__bl_reduce_kernel<<<grid, threads, 0, stream>>>(
      (const __nv_bfloat16*)local, (const __nv_bfloat16*)recv, b->slot_row, b->weights,
      (__nv_bfloat16*)out, b->tokens, b->top_k, b->hidden, b->recv_rows);
  TW_CUDA_TRY(cudaGetLastError());
  return TW_SUCCESS;
}

/* Device pointer table of (a, w) for the grouped call: looked up in a small cache, built and
 * uploaded synchronously on a miss (the first call with new inputs; never inside a timed loop that
 * reuses its inputs). */
static tw_status tw__bl_group_table(tw_baseline_t b, const void* a, const void* w, void*** table) {
  for (int i = 0; i < 8; i++)
    if (b->g_cache[i].table && b->g_cache[i].a == a && b->g_cache[i].w == w) {
      *table = b->g_cache[i].table;
      return TW_SUCCESS;
    }
  const int slot = b->g_cache_next;
  b->g_cache_next = (b->g_cache_next + 1) % 8;
  const size_t ng = (size_t)b->num_groups;
  void** host = (void**)malloc(sizeof(void*) * 3 * (ng ? ng : 1));
  if (host == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "baseline: out of host memory");
  for (size_t g = 0; g < ng; g++) {
    const int32_t e = b->g_expert[g];
    host[g] = (char*)w + (size_t)e * b->hidden * b->ffn * 2;
    host[ng + g] = (char*)a + (size_t)b->expert_row0[e] * b->ffn * 2;
    host[2 * ng + g] = (char*)b->c + (size_t)b->expert_row0[e] * b->row_bytes;
  }
  cudaError_t e = cudaSuccess;
  /* Evicting: a call still in flight may read this table; the upload below must not race it. */
  if (b->g_cache[slot].table != NULL) e = cudaDeviceSynchronize();
  if (e == cudaSuccess && b->g_cache[slot].table == NULL)
    e = cudaMalloc((void**)&b->g_cache[slot].table, sizeof(void*) * 3 * (ng ? ng : 1));
  if (e == cudaSuccess)
    e = cudaMemcpy(b->g_cache[slot].table, host, sizeof(void*) * 3 * ng, cudaMemcpyHostToDevice);
  free(host);
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "baseline: uploading the grouped GEMM's pointers failed: %s",
                    cudaGetErrorString(e));
  b->g_cache[slot].a = a;
  b->g_cache[slot].w = w;
  *table = b->g_cache[slot].table;
  return TW_SUCCESS;
}

extern "C" tw_status tw__baseline_gemm_grouped(tw_baseline_t b, const void* a, const void* w,
                                               cudaStream_t stream) {
  TW_TRY(tw__bl_check_io(b, a, w, b ? b->c : NULL));
  if (b->num_groups == 0) return TW_SUCCESS;
  void** table = NULL;
  TW_TRY(tw__bl_group_table(b, a, w, &table));
  const int ng = b->num_groups;
  TW_CUBLAS_TRY(cublasSetStream(b->cublas, stream));
  TW_CUBLAS_TRY(cublasGemmGroupedBatchedEx(
      b->cublas, b->g_transa, b->g_transb, b->g_m, b->g_n, b->g_k, b->g_alpha,
      (const void* const*)table, CUDA_R_16BF, b->g_ld_w, (const void* const*)(table + ng),
      CUDA_R_16BF, b->g_ld_a, b->g_beta, table + 2 * ng, CUDA_R_16BF, b->g_ld_c, ng, b->g_size,
      CUBLAS_COMPUTE_32F));
  return TW_SUCCESS;
}

/* Records phase event `which` on `stream` while timing is on. */
static tw_status tw__bl_mark(tw_baseline_t b, int which, cudaStream_t stream) {
  if (!b->timing) return TW_SUCCESS;
  TW_CUDA_TRY(cudaEventRecord(b->t_ev[which], stream));
  if (which == TW__BL_T_END) b->timed = 1;
  return TW_SUCCESS;
}

/* The sequential forms: GEMM, exchange, reduction, all on `stream`. */
static tw_status tw__bl_sequential(tw_baseline_t b, const void* a, const void* w, void* out,
                                   cudaStream_t stream,
                                   tw_status (*gemm)(tw_baseline_t, const void*, const void*,
                                                     cudaStream_t),
                                   tw_status (*exchange)(tw_baseline_t, cudaStream_t)) {
  TW_TRY(tw__bl_check_io(b, a, w, out));
  TW_TRY(tw__bl_mark(b, TW__BL_T_START, stream));
  TW_TRY(gemm(b, a, w, stream));
  TW_TRY(tw__bl_mark(b, TW__BL_T_GEMM_END, stream));
  TW_TRY(exchange(b, stream));
  TW_TRY(tw__bl_mark(b, TW__BL_T_COMM_END, stream));
  TW_TRY(tw__bl_mark(b, TW__BL_T_RED_START, stream));
  TW_TRY(tw__baseline_reduce(b, b->c, b->recv, out, stream));
  return tw__bl_mark(b, TW__BL_T_END, stream);
}

extern "C" tw_status tw__baseline_sequential_grouped(tw_baseline_t b, const void* a, const void* w,
                                                     void* out, cudaStream_t stream) {
  return tw__bl_sequential(b, a, w, out, stream, tw__baseline_gemm_grouped, tw__baseline_exchange);
}

extern "C" tw_status tw__baseline_sequential_packed(tw_baseline_t b, const void* a, const void* w,
                                                    void* out, cudaStream_t stream) {
  return tw__bl_sequential(b, a, w, out, stream, tw__baseline_gemm, tw__baseline_exchange_packed);
}

extern "C" tw_status tw__baseline_sequential(tw_baseline_t b, const void* a, const void* w,
                                             void* out, cudaStream_t stream) {
  return tw__bl_sequential(b, a, w, out, stream, tw__baseline_gemm, tw__baseline_exchange);
}

extern "C" tw_status tw__baseline_set_timing(tw_baseline_t b, int on) {
  TW_CHECK_NULL(b);
  b->timing = on != 0;
  b->timed = 0;
  return TW_SUCCESS;
}

extern "C" tw_status tw__baseline_timeline(tw_baseline_t b, tw__bl_timeline* t) {
  TW_CHECK_NULL(b);
  TW_CHECK_NULL(t);
  if (!b->timed)
    return tw__fail(TW_ERR_STATE,
                    "tw__baseline_timeline: no sequential or chunked call has run with timing on "
                    "since tw__baseline_set_timing");
  TW_CUDA_TRY(cudaEventSynchronize(b->t_ev[TW__BL_T_END]));
  float* out[4] = {&t->gemm_end_ms, &t->comm_end_ms, &t->reduce_start_ms, &t->total_ms};
  for (int i = 0; i < 4; i++)
    TW_CUDA_TRY(cudaEventElapsedTime(out[i], b->t_ev[TW__BL_T_START], b->t_ev[i + 1]));
  return TW_SUCCESS;
}

/* Cross-rank fence on `stream`: a one-element allreduce completes on a rank only after every rank
 * has reached it in stream order, i.e. after their copy-engine writes into this rank's receive
 * buffer (joined into their streams before the fence) have completed. */
static tw_status tw__bl_fence(tw_baseline_t b, cudaStream_t stream) {
  if (b->world == 1) return TW_SUCCESS;
  TW_NCCL_TRY(ncclAllReduce(b->fence, b->fence + 1, 1, ncclInt32, ncclSum, b->comm, stream));
  return TW_SUCCESS;
}

static tw_status tw__bl_copy_ranges(tw_baseline_t b, const tw__bl_range* list, int32_t n,
                                    cudaStream_t stream) {
  for (int32_t i = 0; i < n; i++) {
    const tw__bl_range* r = &list[i];
    if (r->valid_rows <= 0) continue;
    TW_CUDA_TRY(cudaMemcpyAsync((char*)b->peer_recv[r->peer] + r->dest_offset,
                                (const char*)b->c + (size_t)r->row0 * b->row_bytes,
                                (size_t)r->valid_rows * b->row_bytes, cudaMemcpyDeviceToDevice,
                                stream));
  }
  return TW_SUCCESS;
}

extern "C" tw_status tw__baseline_chunked(tw_baseline_t b, const void* a, const void* w, void* out,
                                          int32_t chunk_rows, cudaStream_t stream) {
  TW_TRY(tw__bl_check_io(b, a, w, out));
  if (chunk_rows < 1)
    return tw__fail(TW_ERR_INVALID_SIZE, "tw__baseline_chunked: chunk_rows %d must be >= 1",
                    chunk_rows);
  if (chunk_rows != b->chunk_rows) tw__bl_build_chunks(b, chunk_rows);
  TW_TRY(tw__bl_mark(b, TW__BL_T_START, stream));
  TW_CUBLAS_TRY(cublasSetStream(b->cublas, stream));
  /* The copy stream must not run ahead of anything the caller queued before this call. */
  TW_CUDA_TRY(cudaEventRecord(b->chunk_events[b->num_chunks], stream));
  TW_CUDA_TRY(cudaStreamWaitEvent(b->copy_stream, b->chunk_events[b->num_chunks], 0));
  for (int32_t c = 0; c < b->num_chunks; c++) {
    for (int32_t g = b->chunk_gemm0[c]; g < b->chunk_gemm0[c + 1]; g++) {
      const tw__bl_range* r = &b->chunk_gemms[g];
      TW_TRY(tw__bl_gemm_range(b, a, w, r->expert, r->row0, r->rows));
    }
    /* The chunk's rows are final once the GEMMs queued before this event have run. */
    TW_CUDA_TRY(cudaEventRecord(b->chunk_events[c], stream));
    TW_CUDA_TRY(cudaStreamWaitEvent(b->copy_stream, b->chunk_events[c], 0));
    TW_TRY(tw__bl_copy_ranges(b, b->chunk_copies + b->chunk_copy0[c],
                              b->chunk_copy0[c + 1] - b->chunk_copy0[c], b->copy_stream));
  }
  for (int32_t g = 0; g < b->num_local_gemms; g++) {
    const tw__bl_range* r = &b->local_gemms[g];
    TW_TRY(tw__bl_gemm_range(b, a, w, r->expert, r->row0, r->rows));
  }
  TW_TRY(tw__bl_mark(b, TW__BL_T_GEMM_END, stream));
  TW_TRY(tw__bl_mark(b, TW__BL_T_COMM_END, b->copy_stream));
  TW_CUDA_TRY(cudaEventRecord(b->copies_done, b->copy_stream));
  TW_CUDA_TRY(cudaStreamWaitEvent(stream, b->copies_done, 0));
  TW_TRY(tw__bl_fence(b, stream));
  TW_TRY(tw__bl_mark(b, TW__BL_T_RED_START, stream));
  TW_TRY(tw__baseline_reduce(b, b->c, b->recv, out, stream));
  return tw__bl_mark(b, TW__BL_T_END, stream);
}

/* ---- checks and inputs ----------------------------------------------------------------------- */

extern "C" tw_status tw__baseline_rel_diff(const void* x, const void* ref, size_t n,
                                           uint32_t* scratch, cudaStream_t stream, double* rel) {
  TW_CHECK_NULL(rel);
  *rel = 0.0;
  if (n == 0) return TW_SUCCESS;
  TW_CHECK_NULL(x);
  TW_CHECK_NULL(ref);
  TW_CHECK_NULL(scratch);
  TW_CUDA_TRY(cudaMemsetAsync(scratch, 0, 2 * sizeof(uint32_t), stream));
  const size_t blocks = (n + 255) / 256 < 2048 ? (n + 255) / 256 : 2048;
  tw__bl_diff_kernel<<<(unsigned)blocks, 256, 0, stream>>>((const __nv_bfloat16*)x,
                                                           (const __nv_bfloat16*)ref, n, scratch);
  TW_CUDA_TRY(cudaGetLastError());
  uint32_t h[2] = {0, 0};
  TW_CUDA_TRY(cudaMemcpyAsync(h, scratch, sizeof h, cudaMemcpyDeviceToHost, stream));
  TW_CUDA_TRY(cudaStreamSynchronize(stream));
  float d, r;
  memcpy(&d, &h[0], sizeof d);
  memcpy(&r, &h[1], sizeof r);
  *rel = r > 0.f ? (double)d / (double)r : (d > 0.f ? INFINITY : 0.0);
  return TW_SUCCESS;
}

extern "C" tw_status tw__baseline_fill_random(void* dst, size_t n, uint64_t seed, float scale,
                                              cudaStream_t stream) {
  if (n == 0) return TW_SUCCESS;
  TW_CHECK_NULL(dst);
  const size_t blocks = (n + 255) / 256 < 4096 ? (n + 255) / 256 : 4096;
  tw__bl_fill_kernel<<<(unsigned)blocks, 256, 0, stream>>>((__nv_bfloat16*)dst, n, seed, scale);
  TW_CUDA_TRY(cudaGetLastError());
  return TW_SUCCESS;
}
