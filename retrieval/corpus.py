"""Corpus in the Search-R1 / wiki-18 JSONL format, and how passages are shown to the agent.

One JSON object per line: `{"id": "...", "contents": "\\"Title\\"\\ntext"}` — the first line of
`contents` is the title (quoted in wiki-18), the rest is the passage text.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path


class CorpusError(ValueError):
    """A corpus file that cannot be read; the message names the file and the line."""


@dataclass(frozen=True)
class Passage:
    id: str
    contents: str  # exactly as in the corpus: title line, newline, text

    @property
    def title(self) -> str:
        return self.contents.split("\n", 1)[0].strip().strip('"')

    @property
    def text(self) -> str:
        parts = self.contents.split("\n", 1)
        return parts[1].strip() if len(parts) > 1 else ""

    def to_json(self) -> dict[str, str]:
        return {"id": self.id, "contents": self.contents}


def make_contents(title: str, text: str) -> str:
    """`contents` the way wiki-18 writes it: the quoted title on the first line."""
    return f'"{title}"\n{text}'


def iter_corpus(path: str | os.PathLike[str]) -> Iterator[Passage]:
    """Passages of a JSONL corpus, in file order; ids default to the line number when absent."""
    p = Path(path)
    try:
        fh = p.open(encoding="utf-8")
    except OSError as exc:
        raise CorpusError(f"cannot open corpus {p}: {exc.strerror}") from None
    with fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CorpusError(f"{p}:{number}: invalid JSON ({exc.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("contents"), str):
                raise CorpusError(
                    f'{p}:{number}: expected an object with a string "contents" field'
                )
            passage_id = row.get("id", str(number - 1))
            yield Passage(id=str(passage_id), contents=row["contents"])


def read_corpus(path: str | os.PathLike[str]) -> list[Passage]:
    passages = list(iter_corpus(path))
    if not passages:
        raise CorpusError(f"corpus {path} holds no passages")
    return passages


def write_corpus(passages: Sequence[Passage], path: str | os.PathLike[str]) -> None:
    """Write JSONL deterministically (same passages, same bytes)."""
    with Path(path).open("w", encoding="utf-8", newline="\n") as fh:
        for passage in passages:
            fh.write(json.dumps(passage.to_json(), ensure_ascii=False) + "\n")


def corpus_hash(path: str | os.PathLike[str]) -> str:
    """sha256 of the corpus file's bytes: an index records it to say what it was built from."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def format_passages(passages: Sequence[Passage]) -> str:
    """Search results as the agent sees them inside <information>, in Search-R1's layout."""
    return "".join(f"Doc {i}(Title: {p.title}) {p.text}\n" for i, p in enumerate(passages, start=1))
