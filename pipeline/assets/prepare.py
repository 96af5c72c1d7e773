"""`python -m pipeline.assets.prepare SETTING --source DIR_OR_HUB --out DIR`: a paper setting's
question files from the published data.

    python -m pipeline.assets.prepare search_r1 --source /data/flashrag --out /data/search_r1
    python -m pipeline.assets.prepare search_r1 --source RUC-NLPIR/FlashRAG_datasets --out DIR

`--source` is a directory in the setting's published layout, or (only on a machine that is online)
a Hugging Face hub dataset id, whose needed files are downloaded (`--revision`: a branch, tag or
commit; the commit is recorded). Written into `--out`: the setting's files and `manifest.json`
(the source, its revision, the sha256 and size of every input file, the rows per source of every
output file, and `departures`: how the files differ from the published scripts' own). Everything
is written to a temporary directory first and moved in only when whole; an `--out` that already
holds prepared files is refused unless `--force`. Bad input: one line naming the file, the line
and the field, exit status 2, nothing written.

Settings register themselves in SETTINGS: `search_r1` (the paper's factual QA: FlashRAG in,
Search-R1's train.parquet and test.parquet out, `pipeline/assets/search_r1_data.py`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
import pyarrow.parquet as pq

from pipeline.assets.search_r1_data import (
    DEPARTURES,
    TEST_SPLITS,
    TRAIN_SPLITS,
    SourceError,
    convert,
    read_flashrag,
    table,
)

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
MANIFEST = "manifest.json"


class PrepareError(ValueError):
    """Input or a destination that cannot be used: one line, what and where and what to do."""


@dataclass
class Setting:
    """What one setting reads (relative paths in its layout) and how it writes its files."""

    inputs: Callable[[], list[str]]
    write: Callable[[Path, Path], dict]  # (source dir, temporary out dir) -> the manifest's counts
    outputs: tuple[str, ...]
    departures: tuple[str, ...] = ()  # how the files differ from the published scripts' output


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ------------------------------------------------------------------------------------ search_r1


def _search_r1_inputs() -> list[str]:
    pairs = dict.fromkeys([*TRAIN_SPLITS.items(), *TEST_SPLITS.items()])
    return [f"{name}/{split}.jsonl" for name, split in pairs]


def _search_r1_write(source: Path, out: Path) -> dict:
    """train.parquet (NQ + HotpotQA train) and test.parquet (the seven benchmarks, in the paper's
    column order), every input row written as Search-R1's merge scripts write it; per-source
    counts, with how many rows repeat a question an earlier row of the file has."""
    counts: dict = {}
    for name, splits in (("train", TRAIN_SPLITS), ("test", TEST_SPLITS)):
        rows, by_source = [], {}
        seen: set[str] = set()
        for source_name, split in splits.items():
            records = read_flashrag(source / source_name / f"{split}.jsonl")
            converted = convert(records, source_name, split, seen)
            rows += converted.rows
            by_source[source_name] = {
                "file": f"{source_name}/{split}.jsonl",
                "read": len(records),
                "written": len(converted.rows),
                "repeated_questions": converted.repeated,
            }
        pq.write_table(table(rows), out / f"{name}.parquet")
        counts[f"{name}.parquet"] = {"rows": len(rows), "by_source": by_source}
    return counts


SETTINGS: dict[str, Setting] = {
    "search_r1": Setting(
        inputs=_search_r1_inputs,
        write=_search_r1_write,
        outputs=("train.parquet", "test.parquet"),
        departures=DEPARTURES,
    )
}
"""Setting name -> how it is prepared."""


# ------------------------------------------------------------------------------------ sources


def _offline() -> bool:
    return any(
        os.environ.get(v, "").strip().lower() in ("1", "true", "yes")
        for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def resolve_source(source: str, revision: str | None, wanted: list[str]) -> tuple[Path, dict]:
    """The local directory holding `wanted`, and what the manifest says of where it came from.
    A hub dataset id is downloaded (only its `wanted` files) when the machine is online."""
    given = Path(source)
    if given.is_dir():
        return given, {"source": str(given.resolve()), "kind": "directory", "revision": revision}
    if not HUB_ID.fullmatch(source) or given.exists():
        raise PrepareError(
            f"--source {source}: no such directory, and not a hub dataset id (owner/name)"
        )
    if _offline():
        raise PrepareError(
            f"--source {source} is a Hugging Face hub dataset and this machine is offline "
            "(HF_HUB_OFFLINE): copy its files elsewhere and pass --source DIR"
        )
    try:
        info = huggingface_hub.HfApi().dataset_info(source, revision=revision)
        path = huggingface_hub.snapshot_download(
            source, repo_type="dataset", revision=info.sha, allow_patterns=wanted
        )
    except Exception as exc:  # the hub's errors are many (network, auth, not found): one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PrepareError(f"--source {source}: cannot download from the hub ({first})") from None
    return Path(path), {"source": source, "kind": "huggingface_hub", "revision": info.sha}


# ------------------------------------------------------------------------------------ command


def prepare(setting_name: str, source: str, out: Path, revision: str | None, force: bool) -> dict:
    """Prepare `setting_name` from `source` into `out`; the manifest. Raises PrepareError (nothing
    written) on bad input."""
    setting = SETTINGS[setting_name]
    present = [n for n in (*setting.outputs, MANIFEST) if (out / n).exists()]
    if present and not force:
        raise PrepareError(
            f"--out {out} already holds {', '.join(present)}: pass --force to replace them"
        )
    wanted = setting.inputs()
    directory, origin = resolve_source(source, revision, wanted)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.prepare-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        try:
            counts = setting.write(directory, tmp)
        except SourceError as exc:
            raise PrepareError(str(exc)) from None
        inputs = [
            {
                "path": rel,
                "sha256": sha256(directory / rel),
                "bytes": (directory / rel).stat().st_size,
            }
            for rel in wanted
        ]
        manifest = {
            "setting": setting_name,
            **origin,
            "inputs": inputs,
            "outputs": {
                name: {**counts[name], "sha256": sha256(tmp / name)} for name in setting.outputs
            },
            "departures": list(setting.departures),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        out.mkdir(parents=True, exist_ok=True)
        (out / MANIFEST).unlink(missing_ok=True)  # no manifest while the files are replaced
        for name in (*setting.outputs, MANIFEST):  # the manifest last: its presence means whole
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def counts_table(manifest: dict) -> str:
    """The counts per source of every output file, as printed (`repeats`: rows whose question an
    earlier row of the file has, written all the same)."""
    lines = [f"{'file':<14} {'source':<16} {'input':<26} {'read':>8} {'written':>8} {'repeats':>8}"]
    for name, output in manifest["outputs"].items():
        for source_name, c in output["by_source"].items():
            lines.append(
                f"{name:<14} {source_name:<16} {c['file']:<26} {c['read']:>8} "
                f"{c['written']:>8} {c['repeated_questions']:>8}"
            )
        lines.append(f"{name:<14} {'all':<16} {'':<26} {'':>8} {output['rows']:>8}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> None:  # one line, not argparse's usage block
            self.exit(2, f"strata: error: {message} (see --help)\n")

    p = Parser(prog="python -m pipeline.assets.prepare", description=__doc__.split("\n\n")[0])
    p.add_argument("setting", choices=sorted(SETTINGS), help="which paper setting")
    p.add_argument(
        "--source", required=True, help="a directory in the published layout, or a hub id"
    )
    p.add_argument("--out", required=True, help="the directory the prepared files go into")
    p.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    p.add_argument("--force", action="store_true", help="replace prepared files already in --out")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        manifest = prepare(args.setting, args.source, Path(args.out), args.revision, args.force)
    except PrepareError as exc:
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2
    revision = manifest["revision"] or "not given"
    print(f"strata: prepared {args.setting} from {manifest['source']} (revision {revision})")
    print(counts_table(manifest))
    written = ", ".join(str(Path(args.out) / n) for n in (*manifest["outputs"], MANIFEST))
    print(f"strata: wrote {written}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
