/*
 * cli_args.c: the typed flag tables of the `tilewave` subcommands and their one parser (see
 * cli_args.h).
 */
#define _POSIX_C_SOURCE 200809L
#include "cli_args.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "cli.h"
#include "plan.h" /* tw__schedule_parse, tw__dataflow_parse */
#include "tilewave.h"

int tw__cli_parse_ll(const char* s, long long lo, long long hi, long long* out) {
  if (s == NULL || *s == '\0') return 0;
  char* end = NULL;
  errno = 0;
  const long long v = strtoll(s, &end, 10);
  if (errno != 0 || *end != '\0' || v < lo || v > hi) return 0;
  *out = v;
  return 1;
}

int tw__cli_parse_double(const char* s, double* out) {
  if (s == NULL || *s == '\0') return 0;
  char* end = NULL;
  errno = 0;
  const double v = strtod(s, &end);
  if (errno != 0 || *end != '\0') return 0;
  *out = v;
  return 1;
}

static tw_cli_arg tw__cli_blank(const char* name, tw_cli_type type, void* dst) {
  tw_cli_arg a;
  memset(&a, 0, sizeof a);
  a.name = name;
  a.type = type;
  a.dst = dst;
  return a;
}

tw_cli_arg tw__cli_int(const char* name, int* dst, long long lo, long long hi) {
  tw_cli_arg a = tw__cli_blank(name, TW_CLI_T_INT, dst);
  a.lo = lo, a.hi = hi;
  return a;
}

tw_cli_arg tw__cli_int_list(const char* name, int* dst, int max, int* count, long long lo,
                            long long hi) {
  tw_cli_arg a = tw__cli_blank(name, TW_CLI_T_INT_LIST, dst);
  a.lo = lo, a.hi = hi, a.max = max, a.count = count;
  return a;
}

tw_cli_arg tw__cli_i64(const char* name, int64_t* dst, long long lo, long long hi) {
  tw_cli_arg a = tw__cli_blank(name, TW_CLI_T_I64, dst);
  a.lo = lo, a.hi = hi;
  return a;
}

tw_cli_arg tw__cli_double(const char* name, double* dst, double lo, double hi, int lo_open) {
  tw_cli_arg a = tw__cli_blank(name, TW_CLI_T_DOUBLE, dst);
  a.dlo = lo, a.dhi = hi, a.dlo_open = lo_open;
  return a;
}

tw_cli_arg tw__cli_string(const char* name, const char** dst) {
  return tw__cli_blank(name, TW_CLI_T_STRING, (void*)dst);
}

tw_cli_arg tw__cli_bool(const char* name, int* dst) {
  return tw__cli_blank(name, TW_CLI_T_BOOL, dst);
}

tw_cli_arg tw__cli_choice(const char* name, int* dst, int n, const char* const* names,
                          const int* values) {
  tw_cli_arg a = tw__cli_blank(name, TW_CLI_T_CHOICE, dst);
  for (int i = 0; i < n && i < TW_CLI_MAX_CHOICES - 1; i++)
    a.names[i] = names[i], a.values[i] = values ? values[i] : i;
  return a;
}

tw_cli_arg tw__cli_custom(const char* name, void* dst, const char* (*parse)(const char*, void*)) {
  tw_cli_arg a = tw__cli_blank(name, TW_CLI_T_CUSTOM, dst);
  a.parse = parse;
  return a;
}

tw_cli_arg tw__cli_alias(tw_cli_arg a, const char* alias) {
  a.alias = alias;
  return a;
}

/* ---- the shared concepts ---- */

tw_cli_arg tw__cli_hidden(int* dst) {
  return tw__cli_int("--hidden", dst, TW_CLI_HIDDEN_MIN, TW_CLI_HIDDEN_MAX);
}
tw_cli_arg tw__cli_ffn(int* dst) {
  return tw__cli_int("--ffn", dst, TW_CLI_HIDDEN_MIN, TW_CLI_HIDDEN_MAX);
}
tw_cli_arg tw__cli_experts(int* dst) {
  return tw__cli_int("--experts", dst, 1, TW_CLI_EXPERTS_MAX);
}
tw_cli_arg tw__cli_topk(int* dst) {
  return tw__cli_int("--topk", dst, 1, TW_CLI_TOPK_MAX);
}
tw_cli_arg tw__cli_tokens(int* dst) {
  return tw__cli_int("--tokens", dst, 1, TW_CLI_TOKENS_MAX);
}
tw_cli_arg tw__cli_tokens_list(int* dst, int max, int* count) {
  return tw__cli_int_list("--tokens", dst, max, count, 1, TW_CLI_TOKENS_MAX);
}
tw_cli_arg tw__cli_ranks(int* dst) {
  return tw__cli_alias(tw__cli_int("--ranks", dst, 1, TW_MAX_RANKS), "--gpus");
}
tw_cli_arg tw__cli_tp(int* dst) {
  return tw__cli_int("--tp", dst, 1, TW_MAX_TP);
}
tw_cli_arg tw__cli_ep(int* dst) {
  return tw__cli_int("--ep", dst, 1, TW_MAX_RANKS);
}
tw_cli_arg tw__cli_splits(int* dst) {
  return tw__cli_int("--splits", dst, 1, 64);
}
tw_cli_arg tw__cli_tile_m(int* dst) {
  return tw__cli_int("--tile-m", dst, 1, TW_CLI_TILE_MAX);
}
tw_cli_arg tw__cli_tile_n(int* dst) {
  return tw__cli_int("--tile-n", dst, 1, TW_CLI_TILE_MAX);
}
tw_cli_arg tw__cli_comm_ctas(int* dst) {
  return tw__cli_int("--comm-ctas", dst, 1, TW_MAX_COMM_CTAS);
}
tw_cli_arg tw__cli_coalesce(int* dst) {
  return tw__cli_int("--coalesce", dst, 1, TW_CLI_COALESCE_MAX);
}
tw_cli_arg tw__cli_seed(int64_t* dst) {
  return tw__cli_i64("--seed", dst, 0, INT64_MAX);
}
tw_cli_arg tw__cli_schedule(int* dst) {
  static const char* const names[] = {"auto", "remote-first", "expert-major"};
  const int values[] = {TW_SCHEDULE_AUTO, TW_SCHEDULE_REMOTE_FIRST, TW_SCHEDULE_EXPERT_MAJOR};
  return tw__cli_choice("--schedule", dst, 3, names, values);
}
tw_cli_arg tw__cli_dataflow(int* dst) {
  static const char* const names[] = {"reduce", "add"};
  const int values[] = {TW_DATAFLOW_REDUCE, TW_DATAFLOW_ADD};
  return tw__cli_choice("--dataflow", dst, 2, names, values);
}
tw_cli_arg tw__cli_iters(int* dst) {
  return tw__cli_int("--iters", dst, 1, TW_CLI_ITERS_MAX);
}
tw_cli_arg tw__cli_warmup(int* dst) {
  return tw__cli_int("--warmup", dst, 0, TW_CLI_ITERS_MAX);
}
tw_cli_arg tw__cli_delay_us(int* dst) {
  return tw__cli_int("--delay-us", dst, 0, TW_CLI_DELAY_US_MAX);
}
tw_cli_arg tw__cli_timeout(int* dst) {
  return tw__cli_int("--timeout", dst, 0, TW_CLI_TIMEOUT_MAX);
}
tw_cli_arg tw__cli_json(int* dst) {
  return tw__cli_bool("--json", dst);
}
tw_cli_arg tw__cli_json_file(const char** dst) {
  return tw__cli_string("--json-file", dst);
}

static const char* tw__cli_router_parse(const char* v, void* dst) {
  tw_cli_router* r = (tw_cli_router*)dst;
  if (!tw__cli_parse_router(v, &r->router, &r->param))
    return "balanced, moderate_skew, stress_skew or target:R with R >= 1 (the target R_expert)";
  r->name = v;
  return NULL;
}
tw_cli_arg tw__cli_router_arg(tw_cli_router* dst) {
  return tw__cli_custom("--router", dst, tw__cli_router_parse);
}

/* ---- the parser ---- */

int tw__cli_usage_error(const char* cmd, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "%s: ", cmd);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n(%s --help lists the options)\n", cmd);
  va_end(ap);
  return 2;
}

static int tw__cli_matches(const tw_cli_arg* a, const char* s) {
  return strcmp(a->name, s) == 0 || (a->alias != NULL && strcmp(a->alias, s) == 0);
}

/* Parses one value into a; returns 0 or 2 (message printed). */
static int tw__cli_value(const char* cmd, const char* flag, tw_cli_arg* a, const char* v) {
  long long n = 0;
  switch (a->type) {
    case TW_CLI_T_INT:
      if (!tw__cli_parse_ll(v, a->lo, a->hi, &n))
        return tw__cli_usage_error(cmd, "%s: give an integer in %lld..%lld (got '%s')", flag, a->lo,
                                   a->hi, v);
      *(int*)a->dst = (int)n;
      return 0;
    case TW_CLI_T_I64:
      if (!tw__cli_parse_ll(v, a->lo, a->hi, &n))
        return tw__cli_usage_error(cmd, "%s: give an integer in %lld..%lld (got '%s')", flag, a->lo,
                                   a->hi, v);
      *(int64_t*)a->dst = (int64_t)n;
      return 0;
    case TW_CLI_T_INT_LIST: {
      char buf[512];
      snprintf(buf, sizeof buf, "%s", v);
      int k = 0, ok = v[0] != '\0' && strlen(v) < sizeof buf;
      char* save = NULL;
      for (char* tok = strtok_r(buf, ",", &save); ok && tok; tok = strtok_r(NULL, ",", &save)) {
        if (k >= a->max || !tw__cli_parse_ll(tok, a->lo, a->hi, &n)) {
          ok = 0;
          break;
        }
        ((int*)a->dst)[k++] = (int)n;
      }
      if (!ok || k == 0)
        return tw__cli_usage_error(
            cmd, "%s: give 1 to %d integers in %lld..%lld separated by commas (got '%s')", flag,
            a->max, a->lo, a->hi, v);
      *a->count = k;
      return 0;
    }
    case TW_CLI_T_DOUBLE: {
      double d = 0;
      if (!tw__cli_parse_double(v, &d) || !(a->dlo_open ? d > a->dlo : d >= a->dlo) ||
          !(d <= a->dhi))
        return tw__cli_usage_error(cmd, "%s: give a number in %s%g, %g] (got '%s')", flag,
                                   a->dlo_open ? "(" : "[", a->dlo, a->dhi, v);
      *(double*)a->dst = d;
      return 0;
    }
    case TW_CLI_T_STRING:
      if (v[0] == '\0') return tw__cli_usage_error(cmd, "%s: give a non-empty value", flag);
      *(const char**)a->dst = v;
      return 0;
    case TW_CLI_T_CHOICE: {
      for (int i = 0; a->names[i] != NULL; i++)
        if (strcasecmp(a->names[i], v) == 0) {
          *(int*)a->dst = a->values[i];
          if (a->chosen_name) *a->chosen_name = a->names[i];
          return 0;
        }
      char list[256] = "";
      for (int i = 0; a->names[i] != NULL; i++) {
        strncat(list, i ? " | " : "", sizeof list - strlen(list) - 1);
        strncat(list, a->names[i], sizeof list - strlen(list) - 1);
      }
      return tw__cli_usage_error(cmd, "%s: give one of %s (got '%s')", flag, list, v);
    }
    case TW_CLI_T_CUSTOM: {
      const char* want = a->parse(v, a->dst);
      if (want != NULL) return tw__cli_usage_error(cmd, "%s: give %s (got '%s')", flag, want, v);
      return 0;
    }
    case TW_CLI_T_BOOL:
      break;
  }
  return 0;
}

int tw__cli_parse(const char* cmd, int argc, char** argv, tw_cli_arg* args, int n,
                  void (*usage)(FILE*, void*), void* usage_ctx) {
  for (int i = 1; i < argc; i++) {
    const char* s = argv[i];
    if (strcmp(s, "--help") == 0 || strcmp(s, "-h") == 0) {
      if (usage) usage(stdout, usage_ctx);
      return 1;
    }
    tw_cli_arg* a = NULL;
    for (int j = 0; j < n && a == NULL; j++)
      if (args[j].name != NULL && tw__cli_matches(&args[j], s)) a = &args[j];
    if (a == NULL) return tw__cli_usage_error(cmd, "unknown option '%s'", s);
    a->seen++;
    if (a->type == TW_CLI_T_BOOL) {
      *(int*)a->dst = 1;
      continue;
    }
    const char* v = i + 1 < argc ? argv[i + 1] : NULL;
    if (a->has_optional && (v == NULL || (v[0] == '-' && v[1] != '\0'))) {
      *(int*)a->dst = a->optional_value;
      continue;
    }
    if (v == NULL) return tw__cli_usage_error(cmd, "%s needs a value", s);
    i++;
    const int rc = tw__cli_value(cmd, s, a, v);
    if (rc != 0) return rc;
  }
  return 0;
}
