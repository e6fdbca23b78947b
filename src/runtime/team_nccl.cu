/*
 * team_nccl.cu: the NCCL team (team.h): the caller's communicator, borrowed. Windows are NCCL
 * symmetric buffers (ncclMemAlloc + ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC)) with a
 * device communicator beside them; the peer pointers come from ncclGetPeerPointer, which is
 * device code, so one small kernel reads them all once when the window is made (they stay valid
 * for the window's life). Host collectives are NCCL all-gathers staged through a device buffer on
 * the team's own stream.
 *
 * Bounded collectives. An all-gather is enqueued, then polled (cudaStreamQuery,
 * ncclCommGetAsyncError) until it completes or TW_TEAM_TIMEOUT_MS has passed; it never blocks in
 * a synchronising call, and its host staging is pinned (a copy to pageable memory would block
 * until the all-gather ends). On expiry, on an NCCL error, or when a peer has broken the team, the
 * view is broken: this and every later collective fail at once with the first reason, and no
 * further NCCL call is made for it (the window is left to the communicator: deregistering is
 * collective and would wait for the lost rank). The abandoned all-gather stays on the team's
 * stream until the caller aborts the communicator (ncclCommAbort), which tilewave never does: it
 * does not own the communicator. While it is there the view is "device busy" and nothing may
 * synchronise the device (team.h).
 *
 * Breaking the team for the peers. The window carries one more 128-byte line after the context's
 * bytes: an abort word, zero while the team is whole. A rank that breaks the team (its
 * collective timed out, or tw_context_abort) writes (reason << 16 | rank + 1) into every peer's
 * word with a one-thread kernel over NVLink; every collective reads this rank's own word before
 * it starts and while it polls (a copy on a stream of its own, which nothing stuck delays), so
 * the peers' pending and later collectives fail at once instead of waiting out their timeout.
 * Before the window exists (the first comparisons of tw_context_create) a collective is bounded
 * by its timeout only.
 *
 * Not bounded here: NCCL's own collective set-up calls at creation (ncclCommWindowRegister,
 * ncclDevCommCreate) and, in a blocking communicator, the connection set-up NCCL may do inside
 * the first ncclAllGather of a communicator; both happen in tw_context_create, while every rank
 * is there.
 *
 * C++ only because NCCL's device-communicator API (nccl_device.h) is.
 */
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "checks.h"
#include "core.h"
#include "team.h"

namespace {

/* Why a rank broke the team, in its abort word. */
enum { kBrokeAbort = 1, kBrokeTimeout = 2, kBrokeError = 3 };

struct tw__nccl_team {
  ncclComm_t comm;     /* borrowed */
  cudaStream_t stream; /* the all-gathers */
  cudaStream_t watch;  /* abort-word reads and writes: never queued behind an all-gather */
  void* scratch;       /* device staging of all-gathers */
  size_t scratch_bytes;
  unsigned char* host; /* pinned staging: (world + 1) x bytes */
  size_t host_bytes;
  uint32_t* h_word; /* pinned: this rank's abort word, read back */
  uint32_t* d_word; /* this rank's abort word in its window; NULL before the window */
  struct tw__abort_targets {
    uint32_t* word[TW_MAX_RANKS]; /* every rank's abort word, as this process addresses it */
  } targets;
  int broken;  /* no collective will run again on this view */
  int pending; /* an abandoned all-gather may still be on `stream` */
  tw_status broken_status;
  char broken_why[512];
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

/* Writes `value` into the abort word of every rank but `self` (world 0: launches nothing but
 * itself, to load the kernel while nothing spins: docs/hardware.md, lazy loading). */
__global__ void tw_abort_word_kernel(tw__nccl_team::tw__abort_targets t, int world, int self,
                                     uint32_t value) {
  for (int r = threadIdx.x; r < world; r += blockDim.x)
    if (r != self) *(volatile uint32_t*)t.word[r] = value;
  /* NOTES: plain volatile stores over NVLink, then a system-scope fence so they are visible to
   * the peers' copy engines, which read the words; nothing else is ordered by them. */
  __threadfence_system();
}

double tw__nccl_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void tw__nccl_nap(double seconds) {
  struct timespec ts;
  ts.tv_sec = 0;
  ts.tv_nsec = (long)(seconds * 1e9);
  nanosleep(&ts, NULL);
}

/* Marks the view broken with `status` and the message (formatted already) and returns it. */
tw_status tw__nccl_break(tw__nccl_team* n, tw_status status, const char* why) {
  if (!n->broken) {
    n->broken = 1;
    n->broken_status = status;
    snprintf(n->broken_why, sizeof n->broken_why, "%s", why);
  }
  return tw__fail(n->broken_status, "%s", n->broken_why);
}

/* Tells every peer that this rank broke the team (`reason`). Bounded by the team's timeout: a
 * write that does not complete in time is left behind (it only delays the peers). */
void tw__nccl_tell_peers(tw__team* t, int reason) {
  tw__nccl_team* n = static_cast<tw__nccl_team*>(t->impl);
  if (n->d_word == NULL || t->world < 2) return;
  const uint32_t value = (uint32_t)reason << 16 | (uint32_t)(t->rank + 1);
  tw_abort_word_kernel<<<1, 64, 0, n->watch>>>(n->targets, t->world, t->rank, value);
  if (cudaGetLastError() != cudaSuccess) return;
  const double deadline = tw__nccl_now() + 1e-3 * t->timeout_ms;
  while (cudaStreamQuery(n->watch) == cudaErrorNotReady && tw__nccl_now() < deadline)
    tw__nccl_nap(1e-4);
}

/* The peer's reason in this rank's abort word, as a broken view. */
tw_status tw__nccl_peer_broke(tw__team* t, uint32_t word) {
  tw__nccl_team* n = static_cast<tw__nccl_team*>(t->impl);
  const int rank = (int)(word & 0xFFFF) - 1, reason = (int)(word >> 16);
  char why[512];
  snprintf(why, sizeof why,
           "NCCL team: rank %d broke the team (%s); this rank's collectives of the context fail "
           "from now on. Destroy the context on every rank; if a rank is lost, abort the "
           "communicator (ncclCommAbort) on every surviving rank",
           rank,
           reason == kBrokeAbort     ? "it called tw_context_abort"
           : reason == kBrokeTimeout ? "a collective timed out there (TW_TEAM_TIMEOUT_MS)"
                                     : "an NCCL or CUDA error there");
  n->pending = n->pending || cudaStreamQuery(n->stream) == cudaErrorNotReady;
  return tw__nccl_break(n, reason == kBrokeAbort ? TW_ERR_ABORTED : TW_ERR_TIMEOUT, why);
}

/* Reads this rank's abort word, waiting at most until `deadline`. TW_SUCCESS when it is zero
 * (or could not be read in time: the caller's own timeout still bounds it). */
tw_status tw__nccl_read_word(tw__team* t, double deadline) {
  tw__nccl_team* n = static_cast<tw__nccl_team*>(t->impl);
  if (n->d_word == NULL) return TW_SUCCESS;
  *n->h_word = 0;
  TW_CUDA_TRY(cudaMemcpyAsync(n->h_word, n->d_word, 4, cudaMemcpyDeviceToHost, n->watch));
  cudaError_t e;
  while ((e = cudaStreamQuery(n->watch)) == cudaErrorNotReady && tw__nccl_now() < deadline)
    tw__nccl_nap(2e-5);
  if (e == cudaSuccess && *(volatile uint32_t*)n->h_word != 0)
    return tw__nccl_peer_broke(t, *(volatile uint32_t*)n->h_word);
  return TW_SUCCESS;
}

tw_status tw__nccl_allgather(tw__team* t, const void* mine, void* all, size_t bytes) {
  tw__nccl_team* n = static_cast<tw__nccl_team*>(t->impl);
  if (n->broken) return tw__fail(n->broken_status, "%s", n->broken_why);
  const double start = tw__nccl_now(), deadline = start + 1e-3 * t->timeout_ms;
  /* A peer that has broken the team: fail before anything is enqueued. */
  TW_TRY(tw__nccl_read_word(t, deadline));
  const size_t need = bytes * (size_t)(t->world + 1);
  if (n->scratch_bytes < need) {
    cudaFree(n->scratch);
    n->scratch = NULL;
    n->scratch_bytes = 0;
    TW_CUDA_TRY(cudaMalloc(&n->scratch, need));
    n->scratch_bytes = need;
  }
  if (n->host_bytes < need) {
    cudaFreeHost(n->host);
    n->host = NULL;
    n->host_bytes = 0;
    TW_CUDA_TRY(cudaHostAlloc((void**)&n->host, need, cudaHostAllocDefault));
    n->host_bytes = need;
  }
  char* in = static_cast<char*>(n->scratch) + bytes * (size_t)t->world;
  memcpy(n->host + bytes * (size_t)t->world, mine, bytes);
  TW_CUDA_TRY(cudaMemcpyAsync(in, n->host + bytes * (size_t)t->world, bytes, cudaMemcpyHostToDevice,
                              n->stream));
  const ncclResult_t r = ncclAllGather(in, n->scratch, bytes, ncclChar, n->comm, n->stream);
  if (r != ncclSuccess && r != ncclInProgress) {
    char why[512];
    snprintf(why, sizeof why, "NCCL team: ncclAllGather failed: %s (%s)", ncclGetErrorString(r),
             ncclGetLastError(n->comm));
    n->pending = 1;
    tw__nccl_tell_peers(t, kBrokeError);
    return tw__nccl_break(n, TW_ERR_NCCL, why);
  }
  TW_CUDA_TRY(cudaMemcpyAsync(n->host, n->scratch, bytes * (size_t)t->world, cudaMemcpyDeviceToHost,
                              n->stream));
  /* Poll: the all-gather's end, NCCL's asynchronous errors, a peer's abort word (one read in
   * flight at a time, every millisecond or so), the deadline. Naps grow from 2 us to 200 us. */
  double nap = 2e-6, next_word = start + 1e-3;
  int word_in_flight = 0;
  for (;;) {
    const cudaError_t e = cudaStreamQuery(n->stream);
    if (e == cudaSuccess) break;
    char why[512];
    if (e != cudaErrorNotReady) {
      snprintf(why, sizeof why, "NCCL team: the all-gather's stream failed: %s",
               cudaGetErrorString(e));
      n->pending = 1;
      tw__nccl_tell_peers(t, kBrokeError);
      return tw__nccl_break(n, TW_ERR_CUDA, why);
    }
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(n->comm, &async) == ncclSuccess && async != ncclSuccess &&
        async != ncclInProgress) {
      snprintf(why, sizeof why,
               "NCCL team: the communicator reports an asynchronous error during a host "
               "collective: %s (%s); abort the communicator (ncclCommAbort) on every rank",
               ncclGetErrorString(async), ncclGetLastError(n->comm));
      n->pending = 1;
      return tw__nccl_break(n, TW_ERR_NCCL, why);
    }
    const double now = tw__nccl_now();
    if (n->d_word != NULL && word_in_flight && cudaStreamQuery(n->watch) == cudaSuccess) {
      word_in_flight = 0;
      const uint32_t w = *(volatile uint32_t*)n->h_word;
      if (w != 0) {
        n->pending = 1;
        return tw__nccl_peer_broke(t, w);
      }
    }
    if (n->d_word != NULL && !word_in_flight && now >= next_word) {
      *n->h_word = 0;
      if (cudaMemcpyAsync(n->h_word, n->d_word, 4, cudaMemcpyDeviceToHost, n->watch) == cudaSuccess)
        word_in_flight = 1;
      next_word = now + 1e-3;
    }
    if (now >= deadline) {
      /* With two ranks the missing one is known; with more NCCL does not say which. */
      char whom[64];
      if (t->world == 2)
        snprintf(whom, sizeof whom, "rank %d", 1 - t->rank);
      else
        snprintf(whom, sizeof whom, "one or more of the other %d ranks", t->world - 1);
      snprintf(why, sizeof why,
               "NCCL team: rank %d waited %d ms in a host collective (an all-gather of %zu bytes) "
               "for %s; a rank stopped calling the library, died, or runs far behind "
               "(TW_TEAM_TIMEOUT_MS). The team is broken: destroy the context on every rank and "
               "abort the communicator (ncclCommAbort), whose all-gather stays pending until then",
               t->rank, t->timeout_ms, bytes, whom);
      n->pending = 1;
      tw__nccl_tell_peers(t, kBrokeTimeout);
      return tw__nccl_break(n, TW_ERR_TIMEOUT, why);
    }
    tw__nccl_nap(nap);
    if (nap < 2e-4) nap *= 2;
  }
  /* Wait for a word read still in flight: it writes into h_word, reused by the next collective. */
  if (word_in_flight)
    while (cudaStreamQuery(n->watch) == cudaErrorNotReady && tw__nccl_now() < deadline)
      tw__nccl_nap(2e-5);
  memcpy(all, n->host, bytes * (size_t)t->world);
  return TW_SUCCESS;
}

/* The window's abort word: one 128-byte line after the context's bytes. */
size_t tw__nccl_word_offset(size_t bytes) {
  return (bytes + 127) / 128 * 128;
}

/* Frees what window_fill made. On a broken view no NCCL call is made (deregistering is
 * collective and would wait for the lost rank, and the caller may have aborted the communicator
 * already): the registration and its memory stay with the communicator. */
void tw__nccl_window_free(tw__team* t, tw__window* win) {
  tw__nccl_team* n = static_cast<tw__nccl_team*>(t->impl);
  tw__nccl_window* w = static_cast<tw__nccl_window*>(win->handle);
  if (n->broken) {
    if (win->local != NULL)
      TW_WARN(
          "NCCL team: rank %d: the team is broken; the window (%zu bytes) is not freed and stays "
          "registered with the communicator until it is aborted or destroyed",
          t->rank, win->bytes);
  } else {
    if (w != NULL) {
      if (w->dev_comm_created) ncclDevCommDestroy(n->comm, &w->dev_comm);
      if (w->registered) ncclCommWindowDeregister(n->comm, w->win);
    }
    if (win->local != NULL) ncclMemFree(win->local);
  }
  free(w);
  n->d_word = NULL;
  memset(win, 0, sizeof *win);
}

/* COLLECTIVE: a bounded barrier first, so that no rank deregisters (a collective NCCL call
 * without a bound) while a peer is lost, and none frees its buffer while a peer may still write
 * into it. A barrier that fails breaks the view, and the free then makes no NCCL call. */
void tw__nccl_window_destroy(tw__team* t, tw__window* win) {
  tw__nccl_team* n = static_cast<tw__nccl_team*>(t->impl);
  if (!n->broken) (void)tw__team_barrier(t);
  tw__nccl_window_free(t, win);
}

tw_status tw__nccl_window_fill(tw__team* t, size_t bytes, tw__window* win, tw__nccl_window* w) {
  tw__nccl_team* n = static_cast<tw__nccl_team*>(t->impl);
  const size_t word_at = tw__nccl_word_offset(bytes), total = word_at + 128;
  TW_NCCL_TRY(ncclMemAlloc(&win->local, total));
  TW_NCCL_TRY(ncclCommWindowRegister(n->comm, win->local, total, &w->win, NCCL_WIN_COLL_SYMMETRIC));
  w->registered = 1;
  ncclDevCommRequirements reqs;
  memset(&reqs, 0, sizeof reqs);
  TW_NCCL_TRY(ncclDevCommCreate(n->comm, &reqs, &w->dev_comm));
  w->dev_comm_created = 1;
  TW_CUDA_TRY(cudaMemsetAsync(win->local, 0, total, n->stream));
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
  for (int32_t r = 0; r < t->world; r++)
    n->targets.word[r] = (uint32_t*)((char*)win->peers[r] + word_at);
  /* Load the abort kernel now (world 0: it writes nothing), while nothing spins. */
  tw_abort_word_kernel<<<1, 64, 0, n->watch>>>(n->targets, 0, t->rank, 0);
  TW_CUDA_TRY(cudaGetLastError());
  TW_CUDA_TRY(cudaStreamSynchronize(n->watch));
  /* This rank reads its own word through its own allocation (the peers write it through theirs). */
  n->d_word = (uint32_t*)((char*)win->local + word_at);
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

int tw__nccl_device_busy(tw__team* t) {
  tw__nccl_team* n = static_cast<tw__nccl_team*>(t->impl);
  if (!n->pending) return 0;
  if (cudaStreamQuery(n->stream) == cudaErrorNotReady) return 1;
  n->pending = 0; /* the communicator was aborted, or the peer came after all */
  return 0;
}

void tw__nccl_release(tw__team* t) {
  if (t == NULL) return;
  tw__nccl_team* n = static_cast<tw__nccl_team*>(t->impl);
  if (n != NULL) {
    /* Streams are destroyed without waiting; frees would wait for an abandoned all-gather. */
    const int busy = tw__nccl_device_busy(t);
    if (n->stream) cudaStreamDestroy(n->stream);
    if (n->watch) cudaStreamDestroy(n->watch);
    if (busy) {
      TW_WARN(
          "NCCL team: rank %d: an abandoned all-gather still waits on the device; its %zu + %zu "
          "bytes of staging are not freed (abort the communicator first to free them)",
          t->rank, n->scratch_bytes, n->host_bytes);
    } else {
      cudaFree(n->scratch);
      cudaFreeHost(n->host);
      cudaFreeHost(n->h_word);
    }
    free(n);
  }
  free(t);
}

void tw__nccl_abort(tw__team* t, const char* why) {
  tw__nccl_team* n = static_cast<tw__nccl_team*>(t->impl);
  if (n->broken) return;
  char msg[512];
  snprintf(msg, sizeof msg,
           "NCCL team: %s; the context refuses every call but tw_context_destroy. Destroy it on "
           "every rank; if a rank is lost, abort the communicator (ncclCommAbort) on every "
           "surviving rank",
           why);
  tw__nccl_tell_peers(t, kBrokeAbort);
  (void)tw__nccl_break(n, TW_ERR_ABORTED, msg);
}

tw_status tw__nccl_state(tw__team* t) {
  tw__nccl_team* n = static_cast<tw__nccl_team*>(t->impl);
  if (n->broken) return tw__fail(n->broken_status, "%s", n->broken_why);
  /* A peer's abort word, read within a tenth of the timeout (it is local memory). */
  return tw__nccl_read_word(t, tw__nccl_now() + 1e-4 * t->timeout_ms);
}

const tw__team_ops kNcclOps = {tw__nccl_allgather,  tw__nccl_window_create, tw__nccl_window_destroy,
                               tw__nccl_release,    tw__nccl_abort,         tw__nccl_state,
                               tw__nccl_device_busy};

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
  if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&n->watch, cudaStreamNonBlocking);
  if (e == cudaSuccess) e = cudaHostAlloc((void**)&n->h_word, 4, cudaHostAllocDefault);
  if (prev >= 0) cudaSetDevice(prev);
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "tw_context_create: streams on device %d: %s", device,
                    cudaGetErrorString(e));
  int32_t tmo = 0;
  TW_TRY(tw__tunable_int("tw_context_create", TW_TUNE_TEAM_TIMEOUT_MS, &tmo));
  t->timeout_ms = tmo;
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
