"""The inference server example (examples/inference_server) and the load generator
(examples/loadgen.py), run in-process on a free loopback port, on every event loop."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from array import array
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.streams.text
import httpx
import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
SERVER_DIR = ROOT / "examples" / "inference_server"
for _path in (SERVER_DIR, ROOT / "examples"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import batcher  # noqa: E402
import loadgen  # noqa: E402
import mlp  # noqa: E402
import serve  # noqa: E402

from aiotinyrt import Device  # noqa: E402

pytestmark = pytest.mark.anyio

TIMEOUT = 60  # seconds: a bound on every wait below, never a synchronisation


@contextlib.asynccontextmanager
async def running_server(**overrides: Any) -> AsyncIterator[tuple[str, serve.Service]]:
    """The server on 127.0.0.1:<free port>, in this process; shut down (drained, devices closed)
    when the block exits."""
    # no quiet period at shutdown: these tests stop the server after their own requests ended
    config = serve.ServerConfig(**{"drain_quiet": 0.0, **overrides})
    sock = serve.listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    stop = anyio.Event()
    started: list[serve.Service] = []
    ready = anyio.Event()

    def on_ready(service: serve.Service) -> None:
        started.append(service)
        ready.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: serve.serve(config, sock, shutdown_trigger=stop.wait, on_ready=on_ready))
        with anyio.fail_after(TIMEOUT):
            await ready.wait()
        try:
            yield f"http://127.0.0.1:{port}", started[0]
        finally:
            stop.set()


def digits_body(test: mlp.TestSet, start: int, count: int) -> dict[str, Any]:
    return {"images": [test.image(i) for i in range(start, start + count)]}


# ---- serving ---------------------------------------------------------------------------------------
@pytest.mark.slow
async def test_load_generator_against_the_server_then_clean_shutdown() -> None:
    # (CPU and CPU:1 are shared with earlier tests: count only what the server allocates)
    before = {name: Device[name].allocator.statistics().bytes_in_use for name in ("CPU", "CPU:1")}
    async with running_server() as (url, service):
        report = await loadgen.run_load(url, requests=40, concurrency=8, batch=3, time_limit=TIMEOUT)
        async with httpx.AsyncClient(base_url=url) as client:
            stats = (await client.get("/stats")).json()
            health = await client.get("/healthz")
    assert report.statuses == {200: 40}, report.summary()
    assert report.ok == 40 and not report.errors
    assert len(report.latencies) == 40 and report.percentile(50) <= report.percentile(99)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert stats["requests"]["answered"] == 40
    assert stats["micro_batches"]["images"] == 120
    assert 1 <= stats["micro_batches"]["run"] <= 40
    assert stats["queue"] == {"requests": 0, "images": 0, "capacity_images": 1024}
    assert set(stats["devices"]) == {"CPU", "CPU:1"}
    for name, dev in stats["devices"].items():
        assert dev["timelines"]["compute"]["completed"] > 0, name
        assert dev["allocator"]["bytes_in_use"] > 0, name  # weights and activations stay resident
    # after shutdown: drained, synchronized, buffers freed, devices closed
    assert service.stopped.is_set()
    assert service.pipeline is not None
    assert all(dev.closed for dev in service.pipeline.devices)
    for dev in service.pipeline.devices:
        assert dev.allocator.statistics().bytes_in_use == before[dev.name], dev.name


@pytest.mark.slow
async def test_gc_freeze_holds_the_start_up_heap_while_serving_and_is_undone_at_stop() -> None:
    import gc

    assert gc.get_freeze_count() == 0
    async with running_server(gc_freeze=True) as (url, service):
        report = await loadgen.run_load(url, requests=8, concurrency=4, batch=2, time_limit=TIMEOUT)
        async with httpx.AsyncClient(base_url=url) as client:
            stats = (await client.get("/stats")).json()
        assert gc.get_freeze_count() > 0
    assert report.statuses == {200: 8}, report.summary()
    # the model, the app and the libraries were frozen before the first request was served
    assert stats["gc"]["frozen_objects"] > 10_000
    assert len(stats["gc"]["collections"]) == 3
    assert service.stopped.is_set() and gc.get_freeze_count() == 0


@pytest.mark.slow
async def test_served_accuracy_on_held_out_digits() -> None:
    _, test = mlp.load_digits_mlp()
    answers: dict[int, dict[str, Any]] = {}
    async with running_server() as (url, _), httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:

        async def post(start: int) -> None:
            count = min(60, len(test) - start)
            response = await client.post("/predict", json=digits_body(test, start, count))
            assert response.status_code == 200, response.text
            answers[start] = response.json()

        async with anyio.create_task_group() as tg:
            for start in range(0, len(test), 60):
                tg.start_soon(post, start)
    classes = [c for start in sorted(answers) for c in answers[start]["classes"]]
    probabilities = [p for start in sorted(answers) for p in answers[start]["probabilities"]]
    assert len(classes) == len(test) == 360
    accuracy = sum(int(c == y) for c, y in zip(classes, test.labels, strict=True)) / len(test)
    assert accuracy >= 0.95
    for c, probs in zip(classes, probabilities, strict=True):
        assert len(probs) == 10 and abs(sum(probs) - 1) < 1e-4
        assert probs.index(max(probs)) == c


async def test_pipeline_without_http_matches_a_single_device() -> None:
    """Splitting the layers over CPU and CPU:1 changes nothing in the answers."""
    spec, test = mlp.load_digits_mlp()
    one = await mlp.Pipeline.create(spec, ["CPU"], max_batch=64, slots=2)
    two = await mlp.Pipeline.create(spec, ["CPU", "CPU:1"], max_batch=64, slots=2)
    try:
        assert [len(s.layers) for s in two.stages] == [2, 2]
        assert await mlp.accuracy(two, test) == await mlp.accuracy(one, test) >= 0.95
        pixels = array("f", test.images[: 5 * 64])
        a, b = await one.infer(pixels, 5), await two.infer(pixels, 5)
        assert a.classes == b.classes
        assert max(abs(x - y) for x, y in zip(a.probabilities, b.probabilities, strict=True)) < 1e-6
    finally:
        await one.aclose()
        await two.aclose()
        await one.synchronize()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["blocking", "numpy"])
async def test_baseline_modes_agree_with_the_pipeline(mode: str) -> None:
    _, test = mlp.load_digits_mlp()
    body = digits_body(test, 0, 20)
    answers = []
    for m in ("pipelined", mode):
        async with running_server(mode=m) as (url, _), httpx.AsyncClient(base_url=url) as client:
            response = await client.post("/predict", json=body)
            assert response.status_code == 200, response.text
            answers.append(response.json())
    assert answers[0]["classes"] == answers[1]["classes"]
    for p, q in zip(answers[0]["probabilities"], answers[1]["probabilities"], strict=True):
        assert max(abs(x - y) for x, y in zip(p, q, strict=True)) < 1e-4


async def test_http_control_mode_answers_zeros_and_still_validates() -> None:
    """bench/server.py's control row: the HTTP stack alone, same interface and validation."""
    _, test = mlp.load_digits_mlp()
    async with running_server(mode="http") as (url, _), httpx.AsyncClient(base_url=url) as client:
        response = await client.post("/predict", json=digits_body(test, 0, 3))
        assert response.status_code == 200, response.text
        assert response.json() == {"classes": [0, 0, 0], "probabilities": [[0.0] * 10] * 3}
        bad = await client.post("/predict", json={"images": [[1] * 63]})
        assert bad.status_code == 422 and "64" in bad.text, bad.text


@pytest.mark.slow
async def test_width_builds_a_random_mlp_of_the_same_shape() -> None:
    async with running_server(width=40) as (url, service):
        report = await loadgen.run_load(url, requests=10, concurrency=4, batch=2, time_limit=TIMEOUT)
        assert service.pipeline is not None
        assert service.pipeline.spec.widths == [64, 40, 40, 40, 10]
    assert report.ok == 10, report.summary()


# ---- bad input -------------------------------------------------------------------------------------
GOOD_IMAGE = [3] * 64
# (what is wrong, body, expected status, words the error message must contain)
BAD_REQUESTS: list[tuple[str, bytes, int, str]] = [
    ("truncated-json", b'{"images": [[1, 2', 400, "malformed JSON"),
    ("not-utf8", b"\xff\xfe", 400, "malformed JSON"),
    ("not-an-object", b"[1, 2, 3]", 422, '{"images"'),
    ("no-images-key", b'{"pictures": []}', 422, '{"images"'),
    ("images-not-a-list", b'{"images": "abc"}', 422, "must be a list"),
    ("empty", b'{"images": []}', 422, "empty"),
    ("63-pixels", json.dumps({"images": [[1] * 63]}).encode(), 422, "image 0: expected a list of 64"),
    ("image-not-a-list", json.dumps({"images": [GOOD_IMAGE, 5]}).encode(), 422, "image 1"),
    ("string-pixel", json.dumps({"images": [[*[1] * 63, "x"]]}).encode(), 422, "pixel 63"),
    ("bool", json.dumps({"images": [[*[1] * 10, True, *[1] * 53]]}).encode(), 422, "pixel 10"),
    ("too-bright", json.dumps({"images": [[*[1] * 5, 17, *[1] * 58]]}).encode(), 422, "0..16"),
    ("negative", json.dumps({"images": [[-1, *[1] * 63]]}).encode(), 422, "pixel 0"),
    ("nan", b'{"images": [[NaN' + b", 1" * 63 + b"]]}", 422, "NaN"),
    ("infinity", b'{"images": [[1, -Infinity' + b", 1" * 62 + b"]]}", 422, "pixel 1"),
    ("huge-int", b'{"images": [[' + b"9" * 400 + b", 1" * 63 + b"]]}", 422, "pixel 0"),
    ("oversized-batch", json.dumps({"images": [GOOD_IMAGE] * 65}).encode(), 413, "at most 64"),
    ("oversized-body", b" " * 300_000, 413, "over the limit"),
]


@pytest.mark.slow
async def test_bad_input_gets_a_clear_4xx_and_the_server_keeps_serving() -> None:
    async with running_server() as (url, service), httpx.AsyncClient(base_url=url) as client:
        for what, body, status, message in BAD_REQUESTS:
            response = await client.post("/predict", content=body)
            assert response.status_code == status, (what, response.text)
            assert message in response.json()["error"], (what, response.text)
        assert (await client.get("/predict")).status_code == 405
        response = await client.post("/predict", json={"images": [GOOD_IMAGE, [0.5] * 64]})
        assert response.status_code == 200
        assert len(response.json()["classes"]) == 2
        assert service.statistics()["requests"]["bad_input"] == len(BAD_REQUESTS)


# ---- back-pressure and shutdown --------------------------------------------------------------------
@pytest.mark.slow
async def test_full_queue_answers_503_with_retry_after_and_drops_nothing() -> None:
    async with running_server(max_batch=4, queue_images=8) as (url, service):
        assert service.batcher is not None
        service.batcher.pause()
        statuses: list[int] = []
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:

            async def post() -> None:
                response = await client.post("/predict", json={"images": [GOOD_IMAGE] * 4})
                statuses.append(response.status_code)

            async with anyio.create_task_group() as tg:
                tg.start_soon(post)
                tg.start_soon(post)
                with anyio.fail_after(TIMEOUT):  # both accepted: 8 images, the capacity
                    await service.batcher.wait_until(lambda s: s.queued_images == 8)
                rejected = await client.post("/predict", json={"images": [GOOD_IMAGE]})
                service.batcher.resume()
        assert rejected.status_code == 503
        assert rejected.headers["retry-after"] == "1"
        assert "busy" in rejected.json()["error"]
        assert statuses == [200, 200]
        assert service.statistics()["requests"] == {
            "answered": 2,
            "bad_input": 0,
            "rejected_busy": 1,
            "errors": 0,
        }


@pytest.mark.slow
async def test_shutdown_drains_queued_requests_before_closing_devices() -> None:
    statuses: list[int] = []
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:

        async def post(url: str) -> None:
            response = await client.post(url + "/predict", json={"images": [GOOD_IMAGE] * 2})
            statuses.append(response.status_code)

        async with anyio.create_task_group() as tg:
            async with running_server() as (url, service):
                assert service.batcher is not None
                service.batcher.pause()
                for _ in range(5):
                    tg.start_soon(post, url)
                with anyio.fail_after(TIMEOUT):
                    await service.batcher.wait_until(lambda s: s.queued_requests == 5)
                devices = service.pipeline.devices if service.pipeline else []
                assert not any(dev.closed for dev in devices)
                # leaving this block triggers the shutdown while 5 requests wait in the paused queue
            assert devices and all(dev.closed for dev in devices)
    assert statuses == [200] * 5
    assert service.statistics()["requests"]["answered"] == 5
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(base_url=url) as late:
            await late.get("/healthz")


async def test_micro_batches_gather_queued_requests_without_splitting_them() -> None:
    spec, test = mlp.load_digits_mlp()
    pipeline = await mlp.Pipeline.create(spec, ["CPU", "CPU:1"], max_batch=8, slots=2)
    micro = batcher.MicroBatcher(
        acquire=pipeline.acquire,
        release=pipeline.release,
        run=pipeline.run,
        split=mlp.Result.split,
        max_batch=8,
        max_wait=0.0,
        capacity=64,
    )
    try:
        micro.pause()
        tickets = [micro.submit(array("f", test.images[i * 128 : (i + 1) * 128]), 2) for i in range(6)]
        with pytest.raises(ValueError, match=r"1\.\.8 images"):
            micro.submit(array("f", bytes(4 * 64 * 9)), 9)
        async with anyio.create_task_group() as tg:
            tg.start_soon(micro.run)
            micro.resume()
            results = [await t.result() for t in tickets]
            micro.close()
        stats = micro.statistics()
        assert (stats.batches, stats.requests, stats.images) == (2, 6, 12)  # 4 + 2 requests
        first = await pipeline.infer(array("f", test.images[: 8 * 64]), 8)
        second = await pipeline.infer(array("f", test.images[8 * 64 : 12 * 64]), 4)
        assert [c for r in results for c in r.classes] == [*first.classes, *second.classes]
        with pytest.raises(batcher.ShuttingDown):
            micro.submit(array("f", test.images[:64]), 1)
    finally:
        await pipeline.aclose()
        await pipeline.synchronize()


@pytest.mark.slow
async def test_loadgen_command_line_against_the_server() -> None:
    async with running_server() as (url, _):
        argv = [sys.executable, str(ROOT / "examples" / "loadgen.py"), "--url", url]
        argv += ["--requests", "12", "--concurrency", "3", "--batch", "2"]
        with anyio.fail_after(TIMEOUT):
            result = await anyio.run_process(argv, check=False)
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    assert "12 sent, 12 ok" in out and "p50" in out and "p99" in out and "200: 12" in out


def _loop_of(anyio_backend: Any) -> str:
    name, options = anyio_backend
    return "uvloop" if options.get("use_uvloop") else name


@pytest.mark.slow
async def test_serve_command_line_drains_on_sigterm(anyio_backend: Any) -> None:
    """``serve.py --port 0`` on this test's event loop; requests in flight when SIGTERM arrives
    are answered, then the process synchronizes, closes its devices and exits 0."""
    loop = _loop_of(anyio_backend)
    argv = [sys.executable, str(SERVER_DIR / "serve.py"), "--port", "0", "--loop", loop, "--width", "256"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    async with await anyio.open_process(argv, env=env) as process:
        assert process.stdout is not None
        lines = anyio.streams.text.TextReceiveStream(process.stdout)
        output = ""
        with anyio.fail_after(TIMEOUT):
            async for chunk in lines:
                output += chunk
                if "\n" in output.partition("serving")[2]:
                    break
        assert f"({loop}, pipelined" in output, output
        url = output.partition(" on ")[2].split()[0]
        statuses: list[int] = []
        first = anyio.Event()
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:

            async def post() -> None:
                response = await client.post("/predict", json={"images": [GOOD_IMAGE] * 8})
                statuses.append(response.status_code)
                first.set()

            async with anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(post)
                with anyio.fail_after(TIMEOUT):
                    await first.wait()
                process.send_signal(signal.SIGTERM)
        with anyio.fail_after(TIMEOUT):
            async for chunk in lines:
                output += chunk
            code = await process.wait()
    assert code == 0, output
    assert "SIGTERM: draining" in output and "devices closed" in output, output
    # answered, or refused with 503 once draining began: never dropped
    assert len(statuses) == 8 and set(statuses) <= {200, 503} and statuses[0] == 200, statuses


async def test_device_names_are_checked_before_serving() -> None:
    with pytest.raises(ValueError, match="unknown device backend"):
        await mlp.Pipeline.create(mlp.random_mlp(8), ["NOPE"])
    with pytest.raises(ValueError, match="mode"):
        serve.ServerConfig(mode="fast")
    assert Device.canonicalize("cpu:1") in serve.ServerConfig(devices=("cpu", "cpu:1")).devices


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text exposition, parsed by prometheus-client's own parser."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_metrics_in_prometheus_text_format() -> None:
    async with running_server() as (url, _service):
        report = await loadgen.run_load(url, requests=12, concurrency=3, batch=2, time_limit=TIMEOUT)
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            bad = await client.post("/predict", content=b'{"images": [[1, 2')
            response = await client.get("/metrics")
    assert report.statuses == {200: 12} and bad.status_code == 400
    assert response.status_code == 200
    assert response.headers["content-type"] == CONTENT_TYPE_LATEST  # text/plain; version=...
    assert CONTENT_TYPE_LATEST.startswith("text/plain")
    samples = _samples(response.text)

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("aiotinyrt_server_requests_total", endpoint="/predict", status="200") == 12
    assert value("aiotinyrt_server_requests_total", endpoint="/predict", status="400") == 1
    assert value("aiotinyrt_server_request_seconds_count", endpoint="/predict") == 13
    assert value("aiotinyrt_server_request_seconds_bucket", endpoint="/predict", le="+Inf") == 13
    assert value("aiotinyrt_server_request_seconds_sum", endpoint="/predict") > 0
    # every image of the load went through one micro-batch
    assert value("aiotinyrt_server_batch_images_sum") == 12 * 2
    assert 1 <= value("aiotinyrt_server_batch_images_count") <= 12
    for device in ("CPU", "CPU:1"):
        assert value("aiotinyrt_device_busy_seconds_total", device=device) > 0
        assert value("aiotinyrt_allocator_bytes", device=device, state="in_use") > 0
        assert value("aiotinyrt_allocator_bytes", device=device, state="peak") >= value(
            "aiotinyrt_allocator_bytes", device=device, state="in_use"
        )
    assert value("aiotinyrt_server_queued_images") == 0
