"""Question files of any layout (data.type jsonl, parquet, arrow, a plug-in) mapped by
data.fields, Search-R1's own prompt (data.use_row_prompt), a row's own messages and tools, and
every bad row refused in one line naming the file, the row and the field."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from pipeline.assets.datasets import (
    FILE_KINDS,
    LOADERS,
    DatasetError,
    Question,
    check_row_tools,
    load_questions,
)
from pipeline.config.loader import ConfigError, load_config

LOCAL = str(Path(__file__).resolve().parents[2] / "configs" / "local.yaml")
FIELDS = [
    "data.fields.question=prompt_text",
    "data.fields.answers=gold.accepted",
    "data.fields.id=uid",
    "data.fields.data_source=task",
]
ROWS = [
    {
        "uid": 7,
        "prompt_text": "What is 2 + 3?",
        "gold": {"accepted": ["5", "five"]},
        "task": "arith",
        "difficulty": 1,
    },
    {
        "uid": 8,
        "prompt_text": "What is 2 * 3?",
        "gold": {"accepted": ["6"]},
        "task": "arith",
        "difficulty": 2,
    },
]
EXPECTED = [
    Question(
        "7",
        "What is 2 + 3?",
        ("5", "five"),
        "arith",
        extra={"gold": ROWS[0]["gold"], "difficulty": 1},
    ),
    Question(
        "8", "What is 2 * 3?", ("6",), "arith", extra={"gold": ROWS[1]["gold"], "difficulty": 2}
    ),
]


def write(path: Path, rows: list[dict], kind: str) -> Path:
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:  # Arrow's IPC file format
        table = pa.Table.from_pylist(rows)
        with ipc.new_file(str(path), table.schema) as writer:
            writer.write_table(table)
    return path


def data(tmp_path: Path, kind: str, *settings: str, files=("train",)):
    paths = [str(tmp_path / f"{name}.{kind}") for name in files]
    return load_config(
        LOCAL, [f"data.type={kind}", f"data.train_files=[{','.join(paths)}]", *settings]
    ).data


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_rows_of_any_layout_become_questions(tmp_path, kind):
    write(tmp_path / f"train.{kind}", ROWS, kind)
    assert load_questions(tmp_path / f"train.{kind}", data(tmp_path, kind, *FIELDS)) == EXPECTED


def test_defaults_and_fallbacks(tmp_path):
    """Without data.fields: question / answers / id / data_source columns; no id: the file's
    stem and the line; no data_source: the file's stem; a number as an answer: its text."""
    write(tmp_path / "train.jsonl", [{"question": "Q?", "answers": 12}], "jsonl")
    (q,) = load_questions(tmp_path / "train.jsonl", data(tmp_path, "jsonl"))
    assert (q.id, q.question, q.ground_truth, q.data_source, q.messages, q.tools) == (
        "train-1",
        "Q?",
        ("12",),
        "train",
        None,
        None,
    )


def test_arrow_stream_files_and_save_to_disk_directories(tmp_path):
    """datasets.save_to_disk writes Arrow IPC streams listed in state.json: read with pyarrow
    (the datasets package is not needed)."""
    saved = tmp_path / "saved"
    saved.mkdir()
    for i, rows in enumerate((ROWS[:1], ROWS[1:])):
        table = pa.Table.from_pylist(rows)
        with ipc.new_stream(str(saved / f"data-0000{i}-of-00002.arrow"), table.schema) as w:
            w.write_table(table)
    (saved / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": f"data-0000{i}-of-00002.arrow"} for i in (0, 1)]})
    )
    (saved / "dataset_info.json").write_text("{}")
    config = load_config(LOCAL, ["data.type=arrow", f"data.train_files=[{saved}]", *FIELDS])
    assert load_questions(saved, config.data) == EXPECTED
    (tmp_path / "dict").mkdir()
    (tmp_path / "dict" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    (tmp_path / "dict" / "train").mkdir()
    with pytest.raises(DatasetError, match=r"a dataset dictionary of splits \(train\): name one"):
        load_questions(tmp_path / "dict", config.data)


def test_a_rows_own_messages_and_tools(tmp_path):
    rows = [
        {
            "chat": [
                {"role": "system", "content": "You add numbers."},
                {"role": "user", "content": "2 + 3?"},
            ],
            "answers": ["5"],
            "allowed": ["python"],
        },
        {"chat": [{"role": "user", "content": "Capital of France?"}], "answers": ["Paris"]},
    ]
    write(tmp_path / "train.parquet", rows, "parquet")
    config = data(tmp_path, "parquet", "data.fields.messages=chat", "data.fields.tools=allowed")
    first, second = load_questions(tmp_path / "train.parquet", config)
    assert first.messages == tuple(rows[0]["chat"]) and first.question == "2 + 3?"
    assert first.tools == ("python",) and second.tools is None  # a null in a row: all the tools
    check_row_tools([first, second], ["search", "python"], "data.train_files")
    with pytest.raises(DatasetError) as error:
        check_row_tools([first], ["search"], "data.train_files")
    assert str(error.value) == (
        "data.train_files: question 'train-0': its tools name 'python', not in actors.tools "
        "(search): enable it or fix the row"
    )


@pytest.mark.parametrize(
    ("rows", "settings", "message"),
    [
        ([{"question": "Q?"}], [], "line 1: field 'answers' is missing (data.fields.answers)"),
        (
            [{"q": "Q?", "answers": "a"}, {"answers": "b"}],
            ["data.fields.question=q"],
            "line 2: field 'q' is missing (data.fields.question)",
        ),
        (
            [{"question": "Q?", "answers": "a"}],
            ["data.fields.id=uid"],
            "line 1: field 'uid' is missing (data.fields.id)",
        ),
        ([{"question": "Q?", "answers": [1]}], [], "line 1: field 'answers' must be a string or"),
        ([{"question": "  ", "answers": "a"}], [], "line 1: field 'question' is empty"),
        (
            [
                {"question": "Q?", "answers": "a", "id": 1},
                {"question": "R?", "answers": "b", "id": "1"},
            ],
            [],
            "line 1 and line 2: field 'id' value '1' is duplicated",
        ),
        (
            [{"m": [{"role": "tool", "content": "x"}], "answers": "a"}],
            ["data.fields.messages=m"],
            "line 1: field 'm' must be a non-empty list of {role, content} messages, roles "
            "system, user, assistant",
        ),
        (
            [{"question": "Q?", "answers": "a", "t": "search"}],
            ["data.fields.tools=t"],
            "line 1: field 't' must be a list of tool names",
        ),
        (["[1, 2]"], [], "line 1: expected an object of fields, not list"),
    ],
)
def test_a_bad_row_is_one_line_naming_file_row_and_field(tmp_path, rows, settings, message):
    path = tmp_path / "train.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    with pytest.raises(DatasetError) as error:
        load_questions(path, data(tmp_path, "jsonl", *settings))
    assert str(error.value).startswith(f"{path}: {message}")
    assert "\n" not in str(error.value)


def test_a_bad_parquet_row_names_its_row(tmp_path):
    path = write(tmp_path / "train.parquet", [{"question": "Q?", "answers": "a"}] * 2, "parquet")
    with pytest.raises(
        DatasetError,
        match=r"train\.parquet: row 0 and row 1: field 'question' value 'Q\?' is duplicated",
    ):
        load_questions(path, data(tmp_path, "parquet", "data.fields.id=question"))


def test_search_r1_keeps_working_and_its_prompt_is_used_when_asked(tmp_path):
    row = {
        "id": "q0",
        "question": "Capital of France?",
        "golden_answers": ["Paris"],
        "data_source": "nq",
        "prompt": [
            {"role": "user", "content": "Answer with <search>. Question: Capital of France?"}
        ],
    }
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)
    given = load_config(LOCAL, ["data.type=search_r1", f"data.train_files=[{path}]"]).data
    (plain,) = load_questions(path, given)
    assert plain.messages is None and plain.prompt == tuple(row["prompt"])
    own = load_config(
        LOCAL, ["data.type=search_r1", f"data.train_files=[{path}]", "data.use_row_prompt=true"]
    ).data
    (used,) = load_questions(path, own)
    assert used.messages == tuple(row["prompt"]) and used.question == "Capital of France?"
    pq.write_table(pa.Table.from_pylist([{**row, "prompt": None}]), path)
    with pytest.raises(
        DatasetError, match=r"row 0: field 'prompt' is missing \(data.use_row_prompt\)"
    ):
        load_questions(path, own)


def test_a_dataset_plug_in_gives_rows_mapped_by_the_fields(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("gen.py").write_text(
        "def rows(path):\n"
        "    n = int(open(path).read())\n"
        "    return [{'q': f'{i} + {i}?', 'a': str(2 * i)} for i in range(n)]\n"
    )
    Path("three.txt").write_text("3")
    config = load_config(
        LOCAL,
        [
            "data.type=gen.py:rows",
            "data.train_files=[three.txt]",
            "data.fields.question=q",
            "data.fields.answers=a",
        ],
    )
    got = load_questions("three.txt", config.data)
    assert [(q.id, q.question, q.ground_truth) for q in got] == [
        ("three-0", "0 + 0?", ("0",)),
        ("three-1", "1 + 1?", ("2",)),
        ("three-2", "2 + 2?", ("4",)),
    ]
    Path("three.txt").write_text("x")
    with pytest.raises(DatasetError) as error:
        load_questions("three.txt", config.data)
    assert str(error.value) == (
        "three.txt: the dataset plug-in failed: ValueError: invalid literal for int() with base "
        "10: 'x'"
    )


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (["data.type=jsonl"], "data.type 'jsonl' needs data.train_files"),
        (
            ["data.type=search_r1", "data.train_files=[a.parquet]", "data.fields.question=q"],
            "data.fields maps the rows of data.type jsonl, parquet, arrow or a plug-in; "
            "search_r1 files have their own layout",
        ),
        (
            ["data.type=jsonl", "data.train_files=[a.jsonl]", "data.use_row_prompt=true"],
            "data.use_row_prompt reads Search-R1's prompt column",
        ),
        (
            ["data.type=csv", "data.train_files=[a.csv]"],
            "unknown dataset loader 'csv'; known: mini_gaia, search_r1, gaia, jsonl, parquet, "
            "arrow; plug-ins found (entry points strata.datasets): none;",
        ),
        (
            ["data.type=no_such_mod:rows", "data.train_files=[a]"],
            "cannot import 'no_such_mod:rows': ModuleNotFoundError: No module named 'no_such_mod'",
        ),
    ],
)
def test_data_settings_that_cannot_act_are_refused_in_one_line(settings, message):
    with pytest.raises(ConfigError) as error:
        load_config(LOCAL, settings)
    assert message in str(error.value)


def test_the_built_in_data_types_are_the_loaders():
    from pipeline.config.schema import DATA_TYPES

    assert list(DATA_TYPES) == list(LOADERS)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from pipeline.assets.tiny_policy import build_tiny_policy

    out = tmp_path_factory.mktemp("tiny")
    return AutoTokenizer.from_pretrained(
        build_tiny_policy(out / "tiny", ["What is two and three?"] * 50, vocab_size=300)
    )


def test_the_run_and_its_held_out_evaluation_read_the_files_the_same_way(tmp_path, tokenizer):
    from pipeline.backends.runtime import RuntimeUnavailable
    from pipeline.evaluation.heldout import load_items
    from pipeline.runtime.stream import question_stream

    train = write(tmp_path / "train.jsonl", ROWS, "jsonl")
    held = write(tmp_path / "held.jsonl", ROWS[1:], "jsonl")
    config = load_config(
        LOCAL,
        [
            "data.type=jsonl",
            f"data.train_files=[{train}]",
            "data.shuffle=false",
            "data.max_prompt_tokens=4096",
            f"eval.data=[{held}]",
            *FIELDS,
        ],
    )
    tasks, skipped = question_stream(config, None, tokenizer)
    assert skipped == 0 and [next(tasks).id for _ in range(3)] == ["7", "8", "7"]
    (item,) = load_items([held], None, config)
    assert item.question == EXPECTED[1] and item.row == "arith"
    write(train, [{**ROWS[0], "tools": ["calculator"]}], "jsonl")
    config = load_config(
        LOCAL,
        ["data.type=jsonl", f"data.train_files=[{train}]", *FIELDS, "data.fields.tools=tools"],
    )
    with pytest.raises(RuntimeUnavailable) as error:
        question_stream(config, None, tokenizer)
    assert str(error.value) == (
        f"data.train_files: {train}: question '7': its tools name 'calculator', not in "
        "actors.tools (search, python): enable it or fix the row"
    )


def test_a_long_prompt_of_its_own_messages_is_skipped(tokenizer):
    from pipeline.assets.datasets import drop_long_prompts

    short = Question("s", "Two and three?", ("5",), "q")
    from actors.formats import prompt_ids

    limit = len(prompt_ids(tokenizer, ["search"], short.question))  # Strata's instruction in it
    chat = ({"role": "user", "content": "What is two and three? " * limit},)
    own = Question("m", "Two and three?", ("5",), "q", messages=chat)
    kept, skipped = drop_long_prompts([short, own], tokenizer, ["search"], limit)
    assert [q.id for q in kept] == ["s"] and skipped == 1
