/*
 * test_model_ep.c: the expert-parallel resource model (model*.c), in one file because its cases
 * share the hand-built plans and the argmin reference. A hand-built plan whose T(C,
 * mgb) table is computed by hand below, once compute-bound and once bound by its memory traffic;
 * then real plans from the planner: the choice is the argmin of the predictions over every
 * candidate (both schedules when the model chooses the schedule), the fast evaluation equals the
 * segment-by-segment reference, explicit settings win, the selector can be switched off, more
 * link bandwidth never hurts, a plan with nothing to send costs compute (or memory) + reduce at
 * the smallest C, and the memory term sends a weight-heavy plan to the expert-major schedule.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "plan.h"
#include "tilewave.h"
#include "tw_test.h"
#include "tw_test_random.h"

/* ---- A hand-built plan -------------------------------------------------------------------- */
/*
 * Rank 0 of 2, one local expert, TM = TN = 64, hidden 128 (2 column tiles), K = 1000.
 * Layout: 6 bands of 64 valid rows owned by rank 1 (rows 0..383), then 1 local band (384..447).
 * Schedule: band i is tiles 2i, 2i+1 (14 tiles; remote ones first).
 * Segments (planner's rule: the first and last band of a stream alone, middles by mgb):
 *   mgb 1: {0} {1} {2} {3} {4} {5}   last tiles 1 3 5 7 9 11, 2 units each
 *   mgb 2: {0} {1,2} {3,4} {5}       last tiles 1 5 9 11,  units 2 4 4 2
 *   mgb 4: {0} {1,2,3,4} {5}         last tiles 1 9 11,    units 2 8 2
 * Hardware: G = 5, c_max = 3 -> P(1) = 4, P(2) = 3, P(3) = 2.
 *   tau_tile = 2*64*64*1000 / (8.192e12) s = 1 us (overhead 0).
 *   one unit = 64 rows x 64 cols x 2 B = 8192 B, U/2 bands a segment. The consumer serves
 *   the segments from s on in Q_s = max(bytes / (C x 16384) + bands x 1 / C, bytes / 32768) us
 *   (per-CTA rate 16384 B/us, latency 1 us per band shared by the C CTAs, link plateau 32768
 *   B/us). The CTAs' side is the longer at every C (at C = 3 it is 2 x U/6 against U/4), so Q_s
 *   is the sum of the segments' q(U) = U x 8192 / (C x 16384) + (U/2) / C = U / C:
 *              U=2      U=4      U=8
 *     C = 1    2        4        8
 *     C = 2    1        2        4
 *     C = 3    2/3      4/3      8/3
 *   reduce: owner rows = recv 128 + local 64 = 192, tokens 96, (192 + 96) x 256 B / 737280 B/us
 *   = 0.1 us.
 *   memory: one run of the expert's bands: weights 128 x 1000 + rows 448 x (1000 + 128), 2 B
 *   each = 1266688 B, / 737280 B/us = 1.718 us: under one wave's compute at every C (a wave of
 *   P tiles lasts max(1, P x 1.718 / 14) = 1 us at P 4, 3, 2), so the table is compute-bound.
 * A_s = floor(t_s / P) + 1; F = max_s (A_s + Q_s), with additive Q the recurrence
 * F_s = max(A_s, F_{s-1}) + q_s; T = max(F, ceil(14/P)) + 0.1.
 *   C=1 (P 4, compute 4):
 *     mgb 1: A 1 1 2 2 3 3, q 2: F 3 5 7 9 11 13 -> T 13.1
 *     mgb 2: A 1 2 3 3, q 2 4 4 2: F 3, 7, 11, 13 -> T 13.1
 *     mgb 4: A 1 3 3, q 2 8 2: F 3, 11, 13 -> T 13.1
 *   C=2 (P 3, compute 5):
 *     mgb 1: A 1 2 2 3 4 4, q 1: F 2 3 4 5 6 7 -> T 7.1
 *     mgb 2: A 1 2 4 4, q 1 2 2 1: F 2, 4, 6, 7 -> T 7.1
 *     mgb 4: A 1 4 4, q 1 4 1: F 2, 8, 9 -> T 9.1
 *   C=3 (P 2, compute 7):
 *     mgb 1: A 1 2 3 4 5 6, q 2/3: F 5/3 ... 20/3 -> T max(20/3, 7) + 0.1 = 7.1
 *     mgb 2: A 1 3 5 6, q 2/3 4/3 4/3 2/3: F 5/3, 13/3, 19/3, 7 -> T 7.1
 *     mgb 4: A 1 5 6, q 2/3 8/3 2/3: F 5/3, 23/3, 25/3 -> T 8.4333
 * Best: T = 7.1 at (C 2, mgb 1), (C 2, mgb 2), (C 3, mgb 1) and (C 3, mgb 2); ties go to the
 * smaller C, then the smaller mgb: C = 2, mgb = 1. Sequential: ceil(14/5) = 3 waves + 98304 B /
 * 32768 B/us + 0.1 = 6.1. The plan has one expert, so remote-first and expert-major are the same
 * order; it is labelled remote-first and cannot be reordered (no layout_bands).
 */
static const double hand_t[3][3] = {
    {13.1, 13.1, 13.1}, {7.1, 7.1, 9.1}, {7.1, 7.1, 25.0 / 3.0 + 0.1}};
static const int32_t mgbs[3] = {1, 2, 4};

typedef struct hand_plan {
  struct tw_plan plan;
  tw_row_src row_src[448];
  tw_tile tiles[14];
  tw_band bands[7];
  tw_segment segments[7];
  int32_t stream_first[2], stream_last[2];
  tw_hardware hw;
} hand_plan;

static void hand_build(hand_plan* h, int remote) {
  memset(h, 0, sizeof *h);
  struct tw_plan* p = &h->plan;
  p->problem = tw_test_problem(2, 128, 1000, 2, 2, 1000, 0, 0);
  p->rank = 0;
  p->local_experts = 1;
  p->schedule = p->schedule_request = TW_SCHEDULE_REMOTE_FIRST;
  p->tm = p->tn = 64;
  p->col_tiles = 2;
  p->rows = 448;
  p->row_src = h->row_src;
  for (int r = 0; r < 448; r++) {
    h->row_src[r].owner = (remote && r < 384) ? 1 : 0;
    h->row_src[r].token = r;
    h->row_src[r].slot = 0;
  }
  p->num_tiles = 14;
  p->num_remote_tiles = remote ? 12 : 0;
  p->tiles = h->tiles;
  for (int i = 0; i < 14; i++) {
    h->tiles[i].band = i / 2;
    h->tiles[i].row0 = 64 * (i / 2);
    h->tiles[i].rows = 64;
    h->tiles[i].col0 = 64 * (i % 2);
  }
  p->num_bands = 7;
  p->bands = h->bands;
  for (int b = 0; b < 7; b++) {
    h->bands[b].row0 = 64 * b;
    h->bands[b].rows = h->bands[b].valid_rows = 64;
    h->bands[b].dest = (remote && b < 6) ? 1 : 0;
    h->bands[b].segment = -1;
    h->bands[b].dest_offset = h->bands[b].dest == 1 ? 64 * b * 256 : -1;
  }
  p->segments = h->segments;
  h->stream_first[0] = h->stream_last[0] = -1;
  h->stream_first[1] = remote ? 0 : -1;
  h->stream_last[1] = remote ? 5 : -1;
  p->stream_first = h->stream_first;
  p->stream_last = h->stream_last;
  p->send_bytes = remote ? 6 * 64 * 256 : 0;
  p->recv_rows = 128;
  tw_hardware_default(&h->hw);
  h->hw.sm_count = 5;
  h->hw.c_max = 3;
  h->hw.tile_tflops = 8.192;
  h->hw.tile_overhead_us = 0.0;
  h->hw.tile_floor_us = 0.0;  /* the hand tables below have no floor */
  h->hw.tile_m64_share = 1.0; /* and price their 64-row tiles at the full rate */
  h->hw.link_cta_gbps = 16.384;
  h->hw.link_peak_gbps = 32.768;
  h->hw.link_latency_us = 1.0;
  h->hw.mem_gbps = 737.28;
}

static tw_plan_config hand_config(hand_plan* h, int32_t c, int32_t mgb, int32_t use_model) {
  tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
  cfg.comm_ctas = c;
  cfg.coalesce = mgb;
  cfg.use_model = use_model;
  cfg.hardware = &h->hw;
  return cfg;
}

static void test_hand_plan_table(void) {
  static hand_plan h;
  hand_build(&h, 1);
  tw_plan_config cfg = hand_config(&h, 0, 0, 1);
  CHECK_OK(tw__model_choose(&h.plan, &cfg));
  for (int c = 1; c <= 3; c++)
    for (int j = 0; j < 3; j++) {
      double t = 0;
      CHECK_OK(tw_plan_predict(&h.plan, c, mgbs[j], &t));
      CHECKF(fabs(t - hand_t[c - 1][j]) < 1e-9, "T(C=%d, mgb=%d) = %.12g, hand %.12g", c, mgbs[j],
             t, hand_t[c - 1][j]);
    }
  CHECK(h.plan.comm_ctas == 2);
  CHECK(h.plan.coalesce == 1);
  CHECK(h.plan.num_segments == 6); /* the plan keeps the chosen mgb's segments */
  CHECK_NEAR(h.plan.predicted_us, 7.1, 1e-9);
  CHECK_NEAR(h.plan.sequential_us, 6.1, 1e-9);
  CHECK_NEAR(h.plan.gemm_us, 3.0, 1e-9);
  CHECK(h.plan.schedule == TW_SCHEDULE_REMOTE_FIRST);
  double bytes = 0, refetch = -1;
  CHECK_OK(tw__model_traffic(&h.plan, &bytes, &refetch));
  CHECK_NEAR(bytes, 1266688.0, 1e-6);
  CHECK(refetch == 0.0); /* one expert, one run */
  CHECK(h.plan.solve_us >= 0.0 && h.plan.solve_us < 1e4);
  /* The segment-by-segment reference on the kept segments agrees at every C. */
  for (int c = 1; c <= 3; c++) {
    double t = 0;
    CHECK_OK(tw__model_eval_plain(&h.plan, c, &t));
    CHECK_NEAR(t, hand_t[c - 1][0], 1e-9);
  }
  /* Only tabulated mgb and valid C are predicted. */
  double t;
  CHECK_STATUS(tw_plan_predict(&h.plan, 0, 2, &t), TW_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(tw_plan_predict(&h.plan, 4, 2, &t), TW_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(tw_plan_predict(&h.plan, 1, 3, &t), TW_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(tw_plan_predict(&h.plan, 1, 2, NULL), TW_ERR_NULL_POINTER);
  tw__model_free(&h.plan);
  CHECK(h.plan.model_tables == NULL);
  CHECK_STATUS(tw_plan_predict(&h.plan, 1, 2, &t), TW_ERR_STATE);
}

static void test_hand_plan_explicit_and_defaults(void) {
  static hand_plan h;
  hand_build(&h, 1);
  struct {
    int32_t c, mgb, use_model, want_c, want_mgb;
    double want_t;
  } cases[] = {
      {3, 0, 1, 3, 1, 7.1},              /* C fixed: best mgb at C = 3 (1 and 2 tie) */
      {0, 4, 1, 3, 4, 25.0 / 3.0 + 0.1}, /* mgb fixed: best C in column mgb = 4 */
      {1, 1, 1, 1, 1, 13.1},             /* both fixed: the model only predicts */
      {0, 0, 0, 3, 2, 7.1},              /* selector off: TW_DEFAULT_COMM_CTAS (8) capped at c_max
                                             3, mgb 2 */
      {1, 0, 0, 1, 2, 13.1},             /* selector off, C given: C 1, default mgb 2 */
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    tw_plan_config cfg = hand_config(&h, cases[i].c, cases[i].mgb, cases[i].use_model);
    CHECK_OK(tw__model_choose(&h.plan, &cfg));
    CHECKF(h.plan.comm_ctas == cases[i].want_c && h.plan.coalesce == cases[i].want_mgb,
           "case %zu: got C %d mgb %d", i, h.plan.comm_ctas, h.plan.coalesce);
    CHECK_NEAR(h.plan.predicted_us, cases[i].want_t, 1e-9);
  }
  /* An explicit coalesce outside {1, 2, 4} is tabulated and predicted too: mgb 3 gives
   * {0} {1,2,3} {4} {5}: last tiles 1 7 9 11, units 2 6 2 2. At C = 2 (P 3): A 1 3 4 4,
   * q 1, 3*0.5+3/2 = 3, 1, 1: F 2, 6, 7, 8 -> T = max(8, 5) + 0.1 = 8.1. */
  tw_plan_config cfg = hand_config(&h, 2, 3, 1);
  CHECK_OK(tw__model_choose(&h.plan, &cfg));
  CHECK(h.plan.coalesce == 3 && h.plan.comm_ctas == 2);
  CHECK_NEAR(h.plan.predicted_us, 8.1, 1e-9);
  double t = 0;
  CHECK_OK(tw_plan_predict(&h.plan, 2, 3, &t));
  CHECK_NEAR(t, 8.1, 1e-9);
  /* Out-of-range settings are rejected with a message. */
  cfg = hand_config(&h, 4, 0, 1);
  CHECK_STATUS(tw__model_choose(&h.plan, &cfg), TW_ERR_INVALID_ARGUMENT);
  cfg = hand_config(&h, 0, -1, 1);
  CHECK_STATUS(tw__model_choose(&h.plan, &cfg), TW_ERR_INVALID_ARGUMENT);
  cfg = hand_config(&h, 0, 0, 2);
  CHECK_STATUS(tw__model_choose(&h.plan, &cfg), TW_ERR_INVALID_ARGUMENT);
  h.hw.c_max = 5; /* leaves the producer no SM */
  cfg = hand_config(&h, 0, 0, 1);
  CHECK_STATUS(tw__model_choose(&h.plan, &cfg), TW_ERR_INVALID_ARGUMENT);
  tw__model_free(&h.plan);
}

/* Nothing to send: no consumer (C = 0) and T = the compute end on every SM + reduce; every mgb
 * ties (-> the smallest, 1); an explicit C still wins and is priced as the model prices it.
 *   own rows = all 448 local + 128 received = 576, tokens 288: (576 + 288) x 256 B / 737280 B/us
 *   = 0.3 us. Compute: C=0 ceil(14/5) = 3 waves, C=1 ceil(14/4) = 4, C=2 ceil(14/3) = 5, C=3
 *   ceil(14/2) = 7 (memory 1.718 us). T = 3.3, 4.3, 5.3, 7.3. */
static void test_hand_plan_no_remote(void) {
  static hand_plan h;
  hand_build(&h, 0);
  tw_plan_config cfg = hand_config(&h, 0, 0, 1);
  CHECK_OK(tw__model_choose(&h.plan, &cfg));
  CHECK(h.plan.num_segments == 0);
  CHECK(h.plan.comm_ctas == 0);
  CHECK(h.plan.coalesce == 1);
  CHECK_NEAR(h.plan.predicted_us, 3.3, 1e-9);
  tw__model_free(&h.plan);
  cfg = hand_config(&h, 1, 0, 1); /* C given: kept */
  CHECK_OK(tw__model_choose(&h.plan, &cfg));
  CHECK(h.plan.comm_ctas == 1);
  CHECK_NEAR(h.plan.predicted_us, 4.3, 1e-9);
  const double want[3] = {4.3, 5.3, 7.3};
  for (int c = 1; c <= 3; c++)
    for (int j = 0; j < 3; j++) {
      double t = 0;
      CHECK_OK(tw_plan_predict(&h.plan, c, mgbs[j], &t));
      CHECK_NEAR(t, want[c - 1], 1e-9);
    }
  /* Sequential: ceil(14/5) = 3 waves + 0 bytes + 0.3 = 3.3. */
  CHECK_NEAR(h.plan.sequential_us, 3.3, 1e-9);
  tw__model_free(&h.plan);
}

/* The same plan with ten times less memory bandwidth (73728 B/us): its traffic, 1266688 B, takes
 * 1237/72 = 17.18 us, more than the compute end at any C (4, 5, 7 waves of 1 us). Each tile moves
 * 1/14 of it, m = 1237/1008 us, a full wave of P tiles lasts P m (more than a tile's 1 us of
 * compute) and the last wave r m, so the compute end is 14 m = 17.18 us everywhere; reduce = 1 us.
 *   C=1 (P 4, waves of 4 4 4 2 tiles, tau 4 m = 1237/252 = 4.909), mgb 4: A 1 3 3, q 2 8 2:
 *     F tau + 2, 3 tau + 8, 3 tau + 10 = 24.726 -> T = 3 tau + 11 = 25.726
 *   C=2 (P 3, waves of 3 3 3 3 2, tau 1237/336 = 3.682), mgb 2: A 1 2 4 4, q 1 2 2 1:
 *     F 4.682, 2 tau + 2, 4 tau + 2, 4 tau + 3 = 17.726, above the memory end
 *     -> T = 4 tau + 4 = 18.726
 *   C=3 (P 2, 7 waves of 2, tau 1237/504 = 2.454), mgb 1: A 1..6, q 2/3: F_5 = 6 tau + 2/3 =
 *     15.39, below the memory end -> T = 1237/72 + 1 = 18.181
 * GEMM alone (5 SMs, waves of 5 5 4 tiles): 14 m = 17.18; sequential 17.18 + 3 + 1. */
static void test_hand_plan_memory_bound(void) {
  static hand_plan h;
  hand_build(&h, 1);
  h.hw.mem_gbps = 73.728;
  tw_plan_config cfg = hand_config(&h, 0, 0, 1);
  CHECK_OK(tw__model_choose(&h.plan, &cfg));
  const double mem = 1237.0 / 72.0;
  const struct {
    int32_t c, mgb;
    double t;
  } cells[3] = {{1, 4, 3 * 1237.0 / 252 + 11}, {2, 2, 4 * 1237.0 / 336 + 4}, {3, 1, mem + 1}};
  for (int i = 0; i < 3; i++) {
    double t = 0;
    CHECK_OK(tw_plan_predict(&h.plan, cells[i].c, cells[i].mgb, &t));
    CHECKF(fabs(t - cells[i].t) < 1e-9, "T(C=%d, mgb=%d) = %.12g, hand %.12g", cells[i].c,
           cells[i].mgb, t, cells[i].t);
  }
  CHECK_NEAR(h.plan.gemm_us, mem, 1e-9);
  CHECK_NEAR(h.plan.sequential_us, mem + 4.0, 1e-9);
  /* The decision is the argmin of the table, and the reference agrees on its segments. */
  double bt = 0;
  int32_t bc = 0, bm = 0;
  for (int32_t c = 1; c <= 3; c++)
    for (int j = 0; j < 3; j++) {
      double t = 0;
      CHECK_OK(tw_plan_predict(&h.plan, c, mgbs[j], &t));
      CHECK(t >= mem + 1.0 - 1e-9); /* nothing ends before the traffic does */
      if (bc == 0 || t < bt || (t == bt && (c < bc || (c == bc && mgbs[j] < bm))))
        bt = t, bc = c, bm = mgbs[j];
    }
  CHECK(h.plan.comm_ctas == bc && h.plan.coalesce == bm && h.plan.predicted_us == bt);
  for (int32_t c = 1; c <= 3; c++) {
    double fast = 0, plain = 0;
    CHECK_OK(tw_plan_predict(&h.plan, c, bm, &fast));
    CHECK_OK(tw__model_eval_plain(&h.plan, c, &plain));
    CHECK_NEAR(fast, plain, 1e-9 * plain);
  }
  /* A plan built by hand has one order: asking the model to choose cannot reorder it. */
  h.plan.schedule_request = TW_SCHEDULE_AUTO;
  CHECK_STATUS(tw__model_choose(&h.plan, &cfg), TW_ERR_STATE);
  tw__model_free(&h.plan);
}

/* ---- Real plans --------------------------------------------------------------------------- */

static const int32_t scheds[2] = {TW_SCHEDULE_REMOTE_FIRST, TW_SCHEDULE_EXPERT_MAJOR};

/* Whether the model tabulated `schedule` for this plan: both when it chose the schedule (the
 * plans passed here all have the selector on). */
static int tabulated(tw_plan_t plan, int32_t schedule) {
  return schedule == plan->schedule || plan->schedule_request == TW_SCHEDULE_AUTO;
}

/* The model's choice by its rules: the best candidate (T, then C, then the smaller mgb, then
 * expert-major, or remote-first where every local expert's weights fit in half the L2) over every
 * tabulated schedule, C in 1..c_max and mgb in mgb_list, then the plateau walk from it. */
typedef struct best_cand {
  double t;
  int32_t c, mgb, schedule;
} best_cand;

/* The producer's waves at C: ceil(tiles / P(C)). */
static int64_t ref_waves(tw_plan_t plan, int32_t c) {
  const tw_hardware* hw = &plan->hardware;
  const int64_t p = (int64_t)hw->occ_comp * (hw->sm_count - (c + hw->occ_comm - 1) / hw->occ_comm);
  return (plan->num_tiles + p - 1) / p;
}

/* The plateau walk on b's table (plan.h, TW_MODEL_PLATEAU): up from b.c while T stays within the
 * band and the next C keeps b's wave count; the last C reached, with its T. */
static best_cand plateau_walk(tw_plan_t plan, best_cand b) {
  const double band = b.t * (1.0 + TW_MODEL_PLATEAU);
  const int64_t waves = ref_waves(plan, b.c);
  best_cand top = b;
  for (int32_t x = b.c + 1; x < plan->hardware.c_max && ref_waves(plan, x + 1) == waves; x++) {
    double t = 0;
    CHECK_OK(tw__model_predict(plan, b.schedule, x, b.mgb, &t));
    if (t > band) break;
    top.c = x, top.t = t;
  }
  return top;
}

static best_cand argmin_all(tw_plan_t plan, const int32_t* mgb_list, int n_mgb) {
  best_cand b = {0, 0, 0, 0};
  int32_t bkey = 0;
  const double weights =
      2.0 * plan->local_experts * (double)plan->problem.hidden * (double)plan->problem.ffn;
  const int32_t wins = weights <= 0.5 * plan->hardware.l2_mib * 1048576.0
                           ? TW_SCHEDULE_REMOTE_FIRST
                           : TW_SCHEDULE_EXPERT_MAJOR;
  for (int si = 0; si < 2; si++) {
    if (!tabulated(plan, scheds[si])) continue;
    for (int32_t c = 1; c <= plan->hardware.c_max; c++)
      for (int j = 0; j < n_mgb; j++) {
        double t = 0;
        CHECK_OK(tw__model_predict(plan, scheds[si], c, mgb_list[j], &t));
        const int32_t key = -2 * mgb_list[j] + (scheds[si] == wins);
        if (b.c == 0 || t < b.t || (t == b.t && (c < b.c || (c == b.c && key > bkey)))) {
          b = (best_cand){t, c, mgb_list[j], scheds[si]};
          bkey = key;
        }
      }
  }
  return plateau_walk(plan, b);
}

static tw_status make_plan(const char* preset, int32_t world, int32_t tokens, tw_router router,
                           uint64_t seed, int32_t rank, const tw_plan_config* cfg,
                           tw_plan_t* plan) {
  tw_problem prob = TW_PROBLEM_INIT;
  tw_status st = tw_problem_preset(preset, &prob);
  if (st != TW_SUCCESS) return st;
  prob.world_size = world;
  prob.max_tokens = tokens;
  tw_routing_t rt = NULL;
  st = tw_routing_generate(&prob, router, 0.0, tokens, seed, &rt);
  if (st != TW_SUCCESS) return st;
  st = tw_plan_create(&prob, rt, rank, cfg, plan);
  tw_routing_destroy(rt);
  return st;
}

/* Checks that the plan's choice is the argmin over every candidate (both schedules when the
 * model chose the schedule), with ties to the smaller C, then the smaller mgb, then the schedule
 * that wins ties (argmin_all); and that the fast form equals the reference. other_too: also
 * reorders the plan into every tabulated schedule and mgb and checks each table against the
 * reference (slow on big plans), then restores the plan's choice. */
static void check_choice_is_argmin(tw_plan_t plan, const char* what, int other_too) {
  tw_plan_summary s;
  CHECK_OK(tw_plan_summary_get(plan, &s));
  const best_cand b = argmin_all(plan, mgbs, 3);
  if (plan->num_remote_tiles == 0) { /* nothing to send: no consumer, the producer on every SM */
    CHECKF(s.comm_ctas == 0 && s.coalesce == b.mgb && s.schedule == b.schedule &&
               s.predicted_us >= s.gemm_us,
           "%s: nothing to send, chose C %d mgb %d schedule %d T %.9g (GEMM %.9g)", what,
           s.comm_ctas, s.coalesce, s.schedule, s.predicted_us, s.gemm_us);
    return;
  }
  CHECKF(s.comm_ctas == b.c && s.coalesce == b.mgb && s.schedule == b.schedule &&
             s.predicted_us == b.t,
         "%s: chose C %d mgb %d schedule %d T %.9g; argmin is C %d mgb %d schedule %d T %.9g", what,
         s.comm_ctas, s.coalesce, s.schedule, s.predicted_us, b.c, b.mgb, b.schedule, b.t);
  for (int32_t c = 1; c <= plan->hardware.c_max; c++) {
    double fast = 0, plain = 0;
    CHECK_OK(tw_plan_predict(plan, c, s.coalesce, &fast));
    CHECK_OK(tw__model_eval_plain(plan, c, &plain));
    CHECKF(fabs(fast - plain) <= 1e-9 * plain, "%s C %d: fast %.12g, reference %.12g", what, c,
           fast, plain);
  }
  CHECK(s.sequential_us > 0.0 && s.predicted_us > 0.0 && s.gemm_us > 0.0);
  CHECK(s.sequential_us >= s.gemm_us);
  if (!other_too) return;
  for (int si = 0; si < 2; si++) {
    if (!tabulated(plan, scheds[si])) continue;
    for (int j = 0; j < 3; j++) {
      CHECK_OK(tw__plan_set_schedule(plan, scheds[si]));
      CHECK_OK(tw__plan_build_segments(plan, mgbs[j]));
      for (int32_t c = 1; c <= plan->hardware.c_max; c++) {
        double fast = 0, plain = 0;
        CHECK_OK(tw__model_predict(plan, scheds[si], c, mgbs[j], &fast));
        CHECK_OK(tw__model_eval_plain(plan, c, &plain));
        CHECKF(fabs(fast - plain) <= 1e-9 * plain,
               "%s schedule %d mgb %d C %d: fast %.12g, reference %.12g", what, scheds[si], mgbs[j],
               c, fast, plain);
      }
    }
  }
  CHECK_OK(tw__plan_set_schedule(plan, s.schedule));
  CHECK_OK(tw__plan_build_segments(plan, s.coalesce));
}

static void test_real_plans_argmin(void) {
  const tw_router routers[3] = {TW_ROUTER_BALANCED, TW_ROUTER_MODERATE_SKEW, TW_ROUTER_STRESS_SKEW};
  /* Fresh routings every run (the run's seed, TW_TEST_SEED to replay). */
  const uint64_t seed = tw_test_seed;
  int checked = 0;
  for (int p = 0; p < tw_preset_count(); p++)
    for (int w = 2; w <= 4; w += 2)
      for (int r = 0; r < 3; r++) {
        tw_plan_t plan = NULL;
        const int32_t tokens = 512 + 1024 * ((p + r) % 3);
        tw_status st = make_plan(tw_preset_name(p), w, tokens, routers[r], seed + p * 31 + r, w - 1,
                                 NULL, &plan);
        if (st == TW_ERR_INDIVISIBLE) continue; /* e.g. 60 experts on 4 ranks */
        CHECK_OK(st);
        if (plan == NULL) continue;
        char what[128];
        snprintf(what, sizeof what, "%s W %d router %d", tw_preset_name(p), w, r);
        check_choice_is_argmin(plan, what, 1);
        tw_plan_destroy(plan);
        checked++;
      }
  CHECKF(checked >= 2 * tw_preset_count(), "only %d plans were checked", checked);
}

static void test_real_plans_explicit_and_off(void) {
  tw_plan_t plan = NULL;
  tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
  cfg.comm_ctas = 5;
  cfg.coalesce = 1;
  CHECK_OK(make_plan("qwen1.5-moe-a2.7b", 2, 4096, TW_ROUTER_BALANCED, 11, 0, &cfg, &plan));
  if (plan) {
    CHECK(plan->comm_ctas == 5 && plan->coalesce == 1);
    double t = 0;
    CHECK_OK(tw_plan_predict(plan, 5, 1, &t));
    CHECK(t == plan->predicted_us);
    tw_plan_destroy(plan);
  }
  cfg = (tw_plan_config)TW_PLAN_CONFIG_INIT;
  cfg.use_model = 0;
  plan = NULL;
  CHECK_OK(make_plan("qwen1.5-moe-a2.7b", 2, 4096, TW_ROUTER_BALANCED, 11, 0, &cfg, &plan));
  if (plan) {
    CHECK(plan->comm_ctas == TW_DEFAULT_COMM_CTAS && plan->coalesce == TW_DEFAULT_COALESCE);
    tw_plan_destroy(plan);
  }
  /* NULL config = the model with the built-in (or TW_CALIBRATION) hardware. */
  plan = NULL;
  CHECK_OK(make_plan("qwen1.5-moe-a2.7b", 2, 4096, TW_ROUTER_BALANCED, 11, 0, NULL, &plan));
  if (plan) {
    check_choice_is_argmin(plan, "NULL config", 0);
    tw_plan_destroy(plan);
  }
}

/* An explicit coalescing factor outside {1, 2, 4} (3, 24, 64: few long segments): the prediction
 * equals the segment-by-segment reference at every C, and the choice is the walk from the
 * argmin. */
static void test_large_explicit_coalesce(void) {
  const int32_t mgb_values[3] = {3, 24, 64};
  for (int i = 0; i < 3; i++) {
    tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
    cfg.coalesce = mgb_values[i];
    tw_plan_t plan = NULL;
    CHECK_OK(make_plan("m-bert", 4, 16384, TW_ROUTER_STRESS_SKEW, tw_test_seed + (uint64_t)i, 2,
                       &cfg, &plan));
    if (plan == NULL) continue;
    CHECK(plan->coalesce == mgb_values[i]);
    double best = 0;
    int32_t best_c = 0;
    for (int32_t c = 1; c <= plan->hardware.c_max; c++) {
      double fast = 0, plain = 0;
      CHECK_OK(tw_plan_predict(plan, c, mgb_values[i], &fast));
      CHECK_OK(tw__model_eval_plain(plan, c, &plain));
      CHECKF(fabs(fast - plain) <= 1e-9 * plain, "mgb %d C %d: fast %.12g, reference %.12g",
             mgb_values[i], c, fast, plain);
      if (best_c == 0 || fast < best) best = fast, best_c = c;
    }
    const best_cand b =
        plateau_walk(plan, (best_cand){best, best_c, mgb_values[i], plan->schedule});
    CHECK(plan->comm_ctas == b.c && plan->predicted_us == b.t);
    tw_plan_destroy(plan);
  }
}

/* More link bandwidth (or less latency) never increases any candidate's T. */
static void test_monotonic_in_link(void) {
  tw_hardware base, fast;
  CHECK_OK(tw_hardware_default(&base));
  for (int v = 0; v < 3; v++) {
    fast = base;
    if (v == 0) fast.link_cta_gbps *= 1.7;
    if (v == 1) fast.link_peak_gbps *= 2.5;
    if (v == 2) fast.link_latency_us *= 0.25;
    tw_plan_config c1 = TW_PLAN_CONFIG_INIT, c2 = TW_PLAN_CONFIG_INIT;
    c1.hardware = &base;
    c2.hardware = &fast;
    tw_plan_t p1 = NULL, p2 = NULL;
    CHECK_OK(make_plan("deepseek-v2-lite", 2, 4096, TW_ROUTER_MODERATE_SKEW, 77 + v, 1, &c1, &p1));
    CHECK_OK(make_plan("deepseek-v2-lite", 2, 4096, TW_ROUTER_MODERATE_SKEW, 77 + v, 1, &c2, &p2));
    if (p1 && p2) {
      for (int si = 0; si < 2; si++) /* the model chose the schedule: both are tabulated */
        for (int32_t c = 1; c <= base.c_max; c++)
          for (int j = 0; j < 3; j++) {
            double t1 = 0, t2 = 0;
            CHECK_OK(tw__model_predict(p1, scheds[si], c, mgbs[j], &t1));
            CHECK_OK(tw__model_predict(p2, scheds[si], c, mgbs[j], &t2));
            CHECKF(t2 <= t1 * (1 + 1e-12), "variant %d schedule %d C %d mgb %d: %.9g > %.9g", v,
                   scheds[si], c, mgbs[j], t2, t1);
          }
      CHECK(p2->predicted_us <= p1->predicted_us * (1 + 1e-12));
    }
    tw_plan_destroy(p1);
    tw_plan_destroy(p2);
  }
}

/* One rank: nothing is remote, so the plan takes no consumer SM (C = 0) and T is the compute end
 * on every SM + reduce: the full waves of P tiles last max(tau, P m), the last wave of r tiles
 * max(tau, r m), m the traffic per tile. */
static void test_real_plan_no_remote(void) {
  tw_plan_t plan = NULL;
  const int32_t tokens = 3000;
  CHECK_OK(make_plan("m-gpt", 1, tokens, TW_ROUTER_STRESS_SKEW, 5, 0, NULL, &plan));
  if (plan == NULL) return;
  const tw_hardware* hw = &plan->hardware;
  CHECK(plan->num_segments == 0 && plan->send_bytes == 0);
  const double c = 2.0 * plan->tm * plan->tn * plan->problem.ffn / (hw->tile_tflops * 1e6);
  const double f = hw->tile_floor_us * plan->tn / 128.0;
  const double tau = pow(pow(c, 4) + pow(f, 4), 0.25) + hw->tile_overhead_us;
  const double reduce =
      (double)tokens * (plan->problem.top_k + 1) * plan->problem.hidden * 2 / (hw->mem_gbps * 1e3);
  /* Memory: every expert with rows is one run (all bands are local, either schedule). */
  int64_t used = 0;
  for (int32_t e = 0; e < plan->local_experts; e++) used += plan->expert_real_rows[e] > 0;
  const double bytes = 2.0 * ((double)used * plan->problem.hidden * plan->problem.ffn +
                              (double)plan->rows * (plan->problem.hidden + plan->problem.ffn));
  const double m = bytes / (hw->mem_gbps * 1e3) / (double)plan->num_tiles;
  double want = 0;
  int32_t mixed = 0;
  for (int32_t cc = 0; cc <= hw->c_max; cc++) {
    const int64_t p = hw->occ_comp * (hw->sm_count - (cc + hw->occ_comm - 1) / hw->occ_comm);
    const int64_t tiles = plan->num_tiles, waves = (tiles + p - 1) / p;
    const int64_t last = tiles - (waves - 1) * p;
    const double end = (double)(waves - 1) * fmax(tau, (double)p * m) + fmax(tau, (double)last * m);
    if (cc == 0) want = end + reduce;
    mixed += waves > 1 && (double)p * m > tau && (double)last * m < tau;
  }
  /* The case the even spread priced wrong: memory-bound full waves, a compute-bound last one. */
  CHECKF(mixed > 0,
         "no C with memory-bound full waves and a compute-bound last wave (m %g, tau %g)", m, tau);
  CHECKF(plan->comm_ctas == 0, "chose C %d with nothing to send", plan->comm_ctas);
  CHECK_NEAR(plan->predicted_us, want, 1e-9 * want);
  tw_plan_destroy(plan);
}

/* Randomized: random machines (link rates, latency, tile speed, c_max, occupancies) and real
 * plans of every preset, router, rank count and rank. The decision (best-first search over
 * bounds, wave skipping) must pick the argmin of tw_plan_predict with the tie rules, for a free
 * choice and for each fixed mgb (1, 2, 4 and a random explicit one); and the prediction of every
 * (C, mgb) must equal the segment-by-segment reference. */
static uint64_t ep_rng_state = 0;
static uint64_t ep_rng(void) {
  return tw_test_rng_next(&ep_rng_state);
}
static double ep_uniform(double lo, double hi) {
  return lo + (hi - lo) * (double)(ep_rng() >> 11) / 9007199254740992.0;
}

static void test_random_hardware_equivalence(void) {
  const tw_router routers[3] = {TW_ROUTER_BALANCED, TW_ROUTER_MODERATE_SKEW, TW_ROUTER_STRESS_SKEW};
  ep_rng_state = tw_test_seed * 2654435761u + 1; /* the run's seed, TW_TEST_SEED to replay */
  int checked = 0;
  for (int iter = 0; iter < 100; iter++) {
    tw_hardware hw;
    CHECK_OK(tw_hardware_default(&hw));
    hw.link_cta_gbps = ep_uniform(4.0, 80.0);
    hw.link_peak_gbps = ep_uniform(50.0, 900.0);
    hw.link_latency_us = iter % 7 == 0 ? 0.0 : ep_uniform(0.05, 5.0);
    hw.tile_tflops = ep_uniform(1.0, 10.0);
    hw.tile_overhead_us = ep_uniform(0.0, 2.0);
    hw.tile_floor_us = iter % 4 == 0 ? 0.0 : ep_uniform(0.0, 12.0);
    hw.occ_comm = 1 + (int32_t)(ep_rng() % 2);
    hw.occ_comp = 1 + (int32_t)(ep_rng() % 2);
    hw.c_max = 1 + (int32_t)(ep_rng() % 48);
    hw.mem_gbps = iter % 5 == 0 ? ep_uniform(50.0, 400.0) : ep_uniform(400.0, 8000.0);
    /* Either side of "the weights stay in L2" (the tie rule between the schedules flips). */
    hw.l2_mib = iter % 3 == 0 ? 0.0 : ep_uniform(1.0, 1024.0);
    const int32_t schedule = (int32_t)(ep_rng() % 3); /* auto, remote-first, expert-major */
    const int p = (int)(ep_rng() % (uint64_t)tw_preset_count());
    const int32_t world = 1 << (ep_rng() % 4); /* 1, 2, 4, 8 */
    const int32_t tokens = 256 + (int32_t)(ep_rng() % 8192);
    const int32_t rank = (int32_t)(ep_rng() % (uint64_t)world);
    const tw_router router = routers[ep_rng() % 3];
    const uint64_t rseed = ep_rng();
    const int32_t odd_mgb = 3 + (int32_t)(ep_rng() % 30); /* explicit, outside {1, 2, 4} */
    for (int j = -1; j < 4; j++) {                        /* -1: free choice; else mgb fixed */
      const int32_t mgb = j < 0 ? 0 : j < 3 ? mgbs[j] : odd_mgb;
      tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
      cfg.hardware = &hw;
      cfg.coalesce = mgb;
      cfg.schedule = schedule;
      tw_plan_t plan = NULL;
      tw_status st = make_plan(tw_preset_name(p), world, tokens, router, rseed, rank, &cfg, &plan);
      if (st == TW_ERR_INDIVISIBLE) break;
      CHECK_OK(st);
      if (plan == NULL) break;
      char what[160];
      snprintf(what, sizeof what, "iter %d %s W %d rank %d tokens %d mgb %d schedule %d", iter,
               tw_preset_name(p), world, rank, tokens, cfg.coalesce, schedule);
      if (schedule != TW_SCHEDULE_AUTO) CHECK(plan->schedule == schedule);
      if (j < 0) {
        check_choice_is_argmin(plan, what, 0);
      } else {
        /* Fixed mgb (an odd one can have segments of up to 32 bands, where late waves
         * matter): argmin over C (and both schedules when the model chose), and every C
         * against the reference on these segments. */
        for (int32_t c = 1; c <= hw.c_max; c++) {
          double fast = 0, plain = 0;
          CHECK_OK(tw_plan_predict(plan, c, mgb, &fast));
          CHECK_OK(tw__model_eval_plain(plan, c, &plain));
          CHECKF(fabs(fast - plain) <= 1e-9 * plain, "%s C %d: fast %.12g, reference %.12g", what,
                 c, fast, plain);
        }
        const best_cand b = argmin_all(plan, &mgb, 1);
        const int32_t want_c = plan->num_remote_tiles == 0 ? 0 : b.c;
        CHECKF(
            plan->coalesce == mgb && plan->comm_ctas == want_c &&
                (want_c == 0 ? plan->predicted_us >= plan->gemm_us : plan->predicted_us == b.t) &&
                plan->schedule == b.schedule,
            "%s: chose C %d schedule %d T %.12g; argmin C %d schedule %d T %.12g", what,
            plan->comm_ctas, plan->schedule, plan->predicted_us, want_c, b.schedule, b.t);
      }
      tw_plan_destroy(plan);
      checked++;
    }
  }
  CHECKF(checked >= 100, "only %d plans were checked", checked);
}

/* Plans one rank of a custom shape (2 ranks, balanced top-2) with the given schedule. */
static tw_status custom_plan(int32_t hidden, int32_t ffn, int32_t experts, int32_t tokens,
                             int32_t schedule, uint64_t seed, tw_plan_t* plan) {
  tw_problem prob = tw_test_problem(2, hidden, ffn, experts, 2, tokens, 0, 0);
  tw_routing_t rt = NULL;
  tw_status st = tw_routing_generate(&prob, TW_ROUTER_BALANCED, 0.0, tokens, seed, &rt);
  if (st != TW_SUCCESS) return st;
  tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
  cfg.schedule = schedule;
  st = tw_plan_create(&prob, rt, 0, &cfg, plan);
  tw_routing_destroy(rt);
  return st;
}

/* Experts of the plan with both remote and local bands: the ones remote-first reads twice (an
 * expert whose local rows all fit in the band its remote rows end in has no local band). */
static int64_t split_experts(tw_plan_t plan) {
  int64_t n = 0;
  for (int32_t e = 0; e < plan->local_experts; e++)
    n += plan->expert_local_band0[e] > plan->expert_band0[e] &&
         plan->expert_band0[e + 1] > plan->expert_local_band0[e];
  return n;
}

/* Experts expert-major reads twice: its last two experts go remote, remote, local, local
 * (schedule.c), so one whose two parts have a non-empty part of the other between them. */
static int64_t expert_major_second_reads(tw_plan_t plan) {
  const int32_t E = plan->local_experts;
  if (E < 3) return 0;
  int32_t seq[4], n = 0;
  for (int part = 0; part < 2; part++)
    for (int32_t j = E - 2; j < E; j++) {
      const int32_t e = plan->expert_order[j];
      const int32_t b0 = part ? plan->expert_local_band0[e] : plan->expert_band0[e];
      const int32_t b1 = part ? plan->expert_band0[e + 1] : plan->expert_local_band0[e];
      if (b1 > b0) seq[n++] = e;
    }
  int64_t runs = 0, experts = 0;
  for (int32_t i = 0; i < n; i++) {
    runs += i == 0 || seq[i] != seq[i - 1];
    int first = 1;
    for (int32_t j = 0; j < i; j++) first &= seq[j] != seq[i];
    experts += first;
  }
  return runs - experts;
}

/* Weight-heavy: 64 local experts of H 4096 x F 2048 (16.8 MB of weights each) and about 256 rows
 * each (128 remote, 128 local: two or three bands), so the weights dominate the producer's traffic
 * and remote-first reads them twice (expert-major only its last two experts'). The
 * model must see it (GEMM and T both slower under remote-first) and choose expert-major. Then
 * compute-heavy: 2 local experts with 16384 rows each, where the weights are a rounding error
 * and the choice may go either way, but never to the slower prediction: the model's choice
 * equals the better of the two schedules planned explicitly, bit for bit. */
static void test_schedule_choice(void) {
  const uint64_t seed = tw_test_seed; /* the run's seed, TW_TEST_SEED to replay */
  tw_plan_t rf = NULL, em = NULL, au = NULL;
  CHECK_OK(custom_plan(4096, 2048, 128, 8192, TW_SCHEDULE_REMOTE_FIRST, seed, &rf));
  CHECK_OK(custom_plan(4096, 2048, 128, 8192, TW_SCHEDULE_EXPERT_MAJOR, seed, &em));
  CHECK_OK(custom_plan(4096, 2048, 128, 8192, TW_SCHEDULE_AUTO, seed, &au));
  if (rf && em && au) {
    const int64_t split = split_experts(rf);
    /* The scenario needs most experts split (a property of the seeded routing, not of the code:
     * seed 1796169304 gives 47 of 64, which still passes every check below). */
    CHECKF(split >= 32, "only %lld of 64 experts have remote and local rows", (long long)split);
    const double w = 4096.0 * 2048.0 * 2.0;
    double rf_bytes = 0, rf_refetch = 0, em_bytes = 0, em_refetch = -1;
    CHECK_OK(tw__model_traffic(rf, &rf_bytes, &rf_refetch));
    CHECK_OK(tw__model_traffic(em, &em_bytes, &em_refetch));
    const int64_t em_split = expert_major_second_reads(em);
    CHECKF(em_split <= 2, "expert-major reads %lld experts twice", (long long)em_split);
    CHECK_NEAR(rf_bytes - em_bytes, (double)(split - em_split) * w, 1.0);
    CHECK_NEAR(rf_refetch, (double)split * w, 1.0); /* the second reads are the difference */
    CHECK_NEAR(em_refetch, (double)em_split * w, 1.0);
    printf("  weight-heavy: GEMM %.1f us remote-first, %.1f us expert-major; T %.1f / %.1f us\n",
           rf->gemm_us, em->gemm_us, rf->predicted_us, em->predicted_us);
    CHECK(em->gemm_us < 0.8 * rf->gemm_us);
    CHECK(em->predicted_us < rf->predicted_us);
    CHECK(au->schedule == TW_SCHEDULE_EXPERT_MAJOR);
    CHECK(au->predicted_us == em->predicted_us && au->comm_ctas == em->comm_ctas &&
          au->coalesce == em->coalesce);
    check_choice_is_argmin(au, "weight-heavy", 1);
  }
  tw_plan_destroy(rf);
  tw_plan_destroy(em);
  tw_plan_destroy(au);
  rf = em = au = NULL;
  CHECK_OK(custom_plan(4096, 2048, 4, 16384, TW_SCHEDULE_REMOTE_FIRST, seed + 1, &rf));
  CHECK_OK(custom_plan(4096, 2048, 4, 16384, TW_SCHEDULE_EXPERT_MAJOR, seed + 1, &em));
  CHECK_OK(custom_plan(4096, 2048, 4, 16384, TW_SCHEDULE_AUTO, seed + 1, &au));
  if (rf && em && au) {
    printf("  compute-heavy: GEMM %.1f us remote-first, %.1f us expert-major; T %.1f / %.1f us\n",
           rf->gemm_us, em->gemm_us, rf->predicted_us, em->predicted_us);
    const tw_plan_t best = rf->predicted_us < em->predicted_us ? rf : em; /* ties: expert-major */
    CHECK(au->schedule == best->schedule && au->predicted_us == best->predicted_us);
    CHECK(au->comm_ctas == best->comm_ctas && au->coalesce == best->coalesce);
    /* Compute-bound: both GEMMs are the compute waves, remote-first's plus the exposed part of
     * its second read of the two experts' weights. */
    double bytes = 0, refetch = 0;
    CHECK_OK(tw__model_traffic(rf, &bytes, &refetch));
    CHECK_NEAR(refetch, 2.0 * 4096.0 * 2048.0 * 2.0, 1.0);
    const double exposed = rf->hardware.refetch_exposure * refetch / (rf->hardware.mem_gbps * 1e3);
    CHECK(exposed > 0.0);
    CHECK_NEAR(rf->gemm_us - em->gemm_us, exposed, 1e-9 * rf->gemm_us);
    check_choice_is_argmin(au, "compute-heavy", 0);
  }
  tw_plan_destroy(rf);
  tw_plan_destroy(em);
  tw_plan_destroy(au);
  /* On every preset the choice follows the model's rule over both schedules (the best candidate,
   * then the plateau walk on its schedule) and equals the plan fixed to the schedule it chose.
   * It need not have the lower T of the two fixed plans: each walks up its own plateau, so the
   * schedule with the lower minimum can end above the other's walked T (qwen, seed 1796100608:
   * 194.08 -> 195.98 us against remote-first's 195.01). */
  for (int p = 0; p < tw_preset_count(); p++) {
    tw_plan_config c1 = TW_PLAN_CONFIG_INIT, c2 = TW_PLAN_CONFIG_INIT, c3 = TW_PLAN_CONFIG_INIT;
    c1.schedule = TW_SCHEDULE_REMOTE_FIRST;
    c2.schedule = TW_SCHEDULE_EXPERT_MAJOR;
    tw_plan_t a = NULL, b = NULL, c = NULL;
    CHECK_OK(make_plan(tw_preset_name(p), 2, 4096, TW_ROUTER_MODERATE_SKEW, seed + p, 0, &c1, &a));
    CHECK_OK(make_plan(tw_preset_name(p), 2, 4096, TW_ROUTER_MODERATE_SKEW, seed + p, 0, &c2, &b));
    CHECK_OK(make_plan(tw_preset_name(p), 2, 4096, TW_ROUTER_MODERATE_SKEW, seed + p, 0, &c3, &c));
    if (a && b && c) {
      check_choice_is_argmin(c, tw_preset_name(p), 0);
      const tw_plan_t same = c->schedule == TW_SCHEDULE_REMOTE_FIRST ? a : b;
      CHECKF(c->predicted_us == same->predicted_us && c->comm_ctas == same->comm_ctas &&
                 c->coalesce == same->coalesce,
             "%s: chose schedule %d C %d mgb %d T %.9g; that schedule alone: C %d mgb %d T %.9g",
             tw_preset_name(p), c->schedule, c->comm_ctas, c->coalesce, c->predicted_us,
             same->comm_ctas, same->coalesce, same->predicted_us);
    }
    tw_plan_destroy(a);
    tw_plan_destroy(b);
    tw_plan_destroy(c);
  }
}

/* Granite's 16 local experts hold 16 MiB of weights: within half of the H200's 60 MiB L2, so
 * remote-first's second runs are no device-memory traffic and it wins the model's ties (the
 * measured case: dev/NOTES.md section 10); with a 16 MiB L2 the second reads count again. */
static void test_weights_in_l2(void) {
  const uint64_t seed = tw_test_seed;
  tw_hardware hw;
  CHECK_OK(tw_hardware_default(&hw));
  for (int small = 0; small < 2; small++) {
    hw.l2_mib = small ? 16.0 : 60.0;
    tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
    cfg.hardware = &hw;
    cfg.schedule = TW_SCHEDULE_REMOTE_FIRST;
    tw_plan_t rf = NULL;
    CHECK_OK(make_plan("granite-3.1-1b-a400m", 2, 4096, TW_ROUTER_BALANCED, seed, 0, &cfg, &rf));
    if (rf == NULL) return;
    double bytes = 0, refetch = -1;
    CHECK_OK(tw__model_traffic(rf, &bytes, &refetch));
    const double w = 2.0 * 1024.0 * 512.0; /* one expert's weights, bytes */
    const double a_c = 2.0 * (double)rf->rows * (512.0 + 1024.0);
    if (small) {
      CHECK(refetch >= w);                              /* an expert with both kinds of rows */
      CHECK_NEAR(bytes, a_c + 16.0 * w + refetch, 1.0); /* every second run from memory */
    } else {
      CHECK(refetch == 0.0);
      CHECK_NEAR(bytes, a_c + 16.0 * w, 1.0); /* each expert's weights once */
    }
    tw_plan_destroy(rf);
  }
  /* With the weights in L2 the model picks remote-first there (measured 2.4-7.2% faster). */
  hw.l2_mib = 60.0;
  for (int32_t tokens = 1024; tokens <= 16384; tokens *= 4) {
    tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
    cfg.hardware = &hw;
    tw_plan_t au = NULL;
    CHECK_OK(make_plan("granite-3.1-1b-a400m", 2, tokens, TW_ROUTER_BALANCED, seed, 0, &cfg, &au));
    if (au == NULL) return;
    CHECKF(au->schedule == TW_SCHEDULE_REMOTE_FIRST, "granite at %d tokens chose schedule %d",
           tokens, au->schedule);
    tw_plan_destroy(au);
  }
}

/* 64-row tiles: the model prices their compute at tile_m64_share of the 128-row rate. Measured on
 * 2 x H200 (bench/results/2026-11-30-run11-tile-m.md): at 8192 tokens/rank, K 2048, N 4096, 32 and
 * 64 experts the call took 1.24x and 1.19x as long with 64-row tiles; the default share must
 * predict them slower, and a share of 1 (the former model) predicts them at most a few percent
 * slower. */
static tw_status plan_grid_point(int32_t experts, int32_t tile_m, double share, double* us) {
  tw_problem prob = TW_PROBLEM_INIT;
  prob.world_size = 2, prob.hidden = 4096, prob.ffn = 2048, prob.experts = experts;
  prob.top_k = 2, prob.max_tokens = 8192, prob.tile_m = tile_m;
  tw_hardware hw;
  tw_status st = tw_hardware_default(&hw);
  if (st != TW_SUCCESS) return st;
  hw.tile_m64_share = share;
  tw_routing_t rt = NULL;
  st = tw_routing_generate(&prob, TW_ROUTER_BALANCED, 0.0, 8192, 1, &rt);
  if (st != TW_SUCCESS) return st;
  tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
  cfg.hardware = &hw;
  tw_plan_t plan = NULL;
  st = tw_plan_create(&prob, rt, 0, &cfg, &plan);
  tw_routing_destroy(rt);
  if (st == TW_SUCCESS) *us = plan->predicted_us;
  tw_plan_destroy(plan);
  return st;
}

static void test_tile_height_rate(void) {
  tw_hardware def;
  CHECK_OK(tw_hardware_default(&def));
  CHECK(def.tile_m64_share > 0.0 && def.tile_m64_share < 1.0);
  for (int32_t e = 32; e <= 64; e *= 2) {
    double t128 = 0, t64 = 0, t128_full = 0, t64_full = 0;
    CHECK_OK(plan_grid_point(e, 128, def.tile_m64_share, &t128));
    CHECK_OK(plan_grid_point(e, 64, def.tile_m64_share, &t64));
    CHECK_OK(plan_grid_point(e, 128, 1.0, &t128_full));
    CHECK_OK(plan_grid_point(e, 64, 1.0, &t64_full));
    CHECKF(t64 > t128, "E %d: 64-row tiles predicted %.1f us, 128-row %.1f (measured 1.19-1.24x)",
           e, t64, t128);
    CHECK_NEAR(t128, t128_full, 1e-9 * t128); /* the share prices 64-row tiles only */
    /* At the full rate the model misses the measured slowdown (within 5% of 128-row tiles,
     * faster before the tile groups): the share is what predicts it. */
    CHECKF(t64_full < 1.05 * t128_full && t64 > t64_full,
           "E %d: at the full rate 64-row tiles %.1f us, 128-row %.1f; at the share %.1f", e,
           t64_full, t128_full, t64);
  }
  /* Outside (0, 1] is an error naming the key. */
  tw_hardware hw = def;
  hw.tile_m64_share = 1.5;
  tw_problem prob = TW_PROBLEM_INIT;
  prob.world_size = 2, prob.hidden = 1024, prob.ffn = 512, prob.experts = 8, prob.top_k = 2;
  prob.max_tokens = 64;
  tw_routing_t rt = NULL;
  CHECK_OK(tw_routing_generate(&prob, TW_ROUTER_BALANCED, 0.0, 64, 1, &rt));
  tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
  cfg.hardware = &hw;
  tw_plan_t plan = NULL;
  CHECK_STATUS(tw_plan_create(&prob, rt, 0, &cfg, &plan), TW_ERR_INVALID_ARGUMENT);
  CHECK(strstr(tw_last_error(), "tile_m64_share") != NULL);
  hw.tile_m64_share = 0.0;
  CHECK_STATUS(tw_plan_create(&prob, rt, 0, &cfg, &plan), TW_ERR_INVALID_ARGUMENT);
  tw_routing_destroy(rt);
}

TW_TEST_MAIN(TW_TEST(tw_test_seed_setup), TW_TEST(test_hand_plan_table),
             TW_TEST(test_hand_plan_explicit_and_defaults), TW_TEST(test_hand_plan_no_remote),
             TW_TEST(test_hand_plan_memory_bound), TW_TEST(test_schedule_choice),
             TW_TEST(test_real_plans_argmin), TW_TEST(test_real_plans_explicit_and_off),
             TW_TEST(test_monotonic_in_link), TW_TEST(test_large_explicit_coalesce),
             TW_TEST(test_real_plan_no_remote), TW_TEST(test_random_hardware_equivalence),
             TW_TEST(test_weights_in_l2), TW_TEST(test_tile_height_rate))
