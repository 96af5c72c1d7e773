"""Weight publishing through Ray's object store to engines hosted by Ray actors (local cluster on
127.0.0.1, started and stopped by the test)."""

import asyncio
import os

import pytest
import torch

from learner.weight_sync import RaySync

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield
    ray.shutdown()


@ray.remote
class EngineHost:
    def __init__(self):
        self.version, self.weights = 0, None

    async def update_weights(self, version, state_dict):
        self.version, self.weights = version, state_dict

    def served(self):
        return self.version, float(sum(t.sum() for t in self.weights.values()))


def test_publish_reaches_every_ray_actor(cluster):
    hosts = [EngineHost.remote() for _ in range(3)]
    sync = RaySync(hosts)
    weights = {"a": torch.ones(4, 4), "b": torch.arange(6.0)}
    seconds = asyncio.run(sync.publish(weights, 1))
    assert seconds > 0
    assert ray.get([h.served.remote() for h in hosts]) == [(1, 31.0)] * 3
    with pytest.raises(ValueError, match="must increase"):
        asyncio.run(sync.publish(weights, 1))
