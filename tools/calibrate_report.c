/*
 * calibrate_report.c: what `tilewave calibrate` prints and writes besides the calibration file's
 * keys: the tables of every measurement, the parameter table, the JSON record (--json-file) and
 * the provenance comments.
 */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime.h>
#include <math.h>
#include <nccl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "baseline.h"
#include "bench_common.h"
#include "calibrate.h"
#include "calibrate_fit.h"
#include "checks.h"
#include "cli.h"
#include "cli_args.h"
#include "core.h"
#include "kernels.h"
#include "oracle.h"
#include "plan.h"
#include "spawn.h"
#include "tilewave.h"
/* The producer's points, its fit, the floor and the 64-row tiles. */
static void twc_print_producer(const twc_state* s) {
  const tw_hardware* h = &s->hw;
  if (s->prod_ok) {
    printf("producer GEMM alone: N %d, %d experts, top-2, balanced, tile %dx%d, P = %d CTAs\n",
           TWC_PRODUCER_N, TWC_PRODUCER_EXPERTS, s->tm, s->tn, s->grid);
    printf("| K | tiles | waves | us | tiles | waves | us | us/wave | fit | residual |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < TWC_NK; i++) {
      const twc_prod_point* p = &s->prod[i];
      printf("| %d | %lld | %lld | %.1f | %lld | %lld | %.1f | %.3f | %.3f | %+.3f |\n", p->k,
             (long long)p->tiles[0], (long long)p->waves[0], p->us[0], (long long)p->tiles[1],
             (long long)p->waves[1], p->us[1], p->us_per_wave, p->us_per_wave - p->resid_us,
             p->resid_us);
    }
    printf(
        "fit: us/wave = 2 TM TN K / (%.3f TFLOP/s x 1e6) + %.3f us  (%.0f TFLOP/s over %d SMs; "
        "K >= %d)\n",
        h->tile_tflops, h->tile_overhead_us, h->tile_tflops * h->sm_count, h->sm_count, twc_ks[1]);
    printf(
        "floor: K %d's wave = (c^4 + f^4)^(1/4) + %.3f us, c = its compute at that rate, f = "
        "%.3f us x TN / 128\n",
        twc_ks[0], h->tile_overhead_us, h->tile_floor_us);
    const twc_prod_point* p64 = &s->m64;
    printf(
        "64-row tiles (64x%d), K %d: %lld tiles, %lld waves, %.1f us; %lld tiles, %lld waves, "
        "%.1f us; %.3f us/wave",
        s->tn64, p64->k, (long long)p64->tiles[0], (long long)p64->waves[0], p64->us[0],
        (long long)p64->tiles[1], (long long)p64->waves[1], p64->us[1], p64->us_per_wave);
    if (s->m64_ok)
      printf(" = the model's tile at %.3f of the 128-row rate (tile_m64_share)\n",
             s->hw.tile_m64_share);
    else
      printf("\n");
    if (s->prod_note[0]) printf("note: %s\n", s->prod_note);
    if (s->m64_note[0]) printf("note: %s\n", s->m64_note);
    printf("\n");
  }
}

/* The producer under both schedules and the exposure it gives. */
static void twc_print_refetch(const twc_state* s) {
  const tw_hardware* h = &s->hw;
  if (s->ref_ok) {
    printf(
        "producer alone under both schedules: 2 ranks' layout planned for rank 0, %d tokens/rank, "
        "K %d, N %d, %d of %d experts local, top-2, balanced, %d rows, %lld tiles, P = %d CTAs; "
        "medians, interleaved\n",
        TWC_REFETCH_TOKENS, TWC_REFETCH_K, TWC_REFETCH_N, s->ref_experts, TWC_REFETCH_EXPERTS,
        s->ref_rows, (long long)s->ref_tiles, s->grid);
    printf("| schedule | us | model's memory traffic MiB | traffic / mem_gbps us |\n");
    printf("|---|---|---|---|\n");
    for (int i = 0; i < 2; i++)
      printf("| %s | %.1f | %.0f | %.1f |\n", i == 0 ? "remote-first" : "expert-major",
             s->ref_us[i], s->ref_traffic[i] / 1048576.0, s->ref_traffic[i] / (h->mem_gbps * 1e3));
    printf(
        "exposure = (%.1f - %.1f us - the model's own difference %.1f us) / (second reads %.0f MiB "
        "/ %.0f GB/s = %.1f us) = %.3f\n",
        s->ref_us[0], s->ref_us[1], s->ref_roof_us, s->ref_bytes / 1048576.0, h->mem_gbps,
        s->ref_bytes / (h->mem_gbps * 1e3), s->ref_raw);
  }
  if (s->ref_note[0]) printf("note (refetch_exposure): %s\n", s->ref_note);
  if (s->ref_ok || s->ref_note[0]) printf("\n");
}

/* The link points of every rank, the pool fits and the aggregate rate. */
static void twc_print_link(const twc_state* s) {
  if (s->link_ok) {
    const twc_pool_fit* f = &s->cfit[s->fit_ci];
    printf(
        "consumer alone (COMM_ONLY) and beside the producer (OVERLAP): %d tokens/rank, K %d, %d "
        "experts, top-2, balanced, mgb %d, remote-first, consumer unit %d and %d column tile(s) "
        "(hidden %d and %d); median us per rank; ready = the producer's time to the first "
        "segment\n",
        s->link_tokens, TWC_LINK_FFN, s->link_experts, TWC_LINK_MGB, s->unit_tiles[0],
        s->unit_tiles[1], twc_link_hidden[0], twc_link_hidden[1]);
    printf(
        "| hidden | C | rank | bands | MiB sent | alone us | GB/s alone | beside us | producer us "
        "| "
        "ready us | C x (beside - ready) | fit | in fit |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int pi = 0; pi < TWC_NPROB; pi++)
      for (int ci = 0; ci < s->nlink_c; ci++)
        for (int r = 0; r < s->world; r++) {
          const twc_link_point* q = twc_point(s, r, pi, ci);
          char fit[32] = "-";
          if (f->ok)
            snprintf(fit, sizeof fit, "%.1f",
                     q->total_bytes / (f->gbps * 1e3) + q->bands * f->latency_us);
          printf(
              "| %.0f | %.0f | %d | %.0f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %s | "
              "%s |\n",
              q->hidden, q->c, r, q->bands, q->total_bytes / 1048576.0, q->us,
              q->us > 0 ? q->total_bytes / q->us * 1e-3 : 0.0, q->beside_us, q->gemm_us,
              q->ready_us, q->c * (q->beside_us - q->ready_us), fit,
              ci == s->fit_ci ? "yes" : "no");
        }
    if (f->ok && s->bound)
      printf(
          "pool fit beside the producer at C = %d (%d points; the largest C at which the consumer "
          "runs >= 1.25x as long as the producer at every point): C x (us - ready) = bytes / "
          "(%.2f GB/s x 1e3) + bands x %.3f us\n",
          s->fit_c, f->n, f->gbps, f->latency_us);
    else if (f->ok)
      printf(
          "pool fit at C = %d, not written (the consumer does not bound every call): C x (us - "
          "ready) = bytes / (%.2f GB/s x 1e3) + bands x %.3f us\n",
          s->fit_c, f->gbps, f->latency_us);
    if (s->fit_ci > 0) {
      printf("pool fit at each C up to it (information):");
      for (int ci = 0; ci <= s->fit_ci; ci++) {
        if (s->cfit[ci].ok)
          printf(" C=%d %.2f GB/s %.3f us;", twc_cs[ci], s->cfit[ci].gbps, s->cfit[ci].latency_us);
        else
          printf(" C=%d failed;", twc_cs[ci]);
      }
      printf("\n");
    }
    printf("aggregate rate alone (bytes / time), hidden %d, mean over ranks:", twc_link_hidden[0]);
    for (int ci = 0; ci < s->nlink_c; ci++) printf(" C=%d %.0f", twc_cs[ci], s->agg_gbps[ci]);
    printf(" GB/s\n");
    if (s->link_note[0]) printf("note: %s\n", s->link_note);
    if (s->reduce_us > 0)
      printf(
          "owner's reduction (rank 0, hidden %d, largest C): %.1f us for %.1f MiB, %.0f GB/s "
          "effective (includes waiting for the peers' last arrivals)\n",
          twc_link_hidden[0], s->reduce_us, s->reduce_bytes / 1048576.0,
          s->reduce_bytes / s->reduce_us * 1e-3);
    printf("\n");
  }
}

/* Every parameter: default, measured, how. */
static void twc_print_params(const twc_state* s) {
  const tw_hardware *d = &s->def, *h = &s->hw;
  printf("| parameter | default | measured | how |\n|---|---|---|---|\n");
  printf("| sm_count | %d | %d | cudaDevAttrMultiProcessorCount |\n", d->sm_count, h->sm_count);
  printf("| l2_mib | %.1f | %.1f | cudaDevAttrL2CacheSize |\n", d->l2_mib, h->l2_mib);
  printf(
      "| occ_comp | %d | %d | resident CTAs per SM of the default producers (128 x 128, 128 x 256; "
      "the smaller), cudaOccupancyMaxActiveBlocksPerMultiprocessor |\n",
      d->occ_comp, h->occ_comp);
  printf("| occ_comm | %d | %d | the same for the bulk consumer |\n", d->occ_comm, h->occ_comm);
  printf("| c_max | %d | %d | default, capped at (sm_count - 1) x occ_comm |\n", d->c_max,
         h->c_max);
  if (s->prod_ok) {
    printf("| tile_tflops | %.3f | %.3f | producer alone, slope of us/wave vs 2 TM TN K |\n",
           d->tile_tflops, h->tile_tflops);
    printf("| tile_overhead_us | %.3f | %.3f | producer alone, intercept of the same fit |\n",
           d->tile_overhead_us, h->tile_overhead_us);
    printf(
        "| tile_floor_us | %.3f | %.3f | producer alone, K %d's wave beyond its compute, per 128 "
        "columns |\n",
        d->tile_floor_us, h->tile_floor_us, twc_ks[0]);
    if (s->m64_ok)
      printf(
          "| tile_m64_share | %.3f | %.3f | producer alone, 64 x %d tiles at K %d: the share of "
          "tile_tflops that prices their wave |\n",
          d->tile_m64_share, h->tile_m64_share, s->tn64, s->m64.k);
    printf("| mem_gbps | %.0f | %.0f | device-to-device copy of %.0f MiB, read + write |\n",
           d->mem_gbps, h->mem_gbps, s->copy_bytes / 1048576.0);
  }
  if (s->ref_ok)
    printf(
        "| refetch_exposure | %.3f | %.3f | producer alone, %d local experts, (remote-first %.1f - "
        "expert-major %.1f - roofline %.1f us) / (%.0f MiB of second reads / mem_gbps = %.1f "
        "us)%s |\n",
        d->refetch_exposure, h->refetch_exposure, s->ref_experts, s->ref_us[0], s->ref_us[1],
        s->ref_roof_us, s->ref_bytes / 1048576.0, s->ref_bytes / (h->mem_gbps * 1e3),
        h->refetch_exposure != s->ref_raw ? "; clamped to [0, 1] (see note)" : "");
  else
    printf("| refetch_exposure | %.3f | - | default kept: %s |\n", d->refetch_exposure,
           s->ref_note[0] ? "not measured (see note)" : "needs the producer's measurement");
  if (s->link_ok) {
    const twc_pool_fit* f = &s->cfit[s->fit_ci];
    if (s->cta_written)
      printf(
          "| link_cta_gbps | %.2f | %.2f | consumer beside the producer at C = %d, hidden %d and "
          "%d: 1 / slope of C x us vs bytes |\n",
          d->link_cta_gbps, h->link_cta_gbps, s->fit_c, twc_link_hidden[0], twc_link_hidden[1]);
    else if (f->ok && s->bound)
      printf("| link_cta_gbps | %.2f | - | default kept: fitted %.3g GB/s is implausible |\n",
             d->link_cta_gbps, f->gbps);
    else if (f->ok)
      printf("| link_cta_gbps | %.2f | - | default kept: the consumer never bounds the call |\n",
             d->link_cta_gbps);
    else
      printf("| link_cta_gbps | %.2f | - | default kept: the pool fit failed (see note) |\n",
             d->link_cta_gbps);
    if (s->latency_written)
      printf(
          "| link_latency_us | %.3f | %.3f | same fit, coefficient of the bands sent (per band) "
          "|\n",
          d->link_latency_us, h->link_latency_us);
    else if (f->ok && s->bound)
      printf(
          "| link_latency_us | %.3f | - | default kept: fitted %.3g us is outside %.0f..%.0f |\n",
          d->link_latency_us, f->latency_us, TW_CALIB_LATENCY_US_MIN, TW_CALIB_LATENCY_US_MAX);
    else if (f->ok)
      printf("| link_latency_us | %.3f | - | default kept: the consumer never bounds the call |\n",
             d->link_latency_us);
    else
      printf("| link_latency_us | %.3f | - | default kept: the pool fit failed (see note) |\n",
             d->link_latency_us);
    printf("| link_peak_gbps | %.1f | %.1f | consumer alone, largest aggregate rate over C |\n",
           d->link_peak_gbps, h->link_peak_gbps);
  } else {
    printf("| link_cta_gbps | %.2f | - | default kept: needs 2 GPUs |\n", d->link_cta_gbps);
    printf("| link_latency_us | %.3f | - | default kept: needs 2 GPUs |\n", d->link_latency_us);
    printf("| link_peak_gbps | %.1f | - | default kept: needs 2 GPUs |\n", d->link_peak_gbps);
  }
  printf("| rho_ref | %.2f | - | default kept: the first paper's reference (TP model) |\n",
         d->rho_ref);
  if (!s->link_ok)
    printf(
        "\none GPU: the NVLink numbers (link_*) are the built-in H200 defaults; run on 2+ GPUs "
        "to measure them\n");
}

void twc_print(const twc_state* s) {
  printf("# tilewave calibrate: %d x %s, %d SMs\n\n", s->world, s->device_name, s->hw.sm_count);
  twc_print_producer(s);
  twc_print_refetch(s);
  twc_print_link(s);
  twc_print_params(s);
  fflush(stdout);
}

/* The fields this run measured and wrote, in tw_hardware order. */
typedef struct twc_field {
  const char* name;
  int measured;
} twc_field;

static int twc_fields(const twc_state* s, twc_field* f) {
  const twc_field all[] = {
      {"sm_count", 1},
      {"occ_comp", 1},
      {"occ_comm", 1},
      {"c_max", 0},
      {"tile_tflops", s->prod_ok},
      {"tile_overhead_us", s->prod_ok},
      {"link_cta_gbps", s->cta_written},
      {"link_peak_gbps", s->link_ok},
      {"link_latency_us", s->latency_written},
      {"mem_gbps", s->prod_ok},
      {"refetch_exposure", s->ref_ok},
      {"rho_ref", 0},
      {"l2_mib", 1},
      {"tile_floor_us", s->prod_ok},
      {"tile_m64_share", s->m64_ok},
  };
  const int n = (int)(sizeof all / sizeof all[0]);
  for (int i = 0; i < n; i++) f[i] = all[i];
  return n;
}

static void twc_json_hw(FILE* f, const char* name, const tw_hardware* h) {
  fprintf(
      f,
      "  \"%s\": {\"sm_count\": %d, \"occ_comp\": %d, \"occ_comm\": %d, \"c_max\": %d, "
      "\"tile_tflops\": %.6g, \"tile_overhead_us\": %.6g, \"link_cta_gbps\": %.6g, "
      "\"link_peak_gbps\": %.6g, \"link_latency_us\": %.6g, \"mem_gbps\": %.6g, "
      "\"refetch_exposure\": %.6g, \"rho_ref\": %.6g, \"l2_mib\": %.6g, \"tile_floor_us\": %.6g}",
      name, h->sm_count, h->occ_comp, h->occ_comm, h->c_max, h->tile_tflops, h->tile_overhead_us,
      h->link_cta_gbps, h->link_peak_gbps, h->link_latency_us, h->mem_gbps, h->refetch_exposure,
      h->rho_ref, h->l2_mib, h->tile_floor_us);
}

tw_status twc_write_json(const twc_state* s, const char* path) {
  FILE* f = fopen(path, "w");
  if (f == NULL) return tw__fail(TW_ERR_IO, "calibrate: cannot write %s", path);
  fprintf(f, "{\"command\": \"calibrate\", \"device\": ");
  tw__json_str(f, s->device_name);
  fprintf(f, ", \"world_size\": %d, \"quick\": %d,\n", s->world, s->o.quick);
  twc_json_hw(f, "defaults", &s->def);
  fprintf(f, ",\n");
  twc_json_hw(f, "measured", &s->hw);
  twc_field fields[16] = {{NULL, 0}}; /* 15 used; zeroed for the compiler's flow analysis */
  const int nf = twc_fields(s, fields);
  fprintf(f, ",\n  \"measured_fields\": [");
  for (int i = 0, first = 1; i < nf; i++)
    if (fields[i].measured) {
      fprintf(f, "%s\"%s\"", first ? "" : ", ", fields[i].name);
      first = 0;
    }
  fprintf(f, "],\n");
  fprintf(f, "  \"producer\": {\"tm\": %d, \"tn\": %d, \"grid\": %d, \"n\": %d, \"points\": [",
          s->tm, s->tn, s->grid, TWC_PRODUCER_N);
  for (int i = 0; s->prod_ok && i < TWC_NK; i++) {
    const twc_prod_point* p = &s->prod[i];
    fprintf(f,
            "%s\n    {\"k\": %d, \"tiles\": [%lld, %lld], \"waves\": [%lld, %lld], \"us\": [%.3f, "
            "%.3f], \"us_per_wave\": %.4f, \"residual_us\": %.4f}",
            i ? "," : "", p->k, (long long)p->tiles[0], (long long)p->tiles[1],
            (long long)p->waves[0], (long long)p->waves[1], p->us[0], p->us[1], p->us_per_wave,
            p->resid_us);
  }
  const twc_prod_point* p64 = &s->m64;
  fprintf(f,
          "],\n    \"m64\": {\"measured\": %s, \"tm\": 64, \"tn\": %d, \"k\": %d, \"tiles\": "
          "[%lld, %lld], \"waves\": [%lld, %lld], \"us\": [%.3f, %.3f], \"us_per_wave\": %.4f, "
          "\"note\": ",
          s->m64_ok ? "true" : "false", s->tn64, p64->k, (long long)p64->tiles[0],
          (long long)p64->tiles[1], (long long)p64->waves[0], (long long)p64->waves[1], p64->us[0],
          p64->us[1], p64->us_per_wave);
  tw__json_str(f, s->m64_note);
  fprintf(f, "}},\n  \"copy\": {\"bytes\": %.0f, \"us\": %.3f},\n", s->copy_bytes, s->copy_us);
  fprintf(f,
          "  \"refetch\": {\"measured\": %s, \"tokens\": %d, \"experts\": %d, \"local_experts\": "
          "%d, \"k\": %d, \"n\": %d, \"grid\": %d, \"rows\": %d, \"tiles\": %lld, "
          "\"remote_first_us\": %.3f, \"expert_major_us\": %.3f, \"traffic_bytes\": [%.0f, %.0f], "
          "\"refetch_bytes\": %.0f, \"mem_gbps\": %.6g, \"roofline_us\": %.3f, \"raw\": %.6g, "
          "\"exposure\": %.6g, "
          "\"note\": ",
          s->ref_ok ? "true" : "false", TWC_REFETCH_TOKENS, TWC_REFETCH_EXPERTS, s->ref_experts,
          TWC_REFETCH_K, TWC_REFETCH_N, s->grid, s->ref_rows, (long long)s->ref_tiles, s->ref_us[0],
          s->ref_us[1], s->ref_traffic[0], s->ref_traffic[1], s->ref_bytes, s->hw.mem_gbps,
          s->ref_roof_us, s->ref_raw, s->hw.refetch_exposure);
  tw__json_str(f, s->ref_note);
  fprintf(f, "},\n");
  const twc_pool_fit* fit = &s->cfit[s->fit_ci];
  fprintf(f,
          "  \"link\": {\"measured\": %s, \"tokens\": %d, \"experts\": %d, \"ffn\": %d, \"mgb\": "
          "%d, \"schedule\": \"remote-first\", \"hidden\": [%d, %d], \"unit_tiles\": [%d, %d], "
          "\"fit_c\": %d, \"fit_ok\": %s, \"fit_points\": %d, \"fit_link_cta_gbps\": %.6g, "
          "\"fit_link_latency_us\": %.6g, \"link_cta_written\": %s, \"link_latency_written\": %s, "
          "\"note\": ",
          s->link_ok ? "true" : "false", s->link_tokens, s->link_experts, TWC_LINK_FFN,
          TWC_LINK_MGB, twc_link_hidden[0], twc_link_hidden[1], s->unit_tiles[0], s->unit_tiles[1],
          s->fit_c, fit->ok ? "true" : "false", fit->n, fit->gbps, fit->latency_us,
          s->cta_written ? "true" : "false", s->latency_written ? "true" : "false");
  tw__json_str(f, s->link_note);
  fprintf(f, ",\n    \"fits_by_c\": [");
  for (int ci = 0; s->link_ok && ci <= s->fit_ci; ci++)
    fprintf(f,
            "%s{\"c\": %d, \"ok\": %s, \"points\": %d, \"link_cta_gbps\": %.6g, "
            "\"link_latency_us\": %.6g}",
            ci ? ", " : "", twc_cs[ci], s->cfit[ci].ok ? "true" : "false", s->cfit[ci].n,
            s->cfit[ci].gbps, s->cfit[ci].latency_us);
  fprintf(f, "],\n    \"alone_gbps_by_c\": [");
  for (int ci = 0; s->link_ok && ci < s->nlink_c; ci++)
    fprintf(f, "%s{\"c\": %d, \"gbps\": %.6g}", ci ? ", " : "", twc_cs[ci], s->agg_gbps[ci]);
  fprintf(f, "],\n    \"points\": [");
  int first = 1;
  for (int r = 0; s->link_ok && r < s->world; r++)
    for (int pi = 0; pi < TWC_NPROB; pi++)
      for (int ci = 0; ci < s->nlink_c; ci++) {
        const twc_link_point* q = twc_point(s, r, pi, ci);
        fprintf(f,
                "%s\n      {\"rank\": %d, \"hidden\": %.0f, \"c\": %.0f, \"bands\": %.0f, "
                "\"bytes\": %.0f, \"us\": %.3f, \"reduce_us\": %.3f, \"beside_us\": %.3f, "
                "\"producer_us\": %.3f, \"ready_waves\": %.0f, \"waves\": %.0f, \"ready_us\": "
                "%.3f, \"in_fit\": %s}",
                first ? "" : ",", r, q->hidden, q->c, q->bands, q->total_bytes, q->us, q->reduce_us,
                q->beside_us, q->gemm_us, q->ready_waves, q->waves, q->ready_us,
                ci == s->fit_ci ? "true" : "false");
        first = 0;
      }
  fprintf(f, "]}\n}\n");
  const int bad = ferror(f);
  if (fclose(f) != 0 || bad) return tw__fail(TW_ERR_IO, "calibrate: writing %s failed", path);
  return TW_SUCCESS;
}

/* Comments after the keys: what measured the file and which values are defaults. */
tw_status twc_append_provenance(const twc_state* s) {
  FILE* f = fopen(s->o.out, "a");
  if (f == NULL) return tw__fail(TW_ERR_IO, "calibrate: cannot append to %s", s->o.out);
  twc_field fields[16] = {{NULL, 0}}; /* 15 used; zeroed for the compiler's flow analysis */
  const int nf = twc_fields(s, fields);
  fprintf(f, "# measured by `tilewave calibrate%s` on %d x %s\n", s->o.quick ? " --quick" : "",
          s->world, s->device_name);
  for (int m = 1; m >= 0; m--) {
    fprintf(f, "# %s:", m ? "measured" : "built-in defaults");
    for (int i = 0, first = 1; i < nf; i++)
      if (fields[i].measured == m) {
        fprintf(f, "%s %s", first ? "" : ",", fields[i].name);
        first = 0;
      }
    fprintf(f, "\n");
  }
  const int bad = ferror(f);
  if (fclose(f) != 0 || bad) return tw__fail(TW_ERR_IO, "calibrate: writing %s failed", s->o.out);
  return TW_SUCCESS;
}
