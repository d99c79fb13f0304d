"""The inference server's shutdown under load, as a user meets it: ``serve.py`` as a process,
``loadgen`` hammering it over keep-alive connections, SIGINT in the middle. Every request the
server accepted is answered (200, or a 503 the client may retry); after that the only failure a
client may see is a refused connection."""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import anyio
import anyio.streams.text
import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVER_DIR = ROOT / "examples" / "inference_server"
if str(ROOT / "examples") not in sys.path:
    sys.path.insert(0, str(ROOT / "examples"))

import loadgen  # noqa: E402

pytestmark = pytest.mark.anyio

TIMEOUT = 120  # seconds: a bound on every wait below, never a synchronisation


async def start_server(*extra: str) -> tuple[Any, str, anyio.streams.text.TextReceiveStream, list[str]]:
    argv = [sys.executable, str(SERVER_DIR / "serve.py"), "--port", "0", "--width", "128", *extra]
    process = await anyio.open_process(argv, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert process.stdout is not None
    lines = anyio.streams.text.TextReceiveStream(process.stdout)
    output = [""]
    with anyio.fail_after(TIMEOUT):
        async for chunk in lines:
            output[0] += chunk
            if "\n" in output[0].partition("serving")[2]:
                break
    url = output[0].partition(" on ")[2].split()[0]
    return process, url, lines, output


@pytest.mark.slow
async def test_sigint_under_load_answers_every_accepted_request(anyio_backend: Any) -> None:
    name, options = anyio_backend
    loop = "uvloop" if options.get("use_uvloop") else name
    process, url, lines, output = await start_server("--loop", loop)  # the server on this test's loop
    async with process:
        report: list[loadgen.LoadReport] = []

        async def load() -> None:
            report.append(
                await loadgen.run_load(
                    url, requests=4000, concurrency=48, batch=2, time_limit=TIMEOUT, timeout=60
                )
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(load)
            # SIGINT once the server has answered a good share of the load (polling its /stats)
            polls = 0
            async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
                with anyio.fail_after(TIMEOUT):
                    while (await client.get("/stats")).json()["requests"]["answered"] < 300:
                        polls += 1
                polls += 1
            process.send_signal(signal.SIGINT)
        with anyio.fail_after(TIMEOUT):
            async for chunk in lines:
                output[0] += chunk
            code = await process.wait()
    out = output[0]
    (result,) = report
    assert code == 0, out
    assert "SIGINT: draining" in out and "devices closed" in out, out
    assert result.statuses.get(200, 0) > 0, result.summary()
    assert set(result.statuses) <= {200, 503}, result.summary()
    # every HTTP request that reached the application was answered, and the client got each answer
    counts = re.search(r"HTTP requests: (\d+) received, (\d+) answered", out)
    assert counts is not None, out
    received, answered = int(counts.group(1)), int(counts.group(2))
    assert received == answered == result.statuses[200] + result.statuses.get(503, 0) + polls, (
        out + result.summary()
    )
    # a request the client sent and the server never saw shows as ReadError/RemoteProtocolError
    assert set(result.errors) <= {"ConnectError"}, result.summary()
