/*
 * test_seq_layout.c: the sequential layer's all-to-all offsets (harness/seq_layout.c) on every
 * rank of random routings, without a GPU: a host simulation moves slot ids instead of rows
 * through the send buffers (stable sort by expert), the dispatch copies, the (source, expert)
 * GEMM groups and the copies back, exactly as harness/seq_layer.cu does, and checks that
 *  - every receive row is written exactly once, in the order the benchmark's row check expects
 *    (source-major, then local expert, then the source's token order);
 *  - the groups cover the receive rows once, each with rows of its expert only;
 *  - after the return copies, every source finds slot i's row at ret[pos[i]];
 *  - a count sum that misses slots and a receive side over capacity are refused.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "seq_layout.h"
#include "tilewave.h"
#include "tw_test.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t next(void) {
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return (uint32_t)(rng >> 11);
}

/* A slot id: (rank, slot index) in one int64. */
#define SLOT(s, i) (((int64_t)(s) << 32) | (int64_t)(i))

static void run_case(int W, int E, int K, int skew) {
  const int ET = W * E;
  int32_t tokens[8];
  int32_t* ids[8];
  int64_t *send[8], *pos[8], *recv[8], *ret[8];
  int64_t* o_mem[8];
  int32_t* g_mem[8];
  tw__seq_offsets o[8];
  int32_t* counts = (int32_t*)calloc((size_t)W * ET, sizeof(int32_t));
  for (int s = 0; s < W; s++) {
    tokens[s] = (int32_t)(next() % 60);
    const int n = tokens[s] * K;
    ids[s] = (int32_t*)malloc(sizeof(int32_t) * (size_t)n + 4);
    for (int t = 0; t < tokens[s]; t++)
      for (int j = 0; j < K; j++) {
        int32_t g;
        int dup;
        do { /* distinct within a token; skewed: mostly the low experts */
          g = (int32_t)(skew && next() % 2 ? next() % (K < ET ? K : ET) : next() % ET);
          dup = 0;
          for (int q = 0; q < j; q++) dup |= ids[s][t * K + q] == g;
        } while (dup);
        ids[s][t * K + j] = g;
        counts[(size_t)s * ET + g]++;
      }
    /* Stable counting sort by expert: send[p] = slot, pos[slot] = p. */
    send[s] = (int64_t*)malloc(sizeof(int64_t) * (size_t)n + 8);
    pos[s] = (int64_t*)malloc(sizeof(int64_t) * (size_t)n + 8);
    int p = 0;
    for (int g = 0; g < ET; g++)
      for (int i = 0; i < n; i++)
        if (ids[s][i] == g) send[s][p] = SLOT(s, i), pos[s][i] = p, p++;
    o_mem[s] = (int64_t*)calloc(6 * (size_t)W + (size_t)ET, sizeof(int64_t));
    g_mem[s] = (int32_t*)calloc(2 * (size_t)ET, sizeof(int32_t));
    o[s].send_off = o_mem[s], o[s].send_rows = o_mem[s] + W, o[s].recv_off = o_mem[s] + 2 * W;
    o[s].recv_from = o_mem[s] + 3 * W, o[s].at_dest = o_mem[s] + 4 * W;
    o[s].at_src = o_mem[s] + 5 * W, o[s].g_row0 = o_mem[s] + 6 * W;
    o[s].g_e = g_mem[s], o[s].g_m = g_mem[s] + ET;
  }
  int64_t tmax = 0;
  for (int s = 0; s < W; s++) tmax = tokens[s] > tmax ? tokens[s] : tmax;
  const int64_t recv_max = W == 1 ? tmax * K : (int64_t)W * tmax * (K < E ? K : E);
  for (int me = 0; me < W; me++) {
    CHECK_OK(tw__seq_offsets_compute(W, E, me, counts, (int64_t)tokens[me] * K, recv_max, &o[me]));
    recv[me] = (int64_t*)malloc(sizeof(int64_t) * (size_t)o[me].recv_rows + 8);
    for (int64_t r = 0; r < o[me].recv_rows; r++) recv[me][r] = -1;
  }
  /* The dispatch copies: source s's block for d into d's receive buffer. */
  for (int s = 0; s < W; s++)
    for (int d = 0; d < W; d++)
      for (int64_t r = 0; r < o[s].send_rows[d]; r++) {
        const int64_t at = o[s].at_dest[d] + r;
        CHECKF(at >= 0 && at < o[d].recv_rows && recv[d][at] == -1,
               "W %d E %d K %d: rank %d's row %lld lands on row %lld of rank %d twice or outside",
               W, E, K, s, (long long)r, (long long)at, d);
        if (at >= 0 && at < o[d].recv_rows) recv[d][at] = send[s][o[s].send_off[d] + r];
      }
  for (int d = 0; d < W; d++) {
    /* The order the benchmark expects: source-major, local expert, token order. */
    int64_t r = 0;
    for (int s = 0; s < W; s++) {
      CHECK(o[d].recv_off[s] == r);
      for (int e = 0; e < E; e++)
        for (int i = 0; i < tokens[s] * K; i++)
          if (ids[s][i] == d * E + e) {
            CHECKF(r < o[d].recv_rows && recv[d][r] == SLOT(s, i),
                   "W %d E %d K %d: rank %d's receive row %lld", W, E, K, d, (long long)r);
            r++;
          }
    }
    CHECK(r == o[d].recv_rows);
    /* The groups: in receive order, back to back, one expert each. */
    int64_t next_row = 0;
    for (int q = 0; q < o[d].ngroups; q++) {
      CHECK(o[d].g_row0[q] == next_row && o[d].g_m[q] > 0);
      for (int64_t rr = o[d].g_row0[q]; rr < o[d].g_row0[q] + o[d].g_m[q]; rr++) {
        const int64_t slot = recv[d][rr];
        const int s = (int)(slot >> 32), i = (int)(slot & 0xffffffff);
        CHECK(ids[s][i] == d * E + o[d].g_e[q]);
      }
      next_row += o[d].g_m[q];
    }
    CHECK(next_row == o[d].recv_rows);
  }
  /* GEMM2's rows carry their slot; the copies back: d's block from s into s's ret. */
  for (int s = 0; s < W; s++) {
    ret[s] = (int64_t*)malloc(sizeof(int64_t) * (size_t)tokens[s] * K + 8);
    for (int i = 0; i < tokens[s] * K; i++) ret[s][i] = -1;
  }
  for (int d = 0; d < W; d++)
    for (int s = 0; s < W; s++)
      for (int64_t r = 0; r < o[d].recv_from[s]; r++) {
        const int64_t at = o[d].at_src[s] + r;
        CHECK(at >= 0 && at < (int64_t)tokens[s] * K && ret[s][at] == -1);
        if (at >= 0 && at < (int64_t)tokens[s] * K) ret[s][at] = recv[d][o[d].recv_off[s] + r];
      }
  for (int s = 0; s < W; s++)
    for (int i = 0; i < tokens[s] * K; i++)
      CHECKF(ret[s][pos[s][i]] == SLOT(s, i), "W %d E %d K %d: rank %d slot %d comes back wrong", W,
             E, K, s, i);
  /* Refusals (once per world size: each logs a warning): a slot not counted, a receive side
   * over capacity. */
  static int refused[9];
  if (tokens[0] > 0 && !refused[W]++) {
    CHECK(tw__seq_offsets_compute(W, E, 0, counts, (int64_t)tokens[0] * K + 1, recv_max, &o[0]) ==
          TW_ERR_EXPERT_ID);
    if (o[0].recv_rows > 0)
      CHECK(tw__seq_offsets_compute(W, E, 0, counts, (int64_t)tokens[0] * K, o[0].recv_rows - 1,
                                    &o[0]) == TW_ERR_CAPACITY);
  }
  for (int s = 0; s < W; s++) {
    free(ids[s]), free(send[s]), free(pos[s]), free(recv[s]), free(ret[s]);
    free(o_mem[s]), free(g_mem[s]);
  }
  free(counts);
}

static void test_offsets_random(void) {
  for (int W = 1; W <= 4; W++)
    for (int E = 1; E <= 5; E += 2)
      for (int K = 1; K <= 4 && K <= W * E; K++)
        for (int rep = 0; rep < 6; rep++) run_case(W, E, K, rep % 2);
}

TW_TEST_MAIN(TW_TEST(test_offsets_random))
