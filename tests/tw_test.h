/*
 * tw_test.h: a minimal test harness shared by every test binary.
 *
 * A test binary defines test functions, lists them with TW_TEST_MAIN, and prints
 * "N passed, N failed" at the end; it exits 0 only if nothing failed. GPU tests call
 * tw_test_require_gpu() first, which exits with 77 (ctest's skip code) where no GPU exists.
 */
#ifndef TW_TEST_H
#define TW_TEST_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TW_TEST_SKIP 77

/* Failures of the current test; a test passes when it records none. */
/* Per thread: the in-process multi-rank tests run one rank per thread. */
#ifdef __cplusplus
#define TW_TEST_THREAD_LOCAL thread_local
#else
#define TW_TEST_THREAD_LOCAL _Thread_local
#endif
static TW_TEST_THREAD_LOCAL int tw_test_failures_ = 0;
/* A case that ran no check says so with TW_TEST_SKIP_CASE("why"): it is counted skipped, never
 * passed. */
static TW_TEST_THREAD_LOCAL const char* tw_test_skipped_ = NULL;
#define TW_TEST_SKIP_CASE(why) \
  do {                         \
    tw_test_skipped_ = (why);  \
    return;                    \
  } while (0)

#define CHECK(cond)                                                                \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      fprintf(stderr, "  CHECK failed at %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      tw_test_failures_++;                                                         \
    }                                                                              \
  } while (0)

/* Like CHECK, with a printf-style explanation. */
#define CHECKF(cond, ...)                                                          \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      fprintf(stderr, "  CHECK failed at %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                                \
      fprintf(stderr, "\n");                                                       \
      tw_test_failures_++;                                                         \
    }                                                                              \
  } while (0)

/* Checks a tilewave call's status, printing the library's detail on mismatch. */
#define CHECK_STATUS(expr, expected)                                                           \
  do {                                                                                         \
    tw_status tw_s_ = (expr);                                                                  \
    if (tw_s_ != (expected)) {                                                                 \
      fprintf(stderr, "  CHECK failed at %s:%d: %s returned %s, expected %s (%s)\n", __FILE__, \
              __LINE__, #expr, tw_status_string(tw_s_), tw_status_string(expected),            \
              tw_last_error());                                                                \
      tw_test_failures_++;                                                                     \
    }                                                                                          \
  } while (0)

#define CHECK_OK(expr) CHECK_STATUS(expr, TW_SUCCESS)

#define CHECK_NEAR(a, b, tol)                                                                   \
  do {                                                                                          \
    double tw_a_ = (double)(a), tw_b_ = (double)(b);                                            \
    if (!(fabs(tw_a_ - tw_b_) <= (tol))) {                                                      \
      fprintf(stderr, "  CHECK failed at %s:%d: %s = %.9g, %s = %.9g, |diff| > %g\n", __FILE__, \
              __LINE__, #a, tw_a_, #b, tw_b_, (double)(tol));                                   \
      tw_test_failures_++;                                                                      \
    }                                                                                           \
  } while (0)

typedef struct tw_test_case {
  const char* name;
  void (*fn)(void);
} tw_test_case;

#define TW_TEST(name) \
  { #name, name }

static inline int tw_test_run(const tw_test_case* cases, int n) {
  int passed = 0, failed = 0, skipped = 0;
  for (int i = 0; i < n; i++) {
    tw_test_failures_ = 0;
    tw_test_skipped_ = NULL;
    printf("[ RUN  ] %s\n", cases[i].name);
    fflush(stdout);
    cases[i].fn();
    if (tw_test_failures_ == 0 && tw_test_skipped_ != NULL) {
      skipped++;
      printf("[ SKIP ] %s (%s)\n", cases[i].name, tw_test_skipped_);
    } else if (tw_test_failures_ == 0) {
      passed++;
      printf("[  OK  ] %s\n", cases[i].name);
    } else {
      failed++;
      printf("[ FAIL ] %s (%d checks failed)\n", cases[i].name, tw_test_failures_);
    }
    fflush(stdout);
  }
  if (skipped > 0)
    printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
  else
    printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}

#define TW_TEST_MAIN(...)                                             \
  int main(void) {                                                    \
    static const tw_test_case cases[] = {__VA_ARGS__};                \
    return tw_test_run(cases, (int)(sizeof cases / sizeof cases[0])); \
  }

#endif /* TW_TEST_H */
