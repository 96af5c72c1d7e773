"""The learner under `runtime.type: ray`: `LearnerWorker`, the Ray actor that holds it, and the
placement group its ranks share (`learner.num_ranks` > 1: the worker is rank 0 on bundle 0,
ranks 1..N-1 are actors on the other bundles, learner/ray_ranks.py)."""

from __future__ import annotations

import asyncio

import torch

from learner.checkpoint import load_checkpoint, save_checkpoint
from learner.weight_sync import write_checkpoint
from pipeline.backends.ray import RayRuntime
from pipeline.backends.runtime import RuntimeUnavailable
from pipeline.config.schema import StrataConfig
from pipeline.runtime.parts import close_learner, make_learner
from pipeline.runtime.startup import resumed


class LearnerWorker:
    """The learner (DeepSpeed) in its own process; weights leave it as CPU tensors."""

    def __init__(self, config: dict, policy_dir: str, threads: int) -> None:
        resumed()  # the worker imported this module with the collector paused
        torch.set_num_threads(threads)
        self.learner = make_learner(StrataConfig.model_validate(config), policy_dir)

    def version(self) -> int:
        return self.learner.version

    def step(self, groups: list) -> dict:
        return self.learner.step(groups)

    def state_dict(self) -> dict:
        return {name: t.detach().cpu() for name, t in self.learner.state_dict().items()}

    def save_weights(self, directory: str) -> str:
        """The current weights as an HF checkpoint `directory/vNNNNNN` for inference servers to
        load (on storage they can read); the driver's CheckpointSync prunes old ones."""
        learner = self.learner
        path = write_checkpoint(
            directory, learner.version, learner.state_dict(), learner.model, learner.tokenizer
        )
        return str(path)

    def save(self, directory: str, extra: dict) -> str:
        return str(save_checkpoint(self.learner, directory, extra))

    def load(self, directory: str) -> dict:
        return load_checkpoint(self.learner, directory)

    def nodes(self) -> list[str]:
        """The Ray node id of each rank, rank 0 first."""
        import ray

        peers = getattr(self.learner, "peers", None)
        return [ray.get_runtime_context().get_node_id()] + (
            peers.nodes() if peers is not None else []
        )

    def close(self) -> None:
        """Stop the learner's other ranks (learner.num_ranks > 1)."""
        close_learner(self.learner)


async def learner_placement(runtime: RayRuntime, ranks: int, timeout_s: float = 120.0) -> dict:
    """The learner actor's scheduling options: with several ranks, bundle 0 of a placement group
    of one bundle per rank (runtime.learner_num_cpus/gpus each, runtime.learner_placement), whose
    other bundles its ranks take (learner/ray_ranks.py). Ray would wait forever for bundles it cannot
    place: after `timeout_s` that is one line instead."""
    if ranks == 1:
        return {}
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {"CPU": runtime.learner_num_cpus, "GPU": runtime.learner_num_gpus}
    bundle = {k: v for k, v in bundle.items() if v > 0} or {"CPU": 0.01}  # a bundle is never empty
    group = placement_group([bundle] * ranks, strategy=runtime.learner_placement)
    try:
        await asyncio.wait_for(group.ready(), timeout_s)
    except TimeoutError:
        remove_placement_group(group)
        raise RuntimeUnavailable(
            f"the Ray cluster cannot place the learner's {ranks} ranks ({runtime.learner_placement}, "
            f"{bundle} each) within {timeout_s:g} s: add nodes, lower runtime.learner_num_cpus/gpus "
            "or learner.num_ranks, or use runtime.learner_placement PACK"
        ) from None
    return {
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=0
        )
    }
