"""How far the warm start's quality moves with the seed and with float noise, by epochs of SFT.

    python benchmarks/warm_start_spread.py [--epochs 30 60] [--seeds 0 1 2] [--threads 2]
                                           [--out runs/warm-start-spread]

Each build is the default's warm start (configs/local.yaml's world, index and top-k) with the
given `max_epochs`, model seed and torch thread count (another thread count rounds the float
reductions otherwise: the same recipe, other rounding), run in its own process, then scored
by `pipeline.evaluate` exactly as a run's step-0 evaluation is: greedy, held-out questions by
level and 120 training questions. The table is printed and written to OUT/spread.md; the last
line gives the held-out range per epoch count. About 75 s a 30-epoch build and 130 s a 60-epoch
one on 2 cores, evaluation included (10 minutes for the default six).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COLUMNS = (
    "epochs",
    "seed",
    "threads",
    "steps",
    "loss",
    "seconds",
    "all",
    "L1",
    "L2",
    "L3",
    "training",
    "weights",
)
SOURCES = {
    "all": "all",
    "L1": "minigaia_l1",
    "L2": "minigaia_l2",
    "L3": "minigaia_l3",
    "training": "training questions",
}


def build(epochs: int, seed: int, threads: int, out: Path) -> None:
    """One warm start (in this process: the thread count holds for all of it)."""
    import torch

    torch.set_num_threads(threads)
    from dataclasses import replace

    from pipeline.assets.cache import prepare_index, prepare_world
    from pipeline.assets.warm_start import DEFAULT_TRAINING, warm_start
    from pipeline.config.loader import load_config

    config = load_config(str(ROOT / "configs" / "local.yaml"))
    world = prepare_world(config, quiet=True)
    index = prepare_index(config, world / "corpus.jsonl", quiet=True)
    model = config.model.model_copy(update={"seed": seed})
    training = replace(DEFAULT_TRAINING, max_epochs=epochs)
    warm_start(
        world,
        out,
        model,
        tools=tuple(config.actors.tools),
        training=training,
        progress=False,
        index_dir=index,
        topk=config.retrieval.topk,
    )


def measure(epochs: int, seed: int, threads: int, out: Path) -> dict:
    began = time.monotonic()
    one = [sys.executable, __file__, "--one", str(epochs), str(seed), str(threads), str(out)]
    subprocess.run(one, check=True, cwd=ROOT)
    record = json.loads((out / "warm_start.json").read_text(encoding="utf-8"))
    evaluation = out.with_suffix(".eval.json")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.evaluate",
            str(out),
            "--config",
            "configs/local.yaml",
            "--out",
            str(evaluation),
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    rows = {
        r["name"]: r["accuracy"] for r in json.loads(evaluation.read_text())["rows"] if r["tools"]
    }
    from pipeline.evaluation.report import weights_digest

    return {
        "epochs": epochs,
        "seed": seed,
        "threads": threads,
        "steps": record["steps"],
        "loss": f"{record['final_loss']:.3f}",
        "seconds": f"{time.monotonic() - began:.0f}",
        **{k: f"{rows[v]:.3f}" for k, v in SOURCES.items()},
        "weights": weights_digest(out),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, nargs="+", default=[30, 60])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--threads", type=int, nargs="+", default=[2])
    p.add_argument("--out", default="runs/warm-start-spread")
    p.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        epochs, seed, threads, out = args.one
        build(int(epochs), int(seed), int(threads), Path(out))
        return 0
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    print(lines[0], flush=True)
    results = []
    for epochs in args.epochs:
        for seed in args.seeds:
            for threads in args.threads:
                row = measure(epochs, seed, threads, out / f"e{epochs}-seed{seed}-t{threads}")
                results.append(row)
                lines.append("| " + " | ".join(str(row[c]) for c in COLUMNS) + " |")
                print(lines[-1], flush=True)
    (out / "spread.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    spans = []
    for epochs in args.epochs:
        held_out = sorted(float(r["all"]) for r in results if r["epochs"] == epochs)
        spans.append(f"{epochs} epochs {held_out[0]:.3f}-{held_out[-1]:.3f}")
    print(f"held-out accuracy of the warm-started policy: {', '.join(spans)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
