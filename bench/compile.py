"""Compilation (cold, concurrent, cached, single flight) and multi-threaded CPU kernels,
side by side with tinygrad 0.14 where it is installed.

    python bench/compile.py            # 5 repetitions, elementwise over 64 Mi floats
    python bench/compile.py --quick    # 3 repetitions, 16 Mi floats

Rows (medians over the repetitions; every repetition uses fresh kernel sources, so "cold" means
a miss in both the in-memory and the persistent cache, with the compiler's identity already
known):

1. one cold ``compile_cached`` of a rendered kernel (a ``cc`` subprocess), and tinygrad's
   synchronous ``ClangCompiler.compile`` of the same source;
2. 16 distinct kernels compiled one after another, the same with no standby compiler process
   (``CC_STANDBY=0``: one process started per compile, which is what "serial" means in the
   concurrency target; with the standby even serial compiles use a second core), then
   concurrently from one task group (target: ≥ 1.7× faster than the no-standby serial with 2+
   cores);
3. a ``compile_cached`` hit (target ≤ 5 µs), and tinygrad's ``compile_cached`` hit;
4. single flight: 32 concurrent ``compile_cached`` calls for one new source run exactly one
   compiler process (``compiler.compiles``);
5. an elementwise ``Kernel`` over 64 Mi floats: ``await prog(...)`` of ``dev.program(kernel)``
   on a device limited to one thread (``CPU_THREADS=1``), then on the default device, which
   splits it across every core with the ``core_id, core_count`` convention (target ≥ 1.7×);
   the same binary called through cffi from Python threads is the reference;
6. program load: ``dev.program()`` cold (compile + load, target ≤ 1.0× tinygrad's
   ``ClangCompiler.compile`` + ``CPUProgram``; five pairs per repetition, ours and tinygrad's
   alternating, the ratio taken per pair; the compiler's own CPU time with our flags, tinygrad's
   and the former ``-shared`` ones, from ``getrusage``), loading alone (``dev.runtime()`` of a compiled
   object, target ≤ 0.3 ms; the ELF loader by itself; the shared-object loading the CPU device
   used before objects — memfd + ``dlopen`` + ``dlsym`` — and tinygrad's ``CPUProgram``), the
   loader's parse step next to pyelftools' (where installed), and ``/proc/self/maps`` entries
   added by 1,000 loaded programs (target ≤ 20, one per 50 programs).

The compile caches live in a temporary directory (``CACHEDB``), never in ~/.cache.
"""

from __future__ import annotations

import argparse
import atexit
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# Keep the compile caches (ours and tinygrad's, which reads CACHEDB at import) out of ~/.cache.
_TMP = tempfile.mkdtemp(prefix="aiotinyrt-bench-")
atexit.register(shutil.rmtree, _TMP, True)
os.environ["CACHEDB"] = os.path.join(_TMP, "cache.db")

import anyio  # noqa: E402
import cffi  # noqa: E402
from _samples import Samples  # noqa: E402  (bench/ is sys.path[0])

from aiotinyrt import Buffer, Device, dtypes  # noqa: E402
from aiotinyrt.compiler import Compiler  # noqa: E402
from aiotinyrt.host import elf  # noqa: E402
from aiotinyrt.kernel import BufferParam, ClangRenderer, IntParam, Kernel, cpu_threads  # noqa: E402

TARGET_CONCURRENT_X = 1.7
TARGET_HIT_US = 5.0
TARGET_THREADS_X = 1.7
TARGET_COLD_VS_TG = 1.0
TARGET_LOAD_MS = 0.3
TARGET_MAPS_PER_1000 = 20
MI = 1 << 20


def compile_kernel(nonce: str, i: int) -> str:
    """A small, realistic kernel (a 2-D stencil with a reduction loop), distinct per (nonce, i)."""
    k = Kernel(
        f"k_{nonce}_{i}",
        [BufferParam("out", dtypes.float32, "w"), BufferParam("x", dtypes.float32), IntParam("taps")],
        f"""
        float acc = 0.0f;
        for (int t = 0; t < taps; t++) {{
          int j = min(gidx0 + t, gsz0 - 1);
          acc += x[gidx1 * gsz0 + j] * (float)(t + {i + 1}) + sqrt(fabs(x[j]));
        }}
        out[gidx1 * gsz0 + gidx0] = acc > 0.0f ? acc : exp(acc);
        """,
    )
    return ClangRenderer().render(k)


ELEMENTWISE = Kernel(
    "elementwise",
    [BufferParam("out", dtypes.float32, "w"), BufferParam("x", dtypes.float32)],
    "float v = x[gidx0]; out[gidx0] = v * 1.5f + sqrt(fabs(v)) / (1.0f + v * v);",
)


# ---- tinygrad anchors --------------------------------------------------------------------------


def tinygrad_compiler() -> tuple[Any, str]:
    try:
        from importlib import metadata

        from tinygrad.runtime.support.compiler_cpu import ClangCompiler as TinyClang
    except Exception as exc:  # any import problem means "not available"
        return None, f"n/a ({type(exc).__name__})"
    arch = {"amd64": "x86_64", "aarch64": "arm64"}.get(platform.machine().lower(), platform.machine().lower())
    return TinyClang([arch, "native"]), f"tinygrad {metadata.version('tinygrad')}"


def tinygrad_rep(tg: Any, nonce: str, out: Samples) -> None:
    src = compile_kernel(f"tg{nonce}", 0)
    start = time.perf_counter()
    tg.compile(src)
    out.add("tg_cold", (time.perf_counter() - start) * 1e3)
    srcs = [compile_kernel(f"tgs{nonce}", i) for i in range(16)]
    start = time.perf_counter()
    for s in srcs:
        tg.compile(s)
    out.add("tg_seq16", (time.perf_counter() - start) * 1e3)
    from tinygrad.device import Device as TgDevice
    from tinygrad.device import TinyELF
    from tinygrad.runtime.ops_cpu import CPUProgram as TgCPUProgram

    tg_dev: Any = TgDevice["CPU"]
    lib = tg.compile(compile_kernel(f"tgload{nonce}", 0))
    out.add(
        "tg_load",
        _per_call_ms(
            lambda: TgCPUProgram(tg_dev, TinyELF(lib, f"k_tgload{nonce}_0", tg_dev.renderer.target, ())), 200
        ),
    )
    if "tg_maps" not in out.values:
        before = _mappings()
        kept = [
            TgCPUProgram(tg_dev, TinyELF(lib, f"k_tgload{nonce}_0", tg_dev.renderer.target, ()))
            for _ in range(1000)
        ]
        out.add("tg_maps", _mappings() - before)
        del kept
    hit = compile_kernel(f"tghit{nonce}", 0)
    tg.compile_cached(hit)  # miss: compiles and stores in tinygrad's sqlite cache
    n = 2000
    start = time.perf_counter()
    for _ in range(n):
        tg.compile_cached(hit)
    out.add("tg_hit", (time.perf_counter() - start) / n * 1e6)


# ---- aiotinyrt ---------------------------------------------------------------------------------


def tinygrad_cold_program(tg: Any, nonce: str) -> float:
    """tinygrad's ClangCompiler.compile + CPUProgram of a fresh kernel, in ms."""
    from tinygrad.device import Device as TgDevice
    from tinygrad.device import TinyELF
    from tinygrad.runtime.ops_cpu import CPUProgram as TgCPUProgram

    tg_dev: Any = TgDevice["CPU"]
    src = compile_kernel(f"tgprog{nonce}", 0)
    start = time.perf_counter()
    lib = tg.compile(src)
    TgCPUProgram(tg_dev, TinyELF(lib, f"k_tgprog{nonce}_0", tg_dev.renderer.target, ()))
    return (time.perf_counter() - start) * 1e3


async def compile_suite(backend: str, nonce: str, out: Samples, hits: int, tg: Any) -> None:
    dev = Device["CPU"]
    compiler: Compiler = dev.compiler
    await compiler.compile_cached(compile_kernel("warmup", 0))  # the compiler's identity, once

    src = compile_kernel(f"cold{nonce}{backend}", 0)
    start = time.perf_counter()
    await compiler.compile_cached(src)
    out.add(f"cold/{backend}", (time.perf_counter() - start) * 1e3)

    for pair in range(5):  # ours and tinygrad's alternately: paired under the same load
        src = compile_kernel(f"prog{nonce}{backend}{pair}", 0)
        start = time.perf_counter()
        await dev.program(f"k_prog{nonce}{backend}{pair}_0", src)
        ours = (time.perf_counter() - start) * 1e3
        out.add(f"cold_program/{backend}", ours)
        if tg is not None:
            theirs = tinygrad_cold_program(tg, f"{nonce}{backend}{pair}")
            out.add(f"tg_cold_load/{backend}", theirs)
            out.add(f"cold_ratio/{backend}", ours / theirs)

    srcs = [compile_kernel(f"seq{nonce}{backend}", i) for i in range(16)]
    start = time.perf_counter()
    for s in srcs:
        await compiler.compile_cached(s)
    out.add(f"seq16/{backend}", (time.perf_counter() - start) * 1e3)

    # the same with no standby compiler process: one process started per compile, as serial
    # compilation is in the concurrency target (the standby lets even serial compiles use 2 cores)
    srcs = [compile_kernel(f"seqcold{nonce}{backend}", i) for i in range(16)]
    saved = os.environ.get("CC_STANDBY")
    os.environ["CC_STANDBY"] = "0"
    try:
        dev.compiler._process.close()  # type: ignore[attr-defined]
        start = time.perf_counter()
        for s in srcs:
            await compiler.compile_cached(s)
        out.add(f"seq16cold/{backend}", (time.perf_counter() - start) * 1e3)
    finally:
        if saved is None:
            del os.environ["CC_STANDBY"]
        else:
            os.environ["CC_STANDBY"] = saved

    srcs = [compile_kernel(f"con{nonce}{backend}", i) for i in range(16)]
    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for s in srcs:
            tg.start_soon(compiler.compile_cached, s)
    out.add(f"con16/{backend}", (time.perf_counter() - start) * 1e3)

    hit = srcs[0]
    start = time.perf_counter()
    for _ in range(hits):
        await compiler.compile_cached(hit)
    out.add(f"hit/{backend}", (time.perf_counter() - start) / hits * 1e6)

    one = compile_kernel(f"flight{nonce}{backend}", 0)
    before = compiler.compiles
    start = time.perf_counter()
    results: list[bytes] = []

    async def ask() -> None:
        results.append(await compiler.compile_cached(one))

    async with anyio.create_task_group() as tg:
        for _ in range(32):
            tg.start_soon(ask)
    out.add(f"flight_ms/{backend}", (time.perf_counter() - start) * 1e3)
    out.add(f"flight_procs/{backend}", compiler.compiles - before)
    assert len(results) == 32 and len(set(results)) == 1


async def threads_suite(n: int, reps: int, out: Samples) -> None:
    """Elementwise over ``n`` floats: on one thread, then split across every core by the device;
    the same binary called through cffi from Python threads is the reference."""
    dev = Device["CPU"]
    os.environ["CPU_THREADS"] = "1"  # a second CPU device that never splits: the 1-thread baseline
    try:
        single = Device["CPU:1"]
    finally:
        del os.environ["CPU_THREADS"]
    threads = cpu_threads((n,), getattr(dev, "threads", os.cpu_count() or 1))
    chunk = bytes(range(256)) * (4 * MI // 256)  # fills the input, faulting every page in
    data = bytearray(n * 4)
    for offset in range(0, n * 4, len(chunk)):
        data[offset : offset + len(chunk)] = chunk[: n * 4 - offset]
    bufs = {}
    for d in (dev, single):
        x = await Buffer(d.name, n, dtypes.float32).allocate()
        y = await Buffer(d.name, n, dtypes.float32).allocate()
        await x.copyin(data)
        await y.copyin(data)
        bufs[d.name] = (y, x)
    split_prog = await dev.program(ELEMENTWISE)
    single_prog = await single.program(ELEMENTWISE)

    # the reference: the same binary, loaded with cffi and called from Python threads
    lib = await dev.compiler.compile_cached(ClangRenderer().render(ELEMENTWISE))
    path = os.path.join(_TMP, "elementwise.so")
    with open(path + ".o", "wb") as f:
        f.write(lib)
    cc = list(getattr(dev.compiler, "cc", ["cc"]))
    await anyio.run_process([*cc, "-shared", path + ".o", "-o", path, "-lm"])  # the same code, linked
    ffi = cffi.FFI()
    ffi.cdef(f"void {ELEMENTWISE.name}(void *, void *, int, int, int, int, int);")
    fn: Callable[..., None] = getattr(ffi.dlopen(path), ELEMENTWISE.name)
    y, x = bufs[dev.name]
    addrs = (ffi.cast("void *", y.handle().addr), ffi.cast("void *", x.handle().addr))
    launch = ELEMENTWISE.launch_vals((), (n,))

    def run(core_id: int, core_count: int) -> None:
        fn(*addrs, *launch, core_id, core_count)

    with ThreadPoolExecutor(max_workers=threads) as pool:
        await single_prog(*bufs[single.name], global_size=(n,))  # warm up
        await split_prog(*bufs[dev.name], global_size=(n,))
        list(pool.map(lambda i: run(i, threads), range(threads)))
        for _ in range(reps):
            start = time.perf_counter()
            await single_prog(*bufs[single.name], global_size=(n,))
            out.add("dev1", (time.perf_counter() - start) * 1e3)
            start = time.perf_counter()
            await split_prog(*bufs[dev.name], global_size=(n,))
            out.add("devn", (time.perf_counter() - start) * 1e3)
            start = time.perf_counter()
            pool.submit(run, 0, 1).result()
            out.add("raw1", (time.perf_counter() - start) * 1e3)
            start = time.perf_counter()
            list(pool.map(lambda i: run(i, threads), range(threads)))
            out.add("rawn", (time.perf_counter() - start) * 1e3)
    out.notes["threads"] = str(threads)
    for pair in bufs.values():
        for b in pair:
            await b.free()
    await single.aclose()


# ---- program loading -----------------------------------------------------------------------------

_ffi = cffi.FFI()
_ffi.cdef("void *dlopen(const char *, int); void *dlsym(void *, const char *); int dlclose(void *);")
_dl: Any = _ffi.dlopen(None)


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def _dlopen_load(so: bytes, name: str) -> tuple[Any, int]:
    """Shared-object loading as the CPU device did it before objects: memfd, dlopen, dlsym."""
    fd = os.memfd_create("bench", os.MFD_CLOEXEC)
    os.write(fd, so)
    handle = _dl.dlopen(f"/proc/self/fd/{fd}".encode(), 2)
    assert handle != _ffi.NULL and _dl.dlsym(handle, name.encode()) != _ffi.NULL
    return handle, fd


def _dlopen_unload(loaded: tuple[Any, int]) -> None:
    _dl.dlclose(loaded[0])
    os.close(loaded[1])


def _per_call_ms(fn: Callable[[], object], n: int) -> float:
    """The median of ``n`` calls' wall times (a median: on a shared machine a mean is mostly the
    other processes' time slices)."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


async def load_suite(nonce: str, out: Samples) -> None:
    """Loading a compiled kernel: the object loader against shared-object loading, and the
    mappings 1,000 loaded programs add."""
    dev = Device["CPU"]
    name = f"k_load{nonce}_0"
    src = compile_kernel(f"load{nonce}", 0)
    lib = await dev.compiler.compile_cached(src)
    cc = list(getattr(dev.compiler, "cc", ["cc"]))
    path = os.path.join(_TMP, "load.c")
    with open(path, "w") as f:
        f.write(src)
    flags = ["-O2", "-march=native", "-fPIC", "-shared", "-fno-math-errno"]
    await anyio.run_process([*cc, *flags, "-x", "c", path, "-o", path + ".so", "-lm"])
    with open(path + ".so", "rb") as f:
        so = f.read()
    # the compiler's own CPU time (getrusage of children: immune to waiting for a core), by flags
    tg_flags = ["-c", "-O2", "-fPIC", "-ffreestanding", "-fno-math-errno", "-nostdlib", "-fno-ident"]
    tg_flags += [f"--target={platform.machine()}-none-unknown-elf", "-march=native"]
    variants = {
        "ccpu_ours": [*cc, *getattr(dev.compiler, "FLAGS", ())],
        "ccpu_tinygrad": [*cc, *tg_flags],
        "ccpu_shared": [*cc, *flags],
    }
    for _ in range(3):
        for key, argv in variants.items():
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run([*argv, "-x", "c", path, "-o", path + ".out"], check=True)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            used = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
            out.add(key, used * 1e3)
    n = 200
    out.add("load_runtime", _per_call_ms(lambda: dev.runtime(name, lib), n))
    out.add("load_elf", _per_call_ms(lambda: elf.load(lib), n))
    out.add("load_dlopen", _per_call_ms(lambda: _dlopen_unload(_dlopen_load(so, name)), n))
    out.add("parse_struct", _per_call_ms(lambda: elf.parse(lib), n))
    try:
        from elftools.elf.elffile import ELFFile  # type: ignore[import-not-found]
    except ImportError:
        pass
    else:
        import io

        def pyelftools_parse() -> None:
            f = ELFFile(io.BytesIO(lib))
            for section in f.iter_sections():
                if section["sh_type"] == "SHT_RELA":
                    list(section.iter_relocations())
                elif section["sh_type"] == "SHT_SYMTAB":
                    list(section.iter_symbols())
                elif section["sh_flags"] & 2:
                    section.data()

        out.add("parse_pyelftools", _per_call_ms(pyelftools_parse, n))
    if "maps_object" not in out.values:  # once: the count does not vary
        before = _mappings()
        kept: list[Any] = [dev.runtime(name, lib) for _ in range(1000)]
        out.add("maps_object", _mappings() - before)
        del kept
        before = _mappings()
        handles = [_dlopen_load(so, name) for _ in range(1000)]
        out.add("maps_dlopen", _mappings() - before)
        for h in handles:
            _dlopen_unload(h)


# ---- report ------------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def verdict(values: Sequence[float | None], ok: Callable[[float], bool]) -> str:
    marks = ["n/a" if v is None else ("PASS" if ok(v) else "MISS") for v in values]
    return marks[0] if len(set(marks)) == 1 else " / ".join(marks)


def report(s: Samples, n: int, tg_label: str, reps: int, load: tuple[float, float]) -> str:
    m = s.median
    loops = ("asyncio", "trio")
    rows: list[tuple[str, ...]] = []

    def per_loop(key: str, digits: int = 2) -> list[str]:
        return [fmt(m(f"{key}/{b}"), digits) for b in loops]

    rows.append(("1. cold compile_cached, one kernel (cc subprocess)", "ms", *per_loop("cold", 1), "—", ""))
    rows.append(
        (
            f"   {tg_label}: ClangCompiler.compile, same source",
            "ms",
            fmt(m("tg_cold"), 1),
            "(sync)",
            "—",
            "ref",
        )
    )
    rows.append(("2. 16 distinct kernels, one after another", "ms", *per_loop("seq16", 0), "—", ""))
    rows.append(
        ("   16 distinct kernels, concurrently (one task group)", "ms", *per_loop("con16", 0), "—", "")
    )
    rows.append(
        (
            "   16 one after another, no standby process (CC_STANDBY=0)",
            "ms",
            *per_loop("seq16cold", 0),
            "—",
            "",
        )
    )
    speed = [
        None if m(f"seq16cold/{b}") is None or not m(f"con16/{b}") else m(f"seq16cold/{b}") / m(f"con16/{b}")  # type: ignore[operator]
        for b in loops
    ]
    rows.append(
        (
            f"   speed-up of concurrent over no-standby serial ({os.cpu_count()} cores)",
            "×",
            *[fmt(v) for v in speed],
            f"≥ {TARGET_CONCURRENT_X}",
            verdict(speed, lambda v: v >= TARGET_CONCURRENT_X),
        )
    )
    rows.append(
        (f"   {tg_label}: 16 compiles, one after another", "ms", fmt(m("tg_seq16"), 0), "(sync)", "—", "ref")
    )
    hit = [m(f"hit/{b}") for b in loops]
    rows.append(
        (
            "3. compile_cached hit (in-memory)",
            "µs/call",
            *[fmt(v) for v in hit],
            f"≤ {TARGET_HIT_US}",
            verdict(hit, lambda v: v <= TARGET_HIT_US),
        )
    )
    rows.append(
        (f"   {tg_label}: compile_cached hit (sqlite)", "µs/call", fmt(m("tg_hit")), "(sync)", "—", "ref")
    )
    procs = [m(f"flight_procs/{b}") for b in loops]
    rows.append(
        (
            "4. single flight: 32 concurrent compile_cached, one source",
            "compiler runs",
            *[fmt(v, 0) for v in procs],
            "= 1",
            verdict(procs, lambda v: v == 1),
        )
    )
    rows.append(("   wall time of the 32 calls", "ms", *per_loop("flight_ms", 1), "—", ""))
    threads = s.notes.get("threads", "?")
    size = f"{n // MI} Mi floats"
    dev1, devn, raw1, rawn = m("dev1"), m("devn"), m("raw1"), m("rawn")
    rows.append(
        (f"5. elementwise over {size}: one thread (CPU_THREADS=1)", "ms", fmt(dev1, 1), "", "—", "ref")
    )
    ratio = None if dev1 is None or not devn else dev1 / devn
    rows.append(
        (
            f"   split by the device over {threads} cores (core_id/core_count)",
            "ms",
            fmt(devn, 1),
            f"{fmt(ratio)} ×",
            f"≥ {TARGET_THREADS_X}×",
            verdict([ratio], lambda v: v >= TARGET_THREADS_X),
        )
    )
    raw_ratio = None if raw1 is None or not rawn else raw1 / rawn
    rows.append(
        (
            f"   reference: same binary via cffi, 1 thread / {threads} Python threads",
            "ms",
            f"{fmt(raw1, 1)} / {fmt(rawn, 1)}",
            f"{fmt(raw_ratio)} ×",
            "—",
            "ref",
        )
    )
    rows.append(
        ("6. cold dev.program(): compile + load, one kernel", "ms", *per_loop("cold_program", 1), "—", "")
    )
    rows.append(
        (
            f"   {tg_label}: ClangCompiler.compile + CPUProgram, alternating",
            "ms",
            *per_loop("tg_cold_load", 1),
            "—",
            "ref",
        )
    )
    ratios = [m(f"cold_ratio/{b}") for b in loops]
    rows.append(
        (
            "   ours ÷ tinygrad's, median of the paired runs",
            "×",
            *[fmt(v) for v in ratios],
            f"≤ {TARGET_COLD_VS_TG}",
            verdict(ratios, lambda r: r <= TARGET_COLD_VS_TG),
        )
    )
    rows.append(
        (
            "   the compiler's CPU time: these flags / tinygrad's / cc -shared",
            "ms",
            f"{fmt(m('ccpu_ours'), 1)} / {fmt(m('ccpu_tinygrad'), 1)} / {fmt(m('ccpu_shared'), 1)}",
            "",
            "—",
            "ref",
        )
    )
    load_ms = m("load_runtime")
    rows.append(
        (
            "   load alone: dev.runtime() of a compiled object (loop thread)",
            "ms",
            fmt(load_ms, 3),
            "",
            f"≤ {TARGET_LOAD_MS}",
            verdict([load_ms], lambda v: v <= TARGET_LOAD_MS),
        )
    )
    rows.append(
        ("   the ELF loader alone (parse, relocate, place)", "ms", fmt(m("load_elf"), 3), "", "—", "")
    )
    rows.append(
        ("   shared object as before: memfd + dlopen + dlsym", "ms", fmt(m("load_dlopen"), 3), "", "—", "ref")
    )
    rows.append((f"   {tg_label}: CPUProgram load", "ms", fmt(m("tg_load"), 3), "", "—", "ref"))
    rows.append(
        (
            "   parse step: struct reader / pyelftools",
            "ms",
            f"{fmt(m('parse_struct'), 3)} / {fmt(m('parse_pyelftools'), 3)}",
            "",
            "—",
            "ref",
        )
    )
    maps = m("maps_object")
    rows.append(
        (
            "   /proc/self/maps entries added by 1,000 loaded programs",
            "entries",
            fmt(maps, 0),
            "",
            f"≤ {TARGET_MAPS_PER_1000}",
            verdict([maps], lambda v: v <= TARGET_MAPS_PER_1000),
        )
    )
    rows.append(
        (
            f"   the same, shared objects (dlopen) / {tg_label} CPUProgram",
            "entries",
            f"{fmt(m('maps_dlopen'), 0)} / {fmt(m('tg_maps'), 0)}",
            "",
            "—",
            "ref",
        )
    )
    header = ("measurement", "unit", "asyncio", "trio", "target", "verdict")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        f"aiotinyrt compile & threads bench — {platform.machine()}, {os.cpu_count()} cores, python "
        f"{platform.python_version()}, medians of {reps} repetitions, load average {load[0]:.2f} at start, "
        f"{load[1]:.2f} at end (above ~0.5 other work shares the cores: parallel rows understate)",
        "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repetitions, 16 Mi floats")
    args = parser.parse_args(argv)
    reps = 3 if args.quick else 5
    n = (16 if args.quick else 64) * MI
    hits = 20000
    samples = Samples()
    load_start = os.getloadavg()[0]
    tg, tg_label = tinygrad_compiler()
    for rep in range(reps):
        nonce = f"{os.getpid()}_{rep}"
        if tg is not None:
            tinygrad_rep(tg, nonce, samples)
        anyio.run(compile_suite, "asyncio", nonce, samples, hits, tg, backend="asyncio")
        anyio.run(compile_suite, "trio", nonce, samples, hits, tg, backend="trio")
        anyio.run(load_suite, nonce, samples)
    anyio.run(threads_suite, n, reps, samples)
    print(report(samples, n, tg_label, reps, (load_start, os.getloadavg()[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
