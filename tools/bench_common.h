/*
 * bench_common.h: what `tilewave bench` and `tilewave sweep` share: a device
 * delay that lets the host finish enqueuing a policy before its timed region starts, and
 * command-line number parsing.
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

/* Strict number parsing for flags: the whole string must be a number within [lo, hi]. */
int tw__bench_parse_int(const char* s, long lo, long hi, long* out);
int tw__bench_parse_double(const char* s, double* out);

#ifdef __cplusplus
}
#endif

#endif /* TW_BENCH_COMMON_H */
