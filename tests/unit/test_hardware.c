/*
 * test_hardware.c: the hardware description: built-in H200 defaults, the "key = value" file
 * (exact round trip, comments, missing keys, errors naming key and line) and TW_CALIBRATION
 * (used by plans created without a hardware description; a bad file fails tw_plan_create).
 */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "plan.h"
#include "tilewave.h"
#include "tw_test.h"

static char tmp_dir[64];

static const char* tmp_path(const char* name) {
  static char buf[4][160];
  static int i = 0;
  i = (i + 1) % 4;
  snprintf(buf[i], sizeof buf[i], "%s/%s", tmp_dir, name);
  return buf[i];
}

static void write_text(const char* path, const char* text) {
  FILE* f = fopen(path, "w");
  if (f == NULL) return;
  fputs(text, f);
  fclose(f);
}

static void test_defaults(void) {
  tw_hardware hw;
  CHECK_OK(tw_hardware_default(&hw));
  CHECK(hw.size == sizeof hw && hw.magic == TW_HARDWARE_MAGIC && hw.version == TW_API_VERSION);
  CHECK(hw.sm_count == 132 && hw.occ_comp == 1 && hw.occ_comm == 1 && hw.c_max == 32);
  CHECK_NEAR(hw.tile_tflops * 132, 793.0, 1e-9);
  CHECK(hw.link_cta_gbps > 0 && hw.link_cta_gbps * 2 <= 110); /* 2 CTAs measured 99 GB/s */
  CHECK(hw.link_peak_gbps >= 337 && hw.link_peak_gbps <= 359);
  CHECK(hw.link_latency_us > 0 && hw.tile_overhead_us >= 0);
  CHECK(hw.mem_gbps == 3800.0 && hw.rho_ref == 10.05);
  CHECK(hw.tile_m64_share > 0.5 && hw.tile_m64_share < 1.0); /* run 11: 0.5 / 0.68 */
  CHECK_STATUS(tw_hardware_default(NULL), TW_ERR_NULL_POINTER);
}

static uint64_t rng_state;
static double rnd(double lo, double hi) {
  rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
  return lo + (hi - lo) * (double)(rng_state >> 11) / 9007199254740992.0;
}

/* Random values with full 53-bit mantissas must come back bit-exactly. */
static void test_round_trip(void) {
  rng_state = (uint64_t)time(NULL) * 2654435761u + 1;
  for (int i = 0; i < 50; i++) {
    tw_hardware hw, back;
    CHECK_OK(tw_hardware_default(&hw));
    hw.sm_count = 16 + (int32_t)rnd(0, 200);
    hw.occ_comp = 1 + (int32_t)rnd(0, 3);
    hw.occ_comm = 1 + (int32_t)rnd(0, 3);
    hw.c_max = 1 + (int32_t)rnd(0, 15);
    hw.tile_tflops = rnd(0.1, 20);
    hw.tile_overhead_us = rnd(0, 3);
    hw.link_cta_gbps = rnd(1, 100);
    hw.link_peak_gbps = rnd(100, 1000);
    hw.link_latency_us = rnd(0, 10) * 1e-3;
    hw.mem_gbps = rnd(500, 8000);
    hw.rho_ref = rnd(0.5, 50);
    hw.l2_mib = rnd(0, 256);
    hw.tile_floor_us = rnd(0, 10);
    hw.tile_m64_share = rnd(0.05, 1);
    const char* path = tmp_path("rt.txt");
    CHECK_OK(tw_hardware_write(&hw, path));
    memset(&back, 0x5a, sizeof back);
    CHECK_OK(tw_hardware_read(path, &back));
    CHECK(memcmp(&hw, &back, sizeof hw) == 0);
  }
}

static void test_parse_rules(void) {
  tw_hardware hw, def;
  CHECK_OK(tw_hardware_default(&def));
  /* Comments, blank lines, spaces; missing keys keep their defaults. */
  const char* p = tmp_path("partial.txt");
  write_text(p,
             "# measured on host x\n\n  sm_count=100   # trailing comment\nrho_ref =  3.5\n"
             "\tlink_peak_gbps = 4e2\n");
  CHECK_OK(tw_hardware_read(p, &hw));
  CHECK(hw.sm_count == 100 && hw.rho_ref == 3.5 && hw.link_peak_gbps == 400.0);
  CHECK(hw.c_max == def.c_max && hw.mem_gbps == def.mem_gbps && hw.tile_tflops == def.tile_tflops);

  /* Unknown key: TW_ERR_IO naming the key and the line; the output is left untouched. */
  p = tmp_path("unknown.txt");
  write_text(p, "sm_count = 100\n# ok\nsm_cuont = 7\n");
  hw = def;
  hw.sm_count = 55;
  CHECK_STATUS(tw_hardware_read(p, &hw), TW_ERR_IO);
  CHECK(strstr(tw_last_error(), "sm_cuont") != NULL);
  CHECK(strstr(tw_last_error(), ":3:") != NULL);
  CHECK(hw.sm_count == 55);

  const struct {
    const char* text;
    tw_status want;
    const char* mention;
  } bad[] = {
      {"sm_count = 12x\n", TW_ERR_IO, "sm_count"},
      {"sm_count = 1.5\n", TW_ERR_IO, "sm_count"},
      {"rho_ref = \n", TW_ERR_IO, "rho_ref"},
      {"rho_ref = abc\n", TW_ERR_IO, "rho_ref"},
      {"just words\n", TW_ERR_IO, ":1:"},
      {"rho_ref = -1\n", TW_ERR_INVALID_ARGUMENT, "rho_ref"},
      {"mem_gbps = inf\n", TW_ERR_INVALID_ARGUMENT, "mem_gbps"},
      {"sm_count = 20\nc_max = 20\n", TW_ERR_INVALID_ARGUMENT, "c_max"},
      {"occ_comm = 0\n", TW_ERR_INVALID_ARGUMENT, "occ_comm"},
      {"refetch_exposure = 1.5\n", TW_ERR_INVALID_ARGUMENT, "refetch_exposure"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    p = tmp_path("bad.txt");
    write_text(p, bad[i].text);
    CHECK_STATUS(tw_hardware_read(p, &hw), bad[i].want);
    CHECKF(strstr(tw_last_error(), bad[i].mention) != NULL, "case %zu: '%s' lacks '%s'", i,
           tw_last_error(), bad[i].mention);
  }
  CHECK_STATUS(tw_hardware_read(tmp_path("missing.txt"), &hw), TW_ERR_IO);
  CHECK_STATUS(tw_hardware_read(NULL, &hw), TW_ERR_NULL_POINTER);
  CHECK_STATUS(tw_hardware_write(&def, "/nonexistent-dir/x/hw.txt"), TW_ERR_IO);
  tw_hardware broken = def;
  broken.magic = 1;
  CHECK_STATUS(tw_hardware_write(&broken, tmp_path("b.txt")), TW_ERR_CONFIG_VERSION);
}

/* Creates a small plan with config->hardware == NULL and returns its status; `out` gets the
 * hardware the plan used. */
static tw_status plan_with_env_hw(tw_hardware* out) {
  tw_problem prob = TW_PROBLEM_INIT;
  tw_status st = tw_problem_preset("m-trans-xl", &prob);
  if (st != TW_SUCCESS) return st;
  prob.world_size = 2;
  prob.max_tokens = 256;
  tw_routing_t rt = NULL;
  st = tw_routing_generate(&prob, TW_ROUTER_BALANCED, 0, 256, 3, &rt);
  if (st != TW_SUCCESS) return st;
  tw_plan_t plan = NULL;
  st = tw_plan_create(&prob, rt, 0, NULL, &plan);
  if (st == TW_SUCCESS) {
    *out = plan->hardware;
    tw_plan_destroy(plan);
  }
  tw_routing_destroy(rt);
  return st;
}

/* TW_CALIBRATION is read once per process, so each case runs in a child process. Exit codes:
 * 0 as expected, 1 otherwise. */
static int run_child(const char* calibration, int expect_ok, const tw_hardware* want) {
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid == 0) {
    if (calibration)
      setenv("TW_CALIBRATION", calibration, 1);
    else
      unsetenv("TW_CALIBRATION");
    tw_hardware got;
    tw_status st = plan_with_env_hw(&got);
    /* The resolver itself (what tw_plan_create calls) must name the variable in its detail. */
    tw_hardware direct;
    tw_status rs = tw__hardware_resolve(NULL, &direct);
    int ok = expect_ok ? (st == TW_SUCCESS && memcmp(&got, want, sizeof got) == 0 &&
                          rs == TW_SUCCESS && memcmp(&direct, want, sizeof got) == 0)
                       : (st == TW_ERR_IO && rs == TW_ERR_IO &&
                          strstr(tw_last_error(), "TW_CALIBRATION") != NULL);
    if (!ok) fprintf(stderr, "  child: %s (%s)\n", tw_status_string(st), tw_last_error());
    _exit(ok ? 0 : 1);
  }
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static void test_calibration_env(void) {
  tw_hardware def, cal;
  CHECK_OK(tw_hardware_default(&def));
  cal = def;
  cal.sm_count = 78;
  cal.c_max = 12;
  cal.link_cta_gbps = 31.25;
  cal.rho_ref = 7.125;
  const char* good = tmp_path("cal.txt");
  CHECK_OK(tw_hardware_write(&cal, good));
  const char* bad = tmp_path("cal_bad.txt");
  write_text(bad, "sm_count = 78\nlink_speed = 3\n");
  CHECK(run_child(NULL, 1, &def) == 0);
  CHECK(run_child(good, 1, &cal) == 0);
  CHECK(run_child(bad, 0, NULL) == 0);
  CHECK(run_child(tmp_path("does-not-exist.txt"), 0, NULL) == 0);
}

int main(void) {
  snprintf(tmp_dir, sizeof tmp_dir, "/tmp/tw_hw_XXXXXX");
  if (mkdtemp(tmp_dir) == NULL) {
    perror("mkdtemp");
    return 1;
  }
  static const tw_test_case cases[] = {TW_TEST(test_defaults), TW_TEST(test_round_trip),
                                       TW_TEST(test_parse_rules), TW_TEST(test_calibration_env)};
  int rc = tw_test_run(cases, (int)(sizeof cases / sizeof cases[0]));
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp_dir);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmp_dir);
  return rc;
}
