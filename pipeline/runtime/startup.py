"""A process's start: its large imports, not scanned by Python's cyclic garbage collector.

Importing torch, transformers and DeepSpeed (`pipeline.runtime.run`) leaves ~420,000 objects
the collector tracks (modules, classes, functions, registries), alive as long as the process.
Python's collector runs a full collection each time enough objects have survived the younger
generations, and each full collection scans every object made so far: while a launch imports
those libraries, the collector scans the same objects again and again. `uncollected()` pauses
the collector while a block imports and then freezes what exists (`gc.freeze`: later
collections skip it); what the run makes afterwards is collected as usual.
`python benchmarks/startup.py` (2-core machine, 2026-11-27, 5 rounds): the imports took 6.5 s of
CPU paused against 8.6 s running (medians, 0.75x); a 2-step launch of configs/local.yaml took
8.1-9.2 s of CPU against 10.6-11.2 s.

A Ray worker imports its actor's module before any code of ours runs in it: the cluster starts
every worker with the collector paused (`paused`, its `worker_process_setup_hook`), and each of
our actors' constructors freezes what the imports made and collects again (`resumed`). Importing
a generation actor's module (`pipeline.runtime.ray`) in a fresh interpreter took 3.57 s of CPU
paused against 5.19 s running (0.69x), a learner rank's (`learner.ray_ranks`) 3.11 s against
4.42 s (0.71x): `python benchmarks/startup.py --module pipeline.runtime.ray --rounds 4` and
`--module learner.ray_ranks`, medians of 4 rounds, 2026-11-27, 2-core VM, no GPU. (Measured inside
Ray workers, by hand and with no command, the saving was about 10%: 5.8 s against 6.4 s.)
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def uncollected() -> Iterator[None]:
    """Pause the cyclic collector while the block runs (imports), then freeze what exists."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def paused() -> None:
    """A Ray worker's setup hook (pipeline/runtime/ray_cluster.py): no collection while the
    worker imports the module of the actor it is about to construct."""
    gc.disable()


def resumed() -> None:
    """An actor's constructor after `paused`: freeze what exists, collect from here on."""
    gc.freeze()
    gc.enable()
