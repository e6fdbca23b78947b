/*
 * cli.h: what the `tilewave` subcommands share. Each command is `int run(argc, argv)` with
 * argv[0] the command's name; it returns the process exit code (0 ok, 1 failure, 2 usage error).
 */
#ifndef TW_CLI_H
#define TW_CLI_H

typedef struct tw_cli_command {
  const char* name;
  const char* summary;
  int (*run)(int argc, char** argv);
} tw_cli_command;

#ifdef __cplusplus
extern "C" {
#endif
/* `tilewave bench gemm`: the producer GEMM against cuBLAS (tools/bench_gemm.cu). */
int tw_cli_bench_gemm(int argc, char** argv);
/* `tilewave bench gemm1`: GEMM1 + SwiGLU against cuBLAS + SwiGLU (tools/bench_gemm1.cu). */
int tw_cli_bench_gemm1(int argc, char** argv);
/* `tilewave bench layer` (tw_moe_layer against the sequential layer) and `bench dispatch`
 * (tw_moe_dispatch against permute + copy all-to-all), on one GPU: tools/bench_layer.c. */
int tw_cli_bench_layer(int argc, char** argv);
int tw_cli_bench_dispatch(int argc, char** argv);
/* `tilewave plan`: planner and resource model, no GPU needed (tools/cmd_plan.c). */
int tw_cli_plan(int argc, char** argv);
/* `tilewave bench` (overlap vs the baselines; `bench gemm` forwards to tw_cli_bench_gemm) and
 * `tilewave sweep` (every C and mgb of one point against the model's choice): tools/cmd_bench.c. */
int tw_cli_bench(int argc, char** argv);
int tw_cli_sweep(int argc, char** argv);
/* `tilewave calibrate`: measures the model's machine description (tools/cmd_calibrate.c). */
int tw_cli_calibrate(int argc, char** argv);
/* `tilewave trace`: one call recorded as trace-event JSON (tools/cmd_trace.c). */
int tw_cli_trace(int argc, char** argv);
/* Routers on the command line (tools/cli_router.c): balanced, moderate_skew, stress_skew or
 * target:R (R >= 1, the target R_expert, into *param); 1 when v names one, else 0. */
int tw__cli_parse_router(const char* v, int* router, double* param);
const char* tw__cli_router_name(int router);
/* A router of `bench layer` and `bench dispatch` only (tools/bench_layer.c builds it from a
 * balanced routing): expert 0 in every token's choices. tw__cli_router_name names it "hot". */
#define TWB_ROUTER_HOT 100
/* A tw_schedule's name as the command line spells it ("?" for AUTO or an unknown value). */
const char* tw__cli_schedule_name(int schedule);
#ifdef __cplusplus
}
#endif

#endif /* TW_CLI_H */
