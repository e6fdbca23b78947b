/*
 * test_tunables.c: the table of TW_* environment variables (src/core/tunables.c) and its
 * accessors. Every entry has a TW_ name, a doc and a default within its range (or among its
 * choices); the defaults that name a constant of another part equal it; ids and names find their
 * entries; every integer and choice entry takes its default when unset or empty, takes a good
 * value, and fails on a bad one with TW_ERR_INVALID_ARGUMENT naming the variable and its range or
 * choices (the output untouched); a lenient integer falls back on a non-integer; the planner's
 * variables fail tw_plan_create with their message.
 */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "plan.h"
#include "tunables.h"
#include "tw_test.h"

static void expect_message(const char* needle) {
  CHECKF(strstr(tw_last_error(), needle) != NULL, "message \"%s\" lacks \"%s\"", tw_last_error(),
         needle);
}

static void test_table_entries(void) {
  const tw_tunable* table = tw__tunable_table();
  for (int i = 0; i < TW_TUNE_COUNT; i++) {
    const tw_tunable* t = &table[i];
    CHECKF(t->name != NULL && strncmp(t->name, "TW_", 3) == 0, "entry %d has no TW_ name", i);
    if (t->name == NULL) continue;
    CHECKF(t->doc != NULL && strlen(t->doc) > 10, "%s has no doc", t->name);
    CHECKF(tw__tunable((tw_tunable_id)i) == t, "%s: id %d finds another entry", t->name, i);
    CHECKF(tw__tunable_find(t->name) == t, "%s: its name finds another entry", t->name);
    for (int j = 0; j < i; j++)
      CHECKF(strcmp(table[j].name, t->name) != 0, "%s is in the table twice", t->name);
    switch (t->kind) {
      case TW_TUNABLE_INT:
      case TW_TUNABLE_INT_LENIENT:
        CHECKF(t->lo <= t->def && t->def <= t->hi, "%s: default %lld outside %lld..%lld", t->name,
               (long long)t->def, (long long)t->lo, (long long)t->hi);
        CHECKF(t->lo >= INT32_MIN && t->hi <= INT32_MAX, "%s: range beyond int32", t->name);
        CHECKF(t->choices == NULL, "%s: an integer with choices", t->name);
        break;
      case TW_TUNABLE_CHOICE: {
        int n = 0;
        while (t->choices != NULL && t->choices[n] != NULL) n++;
        CHECKF(n >= 2, "%s: %d choices", t->name, n);
        CHECKF(t->def >= 0 && t->def < n, "%s: default index %lld of %d choices", t->name,
               (long long)t->def, n);
        CHECKF(t->hint != NULL, "%s: no hint for its message", t->name);
        for (int j = 0; j < n && t->hint; j++)
          CHECKF(strstr(t->hint, t->choices[j]) != NULL, "%s: hint \"%s\" lacks \"%s\"", t->name,
                 t->hint, t->choices[j]);
        break;
      }
      case TW_TUNABLE_STRING:
        break;
      default:
        CHECKF(0, "%s: kind %d", t->name, (int)t->kind);
    }
    if (t->say == TW_TUNABLE_SAY_NOUN) CHECKF(t->noun != NULL, "%s: no noun", t->name);
  }
  CHECK(tw__tunable(TW_TUNE_COUNT) == NULL);
  CHECK(tw__tunable_find("TW_NOT_A_TUNABLE") == NULL);
  CHECK(tw__tunable_find(NULL) == NULL);
}

/* Defaults that other parts name as constants, and choices whose index is a value. */
static void test_defaults_match_constants(void) {
  CHECK(tw__tunable(TW_TUNE_TILE_GROUP)->def == TW_TILE_GROUP_DEFAULT);
  CHECK(tw__tunable(TW_TUNE_CONSUMER_TAIL_BANDS)->def == TW_DEFAULT_TAIL_BANDS);
  CHECK(tw__tunable(TW_TUNE_TIMEOUT_MS)->def == TW_DEFAULT_TIMEOUT_MS);
  CHECK(tw__tunable(TW_TUNE_DEBUG)->def == TW_LOG_WARN);
  CHECK(tw__tunable_match(TW_TUNE_DEBUG, "trace") == TW_LOG_TRACE);
  CHECK(tw__tunable_match(TW_TUNE_SCHEDULE, "auto") == TW_SCHEDULE_AUTO);
  CHECK(tw__tunable_match(TW_TUNE_SCHEDULE, "Remote-First") == TW_SCHEDULE_REMOTE_FIRST);
  CHECK(tw__tunable_match(TW_TUNE_SCHEDULE, "expert-major") == TW_SCHEDULE_EXPERT_MAJOR);
  CHECK(tw__schedule_parse("EXPERT-MAJOR") == TW_SCHEDULE_EXPERT_MAJOR);
  CHECK(tw__schedule_parse("sideways") == -1);
  CHECK(tw__dataflow_parse("Add") == TW_DATAFLOW_ADD);
  CHECK(tw__dataflow_parse("reduce") == TW_DATAFLOW_REDUCE);
  CHECK(tw__dataflow_parse("sum") == -1);
  /* The context's choices match case and all. */
  CHECK(tw__tunable_match(TW_TUNE_CONSUMER_COPY, "registers") == 1);
  CHECK(tw__tunable_match(TW_TUNE_CONSUMER_COPY, "Registers") == -1);
  CHECK(tw__tunable_match(TW_TUNE_ADD_ZEROING, "copy") == 1);
  CHECK(tw__tunable_match(TW_TUNE_ADD_ZEROING, NULL) == -1);
}

/* A value outside an integer entry's range (or not an integer), and one of its range's ends. */
static void test_int_entries(void) {
  for (int i = 0; i < TW_TUNE_COUNT; i++) {
    const tw_tunable* t = tw__tunable((tw_tunable_id)i);
    if (t->kind != TW_TUNABLE_INT) continue;
    char hi[32], above[32], range[64];
    snprintf(hi, sizeof hi, "%lld", (long long)t->hi);
    snprintf(above, sizeof above, "%lld", (long long)t->hi + 1);
    snprintf(range, sizeof range, t->say == TW_TUNABLE_SAY_USE ? "%lld..%lld" : "%lld to %lld",
             (long long)t->lo, (long long)t->hi);
    int32_t v = -7;
    unsetenv(t->name);
    CHECK_OK(tw__tunable_int("test", (tw_tunable_id)i, &v));
    CHECKF(v == t->def, "%s unset: %d", t->name, v);
    setenv(t->name, "", 1);
    v = -7;
    CHECK_OK(tw__tunable_int_or("test", (tw_tunable_id)i, 3, &v));
    CHECKF(v == 3, "%s empty: %d, not the caller's default", t->name, v);
    setenv(t->name, hi, 1);
    CHECK_OK(tw__tunable_int("test", (tw_tunable_id)i, &v));
    CHECKF(v == t->hi, "%s=%s: %d", t->name, hi, v);
    const char* bad[] = {above, "x", "4x", "-99999999999999999999"};
    for (size_t b = 0; b < sizeof bad / sizeof bad[0]; b++) {
      setenv(t->name, bad[b], 1);
      v = -7;
      tw__clear_error();
      CHECK_STATUS(tw__tunable_int("test", (tw_tunable_id)i, &v), TW_ERR_INVALID_ARGUMENT);
      expect_message(t->name);
      expect_message(range);
      expect_message(bad[b]);
      CHECKF(v == -7, "%s=%s: output touched", t->name, bad[b]);
    }
    /* Leading blanks: the USE form rejects them, the NOUN form (strtol's) takes them. */
    char spaced[40];
    snprintf(spaced, sizeof spaced, " %s", hi);
    setenv(t->name, spaced, 1);
    CHECK_STATUS(tw__tunable_int("test", (tw_tunable_id)i, &v),
                 t->say == TW_TUNABLE_SAY_NOUN ? TW_SUCCESS : TW_ERR_INVALID_ARGUMENT);
    unsetenv(t->name);
  }
  /* The wrong kind is an internal error, not a silent read. */
  int32_t v = 0;
  CHECK_STATUS(tw__tunable_int("test", TW_TUNE_SCHEDULE, &v), TW_ERR_INTERNAL);
  CHECK_STATUS(tw__tunable_int("test", TW_TUNE_COUNT, &v), TW_ERR_INTERNAL);
  CHECK_STATUS(tw__tunable_int("test", TW_TUNE_TILE_GROUP, NULL), TW_ERR_NULL_POINTER);
}

static void test_lenient_entries(void) {
  for (int i = 0; i < TW_TUNE_COUNT; i++) {
    const tw_tunable* t = tw__tunable((tw_tunable_id)i);
    if (t->kind != TW_TUNABLE_INT_LENIENT) continue;
    unsetenv(t->name);
    CHECK(tw__tunable_int_lenient((tw_tunable_id)i, 11) == 11);
    setenv(t->name, "not-a-number", 1);
    CHECK(tw__tunable_int_lenient((tw_tunable_id)i, 11) == 11);
    setenv(t->name, "42", 1);
    CHECK(tw__tunable_int_lenient((tw_tunable_id)i, 11) == 42);
    unsetenv(t->name);
  }
}

static void test_choice_entries(void) {
  for (int i = 0; i < TW_TUNE_COUNT; i++) {
    const tw_tunable* t = tw__tunable((tw_tunable_id)i);
    if (t->kind != TW_TUNABLE_CHOICE) continue;
    int32_t x = -7;
    unsetenv(t->name);
    CHECK_OK(tw__tunable_choice("test", (tw_tunable_id)i, &x));
    CHECKF(x == t->def, "%s unset: %d", t->name, x);
    for (int32_t j = 0; t->choices[j] != NULL; j++) {
      setenv(t->name, t->choices[j], 1);
      CHECK_OK(tw__tunable_choice("test", (tw_tunable_id)i, &x));
      CHECKF(x == j, "%s=%s: %d", t->name, t->choices[j], x);
    }
    setenv(t->name, "bogus-value", 1);
    x = -7;
    tw__clear_error();
    CHECK_STATUS(tw__tunable_choice("test", (tw_tunable_id)i, &x), TW_ERR_INVALID_ARGUMENT);
    expect_message(t->name);
    expect_message("bogus-value");
    expect_message(t->hint);
    CHECKF(x == -7, "%s: output touched", t->name);
    unsetenv(t->name);
  }
  setenv("TW_DEBUG", "NONE", 1);
}

/* The planner's variables, through tw_plan_create: the messages as they have always read. */
static void test_plan_messages(void) {
  tw_problem p = TW_PROBLEM_INIT;
  p.world_size = 2;
  p.hidden = 256;
  p.ffn = 128;
  p.experts = 4;
  p.top_k = 2;
  p.max_tokens = 64;
  tw_routing_t rt = NULL;
  CHECK_OK(tw_routing_generate(&p, TW_ROUTER_BALANCED, 0.0, 64, 5, &rt));
  if (rt == NULL) return;
  static const struct {
    const char* name;
    const char* value;
    const char* message;
  } cases[] = {
      {"TW_TILE_GROUP", "0", "TW_TILE_GROUP=\"0\" is not a band count; set 1 to 64, or unset it"},
      {"TW_SCHEDULE", "sideways",
       "TW_SCHEDULE=\"sideways\" is not a schedule; set remote-first, expert-major or auto, or "
       "unset it"},
      {"TW_COMBINE_DATAFLOW", "sum",
       "tw_plan_create: TW_COMBINE_DATAFLOW=\"sum\"; set `reduce` or `add`, or unset it"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    setenv(cases[i].name, cases[i].value, 1);
    tw_plan_t pl = NULL;
    CHECK_STATUS(tw_plan_create(&p, rt, 0, NULL, &pl), TW_ERR_INVALID_ARGUMENT);
    CHECKF(strcmp(tw_last_error(), cases[i].message) == 0, "message \"%s\", expected \"%s\"",
           tw_last_error(), cases[i].message);
    CHECK(pl == NULL);
    tw_plan_destroy(pl);
    unsetenv(cases[i].name);
  }
  /* The generic by-name reader keeps its message too. */
  setenv("TW_TEST_TUNABLE_SWITCH", "9", 1);
  int v = 0;
  CHECK_STATUS(tw__env_int_in("test", "TW_TEST_TUNABLE_SWITCH", 0, 5, 0, &v),
               TW_ERR_INVALID_ARGUMENT);
  CHECKF(strcmp(tw_last_error(),
                "test: TW_TEST_TUNABLE_SWITCH='9'; use an integer in 0..5 (or unset it)") == 0,
         "message \"%s\"", tw_last_error());
  unsetenv("TW_TEST_TUNABLE_SWITCH");
  tw_routing_destroy(rt);
}

int main(void) {
  setenv("TW_DEBUG", "NONE", 1); /* expected failures would log a WARN each */
  static const tw_test_case cases[] = {
      TW_TEST(test_table_entries),  TW_TEST(test_defaults_match_constants),
      TW_TEST(test_int_entries),    TW_TEST(test_lenient_entries),
      TW_TEST(test_choice_entries), TW_TEST(test_plan_messages),
  };
  return tw_test_run(cases, (int)(sizeof cases / sizeof cases[0]));
}
