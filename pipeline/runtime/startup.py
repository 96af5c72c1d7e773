"""A process's start: its large imports, not scanned by Python's cyclic garbage collector.

Importing torch, transformers and DeepSpeed makes hundreds of thousands of objects (modules,
classes, functions, registries) that live as long as the process. Python's collector runs a
full collection each time enough new objects have survived the younger ones, and each full
collection scans every object made so far: while a launch imports those libraries, the collector
scanned the same objects again and again, about 2 s of CPU of a launch's ~7 s of imports
(2-core machine, 2026-11-27: `import pipeline.runtime.run` took 6.9-8.4 s with the collector
running, 5.0-5.8 s with it paused and the objects frozen after). `uncollected()` pauses the
collector while a block imports and then freezes what exists (`gc.freeze`: later collections
skip it). Those objects are the process's code and registries, alive until it exits; what the
run makes afterwards is collected as usual.
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
