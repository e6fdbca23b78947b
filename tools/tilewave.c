/*
 * tilewave.c: the `tilewave` command-line tool. Each subcommand lives in its own cmd_*.c file and
 * is listed in the table below.
 */
#include <stdio.h>
#include <string.h>

#include "tilewave.h"
#include "cli.h"

static int cmd_version(int argc, char** argv) {
  (void)argc;
  (void)argv;
  int v = tw_version();
  printf("tilewave %d.%d.%d\n", v / 10000, (v / 100) % 100, v % 100);
  return 0;
}

static const tw_cli_command commands[] = {
    {"version", "print the library version", cmd_version},
    {"plan", "plan a rank and show the model's choice of C and mgb (no GPU)", tw_cli_plan},
    {"bench",
     "overlapped GEMM2 + combine vs sequential, unfused and chunked baselines (without GPUs: "
     "the planner's what-if); `bench gemm`: producer GEMM vs cuBLAS; `bench gemm1`: GEMM1 + "
     "SwiGLU vs cuBLAS",
     tw_cli_bench},
    {"sweep", "every C and mgb of one point: oracle, the model's choice, regret", tw_cli_sweep},
    {"calibrate", "measure this machine's model parameters; writes a TW_CALIBRATION file",
     tw_cli_calibrate},
    {"trace", "one call's timeline (tiles, units, waits) as Perfetto / chrome://tracing JSON",
     tw_cli_trace},
};

static void usage(FILE* f) {
  fprintf(f,
          "usage: tilewave <command> [options]   (tilewave <command> --help for its "
          "options)\n\ncommands:\n");
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    fprintf(f, "  %-10s %s\n", commands[i].name, commands[i].summary);
}

int main(int argc, char** argv) {
  if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
      strcmp(argv[1], "help") == 0) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    if (strcmp(argv[1], commands[i].name) == 0) return commands[i].run(argc - 1, argv + 1);
  fprintf(stderr, "tilewave: unknown command '%s'\n\n", argv[1]);
  usage(stderr);
  return 2;
}
