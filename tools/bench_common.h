/*
 * bench_common.h: what `tilewave bench` and `tilewave sweep` share: a device delay that lets the
 * host finish enqueuing a policy before its timed region starts (the statistics are in
 * harness/bench_stats.h, the command-line numbers in cli_args.h).
 */
#ifndef TW_BENCH_COMMON_H
#define TW_BENCH_COMMON_H

#include <cuda_runtime.h>
#include <stdint.h>

#include "bench_stats.h" /* tw__bench_stats, tw__bench_stats_of (harness/) */
#include "tilewave.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Enqueues a kernel on `stream` that spins for `us` microseconds on one SM (globaltimer): the host
 * enqueues the timed work while it spins, so that host launch cost that overlaps device work in a
 * real pipeline does not count, and launch cost that does not overlap still does. */
tw_status tw__bench_delay(cudaStream_t stream, int us);

#ifdef __cplusplus
}
#endif

#endif /* TW_BENCH_COMMON_H */
