"""Hostile question files and trajectory Parquet files, fuzzed: each loads or fails with the
loader's own error, one line naming the file; never another exception, which would reach the
user as a traceback."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from buffers.reader import TrajectoryFileError, read_trajectories
from buffers.spill import SPILL_SCHEMA, spill_table
from buffers.testing import synthetic_trajectory as traj
from pipeline.assets.datasets import SEARCH_R1_COLUMNS, DatasetError, Question, load_questions
from tests.faults.hostile import FUZZ_DATA, TEXT, assert_one_line

# ---------------------------------------------------------------------------- dataset loaders

JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 5),
    st.floats(),
    TEXT,
    st.sampled_from(["", " ", "1", "3", "²", "٣", "x" * 10_000]),
    st.lists(TEXT, max_size=2),
    st.dictionaries(TEXT, TEXT, max_size=2),
)
GAIA_ROWS = st.fixed_dictionaries(
    {},
    optional={
        "task_id": st.one_of(st.sampled_from(["t0", "t1", "t2"]), JSON_VALUES),
        "Question": st.one_of(st.just("How many?"), JSON_VALUES),
        "Level": st.one_of(st.sampled_from([1, 2, 3, "2"]), JSON_VALUES),
        "Final answer": st.one_of(st.just("42"), JSON_VALUES),
        "file_name": JSON_VALUES,
    },
)
ODD_LINES = [
    "{",
    "}",
    "NaN",
    "",
    "   ",
    '{"a": 1}{"b": 2}',
    "\ufeff{}",
    "[" * 3000,
    '{"task_id": "t", "Question": "q", "Level": ' + "9" * 5000 + ', "Final answer": "a"}',
    '{"task_id": "t", "Question": "q", "Level": "²", "Final answer": "a"}',
]
JSONL_LINES = st.one_of(
    GAIA_ROWS.map(json.dumps), JSON_VALUES.map(json.dumps), st.sampled_from(ODD_LINES), TEXT
)
JSONL_FILES = st.one_of(
    st.lists(JSONL_LINES, max_size=5).map(lambda lines: "\n".join(lines).encode()),
    st.binary(max_size=64),
)


def good_row(i: int) -> dict:
    return {
        "id": f"q{i}",
        "question": f"Capital of {i}?",
        "golden_answers": ["Paris"],
        "data_source": "nq",
        "prompt": [{"role": "user", "content": f"Capital of {i}?"}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": ["Paris"]}},
        "extra_info": {"split": "train", "index": i, "level": 1},
    }


R1 = pa.Table.from_pylist([good_row(i) for i in range(3)])
MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
COLUMN_KINDS = {  # an Arrow type and its values (each may be null)
    "string": (pa.string(), st.one_of(TEXT, st.sampled_from(["", " ", "²", "x" * 1000]))),
    "int": (pa.int64(), st.integers(-(2**63), 2**63 - 1)),
    "float": (pa.float64(), st.floats()),
    "bool": (pa.bool_(), st.booleans()),
    "null": (pa.null(), st.none()),
    "binary": (pa.binary(), st.binary(max_size=8)),
    "strings": (pa.list_(pa.string()), st.lists(st.one_of(st.none(), TEXT), max_size=3)),
    "messages": (
        pa.list_(MESSAGE),
        st.lists(
            st.fixed_dictionaries(
                {"role": st.one_of(st.none(), TEXT), "content": st.one_of(st.none(), TEXT)}
            ),
            max_size=2,
        ),
    ),
    "reward_model": (
        pa.struct([("ground_truth", pa.struct([("target", pa.list_(pa.string()))]))]),
        st.fixed_dictionaries(
            {
                "ground_truth": st.one_of(
                    st.none(),
                    st.fixed_dictionaries(
                        {
                            "target": st.one_of(
                                st.none(), st.lists(st.one_of(st.none(), TEXT), max_size=2)
                            )
                        }
                    ),
                )
            }
        ),
    ),
    "plain_ground_truth": (
        pa.struct([("ground_truth", pa.string())]),
        st.fixed_dictionaries({"ground_truth": st.one_of(st.none(), TEXT)}),
    ),
    "extra_info": (
        pa.struct([("index", pa.int64()), ("level", pa.string())]),
        st.fixed_dictionaries(
            {
                "index": st.one_of(st.none(), st.integers(0, 3)),
                "level": st.one_of(st.none(), st.sampled_from(["1", "0", "²", "x"])),
            }
        ),
    ),
}


@st.composite
def columns(draw, rows: int) -> pa.Array:
    arrow_type, values = COLUMN_KINDS[draw(st.sampled_from(sorted(COLUMN_KINDS)))]
    cells = draw(st.lists(st.one_of(st.none(), values), min_size=rows, max_size=rows))
    return pa.array(cells, arrow_type)


@st.composite
def reshaped(draw, table: pa.Table, names: st.SearchStrategy) -> pa.Table:
    """`table` with columns dropped, retyped, duplicated or added (named by `names`)."""
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["drop", "retype", "duplicate", "add"]))
        i = draw(st.integers(0, table.num_columns - 1))
        name = table.column_names[i]
        if op == "drop" and table.num_columns > 1:
            table = table.remove_column(i)
        elif op == "retype":
            table = table.set_column(i, name, draw(columns(table.num_rows)))
        elif op == "duplicate":
            table = table.append_column(name, table.column(i))
        elif op == "add":
            table = table.append_column(draw(names), draw(columns(table.num_rows)))
    return table


def search_r1_tables() -> st.SearchStrategy:
    """0-3 valid Search-R1 rows, their columns reshaped; some are still valid."""
    names = st.one_of(st.sampled_from(SEARCH_R1_COLUMNS), TEXT.filter(bool))
    return st.integers(0, 3).flatmap(lambda n: reshaped(R1.slice(0, n), names))


def parquet_bytes(table: pa.Table, **options) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, **options)
    return sink.getvalue().to_pybytes()


@st.composite
def parquet_files(draw) -> bytes:
    """A Search-R1 file, hostile in its columns, or damaged: truncated, with garbage inside."""
    data = parquet_bytes(draw(search_r1_tables()))
    damage = draw(st.sampled_from(["none"] * 4 + ["truncate", "garbage", "bytes"]))
    if damage == "bytes":
        return draw(
            st.one_of(
                st.binary(max_size=64), st.binary(max_size=32).map(lambda b: b"PAR1" + b + b"PAR1")
            )
        )
    if damage != "none":
        cut = draw(st.integers(0, len(data) - 1))
        junk = b"" if damage == "truncate" else draw(st.binary(min_size=1, max_size=16))
        return data[:cut] + junk + (data[cut + len(junk) :] if junk else b"")
    return data


@FUZZ_DATA
@given(suffix=st.sampled_from([".jsonl", ".parquet"]), data=st.data())
def test_question_files_load_or_fail_in_one_line(scratch, suffix, data):
    content = data.draw(JSONL_FILES if suffix == ".jsonl" else parquet_files())
    path = scratch / f"questions{suffix}"
    path.write_bytes(content)
    try:
        questions = load_questions(path)
    except DatasetError as exc:
        event(f"{suffix}: DatasetError")
        assert_one_line(str(exc), str(path))
    else:
        event(f"{suffix}: loads")
        assert questions and all(isinstance(q, Question) for q in questions)


def plain_parquet(table: pa.Table) -> bytes:
    """Parquet whose strings lie as written in the bytes (no compression, dictionary, statistics)."""
    return parquet_bytes(table, compression="none", use_dictionary=False, write_statistics=False)


QUESTIONS_THAT_BROKE_THE_LOADERS = [  # (suffix, content, what the one line says)
    # int('²') raised ValueError: '²'.isdigit() is true.
    (
        ".jsonl",
        b'{"task_id": "t", "Question": "q", "Level": "\xc2\xb2", "Final answer": "a"}',
        "line 1: field 'Level' must be a positive integer, not '²'",
    ),
    (
        ".parquet",
        parquet_bytes(pa.Table.from_pylist([good_row(0) | {"extra_info": {"level": "²"}}])),
        "row 0: field 'extra_info.level' must be a positive integer, not '²'",
    ),
    # json.loads let out ValueError (a number of 4300+ digits) and RecursionError.
    (
        ".jsonl",
        b'{"Level": ' + b"9" * 5000 + b"}",
        "line 1: invalid JSON (a number of over 4300 digits)",
    ),
    (".jsonl", b"[" * 3000, "line 1: invalid JSON (nested too deeply)"),
    # Bytes that are not UTF-8 where the schema says string: to_pylist() raised UnicodeDecodeError,
    # in a column's name or in its values.
    (
        ".parquet",
        plain_parquet(R1).replace(b"data_source", b"\x80ata_source"),
        "not a readable Parquet file ('utf-8' codec can't decode byte 0x80",
    ),
    (
        ".parquet",
        plain_parquet(R1).replace(b"\x02\x00\x00\x00nq", b"\x02\x00\x00\x00\x80q"),
        "Invalid UTF8 sequence at string index 0)",
    ),
]


@pytest.mark.parametrize("suffix, content, says", QUESTIONS_THAT_BROKE_THE_LOADERS)
def test_what_broke_the_question_loaders_fails_in_one_line(scratch, suffix, content, says):
    path = scratch / f"broke{suffix}"
    path.write_bytes(content)
    with pytest.raises(DatasetError) as failure:
        load_questions(path)
    assert_one_line(str(failure.value), str(path))
    assert says in str(failure.value)


# ------------------------------------------------------------------------ trajectory reader

GOOD = spill_table([(traj(f"p{i // 2}", i % 2, seed=i), "released", 0) for i in range(4)])
GOOD_BYTES, GOOD_PLAIN = parquet_bytes(GOOD), plain_parquet(GOOD)


@st.composite
def overwritten(draw) -> bytes:
    """A good file with a few bytes overwritten past its magic number: may or may not still read."""
    data = draw(st.sampled_from([GOOD_BYTES, GOOD_PLAIN]))
    at, junk = draw(st.integers(4, len(data) - 12)), draw(st.binary(min_size=1, max_size=8))
    return data[:at] + junk + data[at + len(junk) :]


HOSTILE_FILES = st.one_of(
    st.binary(max_size=64).map(lambda b: ("bad", b)),
    st.integers(0, len(GOOD_BYTES) - 1).map(lambda cut: ("bad", GOOD_BYTES[:cut])),
    overwritten().map(lambda b: (GOOD.num_rows, b)),
    st.just(("bad", b"")),
    reshaped(GOOD, TEXT.filter(bool)).map(lambda t: (t.num_rows, parquet_bytes(t))),  # conforms?
)


@FUZZ_DATA
@given(
    hostile=st.lists(HOSTILE_FILES, min_size=1, max_size=3),
    wanted=st.lists(st.sampled_from(SPILL_SCHEMA.names), min_size=1, max_size=6, unique=True),
)
def test_reader_skips_and_names_bad_files(tmp_path_factory, hostile, wanted):
    directory = tmp_path_factory.mktemp("spill")
    good = [directory / "part-000001.parquet", directory / "nested" / "part-000002.parquet"]
    for path in good:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(GOOD_BYTES)
    rows = dict.fromkeys(good, GOOD.num_rows)
    for i, (expected, content) in enumerate(hostile):
        path = directory / f"hostile-{i}.parquet"
        path.write_bytes(content)
        rows[path] = expected
    table, bad = read_trajectories(directory, wanted, skip_bad=True)
    named = {exc.path for exc in bad}
    for exc in bad:
        assert isinstance(exc, TrajectoryFileError)
        assert_one_line(str(exc), str(exc.path))
    assert named.isdisjoint(good)
    assert {p for p, n in rows.items() if n == "bad"} <= named
    assert table.num_rows == sum(n for p, n in rows.items() if p not in named)
    assert table.column_names == wanted
    table.validate(full=True)  # what it returns is usable (strings are UTF-8, offsets in range)
    if not bad:
        return
    with pytest.raises(TrajectoryFileError) as failure:
        read_trajectories(directory, wanted)
    assert_one_line(str(failure.value), str(failure.value.path))
    assert failure.value.path in named


SPILLS_THAT_BROKE_THE_READER = [  # (content, what the one line says)
    (
        parquet_bytes(GOOD.append_column("prompt_id", GOOD["prompt_id"])),
        "column 'prompt_id' appears more than once",
    ),  # schema.field() raised KeyError
    (
        GOOD_BYTES[:4] + b"\x00" + GOOD_BYTES[5:],
        "cannot read (Couldn't deserialize thrift: TProtocolException: Invalid data)",
    ),  # three lines
    (
        GOOD_PLAIN.replace(b"question of p0", b"\x80uestion of p0"),
        "Invalid UTF8 sequence at string index 0",
    ),  # read, and to_pylist() raised UnicodeDecodeError
]


@pytest.mark.parametrize("content, says", SPILLS_THAT_BROKE_THE_READER)
def test_what_broke_the_reader_fails_in_one_line(tmp_path, content, says):
    (tmp_path / "bad.parquet").write_bytes(content)
    with pytest.raises(TrajectoryFileError) as failure:
        read_trajectories(tmp_path, ["prompt_id", "question"])
    assert_one_line(str(failure.value), str(tmp_path / "bad.parquet"))
    assert says in str(failure.value)
