"""Weight updates over NCCL, trainer side (GPU only): SGLang's distributed update (a
torch.distributed group, buckets, broadcasts) and vLLM's weight transfer (vLLM's own group).

Kept apart from the HTTP clients (`actors.sglang`, `actors.vllm`): nothing here can run without CUDA and NCCL,
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
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=group_name,
        **{options: None},
        timeout=default_pg_timeout,
    )
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


# ------------------------------------------------------------------------ vLLM's weight transfer


def vllm_trainer_problem() -> str | None:
    """Why this process cannot be the sending end of vLLM's NCCL weight transfer, or None. vLLM's
    servers join a group made of its own StatelessProcessGroup (a TCPStore rendezvous) and its
    PyNccl communicator, which a torch.distributed group cannot join: the trainer needs vllm."""
    problem = gpu_transport_problem("nccl")
    if problem is not None:
        return problem
    try:
        from vllm.distributed.weight_transfer import nccl_common  # noqa: F401
    except ImportError:
        return (
            "vllm (>= 0.32, with vllm.distributed.weight_transfer) is not installed in this process"
        )
    return None


def join_vllm_group(address: str, port: int, world_size: int) -> Any:
    """Rank 0 (the sender) of vLLM's weight-transfer group; the servers' workers are ranks
    1..world_size-1 (rank_offset 1). Blocks until every rank has joined."""
    import torch
    from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

    return stateless_init_process_group(address, port, 0, world_size, torch.cuda.current_device())


def vllm_init_info(address: str, port: int, rank_offset: int, world_size: int) -> dict:
    """The /init_weight_transfer_engine body's `init_info` for one server, whose workers take
    ranks rank_offset.. of the group (TCPStore rendezvous at address:port, unpacked tensors)."""
    return {
        "master_address": address,
        "master_port": port,
        "rank_offset": rank_offset,
        "world_size": world_size,
    }


def vllm_update_info(items: list[tuple[str, Any]]) -> dict:
    """The /update_weights body's `update_info`: every tensor's HF name, dtype and shape, in
    the order the tensors are then broadcast one by one (vLLM's unpacked mode)."""
    return {
        "names": [name for name, _ in items],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in items],
        "shapes": [list(t.shape) for _, t in items],
    }


def vllm_broadcast(communicator: Any, tensors: list[Any]) -> None:
    """One broadcast from rank 0 per tensor, on the current stream (vLLM's unpacked receive)."""
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.current_stream()
    for tensor in tensors:
        tensor = tensor.detach() if tensor.is_cuda else tensor.detach().to(device)
        communicator.broadcast(tensor.contiguous(), src=0, stream=stream)
    torch.cuda.synchronize()
