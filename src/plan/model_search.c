/*
 * model_search.c: the model's decision, the best (C, mgb, schedule) over the tables model.c
 * builds (tw__solve), and the plateau walk from it (tw__plateau_end).
 *
 * maximum t'_s = max_{j <= s} t_j leaves the maximum unchanged (a term whose A_s was raised is
 * dominated by the earlier term it was raised to, Q being non-increasing in s). With t'
 * non-decreasing, only the first segment of each wave can attain the maximum, so a candidate
 * costs one term per wave, and Q_s needs only the suffix sums of bytes and bands.
 * tw__model_choose therefore tabulates, once per candidate mgb and before the decision is timed,
 * the running last-tile index t'_s, the first segment at or after each tile index, and the
 * suffix sums of bytes and bands. The decision then runs without allocating: an exact lower
 * bound per candidate (first wave's term, compute end) over only the C range that can win (the
 * compute end's suffix minimum only grows with C, the first term only falls), the best-ranked bound
 * of one table evaluated first (often it is the answer), the other candidates taken best-ranked
 * bound first, each bound raised by two exact probe terms (the last wave's and the one where the
 * first evaluation's maximum fell; lazily while the probes leave the best-ranked bound as it was),
 * only while their bound lets them win; an evaluation starts from its probes, skips the waves
 * whose terms cannot raise its maximum (tw__eval, tw__solve say why each step is exact).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "model_internal.h"
#include "plan.h"

/* Candidate ordering: smaller T; on equal T the smaller C, then the larger key (the smaller mgb,
 * then a schedule: tw__table_key) (bc = 0: no best yet). Applied to a lower bound lb <= T, it
 * says whether the candidate may still win. */
static int tw__better(double t, int32_t c, int32_t key, double bt, int32_t bc, int32_t bkey) {
  if (bc == 0 || t < bt) return 1;
  if (t > bt) return 0;
  return c < bc || (c == bc && key > bkey);
}

/* The probe term tw__eval takes first for wave `wave` (> 1) of C: the term of the first segment
 * not finished before that wave, with the same bits (tw__wave_term). */
static inline double tw__probe_term(const tw__model_tables* m, const tw__seg_table* tb, int32_t c,
                                    double tau, int32_t wave) {
  const int32_t s = tb->first_seg[(int64_t)(wave - 1) * m->prod[c]];
  const double comp_end = m->comp_us[(size_t)tb->slot * ((size_t)m->hw.c_max + 1) + (size_t)c];
  return tw__wave_term(tb, s, tw__wave_end(wave, m->waves[c], tau, comp_end), m->lat_c[c],
                       m->inv_cta[c], m->inv_peak);
}

/* A candidate left for step 4: its bound (raised by the probes once probed), its first term,
 * and the wave of the hint for tw__eval (0: none). */
typedef struct tw__cand {
  double lb, first;
  int32_t c, table, key, wave;
} tw__cand;
/* Raises x's bound by its probes (exact terms tw__eval takes first, so lower bounds of its T):
 * the last wave's term and, while x may still win against (bt, bc, bkey), the term of the wave
 * holding tile `hint` (where step 1's maximum fell; -1: none), which x->wave then names. */
static inline void tw__probe(const tw__model_tables* m, tw__cand* x, int32_t hint, double reduce,
                             double bt, int32_t bc, int32_t bkey) {
  const tw__seg_table* tb = &m->t[x->table];
  const double tau = m->tau_us[(size_t)tb->slot * ((size_t)m->hw.c_max + 1) + (size_t)x->c];
  const int32_t p = m->prod[x->c];
  const int32_t last_wave = tb->last_tile / p + 1;
  x->wave = 0;
  if (last_wave > 1) {
    const double term = tw__probe_term(m, tb, x->c, tau, last_wave) + reduce;
    if (term > x->lb) x->lb = term;
    if (!tw__better(x->lb, x->c, x->key, bt, bc, bkey)) return;
  }
  if (hint >= 0) {
    const int32_t t = hint < tb->last_tile ? hint : tb->last_tile;
    const int32_t wave = tb->seg[tb->first_seg[t]].run_last / p + 1;
    if (wave > 1 && wave < last_wave) {
      const double term = tw__probe_term(m, tb, x->c, tau, wave) + reduce;
      if (term > x->lb) x->lb = term;
      x->wave = wave;
    }
  }
}

/* Candidates step 4 orders; more are evaluated as they come (the same answer, found slower). */
#define TW__MAX_CANDS 64
/* Longest candidate list step 4 starts lazily (tw__solve). */
#define TW__LAZY_MAX 16

/* The last C in [c_lo, c_hi] up to which some compute end + reduce stays within bt (below it if
 * `below`), c_lo - 1 if none, by bisection on the suffix minimum comp_min, which is
 * non-decreasing in C (tw__model_slot); beyond it every compute end exceeds bt. */
static int32_t tw__c_end(const double* comp_min, double reduce, double bt, int below, int32_t c_lo,
                         int32_t c_hi) {
  int32_t lo = c_lo - 1, hi = c_hi; /* the answer lies in [lo, hi] */
  while (hi > lo) {
    const double x = comp_min[hi] + reduce;
    if (!(x > bt || (below && x == bt))) break; /* hi itself qualifies */
    const int32_t mid = lo + (hi - lo + 1) / 2;
    const double y = comp_min[mid] + reduce;
    if (y > bt || (below && y == bt))
      hi = mid - 1;
    else
      lo = mid;
  }
  return hi;
}

/* The last C a table's scan needs: beyond it every compute end + reduce exceeds bt, or equals it
 * at a C above bc (a tie it loses). The two ends are cached per slot for the bt given. */
static inline int32_t tw__scan_end(const double* comp_min, double reduce, double bt, int32_t bc,
                                   int32_t c_lo, int32_t c_hi, double* cached_bt, int32_t* le,
                                   int32_t* lt) {
  if (*cached_bt != bt) {
    *le = tw__c_end(comp_min, reduce, bt, 0, c_lo, c_hi);
    *lt = bt == DBL_MAX ? *le : tw__c_end(comp_min, reduce, bt, 1, c_lo, *le);
    *cached_bt = bt;
  }
  const int32_t tie_end = bc > 0 && bc < *le ? bc : *le;
  return *lt > tie_end ? *lt : tie_end;
}

/* Step 4 of tw__solve: the probes raise bounds; the candidates that can still win are evaluated,
 * best-ranked bound first. First lazily: the best-ranked candidate is probed, and evaluated at once
 * while the probes leave its bound as it was (it still ranks first: probes only raise the others);
 * most decisions end here, most candidates unprobed. At the first bound the probes raise (or
 * rule out), every candidate left is probed and they are evaluated in order: each lazy step
 * costs a scan of the list, so that is cheaper once the probes start to tell candidates apart,
 * and from the start where the list is long (TW__LAZY_MAX).
 * cand: (n) the candidates steps 1-2 left (reordered); done: step 3 found the answer already;
 * (*best_t, *best_c, *best_i, *best_key): the best evaluated candidate, updated. */
static void tw__solve_step4(const tw__model_tables* m, int32_t hint, double reduce, tw__cand* cand,
                            int32_t n, int done, double* best_t, int32_t* best_c, int32_t* best_i,
                            int32_t* best_key) {
  double bt = *best_t;
  int32_t bc = *best_c, bi = *best_i, bkey = *best_key;
  int32_t j = -1; /* the candidate whose raised bound ended the lazy phase */
  while (!done && n > 0 && n <= TW__LAZY_MAX) {
    j = 0;
    for (int32_t q = 1; q < n; q++)
      if (tw__better(cand[q].lb, cand[q].c, cand[q].key, cand[j].lb, cand[j].c, cand[j].key)) j = q;
    tw__cand x = cand[j];
    if (!tw__better(x.lb, x.c, x.key, bt, bc, bkey)) { /* the best-ranked cannot win: none can */
      done = 1;
      break;
    }
    const double lb = x.lb;
    tw__probe(m, &x, hint, reduce, bt, bc, bkey);
    if (!tw__better(x.lb, x.c, x.key, bt, bc, bkey)) {
      cand[j] = cand[--n], j = -1;
      break;
    }
    if (x.lb != lb) {
      cand[j] = x;
      break;
    }
    cand[j] = cand[--n], j = -1;
    /* A candidate that loses ties stops at a term that reaches bt. */
    const int strict = !tw__better(bt, x.c, x.key, bt, bc, bkey);
    const double t = tw__eval(m, &m->t[x.table], x.c, x.first, bt, strict, x.wave, NULL, 0.0);
    if (tw__better(t, x.c, x.key, bt, bc, bkey)) {
      bt = t, bc = x.c, bi = x.table, bkey = x.key;
      done = t == lb; /* T at its bound, which ranked first: no other can win */
    }
  }
  int32_t k = 0;
  for (int32_t q = 0; q < n && !done; q++) {
    tw__cand x = cand[q];
    if (!tw__better(x.lb, x.c, x.key, bt, bc, bkey)) continue;
    if (q != j) {
      tw__probe(m, &x, hint, reduce, bt, bc, bkey);
      if (!tw__better(x.lb, x.c, x.key, bt, bc, bkey)) continue;
    }
    cand[k++] = x;
  }
  n = done ? 0 : k;
  while (n > 0) {
    j = 0;
    for (int32_t q = 1; q < n; q++)
      if (tw__better(cand[q].lb, cand[q].c, cand[q].key, cand[j].lb, cand[j].c, cand[j].key)) j = q;
    const tw__cand x = cand[j];
    /* The best-ranked bound left cannot win: none can. */
    if (!tw__better(x.lb, x.c, x.key, bt, bc, bkey)) break;
    cand[j] = cand[--n];
    /* A candidate that loses ties stops at a term that reaches bt. */
    const int strict = !tw__better(bt, x.c, x.key, bt, bc, bkey);
    const double t = tw__eval(m, &m->t[x.table], x.c, x.first, bt, strict, x.wave, NULL, 0.0);
    if (tw__better(t, x.c, x.key, bt, bc, bkey)) bt = t, bc = x.c, bi = x.table, bkey = x.key;
  }
  *best_t = bt, *best_c = bc, *best_i = bi, *best_key = bkey;
}

/* The decision: the best (C, mgb, schedule) over C in [c_lo, c_hi] and the tables of `use` (bit
 * i = table i; one table per mgb and schedule), by T, then the smaller C, then the larger key
 * (the smaller mgb, then a schedule); the same answer as evaluating every candidate, found by
 * best-first branch and bound on lb = max(first term, compute end) + reduce:
 *
 *   1. one table (the last: mgb 1 of the last schedule tabulated, usually the winner)
 *      is scanned from the smallest C up to its best-ranked bound (the suffix minimum of the
 *      compute end only grows with C: the scan stops where it reaches the best bound so far)
 *      and that candidate's exact T is evaluated: an upper bound bt of the optimum;
 *   2. every table is scanned from the last C whose compute end + reduce stays within bt (by
 *      bisection on the suffix minimum) down to the first C whose first term + reduce exceeds
 *      bt (the first term only grows as C falls): what lies outside cannot win. Where the first
 *      term + reduce equals bt at a C above bc, the scan goes on at bc (those C tie at best and
 *      lose). The candidates inside are kept, and the best-ranked bound over all tables is
 *      tracked;
 *   3. if the candidate evaluated in 1 holds the best-ranked bound by (lb, C, -key) and its T
 *      equals its bound (T is the first wave's term on link-bound shapes, the compute end on
 *      compute-bound ones), it is the answer, since no bound is below it and equal bounds rank
 *      after it: the search ends here;
 *   4. otherwise the candidates are evaluated best-ranked bound first, each bound raised by two
 *      probe terms (the last wave's, and the one of the wave holding the tile where step 1's
 *      maximum fell), while the best-ranked bound still lets one win (tw__better). The probes
 *      are taken lazily, for the best-ranked candidate only, while they leave its bound as it
 *      was (it then still ranks first and is evaluated; if its T equals that bound, it is the
 *      answer); at the first bound they raise, every candidate left is probed.
 *      Each evaluation starts from its probes and stops at its first term above the best T (or
 *      reaching it, when a tie would lose).
 *
 * The first-term bound is exact in floating point, lb <= T bit for bit, so it is compared
 * without margin and no candidate that could win or tie is skipped: T = max(f, compute end) +
 * reduce where f is the maximum of the wave terms; the first wave with a ready segment has s =
 * 0 and A_0 >= 1; when A_0 = 1 its term is the very value tw__first_terms gave (tw__eval reuses
 * it), and when A_0 > 1 it exceeds that value by at least tau, far beyond rounding. max and the
 * same + reduce keep the order. The first term is non-increasing in C bit for bit (tau(C) and
 * the service's per-C rates are, and rounding is monotone), which the scan of step 2 relies on.
 * A probe is computed by the one out-of-line copy (tw__wave_term) that tw__eval also uses for
 * the same probe and folds into its maximum, so it is <= T bit for bit whatever the compiler
 * fuses, and is compared without margin too: a tie of a probed bound with bt is decided by C and
 * key, never by a slack. */
void tw__solve(const tw__model_tables* m, int32_t c_lo, int32_t c_hi, unsigned use, int32_t* best_c,
               int32_t* best_table, double* best_t) {
  const size_t stride = (size_t)m->hw.c_max + 1;
  const double reduce = m->reduce_us;
  double bt = DBL_MAX; /* best evaluated candidate */
  int32_t bc = 0, bi = -1, bkey = 0;
  double bl = DBL_MAX; /* best-ranked bound */
  int32_t lc = 0, li = -1, lkey = 0;
  int32_t hint = -1;             /* schedule index where step 1's maximum fell */
  int32_t c_end[TW__MAX_TABLES]; /* candidates C in [c_lo, c_end[i]] are left */
  unsigned lazy = 0;             /* tables whose scan waits for step 4 (bit i) */
  /* Per schedule slot, for the bt they were found with: the last C whose compute end + reduce
   * is within bt and below it (C beyond the latter tie at best: only C <= bc may still win). */
  double slot_bt[TW__MAX_SCHED] = {-1.0, -1.0};
  int32_t slot_le[TW__MAX_SCHED] = {0, 0}, slot_lt[TW__MAX_SCHED] = {0, 0};
  tw__cand cand[TW__MAX_CANDS];
  int32_t n = 0;
  unsigned rows = 0; /* rows of m->first begun for this decision (bit r) */
  int32_t row_hi[TW__MAX_SCHED + TW__MAX_TABLES];
  for (int32_t pass = 0; pass < 2; pass++) { /* pass 0: steps 1-2; pass 1: lazy tables */
    for (int32_t i = m->ntables - 1; i >= 0; i--) {
      if (pass == 0) c_end[i] = c_lo - 1;
      if (!(use & (1u << i)) || (pass == 1 && !(lazy & (1u << i)))) continue;
      const tw__seg_table* tb = &m->t[i];
      const double* comp_us = m->comp_us + (size_t)tb->slot * stride;
      const double* comp_min = m->comp_min + (size_t)tb->slot * stride;
      if (pass == 0) {
        c_end[i] = tw__scan_end(comp_min, reduce, bt, bc, c_lo, c_hi, &slot_bt[tb->slot],
                                &slot_le[tb->slot], &slot_lt[tb->slot]);
        if (c_end[i] < c_lo) continue;
        /* Dominated by a twin whose bounds are known at every C left here (its compute end is
         * no larger, so its c_end is no smaller): every bound of this table ranks after the
         * twin's bound at the same C, so it cannot hold the best-ranked bound unless a twin's
         * bound does; step 3 holds without it, step 4 scans it. */
        if (tb->twin >= 0 && (use & (1u << tb->twin)) && c_end[tb->twin] >= c_end[i]) {
          lazy |= 1u << i;
          continue;
        }
      }
      /* The first terms of a row are computed in runs of C (a short loop the compiler
       * vectorises), each C once per row, and only as far as the scans reach: from c_lo up to
       * the C step 1 stops at, in runs of 8, and up to c_end for step 2. */
      double* firsts = m->first + (size_t)tb->first_row * stride;
      int32_t* filled = &row_hi[tb->first_row]; /* firsts[c_lo..*filled] hold values */
      if (!(rows & (1u << tb->first_row))) {
        *filled = c_lo - 1;
        rows |= 1u << tb->first_row;
      }
      if (bi < 0) { /* step 1: up to the best-ranked bound, which is evaluated */
        double tl = DBL_MAX, tf = 0.0;
        int32_t tc = 0;
        for (int32_t c = c_lo; c <= c_end[i]; c++) {
          if (tc > 0 && comp_min[c] + reduce >= tl) break; /* here and beyond: lb >= tl */
          const double comp = comp_us[c] + reduce;
          if (c > *filled) {
            const int32_t e = c_end[i] - c > 7 ? c + 7 : c_end[i];
            tw__first_terms(m, tb, *filled + 1, e, firsts + *filled + 1);
            *filled = e;
          }
          const double first = firsts[c];
          const double lb = first + reduce > comp ? first + reduce : comp;
          if (tc == 0 || lb < tl) tl = lb, tc = c, tf = first;
        }
        bl = tl, lc = tc, li = i, lkey = tb->key;
        bt = tw__eval(m, tb, tc, tf, DBL_MAX, 0, 0, &hint, 0.0);
        bc = tc, bi = i, bkey = tb->key;
        c_end[i] = tw__scan_end(comp_min, reduce, bt, bc, c_lo, c_hi, &slot_bt[tb->slot],
                                &slot_le[tb->slot], &slot_lt[tb->slot]);
      }
      /* Step 2: from the last C within bt down to the first whose first term exceeds it. */
      if (c_end[i] > *filled) {
        tw__first_terms(m, tb, *filled + 1, c_end[i], firsts + *filled + 1);
        *filled = c_end[i];
      }
      for (int32_t c = c_end[i]; c >= c_lo; c--) {
        const double first = firsts[c];
        if (first + reduce > bt) break;
        if (first + reduce == bt && c > bc) {
          /* A tie at a C above bc loses, and so does every C down to bc + 1 (their first
           * terms are no smaller): go on at bc. */
          c = bc + 1;
          continue;
        }
        const double comp = comp_us[c];
        const double lb = (first > comp ? first : comp) + reduce;
        if (pass == 0 && tw__better(lb, c, tb->key, bl, lc, lkey))
          bl = lb, lc = c, li = i, lkey = tb->key;
        if ((i == bi && c == bc) || !tw__better(lb, c, tb->key, bt, bc, bkey)) continue;
        if (n < TW__MAX_CANDS) {
          cand[n++] = (tw__cand){lb, first, c, i, tb->key, 0};
        } else { /* no room to order it: evaluate it now */
          const double t = tw__eval(m, tb, c, first, bt, 0, 0, NULL, 0.0);
          if (tw__better(t, c, tb->key, bt, bc, bkey)) bt = t, bc = c, bi = i, bkey = tb->key;
        }
      }
    }
    if (bi < 0) {
      *best_c = 0, *best_table = -1, *best_t = 0.0;
      return;
    }
    if (pass == 0 && li == bi && lc == bc && bt == bl) break; /* step 3 */
  }
  /* Step 4 (tw__solve_step4). */
  tw__solve_step4(m, hint, reduce, cand, n, li == bi && lc == bc && bt == bl, &bt, &bc, &bi, &bkey);
  *best_c = bc;
  *best_table = bi;
  *best_t = bt;
}

/* The plateau walk (plan.h, TW_MODEL_PLATEAU): from the best candidate (*c, *t) up through the
 * C of its table whose T stays within the band and whose next C still has the best's wave count
 * (a wave step's place is uncertain by a C: ranks differ by a few tiles), so the walk never takes
 * the last C before a step. *c and *t become the last one reached. Each step stops at its first
 * term above the band; the compute end's suffix minimum ends the walk where no larger C can be
 * within it. */
void tw__plateau_end(const tw__model_tables* m, int32_t table, int32_t c_hi, int32_t* c,
                     double* t) {
  const tw__seg_table* tb = &m->t[table];
  const double* comp_min = m->comp_min + (size_t)tb->slot * ((size_t)m->hw.c_max + 1);
  const double reduce = m->reduce_us;
  const double band = *t * (1.0 + TW_MODEL_PLATEAU);
  const int32_t waves = m->waves[*c];
  int32_t top = *c;
  double top_first = 0.0;
  for (int32_t x = *c + 1; x < c_hi && m->waves[x + 1] == waves; x++) {
    if (comp_min[x] + reduce > band) break; /* here and beyond */
    double first;
    tw__first_terms(m, tb, x, x, &first);
    if (first + reduce > band) break;
    /* Whether T <= band, not T itself: the maximum starts at the band (less the reduction), so
     * that the terms below it are skipped. */
    if (tw__eval(m, tb, x, first, band, 0, 0, NULL, (band - reduce) * TW__SKIP_SLACK) > band) break;
    top = x, top_first = first;
  }
  if (top != *c) {
    *c = top;
    *t = tw__eval(m, tb, top, top_first, DBL_MAX, 0, 0, NULL, 0.0);
  }
}
