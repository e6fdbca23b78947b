/*
 * tunables.c: the table of the library's TW_* environment variables and its accessors
 * (tunables.h says how they read and what their errors say).
 */
#define _POSIX_C_SOURCE 200809L
#include "tunables.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "core.h"

static const char* const tw__debug_levels[] = {"NONE", "WARN", "INFO", "TRACE", NULL};
/* In tw_schedule order: the index is the TW_SCHEDULE_* value. */
static const char* const tw__schedules[] = {"auto", "remote-first", "expert-major", NULL};
/* The index is the tw_combine_dataflow value less 1. */
static const char* const tw__dataflows[] = {"reduce", "add", NULL};
static const char* const tw__copies[] = {"bulk", "registers", NULL};
static const char* const tw__zeroings[] = {"producer", "copy", NULL};

/* Defaults that name a constant of another part are checked against it by test_tunables
 * (TW_TILE_GROUP_DEFAULT, TW_DEFAULT_TAIL_BANDS, TW_DEFAULT_TIMEOUT_MS). */
static const tw_tunable tw__table[TW_TUNE_COUNT] = {
    [TW_TUNE_DEBUG] = {"TW_DEBUG", TW_TUNABLE_CHOICE, 1, 0, 0, tw__debug_levels, 1,
                       TW_TUNABLE_SAY_USE, NULL, "`NONE`, `WARN`, `INFO` or `TRACE`",
                       "log level on stderr, read once per process; anything else is WARN"},
    [TW_TUNE_TIMEOUT_MS] = {"TW_TIMEOUT_MS", TW_TUNABLE_INT_LENIENT, 5000, 1, INT32_MAX - 1, NULL,
                            0, TW_TUNABLE_SAY_USE, NULL, NULL,
                            "bound of every device-side wait in ms (default 5000; the CPU "
                            "executor's 10000); a timeout is TW_ERR_TIMEOUT"},
    [TW_TUNE_CALIBRATION] = {"TW_CALIBRATION", TW_TUNABLE_STRING, 0, 0, 0, NULL, 0,
                             TW_TUNABLE_SAY_USE, NULL, NULL,
                             "hardware description file for the model, read once per process "
                             "(unset: the built-in H200 numbers)"},
    [TW_TUNE_SCHEDULE] = {"TW_SCHEDULE", TW_TUNABLE_CHOICE, 0, 0, 0, tw__schedules, 1,
                          TW_TUNABLE_SAY_NOUN, "a schedule", "remote-first, expert-major or auto",
                          "tile schedule of plans whose config leaves it at 0 (default auto: "
                          "the model picks); read at every tw_plan_create"},
    [TW_TUNE_TILE_GROUP] = {"TW_TILE_GROUP", TW_TUNABLE_INT, 8, 1, 64, NULL, 0, TW_TUNABLE_SAY_NOUN,
                            "a band count", NULL,
                            "bands whose tiles the producer walks column by column together "
                            "(default 8; 1: band by band); read at every tw_plan_create"},
    [TW_TUNE_COMBINE_DATAFLOW] = {"TW_COMBINE_DATAFLOW", TW_TUNABLE_CHOICE, 0, 0, 0, tw__dataflows,
                                  1, TW_TUNABLE_SAY_SET, NULL, "`reduce` or `add`",
                                  "dataflow of plans and contexts whose config leaves it at 0 "
                                  "(default reduce); read at every tw_plan_create and "
                                  "tw_context_create"},
    [TW_TUNE_CONSUMER_TILES_PER_UNIT] = {"TW_CONSUMER_TILES_PER_UNIT", TW_TUNABLE_INT_LENIENT, 0, 0,
                                         INT32_MAX, NULL, 0, TW_TUNABLE_SAY_USE, NULL, NULL,
                                         "column tiles per consumer transfer unit, clamped to 1.."
                                         "column tiles (default 0, the context's: the whole band "
                                         "under bulk copies, 1 under registers)"},
    [TW_TUNE_CONSUMER_TAIL_BANDS] = {"TW_CONSUMER_TAIL_BANDS", TW_TUNABLE_INT, 8, 0, 1 << 20, NULL,
                                     0, TW_TUNABLE_SAY_USE, NULL, NULL,
                                     "last bands of every destination stream sent as row parts "
                                     "(default 8; 0: whole bands; same on every rank)"},
    [TW_TUNE_CONSUMER_TAIL_PARTS] = {"TW_CONSUMER_TAIL_PARTS", TW_TUNABLE_INT, 0, 0, 64, NULL, 0,
                                     TW_TUNABLE_SAY_USE, NULL, NULL,
                                     "row parts per tail band (default 0: by the band's size)"},
    [TW_TUNE_CONSUMER_COPY] = {"TW_CONSUMER_COPY", TW_TUNABLE_CHOICE, 0, 0, 0, tw__copies, 0,
                               TW_TUNABLE_SAY_USE, NULL, "`bulk` or `registers`",
                               "how the consumer copies: bulk (TMA through shared memory, the "
                               "default) or registers"},
    [TW_TUNE_GEMM_VARIANT] = {"TW_GEMM_VARIANT", TW_TUNABLE_INT, 0, 0, 5, NULL, 0,
                              TW_TUNABLE_SAY_USE, NULL, NULL,
                              "producer kernel version a context launches (default 0: the "
                              "library's choice; 1-5: src/kernels/sm90_gemm.cu)"},
    [TW_TUNE_ADD_ZEROING] = {"TW_ADD_ZEROING", TW_TUNABLE_CHOICE, 0, 0, 0, tw__zeroings, 0,
                             TW_TUNABLE_SAY_USE, NULL, "`copy` or `producer`",
                             "how the add dataflow zeroes its next output buffer: producer (its "
                             "idle warps, the default) or copy (the copy engine)"},
    [TW_TUNE_DEBUG_TAGS] = {"TW_DEBUG_TAGS", TW_TUNABLE_INT_LENIENT, 0, 0, 1, NULL, 0,
                            TW_TUNABLE_SAY_USE, NULL, NULL,
                            "nonzero: tag every forwarded row with its source and count "
                            "arrivals (tests; default 0)"},
    [TW_TUNE_UNIQUE_ID_FILE] = {"TW_UNIQUE_ID_FILE", TW_TUNABLE_STRING, 0, 0, 0, NULL, 0,
                                TW_TUNABLE_SAY_USE, NULL, NULL,
                                "under an external launcher, the file through which the ranks "
                                "share the NCCL unique id (default unset)"},
    [TW_TUNE_TEAM_TIMEOUT_MS] = {"TW_TEAM_TIMEOUT_MS", TW_TUNABLE_INT, TW_DEFAULT_TEAM_TIMEOUT_MS,
                                 1, 1 << 30, NULL, 0, TW_TUNABLE_SAY_USE, NULL, NULL,
                                 "bound in ms of every host-side collective of a team, "
                                 "in-process or NCCL (default 60000); after it every rank's fail"},
};

const tw_tunable* tw__tunable_table(void) {
  return tw__table;
}

const tw_tunable* tw__tunable(tw_tunable_id id) {
  return (int)id >= 0 && id < TW_TUNE_COUNT ? &tw__table[id] : NULL;
}

const tw_tunable* tw__tunable_find(const char* name) {
  for (int i = 0; name != NULL && i < TW_TUNE_COUNT; i++)
    if (strcmp(tw__table[i].name, name) == 0) return &tw__table[i];
  return NULL;
}

const char* tw__tunable_raw(tw_tunable_id id) {
  const tw_tunable* t = tw__tunable(id);
  if (t == NULL) return NULL;
  const char* s = getenv(t->name);
  return s == NULL || *s == '\0' ? NULL : s;
}

int tw__tunable_parse_int(const char* s, int64_t lo, int64_t hi, int blanks_ok, int64_t* out) {
  if (s == NULL) return 0;
  char* end = NULL;
  const long long v = strtoll(s, &end, 10);
  const int blank = *s == ' ' || *s == '\t'; /* strtoll would skip them */
  if ((blank && !blanks_ok) || end == s || *end != '\0' || v < lo || v > hi) return 0;
  *out = (int64_t)v;
  return 1;
}

static tw_status tw__tunable_bad(const char* what, const tw_tunable* t, const char* value) {
  char range[64];
  const char* hint = t->hint;
  if (t->kind == TW_TUNABLE_INT || t->kind == TW_TUNABLE_INT_LENIENT) {
    snprintf(range, sizeof range,
             t->say == TW_TUNABLE_SAY_USE ? "an integer in %lld..%lld" : "%lld to %lld",
             (long long)t->lo, (long long)t->hi);
    hint = range;
  }
  switch (t->say) {
    case TW_TUNABLE_SAY_NOUN:
      return tw__fail(TW_ERR_INVALID_ARGUMENT, "%s=\"%s\" is not %s; set %s, or unset it", t->name,
                      value, t->noun, hint);
    case TW_TUNABLE_SAY_SET:
      return tw__fail(TW_ERR_INVALID_ARGUMENT, "%s: %s=\"%s\"; set %s, or unset it", what, t->name,
                      value, hint);
    case TW_TUNABLE_SAY_USE:
    default:
      return tw__fail(TW_ERR_INVALID_ARGUMENT, "%s: %s='%s'; use %s (or unset it)", what, t->name,
                      value, hint);
  }
}

static tw_status tw__tunable_kind_check(const tw_tunable* t, tw_tunable_id id,
                                        tw_tunable_kind kind) {
  if (t == NULL || t->kind != kind)
    return tw__fail(TW_ERR_INTERNAL, "tunable %d is not of kind %d", (int)id, (int)kind);
  return TW_SUCCESS;
}

tw_status tw__tunable_int_or(const char* what, tw_tunable_id id, int32_t fallback, int32_t* out) {
  TW_CHECK_NULL(out);
  const tw_tunable* t = tw__tunable(id);
  TW_TRY(tw__tunable_kind_check(t, id, TW_TUNABLE_INT));
  const char* s = tw__tunable_raw(id);
  if (s == NULL) {
    *out = fallback;
    return TW_SUCCESS;
  }
  int64_t v = 0;
  if (!tw__tunable_parse_int(s, t->lo, t->hi, t->say == TW_TUNABLE_SAY_NOUN, &v))
    return tw__tunable_bad(what, t, s);
  *out = (int32_t)v;
  return TW_SUCCESS;
}

tw_status tw__tunable_int(const char* what, tw_tunable_id id, int32_t* out) {
  const tw_tunable* t = tw__tunable(id);
  return tw__tunable_int_or(what, id, t != NULL ? (int32_t)t->def : 0, out);
}

int64_t tw__tunable_int_lenient(tw_tunable_id id, int64_t fallback) {
  const tw_tunable* t = tw__tunable(id);
  if (t == NULL) return fallback;
  return tw__env_int(t->name, fallback);
}

int32_t tw__tunable_match(tw_tunable_id id, const char* value) {
  const tw_tunable* t = tw__tunable(id);
  if (t == NULL || t->choices == NULL || value == NULL) return -1;
  for (int32_t i = 0; t->choices[i] != NULL; i++)
    if ((t->case_blind ? strcasecmp(value, t->choices[i]) : strcmp(value, t->choices[i])) == 0)
      return i;
  return -1;
}

tw_status tw__tunable_choice(const char* what, tw_tunable_id id, int32_t* index) {
  TW_CHECK_NULL(index);
  const tw_tunable* t = tw__tunable(id);
  TW_TRY(tw__tunable_kind_check(t, id, TW_TUNABLE_CHOICE));
  const char* s = tw__tunable_raw(id);
  if (s == NULL) {
    *index = (int32_t)t->def;
    return TW_SUCCESS;
  }
  const int32_t i = tw__tunable_match(id, s);
  if (i < 0) return tw__tunable_bad(what, t, s);
  *index = i;
  return TW_SUCCESS;
}

const char* tw__tunable_string(tw_tunable_id id) {
  return tw__tunable_raw(id);
}
