/*
 * plan_exec.c: CPU execution of the planned GEMM2 + combine of all ranks, threaded like the GPU.
 *
 * Why: the planner's output (row layout, tile schedule, band destinations and offsets, segments,
 * the owners' slot_row maps) is only right if every (token, slot) row, computed on the rank of
 * its expert, lands exactly where its owner's weighted reduction reads it. Running the plans
 * with real concurrency and the kernels' signalling protocol on the CPU proves that without a
 * GPU, and proves that the protocol itself cannot deadlock or read unpublished data: the result
 * must equal a plain fp32 evaluation bit for bit (same summation orders), and every wait is
 * bounded so that a missing publish turns into TW_ERR_TIMEOUT instead of a hang.
 *
 * Threads per simulated rank r (W ranks in one process):
 *   producer  1: walks plan->tiles in schedule order, computes each tile (fp32, k order) into
 *                the rank's layout output, then release-increments band_done[band];
 *   consumers C = plan->comm_ctas: each claims the next unit (one band x one column tile,
 *                segments in schedule order) from the rank's claim counter, as the GPU's
 *                consumer CTAs do; waits (acquire) for all bands of the unit's segment, copies
 *                the band's valid rows x the tile's columns into the destination's receive
 *                buffer at the band's dest_offset and release-increments its arrivals[r];
 *   receiver  1: waits (acquire) for plan->recv_bands[s] x col_tiles arrivals from every
 *                source s and for its own local bands, then computes
 *                out[t] = sum_j w[t][j] * row(slot_row[t k + j]) in fp32, slot order.
 * Before any thread starts, the plans are cross-checked against each other and the routing
 * (every assignment computed exactly once on the right expert, every receive row filled by
 * exactly one band row, offsets in bounds); violations are TW_ERR_INTERNAL with the details.
 */
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "reference.h"

/* One transfer unit: one band of a segment x one column tile. */
typedef struct exec_unit {
  int32_t segment, band, col_tile;
} exec_unit;

typedef struct exec_rank {
  const struct tw_plan* plan;
  float* layout;           /* (rows, H) the rank's GEMM2 output in layout order */
  float* recv;             /* (recv_rows, H) rows other ranks send here */
  atomic_int* band_done;   /* (num_bands) tiles of each band published by the producer */
  atomic_int* arrivals;    /* (W) units arrived from each source rank */
  atomic_int* recv_writes; /* (recv_rows) units written into each receive row (diagnostic) */
  int32_t* expect_units;   /* (W) units the source ranks' plans send here (checked against
                              this rank's recv_bands, which the receiver waits for) */
  exec_unit* units;        /* (num_units) this rank's transfer units in schedule order */
  int64_t num_units;
  atomic_llong unit_next; /* the next unit no consumer has claimed */
} exec_rank;

typedef struct exec_ctx {
  tw_routing_t routing;
  const float* const* h; /* (W) -> (tokens, K, F) */
  const float* w2;       /* (E_total, H, F) */
  float* const* out;     /* (W) -> (tokens, H) */
  int32_t W, H, F, K, EL, tn, col_tiles;
  int64_t row_bytes; /* bytes of one row in a receive buffer (dtype width x H) */
  double timeout_s;
  tw_plan_exec_options opt;
  float* pad_input; /* (F) the input of padding rows: options->padding_value, 0 by default */
  exec_rank* ranks;
  atomic_int abort_flag; /* set by the first failing thread so that all others stop */
  pthread_mutex_t err_lock;
  tw_status err;
  char err_msg[512];
} exec_ctx;

typedef struct exec_thread {
  exec_ctx* ctx;
  int32_t rank, index; /* index: consumer id, unused for producer/receiver */
  pthread_t tid;
  int started;
} exec_thread;

/* Records the first failure of any thread and tells every other thread to stop. Later calls,
 * among them those of waits that the abort cut short, change nothing: abort_flag is only set
 * here, after err. */
static void exec_fail(exec_ctx* ctx, tw_status st, const char* fmt, ...) TW__PRINTF(3, 4);
static void exec_fail(exec_ctx* ctx, tw_status st, const char* fmt, ...) {
  pthread_mutex_lock(&ctx->err_lock);
  if (ctx->err == TW_SUCCESS) {
    ctx->err = st;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ctx->err_msg, sizeof ctx->err_msg, fmt, ap);
    va_end(ap);
  }
  pthread_mutex_unlock(&ctx->err_lock);
  atomic_store_explicit(&ctx->abort_flag, 1, memory_order_relaxed);
}

/* Spins until *counter >= target. Returns 1 when reached, 0 on timeout or abort. The acquire
 * load pairs with the release increment of the writer: once the count is seen, every store the
 * writer made before its increment (tile data, copied rows) is visible to this thread. */
static int exec_wait(exec_ctx* ctx, atomic_int* counter, int target, int* seen) {
  double deadline = tw__now_seconds() + ctx->timeout_s;
  for (uint64_t spin = 0;; spin++) {
    int v = atomic_load_explicit(counter, memory_order_acquire);
    *seen = v;
    if (v >= target) return 1;
    if (atomic_load_explicit(&ctx->abort_flag, memory_order_relaxed)) return 0;
    if ((spin & 63) == 63 && tw__now_seconds() > deadline) return 0;
    sched_yield(); /* the simulated ranks share few cores: let the producers run */
  }
}

static void* producer_main(void* arg) {
  exec_thread* th = (exec_thread*)arg;
  exec_ctx* ctx = th->ctx;
  exec_rank* rk = &ctx->ranks[th->rank];
  const struct tw_plan* plan = rk->plan;
  const int32_t H = ctx->H, F = ctx->F, K = ctx->K;
  int skipped = 0;
  for (int32_t i = 0; i < plan->num_tiles; i++) {
    if (atomic_load_explicit(&ctx->abort_flag, memory_order_relaxed)) return NULL;
    const tw_tile* tile = &plan->tiles[i];
    const float* w = ctx->w2 + (size_t)(th->rank * ctx->EL + tile->expert) * H * F;
    int32_t c1 = tile->col0 + ctx->tn < H ? tile->col0 + ctx->tn : H;
    for (int32_t row = tile->row0; row < tile->row0 + tile->rows; row++) {
      const tw_row_src* src = &plan->row_src[row];
      const float* in = src->owner < 0
                            ? ctx->pad_input
                            : ctx->h[src->owner] + ((size_t)src->token * K + src->slot) * F;
      float* o = rk->layout + (size_t)row * H;
      for (int32_t n = tile->col0; n < c1; n++) {
        const float* wn = w + (size_t)n * F;
        float acc = 0.0f;
        for (int32_t f = 0; f < F; f++) acc += in[f] * wn[f];
        o[n] = acc;
      }
    }
    if (th->rank == ctx->opt.skip_rank && tile->band == ctx->opt.skip_band && !skipped) {
      skipped = 1; /* fault injection: this tile is computed but never published */
      continue;
    }
    /* Release: the tile's stores above happen-before any acquire load that sees this count. */
    atomic_fetch_add_explicit(&rk->band_done[tile->band], 1, memory_order_release);
  }
  return NULL;
}

static void* consumer_main(void* arg) {
  exec_thread* th = (exec_thread*)arg;
  exec_ctx* ctx = th->ctx;
  exec_rank* rk = &ctx->ranks[th->rank];
  const struct tw_plan* plan = rk->plan;
  const int32_t H = ctx->H;
  for (int64_t u = atomic_fetch_add_explicit(&rk->unit_next, 1, memory_order_relaxed);
       u < rk->num_units; u = atomic_fetch_add_explicit(&rk->unit_next, 1, memory_order_relaxed)) {
    const exec_unit* un = &rk->units[u];
    const tw_segment* seg = &plan->segments[un->segment];
    for (int32_t b = seg->band0; b < seg->band0 + seg->nbands; b++) {
      int seen = 0;
      if (!exec_wait(ctx, &rk->band_done[b], ctx->col_tiles, &seen)) {
        exec_fail(ctx, TW_ERR_TIMEOUT,
                  "rank %d consumer %d: segment %d (bands %d..%d, to rank "
                  "%d) not ready after %.0f ms: band %d has %d of %d tiles published",
                  th->rank, th->index, un->segment, seg->band0, seg->band0 + seg->nbands - 1,
                  seg->dest, ctx->timeout_s * 1e3, b, seen, ctx->col_tiles);
        return NULL;
      }
    }
    const tw_band* band = &plan->bands[un->band];
    exec_rank* dst = &ctx->ranks[band->dest];
    int64_t drow = band->dest_offset / ctx->row_bytes;
    int32_t c0 = un->col_tile * ctx->tn, c1 = c0 + ctx->tn < H ? c0 + ctx->tn : H;
    for (int32_t i = 0; i < band->valid_rows; i++) {
      memcpy(dst->recv + (size_t)(drow + i) * H + c0,
             rk->layout + (size_t)(band->row0 + i) * H + c0, (size_t)(c1 - c0) * sizeof(float));
      atomic_fetch_add_explicit(&dst->recv_writes[drow + i], 1, memory_order_relaxed);
    }
    /* Release: the copied rows happen-before the receiver's acquire of the final count. Several
     * consumers add to the same counter; RMWs continue each other's release sequences, so the
     * acquire that sees the total synchronizes with every one of them. */
    atomic_fetch_add_explicit(&dst->arrivals[th->rank], 1, memory_order_release);
  }
  return NULL;
}

static void* receiver_main(void* arg) {
  exec_thread* th = (exec_thread*)arg;
  exec_ctx* ctx = th->ctx;
  const int32_t r = th->rank, H = ctx->H, K = ctx->K;
  exec_rank* rk = &ctx->ranks[r];
  const struct tw_plan* plan = rk->plan;
  int seen = 0;
  for (int32_t s = 0; s < ctx->W; s++) {
    if (s == r) continue;
    /* What the own plan says arrives, as on the GPU (check_plans matched it to the senders). */
    const int32_t expect = plan->recv_bands[s] * ctx->col_tiles;
    if (!exec_wait(ctx, &rk->arrivals[s], expect, &seen)) {
      exec_fail(ctx, TW_ERR_TIMEOUT,
                "rank %d receiver: %d of %d units from rank %d arrived "
                "after %.0f ms",
                r, seen, expect, s, ctx->timeout_s * 1e3);
      return NULL;
    }
  }
  /* Every band that holds rows of our own tokens: the local bands, and a band that sends its
   * first rows to another rank and keeps ours after them (the last remote group's tail). On the
   * GPU the final reduction runs after the producer kernel, which covers both. */
  for (int32_t b = 0; b < plan->num_bands; b++) {
    const tw_band* bd = &plan->bands[b];
    const int shared = bd->dest != r && bd->valid_rows < bd->rows &&
                       plan->row_src[bd->row0 + bd->valid_rows].owner == r;
    if (bd->dest != r && !shared) continue;
    if (!exec_wait(ctx, &rk->band_done[b], ctx->col_tiles, &seen)) {
      exec_fail(ctx, TW_ERR_TIMEOUT,
                "rank %d receiver: band %d (%s) has %d of %d tiles "
                "published after %.0f ms",
                r, b, shared ? "shared with a remote group" : "local", seen, ctx->col_tiles,
                ctx->timeout_s * 1e3);
      return NULL;
    }
  }
  const int32_t tokens = ctx->routing->tokens[r];
  const float* gw = ctx->routing->weights[r];
  for (int32_t t = 0; t < tokens; t++) {
    float* o = ctx->out[r] + (size_t)t * H;
    for (int32_t n = 0; n < H; n++) o[n] = 0.0f;
    for (int32_t j = 0; j < K; j++) {
      int32_t v = plan->slot_row[(size_t)t * K + j];
      const float* row = v < plan->recv_rows ? rk->recv + (size_t)v * H
                                             : rk->layout + (size_t)(v - plan->recv_rows) * H;
      float w = gw[(size_t)t * K + j];
      for (int32_t n = 0; n < H; n++) o[n] += w * row[n];
    }
  }
  return NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* Cross-checks of the plans (before any thread runs)                                          */
/* ------------------------------------------------------------------------------------------ */

#define BAD(...) return tw__fail(TW_ERR_INTERNAL, __VA_ARGS__)

static tw_status check_plans(exec_ctx* ctx, const tw_plan_t* plans) {
  const int32_t W = ctx->W, K = ctx->K;
  tw_routing_t rt = ctx->routing;
  /* hits[o][t k + j]: how many layouts compute assignment (o, t, j). */
  int32_t** hits = (int32_t**)calloc((size_t)W, sizeof(int32_t*));
  if (hits == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "plan exec: check scratch");
  tw_status st = TW_SUCCESS;
  for (int32_t o = 0; o < W && st == TW_SUCCESS; o++) {
    hits[o] = (int32_t*)calloc((size_t)rt->tokens[o] * K + 1, sizeof(int32_t));
    if (hits[o] == NULL) st = tw__fail(TW_ERR_OUT_OF_MEMORY, "plan exec: check scratch");
  }
  for (int32_t r = 0; r < W && st == TW_SUCCESS; r++) {
    const struct tw_plan* p = plans[r];
    for (int32_t e = 0; e < p->local_experts && st == TW_SUCCESS; e++)
      for (int32_t row = p->expert_row0[e]; row < p->expert_row0[e] + p->expert_rows[e]; row++) {
        const tw_row_src* s = &p->row_src[row];
        if (s->owner < 0) continue;
        if (s->owner >= W || s->token < 0 || s->token >= rt->tokens[s->owner] || s->slot < 0 ||
            s->slot >= K) {
          st = tw__fail(TW_ERR_INTERNAL,
                        "plan exec: rank %d row %d has source (%d, %d, %d) out "
                        "of range",
                        r, row, s->owner, s->token, s->slot);
          break;
        }
        size_t a = (size_t)s->token * K + s->slot;
        if (rt->expert_ids[s->owner][a] != r * ctx->EL + e) {
          st = tw__fail(TW_ERR_INTERNAL,
                        "plan exec: rank %d row %d (local expert %d) holds "
                        "assignment (%d, %d, %d) routed to expert %d",
                        r, row, e, s->owner, s->token, s->slot, rt->expert_ids[s->owner][a]);
          break;
        }
        hits[s->owner][a]++;
      }
  }
  for (int32_t o = 0; o < W && st == TW_SUCCESS; o++)
    for (size_t a = 0; a < (size_t)rt->tokens[o] * K; a++)
      if (hits[o][a] != 1) {
        st = tw__fail(TW_ERR_INTERNAL,
                      "plan exec: assignment (owner %d, token %zu, slot %zu) is "
                      "computed %d times over all layouts; expected once",
                      o, a / K, a % K, hits[o][a]);
        break;
      }
  for (int32_t o = 0; o < W; o++) free(hits[o]);
  free(hits);
  if (st != TW_SUCCESS) return st;

  for (int32_t r = 0; r < W; r++) {
    const struct tw_plan* p = plans[r];
    exec_rank* rk = &ctx->ranks[r];
    /* Every (band, column tile) is scheduled exactly once, on rows of the band. */
    int32_t* tiles_of = (int32_t*)calloc((size_t)p->num_bands + 1, sizeof(int32_t));
    if (tiles_of == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "plan exec: check scratch");
    for (int32_t i = 0; i < p->num_tiles; i++) {
      const tw_tile* t = &p->tiles[i];
      if (t->band < 0 || t->band >= p->num_bands || t->row0 != p->bands[t->band].row0 ||
          t->rows != p->bands[t->band].rows || t->expert != p->bands[t->band].expert ||
          t->col0 < 0 || t->col0 >= ctx->H || t->col0 % ctx->tn != 0) {
        free(tiles_of);
        BAD("plan exec: rank %d tile %d (band %d, row0 %d, rows %d, col0 %d) does not match its "
            "band",
            r, i, t->band, t->row0, t->rows, t->col0);
      }
      tiles_of[t->band]++;
    }
    for (int32_t b = 0; b < p->num_bands; b++)
      if (tiles_of[b] != ctx->col_tiles) {
        int32_t n = tiles_of[b];
        free(tiles_of);
        BAD("plan exec: rank %d band %d has %d tiles in the schedule; expected %d", r, b, n,
            ctx->col_tiles);
      }
    free(tiles_of);
    /* Bands: valid rows first and all owned by dest; after them padding, or in a band shared by
     * the last remote group and the local group, this rank's own rows; offsets in bounds. */
    for (int32_t b = 0; b < p->num_bands; b++) {
      const tw_band* bd = &p->bands[b];
      if (bd->dest < 0 || bd->dest >= W || bd->row0 < 0 || bd->row0 + bd->rows > p->rows ||
          bd->valid_rows < 1 || bd->valid_rows > bd->rows)
        BAD("plan exec: rank %d band %d (dest %d, row0 %d, rows %d, valid %d) is out of range", r,
            b, bd->dest, bd->row0, bd->rows, bd->valid_rows);
      for (int32_t i = 0; i < bd->rows; i++) {
        int32_t owner = p->row_src[bd->row0 + i].owner;
        if ((i < bd->valid_rows && owner != bd->dest) ||
            (i >= bd->valid_rows && owner != -1 && !(owner == r && bd->dest != r)))
          BAD("plan exec: rank %d band %d row %d has owner %d; the band sends %d valid rows to "
              "rank %d",
              r, b, bd->row0 + i, owner, bd->valid_rows, bd->dest);
      }
      if (bd->dest == r) {
        if (bd->segment != -1)
          BAD("plan exec: rank %d band %d is local but names segment %d", r, b, bd->segment);
        continue;
      }
      if (bd->segment < 0 || bd->segment >= p->num_segments)
        BAD("plan exec: rank %d remote band %d has segment %d of %d", r, b, bd->segment,
            p->num_segments);
      if (bd->dest_offset < 0 || bd->dest_offset % ctx->row_bytes != 0 ||
          bd->dest_offset / ctx->row_bytes + bd->valid_rows > plans[bd->dest]->recv_rows)
        BAD("plan exec: rank %d band %d: dest_offset %" PRId64 " + %d rows of %" PRId64
            " bytes does not fit rank %d's receive buffer of %d rows",
            r, b, bd->dest_offset, bd->valid_rows, ctx->row_bytes, bd->dest,
            plans[bd->dest]->recv_rows);
    }
    /* Segments: consecutive bands of one destination, contiguous at the destination. */
    int64_t units = 0;
    for (int32_t s = 0; s < p->num_segments; s++) {
      const tw_segment* sg = &p->segments[s];
      if (sg->nbands < 1 || sg->band0 < 0 || sg->band0 + sg->nbands > p->num_bands)
        BAD("plan exec: rank %d segment %d covers bands %d..+%d of %d", r, s, sg->band0, sg->nbands,
            p->num_bands);
      if (sg->ready_tiles != sg->nbands * ctx->col_tiles)
        BAD("plan exec: rank %d segment %d waits for %d tiles; its %d bands have %d", r, s,
            sg->ready_tiles, sg->nbands, sg->nbands * ctx->col_tiles);
      int64_t off = sg->dest_offset;
      int32_t valid = 0;
      for (int32_t b = sg->band0; b < sg->band0 + sg->nbands; b++) {
        const tw_band* bd = &p->bands[b];
        if (bd->segment != s || bd->dest != sg->dest || bd->dest_offset != off)
          BAD("plan exec: rank %d segment %d (dest %d, offset %" PRId64
              ") and its band %d (segment "
              "%d, dest %d, offset %" PRId64 ") disagree",
              r, s, sg->dest, off, b, bd->segment, bd->dest, bd->dest_offset);
        off += (int64_t)bd->valid_rows * ctx->row_bytes;
        valid += bd->valid_rows;
      }
      if (valid != sg->valid_rows || sg->src_row0 != p->bands[sg->band0].row0)
        BAD("plan exec: rank %d segment %d claims %d valid rows from row %d; its bands give %d "
            "from row %d",
            r, s, sg->valid_rows, sg->src_row0, valid, p->bands[sg->band0].row0);
      units += (int64_t)sg->nbands * ctx->col_tiles;
    }
    rk->num_units = units;
    rk->units = (exec_unit*)malloc((size_t)(units ? units : 1) * sizeof(exec_unit));
    if (rk->units == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "plan exec: units of rank %d", r);
    int64_t u = 0;
    for (int32_t s = 0; s < p->num_segments; s++)
      for (int32_t b = p->segments[s].band0; b < p->segments[s].band0 + p->segments[s].nbands; b++)
        for (int32_t c = 0; c < ctx->col_tiles; c++) rk->units[u++] = (exec_unit){s, b, c};
    for (int32_t b = 0; b < p->num_bands; b++)
      if (p->bands[b].dest != r) ctx->ranks[p->bands[b].dest].expect_units[r] += ctx->col_tiles;
  }
  /* The receiver waits for what its own plan says it receives (on the GPU it cannot see the
   * senders' plans); that must agree with what the senders' plans send. */
  for (int32_t r = 0; r < W; r++)
    for (int32_t s = 0; s < W; s++) {
      int64_t own = (int64_t)plans[r]->recv_bands[s] * ctx->col_tiles;
      if ((s == r && plans[r]->recv_bands[s] != 0) || own != ctx->ranks[r].expect_units[s])
        BAD("plan exec: rank %d expects %d bands from rank %d, whose plan sends it %d", r,
            plans[r]->recv_bands[s], s, ctx->ranks[r].expect_units[s] / ctx->col_tiles);
    }

  /* Receive side: every receive row is read by exactly one (token, slot); local rows point at
   * the assignment they hold. */
  for (int32_t r = 0; r < W; r++) {
    const struct tw_plan* p = plans[r];
    int32_t* reads = (int32_t*)calloc((size_t)p->recv_rows + 1, sizeof(int32_t));
    if (reads == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "plan exec: check scratch");
    for (int32_t t = 0; t < rt->tokens[r]; t++)
      for (int32_t j = 0; j < K; j++) {
        int32_t v = p->slot_row[(size_t)t * K + j];
        int32_t q = rt->expert_ids[r][(size_t)t * K + j] / ctx->EL;
        int bad = 0;
        if (v < 0 || v >= p->recv_rows + p->rows)
          bad = 1;
        else if (v < p->recv_rows)
          bad = q == r || reads[v]++ != 0;
        else {
          const tw_row_src* s = &p->row_src[v - p->recv_rows];
          bad = q != r || s->owner != r || s->token != t || s->slot != j;
        }
        if (bad) {
          free(reads);
          BAD("plan exec: rank %d token %d slot %d (expert on rank %d): slot_row %d is wrong "
              "(recv_rows %d, layout rows %d)",
              r, t, j, q, v, p->recv_rows, p->rows);
        }
      }
    for (int32_t v = 0; v < p->recv_rows; v++)
      if (reads[v] != 1) {
        int32_t n = reads[v];
        free(reads);
        BAD("plan exec: rank %d receive row %d is read by %d (token, slot) pairs; expected 1", r, v,
            n);
      }
    free(reads);
  }
  return TW_SUCCESS;
}

/* ------------------------------------------------------------------------------------------ */

static void free_ranks(exec_ctx* ctx) {
  if (ctx->ranks == NULL) return;
  for (int32_t r = 0; r < ctx->W; r++) {
    exec_rank* rk = &ctx->ranks[r];
    free(rk->layout);
    free(rk->recv);
    free(rk->band_done);
    free(rk->arrivals);
    free(rk->recv_writes);
    free(rk->expect_units);
    free(rk->units);
  }
  free(ctx->ranks);
}

static tw_status run_threads(exec_ctx* ctx, const tw_plan_t* plans) {
  int64_t n = 0;
  for (int32_t r = 0; r < ctx->W; r++) n += 2 + plans[r]->comm_ctas;
  exec_thread* th = (exec_thread*)calloc((size_t)n, sizeof(exec_thread));
  if (th == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "plan exec: %" PRId64 " threads", n);
  tw_status st = TW_SUCCESS;
  int64_t i = 0;
  for (int32_t r = 0; r < ctx->W && st == TW_SUCCESS; r++) {
    /* Receivers and consumers first, so that they are already waiting when tiles publish. */
    for (int32_t c = -2; c < plans[r]->comm_ctas; c++, i++) {
      th[i] = (exec_thread){ctx, r, c, 0, 0};
      void* (*fn)(void*) = c == -2 ? receiver_main : c == -1 ? producer_main : consumer_main;
      if (pthread_create(&th[i].tid, NULL, fn, &th[i]) != 0) {
        exec_fail(ctx, TW_ERR_OUT_OF_MEMORY, "plan exec: could not start thread %" PRId64, i);
        st = TW_ERR_OUT_OF_MEMORY;
        break;
      }
      th[i].started = 1;
    }
  }
  for (int64_t j = 0; j < n; j++)
    if (th[j].started) pthread_join(th[j].tid, NULL);
  free(th);
  return st;
}

tw_status tw__plan_exec_cpu(tw_routing_t routing, const tw_plan_t* plans, const float* const* h,
                            const float* w2, float* const* out,
                            const tw_plan_exec_options* options) {
  TW_CHECK_NULL(routing);
  TW_CHECK_NULL(plans);
  TW_CHECK_NULL(h);
  TW_CHECK_NULL(w2);
  TW_CHECK_NULL(out);
  const tw_problem* pb = &routing->problem;
  exec_ctx ctx;
  memset(&ctx, 0, sizeof ctx);
  ctx.routing = routing;
  ctx.h = h;
  ctx.w2 = w2;
  ctx.out = out;
  ctx.W = pb->world_size;
  ctx.H = pb->hidden;
  ctx.F = pb->ffn;
  ctx.K = pb->top_k;
  ctx.EL = pb->experts / pb->world_size;
  ctx.row_bytes = (int64_t)pb->hidden * 2; /* bf16 and fp16 rows: 2 bytes per value */
  ctx.opt = options ? *options : (tw_plan_exec_options)TW_PLAN_EXEC_OPTIONS_INIT;
  int64_t ms = ctx.opt.timeout_ms > 0 ? ctx.opt.timeout_ms
                                      : tw__tunable_int_lenient(TW_TUNE_TIMEOUT_MS, 10000);
  ctx.timeout_s = (double)ms * 1e-3;
  for (int32_t r = 0; r < ctx.W; r++) {
    if (plans[r] == NULL)
      return tw__fail(TW_ERR_NULL_POINTER, "%s: plans[%d] is NULL; pass one plan per rank",
                      __func__, r);
    const struct tw_plan* p = plans[r];
    if (p->rank != r || p->problem.world_size != ctx.W || p->problem.hidden != ctx.H ||
        p->problem.ffn != ctx.F || p->problem.experts != pb->experts || p->problem.top_k != ctx.K ||
        p->local_experts != ctx.EL)
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "%s: plans[%d] is for rank %d of another problem; "
                      "create plans[r] for rank r from this routing",
                      __func__, r, p->rank);
    if (r > 0 && (p->tn != plans[0]->tn || p->tm != plans[0]->tm))
      return tw__fail(TW_ERR_INVALID_ARGUMENT, "%s: plans disagree on the tile shape", __func__);
    if (p->comm_ctas < 1 && p->num_segments > 0)
      return tw__fail(TW_ERR_INTERNAL, "%s: plan of rank %d has comm_ctas %d", __func__, r,
                      p->comm_ctas);
    if (routing->tokens[r] > 0 && (h[r] == NULL || out[r] == NULL))
      return tw__fail(TW_ERR_NULL_POINTER,
                      "%s: h[%d] or out[%d] is NULL but rank %d has %d "
                      "tokens",
                      __func__, r, r, r, routing->tokens[r]);
  }
  ctx.tn = plans[0]->tn;
  ctx.col_tiles = plans[0]->col_tiles;
  if (ctx.tn < 1 || ctx.col_tiles != tw__ceil_div(ctx.H, ctx.tn))
    return tw__fail(TW_ERR_INTERNAL, "%s: tn %d and col_tiles %d do not cover hidden %d", __func__,
                    ctx.tn, ctx.col_tiles, ctx.H);

  tw_status st = TW_SUCCESS;
  ctx.pad_input = (float*)calloc((size_t)ctx.F, sizeof(float));
  for (int32_t f = 0; ctx.pad_input != NULL && f < ctx.F; f++)
    ctx.pad_input[f] = ctx.opt.padding_value;
  ctx.ranks = (exec_rank*)calloc((size_t)ctx.W, sizeof(exec_rank));
  if (ctx.pad_input == NULL || ctx.ranks == NULL) {
    st = tw__fail(TW_ERR_OUT_OF_MEMORY, "%s: context", __func__);
    goto done;
  }
  for (int32_t r = 0; r < ctx.W; r++) {
    const struct tw_plan* p = plans[r];
    exec_rank* rk = &ctx.ranks[r];
    rk->plan = p;
    rk->layout = (float*)malloc(((size_t)p->rows * ctx.H + 1) * sizeof(float));
    rk->recv = (float*)malloc(((size_t)p->recv_rows * ctx.H + 1) * sizeof(float));
    rk->band_done = (atomic_int*)malloc(((size_t)p->num_bands + 1) * sizeof(atomic_int));
    rk->arrivals = (atomic_int*)malloc((size_t)ctx.W * sizeof(atomic_int));
    rk->recv_writes = (atomic_int*)malloc(((size_t)p->recv_rows + 1) * sizeof(atomic_int));
    rk->expect_units = (int32_t*)calloc((size_t)ctx.W, sizeof(int32_t));
    if (!rk->layout || !rk->recv || !rk->band_done || !rk->arrivals || !rk->recv_writes ||
        !rk->expect_units) {
      st = tw__fail(TW_ERR_OUT_OF_MEMORY, "%s: buffers of rank %d (%d rows, %d receive rows)",
                    __func__, r, p->rows, p->recv_rows);
      goto done;
    }
    /* Poison (NaN) so that a row nobody wrote cannot pass a bitwise comparison. */
    memset(rk->layout, 0xff, ((size_t)p->rows * ctx.H + 1) * sizeof(float));
    memset(rk->recv, 0xff, ((size_t)p->recv_rows * ctx.H + 1) * sizeof(float));
    for (int32_t b = 0; b < p->num_bands; b++) atomic_init(&rk->band_done[b], 0);
    for (int32_t s = 0; s < ctx.W; s++) atomic_init(&rk->arrivals[s], 0);
    atomic_init(&rk->unit_next, 0);
    for (int32_t v = 0; v < p->recv_rows; v++) atomic_init(&rk->recv_writes[v], 0);
  }
  st = check_plans(&ctx, plans);
  if (st != TW_SUCCESS) goto done;

  atomic_init(&ctx.abort_flag, 0);
  pthread_mutex_init(&ctx.err_lock, NULL);
  ctx.err = TW_SUCCESS;
  st = run_threads(&ctx, plans);
  pthread_mutex_destroy(&ctx.err_lock);
  if (ctx.err != TW_SUCCESS) {
    st = tw__fail(ctx.err, "%s", ctx.err_msg);
    goto done;
  }
  if (st != TW_SUCCESS) goto done;
  /* Every receive row got each of its column tiles exactly once. */
  for (int32_t r = 0; r < ctx.W; r++)
    for (int32_t v = 0; v < plans[r]->recv_rows; v++) {
      int n = atomic_load_explicit(&ctx.ranks[r].recv_writes[v], memory_order_relaxed);
      if (n != ctx.col_tiles) {
        st = tw__fail(TW_ERR_INTERNAL,
                      "%s: rank %d receive row %d was written by %d units; "
                      "expected %d (one per column tile)",
                      __func__, r, v, n, ctx.col_tiles);
        goto done;
      }
    }
done:
  free_ranks(&ctx);
  free(ctx.pad_input);
  return st;
}
