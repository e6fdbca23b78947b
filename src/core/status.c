/*
 * status.c: status strings, the per-thread last error, logging and environment variables by
 * name (the library's own are tunables.c's).
 */
#define _POSIX_C_SOURCE 200809L
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core.h"

const char* tw_status_string(tw_status status) {
  switch (status) {
#define TW__STATUS_CASE(name, value, msg) \
  case name:                              \
    return #name ": " msg;
    TW_STATUS_TABLE(TW__STATUS_CASE)
#undef TW__STATUS_CASE
  }
  return "TW_ERR_UNKNOWN: not a tilewave status code";
}

int tw_version(void) {
  return TW_VERSION_MAJOR * 10000 + TW_VERSION_MINOR * 100 + TW_VERSION_PATCH;
}

/* One buffer per thread, so concurrent callers never see each other's messages. */
static _Thread_local char tw__last_error[1024];

const char* tw_last_error(void) {
  return tw__last_error;
}

void tw__clear_error(void) {
  tw__last_error[0] = '\0';
}

tw_status tw__fail(tw_status status, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(tw__last_error, sizeof tw__last_error, fmt, ap);
  va_end(ap);
  tw__log(TW_LOG_WARN, "%s (%s)", tw__last_error, tw_status_string(status));
  return status;
}

tw_log_level tw__log_level(void) {
  /* Read once: the level is a process-wide setting, and getenv on every log call is slow. */
  static int level = -1;
  if (level < 0) {
    /* A lenient choice: anything but the four names is the default (no error: logging an
     * error would come back here). The choices are in tw_log_level order. */
    const int32_t i = tw__tunable_match(TW_TUNE_DEBUG, tw__tunable_raw(TW_TUNE_DEBUG));
    level = i >= 0 ? i : (int)tw__tunable(TW_TUNE_DEBUG)->def;
  }
  return (tw_log_level)level;
}

void tw__log(tw_log_level level, const char* fmt, ...) {
  if (level > tw__log_level()) return;
  static const char* names[] = {"", "WARN", "INFO", "TRACE"};
  char line[1200];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  fprintf(stderr, "tilewave %s %s\n", names[level], line);
}

int64_t tw__env_int(const char* name, int64_t fallback) {
  const char* s = getenv(name);
  if (s == NULL || *s == '\0') return fallback;
  char* end = NULL;
  long long v = strtoll(s, &end, 10);
  if (end == s || *end != '\0') {
    TW_WARN("ignoring %s=\"%s\": not an integer; using %lld", name, s, (long long)fallback);
    return fallback;
  }
  return (int64_t)v;
}

tw_status tw__env_int_in(const char* what, const char* name, int lo, int hi, int fallback,
                         int* out) {
  TW_CHECK_NULL(out);
  const char* s = getenv(name);
  if (s == NULL || *s == '\0') {
    *out = fallback;
    return TW_SUCCESS;
  }
  int64_t v = 0;
  if (!tw__tunable_parse_int(s, lo, hi, 0, &v))
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "%s: %s='%s'; use an integer in %d..%d (or unset it)",
                    what, name, s, lo, hi);
  *out = (int)v;
  return TW_SUCCESS;
}

tw_status tw__check_header(const char* what, size_t size, size_t expected_size, uint32_t magic,
                           uint32_t expected_magic, uint32_t version) {
  if (size != expected_size || magic != expected_magic || version != TW_API_VERSION)
    return tw__fail(TW_ERR_CONFIG_VERSION,
                    "%s: header is size %zu magic 0x%08x version %u, expected size %zu magic "
                    "0x%08x version %u; initialise it with the matching *_INIT macro and rebuild "
                    "against this tilewave.h",
                    what, size, magic, version, expected_size, expected_magic, TW_API_VERSION);
  return TW_SUCCESS;
}

double tw__now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
