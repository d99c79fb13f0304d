"""The test run's one local Ray cluster (``ray.cluster_utils.Cluster``: a head node with two
CPUs, no dashboard; a second node joins only for the test that asks for it) and its device host
``t``, shared by tests/test_ray.py, the conformance suite's RAY device and the pipeline example's
Ray run. Started by the first test that needs it, shut down at the end of the run. Ray is
imported only then, so runs without Ray tests never load it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from aiotinyrt import Device

#: The device host every Ray test shares.
HOST = "t"
#: Object store per node: Ray's minimum is ~75 MiB; the tests move a few MiB at most.
STORE_BYTES = 100 * 1024 * 1024


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """A ``ray.cluster_utils.Cluster`` this process is connected to, with host ``t`` started."""
    ray = pytest.importorskip("ray")
    cluster_utils = pytest.importorskip("ray.cluster_utils")
    from aiotinyrt import ray as airay  # (imports Ray: only once a test needs the cluster)

    cluster = cluster_utils.Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "object_store_memory": STORE_BYTES, "include_dashboard": False},
    )
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        actor = airay.start_host(HOST)
        assert ray.get(actor.ping.remote(), timeout=120) == HOST
        yield cluster
    finally:
        for dev in Device.opened():
            if dev.name.startswith("RAY:"):
                dev._shutdown(drop_queued=True, join_timeout=1.0)
        airay._CONNECTIONS.clear()
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture
def ray_host(ray_cluster: Any) -> str:
    """The name of the shared device host (``RAY:t/CPU`` and so on)."""
    return HOST
