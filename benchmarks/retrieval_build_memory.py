"""Peak resident memory and time of `python -m retrieval.build` on a synthetic wiki-18-like corpus.

Writes N passages of about 100 words (wiki-18's passage length) to a JSONL file, then runs the build
as a child process with the `strata-hash-768` encoder (a deterministic stand-in with E5's 768-d
width: MiniLM on 2 cores would take hours for 1M passages and measure the encoder, not the build),
and reports the child's peak RSS (VmHWM: ru_maxrss of a forked child would count the parent's
pages too) and wall time, against issue 68's bound: index bytes + one shard + 10%. Run it with
PYTHONPATH=ANOTHER_CHECKOUT to measure that checkout's build on the same corpus.

    python benchmarks/retrieval_build_memory.py --passages 1000000 [--shard-size 65536] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

WORDS = [f"w{i}" for i in range(5000)]
DIM = 768
DEFAULT_SHARD_SIZE = 65_536  # retrieval.build's
CHILD = """
import re, sys
from pathlib import Path
from retrieval.build import main
code = main(sys.argv[1:])
print("vmhwm_kib", re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text())[1])
sys.exit(code)
"""


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
    command = [sys.executable, "-c", CHILD, "--corpus", str(corpus), "--out", str(out)]
    command += ["--encoder", f"strata-hash-{DIM}", "--index", args.index, "--force"]
    if args.shard_size is not None:
        command += ["--shard-size", str(args.shard_size)]
    start = time.perf_counter()
    done = subprocess.run(
        command, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True
    )
    elapsed = time.perf_counter() - start
    print(done.stdout.decode(), end="")
    peak = int(done.stdout.split()[-1]) * 1024
    size = sum(p.stat().st_size for p in out.iterdir())
    index_bytes = (out / "index.faiss").stat().st_size
    bound = 1.1 * (index_bytes + (args.shard_size or DEFAULT_SHARD_SIZE) * DIM * 4)
    print(
        f"build of {args.passages} passages ({corpus.stat().st_size / 1e9:.2f} GB of JSONL), "
        f"{DIM}-d, {args.index}: {elapsed:.1f} s, peak RSS {peak / 2**30:.2f} GiB, "
        f"index directory {size / 2**30:.2f} GiB, index.faiss {index_bytes / 2**30:.2f} GiB; "
        f"bound (index + one shard + 10%) {bound / 2**30:.2f} GiB: peak / bound "
        f"{peak / bound:.2f}"
    )


if __name__ == "__main__":
    main()
