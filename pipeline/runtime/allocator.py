"""Fewer glibc malloc arenas for the launcher and the processes it starts.

glibc gives each thread that contends for the heap an arena of its own, up to 8 per core, and
memory freed in one arena is not reused by another. A run allocates from many threads (torch's
intra-op pool, asyncio's `to_thread` workers, the Arrow spill writer), so its resident memory kept
creeping up over a 30-minute soak (+13.5% after warm-up, docs/results/soak.md) while the buffer's
limits held what it stored constant. With two arenas the same run held about half the memory.

`cap_arenas()` applies the cap to this process (`mallopt(M_ARENA_MAX)`) and puts
`MALLOC_ARENA_MAX` in the environment, which glibc reads when a child starts (Ray workers, vLLM
servers, the sandboxed python tool). A `MALLOC_ARENA_MAX` the user set is left as it is.
`trim()` hands the heap's free pages back to the system (`malloc_trim(0)`); the local runtime
calls it after each learner step, whose activations are the largest allocations freed, so
resident memory tracks what the run holds rather than what glibc keeps for later. Not glibc
(musl, macOS): neither does anything.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

ARENAS = 2
M_ARENA_MAX = -8  # glibc's malloc.h


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_LIBC = _libc()


def cap_arenas(arenas: int = ARENAS) -> bool:
    """Cap this process and its future children at `arenas` malloc arenas; False where the user
    chose a number (MALLOC_ARENA_MAX set) or the C library is not glibc."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    mallopt = getattr(_LIBC, "mallopt", None)
    if mallopt is None:
        return False
    if mallopt(M_ARENA_MAX, arenas) != 1:  # glibc returns 1 on success
        return False
    os.environ["MALLOC_ARENA_MAX"] = str(arenas)
    return True


def trim() -> bool:
    """Return the free memory at the top and inside the heaps to the system; True if any was."""
    malloc_trim = getattr(_LIBC, "malloc_trim", None)
    return bool(malloc_trim(0)) if malloc_trim is not None else False
