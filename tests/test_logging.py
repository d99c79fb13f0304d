"""DEBUG output goes through the standard logging module (logger ``aiotinyrt`` and children); the
environment's ``DEBUG=n`` still turns it on. Each case runs in a fresh interpreter, as a service
would start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Opens CPU, compiles a kernel (a fresh cache, so the compiler runs), allocates, launches, frees.
WORKLOAD = """
import anyio
from aiotinyrt import Buffer, Device, dtypes

SRC = "void k(float* out, int n) { for (int i = 0; i < n; i++) out[i] = (float)i; }"

async def main() -> None:
    dev = Device["CPU"]
    prog = await dev.program("k", SRC)
    async with Buffer("CPU", 8, dtypes.float32) as buf:
        await prog(buf, vals=(8,))

anyio.run(main)
"""

# The same, with the application's own logging configured first: records are collected as JSON.
ROUTED = (
    """
import json, logging, sys
records = []

class Collect(logging.Handler):
    def emit(self, record):
        records.append({"name": record.name, "level": record.levelname, "message": record.getMessage()})

logging.basicConfig(level=logging.WARNING, handlers=[Collect()])
"""
    + WORKLOAD
    + """
print(json.dumps(records))
"""
)


def run(source: str, tmp_path: Path, debug: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DEBUG"}
    env["CACHEDB"] = str(tmp_path / "cache.db")  # a compile-cache miss: the compiler's source is logged
    if debug is not None:
        env["DEBUG"] = debug
    script = tmp_path / "script.py"
    script.write_text(source)
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False, env=env
    )


def test_debug_1_logs_device_opens_to_stderr_through_logging(tmp_path: Path) -> None:
    result = run(WORKLOAD, tmp_path, "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""  # nothing printed on stdout any more
    assert "aiotinyrt.device: opened device CPU (CPUDevice)" in result.stderr.splitlines(), result.stderr


@pytest.mark.slow
def test_without_debug_nothing_is_logged(tmp_path: Path) -> None:
    result = run(ROUTED, tmp_path, None)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
    assert result.stderr == ""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("level", "logger", "fragment"),
    [
        ("1", "aiotinyrt.device", "opened device CPU"),
        ("2", "aiotinyrt.queue", "CPU/compute@1: k "),  # per-launch timing
        ("4", "aiotinyrt.compiler", "void k(float* out"),  # kernel source
        ("7", "aiotinyrt.allocator", "CPU: alloc 32 B"),
        ("7", "aiotinyrt.allocator", "CPU: free 32 B"),
    ],
)
def test_debug_levels_reach_the_applications_handlers(
    tmp_path: Path, level: str, logger: str, fragment: str
) -> None:
    result = run(ROUTED, tmp_path, level)
    assert result.returncode == 0, result.stderr
    records = json.loads(result.stdout)
    assert all(r["name"].startswith("aiotinyrt.") and r["level"] == "DEBUG" for r in records), records
    assert any(r["name"] == logger and fragment in r["message"] for r in records), records
    assert result.stderr == ""  # routed by the application's handler, no handler of our own


def test_the_environment_is_read_at_each_call_however_it_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """helpers.getenv reads os.environ's own encoded dict: a variable set, changed and removed
    through os.environ (or monkeypatch) is seen at once, as os.environ.get sees it."""
    from aiotinyrt.helpers import getenv, getenv_str

    monkeypatch.delenv("AIOTINYRT_TEST_VAR", raising=False)
    assert getenv("AIOTINYRT_TEST_VAR", 3) == 3 and getenv_str("AIOTINYRT_TEST_VAR", "x") == "x"
    monkeypatch.setenv("AIOTINYRT_TEST_VAR", "7")
    assert getenv("AIOTINYRT_TEST_VAR") == 7
    os.environ["AIOTINYRT_TEST_VAR"] = "caf\\u00e9"
    assert getenv_str("AIOTINYRT_TEST_VAR") == "caf\\u00e9" == os.environ.get("AIOTINYRT_TEST_VAR")
    os.environ.update({"AIOTINYRT_TEST_VAR": "9"})
    assert getenv("AIOTINYRT_TEST_VAR") == 9
    del os.environ["AIOTINYRT_TEST_VAR"]
    assert getenv("AIOTINYRT_TEST_VAR", 5) == 5


def test_the_environment_replaced_by_another_mapping_is_the_one_read() -> None:
    """A test that puts a plain mapping in place of os.environ (mock.patch) is read through it."""
    from unittest import mock

    from aiotinyrt.helpers import getenv

    with mock.patch("os.environ", {"AIOTINYRT_TEST_VAR": "7"}):
        assert getenv("AIOTINYRT_TEST_VAR", 50) == 7
    assert getenv("AIOTINYRT_TEST_VAR", 50) == 50


def test_an_environment_mapping_encoding_its_names_otherwise_is_read_with_its_own_names() -> None:
    """An os._Environ-like mapping put in place of os.environ with another encoding of its names
    is read through that encoding, and what it encoded is not used for os.environ afterwards."""
    from unittest import mock

    from aiotinyrt.helpers import getenv

    name = "aiotinyrt_test_mixed_case"  # (read here first, under the replacement)
    upper = os._Environ({name.upper(): "1"}, str.upper, str, str, str)  # type: ignore[attr-defined]
    with mock.patch("os.environ", upper):
        assert getenv(name) == 1
    os.environ[name] = "3"
    try:
        assert getenv(name) == 3
    finally:
        del os.environ[name]
