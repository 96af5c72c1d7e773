"""The learner as N DeepSpeed ranks in one torch.distributed group (`learner.num_ranks`).

Rank 0 is the `Learner` the runtime already holds; ranks 1..N-1 are started by
`learner.ranked.ranked_learner` (processes, or Ray actors: learner/ray_ranks.py), each building the same `Learner` from the same model and config and then
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

Where the ranks run and how they meet:
- processes (the local runtime): ranks 1..N-1 are processes rank 0 starts on its machine, told
  what to do over pipes; they meet through a `FileStore` in a private temporary directory (no
  listening socket).
- Ray actors (the ray runtime, learner/ray_ranks.py): rank r is an actor on bundle r of the
  learner's placement group (rank 0 is the learner's actor, on bundle 0), so ranks may sit on
  other machines; commands are actor calls. They meet through a `TCPStore` that rank 0 serves
  from a socket it binds itself on `runtime.learner_rendezvous_host` (default: its node's Ray
  address, 127.0.0.1 on a private cluster): torch's own would listen on every interface.
Gloo is bound to the loopback interface (GLOO_SOCKET_IFNAME=lo unless set) when the ranks meet
on loopback; across machines it takes the interface of the machine's host name unless
GLOO_SOCKET_IFNAME says otherwise. On GPUs the group is NCCL's for CUDA tensors and gloo's for
the CPU tensors of the ranks' own agreements (`process_group_backend`).
"""

from __future__ import annotations

import ipaddress
import os
import pickle
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from learner.checkpoint import load_checkpoint, save_rank_part
from learner.deepspeed_ops import load_cpu_op


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


@dataclass(frozen=True)
class TcpRendezvous:
    """A `TCPStore` at host:port, served by rank 0 from `listen_fd`, a socket it bound itself
    (None in what the other ranks are given)."""

    host: str
    port: int
    listen_fd: int | None = None


def is_loopback(host: str) -> bool:
    """Whether `host` (an address, or localhost) is this machine's loopback."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return host == "localhost"


def process_group_backend() -> str:
    """The backend of the learner's process group: with CUDA and NCCL, NCCL for CUDA tensors
    (DeepSpeed's gathers and reductions) and gloo for CPU ones (the trainer's own agreements:
    `_all_max`, `_all_sum`, `all_gather_object`), else gloo. A group of "nccl" alone has no CPU
    backend: configs/gaia.yaml's ranks stopped at their first forward (issue 68)."""
    import torch.distributed as dist

    if torch.cuda.is_available() and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def init_rank_group(rank: int, world: int, where: str | TcpRendezvous) -> None:
    """Join the learner's process group at `where` (a FileStore path, or a TcpRendezvous),
    its backend `process_group_backend()`'s."""
    import deepspeed
    import torch.distributed as dist

    load_cpu_op()  # before DeepSpeed asks for it: learner/deepspeed_ops.py
    backend = process_group_backend()
    if not isinstance(where, TcpRendezvous) or is_loopback(where.host):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pairs connect over loopback only
    for name, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", world)):
        os.environ[name] = str(value)
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if isinstance(where, TcpRendezvous):
        store = dist.TCPStore(
            where.host,
            where.port,
            world,
            rank == 0,
            timeout=timedelta(minutes=10),
            wait_for_workers=False,
            master_listen_fd=where.listen_fd,
        )
    else:
        store = dist.FileStore(where, world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    deepspeed.init_distributed(dist_backend=backend, verbose=False)


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to build its `Learner` (all picklable)."""

    model_path: str
    config: Any  # the learner config section
    kwargs: dict
    threads: int


@dataclass(frozen=True)
class RayPlacement:
    """Ranks as Ray actors: rank r on bundle r of `placement_group` (None: wherever Ray puts
    them), each reserving `num_cpus` and `num_gpus`; they meet at `host` (None: rank 0's node
    address) on `port` (0: a free one)."""

    placement_group: Any = None
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    host: str | None = None
    port: int = 0


def run_command(learner, command: str, payload: Any) -> Any:
    """What rank 0 asks of another rank, carried out there."""
    if command == "train":
        return learner.train_rows(*payload)
    if command == "state_dict":  # ZeRO-3: the gather is collective
        learner.state_dict()
        return None
    if command == "save":
        save_rank_part(learner, Path(payload))
        return None
    if command == "load":
        load_checkpoint(learner, payload)
        return learner.version
    raise ValueError(f"unknown command {command!r}")


def first_line(exc: BaseException) -> str:
    """An exception as one line for rank 0: its type and the first line of its message."""
    line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def _send(conn, message: Any) -> None:
    """Over a rank's pipe, pickled with the standard pickler, so a tensor's bytes travel in the
    message. multiprocessing's pickler (which torch extends) would pass it as a shared-memory file
    descriptor that a thread of the sender serves on request: a rank killed before it asked left
    that thread's traceback on rank 0's stderr (once in four clean-clone suite runs of
    2026-11-25, in the test that kills rank 1)."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _receive(conn) -> Any:
    return pickle.loads(conn.recv_bytes())


class RankPeers:
    """Ranks 1..N-1 of the learner, seen from rank 0: started together, told the same command,
    answered in rank order. A rank that dies or fails ends the call with `RankError`.
    `ProcessPeers` and `RayPeers` say how a command gets there and how a death shows."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.broken: RankError | None = None  # the first failure; every later call raises it

    def _post(self, rank: int, command: str, payload: Any) -> bool:
        """Hand `command` to `rank`; False if it is gone."""
        raise NotImplementedError

    def _answer(self, rank: int) -> tuple[str, Any]:
        """The rank's answer to its oldest command: ("ok", result), ("error", one line) or
        ("dead", None)."""
        raise NotImplementedError

    def _dead(self, rank: int, wait_s: float) -> bool:
        """Whether the rank is gone, looking for up to `wait_s` seconds."""
        raise NotImplementedError

    def _how(self, rank: int) -> str:
        """How a dead rank ended, in a few words."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def send(self, command: str, payloads: list) -> None:
        """`payloads[i]` goes to rank i + 1."""
        self._check()
        if len(payloads) != self.world - 1:
            raise ValueError(f"{len(payloads)} payloads for {self.world - 1} ranks")
        for rank, payload in enumerate(payloads, start=1):
            if not self._post(rank, command, payload):
                raise self._fail(f"learner rank {rank} died before {command}: {self._how(rank)}")

    def broadcast(self, command: str, payload: Any = None) -> None:
        self.send(command, [payload] * (self.world - 1))

    def gather(self, command: str) -> list:
        """Every rank's answer to `command`, in rank order."""
        self._check()
        results = []
        for rank in range(1, self.world):
            status, result = self._answer(rank)
            if status == "dead":
                raise self._fail(f"learner rank {rank} died during {command}: {self._how(rank)}")
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
                if self._dead(rank, wait_s=2.0):  # its socket can close before its exit shows
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
