/*
 * spawn.h: starting the ranks of a multi-GPU run (internal; used by the tool and the GPU tests).
 *
 * Two ways to get one process per GPU:
 *  - local spawn: tw__spawn_local_ranks() forks one child per rank BEFORE any CUDA call in the
 *    parent (CUDA does not survive fork), passes every child the same ncclUniqueId through
 *    pipes, and waits for all of them with a timeout, killing the rest when one hangs;
 *  - an external launcher (mpirun, torchrun, srun with the same variables): the process is one
 *    rank already; rank 0 creates the unique id and publishes it in the file named by
 *    TW_UNIQUE_ID_FILE, the others read it from there.
 * tw__run_ranks() picks the second when a launcher's variables are present, else the first.
 */
#ifndef TW_SPAWN_H
#define TW_SPAWN_H

#include <nccl.h>

#include "tilewave.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Body of one rank. Runs with the rank's CUDA device already set (device = local rank). Returns
 * 0 on success or a tw_status; a child's exit code outside the status table reads as
 * TW_ERR_INTERNAL. */
typedef int (*tw_rank_fn)(int rank, int nranks, const ncclUniqueId* id, void* arg);

/* Number of CUDA devices, counted in a short-lived child so that this process does not
 * initialise CUDA (which would make later forks unusable). -1 if the child failed. */
int tw__gpu_count_forked(void);

/* Forks nranks children (rank i uses GPU i), runs fn in each and waits at most timeout_s seconds
 * (0 = no limit) for all of them. Must be called before this process makes any CUDA call.
 * Returns TW_SUCCESS when every child returned 0; the first failing child's status otherwise
 * (TW_ERR_TIMEOUT when the time ran out; the remaining children are killed with SIGKILL a few
 * seconds after the first failure, or at once on timeout). TW_ERR_NO_DEVICE when there are
 * fewer than nranks GPUs. */
tw_status tw__spawn_local_ranks(int nranks, tw_rank_fn fn, void* arg, int timeout_s);

/* An external launcher's view of this process. */
typedef struct tw_launcher {
  int rank, nranks, local_rank;
  const char* kind; /* "openmpi" or "torchrun" */
} tw_launcher;

/* Fills *l and returns 1 when OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE (local rank from
 * OMPI_COMM_WORLD_LOCAL_RANK) or RANK/WORLD_SIZE (local rank from LOCAL_RANK) are set; returns
 * 0 otherwise. Missing local ranks default to rank. */
int tw__launcher_detect(tw_launcher* l);

/* Exchanges the unique id through the file named by TW_UNIQUE_ID_FILE: rank 0 creates the id
 * and writes the file atomically (temporary file + rename); the other ranks wait, up to timeout_s,
 * for a file modified at most 120 s before they started looking (an older one is taken for a
 * previous job's). Use a fresh path per job. */
tw_status tw__launcher_unique_id(const tw_launcher* l, ncclUniqueId* id, int timeout_s);

/* Runs fn on every rank: as this process's rank under an external launcher (nranks is then the
 * launcher's world size, the argument is ignored), else by tw__spawn_local_ranks(). */
tw_status tw__run_ranks(int nranks, tw_rank_fn fn, void* arg, int timeout_s);

#ifdef __cplusplus
}
#endif

#endif /* TW_SPAWN_H */
