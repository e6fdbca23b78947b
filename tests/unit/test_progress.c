/*
 * test_progress.c: the estimate of the time left and the progress line of the CLI's long runs
 * (tools/progress.c): the mean rate of the items done so far times the items left, no estimate
 * before the first item, none left after the last; seconds below 100 s, minutes above; the line
 * as the tools print it, truncated safely in a short buffer.
 */
#include <string.h>

#include "progress.h"
#include "tw_test.h"

static void test_left(void) {
  CHECK(twb_progress_left(0.0, 0, 40) < 0);                /* nothing done: no rate yet */
  CHECK(twb_progress_left(12.0, 0, 40) < 0);               /* still none, whatever the clock says */
  CHECK_NEAR(twb_progress_left(12.0, 6, 40), 68.0, 1e-12); /* 2 s an item, 34 to go */
  CHECK_NEAR(twb_progress_left(10.0, 1, 2), 10.0, 1e-12);
  CHECK_NEAR(twb_progress_left(3.0, 3, 7), 4.0, 1e-12);
  CHECK(twb_progress_left(50.0, 40, 40) == 0.0); /* all done */
  CHECK(twb_progress_left(50.0, 41, 40) == 0.0); /* never negative */
  /* The estimate scales with the elapsed time and with the items left. */
  CHECK_NEAR(twb_progress_left(24.0, 6, 40), 2 * twb_progress_left(12.0, 6, 40), 1e-12);
  CHECK(twb_progress_left(12.0, 6, 41) > twb_progress_left(12.0, 6, 40));
}

static void test_format(void) {
  char b[160];
  twb_progress_format(b, sizeof b, "sweep --oracle", "point", 7, 6, 40, 12.0);
  CHECKF(strcmp(b, "[sweep --oracle] point 7/40, 12 s elapsed, ~68 s left") == 0, "%s", b);
  twb_progress_format(b, sizeof b, "bench", "point", 1, 0, 40, 0.2);
  CHECKF(strcmp(b, "[bench] point 1/40, 0 s elapsed") == 0, "%s", b);
  /* After the last item: nothing left. */
  twb_progress_format(b, sizeof b, "oracle", "point", 40, 40, 40, 90.0);
  CHECKF(strcmp(b, "[oracle] point 40/40, 90 s elapsed, ~0 s left") == 0, "%s", b);
  /* Minutes from 100 s on: 150 s elapsed after 10 of 30, 300 s left. */
  twb_progress_format(b, sizeof b, "bench gemm", "shape", 11, 10, 30, 150.0);
  CHECKF(strcmp(b, "[bench gemm] shape 11/30, 2.5 min elapsed, ~5.0 min left") == 0, "%s", b);
  twb_progress_format(b, sizeof b, "x", "point", 2, 1, 2, 99.4);
  CHECKF(strcmp(b, "[x] point 2/2, 99 s elapsed, ~99 s left") == 0, "%s", b);
  /* A short buffer: terminated, a prefix of the line, the full length returned. */
  char s[12];
  memset(s, 'z', sizeof s);
  const int n = twb_progress_format(s, sizeof s, "sweep", "point", 7, 6, 40, 12.0);
  CHECK(s[sizeof s - 1] == '\0' && strncmp(s, "[sweep] poi", 11) == 0);
  CHECK(n == (int)strlen("[sweep] point 7/40, 12 s elapsed, ~68 s left"));
}

int main(void) {
  static const tw_test_case cases[] = {
      TW_TEST(test_left),
      TW_TEST(test_format),
  };
  return tw_test_run(cases, (int)(sizeof cases / sizeof cases[0]));
}
