/*
 * test_cli_args.c: the command-line layer of the tools (tools/cli_args.c) and the measurements'
 * statistics and JSON values (harness/bench_stats.c): ranges, aliases, lists, choices, optional
 * values, usage errors (2), help (1); the median of an even count, percentiles, null for NaN.
 */
#define _POSIX_C_SOURCE 200809L /* fmemopen */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "bench_stats.h"
#include "cli_args.h"
#include "tilewave.h"
#include "tw_test.h"

typedef struct opts {
  int hidden, ranks, json, schedule, tokens[4], ntokens, bench, tp, ep, splits;
  double tol;
  const char* file;
  int64_t seed;
  tw_cli_router router;
} opts;

/* Parses the NULL-terminated args into *o (zeroed first); returns tw__cli_parse's code. Usage
 * messages go to stderr, as in the tool. */
static int parse(opts* o, const char* const* args) {
  memset(o, 0, sizeof *o);
  o->router.router = -1;
  char* argv[16];
  int argc = 0;
  argv[argc++] = (char*)"test";
  for (int i = 0; args[i] != NULL && argc < 16; i++) argv[argc++] = (char*)args[i];
  tw_cli_arg t[] = {
      tw__cli_hidden(&o->hidden),
      tw__cli_ranks(&o->ranks),
      tw__cli_json(&o->json),
      tw__cli_schedule(&o->schedule),
      tw__cli_tokens_list(o->tokens, 4, &o->ntokens),
      tw__cli_double("--tol", &o->tol, 0.0, 1.0, 1),
      tw__cli_alias(tw__cli_json_file(&o->file), "--out"),
      tw__cli_seed(&o->seed),
      tw__cli_router_arg(&o->router),
      tw__cli_int("--bench-solve", &o->bench, 1, 100),
      tw__cli_tp(&o->tp),
      tw__cli_ep(&o->ep),
      tw__cli_splits(&o->splits),
  };
  t[9].has_optional = 1, t[9].optional_value = 7;
  return tw__cli_parse("test", argc, argv, t, (int)(sizeof t / sizeof t[0]), NULL, NULL);
}

static void test_values(void) {
  opts o;
  const char* a[] = {"--hidden",   "4096",         "--ranks",    "8",         "--json",
                     "--schedule", "Expert-Major", "--tokens",   "1024,4096", "--tol",
                     "0.5",        "--seed",       "9000000000", NULL};
  CHECK(parse(&o, a) == 0);
  CHECK(o.hidden == 4096 && o.ranks == 8 && o.json == 1);
  CHECK(o.schedule == TW_SCHEDULE_EXPERT_MAJOR);
  CHECK(o.ntokens == 2 && o.tokens[0] == 1024 && o.tokens[1] == 4096);
  CHECK(o.tol == 0.5 && o.seed == 9000000000LL);
}

static void test_aliases(void) {
  opts o;
  const char* a[] = {"--gpus", "4", "--out", "f.json", NULL};
  CHECK(parse(&o, a) == 0);
  CHECK(o.ranks == 4 && o.file != NULL && strcmp(o.file, "f.json") == 0);
}

static void test_ranges(void) {
  opts o;
  const char* lo[] = {"--hidden", "4", NULL};
  const char* hi[] = {"--ranks", "65", NULL};
  const char* neg[] = {"--tokens", "-3", NULL};
  const char* many[] = {"--tokens", "1,2,3,4,5", NULL};
  const char* junk[] = {"--hidden", "12x", NULL};
  const char* open_lo[] = {"--tol", "0", NULL};
  const char* choice[] = {"--schedule", "fastest", NULL};
  const char* router[] = {"--router", "target:0.5", NULL};
  const char* missing[] = {"--hidden", NULL};
  const char* unknown[] = {"--bogus", NULL};
  CHECK(parse(&o, lo) == 2);
  CHECK(parse(&o, hi) == 2);
  CHECK(parse(&o, neg) == 2);
  CHECK(parse(&o, many) == 2);
  CHECK(parse(&o, junk) == 2);
  CHECK(parse(&o, open_lo) == 2);
  CHECK(parse(&o, choice) == 2);
  CHECK(parse(&o, router) == 2);
  CHECK(parse(&o, missing) == 2);
  CHECK(parse(&o, unknown) == 2);
  const char* edge[] = {"--hidden", "65536", "--ranks", "64", "--router", "target:2", NULL};
  CHECK(parse(&o, edge) == 0);
  CHECK(o.hidden == 65536 && o.ranks == 64);
  CHECK(o.router.router == TW_ROUTER_TARGET && o.router.param == 2.0);
  /* The TP x EP concepts: tp within one NVLink domain, ep up to the ranks of a context. */
  const char* tp_edge[] = {"--tp", "8", "--ep", "64", "--splits", "64", NULL};
  CHECK(parse(&o, tp_edge) == 0);
  CHECK(o.tp == TW_MAX_TP && o.ep == TW_MAX_RANKS && o.splits == 64);
  const char* tp_hi[] = {"--tp", "9", NULL};
  const char* tp_lo[] = {"--tp", "0", NULL};
  const char* ep_hi[] = {"--ep", "65", NULL};
  const char* splits_lo[] = {"--splits", "0", NULL};
  CHECK(parse(&o, tp_hi) == 2);
  CHECK(parse(&o, tp_lo) == 2);
  CHECK(parse(&o, ep_hi) == 2);
  CHECK(parse(&o, splits_lo) == 2);
}

static void test_optional_and_help(void) {
  opts o;
  const char* bare[] = {"--bench-solve", "--json", NULL};
  CHECK(parse(&o, bare) == 0);
  CHECK(o.bench == 7 && o.json == 1);
  const char* given[] = {"--bench-solve", "50", NULL};
  CHECK(parse(&o, given) == 0);
  CHECK(o.bench == 50);
  const char* help[] = {"--json", "--help", NULL};
  CHECK(parse(&o, help) == 1);
}

static void test_stats(void) {
  double even[] = {4, 1, 3, 2};
  CHECK_NEAR(tw__stats_median(even, 4), 2.5, 1e-12); /* the mean of the two middles */
  double odd[] = {5, 1, 3};
  CHECK(tw__stats_median(odd, 3) == 3.0);
  double v[] = {5, 1, 3, 2, 4};
  CHECK_NEAR(tw__stats_percentile(v, 5, 0.99), 4.96, 1e-12);
  const float f[] = {10.f, 20.f};
  CHECK_NEAR(tw__stats_percentile_f(f, 2, 0.5), 15.0, 1e-12);
  CHECK(isnan(tw__stats_median(v, 0)));
  const float s[] = {3.f, 1.f, 2.f, 4.f};
  tw__bench_stats st;
  tw__bench_stats_of(s, 4, &st);
  CHECK(st.n == 4 && st.min == 1.0 && st.max == 4.0 && st.median == 2.5 && st.mean == 2.5);
}

static void test_json(void) {
  char buf[64];
  CHECK(strcmp(tw__json_fmt(buf, sizeof buf, "%.2f", 1.5), "1.50") == 0);
  CHECK(strcmp(tw__json_fmt(buf, sizeof buf, "%.2f", NAN), "null") == 0);
  CHECK(strcmp(tw__json_fmt(buf, sizeof buf, "%.2f", INFINITY), "null") == 0);
  char out[64] = "";
  FILE* f = fmemopen(out, sizeof out - 1, "w");
  CHECK(f != NULL);
  if (f == NULL) return;
  tw__json_str(f, "a\"b\\c\n");
  fputc(' ', f);
  tw__json_str(f, NULL);
  fclose(f);
  CHECK(strcmp(out, "\"a\\\"b\\\\c\\u000a\" null") == 0);
}

TW_TEST_MAIN(TW_TEST(test_values), TW_TEST(test_aliases), TW_TEST(test_ranges),
             TW_TEST(test_optional_and_help), TW_TEST(test_stats), TW_TEST(test_json))
