"""The paper's factual-QA data: FlashRAG's question files in, Search-R1's parquet rows out.

FlashRAG's layout (the `RUC-NLPIR/FlashRAG_datasets` dataset on the Hugging Face hub, or a copy of
it on disk): `<dataset>/<split>.jsonl`, one JSON object a line with `id`, `question` and
`golden_answers` (a list of strings; `metadata` and anything else is not read). Search-R1 trains on
NQ + HotpotQA `train` and tests on seven benchmarks, each its `test` split where FlashRAG has one,
else its `dev` split (Search-R1's scripts/data_process/qa_search_{train,test}_merge.py): the splits
below are those. A row out is what those scripts write and `load_search_r1` reads: `id`,
`question` (stripped, a `?` added when missing), `golden_answers`, `data_source`, `prompt` (one
user message: the paper's template), `ability`, `reward_model.ground_truth.target`, `extra_info`
(split and index). Every row of every input is written, as those scripts write it: a question two
benchmarks share, or PopQA's one template asked of two people of one name, is two rows, so each
benchmark keeps its n. What departs from their files is DEPARTURES, which the manifest repeats.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from actors.formats import SEARCH_INSTRUCTION
from actors.rewards import normalize_answer

TRAIN_SPLITS: dict[str, str] = {"nq": "train", "hotpotqa": "train"}
"""Search-R1's training set: FlashRAG dataset -> split."""
TEST_SPLITS: dict[str, str] = {
    "nq": "test",
    "triviaqa": "test",
    "popqa": "test",
    "hotpotqa": "dev",
    "2wikimultihopqa": "dev",
    "musique": "dev",
    "bamboogle": "test",
}
"""The seven benchmarks in the paper's column order: FlashRAG dataset -> the split evaluated."""
ABILITY = "fact-reasoning"
DEPARTURES: tuple[str, ...] = (
    "id is <dataset>_<FlashRAG id>: FlashRAG's ids (e.g. test_0) restart in every dataset and "
    "Search-R1's files keep them as they are",
    "metadata is not written: its fields differ by dataset, so one merged column cannot hold it",
    "golden_answers: blank answers are dropped, and a row left with none is refused (one line "
    "naming it) rather than written",
)
"""How the written files differ from Search-R1's for the same input (none in rows or counts)."""

SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("question", pa.string()),
        ("golden_answers", pa.list_(pa.string())),
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        (
            "reward_model",
            pa.struct(
                [
                    ("style", pa.string()),
                    ("ground_truth", pa.struct([("target", pa.list_(pa.string()))])),
                ]
            ),
        ),
        ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64())])),
    ]
)
"""Search-R1's columns, FlashRAG's three first as its `datasets.map` leaves them."""


class SourceError(ValueError):
    """An input file that cannot be used: one line naming the file, the line and the field."""


@dataclass(frozen=True)
class Record:
    """One FlashRAG question as read."""

    id: str
    question: str
    golden_answers: tuple[str, ...]
    line: int  # where it stands in its file (1-based)


def template(question: str) -> str:
    """The paper's prompt (Search-R1's `base` template) for `question`: the tags format's instruction
    as the agent loop builds it, so training sees the prompt the data names."""
    return f"{SEARCH_INSTRUCTION} Question: {question}\n"


def as_question(text: str) -> str:
    """Search-R1's question clean-up: stripped, ending in a question mark."""
    text = text.strip()
    return text if text.endswith("?") else text + "?"


def _record(row: object, path: Path, number: int) -> Record:
    where = f"{path}: line {number}"
    if not isinstance(row, dict):
        raise SourceError(f"{where}: expected a JSON object with id, question, golden_answers")
    qid = row.get("id")
    if qid is None or isinstance(qid, bool) or not isinstance(qid, str | int):
        problem = "is missing" if qid is None else "must be a string or an integer"
        raise SourceError(f"{where}: field 'id' {problem}")
    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        problem = "is missing" if question is None else "must be a non-empty string"
        raise SourceError(f"{where}: field 'question' {problem}")
    answers = row.get("golden_answers")
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
        problem = "is missing" if answers is None else "must be a list of strings"
        raise SourceError(f"{where}: field 'golden_answers' {problem}")
    kept = tuple(a for a in answers if a.strip())
    if not kept:
        raise SourceError(f"{where}: field 'golden_answers' holds no non-empty answer")
    return Record(str(qid), question, kept, number)


def read_flashrag(path: Path) -> list[Record]:
    """The questions of one FlashRAG `<split>.jsonl`, in file order (blank lines skipped)."""
    if not path.is_file():
        raise SourceError(
            f"{path}: no such file (FlashRAG's layout is <dataset>/<split>.jsonl, e.g. nq/test.jsonl)"
        )
    records: list[Record] = []
    ids: dict[str, int] = {}
    try:
        with path.open(encoding="utf-8") as fh:
            for number, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except (json.JSONDecodeError, RecursionError, ValueError) as exc:
                    reason = (
                        exc.msg if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
                    )
                    raise SourceError(f"{path}: line {number}: invalid JSON ({reason})") from None
                record = _record(row, path, number)
                if record.id in ids:  # two questions under one id would merge into one group
                    raise SourceError(
                        f"{path}: line {number}: field 'id' value {record.id!r} repeats line {ids[record.id]}"
                    )
                ids[record.id] = number
                records.append(record)
    except UnicodeDecodeError:
        raise SourceError(f"{path}: not UTF-8 text") from None
    if not records:
        raise SourceError(f"{path}: holds no questions")
    return records


@dataclass(frozen=True)
class Converted:
    rows: list[dict[str, Any]]  # one per record, in order
    repeated: int  # rows whose normalised question an earlier row of the file has (kept)


def convert(
    records: list[Record], data_source: str, split: str, seen: set[str] | None = None
) -> Converted:
    """Search-R1 rows of one source's records, every one of them. A question whose normalised text
    is in `seen` (the output file's questions so far; updated) is counted as repeated and written:
    Search-R1's scripts keep it, and a benchmark's n is its file's rows."""
    seen = set() if seen is None else seen
    rows, repeated = [], 0
    for index, record in enumerate(records):
        question = as_question(record.question)
        key = normalize_answer(question)
        repeated += key in seen
        seen.add(key)
        answers = list(record.golden_answers)
        rows.append(
            {
                "id": f"{data_source}_{record.id}",
                "question": question,
                "golden_answers": answers,
                "data_source": data_source,
                "prompt": [{"role": "user", "content": template(question)}],
                "ability": ABILITY,
                "reward_model": {"style": "rule", "ground_truth": {"target": answers}},
                "extra_info": {"split": split, "index": index},
            }
        )
    return Converted(rows, repeated)


def table(rows: list[dict[str, Any]]) -> pa.Table:
    """The rows as one Arrow table of SCHEMA."""
    return pa.Table.from_pylist(rows, schema=SCHEMA)
