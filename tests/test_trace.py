"""PROFILE traces as a user meets them: a program run with ``PROFILE`` set writes a Chrome-trace
JSON at exit and says where; the file holds every command on its queue's track, dependencies as
flows, memory as a counter; ``python -m aiotinyrt trace`` summarizes and draws it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

# Kernels on two devices, copies in and out, a transfer a kernel waits for, a graph replay
# spanning both devices (its join waits for the other device), everything freed at the end.
WORKLOAD = """
import anyio
import numpy as np
from aiotinyrt import Buffer, Device, dtypes

SRC = "void scale(float* out, const float* x, int n) { for (int i = 0; i < n; i++) out[i] = 2 * x[i]; }"
N = 1 << 18  # 1 MiB: copies go through the copy queue

async def main() -> None:
    cpu, cpu1 = Device["CPU"], Device["CPU:1"]
    p0, p1 = await cpu.program("scale", SRC), await cpu1.program("scale", SRC)
    async with (
        Buffer("CPU", N, dtypes.float32) as x, Buffer("CPU", N, dtypes.float32) as h,
        Buffer("CPU:1", N, dtypes.float32) as h1, Buffer("CPU:1", N, dtypes.float32) as y,
        Buffer("CPU", N, dtypes.float32) as z,
    ):
        await x.copyin(np.ones(N, dtype=np.float32))
        for _ in range(3):
            p0(h, x, vals=(N,))
            await h1.copy_from(h)  # enqueued after the kernel it reads: a dependency across queues
            p1(y, h1, vals=(N,))
        async with cpu.capture() as graph:
            p0(h, x, vals=(N,))
            await h1.copy_from(h)
            p1(y, h1, vals=(N,))
            p0(z, x, vals=(N,))  # last, waiting for nothing on CPU:1: the replay ends with a join
        await graph.replay()
        await graph.replay()
        assert (await y.numpy() == 4).all()

anyio.run(main)
"""


def run_workload(tmp_path: Path, profile: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "workload.py"
    script.write_text(WORKLOAD)
    env = dict(os.environ, PROFILE=profile)
    return subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
        cwd=tmp_path,
    )


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str], Any]:
    tmp = tmp_path_factory.mktemp("trace")
    path = tmp / "out" / "trace.json"
    path.parent.mkdir()
    result = run_workload(tmp, str(path))
    assert result.returncode == 0, result.stderr
    return path, result, json.loads(path.read_text())


def test_profile_says_where_it_wrote_the_trace_in_one_line(traced: Any) -> None:
    path, result, _ = traced
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("aiotinyrt: wrote a trace of ") and f" to {path} " in lines[0], lines[0]


def tracks(events: list[dict[str, Any]]) -> dict[tuple[int, int], str]:
    procs = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    return {
        (e["pid"], e["tid"]): f"{procs[e['pid']]}/{e['args']['name']}"
        for e in events
        if e["ph"] == "M" and e["name"] == "thread_name"
    }


def test_every_command_kind_is_on_its_queues_track(traced: Any) -> None:
    _, _, data = traced
    events = data["traceEvents"]
    names = tracks(events)
    assert set(names.values()) == {"CPU/compute", "CPU/copy", "CPU:1/compute", "CPU:1/copy"}
    by_kind: dict[str, set[str]] = defaultdict(set)
    for e in events:
        if e["ph"] == "X":
            assert {"name", "cat", "ts", "dur", "pid", "tid", "args"} <= set(e), e
            assert e["dur"] > 0, e
            by_kind[e["cat"]].add(names[(e["pid"], e["tid"])])
    assert by_kind["kernel"] == {"CPU/compute", "CPU:1/compute"}
    assert by_kind["copy"] <= {"CPU/copy", "CPU:1/copy"} and by_kind["copy"]
    assert by_kind["transfer"] == {"CPU:1/copy"}  # the destination's copy queue
    assert by_kind["graph"] and by_kind["wait"], dict(by_kind)
    kernels = [e for e in events if e["ph"] == "X" and e["cat"] == "kernel"]
    assert {e["name"] for e in kernels} == {"scale"}
    assert all(e["args"]["bytes"] == 1 << 20 for e in events if e["ph"] == "X" and e["cat"] == "transfer")


def test_dependencies_are_paired_flows_inside_slices(traced: Any) -> None:
    _, _, data = traced
    events = data["traceEvents"]
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    finishes = {e["id"]: e for e in events if e["ph"] == "f"}
    assert starts and set(starts) == set(finishes)
    assert len(starts) == sum(e["ph"] == "s" for e in events)  # ids are unique
    slices: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            slices[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))

    def inside(e: dict[str, Any]) -> bool:
        return any(a <= e["ts"] <= b for a, b in slices[(e["pid"], e["tid"])])

    crossing = 0
    for k, s in starts.items():
        f = finishes[k]
        assert s["ts"] <= f["ts"], (s, f)
        assert f.get("bp") == "e" and inside(s) and inside(f), (s, f)
        crossing += (s["pid"], s["tid"]) != (f["pid"], f["tid"])
    assert crossing > 0  # some dependency crosses queues (the transfer after the kernel)


def test_timestamps_are_monotonic_and_slices_of_a_track_do_not_overlap(traced: Any) -> None:
    _, _, data = traced
    events = [e for e in data["traceEvents"] if e["ph"] != "M"]
    stamps = [e["ts"] for e in events]
    assert stamps == sorted(stamps) and stamps[0] >= 0
    last_end: dict[tuple[int, int], float] = {}
    for e in events:
        if e["ph"] == "X":
            key = (e["pid"], e["tid"])
            assert e["ts"] >= last_end.get(key, 0.0) - 1e-3, e
            last_end[key] = e["ts"] + e["dur"]


def test_allocator_memory_is_a_counter_track_per_device(traced: Any) -> None:
    _, _, data = traced
    events = data["traceEvents"]
    counters: dict[int, list[int]] = defaultdict(list)
    for e in events:
        if e["ph"] == "C":
            assert e["name"] == "memory in use"
            counters[e["pid"]].append(e["args"]["bytes"])
    assert len(counters) == 2
    for values in counters.values():
        assert max(values) >= 2 << 20 and values[-1] == 0  # 1 MiB buffers, all freed at the end


@pytest.mark.slow
def test_trace_command_summarizes_and_draws(traced: Any, tmp_path: Path) -> None:
    path, _, _ = traced
    png = tmp_path / "timeline.png"
    result = subprocess.run(
        [sys.executable, "-m", "aiotinyrt", "trace", str(path), "--png", str(png)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for heading in ("busy share per queue", "top kernels by device time", "copy bandwidth", "idle gaps"):
        assert heading in out, out
    assert "CPU:1/copy" in out and "scale" in out and "transfer" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_trace_command_on_a_missing_file_is_an_error(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "aiotinyrt", "trace", str(tmp_path / "none.json")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1 and "No such file" in result.stderr and "Traceback" not in result.stderr


def test_an_unwritable_trace_path_fails_when_profiling_starts(tmp_path: Path) -> None:
    target = tmp_path / "no-such-dir" / "trace.json"
    result = run_workload(tmp_path, str(target))
    assert result.returncode == 1
    assert f"ValueError: PROFILE='{target}': the trace cannot be written to {target}" in result.stderr
    assert "Exception ignored" not in result.stderr and not target.parent.exists()


@pytest.mark.slow
def test_profile_1_writes_into_the_working_directory(tmp_path: Path) -> None:
    result = run_workload(tmp_path, "1")
    assert result.returncode == 0, result.stderr
    path = tmp_path / "aiotinyrt_profile.json"
    assert f" to {path} " in result.stderr and json.loads(path.read_text())["traceEvents"]
