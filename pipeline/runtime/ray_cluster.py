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
from typing import TYPE_CHECKING

from learner.ranks import is_loopback
from pipeline.backends.runtime import RuntimeUnavailable

if TYPE_CHECKING:
    from pipeline.backends.ray import RayRuntime

LOOPBACK_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Set to 0, Ray takes loopback as this node's address and every process of a cluster started
here (GCS, raylet, workers, agents) listens on 127.0.0.1 only; left alone, they listen on all
interfaces (`::`, 0.0.0.0) and the runtime-env agent on the machine's address, whatever
`_node_ip_address` says. Ray reads it once, when `ray` is first imported."""

WORKERS = {"worker_process_setup_hook": "pipeline.runtime.startup.paused"}
"""Every worker of a run imports its actor's module with the collector paused; the actors'
constructors resume it (pipeline/runtime/startup.py)."""


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


def start_ray(runtime: RayRuntime, needed: dict[str, float], private_gpus: int = 0) -> None:
    """Join `runtime.address` or start a private cluster bound to `runtime.node_ip` with this
    machine's CPUs and `private_gpus` GPUs. The launch checked a private cluster's size and a
    joined one's address before the assets were built (`RayRuntime.refused`); a joined cluster
    has what it has, checked here once joined (Ray would otherwise wait for it forever)."""
    ray = import_ray(runtime.node_ip)
    handler = signal.getsignal(signal.SIGTERM)
    try:
        if runtime.address:
            ray.init(
                address=runtime.address,
                _node_ip_address=runtime.node_ip,
                logging_level="WARNING",
                log_to_driver=True,
                runtime_env=WORKERS,
            )
        else:
            ray.init(
                address="local",  # None would join the machine's latest cluster (ray_current_cluster)
                _node_ip_address=runtime.node_ip,
                num_cpus=os.cpu_count() or 1,
                num_gpus=private_gpus,
                include_dashboard=False,
                logging_level="WARNING",
                log_to_driver=True,
                runtime_env=WORKERS,
            )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = runtime.address or runtime.node_ip
        raise RuntimeUnavailable(
            f"cannot start or join the Ray cluster at {where}: {exc}"
        ) from None
    finally:
        signal.signal(signal.SIGTERM, handler)  # ours: checkpoint and flush on SIGTERM
    if runtime.address:  # a joined cluster has what it has: check it
        problem = missing_resources(needed, ray.cluster_resources())
        if problem:
            ray.shutdown()
            raise RuntimeUnavailable(problem)


def unreachable(address: str, timeout_s: float = 5.0) -> str | None:
    """Why nothing would answer at the Ray cluster `address` (ray.init would retry for minutes),
    or None: host:port accepts a TCP connection, or the address has another form (left to Ray)."""
    import socket

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "://" in address:
        return None
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return None
    except OSError:
        return (
            f"no Ray cluster answers at runtime.address {address}: start one there "
            "(ray start --head --node-ip-address=127.0.0.1) or leave runtime.address null for a private one"
        )


def missing_resources(needed: dict[str, float], have: Mapping[str, float]) -> str | None:
    """What the roles ask for beyond what the cluster has, in one line, or None."""
    for resource, amount in needed.items():
        if amount > have.get(resource, 0.0) + 1e-9:
            return (
                f"the roles ask for {amount:g} {resource} but the Ray cluster has {have.get(resource, 0):g}: "
                "lower runtime.actor_num_cpus / learner_num_cpus (fractions work) or actors.num_pools"
            )
    return None


def actor_gone_errors() -> tuple[type[BaseException], ...]:
    """Ray's exceptions for an actor that died or is being restarted (the names vary by version)."""
    import ray.exceptions as rx

    return tuple(
        getattr(rx, name)
        for name in ("RayActorError", "ActorUnavailableError", "ActorDiedError")
        if hasattr(rx, name)
    )
