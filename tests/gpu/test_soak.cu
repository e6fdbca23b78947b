/*
 * test_soak.cu: many GEMM2 + combine calls in a row, with no host synchronisation between them,
 * checked every 100 calls. Per rank, per dataflow (reduce, then add, each on a context of its
 * own), a set of plans is built and each uploaded once into a device plan of its own before the
 * first call: generated routings (balanced, moderate and
 * stress skew; full, partial and odd token counts) and hand-made ones (no tokens anywhere, one
 * token per rank, one rank empty, one hot expert, every token on its own rank's experts, every
 * token on other ranks' experts). Every call picks, as a pure function of its index (the same on
 * every rank), the plan, the stream (one of two), the mode (mostly overlapped, one in eight
 * unfused) and, per rank, the consumer CTA count C in 1..max_comm_ctas. One more device plan
 * rotates: every 17 calls it is uploaded again with another plan between calls, with no host
 * synchronisation (on the stream of the last call, the other stream waiting for the upload with
 * an event: the upload rules of tilewave.h), and a quarter of the calls use it with whatever plan
 * it holds; no other device plan is ever uploaded while a call may still read it.
 *
 * Every 100th call (and the last) is a check: its output (poisoned with NaN first under the reduce
 * dataflow) is compared
 *  - bit for bit with an unfused call of the same plan right after it;
 *  - bit for bit with the first checked output of the same plan (the output does not depend on C,
 *    the stream or the mode: a difference is drift, e.g. a stale counter or buffer);
 *  - with a double-precision reference (overlap_common.h) on sampled tokens, within 8e-3 of the
 *    largest reference value (the bound of test_overlap.cu); no NaN may be left;
 * and tw_context_check must return TW_SUCCESS on every rank. The ranks agree after every check
 * whether to go on, so that a failure stops them all together.
 *
 * Calls per dataflow: TW_SOAK_CALLS (default 300: the short run ctest does; the full soak is
 * TW_SOAK_CALLS=10000). Rank 0 prints one summary line per dataflow and one in all (calls,
 * checks, wall time, calls/s) on stdout, and progress with an ETA on stderr. Multi-rank like the
 * other GPU tests (tw_rank_test_main): 2 GPUs over NCCL, or --in-process W. Exits 77 without the
 * GPUs.
 */
#include "overlap_common.h"

enum {
  kHidden = 1024,
  kFfn = 512,
  kExperts = 16,
  kTopK = 2,
  kMaxTokens = 1024,
  kCheckEvery = 100,
  kMaxPlans = 16,
  kSamples = 8
};

typedef struct tw_soak_plan {
  const char* name;
  tw_routing_t rt;
  tw_plan_t plan;
  tw_device_plan_t dp;
  void* expert_in;  /* (plan rows, F) device bf16 */
  uint64_t salt_h;  /* the GEMM2 input's seed (tw_h_value) */
  int32_t tokens;   /* this rank's */
  uint16_t* golden; /* (tokens, H): the first checked output, NULL before */
  int checks;
} tw_soak_plan;

typedef struct tw_soak_stats {
  long calls, checks, compared_tokens;
  long rotations, rotating_calls; /* uploads of the rotating device plan, calls that used it */
  double wall_s, max_rel;
} tw_soak_stats;

/* Calls between checks: TW_SOAK_CHECK_EVERY (default kCheckEvery; 1 checks every call, for
 * finding the first call that goes wrong). */
static int tw_soak_check_every(void) {
  const char* v = getenv("TW_SOAK_CHECK_EVERY");
  const long n = v != NULL && v[0] != '\0' ? strtol(v, NULL, 10) : (long)kCheckEvery;
  return n < 1 ? 1 : n > 1000000 ? 1000000 : (int)n;
}

/* Where two outputs first differ, for the failure message: "token t col c: a vs b", or "". */
static void tw_soak_first_diff(const uint16_t* a, const uint16_t* b, size_t n, char* buf,
                               size_t len) {
  buf[0] = '\0';
  size_t diff = 0, first = n;
  for (size_t e = 0; e < n; e++)
    if (a[e] != b[e]) {
      if (first == n) first = e;
      diff++;
    }
  if (first < n)
    snprintf(buf, len, "; %zu of %zu differ, first at token %zu col %zu: %g vs %g", diff, n,
             first / kHidden, first % kHidden, (double)tw_bf2f(a[first]),
             (double)tw_bf2f(b[first]));
}

static long tw_soak_env(const char* name, long fallback) {
  const char* v = getenv(name);
  return v != NULL && v[0] != '\0' ? strtol(v, NULL, 10) : fallback;
}

/* Variables the soak can hold fixed, to find what a failure needs (all default to the full mix),
 * read once: TW_SOAK_STREAMS=1 puts every call on one stream, TW_SOAK_ROTATE=0 never uploads the
 * rotating device plan, TW_SOAK_UNFUSED=0 makes every call between checks overlapped,
 * TW_SOAK_MAX_C caps C, TW_SOAK_PLAN=k uses plan k only; TW_SOAK_RETRY=1 (tw_soak_verify). */
typedef struct tw_soak_knobs {
  int one_stream, rotate, unfused, retry;
  long max_c, plan; /* 0 / -1: no cap, every plan */
} tw_soak_knobs;

static const tw_soak_knobs* tw_soak_knobs_get(void) {
  static tw_soak_knobs k;
  static int read = 0;
  if (!read) { /* first called from main, before any rank's thread starts */
    k.one_stream = tw_soak_env("TW_SOAK_STREAMS", 2) == 1;
    k.rotate = tw_soak_env("TW_SOAK_ROTATE", 1) != 0;
    k.unfused = tw_soak_env("TW_SOAK_UNFUSED", 1) != 0;
    k.retry = tw_soak_env("TW_SOAK_RETRY", 0) != 0;
    k.max_c = tw_soak_env("TW_SOAK_MAX_C", 0);
    k.plan = tw_soak_env("TW_SOAK_PLAN", -1);
    read = 1;
  }
  return &k;
}

static int tw_soak_calls(void) {
  const char* v = getenv("TW_SOAK_CALLS");
  const long n = v != NULL && v[0] != '\0' ? strtol(v, NULL, 10) : 300;
  return n < 1 ? 1 : n > 100000000 ? 100000000 : (int)n;
}

/* A routing from per-rank arrays that this function owns and frees. */
static tw_status tw_soak_routing_from(const tw_problem* p, const int32_t* tokens, int32_t** ids,
                                      float** ws, tw_routing_t* out) {
  const tw_status st =
      tw_routing_create(p, tokens, (const int32_t* const*)ids, (const float* const*)ws, out);
  for (int r = 0; r < p->world_size; r++) {
    free(ids[r]);
    free(ws[r]);
  }
  return st;
}

/* Hand-made routings. kind: 0 no tokens, 1 one hot expert (every token's first expert is global
 * expert 0), 2 all local (each token on its own rank's experts), 3 all remote (each token on
 * other ranks' experts). Weights: positive, different per slot. */
static tw_status tw_soak_hand_routing(const tw_problem* p, int kind, tw_routing_t* out) {
  const int W = p->world_size, K = p->top_k, El = p->experts / W, E = p->experts;
  int32_t tokens[TW_MAX_RANKS];
  int32_t* ids[TW_MAX_RANKS];
  float* ws[TW_MAX_RANKS];
  for (int r = 0; r < W; r++) {
    tokens[r] = kind == 0 ? 0 : p->max_tokens;
    ids[r] = (int32_t*)malloc(sizeof(int32_t) * ((size_t)tokens[r] * K + 1));
    ws[r] = (float*)malloc(sizeof(float) * ((size_t)tokens[r] * K + 1));
    for (int t = 0; t < tokens[r]; t++) {
      int32_t* id = ids[r] + (size_t)t * K;
      float* w = ws[r] + (size_t)t * K;
      if (kind == 1) {
        id[0] = 0;
        id[1] = 1 + (t * 7 + r * 3) % (E - 1);
      } else if (kind == 2) {
        id[0] = r * El + t % El;
        id[1] = r * El + (t + 1) % El;
      } else {
        const int q1 = (r + 1) % W, q2 = W > 2 ? (r + 2) % W : q1;
        id[0] = q1 * El + t % El;
        id[1] = q2 * El + (t + (q2 == q1 ? 1 : 3)) % El;
      }
      w[0] = 0.55f + 0.4f * (float)((t * 13 + r) % 10) / 10.0f;
      w[1] = 1.0f - w[0] + 0.01f;
    }
  }
  return tw_soak_routing_from(p, tokens, ids, ws, out);
}

/* Every routing of the soak, the same on every rank. Returns the count. */
static int tw_soak_routings(const tw_problem* p, tw_routing_t* rts, const char** names) {
  const int W = p->world_size, M = p->max_tokens;
  int n = 0;
  int32_t tokens[TW_MAX_RANKS];
#define TW_SOAK_GEN(label, router, count_expr, seed)                 \
  do {                                                               \
    for (int r = 0; r < W; r++) tokens[r] = (count_expr);            \
    names[n] = (label);                                              \
    rts[n] = NULL;                                                   \
    CHECK_OK(tw_make_routing(p, (router), tokens, (seed), &rts[n])); \
    if (rts[n] != NULL) n++;                                         \
  } while (0)
  TW_SOAK_GEN("balanced, full", TW_ROUTER_BALANCED, M, 101);
  TW_SOAK_GEN("moderate skew, 700", TW_ROUTER_MODERATE_SKEW, 700, 102);
  TW_SOAK_GEN("stress skew, full", TW_ROUTER_STRESS_SKEW, M, 103);
  TW_SOAK_GEN("balanced, 333", TW_ROUTER_BALANCED, 333, 104);
  TW_SOAK_GEN("stress skew, odd counts", TW_ROUTER_STRESS_SKEW, 1 + 2 * ((r * 131 + 255) % (M / 2)),
              105);
  TW_SOAK_GEN("moderate skew, 1 token", TW_ROUTER_MODERATE_SKEW, 1, 106);
  TW_SOAK_GEN("balanced, rank 0 empty", TW_ROUTER_BALANCED, r == 0 ? 0 : M - 1 - r, 107);
#undef TW_SOAK_GEN
  static const char* const hand[4] = {"no tokens", "one hot expert", "all local", "all remote"};
  for (int kind = 0; kind < 4; kind++) {
    if (kind == 3 && W < 2) continue; /* no other rank */
    rts[n] = NULL;
    CHECK_OK(tw_soak_hand_routing(p, kind, &rts[n]));
    names[n] = hand[kind];
    if (rts[n] != NULL) n++;
  }
  return n;
}

/* Plans, device plans and inputs of every routing, uploaded once; the host waits for the uploads
 * before the first call. Returns the count of plans ready. */
static int tw_soak_setup(tw_rank_env* env, const tw_problem* p, tw_context_t ctx, int dataflow,
                         tw_soak_plan* sp) {
  tw_routing_t rts[kMaxPlans];
  const char* names[kMaxPlans];
  const int n = tw_soak_routings(p, rts, names);
  int ready = 0;
  for (int i = 0; i < n; i++) {
    tw_soak_plan* s = &sp[ready];
    memset(s, 0, sizeof *s);
    s->name = names[i];
    s->rt = rts[i];
    s->salt_h = 7000 + (uint64_t)i * 31;
    tw_plan_config pc = TW_PLAN_CONFIG_INIT;
    pc.dataflow = dataflow;
    pc.coalesce = 1 << (i % 3);
    CHECK_OK(tw_plan_create(p, s->rt, env->rank, &pc, &s->plan));
    CHECK_OK(tw_device_plan_create(ctx, &s->dp));
    const int32_t* ids = NULL;
    const float* ws = NULL;
    CHECK_OK(tw_routing_rank(s->rt, env->rank, &s->tokens, &ids, &ws));
    if (s->plan == NULL || s->dp == NULL) {
      tw_plan_destroy(s->plan);
      tw_device_plan_destroy(s->dp);
      tw_routing_destroy(s->rt);
      continue;
    }
    const size_t in_bytes = (size_t)s->plan->rows * p->ffn * 2;
    CHECK_CUDA(cudaMalloc(&s->expert_in, in_bytes + 16));
    if (in_bytes > 0) {
      uint16_t* h = (uint16_t*)malloc(in_bytes);
      tw_fill_expert_in(s->plan, s->salt_h, h);
      CHECK_CUDA(cudaMemcpy(s->expert_in, h, in_bytes, cudaMemcpyHostToDevice));
      free(h);
    }
    CHECK_OK(tw_device_plan_upload(s->dp, s->plan, s->rt, env->stream));
    ready++;
  }
  CHECK_CUDA(cudaStreamSynchronize(env->stream));
  return ready;
}

static void tw_soak_teardown(tw_soak_plan* sp, int n) {
  for (int i = 0; i < n; i++) {
    CHECK_OK(tw_device_plan_destroy(sp[i].dp));
    tw_plan_destroy(sp[i].plan);
    tw_routing_destroy(sp[i].rt);
    cudaFree(sp[i].expert_in);
    free(sp[i].golden);
  }
}

/* The choices of call i: the same plan, stream and mode on every rank; C per rank. rotating: the
 * call uses the rotating device plan (whatever plan it holds now) instead of the plan's own. */
typedef struct tw_soak_choice {
  int plan, stream, C, rotating;
  tw_combine_mode mode;
} tw_soak_choice;

/* Every kRotateEvery calls the rotating device plan is uploaded again, with another plan. */
enum { kRotateEvery = 17 };

static tw_soak_choice tw_soak_choose(long i, int nplans, int rank, int max_c) {
  const uint64_t h = tw_mix64(0x50a4c0deull ^ (uint64_t)i * 0x9e3779b97f4a7c15ull);
  const tw_soak_knobs* k = tw_soak_knobs_get();
  if (k->max_c >= 1 && k->max_c < max_c) max_c = (int)k->max_c;
  tw_soak_choice c;
  c.plan = k->plan >= 0 && k->plan < nplans ? (int)k->plan : (int)(h % (uint64_t)nplans);
  c.stream = k->one_stream ? 0 : (int)(h >> 17 & 1);
  c.mode = (h >> 33) % 8 == 0 && k->unfused ? TW_COMBINE_UNFUSED : TW_COMBINE_OVERLAP;
  c.C = 1 + (int)(tw_mix64(h ^ (uint64_t)(rank + 1) * 0x5851f42d4c957f2dull) % (uint64_t)max_c);
  c.rotating = (h >> 40) % 4 == 0 && k->rotate;
  return c;
}

/* Copies the output of the last call (checked already) to host. */
static void tw_soak_output(tw_context_t ctx, int dataflow, void* out, int32_t tokens,
                           cudaStream_t s, uint16_t* host) {
  if (tokens == 0) return;
  void* src = out;
  if (dataflow == TW_DATAFLOW_ADD) CHECK_OK(tw_context_output(ctx, &src));
  if (src == NULL) return;
  CHECK_CUDA(cudaMemcpyAsync(host, src, (size_t)tokens * kHidden * 2, cudaMemcpyDeviceToHost, s));
  CHECK_CUDA(cudaStreamSynchronize(s));
}

/* One call; under the reduce dataflow `poison` first fills the stream's output with NaN. */
static tw_status tw_soak_call(tw_context_t ctx, const tw_soak_plan* sp, tw_device_plan_t dp,
                              const void* w2, void* out, int dataflow, const tw_soak_choice* c,
                              cudaStream_t s, int poison) {
  if (poison && dataflow == TW_DATAFLOW_REDUCE && sp->tokens > 0) {
    const tw_status st = tw__fill_bf16(out, (size_t)sp->tokens * kHidden, 0xFFFF, s);
    if (st != TW_SUCCESS) return st;
  }
  tw_combine_options opt = TW_COMBINE_OPTIONS_INIT;
  opt.mode = c->mode;
  opt.comm_ctas = c->C;
  return tw_moe_combine_ex(ctx, dp, sp->expert_in, w2, dataflow == TW_DATAFLOW_ADD ? NULL : out,
                           &opt, s);
}

/* Relative error of a rank's output against the double-precision reference on sampled tokens
 * (first, last and seeded ones, the same for every output of call i); *where says where it is
 * worst. Returns -1 when the rank has no tokens. */
static double tw_soak_rel_err(const tw_problem* p, const tw_soak_plan* sp, int rank, long i,
                              uint64_t salt_w, const uint16_t* h, char* where, size_t len) {
  const int nt = sp->tokens, samples = nt < kSamples ? nt : kSamples;
  double max_err = 0.0, max_ref = 0.0, worst_got = 0.0, worst_ref = 0.0;
  int worst_t = -1, worst_col = -1;
  where[0] = '\0';
  if (samples == 0) return -1.0;
  double* ref = (double*)malloc(sizeof(double) * kHidden);
  for (int k = 0; k < samples && ref != NULL; k++) {
    const int t = k == 0   ? 0
                  : k == 1 ? nt - 1
                           : (int)(tw_mix64((uint64_t)i * 977 + (uint64_t)k) % (uint64_t)nt);
    tw_reference_token(p, sp->rt, rank, t, sp->salt_h, salt_w, ref);
    for (int col = 0; col < kHidden; col++) {
      const double got = (double)tw_bf2f(h[(size_t)t * kHidden + col]);
      const double e = fabs(got - ref[col]);
      if (!(e <= max_err)) { /* NaN sticks */
        max_err = e;
        worst_t = t;
        worst_col = col;
        worst_got = got;
        worst_ref = ref[col];
      }
      if (fabs(ref[col]) > max_ref) max_ref = fabs(ref[col]);
    }
  }
  free(ref);
  snprintf(where, len, "token %d col %d: %g, reference %g", worst_t, worst_col, worst_got,
           worst_ref);
  return max_ref > 0 ? max_err / max_ref : max_err;
}

/* Of the tokens whose outputs differ between a and b: how many have every row on this rank
 * (their sums read this rank's GEMM output only) and how many receive rows from a peer. */
static void tw_soak_diff_tokens(const tw_soak_plan* sp, int top_k, const uint16_t* a,
                                const uint16_t* b, int* local_only, int* with_remote) {
  *local_only = *with_remote = 0;
  for (int t = 0; t < sp->tokens; t++) {
    if (memcmp(a + (size_t)t * kHidden, b + (size_t)t * kHidden, kHidden * 2) == 0) continue;
    int remote = 0;
    for (int j = 0; j < top_k; j++)
      remote |= sp->plan->slot_row[(size_t)t * top_k + j] < sp->plan->recv_rows;
    if (remote)
      (*with_remote)++;
    else
      (*local_only)++;
  }
}

/* The check after call i: returns this rank's failed checks. With TW_SOAK_RETRY=1 every check
 * makes two more calls of the same plan (unfused, then overlapped), so that a failure says
 * which of the outputs is wrong and whether the wrong one comes back. */
static int tw_soak_verify(tw_rank_env* env, const tw_problem* p, tw_context_t ctx, int dataflow,
                          tw_soak_plan* sp, tw_device_plan_t dp, const void* w2, void* out,
                          const tw_soak_choice* c, cudaStream_t s, uint64_t salt_w, long i,
                          uint16_t* h_a, uint16_t* h_b, uint16_t* h_c, tw_soak_stats* stats) {
  const int before = tw_test_failures_;
  CHECK_OK(tw_context_check(ctx));
  tw_soak_output(ctx, dataflow, out, sp->tokens, s, h_a);
  /* The same plan unfused, same C and stream: the same bits. */
  tw_soak_choice u = *c;
  u.mode = TW_COMBINE_UNFUSED;
  CHECK_OK(tw_soak_call(ctx, sp, dp, w2, out, dataflow, &u, s, 1));
  CHECK_OK(tw_context_check(ctx));
  tw_soak_output(ctx, dataflow, out, sp->tokens, s, h_b);
  stats->calls++;
  const size_t n = (size_t)sp->tokens * kHidden;
  char where[160], wa[120], wb[120], retry[400] = "";
  const double rel = tw_soak_rel_err(p, sp, env->rank, i, salt_w, h_a, wa, sizeof wa);
  const int same = memcmp(h_a, h_b, n * 2) == 0;
  if (tw_soak_knobs_get()->retry) {
    /* Every rank makes the same two calls (each is a collective), whatever its verdict. */
    for (int k = 0; k < 2; k++) {
      tw_soak_choice r = *c;
      r.mode = k == 0 ? TW_COMBINE_UNFUSED : TW_COMBINE_OVERLAP;
      CHECK_OK(tw_soak_call(ctx, sp, dp, w2, out, dataflow, &r, s, 1));
      CHECK_OK(tw_context_check(ctx));
      tw_soak_output(ctx, dataflow, out, sp->tokens, s, h_c);
      stats->calls++;
      char wc[120];
      const double rc = tw_soak_rel_err(p, sp, env->rank, i, salt_w, h_c, wc, sizeof wc);
      const size_t len = strlen(retry);
      snprintf(retry + len, sizeof retry - len,
               "; retry %s: rel err %.2e, %s the first, %s the "
               "second",
               k == 0 ? "unfused" : "overlapped", rc,
               memcmp(h_c, h_a, n * 2) ? "differs from" : "equals",
               memcmp(h_c, h_b, n * 2) ? "differs from" : "equals");
    }
  }
  if (!same) {
    int local_only = 0, with_remote = 0;
    tw_soak_diff_tokens(sp, p->top_k, h_a, h_b, &local_only, &with_remote);
    const double rb = tw_soak_rel_err(p, sp, env->rank, i, salt_w, h_b, wb, sizeof wb);
    tw_soak_first_diff(h_a, h_b, n, where, sizeof where);
    CHECKF(0,
           "rank %d call %ld (%s, C %d, %s, stream %d%s): the output differs from the unfused "
           "call's%s; differing tokens: %d with local rows only, %d with rows from peers; "
           "reference: first %.2e (%s), unfused %.2e (%s)%s",
           env->rank, i, sp->name, c->C, c->mode == TW_COMBINE_UNFUSED ? "unfused" : "overlapped",
           c->stream, c->rotating ? ", rotating device plan" : "", where, local_only, with_remote,
           rel, wa, rb, wb, retry);
  } else if (retry[0] != '\0' && strstr(retry, "differs") != NULL) {
    CHECKF(0, "rank %d call %ld (%s, C %d): a retry differs%s", env->rank, i, sp->name, c->C,
           retry);
  }
  if (sp->golden == NULL) {
    sp->golden = (uint16_t*)malloc(n * 2 + 2);
    if (sp->golden != NULL) memcpy(sp->golden, h_a, n * 2);
  } else {
    CHECKF(memcmp(sp->golden, h_a, n * 2) == 0,
           "rank %d call %ld (%s, C %d): the output differs from this plan's first checked one "
           "(check %d of the plan)",
           env->rank, i, sp->name, c->C, sp->checks);
  }
  sp->checks++;
  long nan_seen = 0;
  for (size_t e = 0; e < n; e++) nan_seen += isnan(tw_bf2f(h_a[e])) != 0;
  CHECKF(nan_seen == 0, "rank %d call %ld (%s): %ld output elements never written", env->rank, i,
         sp->name, nan_seen);
  if (rel >= 0) {
    CHECKF(rel < 8e-3,
           "rank %d call %ld (%s, C %d): relative error %.3e against the reference (%s)", env->rank,
           i, sp->name, c->C, rel, wa);
    if (!(rel <= stats->max_rel)) stats->max_rel = rel;
  }
  stats->checks++;
  stats->compared_tokens += sp->tokens < kSamples ? sp->tokens : kSamples;
  return tw_test_failures_ - before;
}

/* The soak of one dataflow on a context of its own. */
static void tw_soak_dataflow(tw_rank_env* env, int dataflow, tw_soak_stats* stats) {
  memset(stats, 0, sizeof *stats);
  const tw_problem p = tw_rank_problem(env, kHidden, kFfn, kExperts, kTopK, kMaxTokens);
  const char* df = dataflow == TW_DATAFLOW_ADD ? "add" : "reduce";
  tw_context_config cc = TW_CONTEXT_CONFIG_INIT;
  cc.dataflow = dataflow;
  tw_context_t ctx = NULL;
  CHECK_OK(tw_rank_context_create(env, &p, &cc, &ctx));
  if (ctx == NULL) return;
  tw_context_info info;
  CHECK_OK(tw_context_info_get(ctx, &info));
  const int max_c = info.max_comm_ctas;
  cudaStream_t streams[2] = {env->stream, NULL};
  CHECK_CUDA(cudaStreamCreateWithFlags(&streams[1], cudaStreamNonBlocking));
  /* Weights, and one output per stream (reduce): a stream's calls are the only writers of its
   * output, so poisoning it in that stream's order races with nothing. */
  const int E = p.experts / p.world_size;
  const size_t w2_n = (size_t)E * p.hidden * p.ffn, out_n = (size_t)p.max_tokens * p.hidden;
  const uint64_t salt_w = 4000 + (uint64_t)dataflow;
  void* w2 = NULL;
  void* outs[2] = {NULL, NULL};
  CHECK_CUDA(cudaMalloc(&w2, w2_n * 2));
  {
    uint16_t* h = (uint16_t*)malloc(w2_n * 2);
    tw_fill_w2(&p, env->rank, salt_w, h);
    CHECK_CUDA(cudaMemcpy(w2, h, w2_n * 2, cudaMemcpyHostToDevice));
    free(h);
  }
  if (dataflow == TW_DATAFLOW_REDUCE)
    for (int k = 0; k < 2; k++) CHECK_CUDA(cudaMalloc(&outs[k], out_n * 2 + 16));
  uint16_t* h_a = (uint16_t*)malloc(out_n * 2 + 16);
  uint16_t* h_b = (uint16_t*)malloc(out_n * 2 + 16);
  uint16_t* h_c = (uint16_t*)malloc(out_n * 2 + 16);
  tw_soak_plan sp[kMaxPlans];
  const int nplans = tw_soak_setup(env, &p, ctx, dataflow, sp);
  CHECK(nplans >= 10);
  /* The rotating device plan: uploaded again every kRotateEvery calls with another plan, with no
   * host synchronisation, on the stream of the last call (every earlier call has ended before that
   * one started: the context orders calls), and the other stream made to wait for the upload
   * (tw_device_plan_upload: calls on another stream must be ordered after it by the caller). */
  tw_device_plan_t rot = NULL;
  int rot_plan = 0, last_stream = 0;
  cudaEvent_t ev_upload = NULL;
  CHECK_OK(tw_device_plan_create(ctx, &rot));
  CHECK_CUDA(cudaEventCreateWithFlags(&ev_upload, cudaEventDisableTiming));
  if (rot != NULL && nplans > 0) {
    CHECK_OK(tw_device_plan_upload(rot, sp[0].plan, sp[0].rt, env->stream));
    CHECK_CUDA(cudaStreamSynchronize(env->stream));
  }
  const long calls = tw_soak_calls();
  const int check_every = tw_soak_check_every();
  const long progress_every = calls / 20 > 500 ? calls / 20 : 500;
  int go = nplans > 0 && streams[1] != NULL && w2 != NULL && h_a != NULL && h_b != NULL &&
           h_c != NULL && rot != NULL && ev_upload != NULL &&
           (dataflow == TW_DATAFLOW_ADD || (outs[0] != NULL && outs[1] != NULL));
  /* Every rank must start together (the verdict is collective). */
  go = tw_rank_sum(env, go ? 0 : 1) == 0;
  const double t0 = tw__now_seconds();
  int halted = 0; /* a call failed here: no more launches until the next check */
  for (long i = 0; go && i < calls; i++) {
    tw_soak_choice c = tw_soak_choose(i, nplans, env->rank, max_c);
    const int check = (i + 1) % check_every == 0 || i + 1 == calls;
    if (!halted && i % kRotateEvery == kRotateEvery - 1 && tw_soak_knobs_get()->rotate) {
      const int k = (int)(tw_mix64((uint64_t)i * 31 + 17) % (uint64_t)nplans);
      cudaStream_t up = streams[last_stream];
      CHECK_OK(tw_device_plan_upload(rot, sp[k].plan, sp[k].rt, up));
      CHECK_CUDA(cudaEventRecord(ev_upload, up));
      CHECK_CUDA(cudaStreamWaitEvent(streams[1 - last_stream], ev_upload, 0));
      rot_plan = k;
      stats->rotations++;
    }
    if (c.rotating) c.plan = rot_plan; /* the same on every rank */
    tw_device_plan_t dp = c.rotating ? rot : sp[c.plan].dp;
    cudaStream_t s = streams[c.stream];
    if (!halted) {
      const tw_status st =
          tw_soak_call(ctx, &sp[c.plan], dp, w2, outs[c.stream], dataflow, &c, s, check);
      CHECKF(st == TW_SUCCESS, "rank %d call %ld (%s%s, C %d): %s (%s)", env->rank, i,
             sp[c.plan].name, c.rotating ? ", rotating device plan" : "", c.C, tw_status_string(st),
             tw_last_error());
      halted = st != TW_SUCCESS;
      stats->calls++;
      stats->rotating_calls += c.rotating;
      last_stream = c.stream;
    }
    if (check) {
      int bad = halted;
      if (!halted) {
        bad = tw_soak_verify(env, &p, ctx, dataflow, &sp[c.plan], dp, w2, outs[c.stream], &c, s,
                             salt_w, i, h_a, h_b, h_c, stats) != 0;
      } else { /* the same collectives as a verifying rank: two checks (four with retries) */
        for (int k = 0; k < (tw_soak_knobs_get()->retry ? 4 : 2); k++)
          CHECK(tw_context_check(ctx) == TW_SUCCESS);
      }
      if (bad) /* what came before (the choices are a pure function of the call index) */
        for (long j = i - 1; j >= 0 && j >= i - 3; j--) {
          const tw_soak_choice q = tw_soak_choose(j, nplans, env->rank, max_c);
          fprintf(stderr, "  rank %d call %ld before it: plan %d%s, stream %d, %s, C %d\n",
                  env->rank, j, q.plan, q.rotating ? " (rotating: its plan then)" : "", q.stream,
                  q.mode == TW_COMBINE_UNFUSED ? "unfused" : "overlapped", q.C);
        }
      /* Go on only if every rank is fine. */
      go = tw_rank_sum(env, bad) == 0;
    }
    if (env->rank == 0 && (i + 1) % progress_every == 0 && i + 1 < calls) {
      const double el = tw__now_seconds() - t0;
      fprintf(stderr, "soak %s: %ld / %ld calls, %ld checks, %.1f s, ETA %.1f s\n", df, i + 1,
              calls, stats->checks, el, el / (double)(i + 1) * (double)(calls - i - 1));
    }
  }
  CHECK_OK(tw_context_check(ctx));
  stats->wall_s = tw__now_seconds() - t0;
  if (env->rank == 0)
    printf(
        "soak %s: W %d, %d plans, %ld calls, %ld checks (%ld tokens against the reference, max "
        "rel err %.2e), %.2f s, %.0f calls/s\n",
        df, env->nranks, nplans, stats->calls, stats->checks, stats->compared_tokens,
        stats->max_rel, stats->wall_s,
        stats->wall_s > 0 ? (double)stats->calls / stats->wall_s : 0.0);
  if (env->rank == 0)
    printf("  rotating device plan: %ld uploads between calls, %ld calls\n", stats->rotations,
           stats->rotating_calls);
  for (int k = 0; k < nplans && env->rank == 0; k++)
    printf("  plan %2d %-26s tokens %4d rows %5d checks %d\n", k, sp[k].name, sp[k].tokens,
           sp[k].plan->rows, sp[k].checks);
  fflush(stdout);
  CHECK_OK(tw_device_plan_destroy(rot));
  if (ev_upload != NULL) cudaEventDestroy(ev_upload);
  tw_soak_teardown(sp, nplans);
  free(h_a);
  free(h_b);
  free(h_c);
  cudaFree(w2);
  cudaFree(outs[0]);
  cudaFree(outs[1]);
  if (streams[1] != NULL) {
    CHECK_CUDA(cudaStreamSynchronize(streams[1]));
    cudaStreamDestroy(streams[1]);
  }
  CHECK_OK(tw_context_destroy(ctx));
}

static void test_soak(tw_rank_env* env) {
  tw_soak_stats r, a;
  tw_soak_dataflow(env, TW_DATAFLOW_REDUCE, &r);
  tw_soak_dataflow(env, TW_DATAFLOW_ADD, &a);
  const long calls = r.calls + a.calls;
  const double wall = r.wall_s + a.wall_s;
  if (env->rank == 0)
    printf(
        "soak total: W %d, %ld calls, %ld checks, %.2f s, %.0f calls/s (TW_SOAK_CALLS=%d per "
        "dataflow)\n",
        env->nranks, calls, r.checks + a.checks, wall, wall > 0 ? (double)calls / wall : 0.0,
        tw_soak_calls());
}

static const tw_rank_case kCases[] = {
    {"soak", test_soak},
};

int main(int argc, char** argv) {
  (void)tw_soak_knobs_get(); /* read once, before the in-process ranks' threads */
  return tw_rank_test_main(argc, argv, kCases, (int)(sizeof kCases / sizeof kCases[0]), 3600);
}
