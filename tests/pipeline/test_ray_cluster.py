"""`runtime.address: null` starts a private Ray cluster, whatever other clusters this machine has.

Left to itself, `ray.init()` without an address joins RAY_ADDRESS or the machine's latest cluster
(Ray's `ray_current_cluster` file): a run would then land on somebody else's cluster, or fail
because a private cluster's CPU and GPU counts cannot be given to a joined one.
"""

import pytest

from pipeline.backends.ray import RayRuntime
from pipeline.runtime.ray_cluster import import_ray, start_ray


def test_a_private_cluster_ignores_ray_address_and_binds_loopback(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")  # nothing listens there
    ray = import_ray()
    if ray.is_initialized():
        pytest.fail("a Ray cluster is already initialised in this test process")
    start_ray(RayRuntime(), {"CPU": 0.5})
    try:
        gcs = ray.get_runtime_context().gcs_address
        assert gcs.startswith("127.0.0.1:") and gcs != "127.0.0.1:9"
        assert ray.cluster_resources()["CPU"] >= 1

        @ray.remote(num_cpus=0.5)
        def collecting() -> bool:
            import gc

            return gc.isenabled()

        # its workers start with the collector paused (an actor's constructor resumes it)
        assert ray.get(collecting.remote(), timeout=120) is False
    finally:
        ray.shutdown()
