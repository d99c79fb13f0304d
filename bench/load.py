"""The reliability load at full size: 200 concurrent tasks x 500 launches, each task a dependency
chain alternating between CPU and CPU:1, 10 % of the waits cancelled at random; on asyncio, uvloop
and trio, each in a fresh process so its peak RSS is its own.

    python bench/load.py                       # full size, every loop
    python bench/load.py --tasks 50 --launches 100 --loops trio

The workload and its checks (results right, no memory, signal, waiter or command retained) are
``tests/test_load.py::run_load``, which the test suite runs at a smaller size. Prints one markdown
table: launches, waits, cancelled waits, seconds, launches per second, peak and growth of RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOOPS = {"asyncio": ("asyncio", {}), "uvloop": ("asyncio", {"use_uvloop": True}), "trio": ("trio", {})}


def one(loop: str, tasks: int, launches: int, seed: int) -> None:
    """Child process: run the load once on ``loop`` and print its report as JSON."""
    sys.path.insert(0, str(ROOT))
    import anyio

    from tests.test_load import run_load

    backend, options = LOOPS[loop]
    report = anyio.run(run_load, tasks, launches, 5, 0.1, seed, backend=backend, backend_options=options)
    print(json.dumps(asdict(report)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--launches", type=int, default=500, help="launches per task")
    parser.add_argument("--loops", default="asyncio,uvloop,trio")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one(args.one, args.tasks, args.launches, args.seed)
        return
    env = {**os.environ}
    env.setdefault("CACHEDB", os.path.join(tempfile.mkdtemp(prefix="aiotinyrt-load-"), "cache.db"))
    print(f"{args.tasks} tasks x {args.launches} launches, CPU <-> CPU:1 chains, 10 % of waits cancelled\n")
    print(
        "| loop | launches | waits | cancel armed | cancelled | seconds | launches/s "
        "| peak RSS MiB | RSS growth MiB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    failed = False
    for loop in args.loops.split(","):
        result = subprocess.run(
            [sys.executable, __file__, "--one", loop, "--tasks", str(args.tasks),
             "--launches", str(args.launches), "--seed", str(args.seed)],
            capture_output=True, text=True, env=env, cwd=ROOT, check=False,
        )  # fmt: skip
        if result.returncode != 0:
            failed = True
            print(f"| {loop} | FAILED: {result.stderr.strip().splitlines()[-1:]} |||||||")
            continue
        r = json.loads(result.stdout.strip().splitlines()[-1])
        print(
            f"| {loop} | {r['launches']} | {r['waits']} | {r['armed_waits']} | {r['cancelled_waits']} "
            f"| {r['seconds']:.2f} | {r['launches'] / r['seconds']:.0f} | {r['peak_rss_mib']:.1f} "
            f"| {r['rss_growth_mib']:.1f} |"
        )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
