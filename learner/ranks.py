"""The learner as N DeepSpeed ranks in one torch.distributed group (`learner.num_ranks`).

Rank 0 is the `Learner` the runtime already holds; ranks 1..N-1 are processes started here
(`RankPeers.start`), each building the same `Learner` from the same model and config and then
doing what rank 0 tells it over a pipe:

    rank 0                                   rank r (r >= 1)
    step(groups): validate, advantages       |
      split the groups by tokens   --------> train(its groups' rows)
      train(its own rows)                     |  the step's collectives: token totals, DeepSpeed's
      <--- metrics, seconds, idle ----------  |  gradient reduction, the micro-step count
    checkpoint: save its part      --------> save its part (ZeRO 1-2: its optimizer shard)
    resume: load                   --------> load

A group is never split across ranks, so per-group and per-stratum statistics stay exact (rank 0
computes every advantage on the whole step anyway). The loss normalisation is global: each
rank's micro-batch loss is weighted by its share of the step's tokens (or sequences) summed over
all ranks, and multiplied by N because DeepSpeed averages gradients over ranks, so the update is
that of one rank on the whole batch. Ranks with fewer micro-batches run empty ones (a zero loss
through the model) so every rank makes the same collective calls.

Rendezvous: a `FileStore` in a private temporary directory (no listening socket) and gloo bound to
the loopback interface (GLOO_SOCKET_IFNAME=lo unless set) on CPU; NCCL on GPUs. Ranks on other
machines (Ray placement groups) are not wired yet: the local runtime starts every rank on this
machine.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


class RankError(RuntimeError):
    """A learner rank died or failed: the step cannot complete; resume from the last checkpoint."""


def split_by_tokens(tokens: list[int], ranks: int) -> list[list[int]]:
    """Indices of `tokens` (one entry per group) dealt to `ranks` ranks so their token sums are
    as even as a greedy deal makes them: largest group first, to the rank with fewest tokens so
    far (ties: lowest rank). Deterministic; each rank's indices in ascending order."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    load = [0] * ranks
    shares: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        shares[rank].append(i)
        load[rank] += tokens[i]
    return [sorted(share) for share in shares]


def init_rank_group(rank: int, world: int, store_path: str) -> None:
    """Join the learner's process group: gloo over loopback on CPU, NCCL on GPUs."""
    import deepspeed
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pairs connect over loopback only
    for name, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", world)):
        os.environ[name] = str(value)
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.FileStore(store_path, world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    deepspeed.init_distributed(dist_backend=backend, verbose=False)


@dataclass(frozen=True)
class RankSpec:
    """What a rank process needs to build its `Learner` (all picklable)."""

    model_path: str
    config: Any  # the learner config section
    kwargs: dict
    threads: int


def ranked_learner(
    model_path: str | os.PathLike[str], config: Any, world: int, threads: int, **kwargs
):
    """Rank 0 of a learner of `world` ranks, in this process (which must not be in a process
    group yet), with ranks 1..world-1 started as processes; `learner.peers.close()` stops them."""
    from learner.trainer import Learner

    peers, store = RankPeers.start(world, RankSpec(str(model_path), config, kwargs, threads))
    try:
        learner = Learner(model_path, config, rank=(0, world, store), peers=peers,
                          before_join=lambda: peers.gather("model load"), **kwargs)  # fmt: skip
        peers.gather("start")
    except BaseException:
        peers.close()
        raise
    return learner


def _rank_main(rank: int, world: int, store_path: str, spec: RankSpec, conn) -> None:
    """A rank process: build the learner, then serve rank 0's commands until told to stop."""
    from learner.checkpoint import load_checkpoint, save_rank_part
    from learner.trainer import Learner

    torch.set_num_threads(spec.threads)
    try:
        learner = Learner(spec.model_path, spec.config, rank=(rank, world, store_path),
                          before_join=lambda: conn.send(("ok", None)), **spec.kwargs)  # fmt: skip
    except BaseException as exc:
        _report(conn, rank, exc)
        return
    conn.send(("ok", None))
    while True:
        try:
            command, payload = conn.recv()
        except (EOFError, OSError):  # rank 0 is gone
            return
        if command == "stop":
            conn.send(("ok", None))
            return
        try:
            if command == "train":
                result = learner.train_rows(*payload)
            elif command == "state_dict":  # ZeRO-3: the gather is collective
                learner.state_dict()
                result = None
            elif command == "save":
                save_rank_part(learner, Path(payload))
                result = None
            elif command == "load":
                load_checkpoint(learner, payload)
                result = learner.version
            else:
                raise ValueError(f"unknown command {command!r}")
            conn.send(("ok", result))
        except BaseException as exc:
            _report(conn, rank, exc)
            return


def _report(conn, rank: int, exc: BaseException) -> None:
    """A rank's failure: its traceback on its stderr, one line to rank 0."""
    print(f"strata: learner rank {rank}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    with contextlib.suppress(OSError):
        conn.send(("error", f"{type(exc).__name__}: {line}" if line else type(exc).__name__))


class RankPeers:
    """Ranks 1..N-1 of the learner, seen from rank 0: started together, told the same command,
    answered in rank order. A rank that dies or fails ends the call with `RankError`."""

    def __init__(self, world: int, store_dir: str, processes: list, conns: list) -> None:
        self.world, self.store_dir = world, store_dir
        self.processes, self.conns = processes, conns
        self.broken: RankError | None = None  # the first failure; every later call raises it

    @classmethod
    def start(cls, world: int, spec: RankSpec) -> tuple[RankPeers, str]:
        """Start ranks 1..world-1; returns the peers and the store rank 0 joins with."""
        store_dir = tempfile.mkdtemp(prefix="strata-ranks-")
        store_path = os.path.join(store_dir, "store")
        context = mp.get_context("spawn")  # never fork a process holding threads and a torch pool
        processes, conns = [], []
        for rank in range(1, world):
            here, there = context.Pipe()
            process = context.Process(target=_rank_main, args=(rank, world, store_path, spec, there),
                                      name=f"strata-learner-rank-{rank}", daemon=True)  # fmt: skip
            process.start()
            there.close()
            processes.append(process)
            conns.append(here)
        return cls(world, store_dir, processes, conns), store_path

    def send(self, command: str, payloads: list) -> None:
        """`payloads[i]` goes to rank i + 1."""
        self._check()
        for rank, (conn, payload) in enumerate(zip(self.conns, payloads, strict=True), start=1):
            try:
                conn.send((command, payload))
            except OSError:  # a broken pipe: the rank is gone
                raise self._fail(f"learner rank {rank} died before {command}: {self._how(rank)}") from None  # fmt: skip

    def broadcast(self, command: str, payload: Any = None) -> None:
        self.send(command, [payload] * len(self.conns))

    def gather(self, command: str) -> list:
        """Every rank's answer to `command`, in rank order."""
        self._check()
        results = []
        for rank, conn in enumerate(self.conns, start=1):
            try:
                status, result = conn.recv()
            except (EOFError, OSError):
                raise self._fail(f"learner rank {rank} died during {command}: {self._how(rank)}") from None  # fmt: skip
            if status == "error":  # the rank printed its traceback to its stderr
                raise self._fail(f"learner rank {rank} failed during {command}: {result}")
            results.append(result)
        return results

    def failure(self, during: str, exc: BaseException) -> RankError:
        """The error for a step whose collectives failed: which rank is gone (gloo's own error
        for that is pages long), else the first line of what was raised. Every later call
        raises the same error: the ranks are out of step and only a resume mends them."""
        if self.broken is None:
            for rank in range(1, self.world):
                self.processes[rank - 1].join(
                    timeout=2
                )  # its socket can close before its exit shows
                if not self.processes[rank - 1].is_alive():
                    return self._fail(
                        f"learner rank {rank} died during {during}: {self._how(rank)}"
                    )
            if isinstance(exc, RankError):
                return self._fail(str(exc))
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return self._fail(f"the learner's ranks failed during {during}: {first}")
        return self.broken

    def _fail(self, message: str) -> RankError:
        if self.broken is None:
            self.broken = RankError(message)
        return self.broken

    def _check(self) -> None:
        if self.broken is not None:
            raise self.broken

    def _how(self, rank: int) -> str:
        process = self.processes[rank - 1]
        process.join(timeout=1)
        code = process.exitcode
        return "still running" if code is None else f"exit code {code}"

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):  # a rank already gone
                conn.send(("stop", None))
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.store_dir, ignore_errors=True)
