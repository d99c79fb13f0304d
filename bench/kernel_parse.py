"""Time to build (parse and check) a portable Kernel, first build and cached rebuild.

    PYTHONPATH=$PWD python bench/kernel_parse.py [--against DIR]

Builds four typical kernels (saxpy, a matmul with a loop, integer control flow, math
functions) with ``Kernel(...)`` and prints the median time of a first build (the per-process
parse cache cleared before each) and of a rebuild of the same kernel (served from the cache).
``--against DIR`` runs the same measurement with another checkout of aiotinyrt on PYTHONPATH
(e.g. an older version) and prints both side by side. Rendering (``dev.program(kernel)``)
does not parse: it prints the tree the build checked.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from aiotinyrt import BufferParam, IntParam, Kernel, dtypes

MATMUL = """
// c[M, N] = a[M, K] @ b[K, N]; gidx1 is the row, gidx0 the column, gsz0 = N
float32 acc = 0.0f;
for (int k = 0; k < K; k++) {
  acc += a[gidx1 * K + k] * b[k * gsz0 + gidx0];
}
c[gidx1 * gsz0 + gidx0] = acc;
"""
INTEGER = """
int32 v = a[gidx0];
int64 acc = 0;
if (v % 3 == 0) { acc = v * 4294967296ll; } else if (v < 0) { acc = -v; } else { acc = v >> 1; }
acc += min(v, 5) + max(v, -5) * 2 + abs(v - 10);
acc ^= (v & 0xF0) | (v << 2);
acc += v > 3 && v <= 20 ? 1000 : -1000;
o[gidx0] = acc;
"""
MATH = """
float v = x[gidx0];
int base = gidx0 * 4;
o[base + 0] = sqrt(fabs(v)) + exp(v / 4.0f);
o[base + 1] = sin(v) + cos(v) + tanh(v);
o[base + 2] = pow(fabs(v), 1.5f) + exp2(v / 8.0f) + log2(fabs(v) + 2.0f);
o[base + 3] = fmin(v, 0.5f) + fmax(v, -0.5f) + (float)(int)v;
"""
F32 = dtypes.float32
KERNELS = {
    "saxpy": (
        [BufferParam("out", F32, "w"), BufferParam("x", F32), BufferParam("y", F32), IntParam("a")],
        "out[gidx0] = a * x[gidx0] + y[gidx0];",
    ),
    "matmul": (
        [BufferParam("c", F32, "w"), BufferParam("a", F32), BufferParam("b", F32), IntParam("K")],
        MATMUL,
    ),
    "integer_ops": ([BufferParam("o", dtypes.int64, "w"), BufferParam("a", dtypes.int32)], INTEGER),
    "math_funcs": ([BufferParam("o", F32, "w"), BufferParam("x", F32)], MATH),
}


def _clear_cache() -> None:
    parser = sys.modules.get("aiotinyrt.kernel.parser")
    if parser is not None:
        parser.parse_body.cache_clear()  # type: ignore[attr-defined]


def measure(repeats: int) -> dict[str, tuple[float, float]]:
    """{kernel: (first build µs, cached rebuild µs)}, medians of ``repeats``."""
    results = {}
    for name, (params, body) in KERNELS.items():
        first, again = [], []
        for _ in range(repeats):
            _clear_cache()
            t0 = time.perf_counter()
            Kernel(name, params, body)
            t1 = time.perf_counter()
            Kernel(name, params, body)
            t2 = time.perf_counter()
            first.append((t1 - t0) * 1e6)
            again.append((t2 - t1) * 1e6)
        results[name] = (statistics.median(first), statistics.median(again))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", help="another aiotinyrt checkout to measure side by side")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    mine = measure(args.repeats)
    if args.json:
        print(json.dumps(mine))
        return
    other: dict[str, list[float]] = {}
    if args.against:
        env = {**os.environ, "PYTHONPATH": os.path.abspath(args.against)}
        argv = [sys.executable, os.path.abspath(__file__), "--json", "--repeats", str(args.repeats)]
        out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, cwd=args.against)
        other = json.loads(out.stdout)
    head = f"{'kernel':<12} {'body chars':>10} {'build µs':>10} {'cached µs':>10}"
    if other:
        head += f" {'other build µs':>15} {'other cached µs':>16}"
    print(head)
    for name, (first, again) in mine.items():
        line = f"{name:<12} {len(KERNELS[name][1]):>10} {first:>10.1f} {again:>10.1f}"
        if other:
            line += f" {other[name][0]:>15.1f} {other[name][1]:>16.1f}"
        print(line)


if __name__ == "__main__":
    main()
