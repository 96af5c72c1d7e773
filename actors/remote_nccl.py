"""SGLang's distributed weight update, trainer side: NCCL group, buckets, broadcast (GPU only).

Kept apart from the HTTP client in `actors.remote`: nothing here can run without CUDA and NCCL,
and `gpu_transport_problem` says in one line what is missing.
"""

from __future__ import annotations

import inspect
from typing import Any


def gpu_transport_problem(backend: str) -> str | None:
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return "torch is not installed"
    if not dist.is_available():
        return "this torch build has no torch.distributed"
    if backend == "nccl" and not dist.is_nccl_available():
        return "this torch build has no NCCL"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    return None


def join_weights_group(address: str, port: int, world_size: int, group_name: str, backend: str):
    """Rank 0 of a process group outside the default one, built the way SGLang's servers build
    their end (sglang.srt.utils.init_custom_process_group) so that both agree on store keys."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        default_pg_timeout,
        rendezvous,
    )

    store, rank, world_size = next(
        rendezvous(f"tcp://{address}:{port}", 0, world_size, timeout=default_pg_timeout)
    )
    store.set_timeout(default_pg_timeout)
    store = PrefixStore(group_name, store)
    params = inspect.signature(_new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name,
        **{options: None}, timeout=default_pg_timeout,
    )  # fmt: skip
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def buckets(items: list[tuple[str, Any]], limit: int) -> list[list[tuple[str, Any]]]:
    """Consecutive runs of at most `limit` bytes (one oversized tensor makes a bucket alone):
    a server allocates a whole bucket before loading it."""
    runs: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for name, tensor in items:
        nbytes = tensor.numel() * tensor.element_size()
        if runs[-1] and size + nbytes > limit:
            runs.append([])
            size = 0
        runs[-1].append((name, tensor))
        size += nbytes
    return runs


def bucket_body(bucket: list[tuple[str, Any]], group_name: str, version: int, last: bool) -> dict:
    body = {
        "names": [name for name, _ in bucket],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
        "group_name": group_name,
        "flush_cache": last,  # the prefix cache holds old-weight KV: drop it once, at the end
    }
    if last:
        body["weight_version"] = str(version)  # the server's version flips with the last bucket
    return body


def broadcast(group: Any, tensors: list[Any]) -> None:
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device())
    for tensor in tensors:
        tensor = tensor.detach() if tensor.is_cuda else tensor.detach().to(device)
        dist.broadcast(tensor.contiguous(), src=0, group=group)
    torch.cuda.synchronize()
