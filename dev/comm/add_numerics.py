#!/usr/bin/env python3
"""The rounding of the two combine dataflows for top-2, against the exact weighted sum (CPU).

reduce: what tilewave does today. The producer rounds each row to bf16, the owner's reduction
        sums w1 * row1 + w2 * row2 in fp32 and rounds once: bf16(w1 bf16(a1) + w2 bf16(a2)).
add:    the dataflow of dev/NOTES.md section 19. The epilogue rounds each weighted row, the L2
        adds the two rows into a zeroed output (cp.reduce.async.bulk .add.noftz.bf16 rounds its
        sum once, bit for bit as checked by dev/comm/reduce_add_lab.cu):
        bf16(bf16(w1 a1) + bf16(w2 a2)); 0 + x is exact, so the order the rows land in does not
        matter.
Random fp32 accumulators (normal, sd 3) and Dirichlet(1, 1) gate weights; prints each path's
error and whether the add path depends on the order.

    python3 dev/comm/add_numerics.py [elements]
"""
import sys

import numpy as np


def bf16(x):
    """Rounds fp32 to bf16 (nearest even), kept as fp32; inputs are finite."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32)


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4_000_000
    rng = np.random.default_rng(1)
    acc = rng.standard_normal((2, n)).astype(np.float32) * 3
    w = rng.dirichlet([1, 1], n).T.astype(np.float32)
    exact = w[0].astype(np.float64) * acc[0] + w[1].astype(np.float64) * acc[1]
    paths = {
        "reduce: bf16(w1 bf16(a1) + w2 bf16(a2))":
            bf16(np.float32(w[0] * bf16(acc[0])) + np.float32(w[1] * bf16(acc[1]))),
        "add: bf16(bf16(w1 a1) + bf16(w2 a2))": bf16(bf16(w[0] * acc[0]) + bf16(w[1] * acc[1])),
    }
    scale = np.abs(acc).max(axis=0)
    for name, v in paths.items():
        err = np.abs(v.astype(np.float64) - exact)
        rel = err / np.maximum(np.abs(exact), 1e-3)
        print("%-42s |err| / |exact|: median %.2e, p99 %.2e; |err| / max |a|: p99 %.2e, max %.2e"
              % (name, np.median(rel), np.quantile(rel, 0.99), np.quantile(err / scale, 0.99),
                 (err / scale).max()))
    add = list(paths.values())[1]
    swapped = bf16(bf16(w[1] * acc[1]) + bf16(w[0] * acc[0]))
    print("add path independent of the order: %s" % np.array_equal(add.view(np.uint32),
                                                                  swapped.view(np.uint32)))
    print("elements where the paths differ: %.1f%%" % (100 * (add != paths[list(paths)[0]]).mean()))


if __name__ == "__main__":
    main()
