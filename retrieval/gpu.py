"""Where a loaded index searches: on every visible GPU (faiss-gpu) or on the CPU.

The usual way to hold a wiki-18 flat index (21M x 768 float32 = 64 GB) on GPUs is Search-R1's:
fp16 vectors, sharded over all GPUs (`index_cpu_to_all_gpus` with `shard`). `plan_gpus` decides,
from the index's size and each GPU's free memory, whether that fits, and says in one line what to
change when it does not; it is pure, so it is tested on a machine without GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import faiss

from retrieval.kinds import KINDS

GpuMode = Literal["shard", "replicate", "off"]
GIB = 2**30


@dataclass(frozen=True)
class GpuOptions:
    mode: GpuMode = "shard"  # shard: each GPU holds 1/G of the vectors; replicate: each holds all
    fp16: bool = True  # vectors stored in half precision on the GPUs (flat and ivf)
    reserve_bytes: int = 2 * GIB  # per GPU: faiss's scratch memory and a query batch's results


@dataclass(frozen=True)
class GpuPlan:
    gpus: int  # 0: search on the CPU
    bytes_per_gpu: int = 0
    note: str = "cpu"


def index_gpu_bytes(kind: str, count: int, dim: int, file_bytes: int, fp16: bool) -> int:
    """Bytes the index takes on GPUs in all: vectors at 2 or 4 bytes a value for flat and ivf
    (plus ivf's 8-byte ids), the file's own size for the compressed kinds."""
    if kind == "flat":
        return count * dim * (2 if fp16 else 4)
    if kind == "ivf":
        return count * (dim * (2 if fp16 else 4) + 8)
    return file_bytes + count * 8


def plan_gpus(
    kind: str, count: int, dim: int, file_bytes: int, free_bytes: list[int], options: GpuOptions
) -> GpuPlan | str:
    """Where to search, or the one line saying why the index does not fit the visible GPUs."""
    if options.mode == "off" or not free_bytes:
        return GpuPlan(0)
    if not KINDS[kind].gpu:
        return GpuPlan(0, note=f"{kind} has no faiss-gpu version: cpu")
    need = index_gpu_bytes(kind, count, dim, file_bytes, options.fp16)
    gpus = len(free_bytes)
    share = math.ceil(need / gpus) if options.mode == "shard" else need
    per_gpu = share + options.reserve_bytes
    short = [i for i, free in enumerate(free_bytes) if free < per_gpu]
    precision = "fp16" if options.fp16 else "fp32"
    how = f"{options.mode}, {precision}, {gpus} GPU{'s' if gpus > 1 else ''}"
    if short:
        worst = short[0]
        advice = (
            "use more GPUs (retrieval.gpu: shard), fp16 (retrieval.gpu_fp16: true), index "
            "ivf_pq, or retrieval.gpu: off to search on the CPU"
        )
        return (
            f"the {kind} index of {count} x {dim} needs {per_gpu / GIB:.1f} GiB per GPU ({how}, "
            f"{options.reserve_bytes / GIB:.1f} GiB of it faiss's scratch) but GPU {worst} has "
            f"{free_bytes[worst] / GIB:.1f} GiB free: {advice}"
        )
    return GpuPlan(gpus, per_gpu, how)


def visible_gpu_free_bytes() -> list[int]:
    """Free bytes of each GPU faiss-gpu can use; [] without faiss-gpu or GPUs."""
    if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() == 0:
        return []
    import torch  # only a machine with faiss-gpu gets here

    return [torch.cuda.mem_get_info(i)[0] for i in range(faiss.get_num_gpus())]


def to_gpus(index: faiss.Index, plan: GpuPlan, options: GpuOptions) -> faiss.Index:
    """`index` copied onto the plan's GPUs (the CPU index is returned when the plan has none)."""
    if plan.gpus == 0:
        return index
    cloner = faiss.GpuMultipleClonerOptions()
    cloner.useFloat16 = options.fp16
    cloner.shard = options.mode == "shard"
    return faiss.index_cpu_to_all_gpus(index, co=cloner, ngpu=plan.gpus)
