/*
 * device_plan.cu: device copies of one rank's plan (tiles, bands, segments, consumer units,
 * slot rows, gate weights, under the add dataflow each row's token and weight, and on a layer
 * context GEMM1's tile list), sized once
 * for the worst case the context's problem allows, so that uploads never allocate. An upload
 * checks the plan against the context before any byte is copied, so that no remote or local
 * access of a later call can leave its buffer. A device plan that a captured call uses keeps
 * the sizes baked into the graph's kernel arguments; later uploads must match them. On a context
 * with a dispatch capacity every device plan starts with the static plan (tw__device_plan_static),
 * which the capturable dispatch needs and never replaces.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "context.h"

/* Byte offsets of a device plan's arrays in its one allocation, sized for the worst case of the
 * context's problem. */
typedef struct tw__dplan_layout {
  size_t tiles, bands, segs, unit0, slot, w, tok, rw, sb, sr0, pads, srow, units, g1, bytes;
  size_t bg, bf, bl, lt, lg1, lc;          /* the capturable mode's arrays */
  size_t nt, nb, ns, nr, ne, np, nsr, ng1; /* element counts */
  size_t ncb, nct, ncg1;                   /* the capturable mode's: bands, tiles, GEMM1 tiles */
  size_t so, ss, cu, nso, nu;              /* the banded copy's: send_off, send_slot, units */
} tw__dplan_layout;

static tw__dplan_layout tw__dplan_layout_of(const struct tw_context* ctx) {
  tw__dplan_layout L;
  L.nt = (size_t)ctx->bands_max * ctx->col_tiles;
  L.nb = (size_t)ctx->bands_max;
  L.ns = (size_t)ctx->slots_max;
  L.tiles = 0;
  L.bands = tw__align(L.tiles + L.nt * sizeof(tw_tile), 256);
  L.segs = tw__align(L.bands + L.nb * sizeof(tw_band), 256);
  L.unit0 = tw__align(L.segs + L.nb * sizeof(tw_segment), 256);
  L.slot = tw__align(L.unit0 + (2 * L.nb + 1) * 4, 256);
  L.w = tw__align(L.slot + L.ns * 4 + 4, 256);
  /* The add dataflow's per-row token and weight. */
  L.nr = ctx->dataflow == TW_DATAFLOW_ADD ? (size_t)ctx->rows_max : 0;
  L.tok = tw__align(L.w + L.ns * 4 + 4, 256);
  L.rw = tw__align(L.tok + L.nr * 4, 256);
  /* Dispatch: the count plan's tables and the per-slot destination rows. */
  L.ne = ctx->dispatch ? (size_t)ctx->problem.experts : 0;
  L.np = ctx->dispatch ? 1 + 2 * (size_t)ctx->local_experts * ctx->world : 0;
  L.nsr = ctx->dispatch ? L.ns : 0;
  L.sb = tw__align(L.rw + L.nr * 4 + 4, 256);
  L.sr0 = tw__align(L.sb + L.ne * 4, 256);
  L.pads = tw__align(L.sr0 + L.ne * 4, 256);
  L.srow = tw__align(L.pads + L.np * 4, 256);
  /* The units each source sends here per call (the call begin adds them to the targets). */
  L.units = tw__align(L.srow + L.nsr * 4 + 4, 256);
  /* The layer: GEMM1's tiles, every band by ceil(ffn / TW_GEMM1_TN) column tiles. */
  L.ng1 = ctx->layer ? L.nb * (size_t)tw__ceil_div(ctx->problem.ffn, TW_GEMM1_TN) : 0;
  /* After the units: the plan's fingerprint (uint64, combine.h plan_fp). */
  L.g1 = tw__align(L.units + TW_MAX_RANKS * 4 + 8, 256);
  /* The capturable mode: each band's group and first row, the mask's outputs (dispatch.h). */
  const int cap = ctx->capacity > 0;
  L.ncb = cap ? L.nb : 0;
  L.nct = cap ? L.nt : 0;
  L.ncg1 = cap ? L.ng1 : 0;
  L.bg = tw__align(L.g1 + L.ng1 * sizeof(tw_tile), 256);
  L.bf = tw__align(L.bg + L.ncb * 4, 256);
  L.bl = tw__align(L.bf + L.ncb * 4, 256);
  L.lt = tw__align(L.bl + L.ncb * 4, 256);
  L.lg1 = tw__align(L.lt + L.nct * sizeof(tw_tile), 256);
  L.lc = tw__align(L.lg1 + L.ncg1 * sizeof(tw_tile), 256);
  /* The banded copy (eager layer contexts). */
  const int banded = ctx->layer && !cap;
  L.nso = banded ? (size_t)ctx->problem.experts : 0;
  L.nu = banded ? (size_t)tw__copy_units_max(&ctx->problem, ctx->tm) : 0;
  L.so = tw__align(L.lc + (cap ? 256 : 0), 256);
  L.ss = tw__align(L.so + L.nso * 4, 256);
  L.cu = tw__align(L.ss + (banded ? L.ns * 4 : 0), 256);
  L.bytes = L.cu + L.nu * sizeof(tw_copy_unit);
  return L;
}

size_t tw__device_plan_bytes(const struct tw_context* ctx) {
  return tw__dplan_layout_of(ctx).bytes;
}

/* The capturable mode's static plan (tw__plan_create_static, planned for the context's budget)
 * into a new device plan, with the dispatch's tables (slot_base, send_row0, no padding: every
 * group is whole bands), each band's group and first row, GEMM1's tiles with schedule band
 * indices, and a mask of no live rows until the first dispatch. Synchronous (set-up time), on
 * the context's auxiliary stream: the legacy default stream could wait behind an in-process
 * peer's kernels. */
static tw_status tw__device_plan_static(tw_device_plan_t d) {
  tw_context_t ctx = d->ctx;
  const int32_t W = ctx->world, ET = ctx->problem.experts;
  const int32_t cap = ctx->capacity, TM = ctx->tm, rank = ctx->rank;
  tw_plan_config pc = TW_PLAN_CONFIG_INIT;
  pc.dataflow = ctx->dataflow;
  pc.sm_budget = ctx->sm_budget;
  tw_plan_t plan = NULL;
  TW_TRY(tw__plan_create_static(&ctx->problem, cap, rank, &pc, &plan));
  int32_t* h = (int32_t*)malloc(((size_t)2 * plan->num_bands + (size_t)plan->rows / TM + 1) * 4);
  tw_status st =
      h == NULL ? tw__fail(TW_ERR_OUT_OF_MEMORY, "tw_device_plan_create: host memory") : TW_SUCCESS;
  int64_t units = 0;
  if (st == TW_SUCCESS) st = tw__device_plan_check(d, plan, 0, &units, "tw_device_plan_create");
  /* Every write of a dispatch stays in bounds: cap rows from send_row0[g] at g's rank, from
   * slot_base[g] here. */
  for (int32_t g = 0; g < ET && st == TW_SUCCESS; g++)
    if (plan->send_row0[g] < 0 || plan->send_row0[g] + (int64_t)cap > ctx->rows_max ||
        plan->slot_base[g] < 0 ||
        plan->slot_base[g] + (int64_t)cap > (int64_t)plan->recv_rows + plan->rows)
      st = tw__fail(TW_ERR_INTERNAL,
                    "tw_device_plan_create: static group of expert %d out of "
                    "bounds (send row %d, slot base %d)",
                    g, plan->send_row0[g], plan->slot_base[g]);
  /* Band b lies in group (e, o): the layout holds expert e's groups in owner order rank + 1, ...,
   * rank (layout.c), each exactly cap rows. by_row maps a band's first row / TM to b. */
  int32_t* band_group = h;
  int32_t* band_first = h + plan->num_bands;
  int32_t* by_row = h + 2 * plan->num_bands;
  for (int32_t b = 0; b < plan->num_bands && st == TW_SUCCESS; b++) {
    const tw_band* band = &plan->bands[b];
    const int32_t off = band->row0 - plan->expert_row0[band->expert];
    const int32_t q = off / cap, o = (rank + 1 + q) % W;
    if (q >= W || band->row0 % TM != 0 || band->rows != TM || band->dest != o)
      st = tw__fail(TW_ERR_INTERNAL,
                    "tw_device_plan_create: static band %d (row %d, dest %d) is "
                    "not one band of group %d",
                    b, band->row0, band->dest, q);
    band_group[b] = band->expert * W + o;
    band_first[b] = off - q * cap;
    by_row[band->row0 / TM] = b;
  }
  if (st == TW_SUCCESS) {
    tw__device_guard guard(ctx->device);
    cudaStream_t s = ctx->s_aux;
    d->h_pads[0] = 0;
    st = tw__device_plan_copy(d, plan, 0, units, s);
    for (int32_t i = 0; i < d->num_gemm1_tiles && st == TW_SUCCESS; i++)
      d->h_gemm1_tiles[i].band = by_row[d->h_gemm1_tiles[i].row0 / TM];
    cudaError_t e = cudaSuccess;
    if (st == TW_SUCCESS && d->num_gemm1_tiles > 0)
      e = cudaMemcpyAsync(d->gemm1_tiles, d->h_gemm1_tiles,
                          (size_t)d->num_gemm1_tiles * sizeof(tw_tile), cudaMemcpyHostToDevice, s);
    if (st == TW_SUCCESS && e == cudaSuccess)
      e = cudaMemcpyAsync(d->slot_base, plan->slot_base, (size_t)ET * 4, cudaMemcpyHostToDevice, s);
    if (st == TW_SUCCESS && e == cudaSuccess)
      e = cudaMemcpyAsync(d->send_row0, plan->send_row0, (size_t)ET * 4, cudaMemcpyHostToDevice, s);
    if (st == TW_SUCCESS && e == cudaSuccess)
      e = cudaMemcpyAsync(d->pads, d->h_pads, 4, cudaMemcpyHostToDevice, s);
    if (st == TW_SUCCESS && e == cudaSuccess && plan->num_bands > 0)
      e = cudaMemcpyAsync(d->band_group, band_group, (size_t)plan->num_bands * 4,
                          cudaMemcpyHostToDevice, s);
    if (st == TW_SUCCESS && e == cudaSuccess && plan->num_bands > 0)
      e = cudaMemcpyAsync(d->band_first, band_first, (size_t)plan->num_bands * 4,
                          cudaMemcpyHostToDevice, s);
    /* No live rows, no live tiles until the first dispatch. */
    if (st == TW_SUCCESS && e == cudaSuccess && plan->num_bands > 0)
      e = cudaMemsetAsync(d->band_live, 0, (size_t)plan->num_bands * 4, s);
    if (st == TW_SUCCESS && e == cudaSuccess) e = cudaMemsetAsync(d->live_counts, 0, 8, s);
    if (st == TW_SUCCESS && e == cudaSuccess) e = cudaStreamSynchronize(s);
    if (st == TW_SUCCESS && e != cudaSuccess)
      st = tw__fail(TW_ERR_CUDA, "tw_device_plan_create: static plan upload: %s",
                    cudaGetErrorString(e));
  }
  if (st == TW_SUCCESS) {
    d->pad_rows = 0;
    d->is_static = 1;
    d->uploaded = 1;
    TW_INFO(
        "device plan: rank %d static plan of %d rows (%d per expert and source), %d bands, "
        "%d tiles, %d units",
        rank, plan->rows, cap, plan->num_bands, plan->num_tiles, d->total_units);
  }
  free(h);
  tw_plan_destroy(plan);
  return st;
}

extern "C" tw_status tw_device_plan_create(tw_context_t ctx, tw_device_plan_t* out) {
  tw__clear_error();
  TW_CHECK_NULL(ctx);
  TW_CHECK_NULL(out);
  *out = NULL;
  TW_DEVICE_SCOPE(ctx);
  tw_device_plan_t d = (tw_device_plan_t)calloc(1, sizeof(struct tw_device_plan));
  if (d == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "tw_device_plan_create: host memory");
  d->ctx = ctx;
  const tw__dplan_layout L = tw__dplan_layout_of(ctx);
  const size_t nb = L.nb, nr = L.nr, np = L.np;
  const size_t off_tiles = L.tiles, off_bands = L.bands, off_segs = L.segs, off_unit0 = L.unit0;
  const size_t off_slot = L.slot, off_w = L.w, off_tok = L.tok, off_rw = L.rw, off_sb = L.sb;
  const size_t off_sr0 = L.sr0, off_pads = L.pads, off_srow = L.srow, off_units = L.units;
  const size_t bytes = L.bytes;
  d->h_seg_unit0 = (int32_t*)malloc((2 * nb + 1 + TW_MAX_RANKS) * 4);
  if (nr > 0) d->h_row_token = (int32_t*)malloc(nr * 8);
  if (np > 0) d->h_pads = (int32_t*)malloc(np * 4);
  if (L.ng1 > 0) d->h_gemm1_tiles = (tw_tile*)malloc(L.ng1 * sizeof(tw_tile));
  if (L.nu > 0) d->h_copy_units = (tw_copy_unit*)malloc(L.nu * sizeof(tw_copy_unit) + L.nso * 4);
  d->h_expert_rows = (int32_t*)calloc(3 * (size_t)ctx->local_experts + 1, 4);
  cudaError_t e = cudaMalloc(&d->mem, bytes);
  if (e != cudaSuccess || d->h_seg_unit0 == NULL || (nr > 0 && d->h_row_token == NULL) ||
      (np > 0 && d->h_pads == NULL) || (L.ng1 > 0 && d->h_gemm1_tiles == NULL) ||
      (L.nu > 0 && d->h_copy_units == NULL) || d->h_expert_rows == NULL) {
    free(d->h_seg_unit0);
    free(d->h_row_token);
    free(d->h_pads);
    free(d->h_gemm1_tiles);
    free(d->h_copy_units);
    free(d->h_expert_rows);
    if (e == cudaSuccess) cudaFree(d->mem);
    free(d);
    return tw__fail(TW_ERR_OUT_OF_MEMORY, "tw_device_plan_create: %zu bytes: %s", bytes,
                    cudaGetErrorString(e));
  }
  char* m = (char*)d->mem;
  d->tiles = (tw_tile*)(m + off_tiles);
  d->bands = (tw_band*)(m + off_bands);
  d->segments = (tw_segment*)(m + off_segs);
  d->seg_unit0 = (int32_t*)(m + off_unit0);
  d->seg_split0 = d->seg_unit0 + nb + 1;
  d->h_seg_split0 = d->h_seg_unit0 + nb + 1;
  d->recv_units = (uint32_t*)(m + off_units);
  d->h_recv_units = (uint32_t*)(d->h_seg_split0 + nb);
  d->plan_fp = (uint64_t*)(m + off_units + TW_MAX_RANKS * 4);
  d->slot_row = (int32_t*)(m + off_slot);
  d->weights = (float*)(m + off_w);
  if (nr > 0) {
    d->row_token = (int32_t*)(m + off_tok);
    d->row_weight = (float*)(m + off_rw);
    d->h_row_weight = (float*)(d->h_row_token + nr);
  }
  if (ctx->dispatch) {
    d->slot_base = (int32_t*)(m + off_sb);
    d->send_row0 = (int32_t*)(m + off_sr0);
    d->pads = (int32_t*)(m + off_pads);
    d->send_row = (int32_t*)(m + off_srow);
  }
  if (L.ng1 > 0) d->gemm1_tiles = (tw_tile*)(m + L.g1);
  if (L.nu > 0) {
    d->send_off = (int32_t*)(m + L.so);
    d->send_slot = (int32_t*)(m + L.ss);
    d->copy_units = (tw_copy_unit*)(m + L.cu);
    d->h_send_off = (int32_t*)(d->h_copy_units + L.nu);
    d->copy_units_max = (int32_t)L.nu;
  }
  if (ctx->capacity > 0) {
    d->band_group = (int32_t*)(m + L.bg);
    d->band_first = (int32_t*)(m + L.bf);
    d->band_live = (int32_t*)(m + L.bl);
    d->live_tiles = (tw_tile*)(m + L.lt);
    if (L.ncg1 > 0) d->live_gemm1_tiles = (tw_tile*)(m + L.lg1);
    d->live_counts = (int32_t*)(m + L.lc);
    const tw_status st = tw__device_plan_static(d);
    if (st != TW_SUCCESS) {
      char why[512];
      snprintf(why, sizeof why, "%s", tw_last_error());
      tw_device_plan_destroy(d); /* clears the error: keep the message */
      return tw__fail(st, "%s", why);
    }
  }
  *out = d;
  return TW_SUCCESS;
}

extern "C" tw_status tw_device_plan_destroy(tw_device_plan_t d) {
  tw__clear_error();
  if (d == NULL) return TW_SUCCESS;
  {
    tw__device_guard guard(d->ctx->device);
    /* A call may still read the arrays. */
    tw__sync_all(d->ctx);
    cudaFree(d->mem);
  }
  free(d->h_seg_unit0);
  free(d->h_row_token);
  free(d->h_pads);
  free(d->h_gemm1_tiles);
  free(d->h_copy_units);
  free(d->h_expert_rows);
  free(d);
  return TW_SUCCESS;
}

tw_status tw__device_plan_check(tw_device_plan_t d, const struct tw_plan* plan, int32_t tokens,
                                int64_t* units_out, const char* what) {
  tw_context_t ctx = d->ctx;
  const tw_problem* p = &ctx->problem;
  const tw_problem* q = &plan->problem;
  if (plan->rank != ctx->rank)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "%s: plan is for rank %d, the context is rank %d; upload this rank's plan",
                    what, plan->rank, ctx->rank);
  if (q->world_size != p->world_size || q->hidden != p->hidden || q->ffn != p->ffn ||
      q->experts != p->experts || q->top_k != p->top_k || plan->tm != ctx->tm ||
      plan->tn != ctx->tn)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "%s: plan problem (W %d, H %d, F %d, E %d, k %d, tile %dx%d) "
                    "differs from the context's (W %d, H %d, F %d, E %d, k %d, tile %dx%d)",
                    what, q->world_size, q->hidden, q->ffn, q->experts, q->top_k, plan->tm,
                    plan->tn, p->world_size, p->hidden, p->ffn, p->experts, p->top_k, ctx->tm,
                    ctx->tn);
  if (plan->dataflow != ctx->dataflow)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "%s: the plan was predicted for the %s dataflow, the "
                    "context runs %s; set tw_plan_config.dataflow to the context's",
                    what, tw__dataflow_name(plan->dataflow), tw__dataflow_name(ctx->dataflow));
  if (tokens > p->max_tokens)
    return tw__fail(TW_ERR_CAPACITY,
                    "%s: %d tokens on rank %d, the context holds at most %d "
                    "(problem max_tokens)",
                    what, tokens, ctx->rank, p->max_tokens);
  if (plan->rows > ctx->rows_max || plan->num_bands > ctx->bands_max ||
      plan->num_segments > ctx->bands_max || plan->recv_rows > ctx->recv_rows_max ||
      (int64_t)plan->num_tiles != (int64_t)plan->num_bands * ctx->col_tiles)
    return tw__fail(TW_ERR_CAPACITY,
                    "%s: plan has %d rows, %d bands, %d segments, %d tiles, %d "
                    "receive rows; the context holds %lld rows, %lld bands, %lld receive rows",
                    what, plan->rows, plan->num_bands, plan->num_segments, plan->num_tiles,
                    plan->recv_rows, (long long)ctx->rows_max, (long long)ctx->bands_max,
                    (long long)ctx->recv_rows_max);
  /* Consistency checks that keep every remote and local access in bounds. */
  const int64_t row_bytes = (int64_t)p->hidden * 2;
  const int64_t recv_cap = ctx->recv_rows_max * row_bytes;
  for (int32_t i = 0; i < plan->num_bands; i++) {
    const tw_band* b = &plan->bands[i];
    if (b->row0 < 0 || b->valid_rows < 0 || b->valid_rows > b->rows ||
        b->row0 + b->rows > plan->rows || b->dest < 0 || b->dest >= ctx->world ||
        (b->dest != ctx->rank && ctx->dataflow == TW_DATAFLOW_REDUCE &&
         (b->dest_offset < 0 || b->dest_offset % row_bytes != 0 ||
          b->dest_offset + (int64_t)b->valid_rows * row_bytes > recv_cap)))
      return tw__fail(TW_ERR_INTERNAL,
                      "%s: band %d (rows %d+%d, valid %d, dest %d, offset %lld) "
                      "is out of bounds",
                      what, i, b->row0, b->rows, b->valid_rows, b->dest, (long long)b->dest_offset);
  }
  for (int32_t s = 0; s < plan->num_segments; s++) {
    const tw_segment* sg = &plan->segments[s];
    if (sg->band0 < 0 || sg->nbands < 1 || sg->band0 + sg->nbands > plan->num_bands ||
        sg->dest < 0 || sg->dest >= ctx->world || sg->dest == ctx->rank)
      return tw__fail(TW_ERR_INTERNAL, "%s: segment %d is malformed", what, s);
  }
  for (int s = 0; s < ctx->world; s++) {
    if (s != ctx->rank && plan->recv_bands[s] < 0)
      return tw__fail(TW_ERR_INTERNAL, "%s: recv_bands[%d] < 0", what, s);
    d->h_recv_units[s] = s == ctx->rank
                             ? 0u
                             : (uint32_t)tw__owner_units(plan->recv_bands[s], ctx->tail_bands,
                                                         ctx->tail_parts, ctx->unit_chunks);
  }
  const int64_t units = tw__consumer_units(plan, ctx->tail_bands, ctx->tail_parts, ctx->unit_chunks,
                                           d->h_seg_unit0, d->h_seg_split0);
  if (units < 0)
    return tw__fail(TW_ERR_INTERNAL, "%s: the segments cannot be cut into units", what);
  if (units > INT32_MAX)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "%s: %lld consumer units do not fit 32 bits; use fewer "
                    "TW_CONSUMER_TAIL_PARTS or wider units (TW_CONSUMER_TILES_PER_UNIT)",
                    what, (long long)units);
  /* A captured call replays with the sizes it was captured with (grids, copy lengths, loop
   * bounds in its kernel arguments); what the kernels read from this plan's memory may change. */
  if (d->captured && (plan->rows != d->rows || plan->recv_rows != d->recv_rows ||
                      plan->num_tiles != d->num_tiles || plan->num_bands != d->num_bands ||
                      units != d->total_units || tokens != d->tokens))
    return tw__fail(TW_ERR_STATE,
                    "%s: a captured call uses this device plan, and this plan's sizes (%d rows, "
                    "%d receive rows, %d bands, %lld units, %d tokens) differ from the captured "
                    "ones (%d, %d, %d, %d, %d); upload it into another device plan and capture a "
                    "call with that one",
                    what, plan->rows, plan->recv_rows, plan->num_bands, (long long)units, tokens,
                    d->rows, d->recv_rows, d->num_bands, d->total_units, d->tokens);
  *units_out = units;
  return TW_SUCCESS;
}

tw_status tw__device_plan_copy(tw_device_plan_t d, const struct tw_plan* plan, int32_t tokens,
                               int64_t units, cudaStream_t stream) {
  tw_context_t ctx = d->ctx;
  /* The layer: GEMM1's tile list of this plan, built before anything is copied (a failure
   * leaves the device plan's sizes as they were). */
  int32_t g1 = 0;
  if (ctx->layer) {
    const int64_t cap = ctx->bands_max * tw__ceil_div(ctx->problem.ffn, TW_GEMM1_TN);
    TW_TRY(tw__plan_gemm1_tiles(plan, TW_GEMM1_TN, d->h_gemm1_tiles, (int32_t)cap, &g1));
  }
  /* Pageable copies: each returns once the source is staged, so the host plan may go away. */
  if (plan->num_tiles > 0)
    TW_CUDA_TRY(cudaMemcpyAsync(d->tiles, plan->tiles, (size_t)plan->num_tiles * sizeof(tw_tile),
                                cudaMemcpyHostToDevice, stream));
  if (plan->num_bands > 0)
    TW_CUDA_TRY(cudaMemcpyAsync(d->bands, plan->bands, (size_t)plan->num_bands * sizeof(tw_band),
                                cudaMemcpyHostToDevice, stream));
  if (plan->num_segments > 0)
    TW_CUDA_TRY(cudaMemcpyAsync(d->segments, plan->segments,
                                (size_t)plan->num_segments * sizeof(tw_segment),
                                cudaMemcpyHostToDevice, stream));
  TW_CUDA_TRY(cudaMemcpyAsync(d->seg_unit0, d->h_seg_unit0, (size_t)(plan->num_segments + 1) * 4,
                              cudaMemcpyHostToDevice, stream));
  if (plan->num_segments > 0)
    TW_CUDA_TRY(cudaMemcpyAsync(d->seg_split0, d->h_seg_split0, (size_t)plan->num_segments * 4,
                                cudaMemcpyHostToDevice, stream));
  TW_CUDA_TRY(cudaMemcpyAsync(d->recv_units, d->h_recv_units, (size_t)ctx->world * 4,
                              cudaMemcpyHostToDevice, stream));
  TW_CUDA_TRY(cudaMemcpyAsync(d->plan_fp, &plan->fingerprint, sizeof(uint64_t),
                              cudaMemcpyHostToDevice, stream));
  if (g1 > 0)
    TW_CUDA_TRY(cudaMemcpyAsync(d->gemm1_tiles, d->h_gemm1_tiles, (size_t)g1 * sizeof(tw_tile),
                                cudaMemcpyHostToDevice, stream));
  d->num_gemm1_tiles = g1;
  d->rows = plan->rows;
  d->recv_rows = plan->recv_rows;
  d->num_tiles = plan->num_tiles;
  d->num_bands = plan->num_bands;
  d->total_units = (int32_t)units;
  d->tokens = tokens;
  d->comm_ctas = plan->comm_ctas;
  for (int s = 0; s < ctx->world; s++) d->recv_bands[s] = s == ctx->rank ? 0 : plan->recv_bands[s];
  TW_TRY(tw_plan_summary_get((tw_plan_t)plan, &d->summary));
  const int32_t E = ctx->local_experts;
  memcpy(d->h_expert_rows, plan->expert_row0, (size_t)E * 4);
  memcpy(d->h_expert_rows + E, plan->expert_rows, (size_t)E * 4);
  memcpy(d->h_expert_rows + 2 * E, plan->expert_real_rows, (size_t)E * 4);
  return TW_SUCCESS;
}

extern "C" tw_status tw_device_plan_upload(tw_device_plan_t d, tw_plan_t plan, tw_routing_t routing,
                                           cudaStream_t stream) {
  tw__clear_error();
  TW_CHECK_NULL(d);
  TW_CHECK_NULL(plan);
  TW_CHECK_NULL(routing);
  tw_context_t ctx = d->ctx;
  const tw_problem* p = &ctx->problem;
  if (d->is_static && d->captured)
    return tw__fail(TW_ERR_STATE,
                    "tw_device_plan_upload: a captured capturable dispatch uses this device "
                    "plan's static plan; upload into another device plan");
  if (plan->slot_row == NULL)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_device_plan_upload: the plan has no slot_row (a plan from counts); "
                    "tw_moe_dispatch uploads those itself");
  int32_t tokens = 0;
  const int32_t* ids = NULL;
  const float* weights = NULL;
  if (plan->rank == ctx->rank) TW_TRY(tw_routing_rank(routing, ctx->rank, &tokens, &ids, &weights));
  /* Every owner's tokens must fit too, not only this rank's: under the add dataflow this rank's
   * consumer adds rows into out[token] of the owners' windows, whose output buffers hold
   * max_tokens rows (the same on every rank, compared at creation), and a plan made for a larger
   * problem would run past them. Every rank refuses such a routing alike, so none calls alone. */
  for (int32_t r = 0; r < ctx->world; r++) {
    int32_t n = 0;
    const int32_t* ids_r = NULL;
    const float* w_r = NULL;
    TW_TRY(tw_routing_rank(routing, r, &n, &ids_r, &w_r));
    if (n > p->max_tokens)
      return tw__fail(TW_ERR_CAPACITY,
                      "tw_device_plan_upload: the routing gives rank %d %d tokens, but every "
                      "context holds at most %d (problem max_tokens); route at most max_tokens "
                      "tokens per rank, or create the contexts with a larger max_tokens",
                      r, n, p->max_tokens);
  }
  int64_t units = 0;
  TW_TRY(tw__device_plan_check(d, plan, tokens, &units, "tw_device_plan_upload"));
  const int64_t nslots = (int64_t)tokens * p->top_k;
  for (int64_t i = 0; i < nslots; i++) {
    if (plan->slot_row[i] < 0 || plan->slot_row[i] >= plan->recv_rows + plan->rows)
      return tw__fail(TW_ERR_INVALID_ARGUMENT,
                      "tw_device_plan_upload: slot %lld points at row %d outside %d receive + %d "
                      "local rows; the plan and the routing do not belong together",
                      (long long)i, plan->slot_row[i], plan->recv_rows, plan->rows);
  }
  /* The add dataflow: each row's token at its owner and its gate weight (rows of padding: -1
   * and 0); a remote band's valid rows must all belong to its destination. */
  if (ctx->dataflow == TW_DATAFLOW_ADD) {
    int32_t owner_tokens[TW_MAX_RANKS];
    const float* owner_w[TW_MAX_RANKS];
    for (int r = 0; r < ctx->world; r++) {
      const int32_t* ids_r = NULL;
      TW_TRY(tw_routing_rank(routing, r, &owner_tokens[r], &ids_r, &owner_w[r]));
    }
    for (int32_t i = 0; i < plan->rows; i++) {
      const tw_row_src src = plan->row_src[i];
      d->h_row_token[i] = -1;
      d->h_row_weight[i] = 0.f;
      if (src.owner < 0) continue;
      if (src.owner >= ctx->world || src.token < 0 || src.token >= owner_tokens[src.owner] ||
          src.slot < 0 || src.slot >= p->top_k)
        return tw__fail(TW_ERR_INVALID_ARGUMENT,
                        "tw_device_plan_upload: row %d names token %d slot %d of rank %d, which "
                        "the routing does not hold; the plan and the routing do not belong "
                        "together",
                        i, src.token, src.slot, src.owner);
      d->h_row_token[i] = src.token;
      d->h_row_weight[i] = owner_w[src.owner][(int64_t)src.token * p->top_k + src.slot];
    }
    for (int32_t i = 0; i < plan->num_bands; i++) {
      const tw_band* b = &plan->bands[i];
      for (int32_t r = b->row0; r < b->row0 + b->valid_rows; r++)
        if (plan->row_src[r].owner != b->dest)
          return tw__fail(TW_ERR_INTERNAL,
                          "tw_device_plan_upload: band %d sends row %d to rank %d, whose token it "
                          "is not (owner %d)",
                          i, r, b->dest, plan->row_src[r].owner);
    }
  }

  TW_DEVICE_SCOPE(ctx);
  d->uploaded = 0;
  d->is_static = 0; /* a capturable dispatch into dplan now refuses (it needs the static plan) */
  TW_TRY(tw__device_plan_copy(d, plan, tokens, units, stream));
  if (nslots > 0) {
    TW_CUDA_TRY(cudaMemcpyAsync(d->slot_row, plan->slot_row, (size_t)nslots * 4,
                                cudaMemcpyHostToDevice, stream));
    TW_CUDA_TRY(
        cudaMemcpyAsync(d->weights, weights, (size_t)nslots * 4, cudaMemcpyHostToDevice, stream));
  }
  if (ctx->dataflow == TW_DATAFLOW_ADD && plan->rows > 0) {
    TW_CUDA_TRY(cudaMemcpyAsync(d->row_token, d->h_row_token, (size_t)plan->rows * 4,
                                cudaMemcpyHostToDevice, stream));
    TW_CUDA_TRY(cudaMemcpyAsync(d->row_weight, d->h_row_weight, (size_t)plan->rows * 4,
                                cudaMemcpyHostToDevice, stream));
  }
  d->uploaded = 1;
  return TW_SUCCESS;
}

extern "C" tw_status tw_device_plan_summary_get(tw_device_plan_t d, tw_plan_summary* summary) {
  tw__clear_error();
  TW_CHECK_NULL(d);
  TW_CHECK_NULL(summary);
  if (!d->uploaded)
    return tw__fail(TW_ERR_STATE,
                    "tw_device_plan_summary_get: nothing uploaded yet (tw_device_plan_upload or "
                    "tw_moe_dispatch)");
  *summary = d->summary;
  return TW_SUCCESS;
}

extern "C" tw_status tw__device_plan_work(tw_device_plan_t d, int32_t* tiles, int32_t* units) {
  TW_CHECK_NULL(d);
  TW_CHECK_NULL(tiles);
  TW_CHECK_NULL(units);
  if (!d->uploaded) return tw__fail(TW_ERR_STATE, "tw__device_plan_work: upload a plan first");
  *tiles = d->num_tiles;
  *units = d->total_units;
  return TW_SUCCESS;
}

extern "C" tw_status tw__device_plan_gemm1_tiles(tw_device_plan_t d, const tw_tile** tiles,
                                                 int32_t* num_tiles) {
  TW_CHECK_NULL(d);
  TW_CHECK_NULL(tiles);
  TW_CHECK_NULL(num_tiles);
  if (!d->uploaded)
    return tw__fail(TW_ERR_STATE, "tw__device_plan_gemm1_tiles: upload a plan first");
  *tiles = d->h_gemm1_tiles;
  *num_tiles = d->h_gemm1_tiles != NULL ? d->num_gemm1_tiles : 0;
  return TW_SUCCESS;
}

extern "C" tw_status tw_device_plan_expert_rows(tw_device_plan_t d, int32_t* row0, int32_t* rows,
                                                int32_t* real_rows) {
  tw__clear_error();
  TW_CHECK_NULL(d);
  if (!d->uploaded)
    return tw__fail(TW_ERR_STATE,
                    "tw_device_plan_expert_rows: nothing uploaded yet (tw_device_plan_upload or "
                    "tw_moe_dispatch)");
  const size_t E = (size_t)d->ctx->local_experts;
  if (row0 != NULL) memcpy(row0, d->h_expert_rows, E * 4);
  if (rows != NULL) memcpy(rows, d->h_expert_rows + E, E * 4);
  if (real_rows != NULL) memcpy(real_rows, d->h_expert_rows + 2 * E, E * 4);
  return TW_SUCCESS;
}
