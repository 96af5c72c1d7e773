"""The reward's named parts and its failures in Prometheus (pipeline/runtime/metrics.py): one
gauge with a `component` label, one counter advanced from the actors' running totals."""

from prometheus_client import generate_latest

from actors.tools import ToolStats
from pipeline.runtime.metrics import RunMetrics
from pipeline.runtime.stream import ActorStats


def test_reward_components_and_errors_are_exported():
    metrics = RunMetrics()
    step = {"reward_mean": 0.5, "reward/judge/correct": 0.75, "reward/format": 1.0}
    metrics.observe_step(step, [], 0.0)
    actors = {
        "a": ActorStats(1, 10, ToolStats(), reward_errors=3),
        "b": ActorStats(1, 5, ToolStats()),
    }
    metrics.sample(_Buffer(), actors)
    actors["a"] = ActorStats(1, 20, ToolStats(), reward_errors=5)  # two more since
    actors["b"] = ActorStats(1, 9, ToolStats(), reward_errors=1)
    metrics.sample(_Buffer(), actors)
    text = generate_latest(metrics.registry).decode()
    assert 'strata_reward_component{component="judge/correct"} 0.75' in text
    assert 'strata_reward_component{component="format"} 1.0' in text
    assert "strata_reward_errors_total 6.0" in text
    metrics.observe_step({"reward/format": 0.5}, [], 0.0)  # the last step's mean
    assert (
        'strata_reward_component{component="format"} 0.5'
        in generate_latest(metrics.registry).decode()
    )


class _Buffer:
    """The buffer's counters as `sample` reads them, all 0."""

    released = filtered = dropped_stale = abandoned = rejected = abandoned_groups = 0
    open_groups = ready_groups = 0
