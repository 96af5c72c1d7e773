"""Peak resident memory and time of `python -m retrieval.build` on a synthetic wiki-18-like corpus.

Writes N passages of about 100 words (wiki-18's passage length) to a JSONL file, then runs the build
as a child process with the `strata-hash-768` encoder (a deterministic stand-in with E5's 768-d
width: MiniLM on 2 cores would take hours for 1M passages and measure the encoder, not the build),
and reports the child's peak RSS (ru_maxrss) and wall time.

    python benchmarks/retrieval_build_memory.py --passages 1000000 [--shard-size 65536] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

WORDS = [f"w{i}" for i in range(5000)]


def write_corpus(path: Path, passages: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    with path.open("w", encoding="utf-8") as fh:
        for start in range(0, passages, 10_000):
            count = min(10_000, passages - start)
            words = rng.integers(0, len(WORDS), size=(count, 100))
            for offset, row in enumerate(words):
                text = " ".join(WORDS[w] for w in row)
                contents = f'"Title {start + offset}"\n{text}'
                fh.write(json.dumps({"id": str(start + offset), "contents": contents}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passages", type=int, default=1_000_000)
    parser.add_argument("--shard-size", type=int, default=None, help="passed on when set")
    parser.add_argument("--index", default="flat")
    parser.add_argument("--work", default=None, help="directory for the corpus and the index")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="strata-build-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / f"corpus-{args.passages}.jsonl"
    if not corpus.exists():
        write_corpus(corpus, args.passages)
    out = work / f"index-{args.passages}-{args.index}"
    command = [sys.executable, "-m", "retrieval.build", "--corpus", str(corpus), "--out", str(out)]
    command += ["--encoder", "strata-hash-768", "--index", args.index, "--force"]
    if args.shard_size is not None:
        command += ["--shard-size", str(args.shard_size)]
    start = time.perf_counter()
    subprocess.run(command, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux reports KiB
    size = sum(p.stat().st_size for p in out.iterdir())
    print(
        f"build of {args.passages} passages ({corpus.stat().st_size / 1e9:.2f} GB of JSONL), "
        f"768-d, {args.index}: {elapsed:.1f} s, peak RSS {peak / 2**30:.2f} GiB, "
        f"index directory {size / 2**30:.2f} GiB"
    )


if __name__ == "__main__":
    main()
