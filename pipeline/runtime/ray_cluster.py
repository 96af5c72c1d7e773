"""Starting or joining the Ray cluster a `runtime.type: ray` run uses, with the checks that turn
Ray's waits into one-line errors: a private cluster bound to 127.0.0.1 (`_node_ip_address` plus
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before ray is imported, see `import_ray`), a `runtime.address` where nothing
listens (ray.init would retry for minutes), and roles asking for more CPUs or GPUs than the
cluster has (Ray would wait for them forever).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping

from learner.ranks import is_loopback
from pipeline.backends.ray import RayRuntime
from pipeline.backends.runtime import RuntimeUnavailable

LOOPBACK_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Set to 0, Ray takes loopback as this node's address and every process of a cluster started
here (GCS, raylet, workers, agents) listens on 127.0.0.1 only; left alone, they listen on all
interfaces (`::`, 0.0.0.0) and the runtime-env agent on the machine's address, whatever
`_node_ip_address` says. Ray reads it once, when `ray` is first imported."""


def import_ray(node_ip: str = "127.0.0.1"):
    """`import ray`, with Ray kept on loopback when `node_ip` is a loopback address: the only
    way any module of ours may import ray before starting or joining a cluster."""
    if is_loopback(node_ip) and os.environ.get(LOOPBACK_ONLY) != "1":
        os.environ[LOOPBACK_ONLY] = "0"  # read by the processes the cluster starts, too
        if "ray" in sys.modules:  # imported by someone else first: its constant is already read
            from ray._private import ray_constants

            ray_constants.ENABLE_RAY_CLUSTER = False  # looked up at call time by ray's services
    import ray

    return ray


def start_ray(runtime: RayRuntime, needed: dict[str, float], reserved_gpus: int = 0) -> None:
    """Join `runtime.address` or start a private cluster bound to `runtime.node_ip`; check it has
    the CPUs and GPUs the roles ask for (Ray would otherwise wait for them forever). A private
    cluster leaves this machine's last `reserved_gpus` GPUs out (the SGLang servers the launcher
    starts take them; Ray hands out the first ones)."""
    ray = import_ray(runtime.node_ip)
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
            ray.init(
                address=runtime.address,
                _node_ip_address=runtime.node_ip,
                logging_level="WARNING",
                log_to_driver=True,
            )
        else:
            ray.init(
                address="local",  # None would join the machine's latest cluster (ray_current_cluster)
                _node_ip_address=runtime.node_ip,
                num_cpus=os.cpu_count() or 1,
                num_gpus=gpus,
                include_dashboard=False,
                logging_level="WARNING",
                log_to_driver=True,
            )
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


def actor_gone_errors() -> tuple[type[BaseException], ...]:
    """Ray's exceptions for an actor that died or is being restarted (the names vary by version)."""
    import ray.exceptions as rx

    return tuple(
        getattr(rx, name)
        for name in ("RayActorError", "ActorUnavailableError", "ActorDiedError")
        if hasattr(rx, name)
    )
