"""Weight publishing through Ray's object store to engines hosted by Ray actors (local cluster on
127.0.0.1, started and stopped by the test)."""

import asyncio
import os

import pytest
import torch

from learner.weight_sync import RaySync
from pipeline.runtime.ray import WorkerTarget

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    yield
    ray.shutdown()


@ray.remote
class EngineHost:
    def __init__(self):
        self.version, self.weights = 0, None

    async def update_weights(self, version, state_dict):
        self.version, self.weights = version, state_dict
        return None, version  # (why it failed, the version it serves), as GenerationWorker does

    def served(self):
        return self.version, float(sum(t.sum() for t in self.weights.values()))


def test_publish_reaches_every_ray_actor(cluster):
    hosts = [EngineHost.remote() for _ in range(3)]
    sync = RaySync([WorkerTarget(f"pool-{i}", h) for i, h in enumerate(hosts)])
    weights = {"a": torch.ones(4, 4), "b": torch.arange(6.0)}
    report = asyncio.run(sync.publish(weights, 1))
    assert report.seconds > 0 and report.published and report.served_version == 1
    assert ray.get([h.served.remote() for h in hosts]) == [(1, 31.0)] * 3
    report = asyncio.run(sync.publish(ray.put(weights), 2))  # an ObjectRef the learner put
    assert report.served_version == 2 and ray.get(hosts[0].served.remote()) == (2, 31.0)
    with pytest.raises(ValueError, match="must increase"):
        asyncio.run(sync.publish(weights, 2))
