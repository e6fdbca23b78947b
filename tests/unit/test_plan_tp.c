/*
 * test_plan_tp.c: the TP x EP plan (tw_tp_plan_create), its description's refusals
 * (tw_parallel_validate) and the CPU reference of GEMM2 + GatherRS (tw__ref_tp_gemm2_gatherrs).
 *
 * For many random routings and (tp, ep) in {(1, W), (W, 1), (2, 2), (2, 4), (4, 2)}, W <= 8, every
 * rank's plan is checked against the routing: every (token, slot, F slice) contribution is
 * produced by exactly one rank, the TP sum of every (token, slot) row is made by exactly one rank
 * (its reducer, the owner itself when ep = 1), whose EP part sends it to the token's owner; the
 * tile list covers every (band, column tile) once, split by split; the GatherRS tiles cover the
 * reducer's block once. The plans, executed on the CPU, give the reference bit for bit, both
 * keyed by (owner, token, slot) and along the TP runtime's data path (where the GatherRS stores
 * each reduced row, tw__tp_plan_destinations, and the owners' slot rows); the
 * reference equals the EP reference at tp = 1 and a direct double sum within a rounding bound.
 */
#include <stdint.h>

#include "plan_tp.h"
#include "reference.h"
#include "tw_test.h"
#include "tw_test_random.h"

typedef struct cfg2 {
  int32_t tp, ep;
} cfg2;

static const cfg2 k_cfgs[] = {{1, 1}, {1, 2}, {2, 1}, {1, 4}, {4, 1},
                              {2, 2}, {1, 8}, {8, 1}, {2, 4}, {4, 2}};
#define NCFG ((int)(sizeof k_cfgs / sizeof k_cfgs[0]))

static tw_parallel par_of(int32_t tp, int32_t ep) {
  tw_parallel par = TW_PARALLEL_INIT;
  par.tp = tp;
  par.ep = ep;
  return par;
}

/* A random small problem for tp x ep ranks: experts a multiple of the world (routings need it),
 * F a multiple of 64 tp, H a few column tiles. */
static tw_problem random_problem(uint64_t* s, int32_t tp, int32_t ep) {
  const int32_t W = tp * ep;
  const int32_t tm = tw_test_rng_next(s) % 2 ? 64 : 128;
  const int32_t tn = tw_test_rng_next(s) % 2 ? 64 : 128;
  const int32_t H =
      tn * (1 + (int32_t)(tw_test_rng_next(s) % 4)) - 8 * (int32_t)(tw_test_rng_next(s) % 2);
  const int32_t E = W * (1 + (int32_t)(tw_test_rng_next(s) % 3));
  const int32_t K = 1 + (int32_t)(tw_test_rng_next(s) % (E < 4 ? E : 4));
  return tw_test_problem(W, H, 64 * tp, E, K, 300, tm, tn);
}

static tw_routing_t random_routing(uint64_t* s, const tw_problem* p) {
  int32_t tokens[TW_MAX_RANKS];
  for (int32_t r = 0; r < p->world_size; r++)
    tokens[r] = tw_test_rng_next(s) % 5 == 0 ? 0 : (int32_t)(tw_test_rng_next(s) % 300);
  return tw_test_random_routing(p, tokens, s, (int)(tw_test_rng_next(s) % 4 == 0));
}

/* Index of (owner, token, slot) in a flat (W, max_tokens, top_k) array. */
static size_t key(const tw_problem* p, int32_t o, int32_t t, int32_t j) {
  return ((size_t)o * p->max_tokens + t) * p->top_k + j;
}

/* The owner (world rank) the EP part of `pl` sends layout row i (inside its own block) to. */
static int32_t ep_dest(const struct tw_tp_plan* pl, int32_t i) {
  const struct tw_plan* ep = pl->ep_plan;
  const int32_t row = i - pl->block_row0[pl->tp_index];
  for (int32_t b = 0; b < ep->num_bands; b++) {
    const tw_band* bd = &ep->bands[b];
    if (row < bd->row0 || row >= bd->row0 + bd->rows) continue;
    const int32_t ep_owner = row - bd->row0 < bd->valid_rows ? bd->dest : pl->group;
    return ep_owner * pl->par.tp + pl->tp_index;
  }
  return -1;
}

static int64_t g_rows_planned = 0; /* over every plan test_invariants checked */

static void check_world(const tw_problem* p, const tw_parallel* par, tw_routing_t rt) {
  const int32_t W = p->world_size, tp = par->tp, K = p->top_k;
  tw_tp_plan_t pl[TW_MAX_RANKS] = {0};
  for (int32_t r = 0; r < W; r++) CHECK_OK(tw_tp_plan_create(p, par, rt, r, NULL, &pl[r]));
  for (int32_t r = 0; r < W; r++)
    if (pl[r] == NULL) goto done;
  const size_t nkey = (size_t)W * p->max_tokens * K;
  int32_t* produced = calloc(nkey * (size_t)tp, sizeof(int32_t)); /* (key, q) */
  int32_t* reduced = calloc(nkey, sizeof(int32_t));
  int32_t* reducer = malloc(nkey * sizeof(int32_t));
  for (int32_t r = 0; r < W; r++) {
    const struct tw_tp_plan* x = pl[r];
    const int32_t g = r / tp, q = r % tp;
    CHECK(x->group == g && x->tp_index == q && x->par.ep == W / tp);
    /* The layout is the same on every TP rank of the group. */
    const struct tw_tp_plan* first = pl[g * tp];
    CHECK(x->rows == first->rows);
    if (x->rows == first->rows)
      CHECK(memcmp(x->row_src, first->row_src, (size_t)x->rows * sizeof *x->row_src) == 0);
    const int32_t R0 = x->block_row0[q], R1 = x->block_row0[q + 1];
    g_rows_planned += x->rows;
    for (int32_t i = 0; i < x->rows; i++) {
      const tw_row_src s = x->row_src[i];
      if (s.owner < 0) continue;
      const int32_t e = rt->expert_ids[s.owner][(size_t)s.token * K + s.slot];
      /* The row's expert is this group's, its owner of the block's TP index. */
      CHECKF(e / x->local_experts == g && e % x->local_experts == x->row_expert[i],
             "rank %d row %d: expert %d", r, i, e);
      int32_t blkq = 0;
      while (i >= x->block_row0[blkq + 1]) blkq++;
      CHECK(s.owner % tp == blkq);
      produced[key(p, s.owner, s.token, s.slot) * tp + q]++;
      if (i >= R0 && i < R1) {
        reduced[key(p, s.owner, s.token, s.slot)]++;
        reducer[key(p, s.owner, s.token, s.slot)] = r;
        CHECKF(ep_dest(x, i) == s.owner, "rank %d row %d goes to %d, owner %d", r, i, ep_dest(x, i),
               s.owner);
      }
    }
    /* Tiles: every (band, column tile) once, split by split, ready counts cumulative. */
    CHECK(x->num_tiles == x->num_bands * x->col_tiles);
    int32_t* seen = calloc((size_t)x->num_tiles + 1, sizeof(int32_t));
    int64_t wcomp = 0;
    for (int32_t b = 0; b < x->num_bands; b++)
      CHECK(x->bands[b].rows >= 1 && x->bands[b].rows <= x->tm);
    for (int32_t qq = 0; qq < tp; qq++)
      for (int32_t e = 0; e < x->local_experts; e++) {
        int64_t n = 0;
        for (int32_t i = x->block_row0[qq]; i < x->block_row0[qq + 1]; i++)
          n += x->row_expert[i] == e;
        wcomp += (n + x->tm - 1) / x->tm;
      }
    wcomp *= x->split_tiles;
    for (int32_t sidx = 0; sidx < x->num_segments; sidx++) {
      const tw_tp_segment* sg = &x->segments[sidx];
      CHECK(sg->ntiles == wcomp && sg->ready_tiles == (sidx + 1) * wcomp);
      for (int32_t t = sg->tile0; t < sg->tile0 + sg->ntiles; t++) {
        const tw_tile* tl = &x->tiles[t];
        CHECK(tl->col0 >= sg->col0 && tl->col0 < sg->col0 + sg->cols);
        CHECK(tl->row0 == x->bands[tl->band].row0 && tl->expert == x->bands[tl->band].expert);
        seen[(size_t)tl->band * x->col_tiles + tl->col0 / x->tn]++;
      }
    }
    int bad = 0;
    for (int32_t t = 0; t < x->num_tiles; t++) bad += seen[t] != 1;
    CHECKF(bad == 0, "rank %d: %d (band, column tile) pairs not computed exactly once", r, bad);
    free(seen);
    /* GatherRS tiles cover the block x hidden once. */
    int32_t* cover = calloc((size_t)(R1 - R0) * p->hidden + 1, sizeof(int32_t));
    for (int32_t c = 0; c < x->num_comm_tiles; c++) {
      const tw_tp_comm_tile* ct = &x->comm_tiles[c];
      const tw_tp_segment* sg = &x->segments[ct->split];
      CHECK(ct->col0 >= sg->col0 && ct->col0 + ct->cols <= sg->col0 + sg->cols);
      for (int32_t i = ct->row0; i < ct->row0 + ct->rows; i++)
        for (int32_t n = ct->col0; n < ct->col0 + ct->cols; n++)
          cover[(size_t)(i - R0) * p->hidden + n]++;
    }
    bad = 0;
    for (size_t i = 0; i < (size_t)(R1 - R0) * p->hidden; i++) bad += cover[i] != 1;
    CHECKF(bad == 0, "rank %d: %d block elements not reduced exactly once", r, bad);
    free(cover);
    /* The model's C: none without a TP sum, else one of the candidates. */
    tw_tp_plan_summary sm = TW_TP_PLAN_SUMMARY_INIT;
    CHECK_OK(tw_tp_plan_summary_get(pl[r], &sm));
    CHECK(sm.tiles_per_split == wcomp && sm.reduce_rows == R1 - R0);
    if (tp == 1 || x->rows == 0)
      CHECK(sm.tp_comm_ctas == 0);
    else
      CHECK(sm.tp_comm_ctas >= 1 && sm.tp_comm_ctas <= x->hw.c_max && sm.tp_predicted_us > 0.0);
  }
  /* Every contribution produced once per F slice, TP-reduced once, by the owner's TP peer in the
   * expert's group (the owner itself when ep = 1). */
  int bad_p = 0, bad_r = 0;
  for (int32_t o = 0; o < W; o++)
    for (int32_t t = 0; t < rt->tokens[o]; t++)
      for (int32_t j = 0; j < K; j++) {
        const size_t k = key(p, o, t, j);
        for (int32_t q = 0; q < tp; q++) bad_p += produced[k * tp + q] != 1;
        const int32_t g = rt->expert_ids[o][(size_t)t * K + j] / (p->experts / (W / tp));
        bad_r += reduced[k] != 1 || reducer[k] != g * tp + o % tp;
        if (W / tp == 1) bad_r += reducer[k] != o;
      }
  CHECKF(bad_p == 0 && bad_r == 0,
         "tp %d ep %d: %d contributions not produced once, %d rows not "
         "reduced once at the right rank",
         tp, W / tp, bad_p, bad_r);
  /* tp = 1: the plan is the EP plan. */
  if (tp == 1)
    for (int32_t r = 0; r < W; r++) {
      tw_plan_t ep = NULL;
      CHECK_OK(tw_plan_create(p, rt, r, NULL, &ep));
      if (ep == NULL) continue;
      CHECK(ep->rows == pl[r]->rows);
      if (ep->rows == pl[r]->rows)
        CHECK(memcmp(ep->row_src, pl[r]->row_src, (size_t)ep->rows * sizeof *ep->row_src) == 0);
      tw_plan_summary a, b;
      CHECK_OK(tw_plan_summary_get(ep, &a));
      CHECK_OK(tw_plan_summary_get(pl[r]->ep_plan, &b));
      CHECK(a.comm_ctas == b.comm_ctas && a.coalesce == b.coalesce && a.send_bytes == b.send_bytes);
      tw_plan_destroy(ep);
    }
  free(produced);
  free(reduced);
  free(reducer);
done:
  for (int32_t r = 0; r < W; r++) tw_tp_plan_destroy(pl[r]);
}

static void test_invariants(void) {
  uint64_t s = tw_test_seed ^ 0x7070;
  for (int iter = 0; iter < 20; iter++)
    for (int c = 0; c < NCFG; c++) {
      tw_problem p = random_problem(&s, k_cfgs[c].tp, k_cfgs[c].ep);
      tw_parallel par = par_of(k_cfgs[c].tp, k_cfgs[c].ep);
      CHECK_OK(tw_parallel_validate(&p, &par));
      tw_routing_t rt = random_routing(&s, &p);
      if (rt == NULL) continue;
      check_world(&p, &par, rt);
      tw_routing_destroy(rt);
    }
  printf("  %lld rows planned over %d worlds\n", (long long)g_rows_planned, 20 * NCFG);
  CHECK(g_rows_planned > 0);
}

/* Every rank's partial sums of its layout rows over its F slice (padding rows zero), in the
 * reference's order; part[r] is (rows of rank r, hidden). */
static void tp_partials(const tw_problem* p, const tw_parallel* par, tw_tp_plan_t* pl,
                        int partial_bf16, const float* const* h, const float* w2, float** part) {
  const int32_t W = p->world_size, tp = par->tp, H = p->hidden, F = p->ffn, K = p->top_k;
  const int32_t S = F / tp;
  for (int32_t r = 0; r < W; r++) {
    const struct tw_tp_plan* x = pl[r];
    part[r] = calloc((size_t)x->rows * H + 1, sizeof(float));
    const int32_t q = x->tp_index;
    for (int32_t i = 0; i < x->rows; i++) {
      const tw_row_src sr = x->row_src[i];
      if (sr.owner < 0) continue; /* padding rows are zero */
      const int32_t e = x->group * x->local_experts + x->row_expert[i];
      const float* hv = h[sr.owner] + ((size_t)sr.token * K + sr.slot) * F;
      for (int32_t n = 0; n < H; n++) {
        const float* wn = w2 + ((size_t)e * H + n) * F;
        float acc = 0.0f;
        for (int32_t f = q * S; f < (q + 1) * S; f++) acc += hv[f] * wn[f];
        if (partial_bf16) acc = tw__ref_bf16_to_f32(tw__ref_f32_to_bf16(acc));
        part[r][(size_t)i * H + n] = acc;
      }
    }
  }
}

/* Runs the plans on the CPU in the reference's arithmetic: each rank's partials of its layout
 * rows over its F slice, each reducer's sum over its TP peers of its block, in TP order, then at
 * each owner the weighted sum of its slots' reduced rows, found through the reducers' blocks. */
static void plan_exec(const tw_problem* p, const tw_parallel* par, tw_routing_t rt,
                      tw_tp_plan_t* pl, int partial_bf16, const float* const* h, const float* w2,
                      uint16_t* const* out) {
  const int32_t W = p->world_size, tp = par->tp, H = p->hidden, K = p->top_k;
  float* part[TW_MAX_RANKS];
  tp_partials(p, par, pl, partial_bf16, h, w2, part);
  const size_t nkey = (size_t)W * p->max_tokens * K;
  float* y = calloc(nkey * (size_t)H + 1, sizeof(float));
  for (int32_t r = 0; r < W; r++) {
    const struct tw_tp_plan* x = pl[r];
    for (int32_t i = x->block_row0[x->tp_index]; i < x->block_row0[x->tp_index + 1]; i++) {
      const tw_row_src sr = x->row_src[i];
      if (sr.owner < 0) continue;
      float* dst = y + key(p, sr.owner, sr.token, sr.slot) * H;
      for (int32_t n = 0; n < H; n++) {
        float acc = 0.0f;
        for (int32_t qq = 0; qq < tp; qq++) {
          const float v = part[x->group * tp + qq][(size_t)i * H + n];
          acc = qq == 0 ? v : acc + v;
        }
        dst[n] = acc;
      }
    }
  }
  for (int32_t o = 0; o < W; o++)
    for (int32_t t = 0; t < rt->tokens[o]; t++)
      for (int32_t n = 0; n < H; n++) {
        float acc = 0.0f;
        for (int32_t j = 0; j < K; j++)
          acc += rt->weights[o][(size_t)t * K + j] * y[key(p, o, t, j) * H + n];
        out[o][(size_t)t * H + n] = tw__ref_f32_to_bf16(acc);
      }
  for (int32_t r = 0; r < W; r++) free(part[r]);
  free(y);
}

/* The TP runtime's data path on the CPU (tp_context.cu, gatherrs.cu, then reduce.cu): every
 * reducer stores the TP sum of each row of its block where tw__tp_plan_destinations says, into
 * the owner's receive rows or its own local rows, and every owner sums its slots through its EP
 * plan's slot_row (receive rows below recv_rows, local rows above). The reduced rows are kept in
 * fp32 here (the kernel rounds them to bf16), so the result must be the reference's bit for bit.
 * Also checked: no receive row is written twice, and no slot reads a row nobody wrote. */
static void runtime_exec(const tw_problem* p, const tw_parallel* par, tw_routing_t rt,
                         tw_tp_plan_t* pl, int partial_bf16, const float* const* h, const float* w2,
                         uint16_t* const* out) {
  const int32_t W = p->world_size, tp = par->tp, H = p->hidden, K = p->top_k;
  const int64_t recv_max = (int64_t)p->max_tokens * K;
  float* part[TW_MAX_RANKS];
  float *recv[TW_MAX_RANKS], *local[TW_MAX_RANKS];
  int32_t* writes[TW_MAX_RANKS];
  tp_partials(p, par, pl, partial_bf16, h, w2, part);
  for (int32_t r = 0; r < W; r++) {
    recv[r] = malloc(((size_t)recv_max * H + 1) * sizeof(float));
    local[r] = malloc(((size_t)pl[r]->ep_plan->rows * H + 1) * sizeof(float));
    writes[r] = calloc((size_t)recv_max + 1, sizeof(int32_t));
    for (size_t i = 0; i < (size_t)recv_max * H; i++) recv[r][i] = NAN;
    for (size_t i = 0; i < (size_t)pl[r]->ep_plan->rows * H; i++) local[r][i] = NAN;
  }
  int bad = 0;
  for (int32_t r = 0; r < W; r++) {
    const struct tw_tp_plan* x = pl[r];
    const int32_t R0 = x->block_row0[x->tp_index], n = x->block_row0[x->tp_index + 1] - R0;
    int32_t* dst = malloc(((size_t)n + 1) * 2 * sizeof(int32_t));
    CHECK_OK(tw__tp_plan_destinations(x, recv_max, dst, dst + n));
    for (int32_t i = 0; i < n; i++) {
      const int32_t owner = dst[i], row = dst[n + i];
      if (owner < 0) continue;
      bad += owner != x->row_src[R0 + i].owner;
      float* to = owner == r ? local[r] + (size_t)row * H : recv[owner] + (size_t)row * H;
      if (owner != r) bad += writes[owner][row]++ != 0;
      for (int32_t c = 0; c < H; c++) {
        float acc = 0.0f;
        for (int32_t qq = 0; qq < tp; qq++) {
          const float v = part[x->group * tp + qq][(size_t)(R0 + i) * H + c];
          acc = qq == 0 ? v : acc + v;
        }
        to[c] = acc;
      }
    }
    free(dst);
  }
  CHECKF(bad == 0, "tp %d: %d rows sent to the wrong owner or written twice", tp, bad);
  for (int32_t o = 0; o < W; o++) {
    const struct tw_plan* ep = pl[o]->ep_plan;
    for (int32_t t = 0; t < rt->tokens[o]; t++)
      for (int32_t c = 0; c < H; c++) {
        float acc = 0.0f;
        for (int32_t j = 0; j < K; j++) {
          const int32_t row = ep->slot_row[(size_t)t * K + j];
          const float v = row < ep->recv_rows ? recv[o][(size_t)row * H + c]
                                              : local[o][(size_t)(row - ep->recv_rows) * H + c];
          acc += rt->weights[o][(size_t)t * K + j] * v;
        }
        out[o][(size_t)t * H + c] = tw__ref_f32_to_bf16(acc);
      }
  }
  for (int32_t r = 0; r < W; r++) {
    free(part[r]);
    free(recv[r]);
    free(local[r]);
    free(writes[r]);
  }
}

static void test_reference(void) {
  uint64_t s = tw_test_seed ^ 0x5151;
  for (int iter = 0; iter < 2; iter++)
    for (int c = 0; c < NCFG; c++) {
      const int32_t tp = k_cfgs[c].tp, ep = k_cfgs[c].ep, W = tp * ep;
      tw_problem p = random_problem(&s, tp, ep);
      p.hidden = 64 + 64 * (iter % 2);
      p.tile_n = 64;
      p.max_tokens = 24;
      tw_parallel par = par_of(tp, ep);
      int32_t tokens[TW_MAX_RANKS];
      for (int32_t r = 0; r < W; r++) tokens[r] = (int32_t)(tw_test_rng_next(&s) % 25);
      tw_routing_t rt = tw_test_random_routing(&p, tokens, &s, 0);
      if (rt == NULL) continue;
      const int32_t H = p.hidden, F = p.ffn, K = p.top_k, E = p.experts;
      float* w2 = malloc(sizeof(float) * (size_t)E * H * F);
      for (size_t i = 0; i < (size_t)E * H * F; i++) w2[i] = tw_test_rng_sym(&s);
      float *h[TW_MAX_RANKS], *ref32[TW_MAX_RANKS];
      uint16_t *out[TW_MAX_RANKS], *out2[TW_MAX_RANKS], *out3[TW_MAX_RANKS];
      double *exact[TW_MAX_RANKS], *mag[TW_MAX_RANKS];
      for (int32_t r = 0; r < W; r++) {
        const size_t n = (size_t)tokens[r] * H + 1;
        h[r] = malloc(sizeof(float) * ((size_t)tokens[r] * K * F + 1));
        for (size_t i = 0; i < (size_t)tokens[r] * K * F; i++) h[r][i] = tw_test_rng_sym(&s);
        ref32[r] = malloc(sizeof(float) * n);
        out[r] = malloc(sizeof(uint16_t) * n);
        out2[r] = malloc(sizeof(uint16_t) * n);
        out3[r] = malloc(sizeof(uint16_t) * n);
        exact[r] = malloc(sizeof(double) * n);
        mag[r] = malloc(sizeof(double) * n);
      }
      tw_tp_plan_t pl[TW_MAX_RANKS] = {0};
      int planned = 1;
      for (int32_t r = 0; r < W; r++) {
        CHECK_OK(tw_tp_plan_create(&p, &par, rt, r, NULL, &pl[r]));
        planned &= pl[r] != NULL;
      }
      CHECK_OK(tw__ref_gemm2_combine(rt, (const float* const*)h, w2, exact, mag));
      CHECK_OK(tw__ref_gemm2_combine_f32(rt, (const float* const*)h, w2, ref32));
      for (int pb = 0; pb < 2; pb++) {
        for (int32_t r = 0; r < W; r++)
          for (size_t i = 0; i < (size_t)tokens[r] * H; i++) out[r][i] = out2[r][i] = 0x7fc1;
        CHECK_OK(tw__ref_tp_gemm2_gatherrs(rt, tp, pb, (const float* const*)h, w2, out));
        int bad_ep = 0, bad_exact = 0, bad_plan = 0;
        if (planned) plan_exec(&p, &par, rt, pl, pb, (const float* const*)h, w2, out2);
        int bad_runtime = 0;
        if (planned) {
          runtime_exec(&p, &par, rt, pl, pb, (const float* const*)h, w2, out3);
          for (int32_t r = 0; r < W; r++)
            for (size_t i = 0; i < (size_t)tokens[r] * H; i++)
              bad_runtime += out3[r][i] != out[r][i];
        }
        CHECKF(bad_runtime == 0,
               "tp %d ep %d bf16 partials %d: the runtime's data path gives %d values other than "
               "the reference",
               tp, ep, pb, bad_runtime);
        for (int32_t r = 0; r < W; r++)
          for (size_t i = 0; i < (size_t)tokens[r] * H; i++) {
            const double v = tw__ref_bf16_to_f32(out[r][i]);
            /* One bf16 rounding of the result, fp32 sums, and (pb) a bf16 rounding per partial. */
            const double tol =
                ldexp(fabs(exact[r][i]), -8) + (pb ? ldexp(mag[r][i], -8) : 0.0) + 1e-5 * mag[r][i];
            bad_exact += !(fabs(v - exact[r][i]) <= tol);
            if (tp == 1 && !pb) bad_ep += out[r][i] != tw__ref_f32_to_bf16(ref32[r][i]);
            if (planned) bad_plan += out2[r][i] != out[r][i];
          }
        CHECKF(bad_exact == 0, "tp %d ep %d bf16 partials %d: %d values off the double sum", tp, ep,
               pb, bad_exact);
        CHECKF(bad_ep == 0, "tp 1 ep %d: %d values differ from the EP reference", ep, bad_ep);
        CHECKF(bad_plan == 0,
               "tp %d ep %d bf16 partials %d: the plans give %d values other than "
               "the reference",
               tp, ep, pb, bad_plan);
      }
      for (int32_t r = 0; r < W; r++) {
        tw_tp_plan_destroy(pl[r]);
        free(h[r]);
        free(ref32[r]);
        free(out[r]);
        free(out2[r]);
        free(out3[r]);
        free(exact[r]);
        free(mag[r]);
      }
      free(w2);
      tw_routing_destroy(rt);
    }
}

static void test_refusals(void) {
  tw_problem p = tw_test_problem(4, 2048, 1408, 64, 6, 1024, 0, 0); /* deepseek-v2-lite */
  tw_parallel par = par_of(2, 2);
  CHECK_OK(tw_parallel_validate(&p, &par));
  CHECK_STATUS(tw_parallel_validate(NULL, &par), TW_ERR_NULL_POINTER);
  CHECK_STATUS(tw_parallel_validate(&p, NULL), TW_ERR_NULL_POINTER);
  par.magic = 0;
  CHECK_STATUS(tw_parallel_validate(&p, &par), TW_ERR_CONFIG_VERSION);
  par = par_of(2, 3); /* 2 x 3 != 4 */
  CHECK_STATUS(tw_parallel_validate(&p, &par), TW_ERR_INVALID_SIZE);
  par = par_of(0, 4);
  CHECK_STATUS(tw_parallel_validate(&p, &par), TW_ERR_INVALID_SIZE);
  par = par_of(16, 0); /* more than one NVLink domain */
  p.world_size = 16;
  CHECK_STATUS(tw_parallel_validate(&p, &par), TW_ERR_UNSUPPORTED);
  p.world_size = 6;
  par = par_of(4, 0); /* 6 is not a multiple of 4 */
  CHECK_STATUS(tw_parallel_validate(&p, &par), TW_ERR_INVALID_SIZE);
  par = par_of(2, 0); /* ep = 3 does not divide 64 experts */
  CHECK_STATUS(tw_parallel_validate(&p, &par), TW_ERR_INDIVISIBLE);
  p.world_size = 4;
  par = par_of(1, -1);
  CHECK_STATUS(tw_parallel_validate(&p, &par), TW_ERR_INVALID_SIZE);
  par = par_of(4, 1); /* 1408 / 4 = 352: not a multiple of 64 */
  CHECK_STATUS(tw_parallel_validate(&p, &par), TW_ERR_ALIGNMENT);
  CHECK(strstr(tw_last_error(), "tp in {1, 2}") != NULL);
  par = par_of(2, 2);
  par.splits = 3; /* 8 column tiles of 256 */
  CHECK_STATUS(tw_parallel_validate(&p, &par), TW_ERR_INVALID_ARGUMENT);
  par.splits = 8;
  CHECK_OK(tw_parallel_validate(&p, &par));
  par.splits = 0;
  par.comm_tile_n = 100;
  CHECK_STATUS(tw_parallel_validate(&p, &par), TW_ERR_INVALID_ARGUMENT);
  par.comm_tile_n = 0;
  par.comm_tile_m = -2;
  CHECK_STATUS(tw_parallel_validate(&p, &par), TW_ERR_INVALID_ARGUMENT);
  par = par_of(2, 2);
  tw_problem bad = p;
  bad.top_k = 0; /* the problem's own checks still apply */
  CHECK_STATUS(tw_parallel_validate(&bad, &par), TW_ERR_TOPK_RANGE);

  /* Plans: a routing of another world, a rank out of range, the add dataflow with tp > 1. */
  uint64_t s = tw_test_seed ^ 0x3131;
  tw_problem small = tw_test_problem(4, 256, 256, 8, 2, 64, 0, 0);
  int32_t tokens[4] = {10, 20, 0, 5};
  tw_routing_t rt = tw_test_random_routing(&small, tokens, &s, 0);
  tw_tp_plan_t pl = NULL;
  CHECK_STATUS(tw_tp_plan_create(&small, &par, rt, 4, NULL, &pl), TW_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(tw_tp_plan_create(&small, &par, NULL, 0, NULL, &pl), TW_ERR_NULL_POINTER);
  tw_problem other = small;
  other.top_k = 3;
  CHECK_STATUS(tw_tp_plan_create(&other, &par, rt, 0, NULL, &pl), TW_ERR_INVALID_ARGUMENT);
  tw_plan_config cfg = TW_PLAN_CONFIG_INIT;
  cfg.dataflow = TW_DATAFLOW_ADD;
  CHECK_STATUS(tw_tp_plan_create(&small, &par, rt, 0, &cfg, &pl), TW_ERR_UNSUPPORTED);
  CHECK(pl == NULL);
  tw_parallel ep_only = par_of(1, 4);
  CHECK_OK(tw_tp_plan_create(&small, &ep_only, rt, 0, &cfg, &pl)); /* tp = 1: the EP plan's */
  tw_tp_plan_summary sm = TW_TP_PLAN_SUMMARY_INIT;
  sm.version = 99;
  CHECK_STATUS(tw_tp_plan_summary_get(pl, &sm), TW_ERR_CONFIG_VERSION);
  tw_tp_plan_destroy(pl);
  CHECK_OK(tw_tp_plan_destroy(NULL));
  /* The config's SM budget holds for the TP model too (its P and c_max). */
  tw_plan_config budget = TW_PLAN_CONFIG_INIT;
  budget.sm_budget = 20;
  CHECK_OK(tw_tp_plan_create(&small, &par, rt, 1, &budget, &pl));
  if (pl != NULL) CHECK(pl->hw.sm_count == 20 && pl->hw.c_max <= 19 * pl->hw.occ_comm);
  tw_tp_plan_destroy(pl);
  tw_routing_destroy(rt);
}

/* The plan's C is tw_tp_select's on the workload the documentation gives (ep = 1: M = every
 * token of the world, D = tp, one group per (block, expert)), on the H200 description. */
static void test_model_choice(void) {
  uint64_t s = tw_test_seed ^ 0x9191;
  tw_problem p = tw_test_problem(4, 2048, 1408, 64, 6, 4096, 0, 0);
  tw_routing_t rt = NULL;
  CHECK_OK(tw_routing_generate(&p, TW_ROUTER_MODERATE_SKEW, 0.0, 4096, tw_test_rng_next(&s), &rt));
  const cfg2 cf[3] = {{2, 2}, {2, 1}, {4, 1}};
  for (int c = 0; c < 3; c++) {
    tw_problem q = p;
    q.world_size = cf[c].tp * cf[c].ep;
    if (cf[c].tp == 4) q.ffn = 1536; /* 1408 / 4 is refused (test_refusals) */
    tw_routing_t r2 = rt;
    if (q.world_size != p.world_size)
      CHECK_OK(tw_routing_generate(&q, TW_ROUTER_BALANCED, 0.0, 4096, 7, &r2));
    tw_parallel par = par_of(cf[c].tp, cf[c].ep);
    tw_tp_plan_t pl = NULL;
    CHECK_OK(tw_tp_plan_create(&q, &par, r2, 1, NULL, &pl));
    if (pl != NULL) {
      int64_t rows[64];
      for (int32_t b = 0; b < pl->par.tp; b++)
        for (int32_t e = 0; e < pl->local_experts; e++) {
          int64_t n = 0;
          for (int32_t i = pl->block_row0[b]; i < pl->block_row0[b + 1]; i++)
            n += pl->row_expert[i] == e;
          rows[b * pl->local_experts + e] = n;
        }
      tw_tp_workload w = {0};
      int64_t m = 0;
      for (int32_t r = 0; r < q.world_size; r++) m += r2->tokens[r];
      const int64_t red = pl->block_row0[pl->tp_index + 1] - pl->block_row0[pl->tp_index];
      w.m = pl->par.ep == 1 ? m : red * pl->par.tp;
      w.n = q.hidden;
      w.k = q.ffn / pl->par.tp;
      w.splits = pl->par.splits;
      w.ranks = pl->par.tp;
      w.experts = pl->par.tp * pl->local_experts;
      w.expert_rows = rows;
      w.tm = pl->tm;
      w.tn = pl->tn;
      w.tm_comm = TW_TP_DEFAULT_COMM_TILE_M;
      w.tn_comm = TW_TP_DEFAULT_COMM_TILE_N;
      int32_t best = 0;
      double t[TW_MAX_COMM_CTAS * 4];
      CHECK_OK(tw_tp_select(&w, &pl->hw, &best, t));
      tw_tp_plan_summary sm = TW_TP_PLAN_SUMMARY_INIT;
      CHECK_OK(tw_tp_plan_summary_get(pl, &sm));
      CHECKF(sm.tp_comm_ctas == best && sm.tp_predicted_waves == t[best - 1],
             "tp %d ep %d: plan C %d T %g, tw_tp_select C %d T %g", cf[c].tp, cf[c].ep,
             sm.tp_comm_ctas, sm.tp_predicted_waves, best, t[best - 1]);
      CHECK(sm.splits == TW_TP_DEFAULT_SPLITS && sm.ffn_slice == w.k);
      CHECK((cf[c].ep == 1) == (sm.ep_send_bytes == 0));
    }
    tw_tp_plan_destroy(pl);
    if (r2 != rt) tw_routing_destroy(r2);
  }
  tw_routing_destroy(rt);
}

TW_TEST_MAIN(TW_TEST(tw_test_seed_setup), TW_TEST(test_invariants), TW_TEST(test_reference),
             TW_TEST(test_refusals), TW_TEST(test_model_choice))
