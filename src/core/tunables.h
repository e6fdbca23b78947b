/*
 * tunables.h: every TW_* environment variable the library reads, in one table (tunables.c), and
 * the typed accessors that read them (internal).
 *
 * An entry has the variable's name, its kind, its default, its range (integers) or its choices
 * (names), and a one-line doc; README.md's table of environment variables lists the same. A
 * caller reads a variable through the accessor of its kind, which applies the table's default
 * and range and words the error: nothing else in src/ calls getenv for a TW_* variable. Every
 * accessor reads the environment on each call (callers that must read once cache the value:
 * TW_DEBUG in tw__log_level, TW_CALIBRATION in hardware.c).
 *
 * The tests' own variables (TW_TEST_SEED, TW_TEST_WORLDS, TW_TEST_QUICK, TW_GEMM_TEST_QUICK) are
 * not the library's and are not in the table.
 */
#ifndef TW_TUNABLES_H
#define TW_TUNABLES_H

#include <stdint.h>

#include "tilewave.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One id per table entry, in table order. */
typedef enum tw_tunable_id {
  TW_TUNE_DEBUG = 0,               /* choice, lenient: log level */
  TW_TUNE_TIMEOUT_MS,              /* integer, lenient: bound of every device-side wait */
  TW_TUNE_CALIBRATION,             /* string: hardware description file */
  TW_TUNE_SCHEDULE,                /* choice: tile schedule of plans */
  TW_TUNE_TILE_GROUP,              /* integer: bands per tile group */
  TW_TUNE_COMBINE_DATAFLOW,        /* choice: dataflow of plans and contexts */
  TW_TUNE_CONSUMER_TILES_PER_UNIT, /* integer, lenient: column tiles per consumer unit */
  TW_TUNE_CONSUMER_TAIL_BANDS,     /* integer: tail bands of every destination stream */
  TW_TUNE_CONSUMER_TAIL_PARTS,     /* integer: row parts per tail band */
  TW_TUNE_CONSUMER_COPY,           /* choice: how the consumer copies */
  TW_TUNE_GEMM_VARIANT,            /* integer: producer kernel version */
  TW_TUNE_ADD_ZEROING,             /* choice: how the add dataflow zeroes its next output */
  TW_TUNE_DEBUG_TAGS,              /* integer, lenient: debug tags on forwarded rows */
  TW_TUNE_UNIQUE_ID_FILE,          /* string: NCCL unique id file under an external launcher */
  TW_TUNE_TEAM_TIMEOUT_MS,         /* integer: bound of a team's host collectives */
  TW_TUNE_COUNT
} tw_tunable_id;

typedef enum tw_tunable_kind {
  /* An integer in [lo, hi]; anything else set is an error (tw__tunable_int). */
  TW_TUNABLE_INT = 0,
  /* An integer read leniently: a value that is not an integer is ignored with a warning, and the
   * caller clamps (tw__tunable_int_lenient; lo, hi document the useful range). */
  TW_TUNABLE_INT_LENIENT = 1,
  /* One of `choices`; anything else set is an error (tw__tunable_choice), or, for a lenient one
   * (TW_DEBUG), the default (tw__tunable_match). */
  TW_TUNABLE_CHOICE = 2,
  /* A string, typically a path (tw__tunable_string). */
  TW_TUNABLE_STRING = 3
} tw_tunable_kind;

/* How a bad value's message reads (each variable keeps the wording it has always had):
 *   TW_TUNABLE_SAY_USE:  "<what>: NAME='value'; use <hint> (or unset it)"
 *   TW_TUNABLE_SAY_SET:  "<what>: NAME=\"value\"; set <hint>, or unset it"
 *   TW_TUNABLE_SAY_NOUN: "NAME=\"value\" is not <noun>; set <hint>, or unset it"
 * where <hint> is "an integer in LO..HI" (USE) or "LO to HI" (SET, NOUN) for an integer, and the
 * entry's `hint` for a choice. Integers of the NOUN form are parsed by strtol (leading blanks
 * allowed), those of the USE form reject leading blanks. */
typedef enum tw_tunable_say {
  TW_TUNABLE_SAY_USE = 0,
  TW_TUNABLE_SAY_SET = 1,
  TW_TUNABLE_SAY_NOUN = 2
} tw_tunable_say;

typedef struct tw_tunable {
  const char* name; /* "TW_TILE_GROUP" */
  tw_tunable_kind kind;
  int64_t def;                /* integers: the default; choices: the default's index in `choices`;
                                 strings: unused (the default is unset) */
  int64_t lo, hi;             /* integers: the range (inclusive) */
  const char* const* choices; /* choices: the accepted names, NULL-terminated */
  int case_blind;             /* choices: names match case-blind (strcasecmp) */
  tw_tunable_say say;         /* the form of a bad value's message */
  const char* noun;           /* TW_TUNABLE_SAY_NOUN: "a band count" */
  const char* hint;           /* choices: the accepted names as the message lists them */
  const char* doc;            /* one line: what it sets, its default */
} tw_tunable;

/* The table: TW_TUNE_COUNT entries, entry i has id i. */
const tw_tunable* tw__tunable_table(void);
/* The entry of `id` (NULL for an id outside the table), or of a name (NULL if none). */
const tw_tunable* tw__tunable(tw_tunable_id id);
const tw_tunable* tw__tunable_find(const char* name);

/* The variable's value as set: NULL when it is unset or empty. */
const char* tw__tunable_raw(tw_tunable_id id);

/* TW_TUNABLE_INT: *out = the value, or the table's default when unset or empty; a value that is
 * not an integer in [lo, hi] is TW_ERR_INVALID_ARGUMENT naming the variable and the range in the
 * entry's form (`what` leads it in the USE and SET forms), *out untouched. */
tw_status tw__tunable_int(const char* what, tw_tunable_id id, int32_t* out);
/* The same with the caller's default instead of the table's (a default that depends on the
 * call, such as the tail bands of a context). */
tw_status tw__tunable_int_or(const char* what, tw_tunable_id id, int32_t fallback, int32_t* out);
/* TW_TUNABLE_INT_LENIENT: the value, or `fallback` when unset or empty, or (with a warning that
 * names the variable) when not an integer; no range check: the caller clamps. */
int64_t tw__tunable_int_lenient(tw_tunable_id id, int64_t fallback);

/* TW_TUNABLE_CHOICE: *index = the value's index in the entry's choices, or the default's index
 * when unset or empty; any other value is TW_ERR_INVALID_ARGUMENT naming the variable and the
 * choices in the entry's form, *index untouched. */
tw_status tw__tunable_choice(const char* what, tw_tunable_id id, int32_t* index);
/* The index of `value` in the entry's choices (case-blind where the entry is), -1 if none or if
 * value is NULL. */
int32_t tw__tunable_match(tw_tunable_id id, const char* value);

/* TW_TUNABLE_STRING: the value, NULL when unset or empty. */
const char* tw__tunable_string(tw_tunable_id id);

/* The integer parse of the table's USE form, for callers with a variable of their own (the
 * generic tw__env_int_in): *out = the value when `s` is an integer in [lo, hi] without leading
 * blanks; returns 0 and leaves *out when it is not. */
int tw__tunable_parse_int(const char* s, int64_t lo, int64_t hi, int blanks_ok, int64_t* out);

#ifdef __cplusplus
}
#endif

#endif /* TW_TUNABLES_H */
