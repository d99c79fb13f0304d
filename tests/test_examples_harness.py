"""The async test harness example (examples/async_harness) passes, and its leak check can fail."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "examples" / "async_harness"
TIMEOUT = 300


def run_pytest(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """pytest in a subprocess (the harness has its own conftest.py and fixtures); it inherits
    this session's CACHEDB, so it shares the private compile cache."""
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "anyio", "-p", "no:cacheprovider", *args]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT, check=False)


@pytest.mark.slow
def test_async_harness_passes_on_every_device_and_loop() -> None:
    result = run_pytest(str(HARNESS), "-rA", cwd=ROOT)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    passed = re.search(r"(\d+) passed", out)
    assert passed is not None and int(passed.group(1)) >= 60, out
    # parametrized over devices and event loops
    for ident in (
        "asyncio-CPU]",
        "trio-CPU:1]",
        "test_many_kernels_concurrently",
        "test_two_device_pipeline",
    ):
        assert ident in out, ident


@pytest.mark.slow
def test_harness_leak_check_fails_a_test_that_leaks(tmp_path: Path) -> None:
    shutil.copy(HARNESS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_leaky.py").write_text(
        "import pytest\n"
        "from aiotinyrt import Buffer, dtypes\n"
        "pytestmark = pytest.mark.anyio\n"
        "@pytest.mark.parametrize('anyio_backend', ['asyncio'])\n"
        "async def test_forgets_a_buffer(device, anyio_backend):\n"
        "    await Buffer(device.name, 100, dtypes.float32).allocate()\n"
        "async def test_frees_its_buffer(device):\n"
        "    buf = await Buffer(device.name, 100, dtypes.float32).allocate()\n"
        "    await buf.free()\n"
    )
    result = run_pytest(str(tmp_path), cwd=tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "device memory leaked" in out and "400 bytes in 1 allocations" in out, out
    assert re.search(r"(\d+) passed", out) is not None and "2 errors" in out, out
