"""Pipelining: two compute stages split over CPU and CPU:1, micro-batches in flight, double-buffered.

    python examples/pipeline.py                      # 48 micro-batches of 4096 floats
    python examples/pipeline.py --batches 8 --size 256 --iters 20
    python examples/pipeline.py --ray                # the two stages on two Ray device hosts

Stage 1 runs on the first device, its output is transferred to the second, stage 2 runs there.
While stage 2 works on micro-batch i on CPU:1, stage 1 already works on micro-batch i+1 on CPU.
Every buffer a micro-batch touches exists ``depth`` times (two: double-buffered), so micro-batch
i+1 never waits for micro-batch i to let go of its memory; the runtime orders the reuse of a
slot (micro-batch i+2 after micro-batch i) by itself, on the devices' worker threads.

The same code with both stages on one device is the baseline: the example prints the throughput
of both and checks that they compute identical outputs. See docs/pipelining.md.

With ``--ray`` the same pipeline runs with stage 1 on ``RAY:p1/CPU`` and stage 2 on
``RAY:p2/CPU``, the CPUs of two device hosts (Ray actors, see docs/scale-out.md), next to the two
local devices, and the outputs are checked identical. It joins the Ray cluster of
``--ray-address`` (or of ``RAY_ADDRESS``; without either it starts a local one) and starts the
hosts unless they run, spread over the cluster's nodes.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass

import anyio
import numpy as np
import numpy.typing as npt

from aiotinyrt import Buffer, Device, Program, dtypes
from aiotinyrt.graph import Graph

FloatArray = npt.NDArray[np.float32]

#: Two compute-bound stages (a dependent multiply-add chain per element): the work grows with
#: ``iters``, the memory traffic does not.
STAGES = r"""
void stage1(float* restrict h, const float* restrict x, int n, int iters) {
  for (int i = 0; i < n; i++) {
    float v = x[i];
    for (int k = 0; k < iters; k++) v = v * 0.999f + 0.001f;
    h[i] = v;
  }
}
void stage2(float* restrict y, const float* restrict h, int n, int iters) {
  for (int i = 0; i < n; i++) {
    float v = h[i];
    for (int k = 0; k < iters; k++) v = v * 1.001f - 0.001f;
    y[i] = v;
  }
}
"""


@dataclass
class Slot:
    """One micro-batch's buffers: input and stage-1 output on the first device, stage-2 input and
    output on the second."""

    x: Buffer
    h: Buffer
    h2: Buffer
    y: Buffer


class TwoStagePipeline:
    """Stage 1 on ``devices[0]``, stage 2 on ``devices[1]`` (may be the same device), ``depth``
    micro-batches of ``size`` floats in flight.

    ``await pipeline.run(batches)`` returns the outputs in order. Create it with
    ``await TwoStagePipeline.create(...)`` and ``await pipeline.aclose()`` when done.
    """

    def __init__(self, devices: tuple[str, str], size: int, iters: int, depth: int, group: int = 16) -> None:
        self.devices = devices
        self.size = size
        self.iters = iters
        self.depth = depth
        #: the graph path reads its outputs ``group`` at a time (see :meth:`run_graph`)
        self.group = group
        self.slots: list[Slot] = []
        #: the graph path's outputs: ``depth + group + 1`` of them (see :func:`ring_size`), so
        #: those read before a replay finished at least a whole micro-batch earlier
        self.outs: list[Buffer] = []
        #: the graph path's inputs on the first device, as many as ``outs``: when output ``k`` is
        #: read, the replay that last read input ``k`` is over, so filling it waits for nothing
        self.ins: list[Buffer] = []
        self.stage1: Program | None = None
        self.stage2: Program | None = None
        self.step: Graph | None = None

    @classmethod
    async def create(
        cls,
        devices: tuple[str, str] = ("CPU", "CPU:1"),
        size: int = 4096,
        iters: int = 200,
        depth: int = 2,
        group: int = 16,
    ) -> TwoStagePipeline:
        """Compile both stages and allocate every buffer.

        Cancellation (or any error): the buffers allocated so far are freed before it propagates.
        """
        if depth < 1 or group < 1:
            raise ValueError(f"depth and group must be at least 1, got {depth} and {group}")
        self = cls(devices, size, iters, depth, group)
        first, second = devices
        made: list[Buffer] = []

        async def alloc(device: str) -> Buffer:
            made.append(await Buffer(device, size, dtypes.float32).allocate())
            return made[-1]

        try:
            self.stage1 = await Device[first].program("stage1", STAGES)
            self.stage2 = await Device[second].program("stage2", STAGES)
            for _ in range(depth):
                self.slots.append(
                    Slot(
                        x=await alloc(first),
                        h=await alloc(first),
                        h2=await alloc(second),
                        y=await alloc(second),
                    )
                )
            for _ in range(ring_size(depth, group)):
                self.outs.append(await alloc(second))
                self.ins.append(await alloc(first))
        except BaseException:
            with anyio.CancelScope(shield=True):
                for buf in made:
                    await buf.free()
            raise
        return self

    async def aclose(self) -> None:
        """Free every buffer (their memory is released once the work using it completed).

        Cancellation: shielded; every buffer is freed.
        """
        with anyio.CancelScope(shield=True):
            for slot in self.slots:
                for buf in (slot.x, slot.h, slot.h2, slot.y):
                    await buf.free()
            for buf in (*self.outs, *self.ins):
                await buf.free()
        self.slots = []
        self.outs = []
        self.ins = []

    def _launch_stage1(self, slot: Slot) -> None:
        assert self.stage1 is not None
        self.stage1(slot.h, slot.x, vals=(self.size, self.iters), writes=(0,))

    def _launch_stage2(self, slot: Slot) -> None:
        assert self.stage2 is not None
        self.stage2(slot.y, slot.h2, vals=(self.size, self.iters), writes=(0,))

    async def run(self, batches: Sequence[FloatArray]) -> list[FloatArray]:
        """Push every micro-batch through both stages; return the outputs in order.

        One task submits everything, in micro-batch order, so submission order is program
        order and the runtime's automatic ordering is all the synchronisation needed. For
        micro-batch ``i`` in slot ``i % depth``:

        * the launch of stage 1 returns at once (its input was copied in one step earlier);
        * the *next* micro-batch's input is copied into the next slot while stage 1 runs;
          the copy waits (on the copy worker) until stage 1 of the slot's previous micro-batch
          has read it;
        * ``copy_from`` returns when stage 1 is done and its output is on the second device;
          meanwhile that device runs stage 2 of micro-batch ``i - 1``;
        * the slot's previous output (micro-batch ``i - depth``) is read back, just before
          stage 2 overwrites it; it finished while stage 1 of ``i`` ran;
        * the launch of stage 2 returns at once, queued behind stage 2 of ``i - 1``.

        The submitting task waits only for stage 1; the first device idles only for one
        transfer and a few wake-ups per micro-batch.

        Cancellation: stops submitting; what was submitted completes on the devices, and the
        buffers stay valid (the next run or ``aclose`` is ordered after that work).
        """
        outputs: list[FloatArray] = []
        if batches:
            await self.slots[0].x.copyin(batches[0])
        for i in range(len(batches)):
            slot = self.slots[i % self.depth]
            self._launch_stage1(slot)
            if i + 1 < len(batches):
                await self.slots[(i + 1) % self.depth].x.copyin(batches[i + 1])
            await slot.h2.copy_from(slot.h)
            if i >= self.depth:
                outputs.append(await slot.y.numpy())
            self._launch_stage2(slot)
        for done in range(max(len(batches) - self.depth, 0), len(batches)):
            outputs.append(await self.slots[done % self.depth].y.numpy())
        return outputs

    async def capture_step(self) -> Graph:
        """Capture stage 1, the transfer, stage 2 and the copy of the result into an output
        buffer, for slot 0, as a graph whose buffers are named, so one synchronous ``replay``
        per micro-batch submits all four for any slot and output: two queue commands (stage 1
        and the transfer, folded into one run on the first device's compute queue; stage 2 and
        the result copy, folded into one run on the second's), the second waiting for the first
        on the devices' workers (see docs/pipelining.md).

        Cancellation: nothing was run; ``self.step`` stays as it was (a capture cancelled while
        sealing cannot be replayed)."""
        slot, out = self.slots[0], self.outs[0]
        async with Device[self.devices[0]].capture(x=slot.x, h=slot.h, h2=slot.h2, y=slot.y, out=out) as step:
            self._launch_stage1(slot)
            await slot.h2.copy_from(slot.h)
            self._launch_stage2(slot)
            await out.copy_from(slot.y)
        self.step = step
        return step

    async def run_graph(self, batches: Sequence[FloatArray]) -> list[FloatArray]:
        """As :meth:`run`, but each micro-batch is one replay of :meth:`capture_step`, and the
        submitting task stays ahead of the devices: it waits once per ``group`` micro-batches,
        for outputs finished at least a micro-batch ago, never for a stage in progress, so both
        devices always have the next step queued.

        Outputs and inputs are rings of ``depth + group + 1`` buffers (:func:`ring_size`). Before
        reusing output ``k``, the task reads the ``group`` oldest outputs at once, waiting only for
        the newest of them (the replays complete in order, so the others are complete too, and
        are copied with ``copyout_nowait``): one sleep and one wake-up of the task per ``group``
        micro-batches instead of one per micro-batch (on two cores the task's CPU is taken from
        the stages, see docs/pipelining.md for the default of 16). The
        newest it waits for is micro-batch ``i - depth - 2`` when it is about to submit ``i``:
        stage 1 of ``i - 1`` is still running then, so the task's wake-up and submissions overlap
        it (waiting for ``i - depth - 1`` instead, with one buffer less, left both devices idle
        25-30 % of the time in an ad-hoc measurement, against ~20 %). Input ``k`` was last read
        by a replay whose output was just read, so filling it waits for nothing: on CPU
        ``copyin_nowait`` copies it on the loop thread at once, without a checkpoint. Every wait
        between devices (stage 2 after the transfer after stage 1, a slot's reuse after its last
        reader) is the runtime's, on the devices' workers.

        Cancellation: as :meth:`run`."""
        step = self.step or await self.capture_step()
        outputs: list[FloatArray] = []
        outs, ins = self.outs, self.ins
        ring = len(outs)

        async def collect(upto: int) -> None:
            """Read outputs ``len(outputs)`` .. ``upto``, all done once ``upto`` is."""
            newest = await read(outs[upto % ring])  # the one wait
            while len(outputs) < upto:
                buf = outs[len(outputs) % ring]
                done = read_now(buf)  # (its writes are done: the replays complete in order)
                outputs.append(done if done is not None else await read(buf))
            outputs.append(newest)

        for i, batch in enumerate(batches):
            k = i % ring
            slot, out, inp = self.slots[k % self.depth], outs[k], ins[k]
            if i >= ring and len(outputs) <= i - ring:  # output k still holds micro-batch i - ring
                await collect(min(i - ring + self.group, len(batches)) - 1)
            try:
                inp.copyin_nowait(batch)  # idle by construction: a memcpy, no trip through the loop
            except anyio.WouldBlock:  # (a backend whose memory is not host memory)
                await inp.copyin(batch)
            step.replay(x=inp, h=slot.h, h2=slot.h2, y=slot.y, out=out)
        if len(outputs) < len(batches):
            await collect(len(batches) - 1)
        return outputs


def ring_size(depth: int, group: int) -> int:
    """Inputs and outputs of the graph path: ``depth + group + 1``, rounded up to a multiple of
    ``depth`` so that input ``k`` always meets slot ``k % depth`` (one substitution set, and one
    cached replay plan, per ring position)."""
    return -(-(depth + group + 1) // depth) * depth


def read_now(buf: Buffer) -> FloatArray | None:
    """A snapshot of ``buf`` taken at once on this thread (no trip through the event loop), for
    an output whose writes are known to be done; None where it cannot be (``copyout_nowait``
    says WouldBlock: a backend without host memory), and :func:`read` is the way."""
    out: FloatArray = np.empty(buf.size, dtype=np.float32)
    try:
        buf.copyout_nowait(out)
    except anyio.WouldBlock:
        return None
    return out


async def read(buf: Buffer) -> FloatArray:
    """A snapshot of ``buf``, waiting only for the commands that write it.

    ``buf.numpy()`` reads on the device's copy queue, in order behind everything submitted there
    before: in :meth:`TwoStagePipeline.run_graph` that is the next micro-batches' transfers,
    which wait for their stages, so the read would wait a whole stage. Where the device memory
    is host memory (CPU), ``as_memoryview()`` waits only for the buffer's own pending writes and
    the copy here is taken before anything else is submitted. Elsewhere it is a copy anyway.

    Cancellation: cancels the wait; nothing is read.
    """
    view = await buf.as_memoryview()
    return np.frombuffer(view, dtype=np.float32).copy()


async def throughput(
    devices: tuple[str, str], batches: Sequence[FloatArray], iters: int, depth: int, graph: bool
) -> tuple[float, list[FloatArray]]:
    """Micro-batches per second through the pipeline on ``devices``, and its outputs."""
    pipeline = await TwoStagePipeline.create(devices, batches[0].size, iters, depth)
    try:
        run = pipeline.run_graph if graph else pipeline.run
        await run(batches[: depth + 1])  # warm up: load, first touch, worker threads
        start = time.perf_counter()
        outputs = await run(batches)
        return len(batches) / (time.perf_counter() - start), outputs
    finally:
        await pipeline.aclose()


CONFIGS = {
    "one": ("one device (CPU, CPU)", ("CPU", "CPU"), False),
    "two": ("two devices (CPU, CPU:1)", ("CPU", "CPU:1"), False),
    "graph": ("two devices, graph replay per micro-batch", ("CPU", "CPU:1"), True),
}
#: ``--ray``: the device hosts of the two stages, and the configuration that uses them
RAY_HOSTS = ("p1", "p2")
RAY_CONFIG = ("two Ray hosts (RAY:p1/CPU, RAY:p2/CPU)", ("RAY:p1/CPU", "RAY:p2/CPU"), False)


def start_ray_hosts(address: str | None = None) -> None:
    """Join a Ray cluster (``address``, else ``RAY_ADDRESS``, else a new local one) unless this
    process is connected, and start the device hosts of :data:`RAY_HOSTS` that do not run yet,
    spread over the cluster's nodes. Blocks until they answer."""
    import ray  # (the optional ray extra: only this path needs it)

    from aiotinyrt import ray as airay

    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    running = airay.running_hosts()
    started = [
        airay.start_host(host, scheduling_strategy="SPREAD") for host in RAY_HOSTS if host not in running
    ]
    ray.get([actor.ping.remote() for actor in started], timeout=120)


async def main(
    batches: int = 48,
    size: int = 4096,
    iters: int = 200,
    depth: int = 2,
    only: Sequence[str] = tuple(CONFIGS),
    ray: bool = False,
) -> dict[str, float]:
    """Run the pipeline on one device and on two (``only``: those of :data:`CONFIGS`), and with
    ``ray`` on two Ray device hosts (:data:`RAY_CONFIG`; call :func:`start_ray_hosts` first);
    print and return micro-batches per second.

    Raises ``AssertionError`` if the configurations' outputs differ.
    """
    rng = np.random.default_rng(0)
    data = [rng.random(size, dtype=np.float32) for _ in range(batches)]
    results: dict[str, float] = {}
    reference: list[FloatArray] | None = None
    configs = [CONFIGS[name] for name in only] + ([RAY_CONFIG] if ray else [])
    for label, devices, graph in configs:
        rate, outputs = await throughput(devices, data, iters, depth, graph)
        if reference is None:
            reference = outputs
        assert len(outputs) == len(reference)
        assert all(np.array_equal(a, b) for a, b in zip(outputs, reference, strict=True)), label
        results[label] = rate
    base = next(iter(results.values()))
    print(
        f"{batches} micro-batches of {size} floats, {iters} iterations per element per stage, depth {depth}"
    )
    for label, rate in results.items():
        print(f"  {label:<44} {rate:9.1f} micro-batches/s  {rate / base:5.2f}x")
    print("  outputs identical in every configuration")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=48)
    parser.add_argument("--size", type=int, default=4096, help="floats per micro-batch")
    parser.add_argument("--iters", type=int, default=200, help="work per element per stage")
    parser.add_argument("--depth", type=int, default=2, help="micro-batches in flight (buffers per slot)")
    parser.add_argument(
        "--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS), help="configurations to run"
    )
    parser.add_argument("--ray", action="store_true", help="also run the stages on two Ray device hosts")
    parser.add_argument("--ray-address", default=None, help="the Ray cluster to join (default: RAY_ADDRESS)")
    args = parser.parse_args()
    if args.ray:
        start_ray_hosts(args.ray_address)
        args.only = [name for name in args.only if name != "graph"] or ["two"]  # (no capture on RAY)
    anyio.run(main, args.batches, args.size, args.iters, args.depth, args.only, args.ray)
