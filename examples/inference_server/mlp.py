"""The digits MLP on aiotinyrt: weights, raw C kernels, and a pipeline of stages over devices.

The model is ``64 -> H -> H -> H -> 10``: three dense ReLU layers and a dense softmax head.
``load_digits_mlp()`` reads the trained weights (H = 64, see ``train.py``); ``random_mlp(width)``
describes the same shape with H = ``width`` and random weights, generated on the device.

Serving splits the layers into contiguous *stages*, one per device (``CPU`` runs the first two
layers, ``CPU:1`` the last two). Each stage keeps its weights resident in its device's memory.
A micro-batch holds a *slot* (activation buffers on every stage) from its input copy to its
output copy, so ``slots`` micro-batches can be in flight: while one runs its second stage on
``CPU:1``, the next runs its first stage on ``CPU``. Activations move between devices with
``Buffer.copy_from``; the runtime orders every copy and launch against the work on the same memory,
so the code below only enqueues and awaits.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import anyio

from aiotinyrt import Buffer, Compiled, Device, Program, Signal, dtypes
from aiotinyrt.digits import KERNELS, read_npz

N_PIXELS = 64  #: 8 x 8 input pixels, 0..16
N_CLASSES = 10
PIXEL_MAX = 16
TILE = 16  #: weights are packed in blocks of 16 output columns (see KERNELS)

# Raw C kernels in tinygrad's CPU convention: buffer pointers first, then ints; each loops itself.
# Weights are packed once, on the device, so the inner loop streams contiguous memory: for every
# block of 16 outputs, ``n_in`` rows of 16 weights (zero past ``n_out``). The micro-kernel keeps a
# 6 x 16 block of outputs in AVX registers (clang/gcc vector extensions).
# The kernels ship inside the package, which runs them in its demo without this repository:
# ``KERNELS`` in aiotinyrt/digits.py.


def packed_size(n_in: int, n_out: int) -> int:
    """Floats in a packed weight matrix (``n_out`` rounded up to a multiple of 16)."""
    return n_in * -(-n_out // TILE) * TILE


# ---- weights --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layer:
    """One dense layer. ``weights`` (row-major ``n_in x n_out`` float32) and ``bias`` are None for a
    layer whose weights are generated on the device (``random_mlp``)."""

    n_in: int
    n_out: int
    weights: array[float] | None = None
    bias: array[float] | None = None


@dataclass(frozen=True)
class MLPSpec:
    """A stack of dense layers: ReLU after each but the last, softmax after the last."""

    layers: tuple[Layer, ...]
    seed: int = 0
    name: str = "digits"

    @property
    def widths(self) -> list[int]:
        return [self.layers[0].n_in, *(layer.n_out for layer in self.layers)]

    @property
    def flops_per_image(self) -> int:
        return sum(2 * layer.n_in * layer.n_out for layer in self.layers)


@dataclass(frozen=True)
class TestSet:
    """Held-out images (raw pixels 0..16, ``count x 64`` uint8) and their labels."""

    images: array[int]
    labels: array[int]

    def __len__(self) -> int:
        return len(self.labels)

    def image(self, i: int) -> list[int]:
        return self.images[i * N_PIXELS : (i + 1) * N_PIXELS].tolist()


def default_weights_path() -> Path:
    """``aiotinyrt/data/digits_mlp.npz``: installed with the package, so the demo finds it too."""
    return Path(str(resources.files("aiotinyrt"))) / "data" / "digits_mlp.npz"


def load_digits_mlp(path: str | Path | None = None) -> tuple[MLPSpec, TestSet]:
    """The trained digits MLP and its held-out test set. The input scale (1/16) is folded into the
    first layer, so the model takes raw pixels 0..16."""
    arrays = read_npz(path or default_weights_path())
    scale = arrays["input_scale"][0][0]
    layers = []
    i = 0
    while f"w{i}" in arrays:
        weights, (n_in, n_out) = arrays[f"w{i}"]
        if i == 0:
            weights = array("f", [w * scale for w in weights])
        layers.append(Layer(n_in, n_out, weights, arrays[f"b{i}"][0]))
        i += 1
    test = TestSet(array("B", arrays["test_images"][0]), array("B", arrays["test_labels"][0]))
    return MLPSpec(tuple(layers)), test


def random_mlp(width: int, *, depth: int = 3, seed: int = 0) -> MLPSpec:
    """``64 -> width x depth -> 10`` with random weights (made on the device), for load tests."""
    if width < 1:
        raise ValueError(f"width must be positive, got {width}")
    widths = [N_PIXELS, *([width] * depth), N_CLASSES]
    layers = tuple(Layer(a, b) for a, b in itertools.pairwise(widths))
    return MLPSpec(layers, seed=seed, name=f"random-{width}")


# ---- the pipeline ---------------------------------------------------------------------------------
@dataclass
class Result:
    """Outputs of one micro-batch: ``rows x 10`` probabilities and ``rows`` classes."""

    probabilities: array[float]
    classes: array[int]

    def split(self, sizes: Sequence[int]) -> list[Result]:
        """Cut into consecutive results of ``sizes`` rows."""
        out, row = [], 0
        for n in sizes:
            out.append(
                Result(
                    self.probabilities[row * N_CLASSES : (row + n) * N_CLASSES],
                    self.classes[row : row + n],
                )
            )
            row += n
        return out


@dataclass
class Stage:
    """Consecutive layers on one device, with their packed weights resident there."""

    device: Compiled
    first: int  #: index of its first layer in the model
    layers: tuple[Layer, ...]
    weights: list[tuple[Buffer, Buffer]]  #: (packed weights, bias) per layer
    dense_relu: Program
    dense_softmax: Program
    last: bool
    kernel_seconds: float = 0.0  #: device time of the kernels run so far


@dataclass
class Slot:
    """Activation buffers for one micro-batch in flight: per stage, its input and every layer's
    output (``max_batch`` rows each), plus the classes of the last stage."""

    index: int
    inputs: list[Buffer]
    outputs: list[list[Buffer]]
    classes: Buffer


class Pipeline:
    """An MLP split into stages over devices, ``slots`` micro-batches in flight.

    Create it with ``await Pipeline.create(spec, ["CPU", "CPU:1"])``; run a micro-batch with
    ``await pipeline.infer(pixels, rows)`` (which takes a slot, waiting for one if all are busy),
    or with ``acquire()`` / ``run(slot, ...)`` / ``release(slot)`` to take the slot first.
    """

    def __init__(
        self, spec: MLPSpec, stages: list[Stage], slots: list[Slot], max_batch: int, buffers: list[Buffer]
    ) -> None:
        self.spec = spec
        self.stages = stages
        self.max_batch = max_batch
        self.slot_count = len(slots)
        self._slots = slots
        self._free = list(slots)
        self._slot_ready = anyio.Semaphore(len(slots))
        self._buffers = buffers
        self.batches = 0  #: micro-batches run
        self.images = 0  #: images run

    @property
    def devices(self) -> list[Compiled]:
        return [stage.device for stage in self.stages]

    @property
    def in_flight(self) -> int:
        """Micro-batches holding a slot now."""
        return self.slot_count - len(self._free)

    @classmethod
    async def create(
        cls,
        spec: MLPSpec,
        devices: Sequence[str],
        *,
        max_batch: int = 64,
        slots: int = 4,
        on_compile: Callable[[str], None] | None = None,
    ) -> Pipeline:
        """Compile the kernels on every device, upload (or generate) the weights, allocate the
        activation buffers of every slot.

        Cancellation: cancelled while building, buffers allocated so far are freed.
        """
        if not devices:
            raise ValueError("a pipeline needs at least one device")
        if max_batch < 1 or slots < 1:
            raise ValueError(f"max_batch and slots must be positive, got {max_batch} and {slots}")
        n_stages = min(len(devices), len(spec.layers))
        bounds = [round(i * len(spec.layers) / n_stages) for i in range(n_stages + 1)]
        allocated: list[Buffer] = []

        async def alloc(device: str, size: int, dtype: Any = dtypes.float32) -> Buffer:
            buf = await Buffer(device, size, dtype).allocate()
            allocated.append(buf)
            return buf

        try:
            stages = []
            for s in range(n_stages):
                device = Device[devices[s]]
                if on_compile is not None:
                    on_compile(device.name)
                progs = {
                    name: await device.program(name, KERNELS)
                    for name in ("dense_relu", "dense_softmax", "pack_dense", "init_dense")
                }
                layers = spec.layers[bounds[s] : bounds[s + 1]]
                weights = []
                for j, layer in enumerate(layers):
                    packed = await alloc(device.name, packed_size(layer.n_in, layer.n_out))
                    bias = await alloc(device.name, layer.n_out)
                    if layer.weights is None or layer.bias is None:
                        seed = (spec.seed * 7919 + bounds[s] + j) & 0x7FFFFFFF
                        progs["init_dense"](packed, bias, vals=(layer.n_in, layer.n_out, seed))
                    else:
                        async with Buffer(device.name, layer.n_in * layer.n_out, dtypes.float32) as raw:
                            await raw.copyin(layer.weights)
                            await device.run(progs["pack_dense"], packed, raw, vals=(layer.n_in, layer.n_out))
                        await bias.copyin(layer.bias)
                    weights.append((packed, bias))
                stages.append(
                    Stage(
                        device,
                        bounds[s],
                        layers,
                        weights,
                        progs["dense_relu"],
                        progs["dense_softmax"],
                        s == n_stages - 1,
                    )
                )
            slot_list = []
            for index in range(slots):
                inputs, outputs = [], []
                for stage in stages:
                    name = stage.device.name
                    inputs.append(await alloc(name, max_batch * stage.layers[0].n_in))
                    outputs.append([await alloc(name, max_batch * layer.n_out) for layer in stage.layers])
                classes = await alloc(stages[-1].device.name, max_batch, dtypes.int32)
                slot_list.append(Slot(index, inputs, outputs, classes))
            await _synchronize(stages)
        except BaseException:
            with anyio.CancelScope(shield=True):
                for buf in allocated:
                    await buf.free()
            raise
        return cls(spec, stages, slot_list, max_batch, allocated)

    async def acquire(self) -> Slot:
        """Wait for a free slot and take it.

        Cancellation: cancelled while waiting, no slot is taken.
        """
        await self._slot_ready.acquire()
        return self._free.pop()

    def release(self, slot: Slot) -> None:
        """Give a slot back (its buffers may still be in use by enqueued work: the runtime orders
        the next micro-batch's copies after it)."""
        self._free.append(slot)
        self._slot_ready.release()

    async def infer(self, pixels: array[float], rows: int) -> Result:
        """Run ``rows`` images (``rows x 64`` float32 pixels) through the model."""
        slot = await self.acquire()
        try:
            return await self.run(slot, pixels, rows)
        finally:
            self.release(slot)

    async def run(self, slot: Slot, pixels: array[float], rows: int) -> Result:
        """Run one micro-batch in ``slot``: copy in, every stage (activations copied between
        devices), copy out.

        Cancellation: cancels the wait only; the enqueued work completes (the slot's buffers stay
        valid, and the next user of the slot is ordered after it).
        """
        if not 1 <= rows <= self.max_batch:
            raise ValueError(f"a micro-batch has 1..{self.max_batch} rows, got {rows}")
        if len(pixels) != rows * N_PIXELS:
            raise ValueError(f"{rows} images need {rows * N_PIXELS} pixels, got {len(pixels)}")
        f32 = dtypes.float32
        previous: Buffer | None = None
        launched: list[tuple[Stage, Signal]] = []
        for s, stage in enumerate(self.stages):
            n_in = stage.layers[0].n_in
            current = slot.inputs[s].view(rows * n_in, f32)
            if previous is None:
                await current.copyin(pixels)
            else:
                await current.copy_from(previous)
            for layer, (w, b), out in zip(stage.layers, stage.weights, slot.outputs[s], strict=True):
                vals = (rows, layer.n_in, layer.n_out)
                if stage.last and layer is stage.layers[-1]:
                    sig = stage.dense_softmax(out, slot.classes, current, w, b, vals=vals, writes=(0, 1))
                else:
                    sig = stage.dense_relu(out, current, w, b, vals=vals, writes=(0,))
                launched.append((stage, sig))
                current = out.view(rows * layer.n_out, f32)
            previous = current
        assert previous is not None
        probs_view = await previous.as_memoryview()
        classes_view = await slot.classes.view(rows, dtypes.int32).as_memoryview()
        try:
            probs = array("f", probs_view.cast("f"))
            classes = array("i", classes_view.cast("i"))
        finally:
            probs_view.release()
            classes_view.release()
        for stage, sig in launched:  # all done: the output depended on every one of them
            stage.kernel_seconds += sig.result()
        self.batches += 1
        self.images += rows
        return Result(probs, classes)

    async def synchronize(self) -> None:
        """Wait for all work on every stage's device."""
        await _synchronize(self.stages)

    async def aclose(self) -> None:
        """Free every buffer (memory is released once the work using it completes).

        Cancellation: shielded.
        """
        with anyio.CancelScope(shield=True):
            buffers, self._buffers = self._buffers, []
            for buf in buffers:
                await buf.free()


async def _synchronize(stages: Sequence[Stage]) -> None:
    from aiotinyrt import synchronize

    await synchronize(*(stage.device for stage in stages))


async def accuracy(pipeline: Pipeline, test: TestSet, batch: int = 60) -> float:
    """Held-out accuracy computed through the pipeline, micro-batches run concurrently."""
    correct = 0

    async def one(start: int) -> None:
        nonlocal correct
        rows = min(batch, len(test) - start)
        pixels = array("f", test.images[start * N_PIXELS : (start + rows) * N_PIXELS])
        result = await pipeline.infer(pixels, rows)
        correct += sum(
            int(c == y) for c, y in zip(result.classes, test.labels[start : start + rows], strict=True)
        )

    async with anyio.create_task_group() as tg:
        for start in range(0, len(test), batch):
            tg.start_soon(one, start)
    return correct / len(test)
