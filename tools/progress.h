/*
 * progress.h: the progress line of a long run of the CLI (bench and sweep points, in-process
 * points, the oracle's and --versus-fixed's passes, bench gemm and gemm1 shapes), on stderr, with
 * an estimate of the time left at the mean rate of the items done so far:
 *   [sweep --oracle] point 7/40, 12 s elapsed, ~57 s left: #70 N8192 ...
 * The arithmetic (twb_progress_left) and the line (twb_progress_format) are pure functions, so
 * that tests/unit/test_progress.c checks them without a clock.
 */
#ifndef TW_TOOLS_PROGRESS_H
#define TW_TOOLS_PROGRESS_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One run: its name on the line, what it counts ("point", "shape") and how many. */
typedef struct twb_progress {
  const char* what;
  const char* unit;
  int total;
  double t_begin; /* tw__now_seconds() at twb_progress_begin */
} twb_progress;

/* Seconds left after `done` of `total` items took `elapsed` seconds, at their mean rate; -1 when
 * nothing is done yet (no rate to go by), 0 when everything is. */
double twb_progress_left(double elapsed, int done, int total);

/* Writes "[what] unit current/total, E elapsed, ~L left" into buf (n bytes, always terminated),
 * the estimate left out when done is 0. Times under 100 s as "12 s", longer as "3.4 min".
 * Returns what snprintf returns. */
int twb_progress_format(char* buf, size_t n, const char* what, const char* unit, int current,
                        int done, int total, double elapsed);

void twb_progress_begin(twb_progress* p, const char* what, const char* unit, int total);

#if defined(__GNUC__)
#define TWB_PRINTF_LIKE(f, a) __attribute__((format(printf, f, a)))
#else
#define TWB_PRINTF_LIKE(f, a)
#endif

/* The line of item index (0-based) of p, printed as it starts (done = index), then ": " and
 * fmt's text when fmt is not NULL. */
void twb_progress_start(const twb_progress* p, int index, const char* fmt, ...)
    TWB_PRINTF_LIKE(3, 4);

/* The line after item index ended (done = index + 1), with fmt's text. */
void twb_progress_end(const twb_progress* p, int index, const char* fmt, ...) TWB_PRINTF_LIKE(3, 4);

#ifdef __cplusplus
}
#endif

#endif /* TW_TOOLS_PROGRESS_H */
