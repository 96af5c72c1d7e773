"""An asyncio event loop on a virtual clock, for simulated runs (`actors.engine.type: simulated`).

`loop.time()` starts at 0 and only moves when the loop would otherwise wait for a timer: then it
jumps to that timer at once. So `asyncio.sleep(60)` returns immediately, yet everything scheduled
in between happens in order, and every duration the pipeline measures with `loop.time()` is the
simulated one. A simulated hour of a GPU cluster costs only the Python work it causes; the ratio
between the two is the run's time scale.

Work in threads (`run_in_executor`, `asyncio.to_thread`: spill writes, checkpoints) is real work,
not simulated: while any is pending, the clock stands still and the loop waits for it for real,
so thread work takes no simulated time and never races the clock. Sockets and pipes are polled
for real as in any loop. Use it for simulations only: a real server or model would be timed out
by a clock that jumps.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _JumpingSelector(selectors.DefaultSelector):
    """Polls the real file descriptors; where the loop would block until its next timer, moves the
    virtual clock there instead (unless thread work is pending, or nothing is scheduled)."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None):
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        loop = self.loop
        if timeout is None or loop is None or loop.threads_pending:
            return super().select(timeout)  # wait for real: I/O, or a thread's result
        loop.advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        selector = _JumpingSelector()
        super().__init__(selector)
        selector.loop = self
        self._now = 0.0
        self.threads_pending = 0

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += max(seconds, 0.0)

    def run_in_executor(self, executor, func, *args):
        future = super().run_in_executor(executor, func, *args)
        self.threads_pending += 1

        def done(_):
            self.threads_pending -= 1

        future.add_done_callback(done)
        return future


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on a fresh VirtualTimeLoop."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(main)
