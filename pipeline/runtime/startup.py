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
a generation actor's module took 5.8 s of CPU paused against 6.4 s running, a learner rank's 4.9 s
against 5.5 s (medians of 4 fresh processes each, 2026-11-27; single processes vary by 1-2 s):
about 10% less. Those figures were taken before a command printed them; `python
benchmarks/startup.py --module pipeline.runtime.ray --rounds 4` (learner.ray_ranks for a learner
rank's) measures the same imports, paused with `uncollected`, side by side.
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
