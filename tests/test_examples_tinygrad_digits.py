"""examples/tinygrad_digits: the tinygrad CNN trains through AIO, and serves the held-out digits
over HTTP with the shipped weights at the accuracy the training script reached."""

from __future__ import annotations

import contextlib
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
async def running(**overrides: Any) -> AsyncIterator[str]:
    config = serve.ServerConfig(**overrides)
    sock = serve.listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    stop = anyio.Event()
    ready = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: serve.serve(config, sock, shutdown_trigger=stop.wait, on_ready=lambda _: ready.set())
        )
        with anyio.fail_after(TIMEOUT):
            await ready.wait()
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            stop.set()


@pytest.mark.anyio
@pytest.mark.slow
async def test_served_accuracy_on_the_held_out_digits_is_at_least_097() -> None:
    images, labels = model.held_out()
    predicted = np.full(len(labels), -1)
    async with running() as url, httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:

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
    async with running() as url, httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        assert (await client.post("/predict", content=b"{nope")).status_code == 400
        assert (await client.post("/predict", json={"images": [[1, 2]]})).status_code == 422
        assert (await client.post("/predict", json={"images": [[17] * 64]})).status_code == 422
        assert (await client.post("/predict", json={"images": [["a"] * 64]})).status_code == 422
        assert (await client.post("/predict", json={"images": [[0] * 64] * 65})).status_code == 413
        assert (await client.get("/healthz")).status_code == 200
