"""Two learner ranks as Ray actors on two Ray nodes train exactly like one rank.

The cluster is two Ray nodes on this machine (a head and a second raylet, both on 127.0.0.1),
and the placement group is STRICT_SPREAD, so rank 0 (the runtime's `LearnerWorker`, on bundle
0) and rank 1 (an actor on bundle 1) run on different nodes and can meet only through the TCP
rendezvous, which must listen on loopback alone. A killed rank stops the next step with one line
naming it. (Two ranks resuming a checkpoint under Ray: tests/pipeline/test_ray_run.py; resumed
ranks against one rank: tests/learner/test_ranks.py.)
"""

import asyncio

import pytest

from learner.ranks import RankError
from learner.trainer import Learner
from pipeline.assets.tiny_policy import build_tiny_policy
from pipeline.config.schema import LearnerConfig, StrataConfig
from pipeline.runtime.ray_cluster import import_ray
from tests.conftest import assert_loopback_listeners, gpu_per_rank
from tests.learner.test_ranks import COMPARED, TEXTS, assert_same, groups, options


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return build_tiny_policy(tmp_path_factory.mktemp("policy") / "tiny", TEXTS, vocab_size=400)


@pytest.fixture
def two_nodes():
    ray = import_ray()
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        cluster.add_node(**node)
        ray.init(address=cluster.address, _node_ip_address="127.0.0.1", logging_level="WARNING")
        yield ray
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.system
@gpu_per_rank(2)
def test_two_ranks_on_two_ray_nodes_train_like_one(two_nodes, policy):
    import os

    from pipeline.runtime.ray_learner import LearnerWorker, learner_placement

    ray = two_nodes
    opts = options(zero_stage=2)
    config = StrataConfig.model_validate(
        {
            "learner": {**opts, "num_ranks": 2},
            "buffer": {"group_size": 4},
            "runtime": {"type": "ray", "learner_placement": "STRICT_SPREAD", "learner_num_cpus": 1},
        }
    )
    plain, batches = config.model_dump(mode="json"), [groups(1), groups(2)]

    placement = asyncio.run(learner_placement(config.runtime, 2))
    worker = (
        ray.remote(LearnerWorker).options(num_cpus=1, **placement).remote(plain, str(policy), 1)
    )
    nodes = ray.get(worker.nodes.remote(), timeout=300)
    assert len(nodes) == 2 and nodes[0] != nodes[1], nodes  # one rank per node
    metrics = [ray.get(worker.step.remote(b), timeout=300) for b in batches]
    weights = ray.get(worker.state_dict.remote())
    listeners = assert_loopback_listeners(os.getpid())  # Ray's processes and the ranks' store
    assert listeners, "no listener seen: the check looked at nothing"

    one = Learner(policy, LearnerConfig(**opts), group_size=4)
    reference = [one.step(b) for b in batches]
    for step, (a, b) in enumerate(zip(reference, metrics, strict=True)):
        for key in COMPARED:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (step, key)
        assert b["rank_count"] == 2.0 and b["rank/0/tokens"] > 0 and b["rank/1/tokens"] > 0
    assert_same(weights, one.state_dict())

    ray.kill(ray.get_actor("strata-learner-rank-1"))  # a dead rank stops the step in one line
    with pytest.raises(RankError) as stopped:
        ray.get(worker.step.remote(batches[0]), timeout=300)
    assert str(stopped.value.cause).startswith("learner rank 1 died during step 3"), stopped.value
    ray.get(worker.close.remote())
