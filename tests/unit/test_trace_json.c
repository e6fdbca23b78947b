/*
 * test_trace_json.c: the conversion of a traced call's records into trace-event JSON
 * (harness/trace_json.c), on synthetic records of two ranks of a combine and a third of a layer's
 * first half (dispatch scan, send, wait, GEMM1): the spans built from them (names, tracks, times,
 * durations, nesting), what is left as instants, the metadata events, and the file.
 * `test_trace_json --out FILE` also keeps the file, which ctest then hands to
 * tests/python/trace_check.py (the format's own checks, by a JSON parser).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trace_json.h"
#include "tw_test.h"

static const char* g_out = NULL; /* --out FILE */

#define T0 1000000000ull /* the earliest record: ts 0 */

static tw_trace_record rec(uint64_t ns_from_t0, int kind, int cta, uint32_t index) {
  tw_trace_record r;
  memset(&r, 0, sizeof r);
  r.ns = T0 + ns_from_t0;
  r.kind = (uint16_t)kind;
  r.cta = (uint16_t)cta;
  r.index = index;
  return r;
}

/* Rank 0: P = 2 CTAs with 4 tiles (CTA 0's tile 2 begins before tile 0 is published: a second
 * track), C = 2 consumer CTAs with 3 units (unit 0 waits for a credit), 2 reduction CTAs; the
 * records out of order, one duplicate and one foreign record. Rank 1: one tile, one unit that
 * only got claimed (a timeout), one reduction CTA without its end. */
static tw_trace_record r0[64], r1[16], r2[32];
static int n0, n1, n2;
static tw_tile tiles0[4], g1tiles2[3];

/* Rank 2, a layer's dispatch and GEMM1: two scan CTAs (count on both, place on CTA 0), two copy
 * CTAs (CTA 0 releases the arrivals), the wait for three sources, three GEMM1 tiles on P = 2
 * (CTA 0's tile 2 begins before tile 0 is stored: a second track) and one GEMM1 record outside
 * the tile list. */
static void build_layer_records(void) {
  n2 = 0;
  r2[n2++] = rec(0, TW_TRACE_SCAN_BEGIN, 0, 0);
  r2[n2++] = rec(800, TW_TRACE_SCAN_END, 0, 0);
  r2[n2++] = rec(10, TW_TRACE_SCAN_BEGIN, 1, 0);
  r2[n2++] = rec(700, TW_TRACE_SCAN_END, 1, 0);
  r2[n2++] = rec(5000, TW_TRACE_SCAN_BEGIN, 0, 1);
  r2[n2++] = rec(5600, TW_TRACE_SCAN_END, 0, 1);
  r2[n2++] = rec(6000, TW_TRACE_SEND_BEGIN, 0, 0);
  r2[n2++] = rec(6100, TW_TRACE_SEND_CREDIT, 0, 0);
  r2[n2++] = rec(9000, TW_TRACE_SEND_END, 0, 40);
  r2[n2++] = rec(6010, TW_TRACE_SEND_BEGIN, 1, 0);
  r2[n2++] = rec(6500, TW_TRACE_SEND_CREDIT, 1, 0);
  r2[n2++] = rec(8800, TW_TRACE_SEND_END, 1, 38);
  r2[n2++] = rec(9050, TW_TRACE_SEND_ARRIVE, 0, 3);
  r2[n2++] = rec(6020, TW_TRACE_RECV_BEGIN, 0, 0);
  r2[n2++] = rec(9400, TW_TRACE_RECV_ARRIVED, 0, 1);
  r2[n2++] = rec(9100, TW_TRACE_RECV_ARRIVED, 0, 0);
  r2[n2++] = rec(9800, TW_TRACE_RECV_ARRIVED, 0, 2);
  r2[n2++] = rec(10000, TW_TRACE_GEMM1_BEGIN, 0, 0);
  r2[n2++] = rec(12000, TW_TRACE_GEMM1_PUBLISH, 0, 0);
  r2[n2++] = rec(11500, TW_TRACE_GEMM1_BEGIN, 0, 2);
  r2[n2++] = rec(14000, TW_TRACE_GEMM1_PUBLISH, 0, 2);
  r2[n2++] = rec(10100, TW_TRACE_GEMM1_BEGIN, 1, 1);
  r2[n2++] = rec(12100, TW_TRACE_GEMM1_PUBLISH, 1, 1);
  r2[n2++] = rec(13000, TW_TRACE_GEMM1_PUBLISH, 1, 5); /* not in the list */
  for (int t = 0; t < 3; t++) {
    memset(&g1tiles2[t], 0, sizeof g1tiles2[t]);
    g1tiles2[t].expert = t;
    g1tiles2[t].row0 = t * 128;
    g1tiles2[t].col0 = 128 * (t % 2);
  }
}

static void layer_rank_of(tw__trace_rank* r) {
  memset(r, 0, sizeof *r);
  r->rank = 2;
  r->records = r2;
  r->count = n2;
  r->budget = 66, r->gemm1_ctas = 2;
  r->num_gemm1_tiles = 3;
  r->gemm1_tiles = g1tiles2;
}

static void build_records(void) {
  n0 = n1 = 0;
  /* producer, rank 0 */
  r0[n0++] = rec(0, TW_TRACE_TILE_BEGIN, 0, 0);
  r0[n0++] = rec(5000, TW_TRACE_TILE_PUBLISH, 0, 0);
  r0[n0++] = rec(4000, TW_TRACE_TILE_BEGIN, 0, 2); /* before tile 0's publish */
  r0[n0++] = rec(9000, TW_TRACE_TILE_PUBLISH, 0, 2);
  r0[n0++] = rec(100, TW_TRACE_TILE_BEGIN, 1, 1);
  r0[n0++] = rec(3000, TW_TRACE_TILE_PUBLISH, 1, 1);
  r0[n0++] = rec(3000, TW_TRACE_TILE_BEGIN, 1, 3); /* right after: same track */
  r0[n0++] = rec(6000, TW_TRACE_TILE_PUBLISH, 1, 3);
  /* consumer, rank 0: CTA 0 units 0 and 2, CTA 1 unit 1 */
  r0[n0++] = rec(200, TW_TRACE_UNIT_CLAIM, 0, 0);
  r0[n0++] = rec(3100, TW_TRACE_UNIT_BANDS, 0, 0);
  r0[n0++] = rec(3500, TW_TRACE_UNIT_CREDIT, 0, 0);
  r0[n0++] = rec(4500, TW_TRACE_UNIT_COPY, 0, 0);
  r0[n0++] = rec(4600, TW_TRACE_UNIT_CLAIM, 0, 2);
  r0[n0++] = rec(9100, TW_TRACE_UNIT_BANDS, 0, 2);
  r0[n0++] = rec(9900, TW_TRACE_UNIT_COPY, 0, 2);
  r0[n0++] = rec(10000, TW_TRACE_UNIT_CLAIM, 0, 3); /* past the last unit: not a unit */
  r0[n0++] = rec(10500, TW_TRACE_ANNOUNCE, 0, TW_TRACE_ANNOUNCE_INDEX(1, 2));
  r0[n0++] = rec(10600, TW_TRACE_CONSUMER_END, 0, 0);
  r0[n0++] = rec(250, TW_TRACE_UNIT_CLAIM, 1, 1);
  r0[n0++] = rec(6100, TW_TRACE_UNIT_BANDS, 1, 1);
  r0[n0++] = rec(7000, TW_TRACE_UNIT_COPY, 1, 1);
  r0[n0++] = rec(7100, TW_TRACE_UNIT_CLAIM, 1, 4);
  r0[n0++] = rec(7400, TW_TRACE_ANNOUNCE, 1, TW_TRACE_ANNOUNCE_INDEX(1, 1));
  r0[n0++] = rec(7500, TW_TRACE_CONSUMER_END, 1, 0);
  /* reduction, rank 0 */
  r0[n0++] = rec(11000, TW_TRACE_REDUCE_BEGIN, 0, 0);
  r0[n0++] = rec(12000, TW_TRACE_REDUCE_ARRIVED, 0, 0);
  r0[n0++] = rec(15000, TW_TRACE_REDUCE_END, 0, 0);
  r0[n0++] = rec(11100, TW_TRACE_REDUCE_BEGIN, 1, 0);
  r0[n0++] = rec(12100, TW_TRACE_REDUCE_ARRIVED, 1, 0);
  r0[n0++] = rec(14000, TW_TRACE_REDUCE_END, 1, 0);
  r0[n0++] = rec(5000, TW_TRACE_TILE_PUBLISH, 0, 0); /* duplicate */
  r0[n0++] = rec(5000, TW_TRACE_TILE_PUBLISH, 0, 7); /* tile 7: not in the plan */
  /* out of order: reverse the array */
  for (int i = 0; i < n0 / 2; i++) {
    const tw_trace_record t = r0[i];
    r0[i] = r0[n0 - 1 - i];
    r0[n0 - 1 - i] = t;
  }
  for (int t = 0; t < 4; t++) {
    memset(&tiles0[t], 0, sizeof tiles0[t]);
    tiles0[t].band = t / 2;
    tiles0[t].expert = 0;
    tiles0[t].row0 = t / 2 * 128;
    tiles0[t].col0 = t % 2 * 256;
  }
  /* rank 1 */
  r1[n1++] = rec(300, TW_TRACE_TILE_BEGIN, 0, 0);
  r1[n1++] = rec(2300, TW_TRACE_TILE_PUBLISH, 0, 0);
  r1[n1++] = rec(400, TW_TRACE_UNIT_CLAIM, 0, 0);
  r1[n1++] = rec(11000, TW_TRACE_REDUCE_BEGIN, 0, 0);
}

static void ranks_of(tw__trace_rank* r) {
  memset(r, 0, 2 * sizeof *r);
  r[0].rank = 0;
  r[0].records = r0;
  r[0].count = n0;
  r[0].budget = 66, r[0].producer_ctas = 2, r[0].consumer_ctas = 2, r[0].reduce_ctas = 2;
  r[0].num_tiles = 4, r[0].total_units = 3, r[0].coalesce = 2;
  r[0].schedule = "remote-first";
  r[0].predicted_us = 12.5;
  r[0].tiles = tiles0;
  r[1].rank = 1;
  r[1].records = r1;
  r[1].count = n1;
  r[1].dropped = 3;
  r[1].budget = 66, r[1].producer_ctas = 1, r[1].consumer_ctas = 1, r[1].reduce_ctas = 1;
  r[1].num_tiles = 1, r[1].total_units = 1, r[1].coalesce = 1;
}

/* The event of (pid, tid, name) starting at ts (ns), or NULL. */
static const tw__trace_event* find(const tw__trace_event* ev, int64_t n, int pid, int32_t tid,
                                   const char* name, int64_t ts) {
  for (int64_t i = 0; i < n; i++)
    if (ev[i].pid == pid && ev[i].tid == tid && ev[i].ts == ts && strcmp(ev[i].name, name) == 0)
      return &ev[i];
  return NULL;
}

static int64_t arg_of(const tw__trace_event* e, const char* key) {
  for (int i = 0; e && i < e->nargs; i++)
    if (strcmp(e->key[i], key) == 0) return e->val[i];
  return -1;
}

/* The label of (pid, tid)'s thread_name event, or NULL. */
static const char* thread_label(const tw__trace_event* ev, int64_t n, int pid, int32_t tid) {
  for (int64_t i = 0; i < n; i++)
    if (ev[i].ph == 'M' && ev[i].pid == pid && ev[i].tid == tid &&
        strcmp(ev[i].name, "thread_name") == 0)
      return ev[i].label;
  return NULL;
}

static void check_file_order(const tw__trace_event* ev, int64_t n);

static void test_spans_and_tracks(void) {
  build_records();
  tw__trace_rank ranks[2];
  ranks_of(ranks);
  tw__trace_event* ev = NULL;
  int64_t n = 0;
  tw__trace_stats st;
  CHECK(tw__trace_build(ranks, 2, &ev, &n, &st) == 0);
  if (ev == NULL) return;
  CHECK(st.t0_ns == T0);
  CHECK(st.tiles == 5);         /* 4 on rank 0, 1 on rank 1 */
  CHECK(st.units == 3);         /* rank 1's unit never finished */
  CHECK(st.reduce_ctas == 2);   /* rank 1's never ended */
  CHECK(st.consumer_ctas == 2); /* rank 1's CTA never ended */
  CHECK(st.duplicates == 1);
  CHECK(st.foreign == 1);
  CHECK(st.overlap_tracks == 1);
  CHECKF(st.partial == 3, "partial %lld", (long long)st.partial); /* claim, begin, CTA */
  CHECK(st.clamped == 0);

  const int32_t p0 = tw__trace_tid(0, 0, 0), p0b = tw__trace_tid(0, 0, 1),
                p1 = tw__trace_tid(0, 1, 0);
  const int32_t c0 = tw__trace_tid(1, 0, 0), c1 = tw__trace_tid(1, 1, 0);
  const int32_t q0 = tw__trace_tid(2, 0, 0);
  /* Producer: tile 2 overlaps tile 0 on CTA 0 -> the second track; tiles 1 and 3 touch. */
  const tw__trace_event* e = find(ev, n, 0, p0, "tile", 0);
  CHECK(e != NULL && e->ph == 'X' && e->dur == 5000 && arg_of(e, "tile") == 0);
  CHECK(arg_of(e, "band") == 0 && arg_of(e, "col0") == 0);
  e = find(ev, n, 0, p0b, "tile", 4000);
  CHECK(e != NULL && e->dur == 5000 && arg_of(e, "tile") == 2 && arg_of(e, "row0") == 128);
  CHECK(find(ev, n, 0, p1, "tile", 100) != NULL && find(ev, n, 0, p1, "tile", 3000) != NULL);
  /* Consumer: unit 0's phases, the CTA span around its units, the announcement. */
  e = find(ev, n, 0, c0, "unit", 200);
  CHECK(e != NULL && e->dur == 4300 && arg_of(e, "unit") == 0);
  e = find(ev, n, 0, c0, "wait bands", 200);
  CHECK(e != NULL && e->dur == 2900);
  e = find(ev, n, 0, c0, "wait credit", 3100);
  CHECK(e != NULL && e->dur == 400);
  e = find(ev, n, 0, c0, "copy", 3500);
  CHECK(e != NULL && e->dur == 1000);
  e = find(ev, n, 0, c0, "copy", 9100); /* unit 2: no credit wait, the copy after the bands */
  CHECK(e != NULL && e->dur == 800 && arg_of(e, "unit") == 2);
  CHECK(find(ev, n, 0, c0, "wait credit", 9100) == NULL);
  e = find(ev, n, 0, c0, "consumer CTA", 200);
  CHECK(e != NULL && e->dur == 10400);
  e = find(ev, n, 0, c0, "announce", 10500);
  CHECK(e != NULL && e->ph == 'i' && arg_of(e, "owner") == 1 && arg_of(e, "units") == 2);
  e = find(ev, n, 0, c1, "unit", 250);
  CHECK(e != NULL && e->dur == 6750 && arg_of(e, "unit") == 1);
  /* Reduction. */
  e = find(ev, n, 0, q0, "reduce CTA", 11000);
  CHECK(e != NULL && e->dur == 4000);
  e = find(ev, n, 0, q0, "wait arrivals", 11000);
  CHECK(e != NULL && e->dur == 1000);
  e = find(ev, n, 0, q0, "reduce", 12000);
  CHECK(e != NULL && e->dur == 3000);
  /* Rank 1: the complete tile, and instants for what never finished. */
  CHECK(find(ev, n, 1, p0, "tile", 300) != NULL);
  e = find(ev, n, 1, c0, "unit claim", 400);
  CHECK(e != NULL && e->ph == 'i' && arg_of(e, "unit") == 0);
  CHECK(find(ev, n, 1, q0, "reduce begin", 11000) != NULL);
  CHECK(find(ev, n, 1, c0, "unit", 400) == NULL);

  /* Names: processes and every track with events. */
  CHECK(thread_label(ev, n, 0, p0) && strcmp(thread_label(ev, n, 0, p0), "producer CTA 0") == 0);
  CHECK(thread_label(ev, n, 0, p0b) &&
        strcmp(thread_label(ev, n, 0, p0b), "producer CTA 0 (overlap 1)") == 0);
  CHECK(thread_label(ev, n, 0, c1) && strcmp(thread_label(ev, n, 0, c1), "consumer CTA 1") == 0);
  CHECK(thread_label(ev, n, 1, q0) && strcmp(thread_label(ev, n, 1, q0), "reduce CTA 0") == 0);
  int procs = 0;
  for (int64_t i = 0; i < n; i++)
    if (ev[i].ph == 'M' && strcmp(ev[i].name, "process_name") == 0)
      procs += strcmp(ev[i].label, ev[i].pid == 0 ? "rank 0" : "rank 1") == 0;
  CHECK(procs == 2);

  check_file_order(ev, n);
  free(ev);
}

/* File order: metadata first; then per (pid, tid) by time, longer first; durations >= 0; the X
 * events of a track nest; every track with events is named. */
static void check_file_order(const tw__trace_event* ev, int64_t n) {
  int64_t first_plain = -1;
  for (int64_t i = 0; i < n; i++) {
    if (ev[i].ph != 'M' && first_plain < 0) first_plain = i;
    if (first_plain >= 0)
      CHECKF(ev[i].ph != 'M', "metadata event %lld after the others", (long long)i);
    CHECK(ev[i].dur >= 0 && ev[i].ts >= 0);
    if (ev[i].ph != 'M') CHECK(thread_label(ev, n, ev[i].pid, ev[i].tid) != NULL);
    if (i > first_plain && first_plain >= 0) {
      const tw__trace_event *a = &ev[i - 1], *b = &ev[i];
      const int later = a->pid < b->pid || (a->pid == b->pid && a->tid < b->tid) ||
                        (a->pid == b->pid && a->tid == b->tid &&
                         (a->ts < b->ts || (a->ts == b->ts && a->dur >= b->dur)));
      CHECKF(later, "events %lld and %lld out of order", (long long)i - 1, (long long)i);
    }
  }
  for (int64_t i = first_plain; i >= 0 && i < n; i++) {
    if (ev[i].ph != 'X') continue;
    /* The innermost earlier X event of the track that is still open at ev[i].ts must contain it. */
    for (int64_t j = i - 1; j >= first_plain; j--) {
      if (ev[j].pid != ev[i].pid || ev[j].tid != ev[i].tid) break;
      if (ev[j].ph != 'X' || ev[j].ts + ev[j].dur <= ev[i].ts) continue;
      CHECKF(ev[i].ts + ev[i].dur <= ev[j].ts + ev[j].dur, "%s at %lld overlaps %s at %lld",
             ev[i].name, (long long)ev[i].ts, ev[j].name, (long long)ev[j].ts);
      break;
    }
  }
}

static void test_layer_tracks(void) {
  build_layer_records();
  tw__trace_rank r;
  layer_rank_of(&r);
  tw__trace_event* ev = NULL;
  int64_t n = 0;
  tw__trace_stats st;
  CHECK(tw__trace_build(&r, 1, &ev, &n, &st) == 0);
  if (ev == NULL) return;
  CHECK(st.t0_ns == T0);
  CHECK(st.gemm1_tiles == 3 && st.tiles == 0 && st.units == 0);
  CHECKF(st.scan_ctas == 2 && st.send_ctas == 2 && st.recv_waits == 1, "scan %lld send %lld",
         (long long)st.scan_ctas, (long long)st.send_ctas);
  CHECK(st.foreign == 1 && st.duplicates == 0 && st.partial == 0 && st.clamped == 0);
  CHECK(st.overlap_tracks == 1);
  const int32_t g0 = tw__trace_tid(TW__TRACE_GEMM1, 0, 0),
                g0b = tw__trace_tid(TW__TRACE_GEMM1, 0, 1),
                g1 = tw__trace_tid(TW__TRACE_GEMM1, 1, 0);
  const int32_t s0 = tw__trace_tid(TW__TRACE_SCAN, 0, 0), s1 = tw__trace_tid(TW__TRACE_SCAN, 1, 0);
  const int32_t d0 = tw__trace_tid(TW__TRACE_SEND, 0, 0), d1 = tw__trace_tid(TW__TRACE_SEND, 1, 0);
  const int32_t w0 = tw__trace_tid(TW__TRACE_RECV, 0, 0);
  const tw__trace_event* e = find(ev, n, 2, g0, "gemm1 tile", 10000);
  CHECK(e != NULL && e->dur == 2000 && arg_of(e, "tile") == 0 && arg_of(e, "band") == -1);
  e = find(ev, n, 2, g0b, "gemm1 tile", 11500);
  CHECK(e != NULL && e->dur == 2500 && arg_of(e, "expert") == 2 && arg_of(e, "row0") == 256);
  e = find(ev, n, 2, g1, "gemm1 tile", 10100);
  CHECK(e != NULL && e->dur == 2000 && arg_of(e, "col0") == 128);
  e = find(ev, n, 2, s0, "count", 0);
  CHECK(e != NULL && e->dur == 800 && arg_of(e, "pass") == 0);
  e = find(ev, n, 2, s0, "place", 5000);
  CHECK(e != NULL && e->dur == 600 && arg_of(e, "pass") == 1);
  e = find(ev, n, 2, s1, "count", 10);
  CHECK(e != NULL && e->dur == 690);
  e = find(ev, n, 2, d0, "send CTA", 6000);
  CHECK(e != NULL && e->dur == 3000 && arg_of(e, "rows") == 40);
  e = find(ev, n, 2, d0, "wait credit", 6000);
  CHECK(e != NULL && e->dur == 100);
  e = find(ev, n, 2, d0, "copy rows", 6100);
  CHECK(e != NULL && e->dur == 2900 && arg_of(e, "rows") == 40);
  e = find(ev, n, 2, d1, "copy rows", 6500);
  CHECK(e != NULL && e->dur == 2300 && arg_of(e, "rows") == 38);
  e = find(ev, n, 2, d0, "arrivals released", 9050);
  CHECK(e != NULL && e->ph == 'i' && arg_of(e, "ranks") == 3);
  e = find(ev, n, 2, w0, "wait rows", 6020);
  CHECK(e != NULL && e->ph == 'X' && e->dur == 3780);
  e = find(ev, n, 2, w0, "rows arrived", 9400);
  CHECK(e != NULL && e->ph == 'i' && arg_of(e, "source") == 1);
  CHECK(thread_label(ev, n, 2, g0) && strcmp(thread_label(ev, n, 2, g0), "gemm1 CTA 0") == 0);
  CHECK(thread_label(ev, n, 2, g0b) &&
        strcmp(thread_label(ev, n, 2, g0b), "gemm1 CTA 0 (overlap 1)") == 0);
  CHECK(thread_label(ev, n, 2, s1) &&
        strcmp(thread_label(ev, n, 2, s1), "dispatch scan CTA 1") == 0);
  CHECK(thread_label(ev, n, 2, d0) &&
        strcmp(thread_label(ev, n, 2, d0), "dispatch send CTA 0") == 0);
  CHECK(thread_label(ev, n, 2, w0) && strcmp(thread_label(ev, n, 2, w0), "dispatch wait") == 0);
  /* The tracks sort in the layer's order: the dispatch's before GEMM1's before the producer's. */
  int64_t si_scan = -1, si_g1 = -1;
  for (int64_t i = 0; i < n; i++)
    if (ev[i].ph == 'M' && strcmp(ev[i].name, "thread_sort_index") == 0) {
      if (ev[i].tid == s0) si_scan = arg_of(&ev[i], "sort_index");
      if (ev[i].tid == g0) si_g1 = arg_of(&ev[i], "sort_index");
    }
  CHECK(si_scan >= 0 && si_g1 > si_scan);
  check_file_order(ev, n);
  free(ev);
}

/* Counts the braces and brackets of a JSON text outside its strings: balanced, never negative. */
static int json_balanced(const char* s) {
  int depth = 0, in_str = 0;
  for (; *s; s++) {
    if (in_str) {
      if (*s == '\\' && s[1])
        s++;
      else if (*s == '"')
        in_str = 0;
      continue;
    }
    if (*s == '"')
      in_str = 1;
    else if (*s == '{' || *s == '[')
      depth++;
    else if (*s == '}' || *s == ']') {
      if (--depth < 0) return 0;
    }
  }
  return depth == 0 && !in_str;
}

static void test_json_file(void) {
  build_records();
  build_layer_records();
  tw__trace_rank ranks[3];
  ranks_of(ranks);
  layer_rank_of(&ranks[2]);
  tw__trace_info info;
  memset(&info, 0, sizeof info);
  info.model = "granite-3.1-1b-a400m";
  info.hidden = 1024, info.ffn = 512, info.experts = 32, info.top_k = 8, info.tokens = 256;
  info.world = 2, info.tile_m = 128, info.tile_n = 256;
  info.router = "balanced", info.dataflow = "reduce", info.team = "in-process";
  info.device = "test \"device\"\n"; /* escaped in the file */
  info.warmup = 3;
  info.op = "layer";
  FILE* f = g_out ? fopen(g_out, "w+") : tmpfile();
  CHECK(f != NULL);
  if (f == NULL) return;
  tw__trace_stats st;
  CHECK(tw__trace_write_json(f, &info, ranks, 3, &st) == 0);
  CHECK(st.tiles == 5 && st.units == 3 && st.gemm1_tiles == 3 && st.send_ctas == 2);
  const long size = ftell(f);
  char* text = (char*)malloc((size_t)size + 1);
  rewind(f);
  CHECK(text != NULL && fread(text, 1, (size_t)size, f) == (size_t)size);
  fclose(f);
  if (text == NULL) return;
  text[size] = '\0';
  CHECK(text[0] == '{' && json_balanced(text));
  CHECK(strstr(text, "\"traceEvents\": [") != NULL);
  CHECK(strstr(text, "\"displayTimeUnit\": \"ns\"") != NULL);
  CHECK(strstr(text, "\"C\": 2") != NULL && strstr(text, "\"P\": 2") != NULL);
  CHECK(strstr(text, "\"budget\": 66") != NULL && strstr(text, "\"schedule\": \"remote-first\""));
  CHECK(strstr(text, "\"predicted_us\": 12.500") != NULL);
  CHECK(strstr(text, "\"dropped\": 3") != NULL);
  CHECK(strstr(text, "\"op\": \"layer\"") != NULL && strstr(text, "\"gemm1_tiles\": 3") != NULL);
  CHECK(strstr(text, "test \\\"device\\\"\\u000a") != NULL);
  /* Microseconds with 3 decimals: tile 2 of rank 0 at 4 us for 5 us. */
  CHECK(strstr(text,
               "\"name\": \"tile\", \"ph\": \"X\", \"pid\": 0, \"tid\": 2, \"ts\": 4.000, "
               "\"dur\": 5.000") != NULL);
  CHECK(strstr(text,
               "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 0, \"tid\": 2, \"ts\": "
               "0.000, \"args\": {\"name\": \"producer CTA 0 (overlap 1)\"}}") != NULL);
  CHECK(strstr(text,
               "\"ph\": \"i\", \"pid\": 0, \"tid\": 10000001, \"ts\": 10.500, \"s\": "
               "\"t\", \"args\": {\"owner\": 1, \"units\": 2}") != NULL);
  free(text);
}

static void test_empty_and_clamped(void) {
  /* No records: a valid trace with only the process names. */
  tw__trace_rank r;
  memset(&r, 0, sizeof r);
  tw__trace_event* ev = NULL;
  int64_t n = 0;
  tw__trace_stats st;
  CHECK(tw__trace_build(&r, 1, &ev, &n, &st) == 0);
  CHECK(n == 2 && ev != NULL && ev[0].ph == 'M' && st.t0_ns == 0);
  free(ev);
  /* An end before its begin is written with dur 0 and counted, never negative. */
  tw_trace_record rr[2] = {rec(500, TW_TRACE_TILE_BEGIN, 3, 0),
                           rec(0, TW_TRACE_TILE_PUBLISH, 3, 0)};
  r.records = rr;
  r.count = 2;
  r.num_tiles = 1;
  CHECK(tw__trace_build(&r, 1, &ev, &n, &st) == 0);
  CHECK(st.clamped == 1 && st.tiles == 1);
  const tw__trace_event* e = ev ? find(ev, n, 0, tw__trace_tid(0, 3, 0), "tile", 500) : NULL;
  CHECK(e != NULL && e->dur == 0);
  free(ev);
}

int main(int argc, char** argv) {
  if (argc == 3 && strcmp(argv[1], "--out") == 0) {
    g_out = argv[2];
  } else if (argc != 1) {
    fprintf(stderr, "usage: %s [--out FILE]\n", argv[0]);
    return 2;
  }
  static const tw_test_case cases[] = {
      TW_TEST(test_spans_and_tracks),
      TW_TEST(test_layer_tracks),
      TW_TEST(test_json_file),
      TW_TEST(test_empty_and_clamped),
  };
  return tw_test_run(cases, (int)(sizeof cases / sizeof cases[0]));
}
