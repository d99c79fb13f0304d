"""Command line: ``python -m aiotinyrt demo [--loop asyncio|trio|uvloop]`` and ``... devices``."""

from __future__ import annotations

import argparse
import sys
import time
from array import array

import anyio

from aiotinyrt import Buffer, Device, dtypes, get_available_devices, synchronize
from aiotinyrt.program import fmt_time

SAXPY = """
void saxpy(float* restrict out, const float* restrict x, const float* restrict y, int n, int a) {
  for (int i = 0; i < n; i++) out[i] = (float)a * x[i] + y[i];
}
"""


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


async def _spinner(message: str, done: anyio.Event) -> None:
    frames = "|/-\\"
    i = 0
    start = time.perf_counter()
    while not done.is_set():
        if sys.stdout.isatty():
            print(f"\r{message} {frames[i % 4]} {time.perf_counter() - start:4.1f} s", end="", flush=True)
        i += 1
        with anyio.move_on_after(0.1):
            await done.wait()
    if sys.stdout.isatty():
        print("\r" + " " * (len(message) + 12) + "\r", end="", flush=True)


async def demo() -> None:
    """Lists devices, compiles and runs a kernel on CPU and CPU:1, prints timings."""
    print(f"aiotinyrt demo on {anyio.get_current_task().name and _loop_name()}")
    devices = get_available_devices()
    print(f"devices: {', '.join(devices)} (default: {Device.DEFAULT})\n")
    cpu = Device["CPU"]
    rows: list[tuple[str, str]] = []

    print("compiling saxpy ...", flush=True)
    done = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_spinner, "compiling saxpy", done)
        start = time.perf_counter()
        prog = await cpu.program("saxpy", SAXPY)
        compile_s = time.perf_counter() - start
        done.set()
    start = time.perf_counter()
    await cpu.program("saxpy", SAXPY)
    rows.append(("compile (first call this process)", fmt_time(compile_s)))
    rows.append(("compile (cache hit)", fmt_time(time.perf_counter() - start)))

    n = 1 << 22
    x = array("f", range(n))
    y = array("f", [1.0]) * n
    bx = await Buffer("CPU", n, dtypes.float32).allocate()
    by = await Buffer("CPU", n, dtypes.float32).allocate()
    out = await Buffer("CPU", n, dtypes.float32).allocate()
    start = time.perf_counter()
    await bx.copyin(x)
    await by.copyin(y)
    rows.append((f"copyin 2 x {n * 4 >> 20} MiB", fmt_time(time.perf_counter() - start)))
    kernel_s = await cpu.run(prog, out, bx, by, vals=(n, 3))
    rows.append((f"saxpy over {n} floats (device time)", fmt_time(kernel_s)))
    result = array("f", bytes(n * 4))
    start = time.perf_counter()
    await out.copyout(memoryview(result).cast("B"))
    rows.append((f"copyout {n * 4 >> 20} MiB", fmt_time(time.perf_counter() - start)))
    ok = all(result[i] == 3 * x[i] + 1 for i in (0, 1, n // 2, n - 1))
    rows.append(("result check", "ok" if ok else "WRONG"))

    small = [await Buffer("CPU", 16, dtypes.float32).allocate() for _ in range(3)]
    launches = 20_000
    start = time.perf_counter()
    for _ in range(launches):
        sig = prog(*small, vals=(16, 2))
    submitted = time.perf_counter() - start
    await sig
    total = time.perf_counter() - start
    rows.append((f"{launches} pipelined launches: submit", fmt_time(submitted / launches) + " / launch"))
    rows.append((f"{launches} pipelined launches: total", fmt_time(total / launches) + " / launch"))
    start = time.perf_counter()
    for _ in range(1000):
        await cpu.run(prog, *small, vals=(16, 2))
    rows.append(("launch + await round trip", fmt_time((time.perf_counter() - start) / 1000)))

    # two devices working at once: the same kernel on CPU and CPU:1
    cpu1 = Device["CPU:1"]
    prog1 = await cpu1.program("saxpy", SAXPY)
    ins1 = [await Buffer("CPU:1", n, dtypes.float32).allocate() for _ in range(3)]
    await ins1[1].copy_from(bx)
    await ins1[2].copy_from(by)
    reps = 8
    start = time.perf_counter()
    for _ in range(reps):
        prog(out, bx, by, vals=(n, 3))
    await cpu.synchronize()
    one = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(reps // 2):
        prog(out, bx, by, vals=(n, 3))
        prog1(ins1[0], ins1[1], ins1[2], vals=(n, 3))
    await synchronize(cpu, cpu1)
    two = time.perf_counter() - start
    rows.append((f"{reps} saxpys on CPU", fmt_time(one)))
    rows.append((f"{reps} saxpys split over CPU and CPU:1", f"{fmt_time(two)} ({one / two:.2f}x)"))

    for buf in (bx, by, out, *small, *ins1):
        await buf.free()
    await synchronize()
    stats = cpu.allocator.statistics()
    rows.append(("CPU allocator", f"{stats.bytes_in_use} B in use, {stats.bytes_cached} B cached"))
    print(_table(rows))


def _loop_name() -> str:
    try:
        import asyncio

        asyncio.get_running_loop()
        return "asyncio"
    except RuntimeError:
        return "trio"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aiotinyrt")
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="list devices, compile and run a kernel, print timings")
    p_demo.add_argument("--loop", choices=["asyncio", "uvloop", "trio"], default="asyncio")
    sub.add_parser("devices", help="list the devices that open here")
    args = parser.parse_args(argv)
    if args.command == "devices":
        for name in get_available_devices():
            print(name)
        return 0
    backend, options = {
        "asyncio": ("asyncio", {}),
        "uvloop": ("asyncio", {"use_uvloop": True}),
        "trio": ("trio", {}),
    }[args.loop]
    anyio.run(demo, backend=backend, backend_options=options)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
