"""examples/tinygrad_digits: the tinygrad CNN trains through AIO, and serves the held-out digits
over HTTP with the shipped weights at the accuracy the training script reached."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import sys
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import pytest
from tinygrad import Tensor

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tinygrad_digits"
if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))


def _example(name: str) -> types.ModuleType:
    """``examples/tinygrad_digits/<name>.py``, by path: the inference server example has a
    ``serve`` module too, and a plain ``import serve`` returns whichever was imported first."""
    spec = importlib.util.spec_from_file_location(f"tinygrad_digits_{name}", EXAMPLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


model = _example("model")
serve = _example("serve")

import aiotinyrt as rt  # noqa: E402

TIMEOUT = 120  # seconds: a bound on every wait below, never a synchronisation


@pytest.mark.slow
def test_a_few_training_steps_through_aio_lower_the_loss() -> None:
    images, labels = model.held_out()  # (the shipped held-out set stands in for training data)
    cnn = model.DigitsCNN.init("AIO:3", seed=1)
    compute = rt.Device["CPU:3"]._compute_queue.timeline
    before = compute.submitted
    losses = model.train(cnn, images, labels, steps=8, batch=64, lr=1e-2, seed=1)
    assert compute.submitted > before  # the kernels ran on aiotinyrt's CPU:3
    assert all(np.isfinite(losses))
    assert np.mean(losses[-3:]) < losses[0] - 0.2, losses


@contextlib.asynccontextmanager
async def running(**overrides: Any) -> AsyncIterator[tuple[str, Any]]:
    """The example server on a free port: its URL and its ``Service``."""
    config = serve.ServerConfig(**overrides)
    sock = serve.listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    stop = anyio.Event()
    services: list[Any] = []
    ready = anyio.Event()

    def on_ready(service: Any) -> None:
        services.append(service)
        ready.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: serve.serve(config, sock, shutdown_trigger=stop.wait, on_ready=on_ready))
        with anyio.fail_after(TIMEOUT):
            await ready.wait()
        try:
            yield f"http://127.0.0.1:{port}", services[0]
        finally:
            stop.set()


@pytest.mark.anyio
@pytest.mark.slow
async def test_served_accuracy_on_the_held_out_digits_is_at_least_097() -> None:
    images, labels = model.held_out()
    predicted = np.full(len(labels), -1)
    async with running() as (url, _), httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:

        async def ask(start: int) -> None:
            rows = images[start : start + 6]
            reply = await client.post("/predict", json={"images": rows.tolist()})
            assert reply.status_code == 200, reply.text
            body = reply.json()
            assert np.allclose(np.sum(body["probabilities"], axis=1), 1, atol=1e-4)
            predicted[start : start + len(rows)] = body["classes"]

        with anyio.fail_after(TIMEOUT):
            async with anyio.create_task_group() as tg:  # many requests in flight at once
                for start in range(0, len(labels), 6):
                    tg.start_soon(ask, start)
        stats = (await client.get("/stats")).json()
    accuracy = float((predicted == labels).mean())
    assert accuracy >= 0.97, accuracy
    assert stats["images"] >= len(labels) and stats["batches"] < len(range(0, len(labels), 6))  # batched


@pytest.mark.anyio
@pytest.mark.slow
async def test_bad_requests_get_clear_status_codes() -> None:
    async with running() as (url, _), httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        assert (await client.post("/predict", content=b"{nope")).status_code == 400
        assert (await client.post("/predict", json={"images": [[1, 2]]})).status_code == 422
        assert (await client.post("/predict", json={"images": [[17] * 64]})).status_code == 422
        assert (await client.post("/predict", json={"images": [["a"] * 64]})).status_code == 422
        assert (await client.post("/predict", json={"images": [[0] * 64] * 65})).status_code == 413
        assert (await client.get("/healthz")).status_code == 200


def _reference(rows: np.ndarray) -> np.ndarray:
    """The model's probabilities on tinygrad's own CPU device (a worker thread: synchronous)."""
    cnn = model.DigitsCNN.load("CPU")
    return cnn(Tensor(rows.astype(np.float32), device="CPU")).softmax(axis=1).numpy()  # type: ignore[no-any-return]


@pytest.mark.anyio
@pytest.mark.slow
async def test_two_replicas_on_aio_and_aio_1_both_serve_and_answer_alike() -> None:
    images, _ = model.held_out()
    rows = images[:8]
    expected = await anyio.to_thread.run_sync(_reference, rows)
    parts = [rows[0:4], rows[0:4], rows[4:8], rows[4:8]]
    answers = []
    async with (
        running(devices=("AIO", "AIO:1")) as (url, _),
        httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client,
    ):
        for part in parts:  # one at a time: the micro-batches alternate between the replicas
            reply = await client.post("/predict", json={"images": part.tolist()})
            assert reply.status_code == 200, reply.text
            answers.append(np.array(reply.json()["probabilities"], np.float32))
        stats = (await client.get("/stats")).json()
    assert stats["replicas"] == {"AIO": 2, "AIO:1": 2}  # each image pair went to both devices
    assert np.array_equal(answers[0], answers[1]) and np.array_equal(answers[2], answers[3])
    np.testing.assert_allclose(np.concatenate([answers[0], answers[2]]), expected, atol=1e-5)


@pytest.mark.anyio
@pytest.mark.slow
async def test_while_serving_the_collector_never_scans_the_model_or_its_captured_jit() -> None:
    # A full collection scans every tracked object on the loop thread: with the ~300,000 that
    # loading and capturing leave, 150-550 ms of loop lag. Counted, not timed: after warm-up
    # they are frozen (out of every generation), and serving adds few objects that stay alive.
    images, _ = model.held_out()
    async with running() as (url, service), httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        replica = service.replicas[0]
        captured = replica.forward.captured
        assert captured is not None and gc.is_tracked(captured)
        frozen = gc.get_freeze_count()

        async def ask(start: int) -> None:
            reply = await client.post("/predict", json={"images": images[start : start + 4].tolist()})
            assert reply.status_code == 200, reply.text

        with anyio.fail_after(TIMEOUT):
            async with anyio.create_task_group() as tg:
                for start in range(0, 96, 4):
                    tg.start_soon(ask, start)
        stats = (await client.get("/stats")).json()
        assert stats["images"] == 96
        assert replica.forward.captured is captured  # served by replays: no new capture
        scanned = gc.get_objects()
        assert not any(obj is captured or obj is replica.model.params["fc_w"] for obj in scanned)
        assert frozen > 100_000 and len(scanned) < frozen // 20, (len(scanned), frozen)
        del scanned
    assert gc.get_freeze_count() == 0  # given back when the server stopped
