/*
 * reduce_add_lab.cu: can the consumer add rows into the owner's output instead of landing them in
 * a receive buffer that the owner's reduction reads back? (dev/NOTES.md section 19; issue #4's
 * efficiency bar.) The owner's reduction reads every (token, k) row and writes every token after
 * the producer ends, at device-memory speed (section 15): it can only be hidden by a dataflow that
 * never lands the rows. Hopper's bulk reduction (cp.reduce.async.bulk .add.noftz.bf16) adds a
 * shared-memory row to a global one in the L2 that holds it, also a peer GPU's over NVLink. This
 * lab measures, on 2 GPUs joined by NVLink, what the consumer's loop (bulk load of a row into
 * shared memory, then a bulk store of it) moves per CTA and in all with C CTAs when its store is
 * such an add to a scattered token row, against the plain store to consecutive rows that the
 * consumer issues today, each to the peer and to local memory; and it checks the add's arithmetic
 * bit for bit: dst = bf16(float(dst) + float(src)), rounded to nearest even once.
 *
 * Build: part of the CMake build (target reduce_add_lab), or
 *   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 dev/comm/reduce_add_lab.cu \
 *     -o reduce_add_lab
 * Run:   ./reduce_add_lab [reps]   (needs 2 GPUs with peer access; exits 77 otherwise)
 * Prints the bit check and two markdown tables: per row width, destination and store kind, GB/s
 * of rows moved (per direction where both GPUs send at once: the slower side's time) at each C;
 * then how long zeroing an output takes alone and while every SM is busy.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "../../src/kernels/bulk.cuh"
#include "../reduce/lab_common.cuh" /* CK */

enum { kStages = 8, kThreads = 32 };

/* Rows [blockIdx.x * per, ...) of src to dst: row i goes to dst row dst_row[i] (a permutation for
 * the add, the identity for the store, as the consumer sends whole bands). One thread issues, as
 * in the consumer; loads run kStages - 2 rows ahead, so that two stores may still be reading
 * shared memory when a stage is refilled. */
template <bool ADD>
__global__ void __launch_bounds__(kThreads)
    move_rows(const __nv_bfloat16* src, __nv_bfloat16* dst, const int32_t* dst_row, int32_t rows,
              int32_t row_elems) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ uint64_t full[kStages];
  if (threadIdx.x != 0) return;
  const uint32_t bytes = (uint32_t)row_elems * 2u;
  const int32_t per = (rows + gridDim.x - 1) / gridDim.x;
  const int32_t lo = blockIdx.x * per, n = max(0, min(rows, lo + per) - lo);
  for (int s = 0; s < kStages; s++) tw__mbar_init(&full[s], 1);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  auto load = [&](int32_t it) {
    const int s = it % kStages;
    tw__mbar_expect_tx(&full[s], bytes);
    tw__bulk_load(smem + (size_t)s * bytes, src + (size_t)(lo + it) * row_elems, bytes, &full[s]);
  };
  for (int32_t it = 0; it < min(n, kStages - 2); it++) load(it);
  for (int32_t it = 0; it < n; it++) {
    const int s = it % kStages;
    tw__mbar_wait(&full[s], (uint32_t)(it / kStages) & 1u);
    __nv_bfloat16* d = dst + (size_t)dst_row[lo + it] * row_elems;
    if (ADD)
      tw__bulk_add_bf16(d, smem + (size_t)s * bytes, bytes);
    else
      tw__bulk_store(d, smem + (size_t)s * bytes, bytes);
    tw__bulk_commit();
    /* The stage of row it + kStages - 2 last held row it - 2: its store must have read it. */
    if (it + kStages - 2 < n) {
      tw__bulk_wait_read<2>();
      load(it + kStages - 2);
    }
  }
  tw__bulk_wait_all();
}

/* The median of a run's samples (the first launch of each is left out by the callers). */
static float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/* Holds every SM for `ns` nanoseconds, as the producer and the consumer do during a call:
 * launched as 2 CTAs of 1024 threads per SM, it takes every thread slot, so no other kernel's
 * CTA can be resident beside it (shared memory alone would leave room for one that needs
 * little). */
__global__ void hold_sms(uint64_t ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  while (t - t0 < ns);
}

/* The control: zeroing by a kernel, which needs an SM. */
__global__ void zero_kernel(int4* p, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = make_int4(0, 0, 0, 0);
}

/* Zeroing an output while every SM is busy: the add needs the owner's output zeroed before the
 * first row arrives, and every SM belongs to the producer or the consumer during a call. Times
 * cudaMemsetAsync, a device-to-device cudaMemcpyAsync from a zeroed buffer, a peer-to-peer copy
 * from the other GPU's zeroed buffer over NVLink and, as the control, a kernel that stores zeros,
 * each alone and launched on a second stream right after a kernel that holds every SM for 2 ms
 * (both GPUs' for the peer copy): what ends well before 2 ms ran beside it (no SMs needed). */
static void zeroing(int sms, int reps) {
  const size_t bytes = (size_t)128 << 20;
  void *buf, *zeros;
  CK(cudaMalloc(&buf, bytes));
  CK(cudaMalloc(&zeros, bytes));
  CK(cudaMemset(zeros, 0, bytes));
  /* The peer's zeroed buffer and a stream there, to hold the peer's SMs too. */
  void* peer_zeros;
  cudaStream_t peer_s;
  CK(cudaSetDevice(1));
  CK(cudaMalloc(&peer_zeros, bytes));
  CK(cudaMemset(peer_zeros, 0, bytes));
  CK(cudaStreamCreateWithFlags(&peer_s, cudaStreamNonBlocking));
  CK(cudaDeviceSynchronize());
  CK(cudaSetDevice(0));
  cudaStream_t side, main_s;
  CK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&main_s, cudaStreamNonBlocking));
  cudaEvent_t start, end, held;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&end));
  CK(cudaEventCreate(&held));
  printf(
      "\n| zeroing 128 MiB | alone us | beside a kernel on every SM for 2000 us: end after its "
      "start, us | that kernel's end, us |\n");
  printf("| --- | ---: | ---: | ---: |\n");
  /* The copy engine on this GPU alone: cudaMemcpyBatchAsync with the hint to overlap compute,
   * from the whole zeroed buffer (one copy) or from its first 4 MiB (32 copies of it). */
  const size_t piece = (size_t)4 << 20, npieces = bytes / piece;
  std::vector<void*> dsts(npieces), srcs(npieces);
  std::vector<size_t> sizes(npieces, piece);
  for (size_t i = 0; i < npieces; i++) dsts[i] = (char*)buf + i * piece, srcs[i] = zeros;
  cudaMemcpyAttributes attr = {};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attr_idx = 0;
  for (int how = 0; how < 6; how++) {
    float med[2], hold = 0;
    for (int beside = 0; beside < 2; beside++) {
      std::vector<float> t, th;
      for (int r = 0; r < reps + 1; r++) {
        CK(cudaDeviceSynchronize());
        CK(cudaEventRecord(start, main_s));
        if (beside) {
          hold_sms<<<2 * sms, 1024, 0, main_s>>>(2000000);
          CK(cudaGetLastError());
          if (how == 3) { /* the peer's SMs are busy too in a call */
            CK(cudaSetDevice(1));
            hold_sms<<<2 * sms, 1024, 0, peer_s>>>(2000000);
            CK(cudaGetLastError());
            CK(cudaSetDevice(0));
          }
        }
        CK(cudaEventRecord(held, main_s));
        CK(cudaStreamWaitEvent(side, start));
        if (how == 0)
          CK(cudaMemsetAsync(buf, 0, bytes, side));
        else if (how == 1)
          CK(cudaMemcpyAsync(buf, zeros, bytes, cudaMemcpyDeviceToDevice, side));
        else if (how == 3)
          CK(cudaMemcpyPeerAsync(buf, 0, peer_zeros, 1, bytes, side));
        else if (how == 4) {
          const void* src = zeros;
          CK(cudaMemcpyBatchAsync(&buf, &src, &bytes, 1, &attr, &attr_idx, 1, side));
        } else if (how == 5)
          CK(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), npieces, &attr, &attr_idx,
                                  1, side));
        else
          zero_kernel<<<4 * sms, 256, 0, side>>>((int4*)buf, bytes / 16);
        CK(cudaEventRecord(end, side));
        CK(cudaEventSynchronize(end));
        CK(cudaEventSynchronize(held));
        float ms, hold_ms;
        CK(cudaEventElapsedTime(&ms, start, end));
        CK(cudaEventElapsedTime(&hold_ms, start, held));
        if (r > 0) t.push_back(ms * 1e3f), th.push_back(hold_ms * 1e3f);
      }
      med[beside] = median(t);
      hold = median(th);
    }
    printf("| %s | %.1f | %.1f | %.1f |\n",
           how == 0   ? "cudaMemsetAsync"
           : how == 1 ? "cudaMemcpyAsync device to device from a zeroed buffer"
           : how == 2 ? "a kernel storing zeros (the control: it needs an SM)"
           : how == 3 ? "cudaMemcpyPeerAsync from the peer's zeroed buffer (both GPUs held)"
           : how == 4 ? "cudaMemcpyBatchAsync, prefer overlap with compute: one copy"
                      : "cudaMemcpyBatchAsync, prefer overlap with compute: 32 x 4 MiB from one",
           med[0], med[1], hold);
  }
  CK(cudaDeviceSynchronize());
  CK(cudaFree(buf));
  CK(cudaFree(zeros));
  CK(cudaSetDevice(1));
  CK(cudaDeviceSynchronize());
  CK(cudaFree(peer_zeros));
  CK(cudaSetDevice(0));
}

/* One GPU's side of the row runs: its source rows and the two row maps (scattered, consecutive),
 * uploaded to device `dev`, whose copies of both kernels get the shared memory of `smem`. */
struct Side {
  __nv_bfloat16* src;
  int32_t *perm, *ident;
};
static Side upload_side(int dev, const std::vector<uint16_t>& src, const std::vector<int32_t>& perm,
                        const std::vector<int32_t>& ident, int smem) {
  Side sd;
  CK(cudaSetDevice(dev));
  CK(cudaMalloc(&sd.src, src.size() * 2));
  CK(cudaMalloc(&sd.perm, perm.size() * 4));
  CK(cudaMalloc(&sd.ident, ident.size() * 4));
  CK(cudaMemcpy(sd.src, src.data(), src.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(sd.perm, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(sd.ident, ident.data(), ident.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaFuncSetAttribute(move_rows<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CK(cudaFuncSetAttribute(move_rows<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CK(cudaSetDevice(0));
  return sd;
}

static uint16_t bf16_bits(float f) { /* round to nearest even (inputs are finite) */
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static float bf16_float(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

int main(int argc, char** argv) {
  const int reps = argc > 1 ? atoi(argv[1]) : 7;
  if (reps < 1) {
    fprintf(stderr, "usage: reduce_add_lab [reps >= 1]\n");
    return 2;
  }
  int ndev = 0, access = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev < 2) {
    fprintf(stderr, "reduce_add_lab: needs 2 GPUs, found %d; skipped\n", ndev);
    return 77;
  }
  CK(cudaDeviceCanAccessPeer(&access, 0, 1));
  if (!access) {
    fprintf(stderr, "reduce_add_lab: GPU 0 cannot map GPU 1's memory; skipped\n");
    return 77;
  }
  CK(cudaSetDevice(1));
  CK(cudaDeviceEnablePeerAccess(0, 0));
  CK(cudaSetDevice(0));
  CK(cudaDeviceEnablePeerAccess(1, 0));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));

  const int32_t rows = 8192, max_elems = 8192; /* 8192 rows of hidden 8192: 128 MiB */
  const size_t elems = (size_t)rows * max_elems;
  std::vector<uint16_t> h_src(elems), h_dst0(elems), h_out(elems);
  uint32_t x = 12345;
  auto rnd = [&]() { return x ^= x << 13, x ^= x >> 17, x ^= x << 5, x; };
  for (size_t i = 0; i < elems; i++) {
    h_src[i] = bf16_bits(((int)(rnd() % 2001) - 1000) / 256.0f);
    h_dst0[i] = bf16_bits(((int)(rnd() % 2001) - 1000) / 64.0f);
  }
  std::vector<int32_t> perm(rows), ident(rows);
  for (int32_t i = 0; i < rows; i++) perm[i] = ident[i] = i;
  for (int32_t i = rows - 1; i > 0; i--) std::swap(perm[i], perm[rnd() % (uint32_t)(i + 1)]);

  /* GPU 0 sends to itself or to GPU 1; GPU 1 sends to GPU 0 in the runs in both directions. */
  const int max_smem = kStages * max_elems * 2;
  const Side side[2] = {upload_side(0, h_src, perm, ident, max_smem),
                        upload_side(1, h_src, perm, ident, max_smem)};
  __nv_bfloat16 *dst_local, *dst_peer;
  CK(cudaMalloc(&dst_local, elems * 2));
  CK(cudaSetDevice(1));
  CK(cudaMalloc(&dst_peer, elems * 2));
  CK(cudaSetDevice(0));

  /* The add's arithmetic, to each destination: every element against the host's rounding. */
  long bad[2] = {0, 0};
  for (int peer = 0; peer < 2; peer++) {
    __nv_bfloat16* dst = peer ? dst_peer : dst_local;
    CK(cudaMemcpy(dst, h_dst0.data(), elems * 2, cudaMemcpyHostToDevice));
    move_rows<true><<<16, kThreads, max_smem>>>(side[0].src, dst, side[0].perm, rows, max_elems);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(h_out.data(), dst, elems * 2, cudaMemcpyDeviceToHost));
    for (int32_t r = 0; r < rows; r++)
      for (int32_t c = 0; c < max_elems; c++) {
        const size_t s = (size_t)r * max_elems + c, d = (size_t)perm[r] * max_elems + c;
        const uint16_t want = bf16_bits(bf16_float(h_dst0[d]) + bf16_float(h_src[s]));
        bad[peer] += h_out[d] != want;
      }
  }

  printf("# reduce_add_lab on %s: bulk store vs bulk add (bf16) of rows, GPU 0 -> GPU 0 / GPU 1\n",
         prop.name);
  printf(
      "Bit check (dst = bf16(dst + src), every element of %d rows of %d): local %ld wrong, "
      "peer %ld wrong\n\n",
      rows, max_elems, bad[0], bad[1]);
  struct Case {
    int peer, both, add, scatter;
    const char* what;
  } cases[] = {
      {0, 0, 0, 0, "bulk store, consecutive rows"}, {0, 0, 0, 1, "bulk store, scattered rows"},
      {0, 0, 1, 1, "bulk add, scattered rows"},     {1, 0, 0, 0, "bulk store, consecutive rows"},
      {1, 0, 0, 1, "bulk store, scattered rows"},   {1, 0, 1, 1, "bulk add, scattered rows"},
      {1, 1, 0, 0, "bulk store, consecutive rows"}, {1, 1, 1, 1, "bulk add, scattered rows"},
  };
  const int cs[] = {1, 2, 4, 8, 16, 32};
  printf("| row bytes | destination | store | C=1 | C=2 | C=4 | C=8 | C=16 | C=32 |\n");
  printf("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  cudaEvent_t ev[2][2];
  for (int d = 0; d < 2; d++) {
    CK(cudaSetDevice(d));
    CK(cudaEventCreate(&ev[d][0]));
    CK(cudaEventCreate(&ev[d][1]));
  }
  CK(cudaSetDevice(0));
  for (int32_t row_elems : {4096, 8192}) {
    /* 64 MiB per launch and direction: rows of this width. */
    const int32_t n = std::min(rows, (int32_t)((64 << 20) / (row_elems * 2)));
    const size_t smem = (size_t)kStages * row_elems * 2;
    for (const Case& cs_ : cases) {
      printf("| %d | %s | %s |", row_elems * 2,
             !cs_.peer  ? "local"
             : cs_.both ? "peer, both GPUs at once (per direction)"
                        : "peer",
             cs_.what);
      for (int c : cs) {
        std::vector<float> t;
        for (int r = 0; r < reps + 1; r++) {
          const int sides = cs_.both ? 2 : 1;
          for (int d = 0; d < sides; d++) { /* GPU d sends to the other (or to itself) */
            CK(cudaSetDevice(d));
            __nv_bfloat16* dst = d ? dst_local : cs_.peer ? dst_peer : dst_local;
            const int32_t* map = cs_.scatter ? side[d].perm : side[d].ident;
            CK(cudaEventRecord(ev[d][0]));
            if (cs_.add)
              move_rows<true><<<c, kThreads, smem>>>(side[d].src, dst, map, n, row_elems);
            else
              move_rows<false><<<c, kThreads, smem>>>(side[d].src, dst, map, n, row_elems);
            CK(cudaGetLastError());
            CK(cudaEventRecord(ev[d][1]));
          }
          float ms = 0;
          for (int d = 0; d < sides; d++) {
            float m;
            CK(cudaSetDevice(d));
            CK(cudaEventSynchronize(ev[d][1]));
            CK(cudaEventElapsedTime(&m, ev[d][0], ev[d][1]));
            ms = std::max(ms, m);
          }
          CK(cudaSetDevice(0));
          if (r > 0) t.push_back(ms); /* the first launch warms up */
        }
        printf(" %.0f |", (double)n * row_elems * 2 / (median(t) * 1e6));
      }
      printf("\n");
    }
  }
  zeroing(prop.multiProcessorCount, reps);
  return bad[0] || bad[1] ? 1 : 0;
}
