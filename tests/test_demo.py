"""``python -m aiotinyrt demo``: runs the digits MLP pipeline within a time bound, on every loop,
from the package alone (weights and held-out images are package data)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import numpy as np
import pytest

from aiotinyrt import digits

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "aiotinyrt" / "data" / "digits_mlp.npz"
SERVER_DIR = ROOT / "examples" / "inference_server"
if str(SERVER_DIR) not in sys.path:
    sys.path.insert(0, str(SERVER_DIR))

import mlp  # noqa: E402

TIME_BOUND = 90  # seconds; the demo's target is 30 s with a warm compile cache on 2 cores


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["asyncio", "trio", "uvloop"])
def test_demo_runs_the_digits_pipeline_and_prints_a_table(loop: str) -> None:
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "aiotinyrt", "demo", "--loop", loop],
        capture_output=True,
        text=True,
        timeout=TIME_BOUND,
        check=False,
        cwd=ROOT / "tests",  # not the repository root: the package is found as installed
    )
    elapsed = time.perf_counter() - start
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert elapsed < TIME_BOUND
    devices_line = next(line for line in out.splitlines() if line.startswith("devices: "))
    assert "CPU" in devices_line.split() or "CPU," in devices_line.split()  # (CL, CPU, NULL here)
    assert "compile (cache hit)" in out  # the first part is kept
    assert "compiling the MLP kernels" in out  # progress while compiling
    rows = [line for line in out.splitlines() if line.startswith("  digits ") or line.startswith("  random-")]
    assert len(rows) == 4, out
    assert sum("CPU -> CPU:1" in row for row in rows) == 2
    for row in rows:
        images_per_s = re.search(r"\s([\d,]+)\s", row.split("flight", 1)[1])
        assert images_per_s is not None and int(images_per_s.group(1).replace(",", "")) > 0, row
    accuracy = re.search(r"held-out accuracy through the served path: ([\d.]+) \(ok\)", out)
    assert accuracy is not None and float(accuracy.group(1)) >= 0.95, out
    # honest figures: the two-device rows beside the machine's ceiling, measured in this run
    ceiling = re.search(r"parallel ceiling, CPU \+ CPU:1\s+([\d.]+)x on (\d+) cores", out)
    assert ceiling is not None and float(ceiling.group(1)) > 0, out
    assert int(ceiling.group(2)) == os.cpu_count()
    assert f"two devices can give at most {ceiling.group(1)}x here ({os.cpu_count()} cores" in out
    assert "(wall time)" in out and "kernel time per batch, per stage" in out and "vs CPU alone" in out
    assert sum(bool(re.search(r"flight\s+[\d,]+\s+[\d.]+x\s", row)) for row in rows) == 2, rows
    # the weights file named where the installed package keeps it
    weights = re.search(r"\(weights: (.+?)\)\n", out)
    assert weights is not None and Path(weights.group(1)) == digits.weights_path(), out
    assert Path(weights.group(1)).is_absolute() and Path(weights.group(1)).is_file()


def test_weights_read_without_numpy_equal_numpy() -> None:
    with np.load(DATA) as ref:
        for reader in (digits.read_npz, mlp.read_npz):
            arrays = reader(DATA)
            assert set(arrays) == set(ref.files)
            for name, (values, shape) in arrays.items():
                assert shape == ref[name].shape, name
                assert np.array_equal(np.frombuffer(values, ref[name].dtype).reshape(shape), ref[name]), name
    spec, test = mlp.load_digits_mlp(DATA)
    assert spec.widths == [64, 64, 64, 64, 10]
    assert len(test) == 360 and set(test.labels) == set(range(10))


def test_every_subpackage_is_installed() -> None:
    """``pip install .`` installs only the packages pyproject.toml lists: each folder of the
    package with an ``__init__.py`` must be one of them (or its modules are missing there)."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "aiotinyrt").rglob("__init__.py")
    }
    assert found - listed == set()


def test_weights_are_package_data() -> None:
    """``pip install .`` must install aiotinyrt/data/digits_mlp.npz, or the demo cannot run."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = config["tool"]["setuptools"]
    assert "aiotinyrt" in setuptools["packages"]
    patterns = setuptools.get("package-data", {}).get("aiotinyrt", [])
    assert any(fnmatch("data/digits_mlp.npz", p) for p in patterns), (
        f"pyproject.toml [tool.setuptools.package-data] aiotinyrt = {patterns} does not include "
        "data/digits_mlp.npz"
    )
