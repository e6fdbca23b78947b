/*
 * tilewave.h: the public C API of tilewave.
 *
 * tilewave runs the Mixture-of-Experts return path of distributed inference (expert down
 * projection, then the combine all-to-all) so that the two overlap at tile granularity: a
 * persistent grouped GEMM publishes each finished tile, and a persistent communication kernel on a
 * few dedicated SMs forwards finished row bands to the ranks that own the tokens. An analytical
 * model picks, before each launch, how many SMs the communication side gets.
 *
 * Conventions (borrowed from NCCL):
 *  - every call returns a tw_status; tw_status_string() names the code and tw_last_error() gives
 *    the detail of the last failure on the calling thread, including what to change;
 *  - configuration structs start with size, magic and version and are filled by *_INIT macros;
 *    a NULL config means defaults;
 *  - handles are opaque; the object that creates a handle owns it until its *_destroy call;
 *  - the library never owns the caller's ncclComm_t or cudaStream_t;
 *  - nothing in the library calls exit() or abort().
 *
 * The planning half (problems, routings, plans, the resource model) is pure host code and works on
 * any machine, with or without a GPU.
 */
#ifndef TILEWAVE_H
#define TILEWAVE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Marks the public functions: the library is built with hidden visibility, so these are the only
 * symbols libtilewave.so exports. */
#if defined(__GNUC__) || defined(__clang__)
#define TW_API __attribute__((visibility("default")))
#else
#define TW_API
#endif

#define TW_VERSION_MAJOR 0
#define TW_VERSION_MINOR 1
#define TW_VERSION_PATCH 0
/* Version of the config structs below; bumped whenever any of them changes layout, except for a
 * field appended at the end that the size field tells apart (tw_plan_config.schedule). */
#define TW_API_VERSION 1

/* -------------------------------------------------------------------------------------------- */
/* Status codes                                                                                 */
/* -------------------------------------------------------------------------------------------- */

/* X(name, value, message). One table gives both the enum and the strings. */
#define TW_STATUS_TABLE(X)                                                               \
  X(TW_SUCCESS, 0, "success")                                                            \
  X(TW_ERR_NULL_POINTER, 1, "a required pointer argument is NULL")                       \
  X(TW_ERR_INVALID_SIZE, 2, "a size or count is zero, negative or too large")            \
  X(TW_ERR_INVALID_ARGUMENT, 3, "an argument is out of its documented range")            \
  X(TW_ERR_CONFIG_VERSION, 4, "a config struct has the wrong size, magic or version")    \
  X(TW_ERR_INDIVISIBLE, 5, "the expert count is not divisible by the world size")        \
  X(TW_ERR_TOPK_RANGE, 6, "top-k is outside 1..experts")                                 \
  X(TW_ERR_EXPERT_ID, 7, "an expert id is outside 0..experts-1")                         \
  X(TW_ERR_DUPLICATE_EXPERT, 8, "a token names the same expert twice")                   \
  X(TW_ERR_NONFINITE_WEIGHT, 9, "a gate weight is NaN or infinite")                      \
  X(TW_ERR_CAPACITY, 10, "more tokens than the declared capacity")                       \
  X(TW_ERR_ALIGNMENT, 11, "a dimension is not a multiple of what the kernels need")      \
  X(TW_ERR_UNSUPPORTED, 12, "the requested feature or data type is not supported")       \
  X(TW_ERR_OUT_OF_MEMORY, 13, "host or device memory allocation failed")                 \
  X(TW_ERR_IO, 14, "a file could not be read, written or parsed")                        \
  X(TW_ERR_NO_DEVICE, 15, "no usable CUDA device")                                       \
  X(TW_ERR_CUDA, 16, "a CUDA runtime or driver call failed")                             \
  X(TW_ERR_CUBLAS, 17, "a cuBLAS call failed")                                           \
  X(TW_ERR_NCCL, 18, "an NCCL call failed or the NCCL version does not match")           \
  X(TW_ERR_TIMEOUT, 19, "a wait exceeded its bound (TW_TIMEOUT_MS, TW_TEAM_TIMEOUT_MS)") \
  X(TW_ERR_STATE, 20, "the object is in the wrong state for this call")                  \
  X(TW_ERR_INTERNAL, 21, "internal error (a bug in tilewave; please report it)")         \
  X(TW_ERR_ABORTED, 22, "a rank aborted the context (tw_context_abort); destroy it")

typedef enum tw_status {
#define TW__STATUS_ENUM(name, value, msg) name = value,
  TW_STATUS_TABLE(TW__STATUS_ENUM)
#undef TW__STATUS_ENUM
} tw_status;

/* Name and one-line meaning of a status code, e.g. "TW_ERR_TOPK_RANGE: top-k is outside ...".
 * Never NULL; unknown codes give "TW_ERR_UNKNOWN". */
TW_API const char* tw_status_string(tw_status status);

/* Detail of the last failure on the calling thread (what was wrong and how to fix it), or "" if
 * no call on this thread has failed. The string stays valid until the next tilewave call on the
 * same thread. */
TW_API const char* tw_last_error(void);

/* Library version as MAJOR*10000 + MINOR*100 + PATCH. */
TW_API int tw_version(void);

/* -------------------------------------------------------------------------------------------- */
/* Problem description                                                                          */
/* -------------------------------------------------------------------------------------------- */

typedef enum tw_dtype { TW_BF16 = 0, TW_FP16 = 1 } tw_dtype;

#define TW_PROBLEM_MAGIC 0x74775062u /* "twPb" */

/* One MoE layer, expert parallel: world_size ranks, one GPU each, experts/world_size local
 * experts per rank, each token routed to top_k experts. GEMM2 (the down projection) has
 * K = ffn and N = hidden. */
/* Upper bounds of a problem (tw_problem_validate): beyond them no model is run, and the host
 * arrays a plan allocates (tiles, rows) would grow without limit. */
#define TW_MAX_HIDDEN 65536
#define TW_MAX_EXPERTS 4096
#define TW_MAX_TOP_K 64
#define TW_MAX_TOKENS (1 << 24)

typedef struct tw_problem {
  size_t size;        /* sizeof(tw_problem) */
  uint32_t magic;     /* TW_PROBLEM_MAGIC */
  uint32_t version;   /* TW_API_VERSION */
  int32_t world_size; /* W in 1..1024 */
  int32_t hidden;     /* H: model width, GEMM2 N; multiple of 8, at most TW_MAX_HIDDEN */
  int32_t ffn;        /* F: expert FFN width, GEMM2 K; multiple of 8, at most TW_MAX_HIDDEN */
  int32_t experts;    /* E_total routed experts over all ranks; multiple of world_size, at most
                         TW_MAX_EXPERTS */
  int32_t top_k;      /* k in 1..min(experts, TW_MAX_TOP_K) */
  int32_t max_tokens; /* capacity: most tokens any rank holds in one call, 1..TW_MAX_TOKENS */
  int32_t tile_m;     /* GEMM2 tile height TM (row band height): 64 or 128; 0 = 128 */
  int32_t tile_n;     /* GEMM2 tile width TN: 64, 128 or 256; 0 = chosen from hidden */
  tw_dtype dtype;     /* activations and weights; TW_BF16 */
} tw_problem;

#define TW_PROBLEM_INIT \
  { sizeof(tw_problem), TW_PROBLEM_MAGIC, TW_API_VERSION, 1, 0, 0, 0, 0, 0, 0, 0, TW_BF16 }

/* Checks a problem; returns the first violation with a message naming the fix. */
TW_API tw_status tw_problem_validate(const tw_problem* problem);

/* Model presets: name -> hidden, ffn, experts, top_k (tokens are up to you). From the papers:
 * "granite-3.1-1b-a400m", "qwen1.5-moe-a2.7b", "deepseek-v2-lite", "m-gpt", "m-bert",
 * "m-trans-xl"; the routed experts of large models: "deepseek-v3", "qwen3-235b-a22b",
 * "gpt-oss-120b", "mixtral-8x22b" (case-insensitive). Leaves world_size, max_tokens and tiles
 * untouched. */
TW_API tw_status tw_problem_preset(const char* name, tw_problem* problem);
/* Number of presets and the i-th preset's name, for listings. */
TW_API int tw_preset_count(void);
TW_API const char* tw_preset_name(int index);

/* -------------------------------------------------------------------------------------------- */
/* Routing: for every rank, for every token, top_k expert ids and gate weights                 */
/* -------------------------------------------------------------------------------------------- */

typedef struct tw_routing* tw_routing_t;

typedef enum tw_router {
  TW_ROUTER_BALANCED = 0,      /* uniform expert choice */
  TW_ROUTER_MODERATE_SKEW = 1, /* Zipf expert popularity, exponent TW_ZIPF_MODERATE */
  TW_ROUTER_STRESS_SKEW = 2,   /* Zipf expert popularity, exponent TW_ZIPF_STRESS */
  TW_ROUTER_TARGET = 3         /* Zipf exponent solved so that R_expert hits a target */
} tw_router;

#define TW_ZIPF_MODERATE 0.6
#define TW_ZIPF_STRESS 1.2

/* Builds a routing from caller arrays (copied; the caller keeps ownership of its arrays).
 * [in] tokens:     (world_size) tokens held by each rank, 0..max_tokens
 * [in] expert_ids: (world_size) pointers, each (tokens[r], top_k) int32 expert ids, row-major
 * [in] weights:    (world_size) pointers, each (tokens[r], top_k) float gate weights
 * Ids must be in range and distinct within a token; weights must be finite. */
TW_API tw_status tw_routing_create(const tw_problem* problem, const int32_t* tokens,
                                   const int32_t* const* expert_ids, const float* const* weights,
                                   tw_routing_t* routing);

/* Generates a deterministic routing from a seed: every rank holds `tokens_per_rank` tokens.
 * param: the target R_expert for TW_ROUTER_TARGET (>= 1), ignored otherwise. Weights are a
 * softmax over the chosen experts' random logits (positive, sum 1 per token). */
TW_API tw_status tw_routing_generate(const tw_problem* problem, tw_router router, double param,
                                     int32_t tokens_per_rank, uint64_t seed, tw_routing_t* routing);

/* Reads / writes a routing file (text format documented in docs/routing-format.md). */
TW_API tw_status tw_routing_read(const tw_problem* problem, const char* path,
                                 tw_routing_t* routing);
TW_API tw_status tw_routing_write(tw_routing_t routing, const char* path);

typedef struct tw_routing_stats {
  double r_expert;         /* max_e L_e / (M k / E): 1 is perfectly balanced */
  int64_t total_tokens;    /* M: tokens over all ranks */
  int64_t max_expert_load; /* max_e L_e: assignments to the busiest expert */
  int64_t min_expert_load; /* min_e L_e */
  int64_t max_rank_rows;   /* most (token, k) rows any rank's experts receive */
} tw_routing_stats;

TW_API tw_status tw_routing_stats_get(tw_routing_t routing, tw_routing_stats* stats);
/* (experts) assignments per expert, written to loads[0..experts-1]. */
TW_API tw_status tw_routing_expert_loads(tw_routing_t routing, int64_t* loads);
/* Read access to rank r's arrays (owned by the routing; valid until it is destroyed). */
TW_API tw_status tw_routing_rank(tw_routing_t routing, int32_t rank, int32_t* tokens,
                                 const int32_t** expert_ids, const float** weights);
TW_API tw_status tw_routing_destroy(tw_routing_t routing);

/* -------------------------------------------------------------------------------------------- */
/* Hardware description and calibration                                                         */
/* -------------------------------------------------------------------------------------------- */

#define TW_HARDWARE_MAGIC 0x74774877u /* "twHw" */

/* What the resource model knows of the machine. tw_hardware_default() gives built-in H200
 * numbers (each with its source in hardware.c; docs/model.md); a file in the format of
 * tw_hardware_write() overrides them through tw_hardware_read() or TW_CALIBRATION; `tilewave
 * calibrate` measures them on the machine at hand (docs/calibrate.md). */
typedef struct tw_hardware {
  size_t size;
  uint32_t magic;
  uint32_t version;
  int32_t sm_count;        /* G: SMs available to the operator */
  int32_t occ_comp;        /* resident producer CTAs per SM */
  int32_t occ_comm;        /* resident consumer CTAs per SM */
  int32_t c_max;           /* largest consumer CTA count considered */
  double tile_tflops;      /* producer throughput per SM in a full wave, TFLOP/s (bf16) */
  double tile_overhead_us; /* fixed cost per producer tile (epilogue, signal), us */
  double link_cta_gbps;    /* NVLink push bandwidth of one consumer CTA, GB/s */
  double link_peak_gbps;   /* saturated NVLink bandwidth per direction, GB/s */
  double link_latency_us;  /* fixed cost per band sent, us (shared by the C consumer CTAs) */
  double mem_gbps;         /* local device memory bandwidth (read + write), GB/s */
  double refetch_exposure; /* fraction of a second read of an expert's weights the producer
                              does not hide under its compute, 0..1 */
  double rho_ref;          /* first paper's reference service-rate ratio (eq. 14) */
  double l2_mib;           /* L2 cache of one GPU, MiB: the weights of all local experts that fit
                              in half of it are read from device memory once per call, whatever
                              the schedule */
  double tile_floor_us;    /* shortest producer tile per 128 output columns, us: a tile's time
                              is the 4-norm of its compute (2 TM TN K / tile_tflops) and
                              tile_floor_us TN / 128, plus tile_overhead_us (0: no floor) */
  double tile_m64_share;   /* throughput of 64-row producer tiles as a share of 128-row ones,
                              (0, 1]: their compute is 2 TM TN K / (tile_tflops x this) */
} tw_hardware;

TW_API tw_status tw_hardware_default(tw_hardware* hw);
/* Text file of "key = value" lines, '#' comments; keys are the field names above. Missing keys
 * keep their defaults; unknown keys are an error naming the key. */
TW_API tw_status tw_hardware_read(const char* path, tw_hardware* hw);
TW_API tw_status tw_hardware_write(const tw_hardware* hw, const char* path);

/* -------------------------------------------------------------------------------------------- */
/* Plans                                                                                        */
/* -------------------------------------------------------------------------------------------- */

typedef struct tw_plan* tw_plan_t;

#define TW_PLAN_CONFIG_MAGIC 0x7477506cu /* "twPl" */

/* The order in which the producer computes a rank's tiles (docs/model.md). */
typedef enum tw_schedule {
  TW_SCHEDULE_AUTO = 0,         /* the model predicts both schedules and keeps the faster */
  TW_SCHEDULE_REMOTE_FIRST = 1, /* every expert's remote bands, then every expert's local bands:
                                   transfers start earliest, but an expert with remote and local
                                   rows has its weights read twice */
  TW_SCHEDULE_EXPERT_MAJOR = 2  /* expert after expert, each its remote bands then its local ones
                                   (the last two experts: both remote parts, then both local ones,
                                   so the last sends start earlier): weights are read once but
                                   those two experts' */
} tw_schedule;

/* How the combine brings a token's top_k rows together in its owner's output. */
typedef enum tw_combine_dataflow {
  TW_DATAFLOW_DEFAULT = 0, /* env TW_COMBINE_DATAFLOW (`reduce` or `add`), else REDUCE */
  /* Rows land in the owner's receive window; after every arrival the owner's weighted reduction
   * (fp32, slot order) writes the caller's `out`. Any top_k. */
  TW_DATAFLOW_REDUCE = 1,
  /* The producer scales each row by its gate weight; local rows are added (bf16, one rounding
   * per add) into the owner's output by the producer, remote ones by the consumer over NVLink;
   * no reduction pass. The output lives in the context's window (tw_context_output), in one of
   * two buffers used in turn: the other is zeroed during the call, for the next one (by the
   * producer's idle warps; env TW_ADD_ZEROING=copy: by a copy engine, from a peer over NVLink).
   * top_k 1 or 2 (the sum 0 + a + b does not depend on the order the rows land in). */
  TW_DATAFLOW_ADD = 2
} tw_combine_dataflow;

typedef struct tw_plan_config {
  size_t size;
  uint32_t magic;
  uint32_t version;
  int32_t comm_ctas; /* C: consumer CTAs; 0 = chosen by the model; an explicit value wins */
  int32_t coalesce;  /* mgb: bands per middle segment; 0 = chosen by the model */
  int32_t use_model; /* 1 (default): analytical choice; 0: fixed TW_DEFAULT_COMM_CTAS/COALESCE */
  const tw_hardware* hardware; /* NULL: TW_CALIBRATION file if set, else built-in defaults */
  /* tw_schedule; 0 = env TW_SCHEDULE if set, else the model's choice (TW_DEFAULT_SCHEDULE when
   * use_model = 0). Appended later: a config whose size ends at `hardware` (built against an
   * earlier tilewave.h) is accepted and plans as TW_SCHEDULE_AUTO. */
  int32_t schedule;
  /* tw_combine_dataflow the plan is predicted for (the model's reduction and link terms); it must
   * match the context's (tw_device_plan_upload checks). Appended after `schedule`: a config that
   * ends before it plans as TW_DATAFLOW_DEFAULT. */
  int32_t dataflow;
  /* SMs the call this plan is for may occupy (tw_context_config / tw_combine_options
   * .sm_budget): the model picks C with P = budget - C; 0 = the hardware description's
   * sm_count (a whole GPU). 2..sm_count. Appended after `dataflow`. */
  int32_t sm_budget;
} tw_plan_config;

#define TW_PLAN_CONFIG_INIT                                                                        \
  {                                                                                                \
    sizeof(tw_plan_config), TW_PLAN_CONFIG_MAGIC, TW_API_VERSION, 0, 0, 1, NULL, TW_SCHEDULE_AUTO, \
        TW_DATAFLOW_DEFAULT, 0                                                                     \
  }

#define TW_DEFAULT_COMM_CTAS 8
#define TW_DEFAULT_COALESCE 2
#define TW_DEFAULT_SCHEDULE TW_SCHEDULE_REMOTE_FIRST

/* Plans rank `rank`'s GEMM2 + combine: the remote-owner-aligned row layout of its local experts,
 * the tile schedule (config->schedule), the combine plan (band destinations, offsets, segments) and
 * the consumer partition (C, mgb). A rank with nothing to send gets C = 0 (no consumer SMs)
 * unless config->comm_ctas fixes it. Pure host work; no GPU needed. */
TW_API tw_status tw_plan_create(const tw_problem* problem, tw_routing_t routing, int32_t rank,
                                const tw_plan_config* config, tw_plan_t* plan);
TW_API tw_status tw_plan_destroy(tw_plan_t plan);

typedef struct tw_plan_summary {
  int32_t rank;
  int32_t comm_ctas;    /* chosen or given C */
  int32_t coalesce;     /* chosen or given mgb */
  int64_t rows;         /* rows of the aligned layout, padding included */
  int64_t padding_rows; /* zero rows added between remote owners' groups (none with 2 ranks) */
  int64_t tiles;        /* producer tiles in the schedule */
  int64_t remote_tiles; /* tiles whose band is sent to another rank */
  int64_t bands;        /* row bands */
  int64_t segments;     /* transfer segments */
  int64_t send_bytes;   /* bytes sent to other ranks */
  double predicted_us;  /* model's T for the chosen partition */
  double sequential_us; /* model's GEMM-then-transfer time */
  double solve_us;      /* time the model took to decide */
  int32_t schedule;     /* the plan's tw_schedule (REMOTE_FIRST or EXPERT_MAJOR, never AUTO) */
  double gemm_us;       /* model's GEMM alone on every SM: max(compute waves, memory traffic)
                           plus the exposed part of second weight reads (refetch_exposure) */
  int32_t dataflow;     /* the tw_combine_dataflow the plan was predicted for (REDUCE or ADD,
                           never DEFAULT) */
  int32_t sm_budget;    /* SMs the plan was predicted for (config.sm_budget resolved) */
} tw_plan_summary;

/* Fills `summary`. This struct has no size field: schedule, gemm_us, dataflow and sm_budget were
 * appended,
 * so a caller built against an earlier tilewave.h must be rebuilt before it calls this. */
TW_API tw_status tw_plan_summary_get(tw_plan_t plan, tw_plan_summary* summary);

/* Model prediction for one candidate (C, mgb) of this plan (its schedule), in microseconds. */
TW_API tw_status tw_plan_predict(tw_plan_t plan, int32_t comm_ctas, int32_t coalesce, double* t_us);

/* -------------------------------------------------------------------------------------------- */
/* The first paper's model (tensor-parallel GEMM2 + GatherRS), kept exactly                      */
/* -------------------------------------------------------------------------------------------- */

typedef struct tw_tp_workload {
  int64_t m;                  /* M: global tokens before top-k expansion */
  int32_t n;                  /* N: GEMM2 output width */
  int32_t k;                  /* K: local GEMM2 reduction dimension */
  int32_t splits;             /* L */
  int32_t ranks;              /* D */
  int32_t experts;            /* E: local experts */
  const int64_t* expert_rows; /* (experts) M_e */
  int32_t tm, tn;             /* compute tile */
  int32_t tm_comm, tn_comm;   /* communication tile */
} tw_tp_workload;

/* Evaluates T(C) of equations (2)-(13) for C = 1..hw->c_max (t[C-1] in compute waves) and picks
 * C* with the eq. (18) tie breaker. t may be NULL. */
TW_API tw_status tw_tp_select(const tw_tp_workload* workload, const tw_hardware* hw,
                              int32_t* best_c, double* t);

/* -------------------------------------------------------------------------------------------- */
/* Tensor parallel x expert parallel (TP x EP): the plan (its runtime: tw_moe_combine_tp)       */
/* -------------------------------------------------------------------------------------------- */

#define TW_PARALLEL_MAGIC 0x74775470u /* "twTp" */
/* Largest TP group: its GatherRS reads partial sums from every TP peer over NVLink, so a group
 * must sit in one NVLink domain (8 GPUs on an HGX H200 board). */
#define TW_MAX_TP 8
/* GatherRS defaults: the first paper's communication tile (TM_comm x TN_comm = 128 x 1024 tokens
 * x columns) and its pipeline of L splits of the output columns. */
#define TW_TP_DEFAULT_SPLITS 2
#define TW_TP_DEFAULT_COMM_TILE_M 128
#define TW_TP_DEFAULT_COMM_TILE_N 1024

/* How a world of W = tp x ep ranks shares the experts. Ranks are numbered TP-innermost: rank r
 * is TP index r % tp of EP group r / tp. EP group g holds experts [g E/ep, (g + 1) E/ep); each of
 * its tp ranks holds, of every one of those experts, the F slice [q F/tp, (q + 1) F/tp) of TP
 * index q (columns of w2, rows of w13). Tokens stay with their owner as in the EP layer; a
 * routing for the problem (world_size W) describes them.
 *
 * A struct of its own rather than fields appended to tw_problem: a TP x EP problem has
 * experts / ep local experts and needs experts divisible by ep, not by W, while every EP entry
 * point (plans, contexts, kernels) relies on tw_problem_validate's experts % world_size == 0 and
 * experts / world_size local experts. Kept apart, the EP path never sees a TP field, and a TP
 * description cannot reach the EP runtime by mistake. */
typedef struct tw_parallel {
  size_t size;         /* sizeof(tw_parallel) */
  uint32_t magic;      /* TW_PARALLEL_MAGIC */
  uint32_t version;    /* TW_API_VERSION */
  int32_t tp;          /* TP ranks per EP group, 1..TW_MAX_TP; ffn must be a multiple of 64 tp
                          (each rank's F slice a whole number of the producer's 64-wide K slices) */
  int32_t ep;          /* EP groups, 1..TW_MAX_RANKS; tp x ep = world_size; experts % ep == 0;
                          0 = world_size / tp */
  int32_t splits;      /* L: GatherRS splits of the hidden columns; must divide the GEMM2 column
                          tiles ceil(hidden / TN); 0 = TW_TP_DEFAULT_SPLITS where it divides,
                          else 1 */
  int32_t comm_tile_m; /* TM_comm: rows of a GatherRS tile, 1..4096; 0 = 128 */
  int32_t comm_tile_n; /* TN_comm: columns of a GatherRS tile, 8..65536, multiple of 8; 0 = 1024 */
} tw_parallel;

#define TW_PARALLEL_INIT \
  { sizeof(tw_parallel), TW_PARALLEL_MAGIC, TW_API_VERSION, 1, 0, 0, 0, 0 }

/* Checks a TP x EP description against a problem whose world_size is W = tp x ep (the problem's
 * other checks as tw_problem_validate, but experts divisible by ep instead of W). Returns the
 * first violation with a message naming the fix: TW_ERR_INVALID_SIZE (tp or ep out of range, tp
 * x ep != world_size), TW_ERR_INDIVISIBLE (experts % ep), TW_ERR_ALIGNMENT (ffn % (64 tp)),
 * TW_ERR_INVALID_ARGUMENT (splits, comm tiles), TW_ERR_UNSUPPORTED (tp > TW_MAX_TP). */
TW_API tw_status tw_parallel_validate(const tw_problem* problem, const tw_parallel* parallel);

typedef struct tw_tp_plan* tw_tp_plan_t;

/* Plans rank `rank`'s GEMM2 + GatherRS of a TP x EP world (docs/model.md, "Tensor parallel").
 * Rank r = (EP group g, TP index q). Every (token, slot) routed to an expert of g is one GEMM2
 * row on each of g's tp ranks, which computes its partial sum over its F slice. The rows are laid
 * out in tp blocks, block q' holding the rows of owners of TP index q' (the owners o with
 * o % tp == q') in the remote-owner-aligned EP layout of "EP rank g" in the EP world of those
 * owners; the layout is the same on every TP rank of g. GatherRS, a reduce-scatter over the TP
 * group: rank (g, q') sums block q' over the group's tp ranks (its reduced rows are then exactly
 * the EP plan's GEMM2 output), and the EP part, the EP combine of that EP world (tw_plan_create),
 * takes each reduced row to its owner, whose weighted reduction sums the token's slots. With
 * ep = 1 the reducer of a token's rows is its owner (the first paper's operator); with tp = 1 the
 * plan is the EP plan. The producer's tiles run split by split (the first paper's L column
 * splits); segment s, split s's output, is published when its tiles are done.
 * config: the EP part's plan config (NULL = defaults; comm_ctas there fixes the EP part's C); its
 * hardware and sm_budget also hold for the TP model. Pure host work. */
TW_API tw_status tw_tp_plan_create(const tw_problem* problem, const tw_parallel* parallel,
                                   tw_routing_t routing, int32_t rank, const tw_plan_config* config,
                                   tw_tp_plan_t* plan);
TW_API tw_status tw_tp_plan_destroy(tw_tp_plan_t plan);

#define TW_TP_PLAN_SUMMARY_MAGIC 0x74775473u /* "twTs" */

typedef struct tw_tp_plan_summary {
  size_t size; /* sizeof(tw_tp_plan_summary), set by the caller (TW_TP_PLAN_SUMMARY_INIT) */
  uint32_t magic;
  uint32_t version;
  int32_t rank, tp, ep, group, tp_index; /* this rank = (group, tp_index) */
  int32_t local_experts;                 /* experts / ep */
  int32_t ffn_slice;                     /* K = ffn / tp, this rank's F slice */
  int32_t splits;                        /* L */
  int32_t comm_tile_m, comm_tile_n;      /* TM_comm x TN_comm */
  int64_t rows;                          /* GEMM2 rows of all tp blocks, padding included */
  int64_t padding_rows;                  /* zero rows of the blocks' EP layouts */
  int64_t bands, tiles;                  /* row bands; producer tiles (bands x column tiles) */
  int64_t tiles_per_split;               /* W_comp: tiles of one split (eq. 6) */
  int64_t reduce_rows;                   /* rows this rank reduces (its block, padding included) */
  int64_t comm_tiles_per_split;          /* GatherRS tiles of its block in split 0 */
  int64_t reduce_read_bytes;             /* partial-sum bytes it reads from its tp - 1 peers */
  /* The TP part: the first paper's model (tw_tp_select) over this rank's tiles. */
  int32_t tp_comm_ctas;      /* C* for the GatherRS; 0 when tp = 1 (nothing to reduce) */
  double tp_predicted_waves; /* T(C*) in compute waves */
  double tp_wave_us;         /* one compute wave (one producer tile), us, from the hardware */
  double tp_predicted_us;    /* T(C*) x tp_wave_us */
  /* The EP part: this rank's EP plan (tw_plan_create on block tp_index); 0s when ep = 1 and
   * nothing leaves the rank. */
  int32_t ep_comm_ctas, ep_coalesce;
  int64_t ep_send_bytes;
  double ep_predicted_us;
  double solve_us; /* time tw_tp_plan_create took: the tp block layouts and both decisions */
} tw_tp_plan_summary;

#define TW_TP_PLAN_SUMMARY_INIT                                                                   \
  {                                                                                               \
    sizeof(tw_tp_plan_summary), TW_TP_PLAN_SUMMARY_MAGIC, TW_API_VERSION, 0, 0, 0, 0, 0, 0, 0, 0, \
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0, 0, 0, 0.0, 0.0                         \
  }

/* Fills `summary` (its header set by TW_TP_PLAN_SUMMARY_INIT). */
TW_API tw_status tw_tp_plan_summary_get(tw_tp_plan_t plan, tw_tp_plan_summary* summary);

/* -------------------------------------------------------------------------------------------- */
/* Runtime: contexts, device plans and the overlapped GEMM2 + combine (needs GPUs and NCCL)     */
/* -------------------------------------------------------------------------------------------- */

/* The caller's NCCL communicator and CUDA stream types, declared exactly as nccl.h and
 * cuda_runtime.h declare them, so that this header needs neither and both may be included. */
typedef struct ncclComm* ncclComm_t;
typedef struct CUstream_st* cudaStream_t;

typedef struct tw_context* tw_context_t;
typedef struct tw_device_plan* tw_device_plan_t;

#define TW_CONTEXT_CONFIG_MAGIC 0x74774378u /* "twCx" */
#define TW_DEFAULT_TIMEOUT_MS 5000          /* bound on every device-side wait */
#define TW_MAX_COMM_CTAS 64                 /* largest consumer CTA count */
#define TW_MAX_RANKS 64                     /* largest world size of one context */

typedef enum tw_debug_tags {
  TW_DEBUG_TAGS_OFF = 0,
  /* Every transfer unit also writes a tag (source rank) and counts its arrival per receive row;
   * the reduction records, per (token, k), the source and the arrival count it saw and reports
   * TW_ERR_INTERNAL when a row arrived more or less than once. Slower; for tests and bring-up. */
  TW_DEBUG_TAGS_CHECK = 1
} tw_debug_tags;

typedef struct tw_context_config {
  size_t size;           /* sizeof(tw_context_config) */
  uint32_t magic;        /* TW_CONTEXT_CONFIG_MAGIC */
  uint32_t version;      /* TW_API_VERSION */
  int32_t timeout_ms;    /* bound on every device-side wait, ms; 0 = env TW_TIMEOUT_MS, else
                            TW_DEFAULT_TIMEOUT_MS */
  int32_t debug_tags;    /* tw_debug_tags; 0 = env TW_DEBUG_TAGS (0 or 1), else off */
  int32_t max_comm_ctas; /* most consumer CTAs any call may use, 1..TW_MAX_COMM_CTAS; 0 = 64 */
  int32_t timing;        /* 1: record CUDA events per phase (tw_context_timings); 0: none */
  int32_t unit_tiles;    /* column tiles per consumer transfer unit (the unit of work and of
                            arrival counting); 0 = env TW_CONSUMER_TILES_PER_UNIT, else a whole
                            band with bulk copies and 1 with register copies; clamped to the
                            column tiles of a band; must be the same on every rank */
  int32_t consumer_copy; /* tw_consumer_copy; 0 = env TW_CONSUMER_COPY (`bulk` or `registers`),
                            else bulk */
  /* tw_combine_dataflow; the same on every rank. Appended after `consumer_copy`: a config that
   * ends before it runs TW_DATAFLOW_DEFAULT. */
  int32_t dataflow;
  /* SMs any call may occupy at once (producer P + consumer C <= budget; every kernel's grid
   * within it), to leave the rest to concurrent work; 0 = every SM on an NCCL team, the GPU's
   * SMs / W on an in-process team. At least 2 (one producer and one consumer CTA). A call may
   * lower it (tw_combine_options.sm_budget). Appended after `dataflow`: a config that ends
   * before it takes the default. */
  int32_t sm_budget;
  /* 1: the context can dispatch (tw_moe_dispatch): it allocates a second window holding the
   * expert-input rows peers write (tw_context_dispatch_buffer: as many rows as a plan of the
   * problem can have, of hidden bf16) and its counters; 0 (default): no dispatch. The same on
   * every rank; the reduce dataflow only. Appended after `sm_budget`. */
  int32_t dispatch;
  /* 1: the context can run the whole layer (tw_moe_layer): everything dispatch = 1 allocates
   * (implied), plus the GEMM1 output h (as many rows as a plan can have, of ffn bf16) and, in
   * every device plan created on the context, GEMM1's tile list; hidden must be a multiple of 64
   * (GEMM1's K slice). 0 (default): no layer. The same on every rank; the reduce dataflow only.
   * Appended after `dispatch`. */
  int32_t layer;
  /* > 0: the capturable dispatch (implies dispatch = 1; the reduce dataflow; 1..max_tokens):
   * every (local expert, source rank) group gets this many rows, rounded up to the tile height
   * TM, whatever the routing (the design of DeepEP's low-latency mode), so tw_moe_dispatch and
   * tw_moe_layer read no routing data on the host and can be captured in a CUDA graph (their
   * comments say what changes). A source with more slots for one expert than the capacity fails
   * the call (TW_ERR_CAPACITY from tw_context_check on every rank, naming the token). Memory: the
   * buffers sized by rows (expert-input rows, GEMM2 output, h) hold at least E W C rows and the
   * receive window at least (W - 1) E C rows (E = local experts, C = the rounded capacity), i.e.
   * about (3 hidden + ffn) x 2 bytes x E W C on each rank; tw_context_memory_get has the totals.
   * The work per call is that of the live rows plus at most one partial band per group.
   * 0 (default): the eager dispatch. The same on every rank. Appended after `layer`. */
  int32_t dispatch_capacity;
} tw_context_config;

/* How the consumer moves rows to a peer. */
typedef enum tw_consumer_copy {
  TW_CONSUMER_COPY_DEFAULT = 0,
  /* Every thread loads 16-byte vectors and stores them to the peer. */
  TW_CONSUMER_COPY_REGISTERS = 1,
  /* One thread streams each unit through shared memory with bulk copies (TMA): loads of later
   * pieces overlap stores of earlier ones. */
  TW_CONSUMER_COPY_BULK = 2
} tw_consumer_copy;

#define TW_CONTEXT_CONFIG_INIT                                                                     \
  {                                                                                                \
    sizeof(tw_context_config), TW_CONTEXT_CONFIG_MAGIC, TW_API_VERSION, 0, 0, 0, 0, 0, 0, 0, 0, 0, \
        0, 0                                                                                       \
  }

/* Creates a context for one rank. COLLECTIVE over `comm`: every rank calls it with the same
 * problem (problem->world_size must equal the communicator's size) and the same config.
 * [in]  problem: shapes and capacity (max_tokens) every later call must fit in
 * [in]  comm:    the caller's communicator; borrowed, never destroyed; it must outlive the
 *                context, and all ranks must share one NVLink domain (NCCL's LSA team)
 * [in]  config:  NULL = defaults
 * [out] ctx
 * Uses the CUDA device current on the calling thread; every later call on this context sets
 * that device for its duration and restores the caller's. Allocates the symmetric receive window
 * (ncclMemAlloc + ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC): max_tokens * top_k rows of
 * hidden bf16, plus arrival counters and credits; under TW_DATAFLOW_ADD instead two outputs of
 * max_tokens rows and up to 32 MiB of zeros), the GEMM output, the device communicator
 * (ncclDevCommCreate), three internal streams, and launches every kernel once (so that no kernel
 * is lazily loaded while another spins). Checks that the NCCL library loaded at run time is the
 * version tilewave was built against (TW_ERR_NCCL otherwise). Synchronises the device. */
TW_API tw_status tw_context_create(const tw_problem* problem, ncclComm_t comm,
                                   const tw_context_config* config, tw_context_t* ctx);

/* In-process teams: W ranks in one process on one GPU, one host thread per rank (as engines
 * drive their ranks). Peer windows are plain device allocations on that GPU and the host
 * collectives meet in shared memory, so every multi-rank protocol runs on a machine with one
 * GPU; one GPU's memory stands in for NVLink, so timings do not compare with multi-GPU ones.
 * The kernels and the planner are the same as on an NCCL team. */
typedef struct tw_team* tw_team_t;

/* Bound on every host-side collective of a team (in-process and NCCL; env TW_TEAM_TIMEOUT_MS):
 * after it the team is broken and every rank's collectives fail with TW_ERR_TIMEOUT. */
#define TW_DEFAULT_TEAM_TIMEOUT_MS 60000

/* Creates an in-process team of world_size ranks on CUDA device `device`. Not collective.
 * Every rank drives four streams (the caller's and the context's three) and each needs a
 * hardware queue of its own: with more than CUDA_DEVICE_MAX_CONNECTIONS / 4 ranks (8 queues
 * unless set; at most 32) this fails with TW_ERR_UNSUPPORTED naming the variable, which must be
 * set before the process's first CUDA call. Host collectives wait at most TW_TEAM_TIMEOUT_MS
 * (TW_DEFAULT_TEAM_TIMEOUT_MS): after that every rank's collectives fail with TW_ERR_TIMEOUT. */
TW_API tw_status tw_team_create(int32_t world_size, int32_t device, tw_team_t* team);
/* Frees the team. Its contexts must have been destroyed (TW_ERR_STATE otherwise). */
TW_API tw_status tw_team_destroy(tw_team_t team);
/* Creates rank `rank`'s context on an in-process team: as tw_context_create, COLLECTIVE over the
 * team (every rank's thread calls it, each with its own rank). Sets the team's device on the
 * calling thread. The ranks' persistent kernels must all be resident at once: the budgets of all
 * ranks must fit in the GPU's SMs (TW_ERR_UNSUPPORTED with the numbers otherwise); the default
 * budget is SMs / W. */
TW_API tw_status tw_context_create_on_team(const tw_problem* problem, tw_team_t team, int32_t rank,
                                           const tw_context_config* config, tw_context_t* ctx);
/* The add dataflow's output of the last call on this context: (tokens of this rank, hidden)
 * device bf16 inside the context's window, ready in the order of that call's stream. It stays
 * valid until the next call on the context starts (the call after that zeroes it); copy it out
 * or consume it before then. TW_ERR_STATE under the reduce dataflow or before the first call. */
TW_API tw_status tw_context_output(tw_context_t ctx, void** out);
/* Frees everything the context allocated. COLLECTIVE (deregisters the window); waits for the
 * context's work to finish first (bounded: every device wait is). When a peer does not join
 * within TW_TEAM_TIMEOUT_MS, or the team is broken (tw_context_abort), it frees what this rank
 * can free alone and returns: see tw_context_abort for what stays behind on an NCCL team. NULL
 * is a no-op. */
TW_API tw_status tw_context_destroy(tw_context_t ctx);

/* Device copy of one rank's plan plus its gate weights: tiles, bands, segments, slot_row and
 * weights (on a context with layer = 1 also GEMM1's tile list, which every upload fills from the
 * plan). Created for a context, sized for the worst case its problem allows (so uploads never
 * allocate). Not collective. */
TW_API tw_status tw_device_plan_create(tw_context_t ctx, tw_device_plan_t* dplan);
/* Copies `plan` (this rank's plan: plan's rank must be the context's rank) and this rank's gate
 * weights from `routing` to the device, asynchronously on `stream`. The host objects may be
 * destroyed as soon as this returns. Calls that use dplan on another stream than `stream` must
 * be ordered after it by the caller; a call already enqueued on `stream` that uses dplan
 * finishes before the new contents land. */
TW_API tw_status tw_device_plan_upload(tw_device_plan_t dplan, tw_plan_t plan, tw_routing_t routing,
                                       cudaStream_t stream);
TW_API tw_status tw_device_plan_destroy(tw_device_plan_t dplan);
/* The summary (tw_plan_summary) of the plan last uploaded to dplan, by tw_device_plan_upload or
 * by tw_moe_dispatch (which plans on the host from the all-gathered counts). TW_ERR_STATE before
 * the first upload. Not collective; does not touch the device. */
TW_API tw_status tw_device_plan_summary_get(tw_device_plan_t dplan, tw_plan_summary* summary);
/* The row layout of this rank's local experts in the plan last uploaded to dplan: local expert e
 * owns rows [row0[e], row0[e] + rows[e]) of the GEMM input (the dispatch buffer after
 * tw_moe_dispatch), of which the first real_rows[e] carry tokens and the rest are padding (zero
 * after a dispatch). What an engine's own expert computation between tw_moe_dispatch and
 * tw_moe_combine needs (grouped-GEMM offsets). Each array holds experts / world_size entries;
 * any may be NULL. TW_ERR_STATE before the first upload. Not collective; host memory only. */
TW_API tw_status tw_device_plan_expert_rows(tw_device_plan_t dplan, int32_t* row0, int32_t* rows,
                                            int32_t* real_rows);

typedef enum tw_combine_mode {
  TW_COMBINE_OVERLAP = 0,   /* producer and consumer run concurrently, tile-level signals */
  TW_COMBINE_UNFUSED = 1,   /* same kernels, consumer starts after the producer has finished */
  TW_COMBINE_GEMM_ONLY = 2, /* producer alone on P SMs (no transfer, no reduction; out untouched) */
  TW_COMBINE_COMM_ONLY = 3  /* consumer + reduction alone on the GEMM output of an earlier call */
} tw_combine_mode;

#define TW_COMBINE_OPTIONS_MAGIC 0x7477436fu /* "twCo" */

typedef struct tw_combine_options {
  size_t size;
  uint32_t magic;
  uint32_t version;
  tw_combine_mode mode;
  int32_t comm_ctas; /* C for this call, 1..max_comm_ctas; 0 = the plan's choice */
  /* SMs this call may occupy at once, 2..the context's sm_budget; 0 = the context's. The plan's
   * C must leave at least one SM for the producer (TW_ERR_INVALID_ARGUMENT otherwise: plan with
   * tw_plan_config.sm_budget set to it). Appended after `comm_ctas`. */
  int32_t sm_budget;
} tw_combine_options;

#define TW_COMBINE_OPTIONS_INIT \
  { sizeof(tw_combine_options), TW_COMBINE_OPTIONS_MAGIC, TW_API_VERSION, TW_COMBINE_OVERLAP, 0, 0 }

/* GEMM2 + combine + weighted reduction of one MoE layer. COLLECTIVE: every rank calls it, in the
 * same order, with its own device plan (all built from one routing).
 * [in]  dplan:     this rank's uploaded plan
 * [in]  expert_in: (plan rows, ffn) device bf16: GEMM2 input in the plan's row layout (padding
 *                  rows must be zero or finite; they are computed, never sent)
 * [in]  w2:        (local experts, hidden, ffn) device bf16: down-projection weights
 * [out] out:       (tokens of this rank, hidden) device bf16: out[t] = sum_j w[t][j] *
 *                  (expert_j(t) output row), accumulated in fp32. Under TW_DATAFLOW_ADD it
 *                  must be NULL: the output is at tw_context_output() instead, where
 *                  out[t] = bf16(bf16(w0 row0) + bf16(w1 row1)) (each add rounded once)
 * [in]  stream:    the caller's stream; all inputs must be ready in its order, and `out` is
 *                  ready in its order when the call's work completes. Any stream: consecutive
 *                  calls on a context are ordered whatever streams they come on (each call's
 *                  work starts after the previous call's has ended; the context makes `stream`
 *                  wait for it)
 * Launches the producer (P = budget - C CTAs) on `stream`, then the consumer (C CTAs) on an
 * internal stream, makes `stream` wait for the consumer and launches the reduction on `stream`
 * (at most budget CTAs; on a whole GPU as many per SM as fit); a plan with nothing to send or
 * receive (world 1, every row local) launches no consumer and gives the producer the whole
 * budget. Returns
 * without synchronising. Device-side failures (a wait that exceeded the timeout) surface as
 * TW_ERR_TIMEOUT from tw_context_check() or from the next call on this context once this one
 * has completed; after that every call returns TW_ERR_STATE until tw_context_reset(). Ranks whose
 * plans disagree (planned from different routings, counts or problems) are caught where rows
 * arrive: a source that delivers more than the owner's plan expects, or whose plan's fingerprint
 * differs from the owner's, fails the call with TW_ERR_INVALID_ARGUMENT on the owner (and
 * through tw_context_check on every rank). A consumer that did not take every unit of the call
 * in the call fails it with TW_ERR_INTERNAL (a library bug; the message asks for a report).
 * CUDA graphs (reduce dataflow, timing off): the call may be captured on `stream`; each replay
 * is one call, with the inputs' and dplan's contents at replay time. Rules: (1) launch the graph
 * on one stream, or order its launches after every other call on the context yourself (a
 * captured call is ordered by its stream only); (2) between replays dplan may be re-uploaded on
 * the graph's stream with a plan of the same sizes (rows, receive rows, bands, units, tokens;
 * other sizes: TW_ERR_STATE, use another device plan); (3) device-side failures of replays are
 * reported by tw_context_check(), not by the next call; (4) every rank instantiates and uploads
 * its graph (cudaGraphInstantiate, cudaGraphUpload) before any rank launches one: both can wait
 * for the device, and on an in-process team that device runs the peers' spinning kernels; (5) on
 * an in-process team, copy results back through pinned host memory or after synchronising the
 * stream (a synchronous pageable copy queued behind a replay stalled the team, docs/runtime.md).
 * Every rank captures and replays the same sequence. Verified (100 replays = eager) with 1-4 and
 * 8 in-process ranks on one GPU. A captured call is one chain of kernels on `stream` (the
 * consumer runs beside the producer as its programmatic dependent), so a graph of it forks
 * nothing. A capture that fails leaves the context as it was. On a device plan of
 * the capturable dispatch (tw_context_config.dispatch_capacity) the call computes and sends the
 * bands with live rows of the last dispatch into dplan (read on the device). */
TW_API tw_status tw_moe_combine(tw_context_t ctx, tw_device_plan_t dplan, const void* expert_in,
                                const void* w2, void* out, cudaStream_t stream);
/* As tw_moe_combine, with options (NULL = defaults). */
TW_API tw_status tw_moe_combine_ex(tw_context_t ctx, tw_device_plan_t dplan, const void* expert_in,
                                   const void* w2, void* out, const tw_combine_options* options,
                                   cudaStream_t stream);

/* ---- Tensor parallel x expert parallel: GEMM2 + GatherRS + the owners' reduction ---------- */

/* A context of one rank of a TP x EP world (tw_parallel) and its device plans. Apart from the
 * EP context (tw_context_t): its window holds the rank's partial sums, which its TP peers read,
 * and its GEMM2 has K = ffn / tp over experts / ep local experts. */
typedef struct tw_tp_context* tw_tp_context_t;
typedef struct tw_tp_device_plan* tw_tp_device_plan_t;

/* Creates rank r's TP context. COLLECTIVE over `comm` (every rank, the same problem, parallel
 * and config); problem->world_size = tp x ep = the communicator's size. tw_parallel_validate's
 * refusals apply (tp x ep != world_size, ffn not a multiple of 64 tp, experts % ep, ...), and
 * the config may set timeout_ms, max_comm_ctas and sm_budget only: the add dataflow, debug tags,
 * timing, dispatch and layer are refused (TW_ERR_UNSUPPORTED). Allocates the window (the
 * receive rows of max_tokens x top_k, the partial sums of tp blocks of an EP rank's worst case,
 * counters), the reduced rows, two internal streams, and launches every kernel once.
 * Synchronises the device. */
TW_API tw_status tw_tp_context_create(const tw_problem* problem, const tw_parallel* parallel,
                                      ncclComm_t comm, const tw_context_config* config,
                                      tw_tp_context_t* ctx);
/* As tw_tp_context_create, for rank `rank` of an in-process team (tw_team_create); COLLECTIVE
 * over the team. The budgets of all ranks must fit in the GPU's SMs (default SMs / W). */
TW_API tw_status tw_tp_context_create_on_team(const tw_problem* problem,
                                              const tw_parallel* parallel, tw_team_t team,
                                              int32_t rank, const tw_context_config* config,
                                              tw_tp_context_t* ctx);
/* Waits for the context's work and frees it. COLLECTIVE (the window). NULL is a no-op. */
TW_API tw_status tw_tp_context_destroy(tw_tp_context_t ctx);
/* COLLECTIVE, blocking: waits for the context's work, then TW_SUCCESS on every rank, or on every
 * rank the first failing rank's device-side error (TW_ERR_TIMEOUT: a wait that expired). A
 * failed context refuses further calls: destroy it on every rank and create another. */
TW_API tw_status tw_tp_context_check(tw_tp_context_t ctx);

/* Device copy of one rank's TP plan: its producer tiles, GatherRS tiles, where each reduced row
 * goes, and its EP part's slot rows and this rank's gate weights. Sized for the worst case of
 * the context's problem (uploads never allocate). Not collective. */
TW_API tw_status tw_tp_device_plan_create(tw_tp_context_t ctx, tw_tp_device_plan_t* dplan);
/* Copies `plan` (tw_tp_plan_create for this rank, with the context's problem and parallel) and
 * this rank's gate weights from `routing` asynchronously on `stream`; the host objects may be
 * freed when it returns. Calls on another stream must be ordered after it by the caller. */
TW_API tw_status tw_tp_device_plan_upload(tw_tp_device_plan_t dplan, tw_tp_plan_t plan,
                                          tw_routing_t routing, cudaStream_t stream);
TW_API tw_status tw_tp_device_plan_destroy(tw_tp_device_plan_t dplan);

/* GEMM2 + GatherRS + weighted reduction of one MoE layer under TP x EP. COLLECTIVE: every rank,
 * in the same order, with its own device plan (all from one routing).
 * [in]  dplan:     this rank's uploaded TP plan
 * [in]  expert_in: (plan rows, ffn / tp) device bf16: GEMM2 input in the TP plan's row layout
 *                  (its tp blocks), this rank's F slice; padding rows zero or finite
 * [in]  w2:        (experts / ep, hidden, ffn / tp) device bf16: the F slice [q F/tp, (q+1) F/tp)
 *                  of the down projection of the group's experts (q = rank % tp)
 * [out] out:       (tokens of this rank, hidden) device bf16: out[t] = sum_j w[t][j] *
 *                  bf16(sum_q bf16(partial_q)), the TP sum and the slot sum in fp32, in order
 * [in]  options:   NULL = defaults; mode TW_COMBINE_OVERLAP or TW_COMBINE_UNFUSED (GatherRS after
 *                  the producer: the same bits), comm_ctas (0: the plan's tp_comm_ctas, at most
 *                  one CTA per GatherRS tile of the block), sm_budget
 * [in]  stream:    as for tw_moe_combine
 * The producer (P = budget - C CTAs) publishes every finished tile to its split's counter; the
 * GatherRS (C CTAs, an internal stream) sums each split of the rank's block over the TP group as
 * soon as the split is complete on every TP peer, and stores each reduced row at its owner (its
 * receive rows, or this rank's own reduced rows); the owners' weighted reduction follows on
 * `stream`. Not capturable in a CUDA graph. Device failures surface from tw_tp_context_check() or
 * the next call (TW_ERR_TIMEOUT). */
TW_API tw_status tw_moe_combine_tp(tw_tp_context_t ctx, tw_tp_device_plan_t dplan,
                                   const void* expert_in, const void* w2, void* out,
                                   const tw_combine_options* options, cudaStream_t stream);

/* ---- Dispatch: from the engine's top-k on the GPU to the expert-input rows --------------- */

/* The integer type of topk_ids. */
typedef enum tw_index_type { TW_INDEX_INT32 = 0, TW_INDEX_INT64 = 1 } tw_index_type;

#define TW_DISPATCH_OPTIONS_MAGIC 0x74774470u /* "twDp" */

typedef struct tw_dispatch_options {
  size_t size;
  uint32_t magic;
  uint32_t version;
  /* How the plan is made (C, mgb, schedule, hardware, sm_budget of the combine that follows);
   * NULL = defaults, planned for the context's sm_budget. Its dataflow must be DEFAULT or the
   * context's. */
  const tw_plan_config* plan_config;
  /* SMs the dispatch's kernels may occupy, 2..the context's sm_budget; 0 = the context's. */
  int32_t sm_budget;
} tw_dispatch_options;

#define TW_DISPATCH_OPTIONS_INIT \
  { sizeof(tw_dispatch_options), TW_DISPATCH_OPTIONS_MAGIC, TW_API_VERSION, NULL, 0 }

/* The context's expert-input buffer, which tw_moe_dispatch fills: (rows_max, hidden) device
 * bf16 inside the dispatch window (tw_context_config.dispatch = 1; TW_ERR_STATE otherwise).
 * A dispatch writes the first `rows` (tw_device_plan_summary_get) in the plan's row layout.
 * Either pointer may be NULL. */
TW_API tw_status tw_context_dispatch_buffer(tw_context_t ctx, void** rows, int64_t* rows_max);

/* Dispatch of one MoE layer, eager mode. COLLECTIVE: every rank calls it, in the same order as
 * its other calls on the context, with its own tokens. From this rank's top-k on the GPU:
 *  1. counts its slots per global expert on the device, checking every id (a bad or repeated id
 *     fails the call on every rank with TW_ERR_EXPERT_ID / TW_ERR_DUPLICATE_EXPERT naming the
 *     rank and slot; nothing is sent and the context stays usable);
 *  2. copies the counts to the host (the call waits for `stream` here), all-gathers them over
 *     the team and builds this rank's plan from the count matrix (the plan tw_plan_create would
 *     make from the same routing), which it uploads to dplan;
 *  3. places every (token, slot) by a device-side scan (no per-token data on the host: the
 *     reduction's slot rows and gate weights are written into dplan on the device), then writes
 *     each token row x[t] once per slot into the expert-input buffer of the expert's rank at its
 *     row of the aligned layout (peer stores), zero-fills this rank's padding rows, and waits
 *     until every rank's rows for it have arrived.
 * [in]  dplan:        this rank's device plan (tw_device_plan_create on ctx); replaced
 * [in]  x:            (tokens, hidden) device bf16, 16-byte aligned
 * [in]  topk_ids:     (tokens, top_k) device int32 or int64 (id_type) global expert ids
 * [in]  topk_weights: (tokens, top_k) device fp32 gate weights
 * [in]  tokens:       0..max_tokens tokens of this rank (another count fails the call on every
 *                     rank)
 * [out] expert_in:    the context's expert-input buffer (tw_context_dispatch_buffer), ready in
 *                     the order of `stream`: (rows, hidden) bf16 in the plan's layout, padding
 *                     rows zero. GEMM1 reads it; with hidden == ffn it is a valid GEMM2 input
 *                     for tw_moe_combine(ctx, dplan, expert_in, ...). May be NULL.
 * [in]  stream:       the caller's stream; inputs ready in its order. The call blocks the host
 *                     until the counts are on it. Peers write into this rank's buffer during
 *                     its next dispatch call: every read of the buffer must be ordered before
 *                     that call (the context orders its own calls).
 * x, topk_ids and topk_weights must not change until the call's work completes. Device-side
 * failures (a wait past the timeout) surface as for tw_moe_combine. Needs the reduce dataflow
 * and tw_context_config.dispatch = 1.
 * Capturable mode (tw_context_config.dispatch_capacity = C > 0): the plan is the static one that
 * tw_device_plan_create put into dplan (every (local expert, source) group C rows, rounded up to
 * TM; an upload into dplan replaces it and the call then fails with TW_ERR_STATE). Steps 1 and 3
 * run on the device alone: no copy to the host, no all-gather, no host wait, no event query
 * under capture, every kernel on `stream`; the call may be captured in a CUDA graph (the rules
 * of tw_moe_combine; `tokens` is baked into the graph, the contents of x, topk_ids and
 * topk_weights are read at replay time). Each rank sends its live row count of every group with
 * its rows; the combine that follows on dplan computes and sends only the bands with live rows.
 * Differences: the rows of a group past its live ones are not written (stale, not zero; the
 * computation never sends or reads their results), tw_device_plan_expert_rows gives the static
 * layout (real_rows = the capacity), plan_config must be NULL (TW_ERR_UNSUPPORTED), and every
 * refusal is local to the rank (its peers' calls then time out). A bad or repeated id, or a
 * slot beyond C rows of its expert from this rank (TW_ERR_CAPACITY, naming the token: raise
 * dispatch_capacity), fails on the device: tw_context_check then returns that status on every
 * rank, and tw_context_reset makes the context usable again. */
TW_API tw_status tw_moe_dispatch(tw_context_t ctx, tw_device_plan_t dplan, const void* x,
                                 const void* topk_ids, tw_index_type id_type,
                                 const float* topk_weights, int32_t tokens, void** expert_in,
                                 cudaStream_t stream);
/* As tw_moe_dispatch, with options (NULL = defaults). */
TW_API tw_status tw_moe_dispatch_ex(tw_context_t ctx, tw_device_plan_t dplan, const void* x,
                                    const void* topk_ids, tw_index_type id_type,
                                    const float* topk_weights, int32_t tokens, void** expert_in,
                                    const tw_dispatch_options* options, cudaStream_t stream);

/* ---- The layer: dispatch, GEMM1 + SwiGLU, GEMM2 + combine in one call ------------------------ */

#define TW_LAYER_OPTIONS_MAGIC 0x74774c79u /* "twLy" */

typedef struct tw_layer_options {
  size_t size;
  uint32_t magic;
  uint32_t version;
  /* How the plan is made, as tw_dispatch_options.plan_config; NULL = defaults, planned for the
   * call's sm_budget. A given config's sm_budget must be 0 (then the call's) or the call's. */
  const tw_plan_config* plan_config;
  /* TW_COMBINE_OVERLAP (default) or TW_COMBINE_UNFUSED for the GEMM2 + combine half; the two
   * give the same bits. */
  tw_combine_mode mode;
  int32_t comm_ctas; /* C of the combine half, 1..max_comm_ctas; 0 = the plan's choice */
  /* SMs every kernel of the call may occupy, 2..the context's sm_budget; 0 = the context's. */
  int32_t sm_budget;
  /* The dispatch beside GEMM1 (eager mode): a positive count: the rows go out band by band on
   * that many CTAs (below the call's budget) while GEMM1 runs on the rest, each GEMM1 tile
   * starting once its band's rows have arrived; TW_LAYER_DISPATCH_SEQUENTIAL: the whole
   * dispatch on every SM of the budget, then GEMM1; TW_LAYER_DISPATCH_AUTO (0, default): the
   * model's choice of the two and of the count (it weighs the copy's SMs, lost to GEMM1 for its
   * whole run, against the dispatch time they hide). The same bits either way; each rank may
   * choose differently. The capturable mode always runs them one after the other. */
  int32_t dispatch_ctas;
} tw_layer_options;

#define TW_LAYER_DISPATCH_AUTO 0
#define TW_LAYER_DISPATCH_SEQUENTIAL (-1)

#define TW_LAYER_OPTIONS_INIT                                                                      \
  {                                                                                                \
    sizeof(tw_layer_options), TW_LAYER_OPTIONS_MAGIC, TW_API_VERSION, NULL, TW_COMBINE_OVERLAP, 0, \
        0, TW_LAYER_DISPATCH_AUTO                                                                  \
  }

/* The whole MoE layer of one rank, eager mode, reduce dataflow. COLLECTIVE: every rank calls it,
 * in the same order as its other calls on the context, with its own tokens. On `stream`:
 *  1. the dispatch (tw_moe_dispatch: counts on the device, the counts to the host, the plan from
 *     the all-gathered count matrix uploaded to dplan with GEMM1's tile list, every token row
 *     written into the expert-input buffer of its experts' ranks);
 *  2. GEMM1 + SwiGLU over that buffer into the context's h (rows, ffn) bf16:
 *     h = bf16(silu(x w_gate^T) * (x w_up^T)), fp32 accumulation, per local expert; after the
 *     dispatch or beside it, each tile starting once its band's rows have arrived
 *     (tw_layer_options.dispatch_ctas; the default is the model's choice);
 *  3. GEMM2 + combine + weighted reduction on h (tw_moe_combine_ex with the options' mode and C).
 * Every kernel's grid is at most the call's sm_budget.
 * [in]  dplan:        this rank's device plan (tw_device_plan_create on ctx); replaced
 * [in]  x:            (tokens, hidden) device bf16, 16-byte aligned
 * [in]  topk_ids:     (tokens, top_k) device int32 or int64 (id_type) global expert ids
 * [in]  topk_weights: (tokens, top_k) device fp32 gate weights
 * [in]  tokens:       0..max_tokens tokens of this rank
 * [in]  w13:          (local experts, 2 ffn, hidden) device bf16, 16-byte aligned: expert e's
 *                     gate projection in rows [0, ffn), its up projection in rows [ffn, 2 ffn)
 *                     (the vLLM / SGLang fused-MoE layout)
 * [in]  w2:           (local experts, hidden, ffn) device bf16, 16-byte aligned
 * [out] out:          (tokens, hidden) device bf16: out[t] = sum_j w[t][j] *
 *                     bf16(h_j(t) w2[e_j]^T), accumulated in fp32; may be NULL when tokens = 0
 * [in]  stream:       the caller's stream; inputs ready in its order, `out` ready in its order
 *                     when the call's work completes. The call blocks the host until this
 *                     rank's counts are on it (as tw_moe_dispatch). Not capturable in the eager
 *                     mode; with tw_context_config.dispatch_capacity > 0 it neither blocks nor
 *                     reads routing data and may be captured in a CUDA graph (tw_moe_dispatch's
 *                     capturable mode, then GEMM1 and GEMM2 + combine on the bands with live
 *                     rows; plan_config must be NULL; refusals are local to the rank).
 * Refusals: a bad or repeated id, a token count out of range, a NULL or unaligned x, topk_ids,
 * topk_weights, w13, w2 or out on any rank fail the call on every rank with the same status,
 * naming the rank, before anything is sent; the context stays usable. A context without
 * tw_context_config.layer = 1 is refused with TW_ERR_STATE, before anything collective (as every
 * rank's context has the same config). Device-side failures surface as for tw_moe_combine. */
TW_API tw_status tw_moe_layer(tw_context_t ctx, tw_device_plan_t dplan, const void* x,
                              const void* topk_ids, tw_index_type id_type,
                              const float* topk_weights, int32_t tokens, const void* w13,
                              const void* w2, void* out, cudaStream_t stream);
/* As tw_moe_layer, with options (NULL = defaults). */
TW_API tw_status tw_moe_layer_ex(tw_context_t ctx, tw_device_plan_t dplan, const void* x,
                                 const void* topk_ids, tw_index_type id_type,
                                 const float* topk_weights, int32_t tokens, const void* w13,
                                 const void* w2, void* out, const tw_layer_options* options,
                                 cudaStream_t stream);

#define TW_CONTEXT_MEMORY_MAGIC 0x74774d6du /* "twMm" */

/* The device memory a context holds on its rank, in bytes, each part sized at creation for the
 * worst case of its problem (nothing grows per call). */
typedef struct tw_context_memory {
  size_t size; /* sizeof(tw_context_memory), set by the caller (TW_CONTEXT_MEMORY_INIT) */
  uint32_t magic;
  uint32_t version;
  int64_t rows_max;        /* rows of the aligned layout any plan can need, padding included */
  int64_t window_bytes;    /* the combine's symmetric window: receive rows (reduce) or the two
                              outputs and zeros (add), arrival counters, credits, debug tags */
  int64_t dispatch_bytes;  /* the dispatch's window: expert-input rows (rows_max, hidden) bf16
                              and counters; 0 without dispatch */
  int64_t gemm2_out_bytes; /* GEMM2 output (rows_max, hidden) bf16 */
  int64_t h_bytes;         /* GEMM1 output h (rows_max, ffn) bf16; 0 without layer */
  int64_t state_bytes;     /* counters, call state, error record, debug slots, the dispatch's
                              scan tables, peer address tables */
  int64_t plan_bytes;      /* one device plan created on this context (tw_device_plan_create) */
  int64_t total_bytes;     /* the sum of the above, with one device plan */
} tw_context_memory;

#define TW_CONTEXT_MEMORY_INIT \
  { sizeof(tw_context_memory), TW_CONTEXT_MEMORY_MAGIC, TW_API_VERSION, 0, 0, 0, 0, 0, 0, 0, 0 }

/* Fills `memory` (its header set by TW_CONTEXT_MEMORY_INIT). Not collective; does not touch the
 * device. */
TW_API tw_status tw_context_memory_get(tw_context_t ctx, tw_context_memory* memory);

/* Waits for this rank's last call and agrees with every rank on whether any device-side wait
 * failed. COLLECTIVE and blocking. Returns TW_SUCCESS on every rank, or TW_ERR_TIMEOUT on every
 * rank with a detail (tw_last_error) naming the rank, the wait (band / arrival / credit), the
 * index and the counter value seen against the target. Bounded: the context's kernels end within
 * timeout_ms, and a rank that does not join the check within TW_TEAM_TIMEOUT_MS fails it on
 * every rank that did with TW_ERR_TIMEOUT naming that rank (over NCCL with more than two ranks:
 * naming the wait, NCCL cannot tell which rank is missing); the team is then broken (see
 * tw_context_abort); after tw_context_abort on any rank it returns TW_ERR_ABORTED. */
TW_API tw_status tw_context_check(tw_context_t ctx);
/* Makes a context usable again after a device-side failure. COLLECTIVE and blocking: waits for
 * the context's kernels to exit (every wait is bounded, so they do), zeroes counters, credits and
 * the error record on every rank, and restarts the call sequence. A broken team (a host-side
 * collective timed out, or a rank aborted) cannot be reset: TW_ERR_TIMEOUT or TW_ERR_ABORTED,
 * within TW_TEAM_TIMEOUT_MS. */
TW_API tw_status tw_context_reset(tw_context_t ctx);
/* Gives up on a context whose ranks can no longer work together (a peer is gone, a check timed
 * out, the caller is shutting down after an error). NOT collective, never waits for a peer:
 *  - this context refuses every later call but tw_context_destroy (and tw_context_info_get):
 *    tw_context_check and tw_context_reset return TW_ERR_ABORTED at once, tw_moe_combine
 *    TW_ERR_STATE;
 *  - the team is broken for every rank: the peers' pending and later host-side collectives of
 *    this context (tw_context_check, tw_context_reset, destroy's barrier) fail at once with
 *    TW_ERR_ABORTED naming this rank; their device-side waits for this rank end by their timeout.
 *    In-process the team's shared state says so; over NCCL this rank writes an abort word into
 *    every peer's window over NVLink, which the peers' collectives poll.
 * tilewave never aborts, revokes or destroys the caller's communicator, and after a team is
 * broken it makes no further NCCL call for the context (not even in tw_context_destroy, which
 * then leaves the window registered and allocated). When a rank is lost, NCCL's own kernels of an
 * abandoned collective wait until the caller aborts the communicator (ncclCommAbort, on every
 * surviving rank, before or after tw_context_destroy once the team is broken): until then
 * tw_context_destroy frees no device memory (any free would wait for those kernels) and returns
 * at once. Idempotent; NULL is a no-op. */
TW_API tw_status tw_context_abort(tw_context_t ctx);

/* Phase times of the last call in ms, from CUDA events (needs config.timing = 1; blocks until
 * the call has completed). Phases run concurrently in TW_COMBINE_OVERLAP, so they do not add up
 * to total_ms there. */
typedef struct tw_combine_timings {
  float total_ms;  /* first launch to the end of the last kernel on the caller's stream */
  float gemm_ms;   /* producer */
  float comm_ms;   /* consumer */
  float reduce_ms; /* owner's weighted reduction (about 0 under the add dataflow: none) */
} tw_combine_timings;

TW_API tw_status tw_context_timings(tw_context_t ctx, tw_combine_timings* timings);

/* What the context resolved: rank, world size, SM count, timeout and the window's size. */
typedef struct tw_context_info {
  int32_t rank, world_size, device, sm_count;
  int32_t timeout_ms, debug_tags, max_comm_ctas;
  int64_t window_bytes;  /* symmetric window per rank */
  int32_t nccl_version;  /* ncclGetVersion() at run time */
  int32_t unit_tiles;    /* column tiles per consumer transfer unit */
  int32_t consumer_copy; /* tw_consumer_copy in use: REGISTERS or BULK */
  int32_t dataflow;      /* tw_combine_dataflow in use: REDUCE or ADD (DEFAULT resolved) */
  int32_t sm_budget;     /* SMs a call occupies at most (config.sm_budget resolved) */
  int32_t in_process;    /* 1: the context is on an in-process team (tw_team_create) */
} tw_context_info;

TW_API tw_status tw_context_info_get(tw_context_t ctx, tw_context_info* info);

#ifdef __cplusplus
}
#endif

#endif /* TILEWAVE_H */
