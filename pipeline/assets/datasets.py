"""Question files the pipeline trains and evaluates on, read into one `Question` type.

Search-R1 parquet (`load_search_r1`), GAIA `metadata.jsonl` (`load_gaia`), the bundled mini-GAIA
world (`load_world`, Search-R1 parquet plus a manifest), and files of any layout (`load_rows`:
JSONL, Parquet, Arrow IPC files or a `datasets.save_to_disk` directory, read with pyarrow) whose
columns `data.fields` maps to a question's (`RowFields`); a dataset plug-in's rows are mapped the
same way. A file that cannot be used raises `DatasetError` naming the file, the row (0-based) or
line (JSONL, 1-based) and the field.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from actors.formats import prompt_ids, render
from pipeline.assets.world import VERSION as WORLD_VERSION
from pipeline.plugins import PluginError, register_builtins, resolve

SEARCH_R1_COLUMNS = (
    "id",
    "question",
    "prompt",
    "data_source",
    "reward_model",
    "golden_answers",
    "ability",
    "extra_info",
)
GAIA_FIELDS = ("task_id", "Question", "Level", "Final answer")
ATTACHMENT_NOTE = (
    "\n\nThe question comes with a file, {name}: it is in the python tool's working directory "
    "(open('{name}'))."
)
"""How a GAIA question's attached file is mentioned in its prompt, after the question."""


class DatasetError(ValueError):
    """A question file that cannot be used; one line naming the file, the row or line and the field."""


@dataclass(frozen=True)
class Question:
    id: str
    question: str
    ground_truth: tuple[str, ...]  # acceptable answers, canonical first
    data_source: str  # e.g. "nq", "minigaia_l2", "gaia_l1"; rewards and metrics are split by it
    level: int | None = None
    # Chat messages ({role, content}); empty when the file has none (GAIA).
    prompt: tuple[dict[str, str], ...] = field(default=(), hash=False)
    # Anything else the file holds per question, e.g. hop_queries and gold_doc_ids.
    extra: dict[str, Any] = field(default_factory=dict, hash=False)
    # The prompt as chat messages, used instead of Strata's instruction and question; None:
    # Strata's (data.fields.messages, or Search-R1's prompt with data.use_row_prompt).
    messages: tuple[dict[str, str], ...] | None = field(default=None, hash=False)
    # The tools this question may use, a subset of actors.tools; None: all of them.
    tools: tuple[str, ...] | None = None


def _field_error(path: Path, where: str, name: str, problem: str) -> DatasetError:
    return DatasetError(f"{path}: {where}: field '{name}' {problem}")


def _text(value: object, path: Path, where: str, name: str) -> str:
    if value is None:
        raise _field_error(path, where, name, "is missing")
    if not isinstance(value, str):
        raise _field_error(path, where, name, f"must be a string, not {type(value).__name__}")
    if not value.strip():
        raise _field_error(path, where, name, "is empty")
    return value


def _level(value: object, path: Path, where: str, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, str) and value.strip().isdecimal():  # isdigit() passes '²', int() not
        with contextlib.suppress(ValueError):  # past int()'s 4300 digits: refused below as written
            value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _field_error(path, where, name, f"must be a positive integer, not {value!r}")
    return value


def _unique(
    questions: list[Question], path: Path, unit: str, places: list[int], name: str
) -> list[Question]:
    """Refuse duplicate ids: two prompts sharing one would be merged into one group downstream.

    `places[i]` is where question i stands in the file (its row, or its line number).
    """
    seen: dict[str, int] = {}
    for q, place in zip(questions, places, strict=True):
        if q.id in seen:
            raise DatasetError(
                f"{path}: {unit}s {seen[q.id]} and {place}: field '{name}' value {q.id!r} is duplicated"
            )
        seen[q.id] = place
    return questions


# ------------------------------------------------------------------------------ Search-R1 parquet


def _read_parquet(path: Path) -> pa.Table:
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    try:
        table = pq.read_table(path)
        table.validate(full=True)  # data that is not what the schema says (strings not UTF-8)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:  # the last: a column's name
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DatasetError(f"{path}: not a readable Parquet file ({reason})") from None
    if table.num_rows == 0:
        raise DatasetError(f"{path}: holds no questions")
    return table


def _ground_truth(row: dict[str, Any], path: Path, where: str) -> tuple[str, ...]:
    if "reward_model" in row:
        name, target = "reward_model.ground_truth.target", None
        model = row["reward_model"]
        truth = model.get("ground_truth") if isinstance(model, dict) else None
        if isinstance(truth, dict):
            target = truth.get("target")
        elif truth is not None:  # verl's other datasets put the answer in ground_truth itself
            name, target = "reward_model.ground_truth", truth
    else:
        name, target = "golden_answers", row["golden_answers"]
    if target is None:
        raise _field_error(path, where, name, "is missing")
    if isinstance(target, str):
        target = [target]
    if not isinstance(target, list) or not all(isinstance(t, str) for t in target):
        raise _field_error(path, where, name, "must be a string or a list of strings")
    answers = tuple(t for t in target if t.strip())
    if not answers:
        raise _field_error(path, where, name, "is empty")
    return answers


def _prompt(value: object, path: Path, where: str) -> tuple[dict[str, str], ...]:
    if value is None:
        return ()
    ok = isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    )
    if not ok:
        raise _field_error(path, where, "prompt", "must be a list of {role, content} messages")
    return tuple({"role": m["role"], "content": m["content"]} for m in value)


def _search_r1_row(row: dict[str, Any], index: int, path: Path) -> Question:
    where = f"row {index}"
    extra_info = row.get("extra_info")
    extra_info = (
        {k: v for k, v in extra_info.items() if v is not None}
        if isinstance(extra_info, dict)
        else {}
    )
    prompt = _prompt(row.get("prompt"), path, where)
    if "question" in row:
        question = _text(row["question"], path, where, "question")
    else:
        users = [m["content"] for m in prompt if m["role"] == "user"]
        question = _text(users[-1] if users else None, path, where, "prompt (a user message)")
    if "id" in row:
        qid = row["id"]
        if qid is None or isinstance(qid, bool) or not isinstance(qid, str | int):
            raise _field_error(
                path, where, "id", "is missing" if qid is None else "must be a string or an integer"
            )
        qid = str(qid)
    elif "index" in extra_info:
        qid = str(extra_info["index"])
    else:
        qid = f"{path.stem}-{index}"
    extra = {k: v for k, v in extra_info.items() if k != "level"}
    if row.get("ability") is not None:
        extra["ability"] = row["ability"]
    return Question(
        id=qid,
        question=question,
        ground_truth=_ground_truth(row, path, where),
        data_source=_text(row["data_source"], path, where, "data_source"),
        level=_level(extra_info.get("level"), path, where, "extra_info.level"),
        prompt=prompt,
        extra=extra,
    )


def load_search_r1(path: str | os.PathLike[str]) -> list[Question]:
    """Questions of a Search-R1 parquet file (id, question or prompt, data_source, reward_model or
    golden_answers; extra_info optional), in file order. Ids that repeat across data sources
    (Search-R1's published train and test files) are read as `<data_source>_<id>`."""
    p = Path(path)
    table = _read_parquet(p)
    names, rows = set(table.column_names), f"all {table.num_rows} rows"
    needed = [("data_source",), ("reward_model", "golden_answers"), ("question", "prompt")]
    for options in needed:
        if not names.intersection(options):
            label = (
                "reward_model.ground_truth.target" if options[0] == "reward_model" else options[0]
            )
            raise _field_error(p, rows, label, f"is missing (no {' or '.join(options)} column)")
    # golden_answers is only the fallback: not read at all when reward_model is there.
    skip = {"golden_answers"} if "reward_model" in names else set()
    columns = {
        n: table.column(n).to_pylist() for n in SEARCH_R1_COLUMNS if n in names and n not in skip
    }
    questions = [
        _search_r1_row({n: values[i] for n, values in columns.items()}, i, p)
        for i in range(table.num_rows)
    ]
    return _unique(_qualified(questions, p), p, "row", list(range(table.num_rows)), "id")


def _qualified(questions: list[Question], path: Path) -> list[Question]:
    """`questions` with every id written `<data_source>_<id>` when ids repeat across data
    sources, as in Search-R1's published files (FlashRAG's `test_0` in each of the seven
    datasets): the ids `prepare search_r1` writes for the same rows. A repeat within one data
    source is refused (two prompts sharing an id would be merged into one group downstream)."""
    if len({q.id for q in questions}) == len(questions):
        return questions
    seen: dict[tuple[str, str], int] = {}
    for row, q in enumerate(questions):
        if (q.data_source, q.id) in seen:
            raise DatasetError(
                f"{path}: rows {seen[q.data_source, q.id]} and {row}: field 'id' value {q.id!r} "
                f"is duplicated within data_source {q.data_source!r}"
            )
        seen[q.data_source, q.id] = row
    return [replace(q, id=f"{q.data_source}_{q.id}") for q in questions]


# ---------------------------------------------------------------------------- GAIA metadata.jsonl


def _gaia_row(row: object, number: int, path: Path) -> Question:
    where = f"line {number}"
    if not isinstance(row, dict):
        raise DatasetError(f"{path}: {where}: expected a JSON object")
    task_id = _text(row.get("task_id"), path, where, "task_id")
    level = _level(row.get("Level"), path, where, "Level")
    if level is None:
        raise _field_error(path, where, "Level", "is missing")
    answer = row.get("Final answer")
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        raise _field_error(
            path,
            where,
            "Final answer",
            "is missing: a question without a gold answer cannot be scored",
        )
    question = _text(row.get("Question"), path, where, "Question")
    extra = {k: v for k, v in row.items() if k not in GAIA_FIELDS}
    attached = _attachment(row.get("file_name"), path, where)
    if attached is not None:
        extra["attachments"] = (str(attached),)
        question += ATTACHMENT_NOTE.format(name=attached.name)
    return Question(
        id=task_id,
        question=question,
        ground_truth=(_text(answer, path, where, "Final answer"),),
        data_source=f"gaia_l{level}",
        level=level,
        extra=extra,
    )


def _attachment(name: object, path: Path, where: str) -> Path | None:
    """The file a GAIA question names (`file_name`, beside metadata.jsonl as GAIA ships it), or
    None when it names none; a named file that is not there is refused now, not mid-run."""
    if name is None or (isinstance(name, str) and not name.strip()):
        return None
    if not isinstance(name, str):
        raise _field_error(path, where, "file_name", "must be a string")
    file = path.parent / name
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise _field_error(path, where, "file_name", f"{name!r} must name a file beside it")
    if not file.is_file():
        raise _field_error(
            path,
            where,
            "file_name",
            f"names {file}, which is missing: copy the question's attachments beside {path.name}",
        )
    return file.resolve()


def load_gaia(path: str | os.PathLike[str]) -> list[Question]:
    """Questions of a GAIA `metadata.jsonl` (task_id, Question, Level, Final answer), in file order."""
    p = Path(path)
    questions, lines = [], []
    for number, row in jsonl_rows(p):
        questions.append(_gaia_row(row, number, p))
        lines.append(number)
    if not questions:
        raise DatasetError(f"{p}: holds no questions")
    return _unique(questions, p, "line", lines, "task_id")


def jsonl_rows(p: Path) -> Iterator[tuple[int, object]]:
    """(line number, the line's JSON value) of every non-blank line of `p`."""
    if not p.is_file():
        raise DatasetError(f"{p}: no such file")
    try:
        with p.open(encoding="utf-8") as fh:
            for number, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"{p}: line {number}: invalid JSON ({exc.msg})") from None
                except ValueError:  # not syntax: int() refuses a number of 4300+ digits
                    raise DatasetError(
                        f"{p}: line {number}: invalid JSON (a number of over 4300 digits)"
                    ) from None
                except RecursionError:
                    raise DatasetError(
                        f"{p}: line {number}: invalid JSON (nested too deeply)"
                    ) from None
                yield number, row
    except UnicodeDecodeError:
        raise DatasetError(f"{p}: not UTF-8 text") from None
    except OSError as exc:
        raise DatasetError(f"{p}: cannot read ({exc.strerror or exc})") from None


# ---------------------------------------------------------------------- files of any layout


@dataclass(frozen=True)
class RowFields:
    """Which of a row's columns (`data.fields`) hold a question's parts. A dotted name reaches
    into a nested object (`reward_model.ground_truth`). `named`: the fields the config set
    itself, which every row must have; a default column a row lacks falls back (id: the file's
    stem and the row, data_source: the file's stem, question: the last user message)."""

    question: str = "question"
    answers: str = "answers"
    id: str = "id"
    data_source: str = "data_source"
    messages: str | None = None
    tools: str | None = None
    named: frozenset[str] = frozenset()


ROLES = ("system", "user", "assistant")
"""The roles a row's own messages may take (the prompt: the model answers after them)."""


def _lookup(row: Mapping[str, Any], column: str) -> tuple[bool, Any]:
    """(found, value) of `column` in `row`, a dotted name reaching into nested objects."""
    if column in row:
        return True, row[column]
    node: Any = row
    for part in column.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _messages(value: object, path: Path, where: str, name: str) -> tuple[dict[str, str], ...]:
    ok = (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(m, Mapping) and m.get("role") in ROLES and isinstance(m.get("content"), str)
            for m in value
        )
    )
    if not ok:
        raise _field_error(
            path,
            where,
            name,
            f"must be a non-empty list of {{role, content}} messages, roles {', '.join(ROLES)}",
        )
    return tuple({"role": m["role"], "content": m["content"]} for m in value)


def _answers(value: object, path: Path, where: str, name: str) -> tuple[str, ...]:
    if isinstance(value, int | float) and not isinstance(value, bool):
        value = [str(value)]  # a numeric answer (GSM8K's) is matched as its text
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple) or not all(isinstance(a, str) for a in value):
        raise _field_error(path, where, name, "must be a string or a list of strings")
    answers = tuple(a for a in value if a.strip())
    if not answers:
        raise _field_error(path, where, name, "is empty")
    return answers


def _tool_names(value: object, path: Path, where: str, name: str) -> tuple[str, ...] | None:
    if value is None:
        return None  # this row: every configured tool
    if not isinstance(value, list | tuple) or not all(isinstance(t, str) and t for t in value):
        raise _field_error(path, where, name, "must be a list of tool names")
    return tuple(dict.fromkeys(value))


def question_of_row(row: object, path: Path, where: str, fields: RowFields) -> Question:
    """The question a row holds under `fields`; every column not used is kept in `extra`."""
    if not isinstance(row, Mapping):
        raise DatasetError(
            f"{path}: {where}: expected an object of fields, not {type(row).__name__}"
        )

    def get(key: str) -> tuple[bool, Any, str]:
        column = getattr(fields, key)
        found, value = _lookup(row, column)
        if not found and key in fields.named:
            raise _field_error(path, where, column, f"is missing (data.fields.{key})")
        return found and value is not None, value, column

    messages = None
    if fields.messages is not None:
        found, value, column = get("messages")
        if not found:
            raise _field_error(path, where, column, "is missing (data.fields.messages)")
        messages = _messages(value, path, where, column)
    found, value, column = get("question")
    if found:
        question = _text(value, path, where, column)
    elif messages is not None:
        users = [m["content"] for m in messages if m["role"] == "user"]
        question = _text(users[-1] if users else None, path, where, f"{column} (a user message)")
    else:
        raise _field_error(path, where, column, "is missing (data.fields.question)")
    found, value, column = get("answers")
    if not found:
        raise _field_error(path, where, column, "is missing (data.fields.answers)")
    answers = _answers(value, path, where, column)
    found, value, column = get("id")
    if not found:
        qid = f"{path.stem}-{where.rpartition(' ')[2]}"
    elif isinstance(value, bool) or not isinstance(value, str | int):
        raise _field_error(path, where, column, "must be a string or an integer")
    else:
        qid = str(value)
    found, value, column = get("data_source")
    source = _text(value, path, where, column) if found else path.stem
    tools = None
    if fields.tools is not None:
        found, value, column = get("tools")
        tools = _tool_names(value if found else None, path, where, column)
    used = {getattr(fields, k) for k in ("question", "answers", "id", "data_source")}
    used |= {c for c in (fields.messages, fields.tools) if c is not None}
    extra = {k: v for k, v in row.items() if k not in used}
    return Question(qid, question, answers, source, messages=messages, extra=extra, tools=tools)


def _arrow_tables(p: Path) -> Iterator[pa.Table]:
    """The tables of an Arrow IPC file (file or stream format) or of a `datasets.save_to_disk`
    directory (its state.json's data files, else every *.arrow in name order)."""
    if p.is_dir():
        if (p / "dataset_dict.json").is_file():
            splits = sorted(d.name for d in p.iterdir() if d.is_dir())
            raise DatasetError(
                f"{p}: a dataset dictionary of splits ({', '.join(splits)}): name one split's "
                f"directory, e.g. {p / (splits[0] if splits else 'train')}"
            )
        files = []
        state = p / "state.json"
        if state.is_file():
            try:
                listed = json.loads(state.read_text(encoding="utf-8")).get("_data_files") or []
                files = [p / f["filename"] for f in listed]
            except (ValueError, UnicodeDecodeError, AttributeError, KeyError, TypeError):
                raise DatasetError(f"{state}: not a datasets state file") from None
        files = files or sorted(p.glob("*.arrow"))
        if not files:
            raise DatasetError(f"{p}: holds no .arrow files (a datasets.save_to_disk directory)")
        for file in files:
            yield from _arrow_tables(file)
        return
    if not p.is_file():
        raise DatasetError(f"{p}: no such file or directory")
    try:
        with pa.memory_map(str(p)) as source:
            try:
                table = ipc.open_file(source).read_all()
            except pa.ArrowInvalid:  # not the file format: the stream format (datasets writes it)
                source.seek(0)
                table = ipc.open_stream(source).read_all()
        table.validate(full=True)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DatasetError(f"{p}: not a readable Arrow IPC file ({reason})") from None
    yield table


def _table_rows(tables: Iterable[pa.Table]) -> Iterator[tuple[str, object]]:
    index = 0
    for table in tables:
        for batch in table.to_batches(
            max_chunksize=4096
        ):  # rows as Python objects, a batch at a time
            for row in batch.to_pylist():
                yield f"row {index}", row
                index += 1


def file_rows(path: str | os.PathLike[str], kind: str) -> Iterator[tuple[str, object]]:
    """(where, row) of every row of a `kind` file: jsonl (line N, 1-based), parquet or arrow
    (row N, 0-based)."""
    p = Path(path)
    if kind == "jsonl":
        return ((f"line {n}", row) for n, row in jsonl_rows(p))
    if kind == "parquet":
        return _table_rows([_read_parquet(p)])
    if kind == "arrow":
        return _table_rows(_arrow_tables(p))
    raise ValueError(f"no file kind {kind!r}")


def load_rows(
    path: str | os.PathLike[str], rows: Iterable[tuple[str, object]], fields: RowFields
) -> list[Question]:
    """The questions of `rows` ((where, row) from `file_rows` or a plug-in), mapped by `fields`;
    a row that already is a Question is taken as it is. Duplicate ids are refused."""
    p = Path(path)
    questions, places = [], []
    for where, row in rows:
        questions.append(
            row if isinstance(row, Question) else question_of_row(row, p, where, fields)
        )
        places.append(where)
    if not questions:
        raise DatasetError(f"{p}: holds no questions")
    seen: dict[str, str] = {}
    for q, where in zip(questions, places, strict=True):
        if q.id in seen:
            raise DatasetError(
                f"{p}: {seen[q.id]} and {where}: field '{fields.id}' value {q.id!r} is duplicated"
            )
        seen[q.id] = where
    return questions


def _plugin_rows(
    loader: Callable[[str], Iterable[object]], path: Path
) -> Iterator[tuple[str, object]]:
    try:
        rows = loader(str(path))
        for index, row in enumerate(rows):
            yield f"row {index}", row
    except DatasetError:
        raise
    except Exception as exc:  # the plug-in's own code: any failure is the file's, in one line
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise DatasetError(
            f"{path}: the dataset plug-in failed: {type(exc).__name__}"
            + (f": {reason}" if reason else "")
        ) from None


# ----------------------------------------------------------------------------------------- entry


FILE_KINDS = ("jsonl", "parquet", "arrow")
"""`data.type`s read by `file_rows` and mapped by `data.fields`."""


def load_questions(path: str | os.PathLike[str], data: Any = None) -> list[Question]:
    """Questions of one file as `data` (the `data` config section, read by attribute) reads it:
    data.type jsonl, parquet, arrow or a plug-in's name, its rows mapped by data.fields;
    otherwise (and with no `data`) by the file's suffix: .parquet is Search-R1, .jsonl is GAIA
    metadata, and data.use_row_prompt makes a Search-R1 row's prompt the question's messages."""
    p = Path(path)
    kind = getattr(data, "type", None)
    if kind in FILE_KINDS or (kind is not None and kind not in LOADERS):
        return load_rows(p, data_rows(p, kind), row_fields(data.fields))
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        questions = load_search_r1(p)
        if getattr(data, "use_row_prompt", False):
            questions = [_row_prompt(q, p, i) for i, q in enumerate(questions)]
        return questions
    if suffix == ".jsonl":
        return load_gaia(p)
    raise DatasetError(
        f"{p}: unknown question file type {suffix or '(no suffix)'!r}; expected .parquet "
        "(Search-R1) or .jsonl (GAIA metadata), or set data.type jsonl, parquet or arrow with "
        "data.fields"
    )


def data_rows(path: Path, kind: str) -> Iterator[tuple[str, object]]:
    """(where, row) of a file of data.type `kind`: a file kind's own reader, or the rows a
    dataset plug-in (`pipeline.plugins`, kind datasets: `loader(path) -> iterable of rows`)
    gives."""
    if kind in FILE_KINDS:
        return file_rows(path, kind)
    try:
        loader = resolve("datasets", kind, "data.type")
    except PluginError as exc:
        raise DatasetError(str(exc)) from None
    return _plugin_rows(loader, path)


def row_fields(section: Any) -> RowFields:
    """`RowFields` of the `data.fields` config section (read by attribute)."""
    keys = ("question", "answers", "id", "data_source", "messages", "tools")
    return RowFields(
        **{k: getattr(section, k) for k in keys},
        named=frozenset(k for k in keys if k in section.model_fields_set),
    )


def _row_prompt(q: Question, path: Path, index: int) -> Question:
    if not q.prompt:
        raise _field_error(path, f"row {index}", "prompt", "is missing (data.use_row_prompt)")
    return replace(q, messages=q.prompt)


def load_world(world_dir: str | os.PathLike[str]) -> tuple[list[Question], list[Question]]:
    """(train, test) questions of a mini-GAIA world written by `python -m pipeline.assets.world`."""
    d = Path(world_dir)
    manifest = d / "world.json"
    if not manifest.is_file():
        raise DatasetError(
            f"not a complete world: {manifest} is missing; build it with python -m pipeline.assets.world --out {d}"
        )
    try:
        version = json.loads(manifest.read_text(encoding="utf-8")).get("version")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        version = None
    if version != WORLD_VERSION:
        raise DatasetError(
            f"{manifest}: field 'version' is {version!r}, expected {WORLD_VERSION}; rebuild it with python -m pipeline.assets.world --out {d} --force"
        )
    return load_search_r1(d / "train.parquet"), load_search_r1(d / "test.parquet")


LOADERS: dict[str, Any] = {
    "mini_gaia": load_world,
    "search_r1": load_search_r1,
    "gaia": load_gaia,
    **{kind: file_rows for kind in FILE_KINDS},
}
"""`data.type`'s built-in names -> how their files are read (mini_gaia: a world directory)."""
register_builtins("datasets", LOADERS)


def drop_long_prompts(
    questions: list[Question], tokenizer: Any, tools: Sequence[str], max_tokens: int
) -> tuple[list[Question], int]:
    """The questions whose prompt (instruction, question and chat template, or the question's
    own messages, as the agent loop builds it with `tools` or the question's own subset) has at
    most `max_tokens` tokens, and how many were skipped."""
    kept = [q for q in questions if len(_prompt_ids(tokenizer, tools, q)) <= max_tokens]
    return kept, len(questions) - len(kept)


def _prompt_ids(tokenizer: Any, tools: Sequence[str], q: Question) -> list[int]:
    tools = [t for t in tools if t in q.tools] if q.tools is not None else tools
    if q.messages is not None:
        return tokenizer.encode(render(tokenizer, list(q.messages)), add_special_tokens=False)
    return prompt_ids(tokenizer, tools, q.question)


def check_row_tools(questions: Sequence[Question], tools: Sequence[str], where: str) -> None:
    """Refuse a question whose own tools (data.fields.tools) name one `tools` (actors.tools)
    does not enable: it would have a tool the run never builds."""
    enabled = set(tools)
    for q in questions:
        unknown = [t for t in q.tools or () if t not in enabled]
        if unknown:
            raise DatasetError(
                f"{where}: question {q.id!r}: its tools name {', '.join(map(repr, unknown))}, "
                f"not in actors.tools ({', '.join(tools) or 'none'}): enable it or fix the row"
            )
