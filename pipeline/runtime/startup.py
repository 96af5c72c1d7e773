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
