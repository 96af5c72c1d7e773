"""A learner of N ranks, started: rank 0's `ranked_learner`, which starts ranks 1..N-1 as
processes on this machine (`ProcessPeers`, each running `_rank_main`) or as Ray actors
(learner/ray_ranks.py), and what a rank process does until rank 0 stops it. How the ranks
meet, split a step and fail is learner/ranks.py.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import traceback
from typing import Any

import torch

from learner.ranks import (
    RankPeers,
    RankSpec,
    RayPlacement,
    _receive,
    _send,
    first_line,
    run_command,
)
from learner.ray_ranks import RayPeers
from learner.trainer import Learner


def ranked_learner(
    model_path: str | os.PathLike[str],
    config: Any,
    world: int,
    threads: int,
    placement: RayPlacement | None = None,
    **kwargs,
):
    """Rank 0 of a learner of `world` ranks, in this process (which must not be in a process
    group yet), with ranks 1..world-1 started as processes, or as Ray actors with `placement`;
    `learner.peers.close()` stops them."""
    spec = RankSpec(str(model_path), config, kwargs, threads)
    if placement is None:
        peers, where = ProcessPeers.start(world, spec)
    else:  # imports ray only here, for the ray runtime
        peers, where = RayPeers.start(world, spec, placement)
    try:
        learner = Learner(
            model_path,
            config,
            rank=(0, world, where),
            peers=peers,
            before_join=lambda: peers.gather("model load"),
            **kwargs,
        )
        peers.gather("start")
    except BaseException:
        peers.close()
        raise
    return learner


def _rank_main(rank: int, world: int, store_path: str, spec: RankSpec, conn) -> None:
    """A rank process: build the learner, then serve rank 0's commands until told to stop."""
    torch.set_num_threads(spec.threads)
    try:
        learner = Learner(
            spec.model_path,
            spec.config,
            rank=(rank, world, store_path),
            before_join=lambda: _send(conn, ("ok", None)),
            **spec.kwargs,
        )
    except BaseException as exc:
        _report(conn, rank, exc)
        return
    _send(conn, ("ok", None))
    while True:
        try:
            command, payload = _receive(conn)
        except (EOFError, OSError):  # rank 0 is gone
            return
        if command == "stop":
            _send(conn, ("ok", None))
            return
        try:
            _send(conn, ("ok", run_command(learner, command, payload)))
        except BaseException as exc:
            _report(conn, rank, exc)
            return


def _report(conn, rank: int, exc: BaseException) -> None:
    """A rank's failure: its traceback on its stderr, one line to rank 0."""
    print(f"strata: learner rank {rank}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    with contextlib.suppress(OSError):
        _send(conn, ("error", first_line(exc)))


class ProcessPeers(RankPeers):
    """Ranks 1..N-1 as processes on this machine, commands over pipes."""

    def __init__(self, world: int, store_dir: str, processes: list, conns: list) -> None:
        super().__init__(world)
        self.store_dir, self.processes, self.conns = store_dir, processes, conns

    @classmethod
    def start(cls, world: int, spec: RankSpec) -> tuple[ProcessPeers, str]:
        """Start ranks 1..world-1; returns the peers and the store rank 0 joins with."""
        store_dir = tempfile.mkdtemp(prefix="strata-ranks-")
        store_path = os.path.join(store_dir, "store")
        context = mp.get_context("spawn")  # never fork a process holding threads and a torch pool
        processes, conns = [], []
        for rank in range(1, world):
            here, there = context.Pipe()
            process = context.Process(
                target=_rank_main,
                args=(rank, world, store_path, spec, there),
                name=f"strata-learner-rank-{rank}",
                daemon=True,
            )
            process.start()
            there.close()
            processes.append(process)
            conns.append(here)
        return cls(world, store_dir, processes, conns), store_path

    def _post(self, rank: int, command: str, payload: Any) -> bool:
        try:
            _send(self.conns[rank - 1], (command, payload))
            return True
        except OSError:  # a broken pipe: the rank is gone
            return False

    def _answer(self, rank: int) -> tuple[str, Any]:
        try:
            return _receive(self.conns[rank - 1])
        except (EOFError, OSError):
            return "dead", None

    def _dead(self, rank: int, wait_s: float) -> bool:
        process = self.processes[rank - 1]
        process.join(timeout=wait_s)
        return not process.is_alive()

    def _how(self, rank: int) -> str:
        process = self.processes[rank - 1]
        process.join(timeout=1)
        code = process.exitcode
        return "still running" if code is None else f"exit code {code}"

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):  # a rank already gone
                _send(conn, ("stop", None))
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.store_dir, ignore_errors=True)
