"""Learner ranks 1..N-1 as Ray actors (the ray runtime's half of learner/ranks.py, which says how
the ranks work together): rank r is a `RankActor` on bundle r of the learner's placement group,
told what to do by rank 0 through `RayPeers`, and the ranks meet through a `TCPStore` that rank
0 serves from a socket it binds itself (torch's own would listen on every interface)."""

from __future__ import annotations

import contextlib
import gc
import ipaddress
import socket
import sys
import threading
import traceback
from collections import deque
from dataclasses import replace
from typing import Any

import torch

from learner.ranks import (
    RankError,
    RankPeers,
    RankSpec,
    RayPlacement,
    TcpRendezvous,
    first_line,
    run_command,
)
from learner.trainer import Learner


class RankActor:
    """Rank r >= 1 as a Ray actor (`RayPeers`). Its `Learner` is built on a thread of its own so
    that `loaded` can answer once the model is loaded, while the rank waits at the rendezvous,
    and `started` once it has joined; `run` then carries out rank 0's commands. Every method
    answers ("ok", result) or ("error", one line), as a rank process does over its pipe."""

    def __init__(self, rank: int, world: int, where: TcpRendezvous, spec: RankSpec) -> None:
        # A run's workers import their actor's module with the collector paused (the runtime's
        # worker_process_setup_hook): freeze what that made and collect from here on.
        gc.freeze()
        gc.enable()
        torch.set_num_threads(spec.threads)
        self.rank, self.learner = rank, None
        self.error: str | None = None
        self._loaded, self._started = threading.Event(), threading.Event()

        def build() -> None:
            try:
                self.learner = Learner(
                    spec.model_path,
                    spec.config,
                    rank=(rank, world, where),
                    before_join=self._loaded.set,
                    **spec.kwargs,
                )
            except BaseException as exc:
                self._failed(exc)
            self._loaded.set()
            self._started.set()

        threading.Thread(target=build, name=f"strata-rank-{rank}-build", daemon=True).start()

    def _failed(self, exc: BaseException) -> tuple[str, str]:
        print(
            f"strata: learner rank {self.rank}:\n{traceback.format_exc()}",
            file=sys.stderr,
            flush=True,
        )
        self.error = self.error or first_line(exc)
        return "error", self.error

    def loaded(self) -> tuple[str, Any]:
        self._loaded.wait()
        return ("error", self.error) if self.error else ("ok", None)

    def started(self) -> tuple[str, Any]:
        self._started.wait()
        return ("error", self.error) if self.error else ("ok", None)

    def node(self) -> str:
        """The Ray node this rank runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def run(self, command: str, payload: Any) -> tuple[str, Any]:
        if self.error:
            return "error", self.error
        try:
            return "ok", run_command(self.learner, command, payload)
        except BaseException as exc:
            return self._failed(exc)


class RayPeers(RankPeers):
    """Ranks 1..N-1 as Ray actors (`RankActor`) on bundles 1..N-1 of the learner's placement
    group; a command is an actor call, answered in the order given (the actors run one call at
    a time)."""

    def __init__(self, world: int, actors: list, listener: socket.socket) -> None:
        super().__init__(world)
        self.actors, self.listener = actors, listener
        self.pending: list[deque] = [deque() for _ in actors]

    @classmethod
    def start(
        cls, world: int, spec: RankSpec, placement: RayPlacement
    ) -> tuple[RayPeers, TcpRendezvous]:
        """Bind the rendezvous socket, start ranks 1..world-1; returns the peers and the
        rendezvous rank 0 joins with (the one with the socket)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        host = placement.host or ray.util.get_node_ip_address()
        try:
            listener = socket.create_server(
                (host, placement.port), family=_family(host), backlog=128
            )
        except OSError as exc:
            raise RankError(
                f"the learner's rendezvous cannot listen on {host}:{placement.port}: "
                f"{exc.strerror or exc}: set runtime.learner_rendezvous_host/port"
            ) from None
        where = TcpRendezvous(host, listener.getsockname()[1])
        actors = []
        remote = ray.remote(RankActor)
        for rank in range(1, world):
            options: dict[str, Any] = dict(
                num_cpus=placement.num_cpus,
                num_gpus=placement.num_gpus,
                name=f"strata-learner-rank-{rank}",
                max_restarts=0,
            )
            if placement.placement_group is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement.placement_group, placement_group_bundle_index=rank
                )
            actors.append(remote.options(**options).remote(rank, world, where, spec))
        peers = cls(world, actors, listener)
        for queue, actor in zip(peers.pending, actors, strict=True):
            queue.extend((actor.loaded.remote(), actor.started.remote()))
        return peers, replace(where, listen_fd=listener.fileno())

    def _post(self, rank: int, command: str, payload: Any) -> bool:
        self.pending[rank - 1].append(self.actors[rank - 1].run.remote(command, payload))
        return True  # a dead actor shows in its answer

    def _answer(self, rank: int) -> tuple[str, Any]:
        import ray

        try:
            return ray.get(self.pending[rank - 1].popleft())
        except ray.exceptions.RayActorError:
            return "dead", None

    def _dead(self, rank: int, wait_s: float) -> bool:
        import ray

        try:  # a live rank stuck in a failed collective answers late: alive
            ray.get(self.actors[rank - 1].node.remote(), timeout=wait_s)
        except ray.exceptions.RayActorError:
            return True
        except ray.exceptions.GetTimeoutError:
            pass
        return False

    def _how(self, rank: int) -> str:
        return "its Ray actor is gone" if self._dead(rank, wait_s=1.0) else "still running"

    def nodes(self) -> list[str]:
        """The Ray node of each rank 1..N-1."""
        import ray

        return ray.get([actor.node.remote() for actor in self.actors])

    def close(self) -> None:
        import ray

        for actor in self.actors:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(actor, no_restart=True)
        self.listener.close()


def _family(host: str) -> socket.AddressFamily:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:  # a host name
        return socket.AF_INET
