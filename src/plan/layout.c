/*
 * layout.c: one rank's row layout from a routing (tw__plan_layout): the remote-owner-aligned rows
 * of its local experts, the source of every row, the bands in layout order with their
 * destinations and receive offsets, and the receive-side map of its own tokens. The order the
 * producer computes the bands in is schedule.c's; the transfer segments are segments.c's.
 *
 * The rules (second paper, Algorithm 1, with the choices fixed in plan.h and docs/model.md):
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
 *  - expert order: experts sorted by remote band count (descending, ties by index), which both
 *    schedules follow (schedule.c).
 *  - receive side at owner o: rows by source rank s (ascending, s != o), then s's local experts
 *    in index order, then (token, slot) order, dense. Sender and receiver derive the same offsets
 *    from the same routing, so no metadata exchange is needed.
 * Everything is O(routed rows + W * experts) and allocates once per plan. The passes over every
 * routed row divide nothing and branch on nothing that depends on the routing (see tw__scratch).
 *
 * Two entry points share one core. The core (tw__layout_core) needs only the count matrix
 * hist[o][g] (how many of rank o's token slots route to global expert g): group sizes, rows,
 * bands, destinations, receive offsets, the owner of every row and the two per-expert bases of
 * the per-token maps (slot_base, send_row0) are functions of it. tw__plan_layout (a routing)
 * counts the matrix on the host, runs the core, then fills the per-token parts: the (token,
 * slot) of every row and slot_row. tw__plan_layout_counts (a count matrix, e.g. all-gathered
 * from the ranks' GPUs) runs the core alone; the per-token parts then come from a device-side
 * scan (src/kernels/dispatch.cu), which places slot i of expert g at slot_base[g] + its position
 * among this rank's slots of g in (token, slot) order, as the host fill below does.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "plan.h"

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

/* The scratch arrays and the plan's per-expert and per-rank arrays (sizes known before the
 * layout). */
static tw_status tw__layout_alloc(struct tw_plan* pl, tw__scratch* sc) {
  const int32_t W = pl->problem.world_size, ET = pl->problem.experts;
  const int32_t E = ET / W;
  const size_t ew = (size_t)E * (size_t)W;
  sc->hist = calloc((size_t)W * (size_t)ET, sizeof(int32_t));
  sc->cnt = tw__alloc(ew, sizeof(int32_t));
  sc->grp_row0 = tw__alloc(ew, sizeof(int32_t));
  sc->dest_row = tw__alloc(ew, sizeof(int64_t));
  sc->before = calloc((size_t)W, sizeof(int64_t));
  sc->cursor = tw__alloc((size_t)ET, sizeof(tw_row_src*));
  sc->step = tw__alloc((size_t)ET, sizeof(int32_t));
  sc->slot_cur = tw__alloc((size_t)ET, sizeof(int32_t));
  sc->keys = tw__alloc((size_t)E, sizeof(tw__order_key));
  pl->expert_row0 = tw__alloc((size_t)E, sizeof(int32_t));
  pl->expert_rows = tw__alloc((size_t)E, sizeof(int32_t));
  pl->expert_real_rows = tw__alloc((size_t)E, sizeof(int32_t));
  pl->expert_order = tw__alloc((size_t)E, sizeof(int32_t));
  pl->expert_band0 = tw__alloc((size_t)E + 1, sizeof(int32_t));
  pl->expert_local_band0 = tw__alloc((size_t)E, sizeof(int32_t));
  pl->recv_bands = tw__alloc((size_t)W, sizeof(int32_t));
  pl->stream_first = tw__alloc((size_t)W, sizeof(int32_t));
  pl->stream_last = tw__alloc((size_t)W, sizeof(int32_t));
  pl->slot_base = tw__alloc((size_t)ET, sizeof(int32_t));
  pl->send_row0 = tw__alloc((size_t)ET, sizeof(int32_t));
  if (!sc->hist || !sc->cnt || !sc->grp_row0 || !sc->dest_row || !sc->before || !sc->cursor ||
      !sc->step || !sc->slot_cur || !sc->keys || !pl->expert_row0 || !pl->expert_rows ||
      !pl->expert_real_rows || !pl->expert_order || !pl->expert_band0 || !pl->expert_local_band0 ||
      !pl->recv_bands || !pl->stream_first || !pl->stream_last || !pl->slot_base || !pl->send_row0)
    return tw__fail(TW_ERR_OUT_OF_MEMORY, "plan: out of host memory");
  return TW_SUCCESS;
}

/* Pass 1 over every routed (owner, token, slot): a histogram per owner over global experts
 * (the count matrix hist[o][g]). */
static void tw__hist_from_routing(const struct tw_plan* pl, const struct tw_routing* rt,
                                  tw__scratch* sc) {
  const int32_t W = pl->problem.world_size, K = pl->problem.top_k, ET = pl->problem.experts;
  for (int32_t o = 0; o < W; o++) {
    const int32_t* ids = rt->expert_ids[o];
    int32_t* h = sc->hist + (size_t)o * ET;
    size_t n = (size_t)rt->tokens[o] * (size_t)K;
    for (size_t i = 0; i < n; i++) h[ids[i]]++;
  }
}

/* From the count matrix: global expert g lives on rank g / E as its local expert g % E, so the
 * histograms give the group sizes of this rank's experts, the rows lower-numbered senders put
 * ahead of ours in each owner's receive buffer, and this rank's own per-expert counts (hist row
 * `rank`). */
static void tw__count_groups(const struct tw_plan* pl, tw__scratch* sc) {
  const int32_t W = pl->problem.world_size, ET = pl->problem.experts;
  const int32_t E = ET / W, rank = pl->rank;
  for (int32_t o = 0; o < W; o++) {
    const int32_t* h = sc->hist + (size_t)o * ET;
    for (int32_t e = 0; e < E; e++) sc->cnt[(size_t)e * W + o] = h[(size_t)rank * E + e];
    for (int32_t s = 0; s < rank; s++) {
      if (s == o) continue;
      for (int32_t e = 0; e < E; e++) sc->before[o] += h[(size_t)s * E + e];
    }
  }
}

/* Rows group q of an expert (owner (r+q) % W, q = 1..W) takes in the layout: its rows, padded
 * to whole bands for every remote group but the last (q < W - 1). The one rule both the layout
 * and the senders' view of other ranks' layouts (tw__send_rows) follow. */
static inline int64_t tw__group_span(int32_t q, int32_t W, int32_t c, int32_t TM) {
  return q >= W - 1 ? c : tw__ceil_div(c, TM) * TM;
}

/* Layout: groups of each expert in owner order r+1, ..., r+W-1, r; every remote group but the
 * last (q = W - 1) padded to whole bands; the last one and the local group then share a band.
 * Sets the experts' rows, the plan's row count and the expert order; *num_bands = the bands. */
static tw_status tw__place_groups(struct tw_plan* pl, tw__scratch* sc, int32_t* num_bands) {
  const int32_t W = pl->problem.world_size, E = pl->local_experts, TM = pl->tm, rank = pl->rank;
  int64_t row = 0;
  int32_t nb_total = 0;
  for (int32_t e = 0; e < E; e++) {
    int64_t e_row0 = row, e_real = 0;
    int32_t remote_bands = 0;
    for (int32_t q = 1; q <= W; q++) {
      int32_t o = (rank + q) % W;
      int32_t c = sc->cnt[(size_t)e * W + o];
      sc->grp_row0[(size_t)e * W + o] = (int32_t)row;
      int32_t nb = (int32_t)tw__ceil_div(c, TM);
      row += tw__group_span(q, W, c, TM);
      e_real += c;
      if (o != rank) remote_bands += nb;
      if (q < W - 1) nb_total += nb;
    }
    nb_total += (int32_t)tw__ceil_div(row - sc->grp_row0[(size_t)e * W + (rank + W - 1) % W], TM);
    if (row > INT32_MAX)
      return tw__fail(TW_ERR_INTERNAL, "plan: layout rows exceed int32 despite validation");
    pl->expert_row0[e] = (int32_t)e_row0;
    pl->expert_rows[e] = (int32_t)(row - e_row0);
    pl->expert_real_rows[e] = (int32_t)e_real;
    sc->keys[e].remote_bands = remote_bands;
    sc->keys[e].expert = e;
  }
  pl->rows = (int32_t)row;
  qsort(sc->keys, (size_t)E, sizeof *sc->keys, tw__order_cmp);
  for (int32_t i = 0; i < E; i++) pl->expert_order[i] = sc->keys[i].expert;
  *num_bands = nb_total;
  return TW_SUCCESS;
}

/* The arrays sized by the layout: row sources, bands (schedule and layout order), segments
 * (worst case: one per band, so that rebuilding them never allocates) and tiles. */
static tw_status tw__layout_alloc_bands(struct tw_plan* pl, int32_t num_bands) {
  pl->row_src = tw__alloc((size_t)pl->rows, sizeof(tw_row_src));
  pl->bands = tw__alloc((size_t)num_bands, sizeof(tw_band));
  pl->layout_bands = tw__alloc((size_t)num_bands, sizeof(tw_band));
  pl->segments = tw__alloc((size_t)num_bands, sizeof(tw_segment)); /* worst case: one per band */
  pl->tiles = tw__alloc((size_t)num_bands * (size_t)pl->col_tiles, sizeof(tw_tile));
  if (!pl->row_src || !pl->bands || !pl->layout_bands || !pl->segments || !pl->tiles)
    return tw__fail(TW_ERR_OUT_OF_MEMORY, "plan: out of host memory (%d rows, %d bands)", pl->rows,
                    num_bands);
  return TW_SUCCESS;
}

/* Row owners (a function of the counts): each group's rows belong to its owner, with token and
 * slot -1 until tw__place_tokens fills them; the tail of each padded remote group is padding
 * (owner -1). Every row is written exactly once. */
static void tw__place_owners(struct tw_plan* pl, const tw__scratch* sc) {
  const int32_t W = pl->problem.world_size, E = pl->local_experts, TM = pl->tm, rank = pl->rank;
  for (int32_t e = 0; e < E; e++) {
    for (int32_t q = 1; q <= W; q++) {
      const int32_t o = (rank + q) % W;
      const size_t gi = (size_t)e * W + o;
      const int32_t c = sc->cnt[gi], g0 = sc->grp_row0[gi];
      const int32_t end = g0 + (int32_t)tw__group_span(q, W, c, TM);
      for (int32_t r = g0; r < g0 + c; r++) pl->row_src[r] = (tw_row_src){o, -1, -1};
      for (int32_t r = g0 + c; r < end; r++) pl->row_src[r] = (tw_row_src){-1, -1, -1};
    }
  }
}

/* Row sources of the routed rows: pass 2 places every routed row in (token, slot) order within
 * its group (owners ascending, tokens ascending, slots ascending); padding rows keep what
 * tw__place_owners wrote. */
static void tw__place_tokens(struct tw_plan* pl, const struct tw_routing* rt, tw__scratch* sc) {
  const int32_t W = pl->problem.world_size, K = pl->problem.top_k, ET = pl->problem.experts;
  const int32_t E = pl->local_experts, rank = pl->rank;
  /* Other ranks' experts write to `sink` and do not advance; ours advance through their group.
   * The stores are unconditional so that the loop has no data-dependent branch. */
  tw_row_src sink;
  for (int32_t g = 0; g < ET; g++) {
    sc->cursor[g] = &sink;
    sc->step[g] = 0;
  }
  for (int32_t e = 0; e < E; e++) sc->step[(size_t)rank * E + e] = 1;
  for (int32_t o = 0; o < W; o++) {
    const int32_t* ids = rt->expert_ids[o];
    tw_row_src** cur = sc->cursor;
    const int32_t* step = sc->step;
    for (int32_t e = 0; e < E; e++)
      cur[(size_t)rank * E + e] = pl->row_src + sc->grp_row0[(size_t)e * W + o];
    for (int32_t t = 0; t < rt->tokens[o]; t++) {
      const int32_t* tid = ids + (size_t)t * K;
      for (int32_t j = 0; j < K; j++) {
        const int32_t g = tid[j];
        *cur[g] = (tw_row_src){o, t, j};
        cur[g] += step[g];
      }
    }
  }
}

/* Where each of our groups lands at its owner: after the rows of lower-numbered senders, then
 * after our lower-numbered experts' rows for that owner. */
static void tw__dest_rows(const struct tw_plan* pl, tw__scratch* sc) {
  const int32_t W = pl->problem.world_size, E = pl->local_experts;
  for (int32_t o = 0; o < W; o++) {
    int64_t at = sc->before[o];
    for (int32_t e = 0; e < E; e++) {
      sc->dest_row[(size_t)e * W + o] = at;
      at += sc->cnt[(size_t)e * W + o];
    }
  }
}

/* Bands in layout order: expert by expert, groups in layout order (owners r+1, ..., r-1, then
 * r: an expert's remote bands come before its local ones), bands in row order. A band sends its
 * first valid_rows rows to dest; the rest are padding, or in the band shared by the last remote
 * group and the local group, local rows. The schedule orders them (tw__plan_set_schedule). Sets
 * num_bands, send_bytes and num_tiles. */
static tw_status tw__layout_bands(struct tw_plan* pl, const tw__scratch* sc, int32_t num_bands) {
  const int32_t W = pl->problem.world_size, E = pl->local_experts, TM = pl->tm, rank = pl->rank;
  const int64_t row_bytes = (int64_t)pl->problem.hidden * 2; /* bf16 */
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
      const int32_t c = o == rank ? 0 : sc->cnt[gi], g0 = sc->grp_row0[gi];
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
          band->dest_offset = (sc->dest_row[gi] + (r0 - g0)) * row_bytes;
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
  if (nb != num_bands)
    return tw__fail(TW_ERR_INTERNAL, "plan: %d bands placed, %d counted", nb, num_bands);
  pl->num_bands = nb;
  pl->send_bytes = send_rows * row_bytes;
  pl->num_tiles = nb * pl->col_tiles;
  return TW_SUCCESS;
}

/* Receive side: rows others return here, ordered by source rank then its expert index, which
 * is ascending global expert id with our own experts skipped. slot_base[g] is the first
 * slot_row value of our rows of expert g: a receive row for another rank's expert, recv_rows
 * plus the local group's first row for ours. */
static void tw__receive_side(struct tw_plan* pl, const tw__scratch* sc) {
  const int32_t W = pl->problem.world_size, ET = pl->problem.experts;
  const int32_t E = pl->local_experts, TM = pl->tm, rank = pl->rank;
  const int32_t* own = sc->hist + (size_t)rank * ET; /* this rank's assignments per global expert */
  int64_t recv = 0;
  for (int32_t s = 0; s < W; s++) {
    pl->recv_bands[s] = 0;
    if (s == rank) continue;
    for (int32_t e = 0; e < E; e++) {
      int32_t g = s * E + e;
      pl->slot_base[g] = (int32_t)recv;
      recv += own[g];
      pl->recv_bands[s] += (int32_t)tw__ceil_div(own[g], TM);
    }
  }
  pl->recv_rows = (int32_t)recv;
  for (int32_t e = 0; e < E; e++)
    pl->slot_base[(size_t)rank * E + e] = pl->recv_rows + sc->grp_row0[(size_t)e * W + rank];
}

/* Where this rank's rows of global expert g start in the layout of g's rank d = g / E (group
 * (g % E, rank) there): d's layout walked by the same rule as tw__place_groups, from the counts
 * alone. -1 where the row does not fit int32 (d's own plan then fails). O(W * E_total). */
static void tw__send_rows(struct tw_plan* pl, const tw__scratch* sc) {
  const int32_t W = pl->problem.world_size, ET = pl->problem.experts;
  const int32_t E = pl->local_experts, TM = pl->tm, me = pl->rank;
  for (int32_t d = 0; d < W; d++) {
    int64_t row = 0;
    for (int32_t e = 0; e < E; e++) {
      const int32_t g = d * E + e;
      for (int32_t q = 1; q <= W; q++) {
        const int32_t o = (d + q) % W;
        if (o == me) pl->send_row0[g] = row <= INT32_MAX ? (int32_t)row : -1;
        row += tw__group_span(q, W, sc->hist[(size_t)o * ET + g], TM);
      }
    }
  }
}

/* Everything the count matrix in sc->hist decides (see the file comment). */
static tw_status tw__layout_core(struct tw_plan* pl, tw__scratch* sc) {
  int32_t num_bands = 0;
  tw__count_groups(pl, sc);
  tw_status st = tw__place_groups(pl, sc, &num_bands);
  if (st == TW_SUCCESS) st = tw__layout_alloc_bands(pl, num_bands);
  if (st == TW_SUCCESS) {
    tw__place_owners(pl, sc);
    tw__dest_rows(pl, sc);
    st = tw__layout_bands(pl, sc, num_bands);
  }
  if (st == TW_SUCCESS) {
    tw__receive_side(pl, sc);
    tw__send_rows(pl, sc);
  }
  /* The bands' order is tw__plan_set_schedule's; the segments are built by the model
   * (tw__model_choose), once per candidate mgb. */
  return st;
}

tw_status tw__plan_layout(struct tw_plan* pl, const struct tw_routing* rt) {
  tw__scratch sc = {0};
  const int32_t K = pl->problem.top_k, ET = pl->problem.experts, rank = pl->rank;
  tw_status st = tw__layout_alloc(pl, &sc);
  if (st == TW_SUCCESS) {
    pl->slot_row = tw__alloc((size_t)rt->tokens[rank] * (size_t)K, sizeof(int32_t));
    if (pl->slot_row == NULL) st = tw__fail(TW_ERR_OUT_OF_MEMORY, "plan: out of host memory");
  }
  if (st == TW_SUCCESS) {
    tw__hist_from_routing(pl, rt, &sc);
    st = tw__layout_core(pl, &sc);
  }
  if (st == TW_SUCCESS) {
    /* The per-token parts: every routed row's (token, slot), and where each of our (token,
     * slot) rows lands (slot_row), by one cursor per global expert from slot_base. */
    tw__place_tokens(pl, rt, &sc);
    memcpy(sc.slot_cur, pl->slot_base, (size_t)ET * sizeof(int32_t));
    const int32_t* ids = rt->expert_ids[rank];
    const size_t n = (size_t)rt->tokens[rank] * (size_t)K;
    for (size_t i = 0; i < n; i++) pl->slot_row[i] = sc.slot_cur[ids[i]]++;
  }
  tw__scratch_free(&sc);
  return st;
}

tw_status tw__plan_layout_counts(struct tw_plan* pl, const int32_t* counts) {
  tw__scratch sc = {0};
  const int32_t W = pl->problem.world_size, ET = pl->problem.experts;
  tw_status st = tw__layout_alloc(pl, &sc);
  if (st == TW_SUCCESS) {
    memcpy(sc.hist, counts, (size_t)W * (size_t)ET * sizeof(int32_t));
    st = tw__layout_core(pl, &sc);
  }
  tw__scratch_free(&sc);
  return st;
}
