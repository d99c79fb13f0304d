"""Reading a ``PROFILE`` trace back (written by :mod:`aiotinyrt.recorder`): ``python -m aiotinyrt
trace FILE`` prints :func:`summarize` (busy share per queue, top kernels by device time, copy
bandwidth, idle gaps, peak memory) and ``--png OUT`` draws :func:`plot` (needs matplotlib, the
``plot`` extra). Any Chrome trace with ``X``/``C`` events and ``s``/``f`` flows can be read.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from aiotinyrt.helpers import format_bytes


# ---- reading -------------------------------------------------------------------------------------
@dataclass
class Slice:
    """One ``X`` event read back: times in microseconds."""

    track: str  # "DEVICE/queue"
    kind: str
    name: str
    ts: float
    dur: float
    nbytes: int = 0


@dataclass
class Trace:
    """A trace file read back: command slices, each device's memory counter ``[(ts, bytes)]``
    and each dependency as ``((track, ts), (track, ts))`` from the command depended on."""

    slices: list[Slice]
    memory: dict[str, list[tuple[float, int]]]
    flows: list[tuple[tuple[str, float], tuple[str, float]]]


def read(path: str) -> Trace:
    """Read a trace file written by :func:`write` (or any Chrome trace with ``X``/``C`` events)."""
    with open(path) as f:
        data = json.load(f)
    evs = data["traceEvents"] if isinstance(data, dict) else data
    names = [e for e in evs if e.get("ph") == "M"]
    procs = {e["pid"]: e["args"]["name"] for e in names if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in names if e["name"] == "thread_name"}
    slices = []
    memory: dict[str, list[tuple[float, int]]] = defaultdict(list)
    ends: dict[str, dict[Any, tuple[str, float]]] = {"s": {}, "f": {}}
    for e in evs:
        ph = e.get("ph")
        if ph in ("X", "s", "f"):
            track = f"{procs.get(e['pid'], e['pid'])}/{threads.get((e['pid'], e['tid']), e['tid'])}"
            if ph == "X":
                nbytes = int(e.get("args", {}).get("bytes", 0))
                slices.append(Slice(track, e.get("cat", "other"), e["name"], e["ts"], e["dur"], nbytes))
            else:
                ends[ph][e["id"]] = (track, e["ts"])
        elif ph == "C":
            memory[str(procs.get(e["pid"], e["pid"]))].append((e["ts"], int(e["args"].get("bytes", 0))))
    flows = [(source, ends["f"][k]) for k, source in ends["s"].items() if k in ends["f"]]
    return Trace(slices, dict(memory), flows)


def summarize(path: str, top: int = 10) -> str:
    """Busy share per queue, top kernels by device time, copy bandwidth and idle gaps, as text."""
    recorded = read(path)
    slices, memory = recorded.slices, recorded.memory
    if not slices:
        return f"{path}: no commands recorded"
    begin = min(s.ts for s in slices)
    span = max(s.ts + s.dur for s in slices) - begin
    lines = [f"{path}: {sum(s.kind != 'wait' for s in slices)} commands over {span / 1e3:.3f} ms", ""]
    lines.append("busy share per queue (commands, not waits, over the whole trace):")
    tracks: dict[str, list[Slice]] = defaultdict(list)
    for s in slices:
        tracks[s.track].append(s)
    for track, items in sorted(tracks.items()):
        busy = sum(s.dur for s in items if s.kind != "wait")
        waited = sum(s.dur for s in items if s.kind == "wait")
        lines.append(
            f"  {track:<20} {100 * busy / span:5.1f} %  "
            f"({busy / 1e3:.3f} ms busy, {waited / 1e3:.3f} ms waiting)"
        )
    kernels: dict[str, list[float]] = defaultdict(list)
    for s in slices:
        if s.kind == "kernel":
            kernels[s.name].append(s.dur)
    lines += ["", f"top kernels by device time (of {len(kernels)}):"]
    for name, durs in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(
            f"  {name:<24} {sum(durs) / 1e3:10.3f} ms total  {len(durs):6d} runs  "
            f"{sum(durs) / len(durs):9.1f} us mean"
        )
    lines += ["", "copy bandwidth (bytes moved over the time the commands ran):"]
    for kind in ("copy", "transfer"):
        moved = [s for s in slices if s.kind == kind and s.nbytes]
        if moved:
            total, secs = sum(s.nbytes for s in moved), sum(s.dur for s in moved) / 1e6
            rate = format_bytes(int(total / secs)) + "/s" if secs > 0 else "-"
            lines.append(f"  {kind:<9} {len(moved):6d} commands  {format_bytes(total):>11}  {rate}")
    lines += ["", "idle gaps per queue (between the first and last command on it):"]
    for track, items in sorted(tracks.items()):
        work = sorted((s for s in items if s.kind != "wait"), key=lambda s: s.ts)
        gaps = [b.ts - (a.ts + a.dur) for a, b in itertools.pairwise(work)]
        gaps = [g for g in gaps if g > 0]
        largest = max(gaps, default=0.0)
        lines.append(
            f"  {track:<20} {sum(gaps) / 1e3:.3f} ms idle in {len(gaps)} gaps, largest {largest:.1f} us"
        )
    if memory:
        lines += ["", "memory in use (allocator), peak:"]
        for device, points in sorted(memory.items()):
            lines.append(f"  {device:<20} {format_bytes(max(n for _, n in points))}")
    return "\n".join(lines)


_COLORS = {"kernel": "tab:blue", "copy": "tab:orange", "transfer": "tab:green", "graph": "tab:purple",
           "wait": "lightgray", "other": "tab:brown"}  # fmt: skip


def plot(path: str, out: str) -> None:
    """Draw the trace's timeline into the PNG ``out``: one row per queue, slices coloured by kind,
    and each device's memory in use below. Needs matplotlib (``pip install 'aiotinyrt[plot]'``)."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--png needs matplotlib: pip install 'aiotinyrt[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    recorded = read(path)
    slices, memory = recorded.slices, recorded.memory
    tracks = sorted({s.track for s in slices})
    begin = min([*(s.ts for s in slices), *(t for points in memory.values() for t, _ in points)], default=0.0)
    fig, (ax, mem) = plt.subplots(
        2, 1, figsize=(12, 1.2 + 0.6 * len(tracks) + 1.6), sharex=True, height_ratios=[max(len(tracks), 1), 2]
    )
    for row, track in enumerate(tracks):
        for kind, color in _COLORS.items():
            bars = [
                ((s.ts - begin) / 1e3, s.dur / 1e3) for s in slices if s.track == track and s.kind == kind
            ]
            if bars:
                ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=color, edgecolors="white", linewidth=0.3)
    rows = {track: row for row, track in enumerate(tracks)}
    for (src, src_ts), (dst, dst_ts) in recorded.flows:  # dependencies across queues
        if src != dst:
            xy = ((dst_ts - begin) / 1e3, rows[dst])
            start = ((src_ts - begin) / 1e3, rows[src])
            ax.annotate("", xy=xy, xytext=start, arrowprops={"arrowstyle": "->", "color": "0.35", "lw": 0.5})
    ax.set_yticks(range(len(tracks)), tracks)
    ax.invert_yaxis()
    kinds = sorted({s.kind for s in slices})
    handles = [Patch(color=_COLORS[k], label=k) for k in kinds]
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1, 1), ncols=len(kinds), frameon=False)
    ax.set_title(f"{os.path.basename(path)} (arrows: dependencies across queues)", loc="left")
    for i, (device, points) in enumerate(sorted(memory.items())):
        xs = [(t - begin) / 1e3 for t, _ in points]
        style = ("-", "--", ":", "-.")[i % 4]  # devices with equal memory stay visible
        mem.step(xs, [n / 2**20 for _, n in points], where="post", label=device, linestyle=style)
    mem.set_ylabel("MiB in use")
    mem.set_xlabel("ms")
    if memory:
        mem.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(path: str, *, png: str | None = None, top: int = 10) -> int:
    """``python -m aiotinyrt trace FILE [--png OUT]``: print the summary, draw the picture."""
    try:
        print(summarize(path, top))
        if png is not None:
            plot(path, png)
            print(f"\ntimeline written to {os.path.abspath(png)}")
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        print(f"python -m aiotinyrt trace: {exc}", file=sys.stderr)
        return 1
    return 0
