/*
 * hardware.c: the machine description the resource model reads (tw_hardware), its built-in H200
 * defaults, and the "key = value" calibration file that replaces them.
 *
 * The defaults are measured numbers from two H200 GPUs joined by NVLink (NV18); each field below
 * names the measurement it comes from, or says it is an estimate. A file with the same keys
 * (written by hand, by tw_hardware_write or by `tilewave calibrate`, which measures most of them)
 * replaces them: setting TW_CALIBRATION=<file> makes every plan created with config->hardware ==
 * NULL use it. The file is read once per process and cached; a file that does not parse is reported
 * by tw_plan_create (never silently replaced by the defaults).
 */
#define _POSIX_C_SOURCE 200809L
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "plan.h"

tw_status tw_hardware_default(tw_hardware* hw) {
  TW_CHECK_NULL(hw);
  memset(hw, 0, sizeof *hw);
  hw->size = sizeof(tw_hardware);
  hw->magic = TW_HARDWARE_MAGIC;
  hw->version = TW_API_VERSION;
  /* H200: 132 SMs (cudaDeviceProp.multiProcessorCount). */
  hw->sm_count = 132;
  /* The persistent producer's shared-memory stages allow one CTA per SM; the consumer is given
   * a whole SM so that it never steals producer issue slots. */
  hw->occ_comp = 1;
  hw->occ_comm = 1;
  /* NCCL-window pushes saturate near 16 CTAs (348 GB/s) and gain 1% at 32: no reason to look
   * further. */
  hw->c_max = 32;
  /* cuBLAS bf16 8192^3 measured 793 TFLOP/s on one H200: per SM in a full wave 793 / 132. */
  hw->tile_tflops = 793.0 / 132.0;
  /* Estimate (no direct measurement yet): a tile's epilogue ends with a TMA store drain
   * (wait_group 0) and a release add through L2. We take about a fifth of the 2.7 us fixed
   * cost of a remote SM-store transfer (intercept of the 256 KiB / 1 MiB rows of the SM-store
   * table, which also includes a kernel launch and an NVLink round trip). */
  hw->tile_overhead_us = 0.5;
  /* What tilewave's consumer (bulk copies) moves per CTA while the producer runs beside it: the
   * rate falls from 37 GB/s at C = 1 as the consumer shares memory with the GEMM, and 28 GB/s is
   * the rate where the choice is made, C = 4..8 (dev/NOTES.md section 4 and "Moved from code
   * comments"). */
  hw->link_cta_gbps = 28.0;
  /* Same table: 16 CTAs 348, 32 CTAs 351, 64 CTAs 359 GB/s per direction; 351 is the plateau
   * over the C range the model considers (c_max = 32). */
  hw->link_peak_gbps = 351.0;
  /* The consumer's fixed cost per band it sends, in the model's pool form (model_eval.c: C CTAs
   * share it): a unit's band poll and the latency of its first bulk load are not overlapped with
   * the previous unit (combine.cu), 2-3 us; 3 us also fits the oracle matrix best (dev/NOTES.md,
   * "Moved from code comments"). `tilewave calibrate` fits it together with the per-CTA rate from
   * two hidden sizes (docs/calibrate.md). */
  hw->link_latency_us = 3.0;
  /* Local device copy measured 3.8 TB/s (read + write). */
  hw->mem_gbps = 3800.0;
  /* `tilewave bench gemm` with each schedule forced: remote-first, which reads the weights of an
   * expert with remote and local rows twice, took longer than expert-major by the model's roofline
   * difference plus 0.30 x (the second reads' bytes / mem_gbps), a least-squares fit (dev/NOTES.md,
   * "Moved from code comments"). */
  hw->refetch_exposure = 0.30;
  /* First paper's reference service-rate ratio (its Section III calibration, K=352, 128x128
   * tiles, D=4). */
  hw->rho_ref = 10.05;
  /* H200 (docs/hardware.md): 60 MiB. */
  hw->l2_mib = 60.0;
  /* A producer tile takes a floor however short its K, about 2.8 us per 128 output columns
   * with the default kernels (v5 at tn 128, v4 at tn 256): (c^4 + (2.8 TN / 128)^4)^(1/4) matches
   * the measured tile times at K 512 and cut the oracle matrices' replayed regret
   * (dev/gemm/NOTES.md v7-v8; dev/NOTES.md, "Moved from code comments"). */
  hw->tile_floor_us = 2.8;
  /* 64-row tiles (problem tile_m 64) run at a lower rate than 128-row ones: measured, a 64-row
   * tile takes 0.68 of a 128-row one's time for half its work, a share of 0.5 / 0.68 (dev/NOTES.md,
   * "Moved from code comments"). */
  hw->tile_m64_share = 0.73;
  return TW_SUCCESS;
}

/* The file's keys, in file order: one table drives reading, writing and validation. */
typedef enum { TW__HW_INT, TW__HW_DOUBLE } tw__hw_kind;
typedef struct {
  const char* key;
  tw__hw_kind kind;
  size_t offset;
} tw__hw_field;

#define TW__HW_I(name) \
  { #name, TW__HW_INT, offsetof(tw_hardware, name) }
#define TW__HW_D(name) \
  { #name, TW__HW_DOUBLE, offsetof(tw_hardware, name) }
static const tw__hw_field tw__hw_fields[] = {
    TW__HW_I(sm_count),      TW__HW_I(occ_comp),         TW__HW_I(occ_comm),
    TW__HW_I(c_max),         TW__HW_D(tile_tflops),      TW__HW_D(tile_overhead_us),
    TW__HW_D(link_cta_gbps), TW__HW_D(link_peak_gbps),   TW__HW_D(link_latency_us),
    TW__HW_D(mem_gbps),      TW__HW_D(refetch_exposure), TW__HW_D(rho_ref),
    TW__HW_D(l2_mib),        TW__HW_D(tile_floor_us),    TW__HW_D(tile_m64_share),
};
#define TW__HW_NFIELDS (sizeof tw__hw_fields / sizeof tw__hw_fields[0])

tw_status tw__hardware_validate(const tw_hardware* hw) {
  TW_CHECK_NULL(hw);
  TW_TRY(tw__check_header("tw_hardware", hw->size, sizeof(tw_hardware), hw->magic,
                          TW_HARDWARE_MAGIC, hw->version));
  if (hw->sm_count < 2 || hw->sm_count > 100000)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_hardware: sm_count = %d; give the GPU's SM count (>= 2)", hw->sm_count);
  if (hw->occ_comp < 1 || hw->occ_comm < 1 || hw->occ_comp > 64 || hw->occ_comm > 64)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_hardware: occ_comp = %d, occ_comm = %d; each must be in 1..64",
                    hw->occ_comp, hw->occ_comm);
  /* At least one SM must stay with the producer at the largest C. */
  int32_t max_c = (hw->sm_count - 1) * hw->occ_comm;
  if (hw->c_max < 1 || hw->c_max > max_c)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_hardware: c_max = %d; must be in 1..%d so that the producer keeps at "
                    "least one SM",
                    hw->c_max, max_c);
  const struct {
    const char* name;
    double v;
    int zero_ok;
  } pos[] = {{"tile_tflops", hw->tile_tflops, 0},
             {"tile_overhead_us", hw->tile_overhead_us, 1},
             {"link_cta_gbps", hw->link_cta_gbps, 0},
             {"link_peak_gbps", hw->link_peak_gbps, 0},
             {"link_latency_us", hw->link_latency_us, 1},
             {"mem_gbps", hw->mem_gbps, 0},
             {"refetch_exposure", hw->refetch_exposure, 1},
             {"rho_ref", hw->rho_ref, 0},
             {"l2_mib", hw->l2_mib, 1},
             {"tile_floor_us", hw->tile_floor_us, 1},
             {"tile_m64_share", hw->tile_m64_share, 0}};
  for (size_t i = 0; i < sizeof pos / sizeof pos[0]; i++) {
    if (!isfinite(pos[i].v) || pos[i].v < 0.0 || (!pos[i].zero_ok && pos[i].v == 0.0))
      return tw__fail(TW_ERR_INVALID_ARGUMENT, "tw_hardware: %s = %g; must be finite and %s",
                      pos[i].name, pos[i].v, pos[i].zero_ok ? ">= 0" : "> 0");
  }
  if (hw->refetch_exposure > 1.0)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_hardware: refetch_exposure = %g; a fraction of a read cannot exceed 1 "
                    "(0: the producer hides every second read of the weights)",
                    hw->refetch_exposure);
  if (hw->tile_m64_share > 1.0)
    return tw__fail(TW_ERR_INVALID_ARGUMENT,
                    "tw_hardware: tile_m64_share = %g; 64-row tiles do not run faster per FLOP "
                    "than 128-row ones: give a share in (0, 1]",
                    hw->tile_m64_share);
  return TW_SUCCESS;
}

/* Trims leading and trailing white space in place; returns the first non-space character. */
static char* tw__trim(char* s) {
  while (isspace((unsigned char)*s)) s++;
  size_t n = strlen(s);
  while (n > 0 && isspace((unsigned char)s[n - 1])) s[--n] = '\0';
  return s;
}

tw_status tw_hardware_read(const char* path, tw_hardware* hw) {
  tw__clear_error();
  TW_CHECK_NULL(path);
  TW_CHECK_NULL(hw);
  tw_hardware out;
  TW_TRY(tw_hardware_default(&out));
  FILE* f = fopen(path, "r");
  if (f == NULL)
    return tw__fail(TW_ERR_IO, "tw_hardware_read: cannot open '%s': %s; check the path", path,
                    strerror(errno));
  char line[512];
  int lineno = 0;
  tw_status st = TW_SUCCESS;
  while (st == TW_SUCCESS && fgets(line, sizeof line, f) != NULL) {
    lineno++;
    if (strchr(line, '\n') == NULL && !feof(f)) {
      st = tw__fail(TW_ERR_IO, "tw_hardware_read: %s:%d: line longer than %zu characters", path,
                    lineno, sizeof line - 2);
      break;
    }
    char* hash = strchr(line, '#');
    if (hash != NULL) *hash = '\0';
    char* s = tw__trim(line);
    if (*s == '\0') continue;
    char* eq = strchr(s, '=');
    if (eq == NULL) {
      st = tw__fail(TW_ERR_IO, "tw_hardware_read: %s:%d: expected 'key = value', got '%s'", path,
                    lineno, s);
      break;
    }
    *eq = '\0';
    char* key = tw__trim(s);
    char* val = tw__trim(eq + 1);
    const tw__hw_field* field = NULL;
    for (size_t i = 0; i < TW__HW_NFIELDS; i++)
      if (strcmp(key, tw__hw_fields[i].key) == 0) field = &tw__hw_fields[i];
    if (field == NULL) {
      st = tw__fail(TW_ERR_IO,
                    "tw_hardware_read: %s:%d: unknown key '%s'; keys are the tw_hardware field "
                    "names (sm_count, occ_comp, ..., rho_ref), see docs/model.md",
                    path, lineno, key);
      break;
    }
    char* end = NULL;
    errno = 0;
    if (field->kind == TW__HW_INT) {
      long v = strtol(val, &end, 10);
      if (*val == '\0' || *end != '\0' || errno != 0 || v < INT32_MIN || v > INT32_MAX) {
        st = tw__fail(TW_ERR_IO, "tw_hardware_read: %s:%d: %s = '%s' is not an integer", path,
                      lineno, key, val);
        break;
      }
      *(int32_t*)((char*)&out + field->offset) = (int32_t)v;
    } else {
      double v = strtod(val, &end);
      if (*val == '\0' || *end != '\0' || errno == ERANGE) {
        st = tw__fail(TW_ERR_IO, "tw_hardware_read: %s:%d: %s = '%s' is not a number", path, lineno,
                      key, val);
        break;
      }
      *(double*)((char*)&out + field->offset) = v;
    }
  }
  if (st == TW_SUCCESS && ferror(f))
    st = tw__fail(TW_ERR_IO, "tw_hardware_read: error reading '%s'", path);
  fclose(f);
  TW_TRY(st);
  tw_status v = tw__hardware_validate(&out);
  if (v != TW_SUCCESS) {
    /* tw__fail writes the thread's message buffer: copy the detail out of it first. */
    char detail[600];
    snprintf(detail, sizeof detail, "%s", tw_last_error());
    return tw__fail(v, "tw_hardware_read: %s: %s", path, detail);
  }
  *hw = out;
  return TW_SUCCESS;
}

tw_status tw_hardware_write(const tw_hardware* hw, const char* path) {
  tw__clear_error();
  TW_CHECK_NULL(hw);
  TW_CHECK_NULL(path);
  TW_TRY(tw__hardware_validate(hw));
  FILE* f = fopen(path, "w");
  if (f == NULL)
    return tw__fail(TW_ERR_IO, "tw_hardware_write: cannot create '%s': %s; check the directory",
                    path, strerror(errno));
  fprintf(f, "# tilewave hardware description (keys: docs/model.md)\n");
  for (size_t i = 0; i < TW__HW_NFIELDS; i++) {
    const tw__hw_field* fd = &tw__hw_fields[i];
    /* %.17g prints every double so that it reads back bit-exactly. */
    if (fd->kind == TW__HW_INT)
      fprintf(f, "%s = %d\n", fd->key, (int)*(const int32_t*)((const char*)hw + fd->offset));
    else
      fprintf(f, "%s = %.17g\n", fd->key, *(const double*)((const char*)hw + fd->offset));
  }
  int bad = ferror(f);
  if (fclose(f) != 0 || bad)
    return tw__fail(TW_ERR_IO, "tw_hardware_write: error writing '%s'", path);
  return TW_SUCCESS;
}

/* TW_CALIBRATION is read once per process: planning must not touch the file system on every
 * plan, and every plan of a process should see the same machine description. */
static pthread_once_t tw__calib_once = PTHREAD_ONCE_INIT;
static tw_hardware tw__calib_hw;
static tw_status tw__calib_status = TW_SUCCESS;
static char tw__calib_error[600];

static void tw__calib_load(void) {
  const char* path = tw__tunable_string(TW_TUNE_CALIBRATION);
  if (path == NULL) {
    tw__calib_status = tw_hardware_default(&tw__calib_hw);
    return;
  }
  tw__calib_status = tw_hardware_read(path, &tw__calib_hw);
  if (tw__calib_status != TW_SUCCESS)
    snprintf(tw__calib_error, sizeof tw__calib_error, "TW_CALIBRATION=%s: %s", path,
             tw_last_error());
  else
    TW_INFO("hardware description from TW_CALIBRATION=%s", path);
}

tw_status tw__hardware_resolve(const tw_hardware* given, tw_hardware* out) {
  TW_CHECK_NULL(out);
  if (given != NULL) {
    TW_TRY(tw__hardware_validate(given));
    *out = *given;
    return TW_SUCCESS;
  }
  pthread_once(&tw__calib_once, tw__calib_load);
  if (tw__calib_status != TW_SUCCESS)
    return tw__fail(tw__calib_status, "%s; fix the file or unset TW_CALIBRATION", tw__calib_error);
  *out = tw__calib_hw;
  return TW_SUCCESS;
}
