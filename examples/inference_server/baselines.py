"""The server's baselines for ``bench/server.py`` (``--mode`` of ``serve.py``): the pipeline's own
kernels called synchronously on the event loop (``blocking``), numpy in the handler (``numpy``),
and no model at all (``http``, the HTTP stack alone)."""

from __future__ import annotations

from array import array
from typing import Any

from mlp import N_CLASSES, N_PIXELS, TILE, Layer, Pipeline, Result


class BlockingModel:
    """The pipeline's own compiled kernels (the same loaded code, called here with cffi) and
    weights, called synchronously on the event loop thread: what a server that ignores the
    runtime's queues would do. Host memory only (the binaries are CPU code)."""

    RELU = "void (*)(float *, const float *, const float *, const float *, int, int, int)"
    SOFTMAX = "void (*)(float *, int *, const float *, const float *, const float *, int, int, int)"

    def __init__(
        self, programs: tuple[Any, Any], layers: list[tuple[Layer, array[float], array[float]]]
    ) -> None:
        import cffi

        self.ffi = cffi.FFI()
        self._programs: tuple[Any, ...] = programs  # they own the code the pointers below call
        relu, softmax = programs
        self.dense_relu: Any = self.ffi.cast(self.RELU, relu.image.symbols["dense_relu"])
        self.dense_softmax: Any = self.ffi.cast(self.SOFTMAX, softmax.image.symbols["dense_softmax"])
        self.layers = layers  #: (layer, packed weights, bias), host copies

    @classmethod
    async def create(cls, pipeline: Pipeline) -> BlockingModel:
        layers = []
        for stage in pipeline.stages:
            for layer, (w, b) in zip(stage.layers, stage.weights, strict=True):
                weights = array("f", (await w.as_memoryview()).cast("f"))
                layers.append((layer, weights, array("f", (await b.as_memoryview()).cast("f"))))
        stage = pipeline.stages[0]
        return cls((stage.dense_relu, stage.dense_softmax), layers)

    def infer(self, pixels: array[float], rows: int) -> Result:
        ffi = self.ffi
        x = pixels
        for i, (layer, w, b) in enumerate(self.layers):
            out = array("f", bytes(4 * rows * layer.n_out))
            args = (
                ffi.from_buffer("float[]", x),
                ffi.from_buffer("float[]", w),
                ffi.from_buffer("float[]", b),
            )
            dims = (rows, layer.n_in, layer.n_out)
            if i == len(self.layers) - 1:
                classes = array("i", bytes(4 * rows))
                self.dense_softmax(
                    ffi.from_buffer("float[]", out), ffi.from_buffer("int[]", classes), *args, *dims
                )
                return Result(out, classes)
            self.dense_relu(ffi.from_buffer("float[]", out), *args, *dims)
            x = out
        raise AssertionError("the model has no layers")

    def close(self) -> None:
        self._programs = ()


class NumpyModel:
    """The same weights (read back from the devices and unpacked), computed by numpy in the
    handler."""

    def __init__(self, layers: list[tuple[Any, Any]]) -> None:
        import numpy as np

        self.np = np
        self.layers = layers  #: (row-major weights, bias) as numpy arrays

    @classmethod
    async def create(cls, pipeline: Pipeline) -> NumpyModel:
        import numpy as np

        layers = []
        for stage in pipeline.stages:
            for layer, (w, b) in zip(stage.layers, stage.weights, strict=True):
                packed = np.frombuffer(await w.as_memoryview(), np.float32).copy()
                blocks = packed.reshape(-1, layer.n_in, TILE)  # (n_out / 16, n_in, 16)
                weights = blocks.transpose(1, 0, 2).reshape(layer.n_in, -1)[:, : layer.n_out]
                bias = np.frombuffer(await b.as_memoryview(), np.float32).copy()
                layers.append((np.ascontiguousarray(weights), bias))
        return cls(layers)

    def infer(self, pixels: array[float], rows: int) -> Result:
        np = self.np
        h = np.frombuffer(pixels, np.float32).reshape(rows, N_PIXELS)
        for w, b in self.layers[:-1]:
            h = np.maximum(h @ w + b, 0.0)
        w, b = self.layers[-1]
        logits = h @ w + b
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs = (e / e.sum(axis=1, keepdims=True)).astype(np.float32)
        return Result(
            array("f", probs.tobytes()), array("i", logits.argmax(axis=1).astype(np.int32).tobytes())
        )


def zero_result(pixels: array[float], rows: int) -> Result:
    """The ``http`` mode's answer: no model, zero probabilities and class 0 for every image, so
    bench/server.py can measure what the HTTP stack (parsing, validation, JSON) costs alone."""
    return Result(array("f", bytes(4 * N_CLASSES * rows)), array("i", bytes(4 * rows)))
