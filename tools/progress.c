/*
 * progress.c: the progress lines of the CLI's long runs (progress.h): the estimate of the time
 * left and its line on stderr.
 */
#include "progress.h"

#include <stdarg.h>
#include <stdio.h>

#include "core.h" /* tw__now_seconds */

double twb_progress_left(double elapsed, int done, int total) {
  if (done <= 0) return -1.0;
  if (done >= total) return 0.0;
  return elapsed / done * (total - done);
}

/* "12 s" below 100 s, "3.4 min" above. */
static void twb_progress_time(char* buf, size_t n, double s) {
  if (s < 99.5)
    snprintf(buf, n, "%.0f s", s);
  else
    snprintf(buf, n, "%.1f min", s / 60.0);
}

int twb_progress_format(char* buf, size_t n, const char* what, const char* unit, int current,
                        int done, int total, double elapsed) {
  char e[32], l[32];
  twb_progress_time(e, sizeof e, elapsed);
  const double left = twb_progress_left(elapsed, done, total);
  if (left < 0) return snprintf(buf, n, "[%s] %s %d/%d, %s elapsed", what, unit, current, total, e);
  twb_progress_time(l, sizeof l, left);
  return snprintf(buf, n, "[%s] %s %d/%d, %s elapsed, ~%s left", what, unit, current, total, e, l);
}

void twb_progress_begin(twb_progress* p, const char* what, const char* unit, int total) {
  p->what = what;
  p->unit = unit;
  p->total = total;
  p->t_begin = tw__now_seconds();
}

static void twb_progress_print(const twb_progress* p, int index, int done, const char* fmt,
                               va_list ap) {
  char line[160];
  twb_progress_format(line, sizeof line, p->what, p->unit, index + 1, done, p->total,
                      tw__now_seconds() - p->t_begin);
  fputs(line, stderr);
  if (fmt != NULL) {
    fputs(": ", stderr);
    vfprintf(stderr, fmt, ap);
  }
  fputc('\n', stderr);
}

void twb_progress_start(const twb_progress* p, int index, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  twb_progress_print(p, index, index, fmt, ap);
  va_end(ap);
}

void twb_progress_end(const twb_progress* p, int index, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  twb_progress_print(p, index, index + 1, fmt, ap);
  va_end(ap);
}
