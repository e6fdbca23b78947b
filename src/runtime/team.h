/*
 * team.h: what a context needs from the ranks around it (internal). A team gives one rank
 *  - host-side collectives over the team's ranks (an all-gather of a few bytes, and a barrier
 *    built on it), each bounded by a timeout after which every rank's later collectives fail;
 *  - symmetric windows: one device buffer per rank, of one size, and the base address of every
 *    rank's buffer as this process addresses it (the peer pointers the kernels write through).
 * A team can be broken: a collective that waited longer than the team's timeout
 * (TW_TEAM_TIMEOUT_MS), or a rank that gave up (tw_context_abort), breaks it for every rank, and
 * from then on every rank's collectives fail at once with the status and message of the first
 * failure (TW_ERR_TIMEOUT or TW_ERR_ABORTED), so that no rank waits for one that will not come.
 * Two backends sit behind it, and neither the kernels nor the planner can tell them apart:
 *  - NCCL (team_nccl.cu): the caller's ncclComm_t, windows from ncclMemAlloc +
 *    ncclCommWindowRegister (symmetric), peer pointers from the LSA team (NVLink);
 *  - in-process (team_local.c): W ranks in one process on one GPU, one host thread per rank;
 *    windows are plain device allocations, collectives go through shared host memory.
 */
#ifndef TW_TEAM_H
#define TW_TEAM_H

#include <stddef.h>
#include <stdint.h>

#include "tilewave.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One rank's window: its own buffer and every rank's, as addressed from this process. */
typedef struct tw__window {
  void* local;               /* this rank's buffer (peers[rank]) */
  void* peers[TW_MAX_RANKS]; /* (world) every rank's buffer base */
  size_t bytes;
  void* handle; /* the backend's (NCCL: the registered ncclWindow_t) */
} tw__window;

typedef struct tw__team tw__team;

typedef struct tw__team_ops {
  /* all[r * bytes ..] = rank r's `mine`, for every rank r; host memory both. COLLECTIVE. */
  tw_status (*allgather)(tw__team* t, const void* mine, void* all, size_t bytes);
  /* A window of `bytes` per rank, zero-filled. COLLECTIVE. */
  tw_status (*window_create)(tw__team* t, size_t bytes, tw__window* win);
  /* COLLECTIVE: no rank frees its buffer before every rank has stopped using the window. */
  void (*window_destroy)(tw__team* t, tw__window* win);
  /* Frees this rank's view of the team (never the caller's communicator). Not collective. */
  void (*release)(tw__team* t);
  /* Breaks the team for every rank with TW_ERR_ABORTED and `why` (names this rank): the peers'
   * pending and later collectives fail at once. Not collective; never waits for a peer. */
  void (*abort)(tw__team* t, const char* why);
  /* TW_SUCCESS, or the status and message that broke the team (tw__fail). Never waits for a
   * peer. */
  tw_status (*state)(tw__team* t);
  /* 1 while a collective this view gave up on may still run on the device (an NCCL all-gather
   * that waits for a lost rank until the caller aborts the communicator): then nothing that
   * synchronises the device (cudaFree, cudaDeviceSynchronize) may be called, it would wait for
   * that collective. */
  int (*device_busy)(tw__team* t);
} tw__team_ops;

/* One rank's view of a team. */
struct tw__team {
  const tw__team_ops* ops;
  void* impl;
  const char* kind; /* "nccl" or "in-process", for messages */
  int32_t rank, world, device;
  int32_t sm_count;       /* SMs of the rank's GPU */
  int32_t default_budget; /* SMs a context takes when its config does not say: the whole GPU
                             (NCCL), the GPU's SMs / W (in-process) */
  int32_t shared_gpu;     /* 1: several ranks run on one GPU (an in-process team of W > 1) */
  int32_t in_process;     /* 1: an in-process team (tw_team_create) */
  int32_t timeout_ms;     /* bound of every collective (TW_TEAM_TIMEOUT_MS) */
  int32_t aborted;        /* 1: this rank called tw_context_abort on the context of this view */
};

/* A view of the caller's communicator (borrowed, never destroyed). Checks the NCCL version
 * against the headers and that every rank shares the NVLink domain. */
tw_status tw__team_nccl_create(ncclComm_t comm, tw__team** out);

/* Rank `rank`'s view of an in-process team (tw_team_create). */
tw_status tw__team_local_join(tw_team_t team, int32_t rank, tw__team** out);

/* An in-process team without the device checks of tw_team_create (host-only tests of the
 * collectives, and tests that need a team timeout of their own): `device` and `sm_count` are
 * taken as given, CUDA_DEVICE_MAX_CONNECTIONS is not checked, and timeout_ms bounds every
 * collective (1..2^30). Freed with tw_team_destroy. */
tw_status tw__team_local_create(int32_t world_size, int32_t device, int32_t sm_count,
                                int32_t timeout_ms, tw_team_t* team);

/* Every rank reaches this point before any leaves. COLLECTIVE. */
tw_status tw__team_barrier(tw__team* t);
/* out = max over ranks of v[i], for each of n values. COLLECTIVE. */
tw_status tw__team_max_i64(tw__team* t, int64_t* v, int n);
/* out = sum over ranks. COLLECTIVE. */
tw_status tw__team_sum_i64(tw__team* t, int64_t* v, int n);

#ifdef __cplusplus
}
#endif

#endif /* TW_TEAM_H */
