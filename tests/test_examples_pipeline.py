"""examples/pipeline.py runs, at a small size: in process on every event loop, and as a script."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import numpy as np
import pytest

pytestmark = pytest.mark.anyio

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "pipeline.py"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("examples_pipeline", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


pipeline = load_example()


async def test_main_runs_every_configuration_and_reports_a_rate_for_each(
    capsys: pytest.CaptureFixture[str],
) -> None:
    results = await pipeline.main(batches=6, size=64, iters=5, depth=2)
    assert set(results) == {
        "one device (CPU, CPU)",
        "two devices (CPU, CPU:1)",
        "two devices, graph replay per micro-batch",
    }
    assert all(rate > 0 for rate in results.values())
    assert "outputs identical" in capsys.readouterr().out


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize(
    ("graph", "group"),
    [(False, 2), (True, 1), (True, 2), (True, 3)],
    ids=["eager", "graph-group1", "graph-group2", "graph-group3"],
)
async def test_pipeline_outputs_equal_running_the_stages_one_batch_at_a_time(
    depth: int, graph: bool, group: int
) -> None:
    rng = np.random.default_rng(depth)
    batches = [rng.random(32, dtype=np.float32) for _ in range(13)]
    one = await pipeline.TwoStagePipeline.create(("CPU", "CPU"), 32, 3, 1)
    two = await pipeline.TwoStagePipeline.create(("CPU", "CPU:1"), 32, 3, depth, group)
    try:
        # depth 1 on one device, each batch run on its own: the reference
        expected = [(await one.run([batch]))[0] for batch in batches]
        got = await (two.run_graph(batches) if graph else two.run(batches))
    finally:
        await one.aclose()
        await two.aclose()
    assert len(got) == len(batches)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert np.array_equal(a, b), f"micro-batch {i}"
    assert not np.array_equal(expected[0], batches[0]), "the stages did nothing"


@pytest.mark.slow
def test_the_script_runs_and_prints_throughput() -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--batches", "4", "--size", "64", "--iters", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "micro-batches/s" in result.stdout
    assert "outputs identical in every configuration" in result.stdout


async def test_create_frees_what_it_allocated_when_it_fails_part_way(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiotinyrt import Buffer, Device

    devices = [Device["CPU"], Device["CPU:1"]]
    before = [d.allocator.statistics().bytes_in_use for d in devices]
    real_allocate = Buffer.allocate
    calls = 0

    async def failing_fifth(self: Buffer, opaque: object = None) -> Buffer:
        nonlocal calls
        calls += 1
        if calls == 5:
            raise MemoryError("injected")
        return await real_allocate(self, opaque)

    monkeypatch.setattr(Buffer, "allocate", failing_fifth)
    with pytest.raises(MemoryError, match="injected"):
        await pipeline.TwoStagePipeline.create(("CPU", "CPU:1"), 64, 2, 2)
    assert calls == 5
    for device in devices:
        await device.synchronize()
    assert [d.allocator.statistics().bytes_in_use for d in devices] == before


async def test_aclose_frees_everything_even_inside_a_cancelled_scope() -> None:
    from aiotinyrt import Device

    devices = [Device["CPU"], Device["CPU:1"]]
    before = [d.allocator.statistics().bytes_in_use for d in devices]
    pipe = await pipeline.TwoStagePipeline.create(("CPU", "CPU:1"), 64, 2, 2)
    assert [d.allocator.statistics().bytes_in_use for d in devices] != before
    with anyio.CancelScope() as scope:
        scope.cancel()
        await pipe.aclose()
    for device in devices:
        await device.synchronize()
    assert [d.allocator.statistics().bytes_in_use for d in devices] == before


@pytest.mark.slow  # (it needs the test run's local Ray cluster)
def test_the_ray_flag_runs_the_stages_on_two_ray_hosts(ray_cluster: Any) -> None:
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.address}  # join the run's cluster
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--ray", "--batches", "4", "--size", "64", "--iters", "2"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert pipeline.RAY_CONFIG[0] in result.stdout and "two devices (CPU, CPU:1)" in result.stdout
    assert "outputs identical in every configuration" in result.stdout
