"""Run one benchmark script of bench/ on two checkouts, alternating, and print one table.

    python bench/before_after.py --rounds 3 BEFORE_DIR AFTER_DIR bench/launch.py -- --quick
    python bench/before_after.py ../old . bench/pipeline.py -- --quick --loop trio

Each checkout runs its own copy of the script with its own package first on ``PYTHONPATH``
(``git worktree add ../old <commit>`` makes one). Rounds alternate before/after so a noisy phase
of the machine hits both alike. Every numeric cell of the scripts' markdown tables is collected
per (row, column); the table shows the median over rounds of each side and after ÷ before. Rows
whose cells are not numbers (references, PASS/MISS) are left out.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

_NUMBER = re.compile(r"^\s*(-?\d+(?:\.\d+)?)")


def run(tree: Path, script: str, args: list[str]) -> str:
    """The script's stdout, run from ``tree`` with that tree's package."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    result = subprocess.run(
        [sys.executable, str(tree / script), *args],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"{tree}: {script} failed:\n{result.stderr[-3000:]}")
    return result.stdout


def cells(table: str) -> dict[tuple[str, str], float]:
    """``(row, column) -> value`` of every numeric cell of the markdown tables in ``table``."""
    out: dict[tuple[str, str], float] = {}
    header: list[str] = []
    for line in table.splitlines():
        if not line.startswith("|"):
            header = []
            continue
        parts = [p.strip() for p in line.strip().strip("|").split("|")]
        if not header:
            header = parts
            continue
        if set(parts[0]) <= set("-: "):
            continue
        row = parts[0]
        for name, cell in zip(header[1:], parts[1:], strict=False):
            match = _NUMBER.match(cell)
            if match and name not in ("target",):
                out[(row, name)] = float(match.group(1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("script", help="path of the benchmark inside each checkout, e.g. bench/launch.py")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side, alternating (default 3)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="after --: arguments for the script")
    opts = parser.parse_args()
    args = opts.args[1:] if opts.args[:1] == ["--"] else opts.args
    values: dict[str, dict[tuple[str, str], list[float]]] = {
        "before": defaultdict(list),
        "after": defaultdict(list),
    }
    order: list[tuple[str, str]] = []
    for r in range(opts.rounds):
        for side, tree in (("before", opts.before), ("after", opts.after)):
            print(f"round {r + 1}/{opts.rounds}: {side} ({tree})", file=sys.stderr)
            for key, value in cells(run(tree.resolve(), opts.script, args)).items():
                values[side][key].append(value)
                if key not in order:
                    order.append(key)
    print(f"| {opts.script} {' '.join(args)} | column | before | after | after ÷ before |")
    print("|---|---|---|---|---|")
    for key in order:
        before, after = values["before"].get(key), values["after"].get(key)
        if not before or not after:
            continue
        b, a = statistics.median(before), statistics.median(after)
        ratio = f"{a / b:.2f}" if b else "—"
        print(f"| {key[0]} | {key[1]} | {b:g} | {a:g} | {ratio} |")
    print(
        f"\nMedians of {opts.rounds} runs per side, alternating. before: {opts.before}, after: {opts.after}."
    )


if __name__ == "__main__":
    main()
