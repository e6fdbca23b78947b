/*
 * problem.c: validation of a problem description, the model presets from the papers, and the
 * resolution of the default tile shape.
 *
 * Every later stage (routing, layout, kernels) relies on the checks made here: dimensions that
 * TMA can move (rows of 16 bytes), an expert count the world size divides, and a worst-case row
 * count that fits the int32 indices of the plan arrays. Each failure names the offending value
 * and what to change.
 */
#define _POSIX_C_SOURCE 200809L /* strcasecmp */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "core.h"
#include "plan.h"

/* Largest world size the planner accepts; plans hold (W) and (W, E) arrays per rank. */
#define TW__MAX_WORLD 1024

typedef struct tw__preset {
  const char* name;
  int32_t hidden, ffn, experts, top_k;
  int32_t paper; /* 1: a shape from the two papers (the oracle matrices take only these) */
} tw__preset;

/* Shapes from the two papers. The second paper's Table 1 gives only the model width of M-GPT,
 * M-BERT and M-Trans-xl (64 experts, top-2); it does not state the expert FFN width, so these use
 * the transformer convention F = 4 H. Then the routed experts of today's large MoE models, from
 * their published configs (hidden_size, moe_intermediate_size or intermediate_size, routed
 * experts, experts per token; shared experts, biases and gpt-oss's clamped SwiGLU left out): the
 * shapes of the layer benchmark (`tilewave bench layer`). */
static const tw__preset tw__presets[] = {
    {"granite-3.1-1b-a400m", 1024, 512, 32, 8, 1}, {"qwen1.5-moe-a2.7b", 2048, 1408, 60, 4, 1},
    {"deepseek-v2-lite", 2048, 1408, 64, 6, 1},    {"m-gpt", 768, 4 * 768, 64, 2, 1},
    {"m-bert", 1024, 4 * 1024, 64, 2, 1},          {"m-trans-xl", 512, 4 * 512, 64, 2, 1},
    {"deepseek-v3", 7168, 2048, 256, 8, 0},        {"qwen3-235b-a22b", 4096, 1536, 128, 8, 0},
    {"gpt-oss-120b", 2880, 2880, 128, 4, 0},       {"mixtral-8x22b", 6144, 16384, 8, 2, 0},
};

#define TW__NUM_PRESETS ((int)(sizeof tw__presets / sizeof tw__presets[0]))

int32_t tw__resolve_tile_m(const tw_problem* p) {
  return p->tile_m == 0 ? 128 : p->tile_m;
}

int32_t tw__resolve_tile_n(const tw_problem* p) {
  if (p->tile_n != 0) return p->tile_n;
  /* Wide outputs amortise the A-tile loads over more columns; narrow ones would leave most of a
   * 256-wide tile idle in the last column tile. */
  return p->hidden >= 2048 ? 256 : 128;
}

tw_status tw_problem_validate(const tw_problem* problem) {
  tw__clear_error();
  TW_CHECK_NULL(problem);
  TW_TRY(tw__check_header("tw_problem", problem->size, sizeof(tw_problem), problem->magic,
                          TW_PROBLEM_MAGIC, problem->version));
  const tw_problem* p = problem;
  if (p->world_size < 1 || p->world_size > TW__MAX_WORLD)
    return tw__fail(TW_ERR_INVALID_SIZE,
                    "world_size (%d) must be in 1..%d; pass the number of ranks", p->world_size,
                    TW__MAX_WORLD);
  if (p->hidden <= 0)
    return tw__fail(TW_ERR_INVALID_SIZE, "hidden (%d) must be positive; pass the model width",
                    p->hidden);
  if (p->ffn <= 0)
    return tw__fail(TW_ERR_INVALID_SIZE, "ffn (%d) must be positive; pass the expert FFN width",
                    p->ffn);
  if (p->hidden > TW_MAX_HIDDEN || p->ffn > TW_MAX_HIDDEN)
    return tw__fail(TW_ERR_INVALID_SIZE,
                    "hidden (%d) and ffn (%d) must be at most %d (TW_MAX_HIDDEN); no MoE model is "
                    "wider, and the plan's arrays grow with them",
                    p->hidden, p->ffn, TW_MAX_HIDDEN);
  if (p->hidden % 8 != 0)
    return tw__fail(TW_ERR_ALIGNMENT,
                    "hidden (%d) is not a multiple of 8; TMA moves rows in 16-byte units, so pad "
                    "the model width to a multiple of 8",
                    p->hidden);
  if (p->ffn % 8 != 0)
    return tw__fail(TW_ERR_ALIGNMENT,
                    "ffn (%d) is not a multiple of 8; TMA moves rows in 16-byte units, so pad the "
                    "expert FFN width to a multiple of 8",
                    p->ffn);
  if (p->experts < 1)
    return tw__fail(TW_ERR_INVALID_SIZE, "experts (%d) must be at least 1", p->experts);
  if (p->experts > TW_MAX_EXPERTS)
    return tw__fail(TW_ERR_INVALID_SIZE, "experts (%d) must be at most %d (TW_MAX_EXPERTS)",
                    p->experts, TW_MAX_EXPERTS);
  if (p->experts % p->world_size != 0)
    return tw__fail(TW_ERR_INDIVISIBLE,
                    "experts (%d) is not divisible by world_size (%d); use a world size that "
                    "divides the expert count",
                    p->experts, p->world_size);
  if (p->top_k < 1 || p->top_k > p->experts || p->top_k > TW_MAX_TOP_K)
    return tw__fail(TW_ERR_TOPK_RANGE, "top_k (%d) must be in 1..experts (%d) and at most %d",
                    p->top_k, p->experts, TW_MAX_TOP_K);
  if (p->max_tokens < 1)
    return tw__fail(TW_ERR_INVALID_SIZE,
                    "max_tokens (%d) must be at least 1; pass the most tokens any rank holds in "
                    "one call",
                    p->max_tokens);
  if (p->max_tokens > TW_MAX_TOKENS)
    return tw__fail(TW_ERR_INVALID_SIZE,
                    "max_tokens (%d) must be at most %d (TW_MAX_TOKENS); split the batch into "
                    "several calls",
                    p->max_tokens, TW_MAX_TOKENS);
  if (p->tile_m != 0 && p->tile_m != 64 && p->tile_m != 128)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "tile_m (%d) must be 0 (default 128), 64 or 128",
                    p->tile_m);
  if (p->tile_n != 0 && p->tile_n != 64 && p->tile_n != 128 && p->tile_n != 256)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tile_n (%d) must be 0 (chosen from hidden), 64, 128 or 256", p->tile_n);
  if (p->dtype == TW_FP16)
    return tw__fail(TW_ERR_UNSUPPORTED, "dtype TW_FP16 is not supported; only TW_BF16 for now");
  if (p->dtype != TW_BF16)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "dtype (%d) is not a tw_dtype; use TW_BF16",
                    (int)p->dtype);
  /* Worst case on one rank: every token of every rank routed to its experts, plus the padding of
   * every remote group. Plan indices into the layout and into "receive rows + layout rows"
   * (slot_row) are int32, so bound the sum of both. */
  int64_t tm = tw__resolve_tile_m(p);
  int64_t local_experts = p->experts / p->world_size;
  int64_t assignments = (int64_t)p->max_tokens * p->top_k;
  int64_t worst = ((int64_t)p->world_size + 1) * assignments +
                  local_experts * ((int64_t)p->world_size - 1) * (tm - 1);
  if (worst > INT32_MAX)
    return tw__fail(TW_ERR_INVALID_SIZE,
                    "worst-case rows per rank (%lld for world_size %d, max_tokens %d, top_k %d) "
                    "exceed 2^31-1; lower max_tokens and split the batch into several calls",
                    (long long)worst, p->world_size, p->max_tokens, p->top_k);
  return TW_SUCCESS;
}

tw_status tw_problem_preset(const char* name, tw_problem* problem) {
  tw__clear_error();
  TW_CHECK_NULL(name);
  TW_CHECK_NULL(problem);
  for (int i = 0; i < TW__NUM_PRESETS; i++) {
    if (strcasecmp(name, tw__presets[i].name) == 0) {
      problem->hidden = tw__presets[i].hidden;
      problem->ffn = tw__presets[i].ffn;
      problem->experts = tw__presets[i].experts;
      problem->top_k = tw__presets[i].top_k;
      return TW_SUCCESS;
    }
  }
  char names[512]; /* the preset table's names, so the message never falls behind it */
  size_t n = 0;
  for (int i = 0; i < TW__NUM_PRESETS && n < sizeof names; i++)
    n += (size_t)snprintf(names + n, sizeof names - n, "%s%s", i ? ", " : "", tw__presets[i].name);
  return tw__fail(TW_ERR_INVALID_ARGUMENT, "unknown preset \"%s\"; use one of %s", name, names);
}

int tw_preset_count(void) {
  return TW__NUM_PRESETS;
}

const char* tw_preset_name(int index) {
  if (index < 0 || index >= TW__NUM_PRESETS) return NULL;
  return tw__presets[index].name;
}

int tw__preset_from_papers(int index) {
  return index >= 0 && index < TW__NUM_PRESETS && tw__presets[index].paper;
}

/* TW_COMBINE_DATAFLOW's choices (tunables.c: `reduce`, `add`) as tw_combine_dataflow values. */
static const int32_t tw__dataflow_values[] = {TW_DATAFLOW_REDUCE, TW_DATAFLOW_ADD};

int32_t tw__dataflow_parse(const char* name) {
  const int32_t i = tw__tunable_match(TW_TUNE_COMBINE_DATAFLOW, name);
  return i < 0 ? -1 : tw__dataflow_values[i];
}

const char* tw__dataflow_name(int32_t dataflow) {
  return dataflow == TW_DATAFLOW_ADD ? "add" : "reduce";
}

tw_status tw__dataflow_resolve(const char* what, int32_t requested, int32_t* dataflow) {
  TW_CHECK_NULL(dataflow);
  *dataflow = TW_DATAFLOW_REDUCE;
  if (requested != TW_DATAFLOW_DEFAULT && requested != TW_DATAFLOW_REDUCE &&
      requested != TW_DATAFLOW_ADD)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "%s: dataflow %d; give 0 (TW_DATAFLOW_DEFAULT: env TW_COMBINE_DATAFLOW, else "
                    "reduce), 1 (TW_DATAFLOW_REDUCE) or 2 (TW_DATAFLOW_ADD)",
                    what, requested);
  /* Read every time (not cached), and checked even when the caller decides, like TW_SCHEDULE. */
  int32_t i = 0;
  TW_TRY(tw__tunable_choice(what, TW_TUNE_COMBINE_DATAFLOW, &i));
  *dataflow = requested != TW_DATAFLOW_DEFAULT ? requested : tw__dataflow_values[i];
  return TW_SUCCESS;
}
