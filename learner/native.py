"""The advantages' fused C loops (learner/advantages.c), built on first use and loaded with ctypes.

buffers/native.py builds the library (with the system C compiler, into `~/.cache/strata/`) and
says once on stderr why it is missing where it is; STRATA_NATIVE=0 turns it off. Without it the
callers' torch path runs instead: the same results bit for bit, slower (`python
benchmarks/advantages.py` shows both).

Only contiguous CPU tensors with float32 or float64 values take this path, and int32 ids (`affine`
narrows int64 ones itself); `cell_sums` and `affine` return None for anything else and the caller
goes on in torch.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from buffers.native import NativeLibrary

# -ffp-contract=off: no a * b + c may become a fused multiply-add, so torch's bits are kept.
FLAGS = ("-O2", "-std=c11", "-shared", "-fPIC", "-ffp-contract=off")


def _declare(library: ctypes.CDLL) -> None:
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    for name in ("cell_sums_f32", "cell_sums_f64", "affine_f32", "affine_f64"):
        function = getattr(library, name)
        function.restype = size
        function.argtypes = [pointer, pointer, size, size] + [pointer] * (
            {"cell_sums_f32": 3, "cell_sums_f64": 4}.get(name, 2)
        )


ADVANTAGES = NativeLibrary(
    Path(__file__).with_name("advantages.c"), FLAGS, _declare, "advantages run in torch"
)
library = ADVANTAGES.get
"""The loaded library, or None when it cannot be had here."""
torch_only = ADVANTAGES.disabled
"""Within it, callers take their torch path (tests and benchmarks compare the two)."""


def _fits(ids: torch.Tensor, *tensors: torch.Tensor) -> bool:
    return ids.dtype == torch.int32 and all(
        t.device.type == "cpu" and t.is_contiguous() for t in (ids, *tensors)
    )


def _check(status: int, where: str) -> None:
    if status:
        raise IndexError(f"{where}: cell id at position {status - 1} is out of range")


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def cell_sums(values: torch.Tensor, ids: torch.Tensor, num_cells: int):
    """(count int64, sum or head float64, tail float64 or None, sum of squares float64) per cell,
    as learner.advantages._sums gives them, or None where this path does not apply (or the C
    side had no memory for its buckets)."""
    lib = library()
    if lib is None or values.dtype not in (torch.float32, torch.float64) or not _fits(ids, values):
        return None
    count = torch.empty(num_cells, dtype=torch.int64)  # the C loop zeroes them, bucket by bucket
    sums = [
        torch.empty(num_cells, dtype=torch.float64)
        for _ in range(2 if values.dtype == torch.float32 else 3)
    ]
    kernel = lib.cell_sums_f32 if values.dtype == torch.float32 else lib.cell_sums_f64
    status = kernel(_ptr(ids), _ptr(values), len(values), num_cells, _ptr(count), *map(_ptr, sums))
    if status < 0:
        return None
    _check(status, kernel.__name__)
    return (count, sums[0], None, sums[1]) if len(sums) == 2 else (count, *sums)


def affine(values: torch.Tensor, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor | None:
    """(values - table[ids, 2]) * table[ids, 0] + table[ids, 1], or None where this path does not
    apply. `table` is [cells, 3] in the values' dtype; int64 ids are narrowed to int32 here."""
    lib = library()
    if lib is not None and ids.dtype == torch.int64 and len(table) < 2**31:
        ids = ids.to(torch.int32)
    if (
        lib is None
        or values.dtype not in (torch.float32, torch.float64)
        or table.dtype != values.dtype
        or not _fits(ids, values, table)
    ):
        return None
    out = torch.empty_like(values)
    kernel = lib.affine_f32 if values.dtype == torch.float32 else lib.affine_f64
    _check(
        kernel(_ptr(ids), _ptr(values), len(values), len(table), _ptr(table), _ptr(out)), "affine"
    )
    return out
