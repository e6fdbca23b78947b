/*
 * cli_args.h: the one argument layer of the `tilewave` subcommands. A command lists its flags in
 * a table of typed entries (integer with a range, integer list, 64-bit integer, double with a
 * range, string, choice, bool, or a custom parser) and calls tw__cli_parse once; every usage
 * error names the flag and what it takes (the range, the choices) and is exit code 2.
 *
 * Concepts that several subcommands share have one canonical spelling, one value name and one
 * range, given by the TW_CLI_* constructors below; a command never spells them itself. Older
 * spellings stay accepted as aliases (see docs/bench.md):
 *   --ranks N        (alias --gpus, `tilewave plan`'s former name)
 *   --hidden H       (alias --n, `bench gemm`'s former name)
 *   --ffn F          (alias --k, `bench gemm`)
 *   --tile-m/--tile-n (aliases --tm/--tn, `bench gemm`)
 *   --iters N        (alias --reps, `bench gemm`)
 *   --json-file F    (alias --json F in `tilewave calibrate`, where --json always took a file)
 */
#ifndef TW_CLI_ARGS_H
#define TW_CLI_ARGS_H

#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tw_cli_type {
  TW_CLI_T_INT,      /* int, in [lo, hi] */
  TW_CLI_T_INT_LIST, /* comma-separated ints in [lo, hi], at most `max` of them */
  TW_CLI_T_I64,      /* int64_t, in [lo, hi] */
  TW_CLI_T_DOUBLE,   /* double, in [dlo, dhi] (dlo_open: lo excluded) */
  TW_CLI_T_STRING,   /* const char*, non-empty */
  TW_CLI_T_CHOICE,   /* one of names[] (case-insensitive): *int = values[i] */
  TW_CLI_T_BOOL,     /* no value: *int = 1 */
  TW_CLI_T_CUSTOM    /* parse(value, dst): NULL when good, else what to give */
} tw_cli_type;

#define TW_CLI_MAX_CHOICES 8

typedef struct tw_cli_arg {
  const char* name;  /* canonical spelling, "--hidden" */
  const char* alias; /* another accepted spelling, or NULL */
  tw_cli_type type;
  void* dst;
  long long lo, hi;                      /* INT, INT_LIST, I64 */
  double dlo, dhi;                       /* DOUBLE */
  int dlo_open;                          /* DOUBLE: dlo itself is out of range */
  int max;                               /* INT_LIST: capacity of dst */
  int* count;                            /* INT_LIST: how many were given */
  const char* names[TW_CLI_MAX_CHOICES]; /* CHOICE, NULL-terminated */
  int values[TW_CLI_MAX_CHOICES];
  const char** chosen_name;                       /* CHOICE: also the name given (optional) */
  const char* (*parse)(const char* v, void* dst); /* CUSTOM */
  int optional_value; /* INT: the value may be left out (next is a flag or none): *dst = this */
  int has_optional;
  int seen; /* set by tw__cli_parse: how many times the flag was given */
} tw_cli_arg;

/* Constructors of the entry kinds. */
tw_cli_arg tw__cli_int(const char* name, int* dst, long long lo, long long hi);
tw_cli_arg tw__cli_int_list(const char* name, int* dst, int max, int* count, long long lo,
                            long long hi);
tw_cli_arg tw__cli_i64(const char* name, int64_t* dst, long long lo, long long hi);
tw_cli_arg tw__cli_double(const char* name, double* dst, double lo, double hi, int lo_open);
tw_cli_arg tw__cli_string(const char* name, const char** dst);
tw_cli_arg tw__cli_bool(const char* name, int* dst);
/* names and values: n entries (n <= TW_CLI_MAX_CHOICES - 1). */
tw_cli_arg tw__cli_choice(const char* name, int* dst, int n, const char* const* names,
                          const int* values);
tw_cli_arg tw__cli_custom(const char* name, void* dst, const char* (*parse)(const char*, void*));
/* The same entry, also accepted as `alias`. */
tw_cli_arg tw__cli_alias(tw_cli_arg a, const char* alias);

/* ---- the shared concepts: one spelling and one range for every subcommand ---- */
#define TW_CLI_HIDDEN_MIN 8
#define TW_CLI_HIDDEN_MAX 65536
#define TW_CLI_EXPERTS_MAX 4096
#define TW_CLI_TOPK_MAX 64
#define TW_CLI_TOKENS_MAX (1 << 24)
#define TW_CLI_TILE_MAX 1024
#define TW_CLI_COALESCE_MAX 65536
#define TW_CLI_ITERS_MAX 100000
#define TW_CLI_DELAY_US_MAX 1000000
#define TW_CLI_TIMEOUT_MAX (1 << 30)

tw_cli_arg tw__cli_hidden(int* dst);                           /* --hidden H: 8..65536 */
tw_cli_arg tw__cli_ffn(int* dst);                              /* --ffn F: 8..65536 */
tw_cli_arg tw__cli_experts(int* dst);                          /* --experts E: 1..4096 */
tw_cli_arg tw__cli_topk(int* dst);                             /* --topk K: 1..64 */
tw_cli_arg tw__cli_tokens(int* dst);                           /* --tokens T: 1..2^24 */
tw_cli_arg tw__cli_tokens_list(int* dst, int max, int* count); /* --tokens T[,T...] */
tw_cli_arg tw__cli_ranks(int* dst);             /* --ranks N (alias --gpus): 1..TW_MAX_RANKS */
tw_cli_arg tw__cli_tp(int* dst);                /* --tp T: 1..TW_MAX_TP TP ranks per EP group */
tw_cli_arg tw__cli_ep(int* dst);                /* --ep E: 1..TW_MAX_RANKS EP groups */
tw_cli_arg tw__cli_splits(int* dst);            /* --splits L: 1..64 GatherRS column splits */
tw_cli_arg tw__cli_tile_m(int* dst);            /* --tile-m TM: 1..1024 */
tw_cli_arg tw__cli_tile_n(int* dst);            /* --tile-n TN: 1..1024 */
tw_cli_arg tw__cli_comm_ctas(int* dst);         /* --comm-ctas C: 1..TW_MAX_COMM_CTAS */
tw_cli_arg tw__cli_coalesce(int* dst);          /* --coalesce MGB: 1..65536 */
tw_cli_arg tw__cli_seed(int64_t* dst);          /* --seed S: 0..2^63-1 */
tw_cli_arg tw__cli_schedule(int* dst);          /* --schedule auto|remote-first|expert-major */
tw_cli_arg tw__cli_dataflow(int* dst);          /* --dataflow reduce|add */
tw_cli_arg tw__cli_iters(int* dst);             /* --iters N: 1..100000 */
tw_cli_arg tw__cli_warmup(int* dst);            /* --warmup N: 0..100000 */
tw_cli_arg tw__cli_delay_us(int* dst);          /* --delay-us U: 0..1000000 */
tw_cli_arg tw__cli_timeout(int* dst);           /* --timeout S: 0..2^30 */
tw_cli_arg tw__cli_json(int* dst);              /* --json: JSON on stdout */
tw_cli_arg tw__cli_json_file(const char** dst); /* --json-file F */

/* A router on the command line: what --router fills. */
typedef struct tw_cli_router {
  int router; /* tw_router; -1 = not given */
  double param;
  const char* name; /* as given */
} tw_cli_router;
tw_cli_arg tw__cli_router_arg(tw_cli_router* dst); /* --router R */

/* Parses argv[1..argc) against args[0..n). `cmd` names the command in messages ("tilewave
 * plan"); `usage` prints its help (on --help/-h, to stdout). Returns 0 when parsed, 1 when the
 * help was printed (exit 0), 2 after a usage error (printed). */
int tw__cli_parse(const char* cmd, int argc, char** argv, tw_cli_arg* args, int n,
                  void (*usage)(FILE*, void*), void* usage_ctx);

/* A usage error of `cmd` found after parsing: prints "cmd: MESSAGE" and where the options are
 * listed; returns 2. */
int tw__cli_usage_error(const char* cmd, const char* fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Strict number parsing: the whole string must be a number within [lo, hi]. */
int tw__cli_parse_ll(const char* s, long long lo, long long hi, long long* out);
int tw__cli_parse_double(const char* s, double* out);

#ifdef __cplusplus
}
#endif

#endif /* TW_CLI_ARGS_H */
