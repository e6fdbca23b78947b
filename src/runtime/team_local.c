/*
 * team_local.c: the in-process team: W ranks in one process on one GPU, one host thread per
 * rank (team.h). A window is one plain device allocation per rank; the peer pointers are the
 * other ranks' allocations, which every thread of the process can address. Host collectives meet
 * in shared host memory under one mutex: an all-gather copies each rank's bytes into a buffer and
 * the last rank to arrive wakes the others. Two buffers alternate by collective number, so a fast
 * rank may write collective g + 1 while a slow one still reads g (it cannot reach g + 2 before
 * every rank has arrived at g + 1, i.e. has left g).
 *
 * Every wait is bounded (TW_TEAM_TIMEOUT_MS). A rank that gives up marks the team broken: the
 * ranks still waiting and every later collective fail with TW_ERR_TIMEOUT and the same message,
 * so no rank is left behind in a collective the others have abandoned. tw_context_abort breaks it
 * the same way with TW_ERR_ABORTED (the waiting ranks are woken at once). The collectives use no
 * CUDA call: tests run them on a machine without a GPU (tw__team_local_create).
 */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core.h"
#include "team.h"

/* Streams one rank of a context drives: the caller's and the context's three. */
enum { kStreamsPerRank = 4 };

struct tw_team {
  int32_t world, device, sm_count, timeout_ms;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint64_t generation; /* collectives completed */
  int32_t arrived;     /* ranks inside the current collective */
  uint64_t arrived_mask[(TW_MAX_RANKS + 63) / 64];
  size_t op_bytes; /* the current collective's bytes per rank */
  unsigned char* buf[2];
  size_t buf_cap[2];
  int32_t views; /* ranks joined and not yet released */
  int32_t joined[TW_MAX_RANKS];
  int broken;
  tw_status broken_status; /* TW_ERR_TIMEOUT or TW_ERR_ABORTED */
  char broken_why[512];
};

static tw_status tw__local_broken(const struct tw_team* t) {
  return tw__fail(t->broken_status, "%s", t->broken_why);
}

/* Marks the team broken (under t->mu) and wakes every waiting rank. The first reason stays. */
static void tw__local_break(struct tw_team* t, tw_status status) {
  t->broken = 1;
  t->broken_status = status;
  pthread_cond_broadcast(&t->cv);
}

static void tw__deadline(struct timespec* ts, int32_t ms) {
  clock_gettime(CLOCK_MONOTONIC, ts);
  ts->tv_sec += ms / 1000;
  ts->tv_nsec += (long)(ms % 1000) * 1000000L;
  if (ts->tv_nsec >= 1000000000L) {
    ts->tv_sec++;
    ts->tv_nsec -= 1000000000L;
  }
}

static tw_status tw__local_allgather(tw__team* view, const void* mine, void* all, size_t bytes) {
  struct tw_team* t = (struct tw_team*)view->impl;
  const int32_t r = view->rank;
  tw_status st = TW_SUCCESS;
  pthread_mutex_lock(&t->mu);
  if (t->broken) {
    st = tw__local_broken(t);
    goto out;
  }
  const uint64_t g = t->generation;
  unsigned char** buf = &t->buf[g & 1];
  if (t->arrived == 0) {
    t->op_bytes = bytes;
    const size_t need = bytes * (size_t)t->world;
    if (t->buf_cap[g & 1] < need) {
      unsigned char* nb = (unsigned char*)realloc(*buf, need);
      if (nb == NULL) {
        st = tw__fail(TW_ERR_OUT_OF_MEMORY, "in-process team: %zu bytes of host memory", need);
        goto out;
      }
      *buf = nb;
      t->buf_cap[g & 1] = need;
    }
  } else if (t->op_bytes != bytes) {
    /* Ranks in different collectives: nothing any of them receives would mean anything. */
    snprintf(t->broken_why, sizeof t->broken_why,
             "in-process team: rank %d entered collective %llu with %zu bytes, another rank with "
             "%zu; the ranks call the library in different orders. The team is broken: destroy "
             "its contexts and the team",
             r, (unsigned long long)g, bytes, t->op_bytes);
    tw__local_break(t, TW_ERR_TIMEOUT);
    st = tw__local_broken(t);
    goto out;
  }
  memcpy(*buf + (size_t)r * bytes, mine, bytes);
  t->arrived_mask[r / 64] |= 1ull << (r % 64);
  if (++t->arrived == t->world) {
    t->arrived = 0;
    memset(t->arrived_mask, 0, sizeof t->arrived_mask);
    t->generation++;
    pthread_cond_broadcast(&t->cv);
  } else {
    struct timespec until;
    tw__deadline(&until, t->timeout_ms);
    while (t->generation == g && !t->broken) {
      if (pthread_cond_timedwait(&t->cv, &t->mu, &until) == ETIMEDOUT && t->generation == g &&
          !t->broken) {
        int missing = -1;
        for (int32_t q = 0; q < t->world && missing < 0; q++)
          if (!(t->arrived_mask[q / 64] >> (q % 64) & 1)) missing = q;
        snprintf(t->broken_why, sizeof t->broken_why,
                 "in-process team: rank %d waited %d ms in collective %llu for rank %d (%d of %d "
                 "arrived); a rank stopped calling the library or runs far behind "
                 "(TW_TEAM_TIMEOUT_MS). The team is broken: destroy its contexts and the team",
                 r, t->timeout_ms, (unsigned long long)g, missing, t->arrived, t->world);
        tw__local_break(t, TW_ERR_TIMEOUT);
      }
    }
    if (t->generation == g) {
      st = tw__local_broken(t);
      goto out;
    }
  }
  /* Collective g is complete: its buffer stays untouched until every rank has left it. */
  memcpy(all, *buf, bytes * (size_t)t->world);
out:
  pthread_mutex_unlock(&t->mu);
  return st;
}

static tw_status tw__local_window_create(tw__team* view, size_t bytes, tw__window* win) {
  memset(win, 0, sizeof *win);
  void* mine = NULL;
  cudaError_t e = cudaMalloc(&mine, bytes);
  if (e == cudaSuccess) e = cudaMemset(mine, 0, bytes);
  /* Every rank joins the all-gather even when its allocation failed, so that none waits. */
  uint64_t word = e == cudaSuccess ? (uint64_t)(uintptr_t)mine : 0;
  uint64_t all[TW_MAX_RANKS];
  tw_status st = tw__local_allgather(view, &word, all, sizeof word);
  if (st == TW_SUCCESS && e != cudaSuccess)
    st = tw__fail(TW_ERR_OUT_OF_MEMORY, "in-process team: rank %d's window of %zu bytes: %s",
                  view->rank, bytes, cudaGetErrorString(e));
  for (int32_t r = 0; st == TW_SUCCESS && r < view->world; r++)
    if (all[r] == 0)
      st =
          tw__fail(TW_ERR_OUT_OF_MEMORY,
                   "in-process team: rank %d could not allocate its window of %zu bytes", r, bytes);
  if (st != TW_SUCCESS) {
    cudaFree(mine);
    return st;
  }
  for (int32_t r = 0; r < view->world; r++) win->peers[r] = (void*)(uintptr_t)all[r];
  win->local = mine;
  win->bytes = bytes;
  return TW_SUCCESS;
}

static void tw__local_window_destroy(tw__team* view, tw__window* win) {
  if (win->local == NULL) return;
  /* No rank may free its buffer while a peer's kernels can still write into it. After a broken
   * team there is no barrier to rely on; all ranks share this GPU, and every device wait is
   * bounded, so waiting for the device covers every rank's kernels. */
  if (tw__team_barrier(view) != TW_SUCCESS) cudaDeviceSynchronize();
  cudaFree(win->local);
  memset(win, 0, sizeof *win);
}

static void tw__local_release(tw__team* view) {
  struct tw_team* t = (struct tw_team*)view->impl;
  pthread_mutex_lock(&t->mu);
  t->joined[view->rank] = 0;
  t->views--;
  pthread_mutex_unlock(&t->mu);
  free(view);
}

static void tw__local_abort(tw__team* view, const char* why) {
  struct tw_team* t = (struct tw_team*)view->impl;
  pthread_mutex_lock(&t->mu);
  if (!t->broken) {
    snprintf(t->broken_why, sizeof t->broken_why,
             "in-process team: %s. The team is broken: destroy its contexts and the team", why);
    tw__local_break(t, TW_ERR_ABORTED);
  }
  pthread_mutex_unlock(&t->mu);
}

static tw_status tw__local_state(tw__team* view) {
  struct tw_team* t = (struct tw_team*)view->impl;
  tw_status st = TW_SUCCESS;
  pthread_mutex_lock(&t->mu);
  if (t->broken) st = tw__local_broken(t);
  pthread_mutex_unlock(&t->mu);
  return st;
}

/* Nothing of the team's runs on the device: its collectives meet in host memory. */
static int tw__local_device_busy(tw__team* view) {
  (void)view;
  return 0;
}

static const tw__team_ops kLocalOps = {
    tw__local_allgather, tw__local_window_create, tw__local_window_destroy, tw__local_release,
    tw__local_abort,     tw__local_state,         tw__local_device_busy};

tw_status tw__team_local_create(int32_t world_size, int32_t device, int32_t sm_count,
                                int32_t timeout_ms, tw_team_t* out) {
  TW_CHECK_NULL(out);
  *out = NULL;
  if (world_size < 1 || world_size > TW_MAX_RANKS || timeout_ms < 1 || timeout_ms > (1 << 30) ||
      sm_count < 1)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "in-process team: world_size %d (1..%d), timeout %d ms (1..2^30), %d SMs",
                    world_size, TW_MAX_RANKS, timeout_ms, sm_count);
  struct tw_team* t = (struct tw_team*)calloc(1, sizeof *t);
  if (t == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "tw_team_create: host memory");
  t->world = world_size;
  t->device = device;
  t->sm_count = sm_count;
  t->timeout_ms = timeout_ms;
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_mutex_init(&t->mu, NULL);
  pthread_cond_init(&t->cv, &ca);
  pthread_condattr_destroy(&ca);
  *out = t;
  return TW_SUCCESS;
}

tw_status tw_team_create(int32_t world_size, int32_t device, tw_team_t* out) {
  tw__clear_error();
  TW_CHECK_NULL(out);
  *out = NULL;
  if (world_size < 1 || world_size > TW_MAX_RANKS)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "tw_team_create: world_size %d; must be 1..%d",
                    world_size, TW_MAX_RANKS);
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n < 1)
    return tw__fail(TW_ERR_NO_DEVICE, "tw_team_create: no CUDA device (%s)",
                    e != cudaSuccess ? cudaGetErrorString(e) : "none found");
  if (device < 0 || device >= n)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "tw_team_create: device %d; this process sees %d",
                    device, n);
  /* Each stream a rank drives needs a hardware queue of its own: two streams sharing one are
   * ordered, and a kernel queued behind another rank's spinning consumer would wait for it
   * (docs/hardware.md, co-residency). */
  const char* conn = getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  const int connections = conn != NULL && conn[0] != '\0' ? atoi(conn) : 8;
  if (world_size * kStreamsPerRank > connections)
    return tw__fail(TW_ERR_UNSUPPORTED,
                    "tw_team_create: %d in-process ranks drive %d streams, but the GPU gives this "
                    "process %d hardware queues (CUDA_DEVICE_MAX_CONNECTIONS%s); set "
                    "CUDA_DEVICE_MAX_CONNECTIONS=32 in the environment before the process's "
                    "first CUDA call, or use at most %d ranks",
                    world_size, world_size * kStreamsPerRank, connections,
                    conn != NULL ? "" : " unset: 8", connections / kStreamsPerRank);
  int sms = 0;
  e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "tw_team_create: SM count of device %d: %s", device,
                    cudaGetErrorString(e));
  int32_t tmo = 0;
  TW_TRY(tw__tunable_int("tw_team_create", TW_TUNE_TEAM_TIMEOUT_MS, &tmo));
  return tw__team_local_create(world_size, device, sms, tmo, out);
}

tw_status tw_team_destroy(tw_team_t t) {
  tw__clear_error();
  if (t == NULL) return TW_SUCCESS;
  pthread_mutex_lock(&t->mu);
  const int32_t views = t->views;
  pthread_mutex_unlock(&t->mu);
  if (views > 0)
    return tw__fail(TW_ERR_STATE,
                    "tw_team_destroy: %d of the team's contexts still exist; destroy them first",
                    views);
  pthread_mutex_destroy(&t->mu);
  pthread_cond_destroy(&t->cv);
  free(t->buf[0]);
  free(t->buf[1]);
  free(t);
  return TW_SUCCESS;
}

tw_status tw__team_local_join(tw_team_t t, int32_t rank, tw__team** out) {
  TW_CHECK_NULL(t);
  TW_CHECK_NULL(out);
  *out = NULL;
  if (rank < 0 || rank >= t->world)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "in-process team: rank %d; the team has ranks 0..%d",
                    rank, t->world - 1);
  tw__team* v = (tw__team*)calloc(1, sizeof *v);
  if (v == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "in-process team: host memory");
  pthread_mutex_lock(&t->mu);
  const int taken = t->joined[rank];
  if (!taken) {
    t->joined[rank] = 1;
    t->views++;
  }
  pthread_mutex_unlock(&t->mu);
  if (taken) {
    free(v);
    return tw__fail(TW_ERR_STATE,
                    "in-process team: rank %d already has a context on this team; one context "
                    "per rank at a time",
                    rank);
  }
  v->ops = &kLocalOps;
  v->impl = t;
  v->kind = "in-process";
  v->rank = rank;
  v->world = t->world;
  v->device = t->device;
  v->sm_count = t->sm_count;
  v->default_budget = t->sm_count / t->world;
  v->shared_gpu = t->world > 1;
  v->in_process = 1;
  v->timeout_ms = t->timeout_ms;
  *out = v;
  return TW_SUCCESS;
}
