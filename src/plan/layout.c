/*
 * layout.c: builds one rank's plan from a routing: the remote-owner-aligned row layout of its
 * local experts, the tile schedule (remote-first or expert-major), the combine plan (band
 * destinations and receive offsets), the receive-side map of its own tokens, and the transfer
 * segments.
 *
 * The rules (second paper, Algorithm 1, with the choices fixed in plan.h and DESIGN.md):
 *  - layout: expert e's rows are grouped by owner in the order (r+1)%W, ..., (r+W-1)%W, then r
 *    itself; each remote group but the last is padded with zero rows to a multiple of TM so that
 *    the rows every TM-row band (counted from the expert's first row) sends go to one owner; the
 *    last remote group and the local group share the band where one ends and the other begins:
 *    that band sends its first rows (the remote group's tail) and keeps the rest, which the owner's
 *    reduction reads in place like every local row. So no band ever sends to two ranks, and with
 *    two ranks nothing is padded (the paper pads every remote group; the shared band saves an
 *    expert's tile row whenever its two tails fit in one band). Within a group rows are in
 *    (token, slot) order; experts follow each other in index order. Starting each rank's owner
 *    cycle at r+1 spreads the first transfers of different ranks over different destinations.
 *  - schedule: experts sorted by remote band count (descending, ties by index), then either
 *    remote-first (the second paper's: every remote band's column tiles, expert by expert, then
 *    every local band's tiles, same expert order) or expert-major (expert by expert, each its
 *    remote bands, groups in layout order, then its local bands; with three experts or more the
 *    last two go remote, remote, local, local, so that the last remote bands are ready one
 *    expert's local bands before the end, which the consumer needs to send them: run 56, 1-1.4%
 *    off the calls where its tail was longest, for a second read of those two experts' weights).
 *    Remote-first starts the transfers earliest; expert-major reads each expert's weights in one
 *    pass (but the last two's) where remote-first reads those of every expert with remote and
 *    local rows twice, once per pass. Both are permutations of the bands in layout order (kept
 *    in layout_bands), so the model can try both on one layout (tw__plan_set_schedule). Either
 *    way a group's bands are consecutive in the schedule, which is what a segment needs. The
 *    tiles follow the bands in groups of up to tile_group bands of one expert (and, under
 *    remote-first, one destination), column by column (TW_TILE_GROUP_DEFAULT).
 *  - receive side at owner o: rows by source rank s (ascending, s != o), then s's local experts
 *    in index order, then (token, slot) order, dense. Sender and receiver derive the same offsets
 *    from the same routing, so no metadata exchange is needed.
 * Everything is O(routed rows + W * experts) and allocates once per plan. The passes over every
 * routed row divide nothing and branch on nothing that depends on the routing (see tw__scratch).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "core.h"
#include "plan.h"

/* Frees a plan, possibly partly built; keeps the thread's last error (failure paths use it). */
static void tw__plan_free(struct tw_plan* plan) {
  if (plan == NULL) return;
  tw__model_free(plan); /* the model's tables (model.c) */
  free(plan->expert_row0);
  free(plan->expert_rows);
  free(plan->expert_real_rows);
  free(plan->row_src);
  free(plan->tiles);
  free(plan->expert_order);
  free(plan->layout_bands);
  free(plan->expert_band0);
  free(plan->expert_local_band0);
  free(plan->bands);
  free(plan->segments);
  free(plan->slot_row);
  free(plan->recv_bands);
  free(plan->stream_first);
  free(plan->stream_last);
  free(plan);
}

tw_status tw_plan_destroy(tw_plan_t plan) {
  tw__clear_error();
  tw__plan_free(plan);
  return TW_SUCCESS;
}

/* Allocation that never returns NULL for a zero count (n == 0 allocates one element). */
static void* tw__alloc(size_t n, size_t elem) {
  return malloc((n ? n : 1) * elem);
}

typedef struct tw__order_key {
  int32_t remote_bands;
  int32_t expert;
} tw__order_key;

static int tw__order_cmp(const void* a, const void* b) {
  const tw__order_key* x = a;
  const tw__order_key* y = b;
  if (x->remote_bands != y->remote_bands) return x->remote_bands > y->remote_bands ? -1 : 1;
  return (x->expert > y->expert) - (x->expert < y->expert);
}

/* Scratch arrays of one build. The two passes over every routed (owner, token, slot) neither
 * divide nor branch on the routing: pass 1 is a histogram over global experts (rank s's experts
 * are the block [s E, s E + E), so the blocks give what the layout needs); pass 2 scatters through
 * one cursor per global expert, where other ranks' experts point at a sink and do not advance.
 * With two ranks about half the rows are ours, in no order a branch predictor could learn. */
typedef struct tw__scratch {
  int32_t* hist;       /* (W, E_total) assignments of owner o's tokens to global expert g */
  int32_t* cnt;        /* (E, W) rows of local expert e owned by rank o */
  int32_t* grp_row0;   /* (E, W) first layout row of group (e, o) */
  int64_t* dest_row;   /* (E, W) first row of group (e, o) in o's receive buffer */
  int64_t* before;     /* (W) rows that ranks s < rank (s != o) send to o */
  tw_row_src** cursor; /* (E_total) next row_src entry of expert g's group of the owner being
                          placed, or a sink for other ranks' experts */
  int32_t* step;       /* (E_total) 1 for this rank's experts, 0 for the others (the sink) */
  int32_t* slot_cur;   /* (E_total) next slot_row value of this rank's rows of expert g */
  tw__order_key* keys; /* (E) */
} tw__scratch;

static void tw__scratch_free(tw__scratch* s) {
  free(s->hist);
  free(s->cnt);
  free(s->grp_row0);
  free(s->dest_row);
  free(s->before);
  free(s->cursor);
  free(s->step);
  free(s->slot_cur);
  free(s->keys);
}

static tw_status tw__plan_build(struct tw_plan* pl, const struct tw_routing* rt) {
  const tw_problem* p = &pl->problem;
  const int32_t W = p->world_size, K = p->top_k, ET = p->experts, rank = pl->rank;
  const int32_t E = ET / W, TM = pl->tm;
  const int64_t row_bytes = (int64_t)p->hidden * 2; /* bf16 */
  tw__scratch sc = {0};
  tw_status st = TW_SUCCESS;
  size_t ew = (size_t)E * (size_t)W;
  sc.hist = calloc((size_t)W * (size_t)ET, sizeof(int32_t));
  sc.cnt = tw__alloc(ew, sizeof(int32_t));
  sc.grp_row0 = tw__alloc(ew, sizeof(int32_t));
  sc.dest_row = tw__alloc(ew, sizeof(int64_t));
  sc.before = calloc((size_t)W, sizeof(int64_t));
  sc.cursor = tw__alloc((size_t)ET, sizeof(tw_row_src*));
  sc.step = tw__alloc((size_t)ET, sizeof(int32_t));
  sc.slot_cur = tw__alloc((size_t)ET, sizeof(int32_t));
  sc.keys = tw__alloc((size_t)E, sizeof(tw__order_key));
  pl->expert_row0 = tw__alloc((size_t)E, sizeof(int32_t));
  pl->expert_rows = tw__alloc((size_t)E, sizeof(int32_t));
  pl->expert_real_rows = tw__alloc((size_t)E, sizeof(int32_t));
  pl->expert_order = tw__alloc((size_t)E, sizeof(int32_t));
  pl->expert_band0 = tw__alloc((size_t)E + 1, sizeof(int32_t));
  pl->expert_local_band0 = tw__alloc((size_t)E, sizeof(int32_t));
  pl->recv_bands = tw__alloc((size_t)W, sizeof(int32_t));
  pl->stream_first = tw__alloc((size_t)W, sizeof(int32_t));
  pl->stream_last = tw__alloc((size_t)W, sizeof(int32_t));
  pl->slot_row = tw__alloc((size_t)rt->tokens[rank] * (size_t)K, sizeof(int32_t));
  if (!sc.hist || !sc.cnt || !sc.grp_row0 || !sc.dest_row || !sc.before || !sc.cursor || !sc.step ||
      !sc.slot_cur || !sc.keys || !pl->expert_row0 || !pl->expert_rows || !pl->expert_real_rows ||
      !pl->expert_order || !pl->expert_band0 || !pl->expert_local_band0 || !pl->recv_bands ||
      !pl->stream_first || !pl->stream_last || !pl->slot_row) {
    st = tw__fail(TW_ERR_OUT_OF_MEMORY, "plan: out of host memory");
    goto done;
  }

  /* Pass 1 over every routed (owner, token, slot): a histogram per owner over global experts.
   * Global expert g lives on rank g / E as its local expert g % E, so the histograms give the
   * group sizes of this rank's experts, the rows lower-numbered senders put ahead of ours in each
   * owner's receive buffer, and this rank's own per-expert counts (hist row `rank`). */
  for (int32_t o = 0; o < W; o++) {
    const int32_t* ids = rt->expert_ids[o];
    int32_t* h = sc.hist + (size_t)o * ET;
    size_t n = (size_t)rt->tokens[o] * (size_t)K;
    for (size_t i = 0; i < n; i++) h[ids[i]]++;
    for (int32_t e = 0; e < E; e++) sc.cnt[(size_t)e * W + o] = h[(size_t)rank * E + e];
    for (int32_t s = 0; s < rank; s++) {
      if (s == o) continue;
      for (int32_t e = 0; e < E; e++) sc.before[o] += h[(size_t)s * E + e];
    }
  }

  /* Layout: groups of each expert in owner order r+1, ..., r+W-1, r; every remote group but the
   * last (q = W - 1) padded to whole bands; the last one and the local group then share a band. */
  int64_t row = 0;
  int32_t num_bands = 0;
  for (int32_t e = 0; e < E; e++) {
    int64_t e_row0 = row, e_real = 0;
    int32_t remote_bands = 0;
    for (int32_t q = 1; q <= W; q++) {
      int32_t o = (rank + q) % W;
      int32_t c = sc.cnt[(size_t)e * W + o];
      sc.grp_row0[(size_t)e * W + o] = (int32_t)row;
      int32_t nb = (int32_t)tw__ceil_div(c, TM);
      row += q >= W - 1 ? c : (int64_t)nb * TM;
      e_real += c;
      if (o != rank) remote_bands += nb;
      if (q < W - 1) num_bands += nb;
    }
    num_bands += (int32_t)tw__ceil_div(row - sc.grp_row0[(size_t)e * W + (rank + W - 1) % W], TM);
    if (row > INT32_MAX) {
      st = tw__fail(TW_ERR_INTERNAL, "plan: layout rows exceed int32 despite validation");
      goto done;
    }
    pl->expert_row0[e] = (int32_t)e_row0;
    pl->expert_rows[e] = (int32_t)(row - e_row0);
    pl->expert_real_rows[e] = (int32_t)e_real;
    sc.keys[e].remote_bands = remote_bands;
    sc.keys[e].expert = e;
  }
  pl->rows = (int32_t)row;
  qsort(sc.keys, (size_t)E, sizeof *sc.keys, tw__order_cmp);
  for (int32_t i = 0; i < E; i++) pl->expert_order[i] = sc.keys[i].expert;

  /* Row sources: padding rows (the tail of each padded remote group), then pass 2 places every
   * routed row in (token, slot) order within its group (owners ascending, tokens ascending, slots
   * ascending). Every row is written exactly once. */
  pl->row_src = tw__alloc((size_t)pl->rows, sizeof(tw_row_src));
  pl->bands = tw__alloc((size_t)num_bands, sizeof(tw_band));
  pl->layout_bands = tw__alloc((size_t)num_bands, sizeof(tw_band));
  pl->segments = tw__alloc((size_t)num_bands, sizeof(tw_segment)); /* worst case: one per band */
  pl->tiles = tw__alloc((size_t)num_bands * (size_t)pl->col_tiles, sizeof(tw_tile));
  if (!pl->row_src || !pl->bands || !pl->layout_bands || !pl->segments || !pl->tiles) {
    st = tw__fail(TW_ERR_OUT_OF_MEMORY, "plan: out of host memory (%d rows, %d bands)", pl->rows,
                  num_bands);
    goto done;
  }
  for (int32_t e = 0; e < E; e++) {
    for (int32_t q = 1; q < W - 1; q++) { /* the padded groups */
      const size_t gi = (size_t)e * W + (rank + q) % W;
      const int32_t c = sc.cnt[gi];
      const int32_t end = sc.grp_row0[gi] + (int32_t)tw__ceil_div(c, TM) * TM;
      for (int32_t r = sc.grp_row0[gi] + c; r < end; r++) pl->row_src[r] = (tw_row_src){-1, -1, -1};
    }
  }
  /* Other ranks' experts write to `sink` and do not advance; ours advance through their group.
   * The stores are unconditional so that the loop has no data-dependent branch. */
  tw_row_src sink;
  for (int32_t g = 0; g < ET; g++) {
    sc.cursor[g] = &sink;
    sc.step[g] = 0;
  }
  for (int32_t e = 0; e < E; e++) sc.step[(size_t)rank * E + e] = 1;
  for (int32_t o = 0; o < W; o++) {
    const int32_t* ids = rt->expert_ids[o];
    tw_row_src** cur = sc.cursor;
    const int32_t* step = sc.step;
    for (int32_t e = 0; e < E; e++)
      cur[(size_t)rank * E + e] = pl->row_src + sc.grp_row0[(size_t)e * W + o];
    for (int32_t t = 0; t < rt->tokens[o]; t++) {
      const int32_t* tid = ids + (size_t)t * K;
      for (int32_t j = 0; j < K; j++) {
        const int32_t g = tid[j];
        *cur[g] = (tw_row_src){o, t, j};
        cur[g] += step[g];
      }
    }
  }

  /* Where each of our groups lands at its owner: after the rows of lower-numbered senders, then
   * after our lower-numbered experts' rows for that owner. */
  for (int32_t o = 0; o < W; o++) {
    int64_t at = sc.before[o];
    for (int32_t e = 0; e < E; e++) {
      sc.dest_row[(size_t)e * W + o] = at;
      at += sc.cnt[(size_t)e * W + o];
    }
  }

  /* Bands in layout order: expert by expert, groups in layout order (owners r+1, ..., r-1, then
   * r: an expert's remote bands come before its local ones), bands in row order. A band sends its
   * first valid_rows rows to dest; the rest are padding, or in the band shared by the last remote
   * group and the local group, local rows. The schedule orders them (tw__plan_set_schedule). */
  int32_t nb = 0;
  int64_t send_rows = 0;
  for (int32_t e = 0; e < E; e++) {
    pl->expert_band0[e] = nb;
    pl->expert_local_band0[e] = -1;
    const int64_t e_end = (int64_t)pl->expert_row0[e] + pl->expert_rows[e];
    /* Remote groups r+1, ..., r-1 (with one rank: the local group alone, as a group that sends
     * nothing); the last one's bands run on into the local group, to the expert's end. */
    for (int32_t q = 1; q <= (W > 1 ? W - 1 : 1); q++) {
      const int32_t o = (rank + q) % W;
      const size_t gi = (size_t)e * W + o;
      const int32_t c = o == rank ? 0 : sc.cnt[gi], g0 = sc.grp_row0[gi];
      const int64_t end = q < W - 1 ? g0 + tw__ceil_div(c, TM) * TM : e_end;
      for (int64_t r0 = g0; r0 < end; r0 += TM) {
        tw_band* band = &pl->layout_bands[nb];
        const int32_t rows = (int32_t)(end - r0 < TM ? end - r0 : TM);
        const int64_t sent = g0 + (int64_t)c - r0; /* this group's rows from r0 on */
        band->expert = e;
        band->row0 = (int32_t)r0;
        band->rows = rows;
        band->segment = -1;
        if (sent > 0) { /* sends to o */
          band->valid_rows = (int32_t)(sent < rows ? sent : rows);
          band->dest = o;
          band->dest_offset = (sc.dest_row[gi] + (r0 - g0)) * row_bytes;
          send_rows += band->valid_rows;
        } else { /* past the last remote group: a local band */
          if (pl->expert_local_band0[e] < 0) pl->expert_local_band0[e] = nb;
          band->valid_rows = rows;
          band->dest = rank;
          band->dest_offset = -1;
        }
        nb++;
      }
    }
    if (pl->expert_local_band0[e] < 0) pl->expert_local_band0[e] = nb; /* no local band */
  }
  pl->expert_band0[E] = nb;
  if (nb != num_bands) {
    st = tw__fail(TW_ERR_INTERNAL, "plan: %d bands placed, %d counted", nb, num_bands);
    goto done;
  }
  pl->num_bands = nb;
  pl->send_bytes = send_rows * row_bytes;
  pl->num_tiles = nb * pl->col_tiles;
  /* The model tabulates an AUTO plan in remote-first order first (tw__model_choose). */
  st = tw__plan_set_schedule(pl, pl->schedule_request == TW_SCHEDULE_EXPERT_MAJOR
                                     ? TW_SCHEDULE_EXPERT_MAJOR
                                     : TW_SCHEDULE_REMOTE_FIRST);
  if (st != TW_SUCCESS) goto done;

  /* Receive side: rows others return here, ordered by source rank then its expert index, which
   * is ascending global expert id with our own experts skipped. slot_cur[g] starts at the first
   * slot_row value of our rows of expert g: a receive row for another rank's expert, recv_rows
   * plus the local group's first row for ours. */
  const int32_t* own = sc.hist + (size_t)rank * ET; /* this rank's assignments per global expert */
  int64_t recv = 0;
  for (int32_t s = 0; s < W; s++) {
    pl->recv_bands[s] = 0;
    if (s == rank) continue;
    for (int32_t e = 0; e < E; e++) {
      int32_t g = s * E + e;
      sc.slot_cur[g] = (int32_t)recv;
      recv += own[g];
      pl->recv_bands[s] += (int32_t)tw__ceil_div(own[g], TM);
    }
  }
  pl->recv_rows = (int32_t)recv;
  for (int32_t e = 0; e < E; e++)
    sc.slot_cur[(size_t)rank * E + e] = pl->recv_rows + sc.grp_row0[(size_t)e * W + rank];
  {
    const int32_t* ids = rt->expert_ids[rank];
    size_t n = (size_t)rt->tokens[rank] * (size_t)K;
    for (size_t i = 0; i < n; i++) pl->slot_row[i] = sc.slot_cur[ids[i]]++;
  }
  /* The segments are built by the model (tw__model_choose), once per candidate mgb. */
done:
  tw__scratch_free(&sc);
  return st;
}

/* Whether band j may join the tile group that band i (i < j, consecutive bands) starts: one
 * expert (one weight matrix), so that the group's tiles read each weight column tile at about the
 * same time, the later bands from L2; and one destination unless j <= span_end. Expert-major sets
 * span_end to the schedule's last remote band: an expert's remote and local bands then share
 * groups, so its weights come from device memory once (run 64, producer alone: 2-11% faster at
 * 32-64 experts; with one group per destination an expert of 32 MB of weights was read about
 * twice), at the price of publishing its remote bands up to a group's columns later; but no band
 * after the last remote one joins a remote group, since the consumer's tail needs that band early
 * (the lead of layout.c, or the last expert where there is none). Remote-first puts every remote
 * tile first: span_end -1, one destination per group. */
static int tw__same_group(const tw_band* bands, int32_t i, int32_t j, int32_t span_end) {
  return bands[i].expert == bands[j].expert && (bands[i].dest == bands[j].dest || j <= span_end);
}

void tw__tiles_from_bands(const tw_band* bands, int32_t nb, int32_t cols, int32_t tn,
                          int32_t tile_group, int32_t span_end, tw_tile* tiles) {
  const int32_t group = tile_group > 1 ? tile_group : 1;
  for (int32_t i = 0, t = 0, flip = 0; i < nb;) {
    int32_t g = 1;
    while (g < group && i + g < nb && tw__same_group(bands, i, i + g, span_end)) g++;
    for (int32_t c = 0; c < cols; c++) {
      const int32_t col = flip ? cols - 1 - c : c;
      for (int32_t j = i; j < i + g; j++, t++)
        tiles[t] = (tw_tile){.row0 = bands[j].row0,
                             .rows = bands[j].rows,
                             .expert = bands[j].expert,
                             .col0 = col * tn,
                             .band = j};
    }
    i += g;
    flip = group > 1 && i < nb && tw__same_group(bands, i - 1, i, span_end) ? !flip : 0;
  }
}

tw_status tw__plan_set_schedule(struct tw_plan* plan, int32_t schedule) {
  TW_CHECK_NULL(plan);
  if (schedule != TW_SCHEDULE_REMOTE_FIRST && schedule != TW_SCHEDULE_EXPERT_MAJOR)
    return tw__fail(
        TW_ERR_INVALID_ARGUMENT,
        "schedule %d: give TW_SCHEDULE_REMOTE_FIRST (1) or TW_SCHEDULE_EXPERT_MAJOR (2)", schedule);
  if (plan->layout_bands == NULL) {
    if (plan->schedule == schedule) return TW_SUCCESS;
    return tw__fail(TW_ERR_STATE,
                    "plan: no bands in layout order to build schedule %d from (a plan built by "
                    "hand keeps its own order); build the plan with tw_plan_create",
                    schedule);
  }
  const int32_t E = plan->local_experts, rank = plan->rank, W = plan->problem.world_size;
  const tw_band* lb = plan->layout_bands;
  /* Expert-major: each expert's bands as the layout has them (remote groups, then the local one),
   * but the last two experts' remote parts before their local parts. Remote-first: two passes
   * over expert_order, [expert_band0, expert_local_band0) then [expert_local_band0,
   * expert_band0 + 1). */
  int32_t nb = 0;
  for (int32_t pass = 0; pass < 2; pass++) {
    if (pass == 1 && schedule == TW_SCHEDULE_EXPERT_MAJOR) break;
    for (int32_t i = 0; i < E; i++) {
      const int32_t e = plan->expert_order[i];
      int32_t b0 = plan->expert_band0[e], b1 = plan->expert_band0[e + 1];
      if (schedule == TW_SCHEDULE_REMOTE_FIRST) {
        if (pass == 0)
          b1 = plan->expert_local_band0[e];
        else
          b0 = plan->expert_local_band0[e];
      } else if (i == E - 2 && E >= 3) {
        /* The last two experts: both remote parts, then both local ones. */
        for (int32_t part = 0; part < 2; part++)
          for (int32_t j = i; j < E; j++) {
            const int32_t x = plan->expert_order[j];
            const int32_t c0 = part ? plan->expert_local_band0[x] : plan->expert_band0[x];
            const int32_t c1 = part ? plan->expert_band0[x + 1] : plan->expert_local_band0[x];
            if (c1 > c0) memcpy(&plan->bands[nb], &lb[c0], (size_t)(c1 - c0) * sizeof *lb);
            nb += c1 > c0 ? c1 - c0 : 0;
          }
        break;
      }
      if (b1 > b0) {
        memcpy(&plan->bands[nb], &lb[b0], (size_t)(b1 - b0) * sizeof *lb);
        nb += b1 - b0;
      }
    }
  }
  if (nb != plan->num_bands)
    return tw__fail(TW_ERR_INTERNAL, "plan: schedule %d holds %d of %d bands", schedule, nb,
                    plan->num_bands);
  /* Streams and remote tile count over the whole order: under expert-major a destination's
   * bands are spread over the schedule, with local bands between them. */
  int32_t nremote = 0;
  for (int32_t d = 0; d < W; d++) plan->stream_first[d] = plan->stream_last[d] = -1;
  for (int32_t i = 0; i < nb; i++) {
    const int32_t d = plan->bands[i].dest;
    if (d == rank) continue;
    nremote++;
    if (plan->stream_first[d] < 0) plan->stream_first[d] = i;
    plan->stream_last[d] = i;
  }
  plan->num_remote_tiles = nremote * plan->col_tiles;
  /* Tiles: bands in schedule order, in the groups of tw__tiles_from_bands; under expert-major
   * an expert's bands of any destination share groups up to the last remote band. */
  int32_t span_end = -1;
  for (int32_t d = 0; d < W && schedule == TW_SCHEDULE_EXPERT_MAJOR; d++)
    if (plan->stream_last[d] > span_end) span_end = plan->stream_last[d];
  tw__tiles_from_bands(plan->bands, nb, plan->col_tiles, plan->tn, plan->tile_group, span_end,
                       plan->tiles);
  plan->num_segments = 0; /* the bands' segment fields are -1 (copied from layout_bands) */
  plan->schedule = schedule;
  return TW_SUCCESS;
}

int32_t tw__schedule_parse(const char* s) {
  if (strcasecmp(s, "remote-first") == 0) return TW_SCHEDULE_REMOTE_FIRST;
  if (strcasecmp(s, "expert-major") == 0) return TW_SCHEDULE_EXPERT_MAJOR;
  if (strcasecmp(s, "auto") == 0) return TW_SCHEDULE_AUTO;
  return -1;
}

tw_status tw__schedule_resolve(const tw_plan_config* config, int32_t* schedule) {
  TW_CHECK_NULL(schedule);
  *schedule = TW_SCHEDULE_AUTO;
  /* Read on every plan (not cached): a process may change it between plans, e.g. a benchmark
   * that measures both schedules. A bad value is an error even when the config decides, so that
   * a typo never goes unnoticed. */
  const char* env = getenv("TW_SCHEDULE");
  int32_t from_env = TW_SCHEDULE_AUTO;
  if (env != NULL && env[0] != '\0') {
    from_env = tw__schedule_parse(env);
    if (from_env < 0)
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "TW_SCHEDULE=\"%s\" is not a schedule; set remote-first, expert-major or "
                      "auto, or unset it",
                      env);
  }
  int32_t from_config = TW_SCHEDULE_AUTO;
  if (config != NULL && config->size >= offsetof(tw_plan_config, schedule) + sizeof(int32_t)) {
    from_config = config->schedule;
    if (from_config != TW_SCHEDULE_AUTO && from_config != TW_SCHEDULE_REMOTE_FIRST &&
        from_config != TW_SCHEDULE_EXPERT_MAJOR)
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "tw_plan_config.schedule = %d; give 0 (TW_SCHEDULE_AUTO: env TW_SCHEDULE, "
                      "else the model's choice), 1 (TW_SCHEDULE_REMOTE_FIRST) or 2 "
                      "(TW_SCHEDULE_EXPERT_MAJOR)",
                      from_config);
  }
  *schedule = from_config != TW_SCHEDULE_AUTO ? from_config : from_env;
  return TW_SUCCESS;
}

tw_status tw__tile_group_resolve(int32_t* tile_group) {
  TW_CHECK_NULL(tile_group);
  *tile_group = TW_TILE_GROUP_DEFAULT;
  /* Read on every plan, like TW_SCHEDULE. */
  const char* env = getenv("TW_TILE_GROUP");
  if (env == NULL || env[0] == '\0') return TW_SUCCESS;
  char* end = NULL;
  const long v = strtol(env, &end, 10);
  if (*end != '\0' || v < 1 || v > 64)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "TW_TILE_GROUP=\"%s\" is not a band count; set 1 to 64, or unset it", env);
  *tile_group = (int32_t)v;
  return TW_SUCCESS;
}

tw_status tw__plan_build_segments(struct tw_plan* plan, int32_t coalesce) {
  TW_CHECK_NULL(plan);
  if (coalesce < 1)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "coalesce (%d) must be at least 1 band per segment; pass 0 in the config to "
                    "let the model choose",
                    coalesce);
  /* Every segment is a run of consecutive schedule indices: a group's bands are consecutive in
   * the schedule and a segment never leaves its group. A new segment starts at a group boundary,
   * at the first and the last band of a destination's stream, right after the first band (so the
   * first segment stays one band), and when the open segment holds `coalesce` bands. The one-
   * band first segment gets the destination going as early as possible; the one-band last
   * segment keeps the tail transfer, which nothing can hide, short. */
  const int32_t rank = plan->rank;
  int32_t nseg = 0;
  for (int32_t i = 0; i < plan->num_bands; i++) {
    tw_band* b = &plan->bands[i];
    if (b->dest == rank) {
      b->segment = -1;
      continue;
    }
    int32_t d = b->dest;
    const tw_band* prev = i > 0 ? &plan->bands[i - 1] : NULL;
    int start = nseg == 0 || prev == NULL || prev->dest != d || prev->expert != b->expert ||
                i == plan->stream_first[d] || i == plan->stream_last[d] ||
                i - 1 == plan->stream_first[d] || plan->segments[nseg - 1].nbands >= coalesce;
    if (start) {
      tw_segment* s = &plan->segments[nseg++];
      s->band0 = i;
      s->nbands = 1;
      s->dest = d;
      s->src_row0 = b->row0;
      s->valid_rows = b->valid_rows;
      s->ready_tiles = plan->col_tiles;
      s->dest_offset = b->dest_offset;
    } else {
      tw_segment* s = &plan->segments[nseg - 1];
      s->nbands++;
      s->valid_rows += b->valid_rows;
      s->ready_tiles += plan->col_tiles;
    }
    b->segment = nseg - 1;
  }
  plan->coalesce = coalesce;
  plan->num_segments = nseg;
  return TW_SUCCESS;
}

tw_status tw_plan_create(const tw_problem* problem, tw_routing_t routing, int32_t rank,
                         const tw_plan_config* config, tw_plan_t* plan) {
  tw__clear_error();
  TW_CHECK_NULL(plan);
  *plan = NULL;
  TW_TRY(tw_problem_validate(problem));
  TW_CHECK_NULL(routing);
  const tw_problem* p = problem;
  /* The config's values are checked by the model (tw__model_choose), against the hardware, and
   * the schedule by tw__schedule_resolve. A config of the size before `schedule` was appended
   * (same magic and version) is a caller built against the earlier tilewave.h: it is read up to
   * `hardware` and plans as TW_SCHEDULE_AUTO, like a NULL config; one that ends before
   * `dataflow` plans for TW_DATAFLOW_DEFAULT. */
  if (config != NULL) {
    const size_t v1_size = offsetof(tw_plan_config, schedule);
    const size_t v2_size = offsetof(tw_plan_config, dataflow);
    const size_t known =
        config->size == v1_size || config->size == v2_size ? config->size : sizeof(tw_plan_config);
    TW_TRY(tw__check_header("tw_plan_config", config->size, known, config->magic,
                            TW_PLAN_CONFIG_MAGIC, config->version));
  }
  int32_t schedule = TW_SCHEDULE_AUTO;
  TW_TRY(tw__schedule_resolve(config, &schedule));
  int32_t dataflow = TW_DATAFLOW_REDUCE;
  TW_TRY(tw__dataflow_resolve("tw_plan_create",
                              config != NULL && config->size == sizeof(tw_plan_config)
                                  ? config->dataflow
                                  : TW_DATAFLOW_DEFAULT,
                              &dataflow));
  int32_t tile_group = TW_TILE_GROUP_DEFAULT;
  TW_TRY(tw__tile_group_resolve(&tile_group));
  const tw_problem* rp = &routing->problem;
  if (rp->world_size != p->world_size || rp->experts != p->experts || rp->top_k != p->top_k)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "the routing is for world_size %d, experts %d, top_k %d but the problem has "
                    "%d, %d, %d; build the routing from the same problem",
                    rp->world_size, rp->experts, rp->top_k, p->world_size, p->experts, p->top_k);
  for (int32_t r = 0; r < p->world_size; r++)
    if (routing->tokens[r] > p->max_tokens)
      return tw__fail(TW_ERR_CAPACITY,
                      "routing rank %d holds %d tokens, more than the problem's max_tokens (%d); "
                      "raise max_tokens",
                      r, routing->tokens[r], p->max_tokens);
  if (rank < 0 || rank >= p->world_size)
    return tw__fail(TW_ERR_INVALID_ARGUMENT, "rank %d is outside 0..%d (world_size %d)", rank,
                    p->world_size - 1, p->world_size);

  struct tw_plan* pl = calloc(1, sizeof *pl);
  if (pl == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "plan: out of host memory");
  pl->problem = *p;
  pl->rank = rank;
  pl->local_experts = p->experts / p->world_size;
  pl->tm = tw__resolve_tile_m(p);
  pl->tn = tw__resolve_tile_n(p);
  pl->col_tiles = (int32_t)tw__ceil_div(p->hidden, pl->tn);
  pl->schedule_request = schedule;
  pl->dataflow = dataflow;
  pl->tile_group = tile_group;
  tw_status st = tw__plan_build(pl, routing);
  if (st == TW_SUCCESS) st = tw__model_choose(pl, config);
  if (st != TW_SUCCESS) {
    tw__plan_free(pl);
    return st;
  }
  *plan = pl;
  return TW_SUCCESS;
}

tw_status tw_plan_summary_get(tw_plan_t plan, tw_plan_summary* summary) {
  tw__clear_error();
  TW_CHECK_NULL(plan);
  TW_CHECK_NULL(summary);
  int64_t real = 0;
  for (int32_t e = 0; e < plan->local_experts; e++) real += plan->expert_real_rows[e];
  memset(summary, 0, sizeof *summary);
  summary->rank = plan->rank;
  summary->comm_ctas = plan->comm_ctas;
  summary->coalesce = plan->coalesce;
  summary->rows = plan->rows;
  summary->padding_rows = plan->rows - real;
  summary->tiles = plan->num_tiles;
  summary->remote_tiles = plan->num_remote_tiles;
  summary->bands = plan->num_bands;
  summary->segments = plan->num_segments;
  summary->send_bytes = plan->send_bytes;
  summary->predicted_us = plan->predicted_us;
  summary->sequential_us = plan->sequential_us;
  summary->solve_us = plan->solve_us;
  summary->schedule = plan->schedule;
  summary->gemm_us = plan->gemm_us;
  summary->dataflow = plan->dataflow;
  return TW_SUCCESS;
}
