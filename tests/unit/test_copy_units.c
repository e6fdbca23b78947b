/*
 * test_copy_units.c: the units of the layer's banded copy (tw__plan_copy_units), which an
 * overlapped GEMM1 relies on to start each band once its counter reaches the band's rows. On
 * random count matrices (W = 1..6, balanced and skewed, ranks with 0, 1, odd and full token
 * counts, tm 64 and 128), with every rank's plan from the matrix and its padding ranges found as
 * the dispatch finds them, for every destination:
 *  - every row of its layout is written by exactly one unit of one source, a routed row by the
 *    rank that owns its token (row_src) and a padding row by the destination itself;
 *  - each unit lies inside one band and names that band's counter (tw_band_counter), and the
 *    rows announced on a band's counter add up to the band's rows; no unit names a counter of
 *    no band, and every counter is below the window's rows_max / TM + E + 1;
 * and for every source: its units to each destination come in local-expert order (the
 * destination's GEMM1 order), their slot ranges partition its slots (send_off the groups'
 * prefix), and there are no more of them than tw__copy_units_max. Refusals: too little room, NULL
 * arguments.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "plan.h"
#include "tilewave.h"
#include "tw_test.h"
#include "tw_test_random.h"

static uint64_t g_rng;

static int32_t rnd_in(int32_t lo, int32_t hi) { /* [lo, hi] */
  return tw_test_rnd_in(&g_rng, lo, hi);
}

/* The padding ranges of a rank's own layout, as the dispatch's upload finds them: the rows past
 * the valid ones of a remote band that belong to nobody. (first row, rows) pairs; returns n. */
static int32_t pads_of(const struct tw_plan* pl, int32_t* pads) {
  int32_t n = 0;
  for (int32_t i = 0; i < pl->num_bands; i++) {
    const tw_band* b = &pl->layout_bands[i];
    if (b->dest == pl->rank || b->valid_rows >= b->rows ||
        pl->row_src[b->row0 + b->valid_rows].owner >= 0)
      continue;
    pads[2 * n] = b->row0 + b->valid_rows;
    pads[2 * n + 1] = b->rows - b->valid_rows;
    n++;
  }
  return n;
}

static void check_world(const tw_problem* p, const int32_t* counts, const char* what) {
  const int32_t W = p->world_size, ET = p->experts, E = ET / W;
  tw_plan_t* pl = calloc((size_t)W, sizeof *pl);
  tw_copy_unit** units = calloc((size_t)W, sizeof *units);
  int32_t* nunits = calloc((size_t)W, sizeof *nunits);
  const int64_t cap = tw__copy_units_max(p, p->tile_m);
  int ok = pl && units && nunits;
  for (int32_t r = 0; ok && r < W; r++) {
    CHECK_OK(tw__plan_create_from_counts(p, counts, r, NULL, &pl[r]));
    if (pl[r] == NULL) {
      ok = 0;
      break;
    }
    int32_t* pads = malloc(((size_t)2 * pl[r]->num_bands + 2) * sizeof(int32_t));
    int32_t* send_off = malloc((size_t)ET * sizeof(int32_t));
    units[r] = malloc((size_t)cap * sizeof(tw_copy_unit));
    const int32_t np = pads_of(pl[r], pads);
    CHECK_OK(
        tw__plan_copy_units(pl[r], counts, pads, np, send_off, units[r], (int32_t)cap, &nunits[r]));
    /* The source's side: its slot ranges partition its slots. */
    const int32_t* mine = counts + (size_t)r * ET;
    int64_t slots = 0;
    for (int32_t g = 0; g < ET; g++) slots += mine[g];
    char* seen = calloc((size_t)slots + 1, 1);
    int bad_off = 0, bad_slot = 0;
    for (int32_t g = 0, off = 0; g < ET; off += mine[g], g++) bad_off += send_off[g] != off;
    for (int32_t u = 0; u < nunits[r]; u++) {
      const tw_copy_unit* x = &units[r][u];
      for (int32_t j = 0; x->slot0 >= 0 && j < x->rows; j++) {
        const int64_t s = (int64_t)x->slot0 + j;
        if (s < 0 || s >= slots || seen[s]++) bad_slot++;
      }
    }
    for (int64_t s = 0; s < slots; s++) bad_slot += seen[s] != 1;
    CHECKF(bad_off == 0 && bad_slot == 0, "%s: rank %d: %d send offsets, %d slots not sent once",
           what, r, bad_off, bad_slot);
    CHECKF(nunits[r] <= cap, "%s: rank %d: %d units, at most %lld", what, r, nunits[r],
           (long long)cap);
    free(seen);
    free(pads);
    free(send_off);
  }
  /* The destinations' side. */
  for (int32_t d = 0; ok && d < W; d++) {
    const struct tw_plan* D = pl[d];
    const int32_t TM = D->tm, nb = D->num_bands;
    const int64_t words = D->rows / TM + E + 1;
    int32_t* band_of = malloc((size_t)words * sizeof(int32_t)); /* counter -> layout band */
    int64_t* announced = calloc((size_t)words, sizeof(int64_t));
    unsigned char* written = calloc((size_t)D->rows + 1, 1);
    for (int64_t w = 0; w < words; w++) band_of[w] = -1;
    int bad_counter = 0;
    for (int32_t b = 0; b < nb; b++) {
      const tw_band* x = &D->layout_bands[b];
      const int32_t w = tw_band_counter(x->row0, x->expert, TM);
      if (w < 0 || w >= words || band_of[w] >= 0)
        bad_counter++;
      else
        band_of[w] = b;
    }
    CHECKF(bad_counter == 0, "%s: rank %d: %d bands whose counters repeat or leave the window",
           what, d, bad_counter);
    int bad_unit = 0, bad_owner = 0, bad_order = 0;
    for (int32_t s = 0; s < W; s++) {
      int32_t last_e = -1;
      for (int32_t u = 0; u < nunits[s]; u++) {
        const tw_copy_unit* x = &units[s][u];
        if (x->dest != d) continue;
        const int32_t b = x->band >= 0 && x->band < words ? band_of[x->band] : -1;
        if (b < 0) {
          bad_unit++;
          continue;
        }
        const tw_band* band = &D->layout_bands[b];
        if (x->rows < 1 || x->row0 < band->row0 || x->row0 + x->rows > band->row0 + band->rows)
          bad_unit++;
        if (band->expert < last_e) bad_order++;
        last_e = band->expert;
        announced[x->band] += x->rows;
        for (int32_t j = 0; j < x->rows && x->row0 + j < D->rows; j++) {
          const int32_t row = x->row0 + j;
          written[row]++;
          const int32_t owner = D->row_src[row].owner;
          bad_owner += x->slot0 >= 0 ? owner != s : (owner != -1 || s != d);
        }
      }
    }
    int bad_rows = 0, bad_sum = 0;
    for (int32_t row = 0; row < D->rows; row++) bad_rows += written[row] != 1;
    for (int32_t b = 0; b < nb; b++) {
      const tw_band* x = &D->layout_bands[b];
      bad_sum += announced[tw_band_counter(x->row0, x->expert, TM)] != x->rows;
    }
    CHECKF(bad_unit == 0 && bad_order == 0,
           "%s: rank %d: %d units outside their band, %d out of expert order", what, d, bad_unit,
           bad_order);
    CHECKF(bad_rows == 0 && bad_owner == 0,
           "%s: rank %d: %d of %d rows not written exactly once, %d by the wrong rank", what, d,
           bad_rows, D->rows, bad_owner);
    CHECKF(bad_sum == 0, "%s: rank %d: %d of %d bands announced with other than their rows", what,
           d, bad_sum, nb);
    free(band_of);
    free(announced);
    free(written);
  }
  for (int32_t r = 0; r < W; r++) {
    if (pl && pl[r]) tw_plan_destroy(pl[r]);
    if (units) free(units[r]);
  }
  free(pl);
  free(units);
  free(nunits);
}

static void test_units_cover_every_row_once(void) {
  g_rng = tw_test_seed ^ 0xba2d;
  int worlds = 0;
  for (int it = 0; it < 120; it++) {
    const int32_t W = 1 + it % 6;
    tw_problem p = TW_PROBLEM_INIT;
    p.world_size = W;
    p.experts = W * rnd_in(1, 8);
    p.top_k = rnd_in(1, p.experts < 6 ? p.experts : 6);
    p.hidden = 64 * rnd_in(1, 8);
    p.ffn = 8 * rnd_in(1, 64);
    p.max_tokens = rnd_in(1, 400);
    p.tile_m = rnd_in(0, 1) ? 64 : 128;
    if (tw_problem_validate(&p) != TW_SUCCESS) continue;
    int32_t tokens[TW_MAX_RANKS];
    tw_test_token_kinds(&g_rng, W, p.max_tokens, tokens);
    tw_routing_t rt =
        tw_test_router_routing(&p, (tw_router)rnd_in(0, 2), tokens, tw_test_seed + (uint64_t)it);
    CHECKF(rt != NULL, "iteration %d: no routing: %s", it, tw_last_error());
    if (rt == NULL) continue;
    int32_t* counts = tw_test_count_matrix(&p, rt);
    char what[96];
    snprintf(what, sizeof what, "iteration %d (W %d, E %d, k %d, tm %d)", it, W, p.experts, p.top_k,
             p.tile_m);
    check_world(&p, counts, what);
    worlds++;
    free(counts);
    tw_routing_destroy(rt);
  }
  CHECKF(worlds >= 100, "only %d random worlds were valid problems", worlds);
}

static void test_refusals(void) {
  tw_problem p = TW_PROBLEM_INIT;
  p.world_size = 2;
  p.experts = 4;
  p.top_k = 2;
  p.hidden = 128;
  p.ffn = 64;
  p.max_tokens = 300;
  p.tile_m = 64;
  CHECK_OK(tw_problem_validate(&p));
  int32_t counts[2 * 4] = {100, 50, 200, 250, 0, 0, 0, 0};
  tw_plan_t pl = NULL;
  CHECK_OK(tw__plan_create_from_counts(&p, counts, 0, NULL, &pl));
  if (pl == NULL) return;
  tw_copy_unit units[64];
  int32_t off[4], n = -1;
  CHECK_OK(tw__plan_copy_units(pl, counts, NULL, 0, off, units, 64, &n));
  CHECK(n > 1);
  CHECK_STATUS(tw__plan_copy_units(pl, counts, NULL, 0, off, units, n - 1, &n),
               TW_ERR_INVALID_SIZE);
  CHECK_STATUS(tw__plan_copy_units(NULL, counts, NULL, 0, off, units, 64, &n), TW_ERR_NULL_POINTER);
  CHECK_STATUS(tw__plan_copy_units(pl, counts, NULL, 1, off, units, 64, &n), TW_ERR_NULL_POINTER);
  tw_plan_destroy(pl);
}

TW_TEST_MAIN(TW_TEST(tw_test_seed_setup), TW_TEST(test_units_cover_every_row_once),
             TW_TEST(test_refusals))
