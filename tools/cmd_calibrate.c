/*
 * cmd_calibrate.c: `tilewave calibrate`, which measures the numbers of the resource model's
 * machine description (tw_hardware) on the GPUs present and writes the calibration file that
 * TW_CALIBRATION points the planner at.
 *
 * Each number is fitted to the formula the model charges it in (src/plan/model.c), so that the
 * file means what the model reads (fits: calibrate_fit.c; method and caveats: docs/calibrate.md):
 *   sm_count          the device's multiprocessor count
 *   l2_mib            the device's L2 cache size
 *   tile_tflops,      the producer GEMM alone (kernels API, band signals on, no consumer) on
 *                     P = SMs - 8 CTAs (a typical C beside it), on
 *   tile_overhead_us  two balanced problems per K that differ only in their wave count: the time
 *                     difference over the wave difference is one wave's time without the launch
 *                     and the kernel's fixed costs; least squares of it against 2 TM TN K over
 *                     K in {1024, 2048, 4096} gives the per-SM rate (slope) and the per-tile
 *                     fixed cost (intercept)
 *   tile_floor_us     the same at K 512, whose tiles take longer than their compute: the floor
 *                     that the model's 4-norm needs for that wave (tw__calib_tile_floor)
 *   tile_m64_share    the same problems at K 2048 with 64-row tiles, timed with the others: the
 *                     share of tile_tflops at which the model's tile time equals their wave
 *                     (tw__calib_tile_share); not written outside (0, 1]
 *   mem_gbps          a device-to-device copy: (read + write bytes) / time, as the default was
 *                     measured (the reduction's own rate is printed beside it)
 *   refetch_exposure  the same producer on one problem whose 64 local experts all have remote
 *                     and local rows, planned under each schedule: (T_remote-first -
 *                     T_expert-major) / (the second reads remote-first has more, 62 experts'
 *                     weights (expert-major reads its last two twice), / mem_gbps), clamped to
 *                     [0, 1]
 *   link_cta_gbps,    the consumer BESIDE the producer (TW_COMBINE_OVERLAP: it shares memory
 *   link_latency_us   with the GEMM) at C in {1, 2, 4, 8, 16, 32} on two problems that send the
 *                     same bands with 4x different bytes (hidden 4096 and 1024), timed by the
 *                     context's per-phase events (comm_ms: the consumer kernel; gemm_ms: the
 *                     producer). Where the consumer bounds the call, the model's pool term says
 *                     C x (time after the first segment is ready) = bytes / link_cta + bands x
 *                     link_latency; least squares over every rank and both problems at the
 *                     largest C at which the consumer bounds every such call gives both (the
 *                     per-CTA rate falls as C grows, so that C, the edge of the range where the
 *                     model makes its choice, is the one that counts). A value outside its
 *                     plausible range (TW_CALIB_*) is not written
 *   link_peak_gbps    the consumer alone (TW_COMBINE_COMM_ONLY, hidden 4096): the plateau of the
 *                     aggregate rate (bytes / time) over C
 *   occ_comp,         cudaOccupancyMaxActiveBlocksPerMultiprocessor of the default producer
 *   occ_comm          kernels (128 x 128 and 128 x 256 tiles; the smaller) and of the bulk
 *                     consumer, each with its shared memory (tw__gemm_occupancy,
 *                     tw__consumer_occupancy)
 *
 * One process per GPU (tw__run_ranks, as `tilewave bench`); rank 0 measures the producer, the
 * copy and the schedules while the others wait, then every rank takes part in the link
 * measurement; rank 0 prints and writes everything. With one GPU the link numbers stay at their
 * defaults.
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
/* ---- ranks ----------------------------------------------------------------------------------- */

static tw_status twc_run(twc_state* s) {
  int dev = 0, sms = 0;
  TW_CUDA_TRY(cudaGetDevice(&dev));
  TW_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  struct cudaDeviceProp prop;
  TW_CUDA_TRY(cudaGetDeviceProperties(&prop, dev));
  snprintf(s->device_name, sizeof s->device_name, "%s", prop.name);
  if (sms <= TW_DEFAULT_COMM_CTAS + 1)
    return tw__fail(TW_ERR_UNSUPPORTED, "calibrate: %d SMs; need more than %d", sms,
                    TW_DEFAULT_COMM_CTAS + 1);
  s->hw.sm_count = sms;
  int l2 = 0;
  TW_CUDA_TRY(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
  if (l2 > 0) s->hw.l2_mib = l2 / 1048576.0;
  /* Occupancy of each kernel role: the default producers at both tile widths (the smaller
   * counts) and the default (bulk) consumer. */
  int occ128 = 0, occ256 = 0, occ_comm = 0;
  TW_TRY(tw__gemm_occupancy(128, 128, 0, &occ128));
  TW_TRY(tw__gemm_occupancy(128, 256, 0, &occ256));
  TW_TRY(tw__consumer_occupancy(TW_CONSUMER_COPY_DEFAULT, &occ_comm));
  if (occ128 < 1 || occ256 < 1 || occ_comm < 1)
    return tw__fail(TW_ERR_UNSUPPORTED,
                    "calibrate: a kernel does not fit on an SM of this GPU (producer %d / %d, "
                    "consumer %d CTAs per SM)",
                    occ128, occ256, occ_comm);
  s->hw.occ_comp = occ128 < occ256 ? occ128 : occ256;
  s->hw.occ_comm = occ_comm;
  if (s->hw.c_max > (sms - 1) * s->hw.occ_comm) s->hw.c_max = (sms - 1) * s->hw.occ_comm;
  twc_progress(s, "%d x %s, %d SMs", s->world, s->device_name, sms);

  /* Rank 0 measures the producer, the copy and the schedules alone; the others wait at the
   * barrier, so that no other GPU's traffic shares anything with it. */
  tw_status st = TW_SUCCESS;
  if (s->rank == 0) {
    st = twc_measure_producer(s);
    if (st == TW_SUCCESS) {
      twc_progress(s, "producer: %.3f TFLOP/s per SM, %.3f us per tile; copy %.0f GB/s",
                   s->hw.tile_tflops, s->hw.tile_overhead_us, s->hw.mem_gbps);
      /* Needs the producer's grid and the copy's mem_gbps; a failure keeps the default. */
      twc_measure_refetch(s);
      if (s->ref_ok)
        twc_progress(s,
                     "schedules: remote-first %.1f us, expert-major %.1f us: refetch_exposure %.3f",
                     s->ref_us[0], s->ref_us[1], s->hw.refetch_exposure);
      else
        twc_progress(s, "schedules: %s", s->ref_note);
    } else {
      fprintf(stderr, "tilewave calibrate: producer: %s: %s\n", tw_status_string(st),
              tw_last_error());
    }
  }
  /* Every rank learns whether rank 0 succeeded (a failed rank 0 must not leave the others
   * inside the link measurement's collectives). */
  int32_t ok_h = st == TW_SUCCESS ? 1 : 0;
  int32_t* ok_d = s->barrier;
  TW_CUDA_TRY(cudaMemcpyAsync(ok_d, &ok_h, 4, cudaMemcpyHostToDevice, s->stream));
  TW_NCCL_TRY(ncclAllReduce(ok_d, ok_d, 1, ncclInt32, ncclMin, s->comm, s->stream));
  TW_CUDA_TRY(cudaMemcpyAsync(&ok_h, ok_d, 4, cudaMemcpyDeviceToHost, s->stream));
  TW_CUDA_TRY(cudaStreamSynchronize(s->stream));
  TW_CUDA_TRY(cudaMemsetAsync(s->barrier, 0, 8, s->stream));
  if (!ok_h) return st != TW_SUCCESS ? st : tw__fail(TW_ERR_INTERNAL, "calibrate: rank 0 failed");

  if (s->world >= 2) {
    twc_progress(s, "link: consumer alone and beside the producer over %d ranks", s->world);
    TW_TRY(twc_measure_link(s));
    twc_progress(s, "link: %.2f GB/s per CTA (%s), %.3f us per band (%s), %.1f GB/s peak",
                 s->hw.link_cta_gbps, s->cta_written ? "fitted" : "default kept",
                 s->hw.link_latency_us, s->latency_written ? "fitted" : "default kept",
                 s->hw.link_peak_gbps);
  } else {
    twc_progress(s, "one GPU: link numbers stay at their defaults");
  }
  if (s->rank != 0) return TW_SUCCESS;

  twc_print(s);
  TW_TRY(tw_hardware_write(&s->hw, s->o.out));
  TW_TRY(twc_append_provenance(s));
  if (s->o.json) TW_TRY(twc_write_json(s, s->o.json));
  printf(
      "\nwrote %s%s%s (%.1f s). Use it with:\n  TW_CALIBRATION=%s tilewave plan ...   (or any "
      "program that plans with tw_plan_config.hardware = NULL)\n",
      s->o.out, s->o.json ? " and " : "", s->o.json ? s->o.json : "", tw__now_seconds() - s->t0,
      s->o.out);
  fflush(stdout);
  return TW_SUCCESS;
}

static int twc_rank_main(int rank, int nranks, const ncclUniqueId* id, void* arg) {
  twc_state s;
  memset(&s, 0, sizeof s);
  s.o = *(const twc_opts*)arg;
  s.rank = rank;
  s.world = nranks;
  s.t0 = tw__now_seconds();
  tw_hardware_default(&s.def);
  s.hw = s.def;
  s.link = (twc_link_point*)calloc((size_t)nranks * TWC_NLINK, sizeof(twc_link_point));
  if (s.link == NULL) return TW_ERR_OUT_OF_MEMORY;
  ncclResult_t nr = ncclCommInitRank(&s.comm, nranks, *id, rank);
  if (nr != ncclSuccess) {
    fprintf(stderr, "tilewave calibrate: rank %d: ncclCommInitRank failed: %s\n", rank,
            ncclGetErrorString(nr));
    free(s.link);
    return TW_ERR_NCCL;
  }
  tw_status st = TW_SUCCESS;
  if (cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking) != cudaSuccess ||
      cudaMalloc((void**)&s.barrier, 256) != cudaSuccess ||
      cudaMemset(s.barrier, 0, 256) != cudaSuccess)
    st = tw__fail(TW_ERR_CUDA, "calibrate: rank %d: CUDA setup failed", rank);
  if (st == TW_SUCCESS) st = twc_run(&s);
  if (st != TW_SUCCESS)
    fprintf(stderr, "tilewave calibrate: rank %d: %s: %s\n", rank, tw_status_string(st),
            tw_last_error());
  cudaFree(s.barrier);
  if (s.stream) cudaStreamDestroy(s.stream);
  /* A failed rank may leave peers inside a collective; abort rather than wait for them. */
  if (st != TW_SUCCESS)
    ncclCommAbort(s.comm);
  else
    ncclCommDestroy(s.comm);
  free(s.link);
  return (int)st;
}

/* ---- command line ---------------------------------------------------------------------------- */

static void twc_usage(FILE* f) {
  fprintf(f,
          "usage: tilewave calibrate [--out FILE] [--json-file FILE] [--quick] [--ranks N] "
          "[--timeout S]\n\n"
          "Measures the resource model's machine description on the GPUs present (one process\n"
          "per GPU) and writes it as a calibration file; plans read it when TW_CALIBRATION\n"
          "names it. Takes well under a minute on 2 GPUs. See docs/calibrate.md.\n"
          "  1 GPU:   sm_count, l2_mib, the kernels' occupancy (occ_comp, occ_comm), producer\n"
          "           tile rate, overhead and floor (tile_tflops, tile_overhead_us,\n"
          "           tile_floor_us), the rate of 64-row tiles (tile_m64_share), device\n"
          "           memory rate (mem_gbps), the\n"
          "           exposed cost of remote-first's second weight reads (refetch_exposure: the\n"
          "           producer under both schedules); link values stay default\n"
          "  2+ GPUs: also the consumer's per-CTA rate and per-band cost (link_cta_gbps,\n"
          "           link_latency_us: beside the producer at small C on hidden 4096 and\n"
          "           1024) and the saturated NVLink rate (link_peak_gbps)\n"
          "A fitted value outside its plausible range is not written (the default stays and\n"
          "the table says why).\n\n"
          "  --out FILE        calibration file to write (default tilewave-calibration.txt)\n"
          "  --json-file FILE  also write every measurement and fit as JSON (alias --json)\n"
          "  --quick           smaller problems and fewer repetitions (noisier)\n"
          "  --ranks N         GPUs to use (default: every visible GPU; 1 = no link values;\n"
          "                    alias --gpus)\n"
          "  --timeout S       kill the run after S seconds (default 300)\n");
}

static void twc_usage_cb(FILE* f, void* ctx) {
  (void)ctx;
  twc_usage(f);
}

int tw_cli_calibrate(int argc, char** argv) {
  twc_opts o;
  memset(&o, 0, sizeof o);
  o.out = "tilewave-calibration.txt";
  o.timeout_s = 300;
  tw_cli_arg args[] = {
      tw__cli_string("--out", &o.out),
      /* --json FILE: the spelling calibrate has always had (docs/calibrate.md) */
      tw__cli_alias(tw__cli_json_file(&o.json), "--json"),
      tw__cli_bool("--quick", &o.quick),
      tw__cli_ranks(&o.ranks),
      tw__cli_timeout(&o.timeout_s),
  };
  const int rc = tw__cli_parse("tilewave calibrate", argc, argv, args,
                               (int)(sizeof args / sizeof args[0]), twc_usage_cb, NULL);
  if (rc != 0) return rc == 1 ? 0 : rc;
  int nranks = o.ranks;
  tw_launcher l;
  if (tw__launcher_detect(&l)) {
    nranks = l.nranks;
  } else {
    /* Counted in a child: this process must not initialise CUDA before it forks the ranks. */
    const int gpus = tw__gpu_count_forked();
    if (gpus <= 0) {
      fprintf(stderr, "tilewave calibrate: calibrate needs a CUDA GPU (none found)\n");
      return 1;
    }
    if (nranks == 0) nranks = gpus;
    if (nranks > gpus) {
      fprintf(stderr, "tilewave calibrate: --ranks %d but only %d GPU(s) visible\n", nranks, gpus);
      return 2;
    }
  }
  tw_status st = tw__run_ranks(nranks, twc_rank_main, &o, o.timeout_s);
  if (st != TW_SUCCESS) {
    fprintf(stderr, "tilewave calibrate: %s: %s\n", tw_status_string(st), tw_last_error());
    return 1;
  }
  return 0;
}
