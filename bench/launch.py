"""Launch overhead and copy bandwidth of aiotinyrt, side by side with raw cffi, tinygrad and memmove.

    python bench/launch.py            # full: 7 repetitions, 100k launches, 256 MiB copies
    python bench/launch.py --quick    # 3 repetitions, 20k launches, 64 MiB copies
    python bench/launch.py --no-gc    # gc disabled inside every timed region (all sides alike)
    python bench/launch.py --profile  # also cProfile the pipelined CPU launch loop (asyncio)

Every figure is the median over the repetitions. One repetition runs every measurement once, in
the same order (raw cffi, tinygrad, memmove, then the aiotinyrt suite under asyncio and under
trio), so slow phases of a noisy machine hit all columns alike. The kernel is the same C source
everywhere: ``a[0] = b[0] + c[0]`` on three one-float buffers. Prints one markdown table.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import gc
import mmap
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

# Keep the compile caches (ours and tinygrad's, which reads CACHEDB at import) out of ~/.cache.
_TMP = tempfile.mkdtemp(prefix="aiotinyrt-bench-")
atexit.register(shutil.rmtree, _TMP, True)
os.environ.setdefault("CACHEDB", os.path.join(_TMP, "cache.db"))

import anyio  # noqa: E402
import anyio.to_thread  # noqa: E402
import cffi  # noqa: E402
from _samples import Samples  # noqa: E402  (bench/ is sys.path[0])

from aiotinyrt import Buffer, Device, dtypes  # noqa: E402

KERNEL = "void k(float* restrict a, const float* restrict b, const float* restrict c) { a[0] = b[0] + c[0]; }"
# Holds the compute worker in C (GIL released) so launches queue up behind it.
HOLD = "int usleep(unsigned int usec);\nvoid hold(int usec) { usleep(usec); }"
MiB = 1 << 20

TARGET_PIPELINED_US = 1.0
TARGET_NULL_US = 0.7
TARGET_COPY_PCT = 90.0
# The issue states the launch targets next to its anchor: tinygrad's synchronous CPUProgram call
# "costs about 1.9 µs on these machines". On a slower machine the same targets, as fractions of
# that anchor measured in the same run, are these (printed as extra rows, next to the absolute).
ANCHOR_TINYGRAD_US = 1.9


@dataclass
class Config:
    reps: int
    launches: int
    round_trips: int
    copy_bytes: int
    gc_off: bool
    profile: bool


@contextlib.contextmanager
def timed_region(cfg: Config) -> Iterator[None]:
    """Collect garbage before a timed region; with ``--no-gc`` also keep gc off inside it."""
    gc.collect()
    if cfg.gc_off:
        gc.disable()
    try:
        yield
    finally:
        if cfg.gc_off:
            gc.enable()


# ---- 1. raw cffi ------------------------------------------------------------------------------------
class RawKernel:
    """The kernel compiled by clang into a shared object, called through cffi function pointers:
    once with cdata pointer arguments (the floor) and once with integer addresses passed as
    ``uintptr_t`` (how aiotinyrt's CPUProgram calls kernels today)."""

    def __init__(self) -> None:
        so = os.path.join(_TMP, "raw_kernel.so")
        subprocess.run(
            ["clang", "-O2", "-march=native", "-fPIC", "-shared", "-x", "c", "-", "-o", so],
            input=KERNEL.encode(),
            check=True,
        )
        self.ffi = cffi.FFI()
        self.ffi.cdef("void k(float *a, const float *b, const float *c);")
        self.lib: Any = self.ffi.dlopen(so)
        self.by_pointer = self.ffi.cast("void (*)(float *, const float *, const float *)", self.lib.k)
        self.by_address = self.ffi.cast("void (*)(uintptr_t, uintptr_t, uintptr_t)", self.lib.k)
        self.mem = [self.ffi.new("float[1]", [v]) for v in (0.0, 1.0, 2.0)]
        self.addrs = [int(self.ffi.cast("uintptr_t", m)) for m in self.mem]

    def run(self, n: int, cfg: Config, *, addresses: bool) -> float:
        fn, (a, b, c) = (self.by_address, self.addrs) if addresses else (self.by_pointer, self.mem)
        self.mem[0][0] = 0.0
        with timed_region(cfg):
            start = time.perf_counter()
            for _ in range(n):
                fn(a, b, c)
            elapsed = time.perf_counter() - start
        assert self.mem[0][0] == 3.0
        return elapsed / n * 1e6


# ---- 2. tinygrad 0.14 --------------------------------------------------------------------------------
class TinygradKernel:
    """tinygrad's own CPU runtime: its ClangCompiler (object file), its JIT loader and CPUProgram,
    called with its HCQBuffers, synchronously (tinygrad's CPUProgram runs in the calling thread)."""

    def __init__(self) -> None:
        from tinygrad.device import Buffer as TgBuffer
        from tinygrad.device import Device as TgDevice
        from tinygrad.device import TinyELF
        from tinygrad.dtype import dtypes as tg_dtypes
        from tinygrad.runtime.ops_cpu import CPUProgram as TgCPUProgram

        dev: Any = TgDevice["CPU"]
        lib = dev.compiler.compile(KERNEL)
        self.prog = TgCPUProgram(dev, TinyELF(lib, "k", dev.renderer.target, ()))
        self.bufs = [TgBuffer("CPU", 1, tg_dtypes.float32).ensure_allocated() for _ in range(3)]
        self.hcq = [b._buf for b in self.bufs]
        for buf, v in zip(self.hcq[1:], (1.0, 2.0), strict=True):
            ctypes.c_float.from_address(buf.va_addr).value = v

    def run(self, n: int, cfg: Config) -> float:
        prog, (a, b, c) = self.prog, self.hcq
        with timed_region(cfg):
            start = time.perf_counter()
            for _ in range(n):
                prog(a, b, c)
            elapsed = time.perf_counter() - start
        assert ctypes.c_float.from_address(a.va_addr).value == 3.0
        return elapsed / n * 1e6


def load_tinygrad() -> tuple[TinygradKernel | None, str]:
    try:
        version = metadata.version("tinygrad")
    except metadata.PackageNotFoundError:
        return None, "n/a (tinygrad not installed)"
    try:
        return TinygradKernel(), f"tinygrad {version}"
    except Exception as exc:  # a tinygrad without a working CPU device: say why, keep going
        return None, f"n/a (tinygrad {version}: {type(exc).__name__}: {exc})"


# ---- 6. memmove baseline -----------------------------------------------------------------------------
class HostMemory:
    """The host buffer the copies read and write (a bytearray, as user data usually is) and an
    anonymous mmap of the same size (the kind of memory a CPU device buffer is) for memmove."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.host = bytearray(nbytes)
        self.device_like = mmap.mmap(-1, nbytes)
        self.host_addr = ctypes.addressof((ctypes.c_char * nbytes).from_buffer(self.host))
        self.dev_addr = ctypes.addressof((ctypes.c_char * nbytes).from_buffer(self.device_like))
        ctypes.memset(self.host_addr, 1, nbytes)  # touch every page of both
        ctypes.memset(self.dev_addr, 2, nbytes)

    def memmove(self, direction: str, cfg: Config) -> float:
        dst, src = (self.dev_addr, self.host_addr) if direction == "in" else (self.host_addr, self.dev_addr)
        with timed_region(cfg):
            start = time.perf_counter()
            ctypes.memmove(dst, src, self.nbytes)
            elapsed = time.perf_counter() - start
        return self.nbytes / elapsed / 1e9


# ---- 3-6. the aiotinyrt suite (one event loop) ----------------------------------------------------------
async def aiotinyrt_suite(backend: str, cfg: Config, host: HostMemory, out: Samples) -> None:
    cpu = Device["CPU"]
    prog = await cpu.program("k", KERNEL)
    a, b, c = [await Buffer("CPU", 1, dtypes.float32).allocate() for _ in range(3)]
    await b.copyin(memoryview(bytearray(ctypes.c_float(1.0))))
    await c.copyin(memoryview(bytearray(ctypes.c_float(2.0))))
    for _ in range(1000):  # warm up: worker thread started, code paths hot
        sig = prog(a, b, c)
    await sig
    assert (await a.as_memoryview()).cast("f")[0] == 3.0

    # 3. pipelined launches: n x prog(a, b, c), then one await of the last signal
    n = cfg.launches
    with timed_region(cfg):
        start = time.perf_counter()
        for _ in range(n):
            sig = prog(a, b, c)
        enqueued = time.perf_counter()
        await sig
        elapsed = time.perf_counter() - start
    out.add(f"pipelined/{backend}", elapsed / n * 1e6)
    out.add(f"enqueue/{backend}", (enqueued - start) / n * 1e6)

    # 3b. the same launches split in two: enqueue while the worker is held inside a kernel (no GIL
    # contention), then drain while the event loop sleeps in the await
    hold = await cpu.program("hold", HOLD)
    await cpu.synchronize()
    hold_us = min(int((enqueued - start) * 1.5e6) + 100_000, 2**31 - 1)
    with timed_region(cfg):
        held = hold(vals=(hold_us,))
        start = time.perf_counter()
        for _ in range(n):
            sig = prog(a, b, c)
        enqueued = time.perf_counter()
        still_held = not held.done()
        await held
        released = time.perf_counter()
        await sig
        drained = time.perf_counter()
    if still_held:  # else the worker ran launches during the enqueue: not a clean split
        out.add(f"enqueue_held/{backend}", (enqueued - start) / n * 1e6)
        out.add(f"drain/{backend}", (drained - released) / n * 1e6)

    # 4. launch + await round trip on an idle device
    await cpu.synchronize()
    for _ in range(50):
        await cpu.run(prog, a, b, c)
    with timed_region(cfg):
        start = time.perf_counter()
        for _ in range(cfg.round_trips):
            await cpu.run(prog, a, b, c)
        elapsed = time.perf_counter() - start
    out.add(f"roundtrip/{backend}", elapsed / cfg.round_trips * 1e6)
    with timed_region(cfg):  # reference: the same hand-off through anyio's thread pool
        start = time.perf_counter()
        for _ in range(cfg.round_trips):
            await anyio.to_thread.run_sync(_noop)
        elapsed = time.perf_counter() - start
    out.add(f"to_thread/{backend}", elapsed / cfg.round_trips * 1e6)

    # 5. NULL device: the runtime's own overhead, no kernel
    null = Device["NULL"]
    nprog = await null.program("k", KERNEL)
    na, nb, nc = [await Buffer("NULL", 1, dtypes.float32).allocate() for _ in range(3)]
    for _ in range(1000):
        sig = nprog(na, nb, nc)
    await sig
    with timed_region(cfg):
        start = time.perf_counter()
        for _ in range(n):
            sig = nprog(na, nb, nc)
        await sig
        elapsed = time.perf_counter() - start
    out.add(f"null/{backend}", elapsed / n * 1e6)

    # 6. copyin / copyout of a preallocated, touched host buffer, device memory touched first
    big = await Buffer("CPU", host.nbytes, dtypes.uint8).allocate()
    view = memoryview(host.host)
    await big.copyin(view)  # touch the device pages
    await big.copyout(view)
    with timed_region(cfg):
        start = time.perf_counter()
        await big.copyin(view)
        elapsed = time.perf_counter() - start
    out.add(f"copyin/{backend}", host.nbytes / elapsed / 1e9)
    with timed_region(cfg):
        start = time.perf_counter()
        await big.copyout(view)
        elapsed = time.perf_counter() - start
    out.add(f"copyout/{backend}", host.nbytes / elapsed / 1e9)

    for buf in (a, b, c, na, nb, nc, big):
        await buf.free()
    await cpu.synchronize()
    await null.synchronize()


def _noop() -> None:
    pass


def profile_pipelined(cfg: Config) -> None:
    """cProfile the pipelined CPU launch loop on asyncio and print the top costs."""
    import cProfile
    import pstats

    async def launches() -> None:
        cpu = Device["CPU"]
        prog = await cpu.program("k", KERNEL)
        a, b, c = [await Buffer("CPU", 1, dtypes.float32).allocate() for _ in range(3)]
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(cfg.launches):
            sig = prog(a, b, c)
        await sig
        profiler.disable()
        for buf in (a, b, c):
            await buf.free()
        print(f"\ncProfile of {cfg.launches} x prog(a, b, c) + await (asyncio; event-loop thread only):")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)

    anyio.run(launches)


# ---- report ------------------------------------------------------------------------------------------
def fmt(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def verdict(values: list[float | None], ok: Callable[[float], bool]) -> str:
    marks = ["n/a" if v is None else ("PASS" if ok(v) else "MISS") for v in values]
    return marks[0] if len(set(marks)) == 1 else " / ".join(marks)


def relative_row(values: list[float | None], tinygrad_us: float, target_us: float) -> tuple[str, ...]:
    """The row above it again, as a fraction of tinygrad's call, against the issue's target
    stated the same way (``target_us / ANCHOR_TINYGRAD_US``)."""
    ratio = [None if v is None else v / tinygrad_us for v in values]
    limit = target_us / ANCHOR_TINYGRAD_US
    return (
        "   the same ÷ tinygrad's CPUProgram call (row 2)",
        "× tinygrad",
        *(fmt(r) for r in ratio),
        f"≤ {limit:.2f}",
        verdict(ratio, lambda v: v <= limit),
    )


def report(cfg: Config, s: Samples, tinygrad_label: str) -> str:
    m = s.median
    loops = ("asyncio", "trio")
    rows: list[tuple[str, ...]] = []
    tg = m("tinygrad")
    rows.append(
        (
            "1. raw cffi call of k, pointer args (Python loop)",
            "µs/call",
            fmt(m("raw")),
            "(no loop)",
            "—",
            "ref",
        )
    )
    rows.append(
        (
            "   same, int addresses as uintptr_t (CPUProgram's way)",
            "µs/call",
            fmt(m("raw_int")),
            "(no loop)",
            "—",
            "ref",
        )
    )
    rows.append(
        (
            f"2. {tinygrad_label if tg is not None else 'tinygrad'} CPUProgram call (synchronous)",
            "µs/call",
            fmt(tg) if tg is not None else tinygrad_label,
            "(no loop)",
            "—",
            "ref",
        )
    )
    pipe = [m(f"pipelined/{b}") for b in loops]
    rows.append(
        (
            f"3. aiotinyrt pipelined: {cfg.launches:,} × prog(a,b,c), await last",
            "µs/launch",
            fmt(pipe[0]),
            fmt(pipe[1]),
            f"≤ {TARGET_PIPELINED_US}",
            verdict(pipe, lambda v: v <= TARGET_PIPELINED_US),
        )
    )
    if tg is not None:
        rows.append(relative_row(pipe, tg, TARGET_PIPELINED_US))
    enq = [m(f"enqueue/{b}") for b in loops]
    rows.append(("   of which enqueue (prog() calls before the await)", "µs/launch", *map(fmt, enq), "—", ""))
    held = [m(f"enqueue_held/{b}") for b in loops]
    rows.append(
        ("   split: enqueue while the worker is held in a kernel", "µs/launch", *map(fmt, held), "—", "")
    )
    drain = [m(f"drain/{b}") for b in loops]
    rows.append(
        ("   split: worker drains the queue, loop asleep in await", "µs/launch", *map(fmt, drain), "—", "")
    )
    rt = [m(f"roundtrip/{b}") for b in loops]
    rows.append(
        (
            f"4. aiotinyrt round trip: await dev.run(prog,a,b,c) × {cfg.round_trips:,}, idle",
            "µs",
            fmt(rt[0], 1),
            fmt(rt[1], 1),
            "—",
            "",
        )
    )
    tt = [m(f"to_thread/{b}") for b in loops]
    rows.append(
        ("   reference: await anyio.to_thread.run_sync(noop)", "µs", fmt(tt[0], 1), fmt(tt[1], 1), "—", "ref")
    )
    null = [m(f"null/{b}") for b in loops]
    rows.append(
        (
            f"5. aiotinyrt NULL: {cfg.launches:,} × prog(a,b,c), await last",
            "µs/launch",
            fmt(null[0]),
            fmt(null[1]),
            f"≤ {TARGET_NULL_US}",
            verdict(null, lambda v: v <= TARGET_NULL_US),
        )
    )
    if tg is not None:
        rows.append(relative_row(null, tg, TARGET_NULL_US))
    size = f"{cfg.copy_bytes // MiB} MiB"
    for direction, what in (("in", "copyin (host → device)"), ("out", "copyout (device → host)")):
        base = m(f"memmove_{direction}")
        rows.append((f"6. ctypes.memmove {size}, {what}", "GB/s", fmt(base), "(no loop)", "—", "ref"))
        got = [m(f"copy{direction}/{b}") for b in loops]
        pct = [None if g is None or not base else g / base * 100 for g in got]
        cells = [f"{fmt(g)} ({fmt(p, 0)} %)" for g, p in zip(got, pct, strict=True)]
        rows.append(
            (
                f"6. aiotinyrt Buffer.{'copyin' if direction == 'in' else 'copyout'} {size}",
                "GB/s (% memmove)",
                *cells,
                f"≥ {TARGET_COPY_PCT:.0f} %",
                verdict(pct, lambda v: v >= TARGET_COPY_PCT),
            )
        )

    header = ("benchmark", "unit", "asyncio", "trio", "target", "result")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    out = [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in rows]
    versions = ", ".join(
        f"{p} {metadata.version(p)}" for p in ("aiotinyrt", "anyio", "trio", "cffi") if _installed(p)
    )
    out.append("")
    out.append(
        f"Tree: {_git_revision()}. Medians of {cfg.reps} repetitions "
        "(each repetition runs every row once, interleaved). "
        f"gc: {'disabled' if cfg.gc_off else 'enabled'} in every timed region, on every side, "
        f"after a gc.collect(). GB/s = 1e9 B/s. "
        f"Python {platform.python_version()}, {os.cpu_count()} CPUs ({_cpu_model()}), {versions}."
    )
    return "\n".join(out)


def _git_revision() -> str:
    try:
        result = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return result.stdout.strip()


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for text in Path("/proc/cpuinfo").read_text().splitlines():
            if text.startswith("model name"):
                return text.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="3 reps, 20k launches, 64 MiB copies")
    parser.add_argument("--no-gc", action="store_true", help="disable gc inside timed regions (all sides)")
    parser.add_argument("--profile", action="store_true", help="cProfile the pipelined launch loop too")
    parser.add_argument("--reps", type=int, help="override the number of repetitions")
    args = parser.parse_args()
    if args.quick:
        cfg = Config(3, 20_000, 500, 64 * MiB, args.no_gc, args.profile)
    else:
        cfg = Config(7, 100_000, 2_000, 256 * MiB, args.no_gc, args.profile)
    if args.reps:
        cfg.reps = args.reps

    raw = RawKernel()
    tinygrad, tinygrad_label = load_tinygrad()
    host = HostMemory(cfg.copy_bytes)
    samples = Samples()
    for rep in range(cfg.reps):
        print(f"repetition {rep + 1}/{cfg.reps} ...", file=sys.stderr, flush=True)
        samples.add("raw", raw.run(cfg.launches, cfg, addresses=False))
        samples.add("raw_int", raw.run(cfg.launches, cfg, addresses=True))
        if tinygrad is not None:
            samples.add("tinygrad", tinygrad.run(cfg.launches, cfg))
        samples.add("memmove_in", host.memmove("in", cfg))
        samples.add("memmove_out", host.memmove("out", cfg))
        anyio.run(aiotinyrt_suite, "asyncio", cfg, host, samples)
        anyio.run(aiotinyrt_suite, "trio", cfg, host, samples, backend="trio")
    print(report(cfg, samples, tinygrad_label))
    if cfg.profile:
        profile_pipelined(cfg)


if __name__ == "__main__":
    main()
