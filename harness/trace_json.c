/*
 * trace_json.c: a traced call's records as Chrome trace-event / Perfetto JSON (trace_json.h says
 * what the file holds). Records are matched per rank by (kind, index): a tile's begin with its
 * publish, a unit's claim with its waits and its copy, a reduction CTA's begin with its end; the
 * dispatch's per CTA (scan and copy CTAs) and per source (the wait kernel).
 * Every record of one unit, and of one reduction CTA, is written by one thread (thread 0 of its
 * CTA), so their times are ordered; a tile's begin and publish come from two warps of one CTA,
 * ordered by the tile's own hand-off (the publish follows the stores that follow the math).
 */
#include "trace_json.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench_stats.h"

enum {
  TWJ_PRODUCER = TW__TRACE_PRODUCER,
  TWJ_CONSUMER = TW__TRACE_CONSUMER,
  TWJ_REDUCE = TW__TRACE_REDUCE,
  TWJ_GEMM1 = TW__TRACE_GEMM1,
  TWJ_SCAN = TW__TRACE_SCAN,
  TWJ_SEND = TW__TRACE_SEND,
  TWJ_RECV = TW__TRACE_RECV
};
/* Sources of the dispatch's wait kernel a rank can have (its threads). */
enum { TWJ_MAX_SOURCES = 256 };
enum { TWJ_MAX_LANES = 16 };

int32_t tw__trace_tid(int role, int cta, int lane) {
  return 1 + role * 10000000 + cta * TWJ_MAX_LANES + lane;
}

static void twj_tid_decode(int32_t tid, int* role, int* cta, int* lane) {
  const int32_t v = tid - 1;
  *role = v / 10000000;
  *cta = (v % 10000000) / TWJ_MAX_LANES;
  *lane = v % TWJ_MAX_LANES;
}

static const char* twj_kind_name(int kind) {
  switch (kind) {
    case TW_TRACE_TILE_BEGIN:
      return "tile begin";
    case TW_TRACE_TILE_PUBLISH:
      return "tile publish";
    case TW_TRACE_UNIT_CLAIM:
      return "unit claim";
    case TW_TRACE_UNIT_BANDS:
      return "unit bands ready";
    case TW_TRACE_UNIT_CREDIT:
      return "unit credit";
    case TW_TRACE_UNIT_COPY:
      return "unit copy end";
    case TW_TRACE_CONSUMER_END:
      return "consumer end";
    case TW_TRACE_REDUCE_BEGIN:
      return "reduce begin";
    case TW_TRACE_REDUCE_ARRIVED:
      return "arrivals complete";
    case TW_TRACE_REDUCE_END:
      return "reduce end";
    case TW_TRACE_GEMM1_BEGIN:
      return "gemm1 tile begin";
    case TW_TRACE_GEMM1_PUBLISH:
      return "gemm1 tile stored";
    case TW_TRACE_SCAN_BEGIN:
      return "scan begin";
    case TW_TRACE_SCAN_END:
      return "scan end";
    case TW_TRACE_SEND_BEGIN:
      return "send begin";
    case TW_TRACE_SEND_CREDIT:
      return "send credit";
    case TW_TRACE_SEND_END:
      return "send end";
    case TW_TRACE_RECV_BEGIN:
      return "wait begin";
    case TW_TRACE_RECV_ARRIVED:
      return "rows arrived";
    default:
      return "record";
  }
}

/* ---- a growing array of events ---- */

typedef struct twj_vec {
  tw__trace_event* v;
  int64_t n, cap;
  int oom;
} twj_vec;

static tw__trace_event* twj_push(twj_vec* e, char ph, int32_t pid, int32_t tid, const char* name) {
  if (e->n == e->cap) {
    const int64_t cap = e->cap ? 2 * e->cap : 256;
    tw__trace_event* v = (tw__trace_event*)realloc(e->v, (size_t)cap * sizeof *v);
    if (v == NULL) {
      e->oom = 1;
      return NULL;
    }
    e->v = v;
    e->cap = cap;
  }
  tw__trace_event* ev = &e->v[e->n++];
  memset(ev, 0, sizeof *ev);
  ev->ph = ph;
  ev->pid = pid;
  ev->tid = tid;
  ev->name = name;
  return ev;
}

static void twj_arg(tw__trace_event* ev, const char* key, int64_t v) {
  if (ev == NULL || ev->nargs >= 5) return;
  ev->key[ev->nargs] = key;
  ev->val[ev->nargs++] = v;
}

/* A complete event [b, e] (ns since t0); an end before the begin is clamped (and counted). */
static tw__trace_event* twj_span(twj_vec* e, tw__trace_stats* st, int32_t pid, int32_t tid,
                                 const char* name, int64_t b, int64_t end) {
  tw__trace_event* ev = twj_push(e, 'X', pid, tid, name);
  if (ev == NULL) return NULL;
  if (end < b) {
    st->clamped++;
    end = b;
  }
  ev->ts = b;
  ev->dur = end - b;
  return ev;
}

static tw__trace_event* twj_instant(twj_vec* e, int32_t pid, int32_t tid, int kind, int64_t t,
                                    const char* key, int64_t index) {
  tw__trace_event* ev = twj_push(e, 'i', pid, tid, twj_kind_name(kind));
  if (ev == NULL) return NULL;
  ev->ts = t;
  if (key) twj_arg(ev, key, index);
  return ev;
}

/* ---- matching records ---- */

/* One slot per (kind, index) of a rank: time + 1 (0 = not seen), the CTA and the record's
 * index (where the slot is per CTA, the index is a value: rows sent). */
typedef struct twj_slot {
  uint64_t t1;
  int32_t cta;
  uint32_t val;
} twj_slot;

static void twj_put(twj_slot* s, uint64_t t, int cta, tw__trace_stats* st) {
  if (s->t1 != 0) {
    st->duplicates++;
    return;
  }
  s->t1 = t + 1;
  s->cta = cta;
}

/* Span (cta, begin, end, index) to place on a track, sorted by CTA then begin. */
typedef struct twj_item {
  int32_t cta, index;
  int64_t b, e;
} twj_item;

static int twj_item_cmp(const void* pa, const void* pb) {
  const twj_item *a = (const twj_item*)pa, *b = (const twj_item*)pb;
  if (a->cta != b->cta) return a->cta < b->cta ? -1 : 1;
  if (a->b != b->b) return a->b < b->b ? -1 : 1;
  if (a->e != b->e) return a->e > b->e ? -1 : 1;
  return a->index < b->index ? -1 : a->index > b->index;
}

/* Lanes of one CTA's spans, in begin order: the first lane whose last span has ended. */
typedef struct twj_lanes {
  int32_t cta;
  int n;
  int64_t end[TWJ_MAX_LANES];
} twj_lanes;

static int twj_lane(twj_lanes* l, const twj_item* it, int64_t* opened) {
  if (l->cta != it->cta) {
    l->cta = it->cta;
    l->n = 0;
  }
  const int64_t end = it->e > it->b ? it->e : it->b;
  for (int i = 0; i < l->n; i++)
    if (l->end[i] <= it->b) {
      l->end[i] = end;
      return i;
    }
  /* A new lane (the last one takes the rest if a CTA ever needed more). */
  const int i = l->n < TWJ_MAX_LANES ? l->n++ : TWJ_MAX_LANES - 1;
  if (i > 0 && i == l->n - 1 && opened != NULL) (*opened)++;
  l->end[i] = end;
  return i;
}

static int64_t twj_rel(uint64_t t1, uint64_t t0) {
  return (int64_t)(t1 - 1 - t0);
}

/* Tiles of one GEMM (slots: begin, end per tile) as spans on lanes per CTA of `role`, the rest as
 * instants; *built counts the spans. */
static void twj_tiles(twj_vec* out, tw__trace_stats* st, int32_t pid, int role,
                      const twj_slot* tile, int64_t T, const tw_tile* tiles, uint64_t t0,
                      twj_item* items, const char* name, int begin_kind, int64_t* built,
                      int64_t* opened) {
  int64_t n = 0;
  for (int64_t t = 0; t < T; t++) {
    const twj_slot *b = &tile[2 * t], *p = &tile[2 * t + 1];
    if (b->t1 && p->t1 && b->cta == p->cta) {
      twj_item it = {b->cta, (int32_t)t, twj_rel(b->t1, t0), twj_rel(p->t1, t0)};
      items[n++] = it;
    } else {
      for (int j = 0; j < 2; j++)
        if (tile[2 * t + j].t1) {
          st->partial++;
          twj_instant(out, pid, tw__trace_tid(role, tile[2 * t + j].cta, 0), begin_kind + j,
                      twj_rel(tile[2 * t + j].t1, t0), "tile", t);
        }
    }
  }
  qsort(items, (size_t)n, sizeof *items, twj_item_cmp);
  twj_lanes lanes = {-1, 0, {0}};
  for (int64_t i = 0; i < n; i++) {
    const int lane = twj_lane(&lanes, &items[i], opened);
    tw__trace_event* ev = twj_span(out, st, pid, tw__trace_tid(role, items[i].cta, lane), name,
                                   items[i].b, items[i].e);
    const int32_t t = items[i].index;
    twj_arg(ev, "tile", t);
    if (tiles != NULL) {
      if (role == TWJ_PRODUCER) twj_arg(ev, "band", tiles[t].band);
      twj_arg(ev, "expert", tiles[t].expert);
      twj_arg(ev, "row0", tiles[t].row0);
      twj_arg(ev, "col0", tiles[t].col0);
    }
    (*built)++;
  }
}

/* The dispatch's and GEMM1's records of one rank (the layer's first half). */
static int twj_dispatch(const tw__trace_rank* r, uint64_t t0, twj_vec* out, tw__trace_stats* st) {
  const int64_t T1 = r->num_gemm1_tiles > 0 ? r->num_gemm1_tiles : 0;
  int32_t max_scan = -1, max_send = -1;
  int any = 0;
  for (int64_t i = 0; i < r->count; i++) {
    const tw_trace_record* x = &r->records[i];
    if (x->kind < TW_TRACE_GEMM1_BEGIN || x->kind >= TW_TRACE_KIND_COUNT) continue;
    any = 1;
    if ((x->kind == TW_TRACE_SCAN_BEGIN || x->kind == TW_TRACE_SCAN_END) && x->cta > max_scan)
      max_scan = x->cta;
    if (x->kind >= TW_TRACE_SEND_BEGIN && x->kind <= TW_TRACE_SEND_ARRIVE && x->cta > max_send)
      max_send = x->cta;
  }
  if (!any) return 0;
  const int64_t SC = max_scan + 1, SD = max_send + 1;
  /* GEMM1 tiles (begin, store), scan CTAs (begin, end per pass), send CTAs (begin, credit, end),
   * the wait kernel (begin, then one per source) */
  twj_slot* slots = (twj_slot*)calloc((size_t)(2 * T1 + 4 * SC + 3 * SD + 1 + TWJ_MAX_SOURCES + 1),
                                      sizeof(twj_slot));
  twj_item* items = (twj_item*)malloc((size_t)(T1 + 1) * sizeof(twj_item));
  if (slots == NULL || items == NULL) {
    free(slots);
    free(items);
    return -1;
  }
  twj_slot *g1 = slots, *scan = g1 + 2 * T1, *send = scan + 4 * SC, *recv = send + 3 * SD;
  const int32_t pid = r->rank;
  for (int64_t i = 0; i < r->count; i++) {
    const tw_trace_record* x = &r->records[i];
    const int64_t k = x->index;
    switch (x->kind) {
      case TW_TRACE_GEMM1_BEGIN:
      case TW_TRACE_GEMM1_PUBLISH:
        if (k >= T1)
          st->foreign++;
        else
          twj_put(&g1[2 * k + (x->kind == TW_TRACE_GEMM1_PUBLISH)], x->ns, x->cta, st);
        break;
      case TW_TRACE_SCAN_BEGIN:
      case TW_TRACE_SCAN_END:
        if (k > 1)
          st->foreign++;
        else
          twj_put(&scan[4 * x->cta + 2 * k + (x->kind == TW_TRACE_SCAN_END)], x->ns, x->cta, st);
        break;
      case TW_TRACE_SEND_BEGIN:
      case TW_TRACE_SEND_CREDIT:
      case TW_TRACE_SEND_END: {
        twj_slot* sl = &send[3 * x->cta + (x->kind - TW_TRACE_SEND_BEGIN)];
        twj_put(sl, x->ns, x->cta, st);
        sl->val = x->index;
        break;
      }
      case TW_TRACE_SEND_ARRIVE: {
        tw__trace_event* ev = twj_instant(out, pid, tw__trace_tid(TWJ_SEND, x->cta, 0), x->kind,
                                          twj_rel(x->ns + 1, t0), "ranks", k);
        if (ev) ev->name = "arrivals released";
        break;
      }
      case TW_TRACE_RECV_BEGIN:
        twj_put(&recv[0], x->ns, x->cta, st);
        break;
      case TW_TRACE_RECV_ARRIVED:
        if (k >= TWJ_MAX_SOURCES)
          st->foreign++;
        else
          twj_put(&recv[1 + k], x->ns, x->cta, st);
        break;
      default:
        break; /* the combine's kinds: twj_rank's */
    }
  }
  twj_tiles(out, st, pid, TWJ_GEMM1, g1, T1, r->gemm1_tiles, t0, items, "gemm1 tile",
            TW_TRACE_GEMM1_BEGIN, &st->gemm1_tiles, &st->overlap_tracks);
  static const char* const kPass[2] = {"count", "place"};
  for (int64_t c = 0; c < SC; c++)
    for (int pass = 0; pass < 2; pass++) {
      const twj_slot* sl = &scan[4 * c + 2 * pass];
      const int32_t tid = tw__trace_tid(TWJ_SCAN, (int)c, 0);
      if (sl[0].t1 && sl[1].t1) {
        twj_arg(
            twj_span(out, st, pid, tid, kPass[pass], twj_rel(sl[0].t1, t0), twj_rel(sl[1].t1, t0)),
            "pass", pass);
        st->scan_ctas += pass == 0;
      } else {
        for (int j = 0; j < 2; j++)
          if (sl[j].t1) {
            st->partial++;
            twj_instant(out, pid, tid, TW_TRACE_SCAN_BEGIN + j, twj_rel(sl[j].t1, t0), "pass",
                        pass);
          }
      }
    }
  for (int64_t c = 0; c < SD; c++) {
    const twj_slot* sl = &send[3 * c];
    const int32_t tid = tw__trace_tid(TWJ_SEND, (int)c, 0);
    if (sl[0].t1 && sl[2].t1) {
      const int64_t b = twj_rel(sl[0].t1, t0), e = twj_rel(sl[2].t1, t0);
      twj_arg(twj_span(out, st, pid, tid, "send CTA", b, e), "rows", sl[2].val);
      int64_t at = b;
      if (sl[1].t1) {
        at = twj_rel(sl[1].t1, t0);
        twj_span(out, st, pid, tid, "wait credit", b, at);
      }
      twj_arg(twj_span(out, st, pid, tid, "copy rows", at, e), "rows", sl[2].val);
      st->send_ctas++;
    } else {
      for (int j = 0; j < 3; j++)
        if (sl[j].t1) {
          st->partial++;
          twj_instant(out, pid, tid, TW_TRACE_SEND_BEGIN + j, twj_rel(sl[j].t1, t0), NULL, 0);
        }
    }
  }
  {
    const int32_t tid = tw__trace_tid(TWJ_RECV, 0, 0);
    int64_t last = -1;
    for (int s = 0; s < TWJ_MAX_SOURCES; s++)
      if (recv[1 + s].t1) {
        const int64_t a = twj_rel(recv[1 + s].t1, t0);
        if (a > last) last = a;
        twj_instant(out, pid, tid, TW_TRACE_RECV_ARRIVED, a, "source", s);
      }
    if (recv[0].t1 && last >= 0) {
      twj_span(out, st, pid, tid, "wait rows", twj_rel(recv[0].t1, t0), last);
      st->recv_waits++;
    } else if (recv[0].t1) {
      st->partial++; /* a wait that saw no source (a timeout) */
      twj_instant(out, pid, tid, TW_TRACE_RECV_BEGIN, twj_rel(recv[0].t1, t0), NULL, 0);
    }
  }
  free(slots);
  free(items);
  return out->oom ? -1 : 0;
}

/* The events of one rank. */
static int twj_rank(const tw__trace_rank* r, uint64_t t0, twj_vec* out, tw__trace_stats* st) {
  const int64_t T = r->num_tiles > 0 ? r->num_tiles : 0,
                U = r->total_units > 0 ? r->total_units : 0;
  int32_t max_cc = -1, max_rc = -1; /* largest consumer / reduction CTA seen */
  for (int64_t i = 0; i < r->count; i++) {
    const tw_trace_record* x = &r->records[i];
    if (x->kind >= TW_TRACE_UNIT_CLAIM && x->kind <= TW_TRACE_CONSUMER_END && x->cta > max_cc)
      max_cc = x->cta;
    if (x->kind >= TW_TRACE_REDUCE_BEGIN && x->kind <= TW_TRACE_REDUCE_END && x->cta > max_rc)
      max_rc = x->cta;
  }
  const int64_t CC = max_cc + 1, RC = max_rc + 1;
  /* tiles (begin, publish), units (claim, bands, credit, copy), consumer CTAs (first, end),
   * reduction CTAs (begin, arrived, end) */
  twj_slot* slots =
      (twj_slot*)calloc((size_t)(2 * T + 4 * U + 2 * CC + 3 * RC + 1), sizeof(twj_slot));
  twj_item* items = (twj_item*)malloc((size_t)(T + U + 1) * sizeof(twj_item));
  if (slots == NULL || items == NULL) {
    free(slots);
    free(items);
    return -1;
  }
  twj_slot *tile = slots, *unit = slots + 2 * T, *cc = unit + 4 * U, *rc = cc + 2 * CC;
  const int32_t pid = r->rank;
  for (int64_t i = 0; i < r->count; i++) {
    const tw_trace_record* x = &r->records[i];
    const int64_t k = x->index;
    switch (x->kind) {
      case TW_TRACE_TILE_BEGIN:
      case TW_TRACE_TILE_PUBLISH:
        if (k >= T) {
          st->foreign++;
          break;
        }
        twj_put(&tile[2 * k + (x->kind == TW_TRACE_TILE_PUBLISH)], x->ns, x->cta, st);
        break;
      case TW_TRACE_UNIT_CLAIM:
      case TW_TRACE_UNIT_BANDS:
      case TW_TRACE_UNIT_CREDIT:
      case TW_TRACE_UNIT_COPY:
        /* A claim past the last unit is how a CTA learns there is no work left: not a unit. */
        if (k < U)
          twj_put(&unit[4 * k + (x->kind - TW_TRACE_UNIT_CLAIM)], x->ns, x->cta, st);
        else if (x->kind != TW_TRACE_UNIT_CLAIM)
          st->foreign++;
        break;
      case TW_TRACE_ANNOUNCE: {
        tw__trace_event* ev = twj_instant(out, pid, tw__trace_tid(TWJ_CONSUMER, x->cta, 0), x->kind,
                                          twj_rel(x->ns + 1, t0), "owner", k & 0xFF);
        if (ev) ev->name = "announce";
        twj_arg(ev, "units", k >> 8);
        break;
      }
      case TW_TRACE_CONSUMER_END:
        twj_put(&cc[2 * x->cta + 1], x->ns, x->cta, st);
        break;
      case TW_TRACE_REDUCE_BEGIN:
      case TW_TRACE_REDUCE_ARRIVED:
      case TW_TRACE_REDUCE_END:
        twj_put(&rc[3 * x->cta + (x->kind - TW_TRACE_REDUCE_BEGIN)], x->ns, x->cta, st);
        break;
      default:
        /* GEMM1's and the dispatch's: twj_dispatch's */
        if (x->kind < TW_TRACE_GEMM1_BEGIN || x->kind >= TW_TRACE_KIND_COUNT) st->foreign++;
        break;
    }
    /* Each consumer CTA's first record opens its span. */
    if (x->kind >= TW_TRACE_UNIT_CLAIM && x->kind <= TW_TRACE_CONSUMER_END &&
        (cc[2 * x->cta].t1 == 0 || x->ns + 1 < cc[2 * x->cta].t1))
      cc[2 * x->cta].t1 = x->ns + 1, cc[2 * x->cta].cta = x->cta;
  }

  /* Producer: complete tiles on lanes per CTA, the rest as instants. */
  twj_tiles(out, st, pid, TWJ_PRODUCER, tile, T, r->tiles, t0, items, "tile", TW_TRACE_TILE_BEGIN,
            &st->tiles, &st->overlap_tracks);

  /* Consumer: units (claim .. copy) with their phases, CTA spans, and the partial units. */
  int64_t n = 0;
  for (int64_t u = 0; u < U; u++) {
    const twj_slot* s = &unit[4 * u];
    if (s[0].t1 && s[3].t1 && s[0].cta == s[3].cta) {
      twj_item it = {s[0].cta, (int32_t)u, twj_rel(s[0].t1, t0), twj_rel(s[3].t1, t0)};
      items[n++] = it;
    } else {
      for (int j = 0; j < 4; j++)
        if (s[j].t1) {
          st->partial++;
          twj_instant(out, pid, tw__trace_tid(TWJ_CONSUMER, s[j].cta, 0), TW_TRACE_UNIT_CLAIM + j,
                      twj_rel(s[j].t1, t0), "unit", u);
        }
    }
  }
  qsort(items, (size_t)n, sizeof *items, twj_item_cmp);
  twj_lanes lanes = {-1, 0, {0}};
  for (int64_t i = 0; i < n; i++) {
    const int lane = twj_lane(&lanes, &items[i], NULL);
    const int32_t tid = tw__trace_tid(TWJ_CONSUMER, items[i].cta, lane), u = items[i].index;
    const twj_slot* s = &unit[4 * (int64_t)u];
    twj_arg(twj_span(out, st, pid, tid, "unit", items[i].b, items[i].e), "unit", u);
    int64_t at = items[i].b; /* where the copy starts: after the last wait */
    if (s[1].t1 && s[1].cta == items[i].cta) {
      at = twj_rel(s[1].t1, t0);
      twj_arg(twj_span(out, st, pid, tid, "wait bands", items[i].b, at), "unit", u);
    }
    if (s[2].t1 && s[2].cta == items[i].cta) {
      const int64_t c = twj_rel(s[2].t1, t0);
      twj_arg(twj_span(out, st, pid, tid, "wait credit", at, c), "unit", u);
      at = c;
    }
    twj_arg(twj_span(out, st, pid, tid, "copy", at, items[i].e), "unit", u);
    st->units++;
  }
  for (int64_t c = 0; c < CC; c++) {
    const twj_slot *f = &cc[2 * c], *e = &cc[2 * c + 1];
    if (f->t1 && e->t1) {
      twj_span(out, st, pid, tw__trace_tid(TWJ_CONSUMER, (int)c, 0), "consumer CTA",
               twj_rel(f->t1, t0), twj_rel(e->t1, t0));
      st->consumer_ctas++;
    } else if (f->t1) {
      st->partial++; /* a CTA that never ended (a timeout): its records say what it did */
    }
  }

  /* Reduction CTAs. */
  for (int64_t c = 0; c < RC; c++) {
    const twj_slot* s = &rc[3 * c];
    const int32_t tid = tw__trace_tid(TWJ_REDUCE, (int)c, 0);
    if (s[0].t1 && s[2].t1) {
      const int64_t b = twj_rel(s[0].t1, t0), e = twj_rel(s[2].t1, t0);
      twj_span(out, st, pid, tid, "reduce CTA", b, e);
      if (s[1].t1) {
        const int64_t a = twj_rel(s[1].t1, t0);
        twj_span(out, st, pid, tid, "wait arrivals", b, a);
        twj_span(out, st, pid, tid, "reduce", a, e);
      }
      st->reduce_ctas++;
    } else {
      for (int j = 0; j < 3; j++)
        if (s[j].t1) {
          st->partial++;
          twj_instant(out, pid, tid, TW_TRACE_REDUCE_BEGIN + j, twj_rel(s[j].t1, t0), NULL, 0);
        }
    }
  }
  free(slots);
  free(items);
  return out->oom ? -1 : 0;
}

/* File order: metadata first, then by rank, track, time, longer first, then as built. */
typedef struct twj_sorted {
  tw__trace_event ev;
  int64_t seq;
} twj_sorted;

static int twj_event_cmp(const void* pa, const void* pb) {
  const twj_sorted *a = (const twj_sorted*)pa, *b = (const twj_sorted*)pb;
  if ((a->ev.ph == 'M') != (b->ev.ph == 'M')) return a->ev.ph == 'M' ? -1 : 1;
  if (a->ev.pid != b->ev.pid) return a->ev.pid < b->ev.pid ? -1 : 1;
  if (a->ev.tid != b->ev.tid) return a->ev.tid < b->ev.tid ? -1 : 1;
  if (a->ev.ts != b->ev.ts) return a->ev.ts < b->ev.ts ? -1 : 1;
  if (a->ev.dur != b->ev.dur) return a->ev.dur > b->ev.dur ? -1 : 1;
  if ((a->ev.ph == 'X') != (b->ev.ph == 'X')) return a->ev.ph == 'X' ? -1 : 1;
  return a->seq < b->seq ? -1 : a->seq > b->seq;
}

static int twj_pair_cmp(const void* pa, const void* pb) {
  const int64_t a = *(const int64_t*)pa, b = *(const int64_t*)pb;
  return a < b ? -1 : a > b;
}

/* The metadata events naming every process and track that has events. */
static void twj_names(twj_vec* e, const tw__trace_rank* ranks, int nranks) {
  const int64_t n = e->n;
  int64_t* pairs = (int64_t*)malloc((size_t)(n + 1) * sizeof(int64_t));
  if (pairs == NULL) {
    e->oom = 1;
    return;
  }
  for (int64_t i = 0; i < n; i++) pairs[i] = ((int64_t)e->v[i].pid << 32) | (uint32_t)e->v[i].tid;
  qsort(pairs, (size_t)n, sizeof *pairs, twj_pair_cmp);
  static const char* const kRole[TW__TRACE_ROLES] = {
      "producer", "consumer", "reduce", "gemm1", "dispatch scan", "dispatch send", "dispatch wait"};
  /* Tracks in the order of the layer's kernels: the dispatch's, GEMM1, then the combine's. */
  static const int kOrder[TW__TRACE_ROLES] = {4, 5, 6, 3, 0, 1, 2};
  for (int i = 0; i < nranks; i++) {
    tw__trace_event* ev = twj_push(e, 'M', ranks[i].rank, 0, "process_name");
    if (ev) snprintf(ev->label, sizeof ev->label, "rank %d", ranks[i].rank);
    ev = twj_push(e, 'M', ranks[i].rank, 0, "process_sort_index");
    twj_arg(ev, "sort_index", ranks[i].rank);
  }
  for (int64_t i = 0; i < n; i++) {
    if (i > 0 && pairs[i] == pairs[i - 1]) continue;
    const int32_t pid = (int32_t)(pairs[i] >> 32), tid = (int32_t)(uint32_t)pairs[i];
    int role, cta, lane;
    twj_tid_decode(tid, &role, &cta, &lane);
    role = role % TW__TRACE_ROLES;
    tw__trace_event* ev = twj_push(e, 'M', pid, tid, "thread_name");
    if (ev && role == TWJ_RECV)
      snprintf(ev->label, sizeof ev->label, "%s", kRole[role]); /* one kernel of one CTA */
    else if (ev && lane > 0)
      snprintf(ev->label, sizeof ev->label, "%s CTA %d (overlap %d)", kRole[role], cta, lane);
    else if (ev)
      snprintf(ev->label, sizeof ev->label, "%s CTA %d", kRole[role], cta);
    ev = twj_push(e, 'M', pid, tid, "thread_sort_index");
    twj_arg(ev, "sort_index", tw__trace_tid(kOrder[role], cta, lane));
  }
  free(pairs);
}

int tw__trace_build(const tw__trace_rank* ranks, int n, tw__trace_event** events, int64_t* nevents,
                    tw__trace_stats* stats) {
  tw__trace_stats st;
  memset(&st, 0, sizeof st);
  *events = NULL;
  *nevents = 0;
  uint64_t t0 = UINT64_MAX;
  for (int i = 0; i < n; i++)
    for (int64_t j = 0; j < ranks[i].count; j++)
      if (ranks[i].records[j].ns < t0) t0 = ranks[i].records[j].ns;
  if (t0 == UINT64_MAX) t0 = 0;
  st.t0_ns = t0;
  twj_vec e = {NULL, 0, 0, 0};
  for (int i = 0; i < n && !e.oom; i++)
    if (twj_rank(&ranks[i], t0, &e, &st) != 0 || twj_dispatch(&ranks[i], t0, &e, &st) != 0)
      e.oom = 1;
  if (!e.oom) twj_names(&e, ranks, n);
  twj_sorted* s = e.oom ? NULL : (twj_sorted*)malloc((size_t)(e.n + 1) * sizeof *s);
  if (s == NULL) {
    free(e.v);
    return -1;
  }
  for (int64_t i = 0; i < e.n; i++) s[i].ev = e.v[i], s[i].seq = i;
  qsort(s, (size_t)e.n, sizeof *s, twj_event_cmp);
  for (int64_t i = 0; i < e.n; i++) e.v[i] = s[i].ev;
  free(s);
  *events = e.v;
  *nevents = e.n;
  if (stats) *stats = st;
  return 0;
}

/* ---- writing ---- */

/* ns as microseconds with three decimals, exactly (ns >= 0). */
static void twj_us(FILE* f, int64_t ns) {
  fprintf(f, "%lld.%03lld", (long long)(ns / 1000), (long long)(ns % 1000));
}

static void twj_write_event(FILE* f, const tw__trace_event* ev) {
  fputs("{\"name\": ", f);
  tw__json_str(f, ev->name);
  fprintf(f, ", \"ph\": \"%c\", \"pid\": %d, \"tid\": %d, \"ts\": ", ev->ph, ev->pid, ev->tid);
  twj_us(f, ev->ts);
  if (ev->ph == 'X') {
    fputs(", \"dur\": ", f);
    twj_us(f, ev->dur);
  }
  if (ev->ph == 'i') fputs(", \"s\": \"t\"", f);
  if (ev->label[0] != '\0' || ev->nargs > 0) {
    fputs(", \"args\": {", f);
    int first = 1;
    if (ev->label[0] != '\0') {
      tw__json_key(f, "name", first);
      tw__json_str(f, ev->label);
      first = 0;
    }
    for (int i = 0; i < ev->nargs; i++) {
      tw__json_key(f, ev->key[i], first);
      fprintf(f, "%lld", (long long)ev->val[i]);
      first = 0;
    }
    fputc('}', f);
  }
  fputc('}', f);
}

static void twj_key_int(FILE* f, const char* key, int64_t v, int first) {
  tw__json_key(f, key, first);
  fprintf(f, "%lld", (long long)v);
}

static void twj_key_str(FILE* f, const char* key, const char* v, int first) {
  tw__json_key(f, key, first);
  tw__json_str(f, v);
}

static void twj_write_metadata(FILE* f, const tw__trace_info* in, const tw__trace_rank* ranks,
                               int n, const tw__trace_stats* st) {
  fputs("{", f);
  twj_key_str(f, "tool", "tilewave trace", 1);
  twj_key_str(f, "clock",
              "%globaltimer ns of the GPU; ts and dur in microseconds from t0_ns, the earliest "
              "record of every rank",
              0);
  tw__json_key(f, "t0_ns", 0);
  fprintf(f, "%llu", (unsigned long long)st->t0_ns);
  twj_key_str(f, "model", in->model, 0);
  twj_key_int(f, "hidden", in->hidden, 0);
  twj_key_int(f, "ffn", in->ffn, 0);
  twj_key_int(f, "experts", in->experts, 0);
  twj_key_int(f, "top_k", in->top_k, 0);
  twj_key_int(f, "tokens_per_rank", in->tokens, 0);
  twj_key_int(f, "world_size", in->world, 0);
  twj_key_int(f, "tile_m", in->tile_m, 0);
  twj_key_int(f, "tile_n", in->tile_n, 0);
  twj_key_str(f, "router", in->router, 0);
  twj_key_str(f, "dataflow", in->dataflow, 0);
  twj_key_str(f, "team", in->team, 0);
  twj_key_str(f, "device", in->device, 0);
  twj_key_int(f, "warmup_calls", in->warmup, 0);
  twj_key_str(f, "op", in->op, 0);
  tw__json_key(f, "ranks", 0);
  fputs("[", f);
  for (int i = 0; i < n; i++) {
    const tw__trace_rank* r = &ranks[i];
    fputs(i ? ", {" : "{", f);
    twj_key_int(f, "rank", r->rank, 1);
    twj_key_int(f, "budget", r->budget, 0);
    twj_key_int(f, "P", r->producer_ctas, 0);
    twj_key_int(f, "C", r->consumer_ctas, 0);
    twj_key_int(f, "plan_C", r->plan_comm_ctas > 0 ? r->plan_comm_ctas : r->consumer_ctas, 0);
    twj_key_int(f, "reduce_ctas", r->reduce_ctas, 0);
    twj_key_str(f, "schedule", r->schedule, 0);
    twj_key_int(f, "coalesce", r->coalesce, 0);
    twj_key_int(f, "tiles", r->num_tiles, 0);
    twj_key_int(f, "units", r->total_units, 0);
    twj_key_int(f, "gemm1_tiles", r->num_gemm1_tiles, 0);
    twj_key_int(f, "gemm1_ctas", r->gemm1_ctas, 0);
    tw__json_key(f, "predicted_us", 0);
    tw__json_num(f, "%.3f", r->predicted_us > 0 ? r->predicted_us : NAN);
    twj_key_int(f, "records", r->count, 0);
    twj_key_int(f, "dropped", r->dropped, 0);
    fputs("}", f);
  }
  fputs("]", f);
  tw__json_key(f, "conversion", 0);
  fputs("{", f);
  twj_key_int(f, "tiles", st->tiles, 1);
  twj_key_int(f, "units", st->units, 0);
  twj_key_int(f, "consumer_ctas", st->consumer_ctas, 0);
  twj_key_int(f, "reduce_ctas", st->reduce_ctas, 0);
  twj_key_int(f, "gemm1_tiles", st->gemm1_tiles, 0);
  twj_key_int(f, "scan_ctas", st->scan_ctas, 0);
  twj_key_int(f, "send_ctas", st->send_ctas, 0);
  twj_key_int(f, "recv_waits", st->recv_waits, 0);
  twj_key_int(f, "partial", st->partial, 0);
  twj_key_int(f, "duplicates", st->duplicates, 0);
  twj_key_int(f, "foreign", st->foreign, 0);
  twj_key_int(f, "clamped", st->clamped, 0);
  twj_key_int(f, "overlap_tracks", st->overlap_tracks, 0);
  fputs("}}", f);
}

int tw__trace_write_json(FILE* f, const tw__trace_info* info, const tw__trace_rank* ranks, int n,
                         tw__trace_stats* stats) {
  tw__trace_event* ev = NULL;
  int64_t nev = 0;
  tw__trace_stats st;
  if (tw__trace_build(ranks, n, &ev, &nev, &st) != 0) return -1;
  fputs("{\"displayTimeUnit\": \"ns\",\n\"metadata\": ", f);
  twj_write_metadata(f, info, ranks, n, &st);
  fputs(",\n\"traceEvents\": [\n", f);
  for (int64_t i = 0; i < nev; i++) {
    twj_write_event(f, &ev[i]);
    fputs(i + 1 < nev ? ",\n" : "\n", f);
  }
  fputs("]}\n", f);
  free(ev);
  if (stats) *stats = st;
  return ferror(f) ? -1 : 0;
}
