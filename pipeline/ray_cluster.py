"""Starting or joining the Ray cluster a `runtime.type: ray` run uses, with the checks that turn
Ray's waits into one-line errors: a private cluster bound to 127.0.0.1 (`_node_ip_address` plus
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, see environment.md), a `runtime.address` where nothing
listens (ray.init would retry for minutes), and roles asking for more CPUs or GPUs than the
cluster has (Ray would wait for them forever).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping

from pipeline.config import RayRuntime
from pipeline.streaming import RuntimeUnavailable


def start_ray(runtime: RayRuntime, needed: dict[str, float], reserved_gpus: int = 0) -> None:
    """Join `runtime.address` or start a private cluster bound to `runtime.node_ip`; check it has
    the CPUs and GPUs the roles ask for (Ray would otherwise wait for them forever). A private
    cluster leaves this machine's last `reserved_gpus` GPUs out (the SGLang servers the launcher
    starts take them; Ray hands out the first ones)."""
    import ray

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if not runtime.address:  # a private cluster gets this machine's CPUs and GPUs: check first
        import torch

        gpus = max(0, torch.cuda.device_count() - reserved_gpus)
        _check_resources(needed, {"CPU": float(os.cpu_count() or 1), "GPU": float(gpus)})
    elif not _reachable(runtime.address):  # ray.init would retry for minutes
        raise RuntimeUnavailable(
            f"no Ray cluster answers at runtime.address {runtime.address}: start one there "
            "(ray start --head --node-ip-address=127.0.0.1) or leave runtime.address null for a private one"
        )
    handler = signal.getsignal(signal.SIGTERM)
    try:
        if runtime.address:
            ray.init(address=runtime.address, _node_ip_address=runtime.node_ip,
                     logging_level="WARNING", log_to_driver=True)  # fmt: skip
        else:
            ray.init(_node_ip_address=runtime.node_ip, num_cpus=os.cpu_count() or 1,
                     num_gpus=gpus, include_dashboard=False,
                     logging_level="WARNING", log_to_driver=True)  # fmt: skip
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = runtime.address or runtime.node_ip
        raise RuntimeUnavailable(
            f"cannot start or join the Ray cluster at {where}: {exc}"
        ) from None
    finally:
        signal.signal(signal.SIGTERM, handler)  # ours: checkpoint and flush on SIGTERM
    if runtime.address:  # a joined cluster has what it has: check it
        try:
            _check_resources(needed, ray.cluster_resources())
        except RuntimeUnavailable:
            ray.shutdown()
            raise


def _reachable(address: str, timeout_s: float = 5.0) -> bool:
    """Whether host:port accepts a TCP connection (other address forms are left to Ray)."""
    import socket

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "://" in address:
        return True
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def _check_resources(needed: dict[str, float], have: Mapping[str, float]) -> None:
    for resource, amount in needed.items():
        if amount > have.get(resource, 0.0) + 1e-9:
            raise RuntimeUnavailable(
                f"the roles ask for {amount:g} {resource} but the Ray cluster has {have.get(resource, 0):g}: "
                "lower runtime.actor_num_cpus / learner_num_cpus (fractions work) or actors.num_pools"
            )
