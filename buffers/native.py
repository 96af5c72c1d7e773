"""C loops for the data plane's hot paths, built on first use and loaded with ctypes.

A `NativeLibrary` compiles its C source with the system C compiler (`$CC`, else `cc`) into
`$XDG_CACHE_HOME/strata/` (default `~/.cache/strata/`), named by a hash of the source, flags and
compiler, so an edit rebuilds and concurrent processes share one file (each writes its own
temporary and renames it into place). Where there is no compiler, or the build fails, or
`STRATA_NATIVE=0` is set, `get()` is None and callers take their numpy or torch path: the same
results, slower. Why a library is missing is said once on stderr, except for STRATA_NATIVE=0,
which is a choice.

Two libraries use it: this module's `check_tokens` (buffers/tokens.c, the token arrays' half of
`Trajectory.validate`) and the advantages' loops (learner/advantages.c, learner/native.py). This
module imports nothing of the project, so buffers/records.py may use it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np


def _compile(source: Path, flags: tuple[str, ...]) -> Path:
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc")]
    if not compiler[0]:
        raise OSError("no C compiler (set CC or install gcc)")
    key = hashlib.sha256(source.read_bytes() + repr((flags, compiler)).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "strata"
    target = cache / f"{source.stem}-{key}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        fd, scratch = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            done = subprocess.run(
                [*compiler, *flags, "-o", scratch, str(source)], capture_output=True, text=True
            )
            if done.returncode != 0:
                raise OSError(f"{shlex.join(compiler)} failed: {done.stderr.strip()[:300]}")
            os.replace(scratch, target)  # atomic: another process sees no file or a whole one
        finally:
            Path(scratch).unlink(missing_ok=True)
    return target


class NativeLibrary:
    """One C source, compiled and loaded on the first `get()` (thread-safe), or None.

    `declare` sets each function's argtypes and restype. `loader` is ctypes.CDLL, which lets go of
    the GIL during a call (right for long loops), or ctypes.PyDLL, which keeps it (right for calls
    of a microsecond, where letting go and taking it back costs more and may wait on other threads).
    `slower_path` ends the stderr line: what runs instead.
    """

    def __init__(
        self,
        source: Path,
        flags: tuple[str, ...],
        declare: Callable[[ctypes.CDLL], None],
        slower_path: str,
        loader: type[ctypes.CDLL] = ctypes.CDLL,
    ) -> None:
        self.source, self.flags, self.declare = source, flags, declare
        self.slower_path, self.loader = slower_path, loader
        self._lock = threading.Lock()
        self._library: ctypes.CDLL | None = None
        self._tried = False

    def get(self) -> ctypes.CDLL | None:
        if self._tried:
            return self._library
        with self._lock:
            if not self._tried:
                if os.environ.get("STRATA_NATIVE", "1") != "0":
                    try:
                        library = self.loader(str(_compile(self.source, self.flags)))
                        self.declare(library)
                        self._library = library
                    except (OSError, AttributeError, ValueError) as error:
                        # a bad .so is an OSError too; an unbalanced quote in CC a ValueError
                        print(
                            f"strata: {self.slower_path}, not the C loops of {self.source.name} "
                            f"({error}); the results are the same, only slower",
                            file=sys.stderr,
                            flush=True,
                        )
                self._tried = True
        return self._library

    @contextmanager
    def disabled(self) -> Iterator[None]:
        """Within it, `get()` is None (tests and benchmarks compare the two paths)."""
        saved = self.get()
        self._library = None
        try:
            yield
        finally:
            self._library = saved


def _declare_tokens(library: ctypes.CDLL) -> None:
    library.check_tokens.restype = ctypes.c_int64
    library.check_tokens.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64]


TOKENS = NativeLibrary(
    Path(__file__).with_name("tokens.c"),
    ("-O3", "-std=c11", "-shared", "-fPIC"),  # -O3: gcc 12 vectorises the loop only there
    _declare_tokens,
    "trajectories are validated in numpy",
    loader=ctypes.PyDLL,
)

_INT8, _INT32, _FLOAT32 = np.dtype(np.int8), np.dtype(np.int32), np.dtype(np.float32)
_address = ctypes.addressof
# An array's address through the buffer protocol: ~0.25 us, where ndarray.ctypes.data costs ~1 us.
# numpy keeps the description of an exported buffer with the array (~70 bytes each, ~0.2 KB a
# trajectory, 1.5% of 1,000 tokens' payload) until the array is freed.
_at = ctypes.c_char.from_buffer


def check_tokens(mask: np.ndarray, versions: np.ndarray, logprobs: np.ndarray) -> int | None:
    """buffers/tokens.c's verdict on three 1-D arrays of one length (the oldest generated
    version, or minus the first invariant broken), or None where the C path does not apply: no
    library, other shapes, dtypes other than native int8/int32/float32, arrays not C-contiguous
    or read-only (numpy then)."""
    library = TOKENS.get()
    n = len(mask)
    if (
        library is None
        or mask.dtype != _INT8  # ==, not is: an unpickled array (from a Ray worker) has its own
        or versions.dtype != _INT32
        or logprobs.dtype != _FLOAT32
        or not mask.ndim == versions.ndim == logprobs.ndim == 1
        or not len(versions) == len(logprobs) == n
    ):
        return None
    try:  # from_buffer takes only writable C-contiguous buffers, of at least one byte
        where = _address(_at(mask)), _address(_at(versions)), _address(_at(logprobs))
    except (TypeError, ValueError, BufferError):
        return None
    return library.check_tokens(*where, n)
