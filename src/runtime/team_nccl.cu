/*
 * team_nccl.cu: the NCCL team (team.h): the caller's communicator, borrowed. Windows are NCCL
 * symmetric buffers (ncclMemAlloc + ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC)) with a
 * device communicator beside them; the peer pointers come from ncclGetPeerPointer, which is
 * device code, so one small kernel reads them all once when the window is made (they stay valid
 * for the window's life). Host collectives are NCCL all-gathers staged through a device buffer on
 * the team's own stream.
 *
 * C++ only because NCCL's device-communicator API (nccl_device.h) is.
 */
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>
#include <stdlib.h>
#include <string.h>

#include "checks.h"
#include "core.h"
#include "team.h"

namespace {

struct tw__nccl_team {
  ncclComm_t comm; /* borrowed */
  cudaStream_t stream;
  void* scratch; /* device staging of all-gathers */
  size_t scratch_bytes;
};

/* What a window holds beyond its buffer. */
struct tw__nccl_window {
  ncclWindow_t win;
  ncclDevComm dev_comm;
  int registered, dev_comm_created;
};

__global__ void tw_peer_pointers_kernel(ncclWindow_t win, int world, void** out) {
  for (int r = threadIdx.x; r < world; r += blockDim.x) out[r] = ncclGetPeerPointer(win, 0, r);
}

tw_status tw__nccl_allgather(tw__team* t, const void* mine, void* all, size_t bytes) {
  tw__nccl_team* n = static_cast<tw__nccl_team*>(t->impl);
  const size_t need = bytes * (size_t)(t->world + 1);
  if (n->scratch_bytes < need) {
    cudaFree(n->scratch);
    n->scratch = NULL;
    n->scratch_bytes = 0;
    TW_CUDA_TRY(cudaMalloc(&n->scratch, need));
    n->scratch_bytes = need;
  }
  char* in = static_cast<char*>(n->scratch) + bytes * (size_t)t->world;
  TW_CUDA_TRY(cudaMemcpyAsync(in, mine, bytes, cudaMemcpyHostToDevice, n->stream));
  TW_NCCL_TRY(ncclAllGather(in, n->scratch, bytes, ncclChar, n->comm, n->stream));
  TW_CUDA_TRY(cudaMemcpyAsync(all, n->scratch, bytes * (size_t)t->world, cudaMemcpyDeviceToHost,
                              n->stream));
  TW_CUDA_TRY(cudaStreamSynchronize(n->stream));
  return TW_SUCCESS;
}

void tw__nccl_window_free(tw__team* t, tw__window* win) {
  tw__nccl_team* n = static_cast<tw__nccl_team*>(t->impl);
  tw__nccl_window* w = static_cast<tw__nccl_window*>(win->handle);
  if (w != NULL) {
    if (w->dev_comm_created) ncclDevCommDestroy(n->comm, &w->dev_comm);
    if (w->registered) ncclCommWindowDeregister(n->comm, w->win);
    free(w);
  }
  if (win->local != NULL) ncclMemFree(win->local);
  memset(win, 0, sizeof *win);
}

tw_status tw__nccl_window_fill(tw__team* t, size_t bytes, tw__window* win, tw__nccl_window* w) {
  tw__nccl_team* n = static_cast<tw__nccl_team*>(t->impl);
  TW_NCCL_TRY(ncclMemAlloc(&win->local, bytes));
  TW_NCCL_TRY(ncclCommWindowRegister(n->comm, win->local, bytes, &w->win, NCCL_WIN_COLL_SYMMETRIC));
  w->registered = 1;
  ncclDevCommRequirements reqs;
  memset(&reqs, 0, sizeof reqs);
  TW_NCCL_TRY(ncclDevCommCreate(n->comm, &reqs, &w->dev_comm));
  w->dev_comm_created = 1;
  TW_CUDA_TRY(cudaMemsetAsync(win->local, 0, bytes, n->stream));
  void** d_peers = NULL;
  TW_CUDA_TRY(cudaMalloc((void**)&d_peers, sizeof(void*) * (size_t)t->world));
  tw_peer_pointers_kernel<<<1, 64, 0, n->stream>>>(w->win, t->world, d_peers);
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(win->peers, d_peers, sizeof(void*) * (size_t)t->world,
                        cudaMemcpyDeviceToHost, n->stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(n->stream);
  cudaFree(d_peers);
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "NCCL team: the window's peer addresses: %s",
                    cudaGetErrorString(e));
  win->bytes = bytes;
  return TW_SUCCESS;
}

tw_status tw__nccl_window_create(tw__team* t, size_t bytes, tw__window* win) {
  memset(win, 0, sizeof *win);
  tw__nccl_window* w = static_cast<tw__nccl_window*>(calloc(1, sizeof(tw__nccl_window)));
  if (w == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "NCCL team: host memory");
  win->handle = w;
  tw_status st = tw__nccl_window_fill(t, bytes, win, w);
  if (st != TW_SUCCESS) tw__nccl_window_free(t, win);
  return st;
}

void tw__nccl_release(tw__team* t) {
  if (t == NULL) return;
  tw__nccl_team* n = static_cast<tw__nccl_team*>(t->impl);
  if (n != NULL) {
    if (n->stream) cudaStreamDestroy(n->stream);
    cudaFree(n->scratch);
    free(n);
  }
  free(t);
}

const tw__team_ops kNcclOps = {tw__nccl_allgather, tw__nccl_window_create, tw__nccl_window_free,
                               tw__nccl_release};

tw_status tw__nccl_team_fill(ncclComm_t comm, tw__team* t, tw__nccl_team* n) {
  /* The device communicator's layout is version-bound: headers and library must agree. */
  int version = 0;
  TW_NCCL_TRY(ncclGetVersion(&version));
  if (version != NCCL_VERSION_CODE)
    return tw__fail(TW_ERR_NCCL,
                    "tw_context_create: the NCCL library loaded at run time is version %d but "
                    "tilewave was built against NCCL headers %d (%d.%d.%d); rebuild with "
                    "TW_NCCL_ROOT pointing at the NCCL you run with, or load that one (rpath, "
                    "LD_LIBRARY_PATH)",
                    version, NCCL_VERSION_CODE, NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH);
  int world = 0, rank = 0, device = 0;
  TW_NCCL_TRY(ncclCommCount(comm, &world));
  TW_NCCL_TRY(ncclCommUserRank(comm, &rank));
  TW_NCCL_TRY(ncclCommCuDevice(comm, &device));
  if (world > TW_MAX_RANKS)
    return tw__fail(TW_ERR_UNSUPPORTED, "tw_context_create: %d ranks; at most %d", world,
                    TW_MAX_RANKS);
  ncclTeam_t lsa = ncclTeamLsa(comm);
  if (lsa.nRanks != world)
    return tw__fail(TW_ERR_UNSUPPORTED,
                    "tw_context_create: only %d of %d ranks share this rank's NVLink domain; the "
                    "NVLink transport needs all ranks in one (multi-node GIN is not built yet)",
                    lsa.nRanks, world);
  int sms = 0;
  TW_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  t->rank = rank;
  t->world = world;
  t->device = device;
  t->sm_count = sms;
  t->default_budget = sms;
  t->shared_gpu = 0;
  n->comm = comm;
  int prev = -1;
  TW_CUDA_TRY(cudaGetDevice(&prev));
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&n->stream, cudaStreamNonBlocking);
  if (prev >= 0) cudaSetDevice(prev);
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "tw_context_create: a stream on device %d: %s", device,
                    cudaGetErrorString(e));
  return TW_SUCCESS;
}

}  // namespace

extern "C" tw_status tw__team_nccl_create(ncclComm_t comm, tw__team** out) {
  TW_CHECK_NULL(comm);
  TW_CHECK_NULL(out);
  *out = NULL;
  tw__team* t = static_cast<tw__team*>(calloc(1, sizeof(tw__team)));
  tw__nccl_team* n = static_cast<tw__nccl_team*>(calloc(1, sizeof(tw__nccl_team)));
  if (t == NULL || n == NULL) {
    free(t);
    free(n);
    return tw__fail(TW_ERR_OUT_OF_MEMORY, "tw_context_create: host memory");
  }
  t->ops = &kNcclOps;
  t->impl = n;
  t->kind = "nccl";
  tw_status st = tw__nccl_team_fill(comm, t, n);
  if (st != TW_SUCCESS) {
    tw__nccl_release(t);
    return st;
  }
  *out = t;
  return TW_SUCCESS;
}
