"""Build the DeepSpeed op the CPU learner loads at start, once, at set-up time.

    python -m learner.deepspeed_ops

On a CPU, DeepSpeed's process group loads a shared-memory communication op that it compiles on
first use (about 30 s on 2 cores, with g++ and ninja, into torch's extension cache). `make setup`
runs this so that the first run, or the first test of a suite, does not wait for the compiler.
On a GPU machine there is nothing to build; a machine without a compiler skips with one line (the
op is then compiled, or done without, by DeepSpeed at run time as before).

The op is built for one environment (its include paths are the venv's), and torch keeps one build
per op name in ~/.cache/torch_extensions: two checkouts on one machine would rebuild it in turn,
each time the other one ran (30-60 s each on 2 cores). `use_own_extension_dir` gives each
environment its own directory; every process that loads the op calls it first.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def use_own_extension_dir() -> None:
    """torch's compiled extensions under this Python environment (`sys.prefix`), unless
    TORCH_EXTENSIONS_DIR is set or the environment is not writable."""
    if "TORCH_EXTENSIONS_DIR" not in os.environ and os.access(sys.prefix, os.W_OK):
        os.environ["TORCH_EXTENSIONS_DIR"] = str(Path(sys.prefix) / "torch_extensions")


def main() -> int:
    os.environ.setdefault("DS_BUILD_OPS", "0")
    use_own_extension_dir()
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        print("learner.deepspeed_ops: no shared-memory op to build on this accelerator")
        return 0
    try:
        builder.load(verbose=False)
    except Exception as exc:  # no compiler here: DeepSpeed tries again at run time
        print(
            f"learner.deepspeed_ops: could not build {builder.NAME} ({exc}); runs build it on first use"
        )
        return 0
    print(f"learner.deepspeed_ops: {builder.NAME} is built")
    return 0


if __name__ == "__main__":
    sys.exit(main())
