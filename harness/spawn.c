/*
 * spawn.c: one process per GPU for the tool and the GPU tests, either forked here or started by
 * an external launcher (see spawn.h for the protocol).
 *
 * Forking happens before this process touches CUDA: a CUDA context does not survive fork, and
 * even cuInit in the parent makes CUDA unusable in the children. That is why the GPU count is
 * taken in a throw-away child and why the unique id is created by child 0 (NCCL's bootstrap root
 * thread then lives in a process that stays up for the whole run) and relayed by the parent.
 */
#define _POSIX_C_SOURCE 200809L
#include "spawn.h"

#include <cuda_runtime.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core.h"

/* Grace period for the other ranks once one has failed: they are probably blocked in a
 * collective with the dead one, but may still be printing a useful error. */
#define TW__SPAWN_GRACE_S 5.0

static void tw__sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static int tw__write_all(int fd, const void* buf, size_t n) {
  const char* p = (const char*)buf;
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

/* Reads exactly n bytes, waiting at most timeout_ms in total (< 0: no limit). */
static int tw__read_all(int fd, void* buf, size_t n, int timeout_ms) {
  char* p = (char*)buf;
  double deadline = tw__now_seconds() + timeout_ms / 1000.0;
  while (n > 0) {
    if (timeout_ms >= 0) {
      int left = (int)((deadline - tw__now_seconds()) * 1000.0);
      if (left <= 0) return -1;
      struct pollfd pfd = {fd, POLLIN, 0};
      int pr = poll(&pfd, 1, left);
      if (pr < 0 && errno == EINTR) continue;
      if (pr <= 0) return -1;
    }
    ssize_t r = read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    p += r;
    n -= (size_t)r;
  }
  return 0;
}

static tw_status tw__status_from_exit(int code) {
  switch (code) {
#define TW__STATUS_CODE(name, value, msg) \
  case value:                             \
    return name;
    TW_STATUS_TABLE(TW__STATUS_CODE)
#undef TW__STATUS_CODE
  }
  return TW_ERR_INTERNAL;
}

int tw__gpu_count_forked(void) {
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    _exit(n > 250 ? 250 : n);
  }
  int st = 0;
  while (waitpid(pid, &st, 0) < 0) {
    if (errno != EINTR) return -1;
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* Body of child `rank`: get the id (create it as rank 0, else read it from the parent), set the
 * device, run fn. Never returns. */
static void tw__child_main(int rank, int nranks, int up_fd, int down_fd, tw_rank_fn fn, void* arg) {
  ncclUniqueId id;
  if (rank == 0) {
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) {
      fprintf(stderr, "tilewave: rank 0: ncclGetUniqueId failed: %s\n", ncclGetErrorString(r));
      _exit(TW_ERR_NCCL);
    }
    if (tw__write_all(up_fd, &id, sizeof id) != 0) _exit(TW_ERR_IO);
  } else if (tw__read_all(down_fd, &id, sizeof id, -1) != 0) {
    /* The parent closes the pipe without writing when rank 0 failed: nothing to run. */
    _exit(TW_ERR_IO);
  }
  if (up_fd >= 0) close(up_fd);
  if (down_fd >= 0) close(down_fd);
  cudaError_t e = cudaSetDevice(rank);
  if (e != cudaSuccess) {
    fprintf(stderr, "tilewave: rank %d: cudaSetDevice(%d) failed: %s\n", rank, rank,
            cudaGetErrorString(e));
    _exit(TW_ERR_CUDA);
  }
  int rc = fn(rank, nranks, &id, arg);
  fflush(stdout);
  fflush(stderr);
  _exit(rc < 0 || rc > 255 ? TW_ERR_INTERNAL : rc);
}

tw_status tw__spawn_local_ranks(int nranks, tw_rank_fn fn, void* arg, int timeout_s) {
  tw__clear_error();
  TW_CHECK_NULL(fn);
  if (nranks < 1 || nranks > TW_MAX_RANKS)
    return tw__fail(TW_ERR_INVALID_SIZE, "tw__spawn_local_ranks: nranks %d is outside 1..%d",
                    nranks, TW_MAX_RANKS);
  if (timeout_s < 0)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "tw__spawn_local_ranks: timeout_s %d < 0", timeout_s);
  int gpus = tw__gpu_count_forked();
  if (gpus < nranks)
    return tw__fail(TW_ERR_NO_DEVICE,
                    "tw__spawn_local_ranks: %d ranks need %d GPUs, found %d; run on a machine "
                    "with more GPUs or ask for fewer ranks",
                    nranks, nranks, gpus < 0 ? 0 : gpus);

  int up[2];
  int down[TW_MAX_RANKS][2];
  pid_t pids[TW_MAX_RANKS];
  int done[TW_MAX_RANKS];
  if (pipe(up) != 0)
    return tw__fail(TW_ERR_IO, "tw__spawn_local_ranks: pipe failed: %s", strerror(errno));
  for (int i = 0; i < nranks; i++) {
    down[i][0] = down[i][1] = -1;
    pids[i] = -1;
    done[i] = 0;
  }
  tw_status status = TW_SUCCESS;
  for (int i = 1; i < nranks; i++) {
    if (pipe(down[i]) != 0) {
      status = tw__fail(TW_ERR_IO, "tw__spawn_local_ranks: pipe failed: %s", strerror(errno));
      break;
    }
  }
  /* Children inherit stdio buffers: flush them so that nothing is printed twice. */
  fflush(stdout);
  fflush(stderr);
  for (int i = 0; i < nranks && status == TW_SUCCESS; i++) {
    pid_t pid = fork();
    if (pid < 0) {
      status = tw__fail(TW_ERR_INTERNAL, "tw__spawn_local_ranks: fork failed: %s", strerror(errno));
      break;
    }
    if (pid == 0) {
      /* Keep only this child's ends: a pipe whose writers are all gone reads EOF, which is how
       * the other children learn that rank 0 died. */
      close(up[0]);
      for (int j = 1; j < nranks; j++) {
        if (down[j][1] >= 0) close(down[j][1]);
        if (j != i && down[j][0] >= 0) close(down[j][0]);
      }
      if (i != 0) close(up[1]);
      tw__child_main(i, nranks, i == 0 ? up[1] : -1, i == 0 ? -1 : down[i][0], fn, arg);
    }
    pids[i] = pid;
  }
  close(up[1]);
  for (int j = 1; j < nranks; j++)
    if (down[j][0] >= 0) close(down[j][0]);

  /* Relay rank 0's id. If that fails the other children read EOF and exit. */
  ncclUniqueId id;
  int id_timeout_ms = timeout_s > 0 ? timeout_s * 1000 : -1;
  int have_id = status == TW_SUCCESS && tw__read_all(up[0], &id, sizeof id, id_timeout_ms) == 0;
  close(up[0]);
  for (int j = 1; j < nranks; j++) {
    if (have_id && down[j][1] >= 0) (void)tw__write_all(down[j][1], &id, sizeof id);
    if (down[j][1] >= 0) close(down[j][1]);
  }

  const double start = tw__now_seconds();
  double kill_at = timeout_s > 0 ? start + timeout_s : -1.0;
  /* A failure while starting (pipe, fork) leaves early children blocked in NCCL's init. */
  if (status != TW_SUCCESS && (kill_at < 0 || start + TW__SPAWN_GRACE_S < kill_at))
    kill_at = start + TW__SPAWN_GRACE_S;
  int left = 0;
  for (int i = 0; i < nranks; i++) left += pids[i] > 0;
  int timed_out = 0;
  while (left > 0) {
    int progressed = 0;
    for (int i = 0; i < nranks; i++) {
      if (pids[i] <= 0 || done[i]) continue;
      int st = 0;
      pid_t r = waitpid(pids[i], &st, WNOHANG);
      if (r == 0) continue;
      if (r < 0 && errno == EINTR) continue;
      done[i] = 1;
      left--;
      progressed = 1;
      tw_status child = TW_SUCCESS;
      if (r < 0)
        child = TW_ERR_INTERNAL;
      else if (WIFSIGNALED(st))
        child = TW_ERR_INTERNAL;
      else if (WIFEXITED(st) && WEXITSTATUS(st) != 0)
        child = tw__status_from_exit(WEXITSTATUS(st));
      if (child != TW_SUCCESS && status == TW_SUCCESS && !timed_out) {
        if (r > 0 && WIFSIGNALED(st))
          status = tw__fail(child, "tw__spawn_local_ranks: rank %d was killed by signal %d", i,
                            WTERMSIG(st));
        else
          status = tw__fail(child, "tw__spawn_local_ranks: rank %d failed with exit code %d (%s)",
                            i, r > 0 ? WEXITSTATUS(st) : -1, tw_status_string(child));
        double grace = tw__now_seconds() + TW__SPAWN_GRACE_S;
        if (kill_at < 0 || grace < kill_at) kill_at = grace;
      }
    }
    if (left == 0) break;
    if (kill_at > 0 && tw__now_seconds() > kill_at) {
      if (status == TW_SUCCESS) {
        timed_out = 1;
        status = tw__fail(TW_ERR_TIMEOUT,
                          "tw__spawn_local_ranks: %d of %d ranks still running after %d s; killed "
                          "them (raise the timeout if the work is legitimately that long)",
                          left, nranks, timeout_s);
      }
      for (int i = 0; i < nranks; i++)
        if (pids[i] > 0 && !done[i]) kill(pids[i], SIGKILL);
      for (int i = 0; i < nranks; i++) {
        if (pids[i] > 0 && !done[i]) {
          int st;
          while (waitpid(pids[i], &st, 0) < 0 && errno == EINTR) {
          }
          done[i] = 1;
          left--;
        }
      }
      break;
    }
    if (!progressed) tw__sleep_ms(10);
  }
  return status;
}

static int tw__env_rank(const char* name, int* value) {
  const char* s = getenv(name);
  if (s == NULL || *s == '\0') return 0;
  char* end = NULL;
  long v = strtol(s, &end, 10);
  if (end == s || *end != '\0' || v < 0 || v > 1 << 20) return 0;
  *value = (int)v;
  return 1;
}

int tw__launcher_detect(tw_launcher* l) {
  if (l == NULL) return 0;
  int rank = 0, size = 0, local = 0;
  if (tw__env_rank("OMPI_COMM_WORLD_RANK", &rank) && tw__env_rank("OMPI_COMM_WORLD_SIZE", &size)) {
    if (!tw__env_rank("OMPI_COMM_WORLD_LOCAL_RANK", &local)) local = rank;
    l->kind = "openmpi";
  } else if (tw__env_rank("RANK", &rank) && tw__env_rank("WORLD_SIZE", &size)) {
    if (!tw__env_rank("LOCAL_RANK", &local)) local = rank;
    l->kind = "torchrun";
  } else {
    return 0;
  }
  l->rank = rank;
  l->nranks = size;
  l->local_rank = local;
  return 1;
}

tw_status tw__launcher_unique_id(const tw_launcher* l, ncclUniqueId* id, int timeout_s) {
  TW_CHECK_NULL(l);
  TW_CHECK_NULL(id);
  const char* path = tw__tunable_string(TW_TUNE_UNIQUE_ID_FILE);
  if (path == NULL)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "an external launcher (%s) started this rank but TW_UNIQUE_ID_FILE is not set; "
                    "set it to a fresh path on a file system every rank sees",
                    l->kind);
  if (l->rank == 0) {
    ncclResult_t r = ncclGetUniqueId(id);
    if (r != ncclSuccess)
      return tw__fail(TW_ERR_NCCL, "ncclGetUniqueId failed: %s", ncclGetErrorString(r));
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    FILE* f = fopen(tmp, "wb");
    if (f == NULL)
      return tw__fail(TW_ERR_IO, "cannot write %s (TW_UNIQUE_ID_FILE): %s", tmp, strerror(errno));
    size_t w = fwrite(id, 1, sizeof *id, f);
    int c = fclose(f);
    /* rename() is atomic: readers see either no file or the complete id. */
    if (w != sizeof *id || c != 0 || rename(tmp, path) != 0) {
      remove(tmp);
      return tw__fail(TW_ERR_IO, "cannot publish the unique id in %s: %s", path, strerror(errno));
    }
    return TW_SUCCESS;
  }
  /* A file older than this is taken for a previous job's and ignored. */
  const time_t not_before = time(NULL) - 120;
  const double deadline = tw__now_seconds() + (timeout_s > 0 ? timeout_s : 1e9);
  for (;;) {
    struct stat sb;
    if (stat(path, &sb) == 0 && sb.st_mtime >= not_before && (size_t)sb.st_size == sizeof *id) {
      FILE* f = fopen(path, "rb");
      if (f != NULL) {
        size_t r = fread(id, 1, sizeof *id, f);
        fclose(f);
        if (r == sizeof *id) return TW_SUCCESS;
      }
    }
    if (tw__now_seconds() > deadline)
      return tw__fail(TW_ERR_TIMEOUT,
                      "rank %d: no unique id appeared in %s (TW_UNIQUE_ID_FILE) within %d s; is "
                      "rank 0 running and does every rank see the same path?",
                      l->rank, path, timeout_s);
    tw__sleep_ms(20);
  }
}

tw_status tw__run_ranks(int nranks, tw_rank_fn fn, void* arg, int timeout_s) {
  tw__clear_error();
  TW_CHECK_NULL(fn);
  tw_launcher l;
  if (!tw__launcher_detect(&l)) return tw__spawn_local_ranks(nranks, fn, arg, timeout_s);
  if (l.rank >= l.nranks)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "%s launcher: rank %d >= world size %d", l.kind,
                    l.rank, l.nranks);
  ncclUniqueId id;
  TW_TRY(tw__launcher_unique_id(&l, &id, timeout_s));
  cudaError_t e = cudaSetDevice(l.local_rank);
  if (e != cudaSuccess)
    return tw__fail(TW_ERR_CUDA, "rank %d: cudaSetDevice(%d) (local rank) failed: %s", l.rank,
                    l.local_rank, cudaGetErrorString(e));
  int rc = fn(l.rank, l.nranks, &id, arg);
  if (rc != 0) {
    tw_status s = tw__status_from_exit(rc);
    return tw__fail(s, "rank %d failed with %d (%s)", l.rank, rc, tw_status_string(s));
  }
  return TW_SUCCESS;
}
