/*
 * bench_grid.c: `tilewave bench` at one point: ours, its modes and the baselines timed together,
 * the derived numbers (speedup, efficiency, overlap), the table row and the JSON record.
 */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime.h>
#include <math.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "baseline.h"
#include "bench.h"
#include "bench_common.h"
#include "checks.h"
#include "cli.h"
#include "core.h"
#include "kernels.h"
#include "oracle.h"
#include "plan.h"
#include "runtime.h"
#include "spawn.h"
#include "tilewave.h"

static int twb_policy_index(const twb_bench_result* r, int kind, int chunk) {
  for (int i = 0; i < r->np; i++)
    if (r->pols[i].kind == kind && (kind != TWB_CHUNKED || r->pols[i].chunk == chunk)) return i;
  return -1;
}

static void twb_add(twb_bench_result* r, int kind, int c, int chunk, int out, const char* name) {
  twb_policy* p = &r->pols[r->np++];
  memset(p, 0, sizeof *p);
  p->kind = kind;
  p->c = c;
  p->chunk = chunk;
  p->out = out;
  snprintf(p->name, sizeof p->name, "%s", name);
}

/* --phases for the baselines: the sequential loop and the fastest chunked size (by the timed
 * rounds' medians), o->iters more calls each with the baseline's phase events, as for ours. */
static tw_status twb_time_baseline_phases(twb_rank* s, const twb_opts* o, twb_bench_result* r) {
  int best = -1;
  for (int i = 0; i < r->np; i++)
    if (r->pols[i].kind == TWB_CHUNKED && (best < 0 || r->st[i].median < r->st[best].median))
      best = i;
  const int pol[2] = {twb_policy_index(r, TWB_SEQ, 0), best};
  r->bphase_rows = best >= 0 ? r->pols[best].chunk : 0;
  const int n = o->iters;
  float* v = (float*)calloc(4 * (size_t)n, sizeof(float));
  if (v == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "bench: out of host memory");
  tw_status st = tw__baseline_set_timing(s->baseline, 1);
  for (int b = 0; b < 2 && st == TW_SUCCESS; b++) {
    if (pol[b] < 0) continue;
    for (int i = 0; i < n && st == TW_SUCCESS; i++) {
      tw__bl_timeline t;
      if ((st = twb_barrier(s)) != TW_SUCCESS) break;
      if ((st = tw__bench_delay(s->stream, o->delay_us)) != TW_SUCCESS) break;
      if ((st = twb_run(s, &r->pols[pol[b]], i % s->nsets, s->stream)) != TW_SUCCESS) break;
      if ((st = tw__baseline_timeline(s->baseline, &t)) != TW_SUCCESS) break;
      v[i] = 1e3f * t.gemm_end_ms;
      v[n + i] = 1e3f * t.comm_end_ms;
      v[2 * n + i] = 1e3f * t.reduce_start_ms;
      v[3 * n + i] = 1e3f * t.total_ms;
    }
    if (st == TW_SUCCESS) st = twb_max_over_ranks(s, v, 4 * (size_t)n);
    for (int k = 0; k < 4 && st == TW_SUCCESS; k++) {
      tw__bench_stats q;
      tw__bench_stats_of(v + (size_t)k * n, n, &q);
      r->bphase[b][k] = q.median;
    }
  }
  const tw_status off = tw__baseline_set_timing(s->baseline, 0);
  free(v);
  return st != TW_SUCCESS ? st : off;
}

/* --phases: runs ours o->iters more times with the context's phase events (tw__context_timeline;
 * each call waited for), after the same device delay as the timed rounds so
 * that the start event does not count host launch time. Per call and rank: when the producer
 * and the consumer end, the reduction's kernel time, and the gap between the later of the two
 * ends and the reduction's start (the cross-stream join and the launch); each the max over ranks
 * per call, then the median over calls. */
static tw_status twb_time_phases(twb_rank* s, const twb_opts* o, twb_bench_result* r) {
  const int n = o->iters;
  float* v = (float*)calloc(6 * (size_t)n, sizeof(float));
  if (v == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "bench: out of host memory");
  const twb_policy* ours = &r->pols[twb_policy_index(r, TWB_OURS, 0)];
  tw_status st = TW_SUCCESS;
  for (int i = 0; i < n && st == TW_SUCCESS; i++) {
    tw_combine_timings t;
    if ((st = twb_barrier(s)) != TW_SUCCESS) break;
    if ((st = tw__bench_delay(s->stream, o->delay_us)) != TW_SUCCESS) break;
    if ((st = twb_run(s, ours, i % s->nsets, s->stream)) != TW_SUCCESS) break;
    float comm_end = 0, red_start = 0, zero_end = 0;
    if ((st = tw__context_timeline(s->ctx, &t, &comm_end, &red_start, &zero_end)) != TW_SUCCESS)
      break;
    v[i] = 1e3f * t.total_ms;
    v[n + i] = 1e3f * t.gemm_ms;
    v[2 * n + i] = 1e3f * comm_end;
    v[3 * n + i] = 1e3f * t.reduce_ms;
    v[4 * n + i] = 1e3f * (red_start - (t.gemm_ms > comm_end ? t.gemm_ms : comm_end));
    v[5 * n + i] = 1e3f * zero_end;
  }
  if (st == TW_SUCCESS) st = twb_max_over_ranks(s, v, 6 * (size_t)n);
  if (st == TW_SUCCESS) {
    tw__bench_stats q[6];
    for (int k = 0; k < 6; k++) tw__bench_stats_of(v + (size_t)k * n, n, &q[k]);
    r->phase_zero = q[5].median;
    r->phase_total = q[0].median, r->phase_gemm = q[1].median;
    r->phase_comm = q[2].median, r->phase_reduce = q[3].median;
    r->phase_join = q[4].median;
    r->phase_n = n;
  }
  free(v);
  if (st == TW_SUCCESS) st = twb_time_baseline_phases(s, o, r);
  return st;
}

tw_status twb_bench_point(twb_rank* s, const twb_opts* o, const twb_point* pt,
                          twb_bench_result* r) {
  memset(r, 0, sizeof *r);
  r->pt = *pt;
  TW_TRY(twb_setup(s, o, pt, NULL, 0));
  r->pt.tokens = s->problem.max_tokens; /* a replayed routing's busiest rank */
  tw_plan_summary sum;
  TW_TRY(tw_plan_summary_get(s->plans[s->rank], &sum));
  r->c = sum.comm_ctas;
  r->mgb = sum.coalesce;
  r->predicted_us = sum.predicted_us;
  r->model_seq_us = sum.sequential_us;

  twb_add(r, TWB_OURS, 0, 0, TWB_OUT_OURS, "ours");
  twb_add(r, TWB_SEQ, 0, 0, TWB_OUT_SEQ, "seq");
  {
    /* The grouped form needs a cuBLAS that supports it for bf16: probe once, agree on all ranks,
     * and leave the policy out (the loop form remains) where any rank cannot run it. */
    float unsupported = 0.f;
    if (tw__baseline_gemm_grouped(s->baseline, s->a[0], s->w[0], s->stream) != TW_SUCCESS ||
        cudaStreamSynchronize(s->stream) != cudaSuccess) {
      fprintf(stderr, "tilewave: rank %d: grouped cuBLAS GEMM unavailable (%s); left out\n",
              s->rank, tw_last_error());
      unsupported = 1.f;
    }
    TW_TRY(twb_max_over_ranks(s, &unsupported, 1));
    if (unsupported == 0.f) twb_add(r, TWB_SEQ_GROUPED, 0, 0, TWB_OUT_SEQ_GROUPED, "seq_grouped");
  }
  twb_add(r, TWB_SEQ_PACKED, 0, 0, TWB_OUT_SEQ_PACKED, "seq_packed");
  twb_add(r, TWB_UNFUSED, 0, 0, TWB_OUT_UNFUSED, "unfused");
  for (int i = 0; i < o->nchunks; i++) {
    char name[24];
    snprintf(name, sizeof name, "chunk%d", o->chunks[i]);
    twb_add(r, TWB_CHUNKED, 0, o->chunks[i], TWB_OUT_CHUNKED, name);
  }
  twb_add(r, TWB_GEMM_ONLY, 0, 0, -1, "gemm");
  twb_add(r, TWB_COMM_ONLY, 0, 0, -1, "comm");
  twb_add(r, TWB_CUBLAS, 0, 0, -1, "cublas");
  twb_add(r, TWB_NCCL, 0, 0, -1, "nccl");
  twb_add(r, TWB_NCCL_PACKED, 0, 0, -1, "nccl_packed");

  /* Correctness before timing: every policy on set 0 against ours; the chunked policies share an
   * output buffer, so check each on its own. */
  float err[24], err2[24];
  for (int i = 0; i < r->np; i++) r->err[i] = -1.f;
  twb_policy one[2];
  one[0] = r->pols[0];
  for (int i = 1; i < r->np; i++) {
    if (r->pols[i].out < 0) continue;
    one[1] = r->pols[i];
    TW_TRY(twb_check(s, one, 2, 0, 1, err));
    r->err[i] = err[1];
  }
  r->err[0] = 0.f;

  float* samples = (float*)calloc((size_t)r->np * (size_t)o->iters, sizeof(float));
  if (samples == NULL) return tw__fail(TW_ERR_OUT_OF_MEMORY, "bench: out of host memory");
  int last_set = 0;
  tw_status st = twb_time(s, o, r->pols, r->np, samples, &last_set);
  /* Correctness after timing: the last round ran every policy on one input set. */
  if (st == TW_SUCCESS) st = twb_check(s, r->pols, r->np, last_set, 0, err2);
  if (st == TW_SUCCESS) {
    for (int i = 0; i < r->np; i++) {
      if (err2[i] > r->err[i] && r->pols[i].kind != TWB_CHUNKED) r->err[i] = err2[i];
      tw__bench_stats_of(samples + (size_t)i * o->iters, o->iters, &r->st[i]);
    }
    /* The last chunked policy of the last round wrote the shared buffer; fold its check in. */
    const int lastc = (o->warmup + o->iters - 1) % 2 == 0
                          ? twb_policy_index(r, TWB_CHUNKED, o->chunks[o->nchunks - 1])
                          : twb_policy_index(r, TWB_CHUNKED, o->chunks[0]);
    if (lastc >= 0 && err2[lastc] > r->err[lastc]) r->err[lastc] = err2[lastc];
  }
  free(samples);
  if (st == TW_SUCCESS && o->phases) st = twb_time_phases(s, o, r);
  return st;
}

/* The add dataflow's zeroing in the phases line (its copies run beside the call). */
static const char* twb_zero_note(const twb_bench_result* r) {
  static char note[96];
  note[0] = '\0';
  if (r->phase_zero > 0)
    snprintf(note, sizeof note, "; the next buffer's zeroing (copy engine) ends at %.1f us",
             r->phase_zero);
  return note;
}

void twb_print_header(const twb_opts* o) {
  printf("Combine dataflow: %s.\n\n",
         tw__dataflow_name(o->add ? TW_DATAFLOW_ADD : TW_DATAFLOW_REDUCE));
  printf(
      "| tokens/rank | K | N | E | router | seq us (form) | ours us (p10-p90) | speedup | gemm us "
      "| comm us | ideal us | eff | overlap | C | mgb | unfused us | chunked us (rows) | max rel "
      "err | check |\n");
  printf(
      "| ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
      "---: | ---: | ---: | ---: | ---: | --- |\n");
}

void twb_derive(const twb_opts* o, const twb_bench_result* r, twb_derived* d) {
  memset(d, 0, sizeof *d);
  d->ours = r->st[twb_policy_index(r, TWB_OURS, 0)].median;
  /* The sequential baseline is the fastest of its forms at this point. */
  static const struct {
    int kind;
    const char* name;
  } forms[] = {{TWB_SEQ, "loop"}, {TWB_SEQ_GROUPED, "grouped"}, {TWB_SEQ_PACKED, "packed"}};
  d->seq = INFINITY;
  d->seq_variant = "none";
  for (int i = 0; i < 3; i++) {
    const int k = twb_policy_index(r, forms[i].kind, 0);
    if (k >= 0 && r->st[k].median < d->seq) {
      d->seq = r->st[k].median;
      d->seq_variant = forms[i].name;
    }
  }
  d->gemm = r->st[twb_policy_index(r, TWB_GEMM_ONLY, 0)].median;
  d->comm = r->st[twb_policy_index(r, TWB_COMM_ONLY, 0)].median;
  d->unfused = r->st[twb_policy_index(r, TWB_UNFUSED, 0)].median;
  d->ideal = d->gemm > d->comm ? d->gemm : d->comm;
  d->eff = d->ours > 0 ? d->ideal / d->ours : 0;
  d->speedup = d->ours > 0 ? d->seq / d->ours : 0;
  const double shorter = d->gemm < d->comm ? d->gemm : d->comm;
  d->overlap = shorter > 0 ? (d->gemm + d->comm - d->ours) / shorter : 0;
  d->chunk = INFINITY;
  for (int i = 0; i < o->nchunks; i++) {
    const int k = twb_policy_index(r, TWB_CHUNKED, o->chunks[i]);
    if (r->st[k].median < d->chunk) {
      d->chunk = r->st[k].median;
      d->chunk_rows = o->chunks[i];
    }
  }
  d->max_err = 0;
  for (int i = 0; i < r->np; i++)
    if (r->err[i] > d->max_err) d->max_err = r->err[i];
  d->pass = d->max_err <= o->tol;
}

void twb_print_row(const twb_opts* o, const twb_bench_result* r) {
  twb_derived d;
  twb_derive(o, r, &d);
  const tw__bench_stats* so = &r->st[twb_policy_index(r, TWB_OURS, 0)];
  printf(
      "| %d | %d | %d | %d | %s | %.1f (%s) | %.1f (%.1f-%.1f) | %.2fx | %.1f | %.1f | %.1f | %.2f "
      "| %.2f | %d | %d | %.1f | %.1f (%d) | %.2e | %s |\n",
      r->pt.tokens, r->pt.ffn, r->pt.hidden, r->pt.experts, tw__cli_router_name(r->pt.router),
      d.seq, d.seq_variant, d.ours, so->p10, so->p90, d.speedup, d.gemm, d.comm, d.ideal, d.eff,
      d.overlap, r->c, r->mgb, d.unfused, d.chunk, d.chunk_rows, d.max_err,
      d.pass ? "pass" : "FAIL");
  if (r->phase_n > 0 && o->add) /* no reduction: the consumer waited for the peers' adds */
    printf(
        "|  | phases of ours (median of %d, max over ranks): producer ends at %.1f us, "
        "consumer at %.1f us (incl. waiting for the peers' adds); the call ends %.1f us after "
        "both (the join and the timing events); total %.1f us%s |\n",
        r->phase_n, r->phase_gemm, r->phase_comm, r->phase_join + r->phase_reduce, r->phase_total,
        twb_zero_note(r));
  else if (r->phase_n > 0)
    printf(
        "|  | phases of ours (median of %d, max over ranks): producer ends at %.1f us, "
        "consumer at %.1f us; the reduction starts %.1f us after both and takes %.1f us "
        "(incl. waiting for the peers); total %.1f us%s |\n",
        r->phase_n, r->phase_gemm, r->phase_comm, r->phase_join, r->phase_reduce, r->phase_total,
        twb_zero_note(r));
  if (r->phase_n > 0)
    printf(
        "|  | phases of the baselines (from each call's start): sequential GEMMs end at %.1f us, "
        "its exchange at %.1f, its reduction runs %.1f-%.1f us; chunked (%d rows) GEMMs end at "
        "%.1f us, copies at %.1f, reduction %.1f-%.1f us |\n",
        r->bphase[0][0], r->bphase[0][1], r->bphase[0][2], r->bphase[0][3], r->bphase_rows,
        r->bphase[1][0], r->bphase[1][1], r->bphase[1][2], r->bphase[1][3]);
  fflush(stdout);
}

void twb_print_json_point(FILE* f, const twb_opts* o, const twb_bench_result* r, int first) {
  twb_derived d;
  twb_derive(o, r, &d);
  fprintf(f,
          "%s  {\"dataflow\": \"%s\", \"tokens_per_rank\": %d, \"ffn\": %d, \"hidden\": %d, "
          "\"experts\": %d, \"top_k\": "
          "%d, \"router\": \"%s\", \"comm_ctas\": %d, \"coalesce\": %d, \"model_predicted_us\": "
          "%.2f, \"model_sequential_us\": %.2f,\n",
          first ? "" : ",\n", tw__dataflow_name(o->add ? TW_DATAFLOW_ADD : TW_DATAFLOW_REDUCE),
          r->pt.tokens, r->pt.ffn, r->pt.hidden, r->pt.experts, r->pt.topk,
          tw__cli_router_name(r->pt.router), r->c, r->mgb, r->predicted_us, r->model_seq_us);
  fprintf(f,
          "   \"seq_us\": %.2f, \"seq_variant\": \"%s\", \"ours_us\": %.2f, \"speedup\": %.4f, "
          "\"gemm_us\": %.2f, \"comm_us\": %.2f, \"ideal_us\": %.2f, \"efficiency\": %.4f, "
          "\"overlap_ratio\": %.4f, \"unfused_us\": %.2f, \"chunked_us\": %.2f, \"chunked_rows\": "
          "%d, \"max_rel_err\": %.3e, \"pass\": %s,\n   \"policies\": [",
          d.seq, d.seq_variant, d.ours, d.speedup, d.gemm, d.comm, d.ideal, d.eff, d.overlap,
          d.unfused, d.chunk, d.chunk_rows, d.max_err < 1e30 ? d.max_err : 1e30,
          d.pass ? "true" : "false");
  for (int i = 0; i < r->np; i++)
    fprintf(f,
            "%s{\"name\": \"%s\", \"median_us\": %.2f, \"p10_us\": %.2f, \"p90_us\": %.2f, "
            "\"min_us\": %.2f, \"samples\": %d, \"rel_err\": %.3e}",
            i ? ",\n     " : "", r->pols[i].name, r->st[i].median, r->st[i].p10, r->st[i].p90,
            r->st[i].min, r->st[i].n, r->err[i] < 1e30f ? (double)r->err[i] : 1e30);
  fprintf(f, "]");
  if (r->phase_n > 0)
    fprintf(
        f,
        ",\n   \"phases_us\": {\"samples\": %d, \"producer_end\": %.2f, \"consumer_end\": %.2f, "
        "\"join\": %.2f, \"reduce\": %.2f, \"total\": %.2f, \"zeroing_end\": %.2f}",
        r->phase_n, r->phase_gemm, r->phase_comm, r->phase_join, r->phase_reduce, r->phase_total,
        r->phase_zero);
  if (r->phase_n > 0)
    for (int b = 0; b < 2; b++)
      fprintf(f,
              ",\n   \"%s_phases_us\": {\"rows\": %d, \"gemm_end\": %.2f, \"comm_end\": %.2f, "
              "\"reduce_start\": %.2f, \"total\": %.2f}",
              b == 0 ? "seq" : "chunked", b == 0 ? 0 : r->bphase_rows, r->bphase[b][0],
              r->bphase[b][1], r->bphase[b][2], r->bphase[b][3]);
  fprintf(f, "}");
}
