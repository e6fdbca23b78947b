/*
 * core.h: errors, logging and tunables shared by every part of tilewave (internal).
 *
 * Every failing call records a detail message with tw__fail(), which also returns the status so
 * that a check reads `return tw__fail(TW_ERR_X, "what was wrong; how to fix it", ...)`.
 */
#ifndef TW_CORE_H
#define TW_CORE_H

#include <stdint.h>

#include "tilewave.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define TW__PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define TW__PRINTF(a, b)
#endif

/* Records the detail of a failure for tw_last_error() and logs it at WARN; returns status. */
tw_status tw__fail(tw_status status, const char* fmt, ...) TW__PRINTF(2, 3);
/* Clears the last error of this thread (called at the start of public entry points). */
void tw__clear_error(void);

/* Propagates a failing status unchanged (its detail is already recorded). */
#define TW_TRY(expr)                       \
  do {                                     \
    tw_status tw__s = (expr);              \
    if (tw__s != TW_SUCCESS) return tw__s; \
  } while (0)

#define TW_CHECK_NULL(ptr)                                                                    \
  do {                                                                                        \
    if ((ptr) == NULL)                                                                        \
      return tw__fail(TW_ERR_NULL_POINTER, "%s: argument '%s' is NULL; pass a valid pointer", \
                      __func__, #ptr);                                                        \
  } while (0)

/* Logging: TW_DEBUG=WARN|INFO|TRACE (default WARN), to stderr. */
typedef enum tw_log_level {
  TW_LOG_NONE = 0,
  TW_LOG_WARN = 1,
  TW_LOG_INFO = 2,
  TW_LOG_TRACE = 3
} tw_log_level;
tw_log_level tw__log_level(void);
void tw__log(tw_log_level level, const char* fmt, ...) TW__PRINTF(2, 3);
#define TW_WARN(...) tw__log(TW_LOG_WARN, __VA_ARGS__)
#define TW_INFO(...) tw__log(TW_LOG_INFO, __VA_ARGS__)
#define TW_TRACE(...) tw__log(TW_LOG_TRACE, __VA_ARGS__)

/* Environment variables by name. The library's own TW_* variables are in the table of
 * tunables.h and read through its accessors; these two serve a variable outside it (the tests')
 * and callers not yet converted. tw__env_int: the integer value, or fallback when unset, empty or
 * not an integer (with a warning naming the variable); no range check. */
int64_t tw__env_int(const char* name, int64_t fallback);
/* An integer environment variable that must lie in [lo, hi]: *out = its value, or fallback when it
 * is unset or empty; anything else is TW_ERR_INVALID_ARGUMENT naming the variable and the range
 * (the caller's `what` leads the message; tunables.h's TW_TUNABLE_SAY_USE form). */
tw_status tw__env_int_in(const char* what, const char* name, int lo, int hi, int fallback,
                         int* out);

/* Validates the size/magic/version header of a config struct. */
tw_status tw__check_header(const char* what, size_t size, size_t expected_size, uint32_t magic,
                           uint32_t expected_magic, uint32_t version);

/* ceil(a / b) for a >= 0, b >= 1. */
static inline int64_t tw__ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

/* Monotonic clock in seconds (host timing of the planner). */
double tw__now_seconds(void);

#ifdef __cplusplus
}
#endif

#include "tunables.h" /* the TW_* environment variables */

#endif /* TW_CORE_H */
