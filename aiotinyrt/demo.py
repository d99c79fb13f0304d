"""``python -m aiotinyrt demo``: what the runtime does on this machine, in one run.

The demo compiles and times a kernel on ``CPU``, measures launches and copies, runs the same
kernel on ``CPU`` and ``CPU:1`` at once beside the machine's parallel ceiling measured in the same
run, then serves the digits MLP (:mod:`aiotinyrt.digits`) as a two-stage pipeline over ``CPU`` and
``CPU:1`` and prints accuracy, throughput and timings. It needs nothing beyond the package's own
dependencies. Where the CPU device does not open it says why (see :mod:`aiotinyrt.machine`).
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import sys
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio
import sniffio

from aiotinyrt import native
from aiotinyrt.buffer import Buffer
from aiotinyrt.device import Compiled, Device, get_available_devices, synchronize
from aiotinyrt.digits import KERNELS, read_npz, weights_path
from aiotinyrt.dtype import dtypes
from aiotinyrt.helpers import fmt_time
from aiotinyrt.machine import open_error
from aiotinyrt.program import Program
from aiotinyrt.signal import Signal

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


def _grid(rows: Sequence[Sequence[str]]) -> str:
    """Rows of cells as aligned columns (first column left, the others right); the first row is
    the header, underlined."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]

    def line(row: Sequence[str]) -> str:
        cells = [row[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True))]
        return "  " + "  ".join(cells).rstrip()

    rule = "  " + "  ".join("-" * w for w in widths)
    return "\n".join([line(rows[0]), rule, *(line(r) for r in rows[1:])])


SPIN = """
void spin(float* restrict out, int n) {
  float x = out[0];
  for (int i = 0; i < n; i++) x = x * 0.999999f + 0.5f;
  out[0] = x;
}
"""


async def parallel_ceiling(reps: int = 8, n: int = 1 << 24) -> tuple[float, float]:
    """This machine's ceiling for two devices at once, measured now: ``reps`` runs of a
    compute-bound kernel (a dependent chain of float operations, no memory traffic) on CPU,
    against the same runs split over CPU and CPU:1. Returns (ceiling, seconds of one run)."""
    progs = [await Device[name].program("spin", SPIN) for name in ("CPU", "CPU:1")]
    bufs = [await Buffer(name, 1, dtypes.float32).allocate() for name in ("CPU", "CPU:1")]
    await Device["CPU"].run(progs[0], bufs[0], vals=(n,))  # warm-up
    start = time.perf_counter()
    for _ in range(reps):
        progs[0](bufs[0], vals=(n,))
    await Device["CPU"].synchronize()
    one = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(reps // 2):
        for prog, buf in zip(progs, bufs, strict=True):
            prog(buf, vals=(n,))
    await synchronize(*(Device[name] for name in ("CPU", "CPU:1")))
    two = time.perf_counter() - start
    for buf in bufs:
        await buf.free()
    return one / two, one / reps


def _loop_name() -> str:
    library = sniffio.current_async_library()
    if library == "asyncio":
        loop = type(asyncio.get_running_loop())
        return "uvloop" if loop.__module__.startswith("uvloop") else "asyncio"
    return library


def cpu_open_error() -> str | None:
    """Why the CPU device does not open here, or None when it does."""
    try:
        Device["CPU"]
    except Exception as exc:
        return open_error(exc)
    return None


async def main() -> int:
    """The whole demo; returns the exit status (1, with the reason, where CPU does not open).

    Cancellation: cancels the demo; the work already queued finishes on the devices.
    """
    print(f"aiotinyrt demo on {_loop_name()}")
    await native.prepare()  # the first run on a machine builds the native queue: not on the loop
    error = cpu_open_error()
    if error is not None:
        print(f"the demo runs on the CPU device, which does not open here: {error}", file=sys.stderr)
        print("(python -m aiotinyrt describes every backend)", file=sys.stderr)
        return 1
    await demo()
    return 0


async def demo() -> None:
    """Lists devices, compiles and runs a kernel on CPU and CPU:1, prints timings, then runs the
    digits MLP as a pipeline over CPU and CPU:1 (see :func:`digits_demo`).

    Cancellation: cancels the demo; the work already queued finishes on the devices.
    """
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
    ceiling, spin_s = await parallel_ceiling()
    cores = os.cpu_count() or 1
    rows.append((f"{reps} saxpys on CPU (wall time)", fmt_time(one)))
    rows.append(
        (
            f"{reps} saxpys split over CPU and CPU:1 (wall time)",
            f"{fmt_time(two)} ({one / two:.2f}x; saxpy is bound by memory bandwidth, which the cores share)",
        )
    )
    rows.append(
        (
            "parallel ceiling, CPU + CPU:1",
            f"{ceiling:.2f}x on {cores} cores (8 compute-bound runs of {fmt_time(spin_s)} each, this run)",
        )
    )

    for buf in (bx, by, out, *small, *ins1):
        await buf.free()
    await synchronize()
    stats = cpu.allocator.statistics()
    rows.append(("CPU allocator", f"{stats.bytes_in_use} B in use, {stats.bytes_cached} B cached"))
    print(_table(rows))
    print()
    await digits_demo(ceiling=ceiling)


@dataclass
class _Layer:
    n_in: int
    n_out: int
    weights: array[float] | None = None  # row-major; None: random, generated on the device
    bias: array[float] | None = None


@dataclass
class _Stage:
    device: Compiled
    layers: list[_Layer]
    progs: dict[str, Program]
    weights: list[tuple[Buffer, Buffer]] = field(default_factory=list)
    buffers: list[list[Buffer]] = field(default_factory=list)  # per slot: input, one per layer
    signals: list[Signal] = field(default_factory=list)  # launches, for the device time


class _DemoPipeline:
    """The model's layers split into consecutive stages, one per device, weights resident on
    each; ``slots`` micro-batches in flight, activations moved with ``copy_from``."""

    def __init__(self, stages: list[_Stage], classes: list[Buffer], max_rows: int) -> None:
        self.stages = stages
        self.classes = classes
        self.max_rows = max_rows
        self.free = list(range(len(classes)))
        self.ready = anyio.Semaphore(len(classes))
        self.latencies: list[float] = []  # seconds from taking a slot to the result

    @classmethod
    async def create(
        cls, layers: list[_Layer], devices: list[str], slots: int, max_rows: int
    ) -> _DemoPipeline:
        n = len(devices)
        bounds = [round(i * len(layers) / n) for i in range(n + 1)]
        stages = []
        for s, name in enumerate(devices):
            dev = Device[name]
            progs = {
                k: await dev.program(k, KERNELS)
                for k in ("dense_relu", "dense_softmax", "pack_dense", "init_dense")
            }
            stage = _Stage(dev, layers[bounds[s] : bounds[s + 1]], progs)
            for j, layer in enumerate(stage.layers):
                packed = await Buffer(
                    name, layer.n_in * -(-layer.n_out // 16) * 16, dtypes.float32
                ).allocate()
                bias = await Buffer(name, layer.n_out, dtypes.float32).allocate()
                if layer.weights is None:
                    progs["init_dense"](packed, bias, vals=(layer.n_in, layer.n_out, bounds[s] + j))
                else:
                    async with Buffer(name, len(layer.weights), dtypes.float32) as raw:
                        await raw.copyin(layer.weights)
                        await dev.run(progs["pack_dense"], packed, raw, vals=(layer.n_in, layer.n_out))
                    await bias.copyin(layer.bias)
                stage.weights.append((packed, bias))
            for _ in range(slots):
                sizes = [stage.layers[0].n_in] + [layer.n_out for layer in stage.layers]
                stage.buffers.append(
                    [await Buffer(name, max_rows * k, dtypes.float32).allocate() for k in sizes]
                )
            stages.append(stage)
        classes = [await Buffer(devices[-1], max_rows, dtypes.int32).allocate() for _ in range(slots)]
        await synchronize(*(stage.device for stage in stages))
        return cls(stages, classes, max_rows)

    async def infer(self, pixels: array[float], rows: int) -> tuple[array[float], array[int]]:
        """One micro-batch: copy in, every stage, copy out. Takes a slot for its duration."""
        f32 = dtypes.float32
        async with self.ready:
            slot = self.free.pop()
            start = time.perf_counter()
            try:
                prev: Buffer | None = None
                for s, stage in enumerate(self.stages):
                    bufs = stage.buffers[slot]
                    x = bufs[0].view(rows * stage.layers[0].n_in, f32)
                    await (x.copyin(pixels) if prev is None else x.copy_from(prev))
                    for j, (layer, (w, b)) in enumerate(zip(stage.layers, stage.weights, strict=True)):
                        vals = (rows, layer.n_in, layer.n_out)
                        if s == len(self.stages) - 1 and j == len(stage.layers) - 1:
                            sig = stage.progs["dense_softmax"](
                                bufs[j + 1], self.classes[slot], x, w, b, vals=vals, writes=(0, 1)
                            )
                        else:
                            sig = stage.progs["dense_relu"](bufs[j + 1], x, w, b, vals=vals, writes=(0,))
                        stage.signals.append(sig)
                        x = bufs[j + 1].view(rows * layer.n_out, f32)
                    prev = x
                assert prev is not None
                probs = array("f", bytes(prev.nbytes))
                classes = array("i", bytes(4 * rows))
                await prev.copyout(memoryview(probs).cast("B"))
                await self.classes[slot].view(rows, dtypes.int32).copyout(memoryview(classes).cast("B"))
                self.latencies.append(time.perf_counter() - start)
                return probs, classes
            finally:
                self.free.append(slot)

    def device_seconds(self) -> list[float]:
        """Kernel time per stage since the last call."""
        out = []
        for stage in self.stages:
            out.append(sum(sig.result() for sig in stage.signals))
            stage.signals.clear()
        return out

    async def aclose(self) -> None:
        for stage in self.stages:
            for buf in [b for pair in stage.weights for b in pair] + [
                b for bufs in stage.buffers for b in bufs
            ]:
                await buf.free()
        for buf in self.classes:
            await buf.free()


async def _measure(
    pipe: _DemoPipeline, images: array[float], count: int, rows: int, passes: int
) -> tuple[float, list[int]]:
    """Run ``passes`` over ``count`` images in micro-batches of ``rows``, as concurrent tasks.
    Returns (seconds, the predicted classes of the first pass)."""
    predicted = [0] * count

    async def one(start: int, first: bool) -> None:
        n = min(rows, count - start)
        _, classes = await pipe.infer(images[start * 64 : (start + n) * 64], n)
        if first:
            predicted[start : start + n] = classes.tolist()

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for p in range(passes):
            for i in range(0, count, rows):
                tg.start_soon(one, i, p == 0)
    return time.perf_counter() - start, predicted


async def digits_demo(
    *, passes: int = 10, wide: int = 1024, wide_images: int = 2048, ceiling: float | None = None
) -> None:
    """The digits MLP (trained weights) and a wider one of the same shape (random weights), each
    run on CPU alone (one micro-batch at a time) and as a CPU -> CPU:1 pipeline (4 in flight).
    ``ceiling``: the machine's two-device ceiling measured earlier in the run, printed beside.

    Cancellation: cancels the demo; the work already queued finishes on the devices.
    """
    path = weights_path()
    arrays = read_npz(path)
    scale = arrays["input_scale"][0][0]
    layers: list[_Layer] = []
    while f"w{len(layers)}" in arrays:
        i = len(layers)
        (w, (n_in, n_out)), (b, _) = arrays[f"w{i}"], arrays[f"b{i}"]
        layers.append(_Layer(n_in, n_out, array("f", [v * scale for v in w]) if i == 0 else w, b))
    test_images = array("f", arrays["test_images"][0])
    labels = arrays["test_labels"][0]
    widths = [layers[0].n_in] + [layer.n_out for layer in layers]
    print(f"digits MLP {'-'.join(map(str, widths))}, held-out set of {len(labels)} images (weights: {path})")

    done = anyio.Event()
    start = time.perf_counter()
    print("compiling the MLP kernels ...", flush=True)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_spinner, "compiling the MLP kernels", done)
        for name in ("CPU", "CPU:1"):
            await Device[name].program("dense_relu", KERNELS)
        done.set()
    compile_s = time.perf_counter() - start

    wide_layers = [_Layer(64, wide), _Layer(wide, wide), _Layer(wide, wide), _Layer(wide, 10)]
    wide_pixels = array("f", [float((i * 7919) % 17) for i in range(wide_images * 64)])
    rows_out = [
        [
            "model",
            "run",
            "images/s",
            "vs CPU alone",
            "batch latency p50",
            "p99",
            "kernel time per batch, per stage",
            "accuracy",
        ]
    ]
    accuracies = []
    alone = 0.0
    for model, model_layers, pixels, count, n_passes in (
        ("digits", layers, test_images, len(labels), passes),
        (f"random-{wide}", wide_layers, wide_pixels, wide_images, 1),
    ):
        for label, devices, slots in (
            ("CPU, 1 in flight", ["CPU"], 1),
            ("CPU -> CPU:1, 4 in flight", ["CPU", "CPU:1"], 4),
        ):
            pipe = await _DemoPipeline.create(model_layers, devices, slots=slots, max_rows=32)
            await _measure(pipe, pixels, min(count, 64), 32, 1)  # warm-up
            pipe.device_seconds()
            pipe.latencies.clear()
            seconds, predicted = await _measure(pipe, pixels, count, 32, n_passes)
            stage_s = pipe.device_seconds()
            await pipe.aclose()
            lat = sorted(pipe.latencies)
            batches = -(-count // 32) * n_passes
            rate = count * n_passes / seconds
            alone = rate if len(devices) == 1 else alone
            if model == "digits":
                correct = sum(int(p == y) for p, y in zip(predicted, labels, strict=True))
                accuracies.append(correct / len(labels))
                acc = f"{correct / len(labels):.4f}"
            else:
                acc = "-"
            rows_out.append(
                [
                    model,
                    label,
                    f"{rate:,.0f}",
                    "-" if len(devices) == 1 else f"{rate / alone:.2f}x",
                    fmt_time(statistics.median(lat)),
                    fmt_time(lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)]),
                    " + ".join(fmt_time(t / batches) for t in stage_s),
                    acc,
                ]
            )
    print(_grid(rows_out))
    print(
        f"  kernels compiled in {fmt_time(compile_s)} (cached on disk); micro-batches of 32 images; "
        f"digits: {passes} passes over the held-out set, random-{wide}: one pass over {wide_images} images"
    )
    print(
        "  images/s: over the whole run; latency: one micro-batch from its input copy to its output "
        "copy (wall time); kernel time: device seconds per micro-batch on each stage's device"
    )
    if ceiling is not None:
        print(
            f"  two devices can give at most {ceiling:.2f}x here ({os.cpu_count() or 1} cores, shared with "
            "whatever else runs; parallel ceiling measured above); a stage hand-over adds a copy and a "
            "wait per micro-batch, so a pipeline whose stages take little kernel time per batch can be "
            "slower than one device"
        )
    ok = all(a >= 0.95 for a in accuracies)
    print(
        f"  held-out accuracy through the served path: {accuracies[-1]:.4f} ({'ok' if ok else 'BELOW 0.95'})"
    )
