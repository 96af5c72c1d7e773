"""Question loaders: the bundled world, hand-made Search-R1 and GAIA files, and every bad case
failing with one line that names the file, the row or line, and the field."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.assets.datasets import (
    DatasetError,
    Question,
    load_gaia,
    load_questions,
    load_search_r1,
    load_world,
)
from pipeline.assets.world import build_world, write_world


@pytest.fixture(scope="module")
def world_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("world") / "small"
    write_world(build_world(11, "small"), out)
    return out


def search_r1_row(i, target=("Paris",), **overrides):
    row = {
        "id": f"q{i}",
        "question": f"What is the capital of country {i}?",
        "golden_answers": ["Paris"],
        "data_source": "nq",
        "prompt": [{"role": "user", "content": f"Answer. Question: capital {i}?"}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": target}},
        "extra_info": {"split": "train", "index": i},
    }
    row.update(overrides)
    return row


def write_parquet(path, rows, schema=None):
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def gaia_row(i, level=1, answer="42", **overrides):
    row = {"task_id": f"t{i}", "Question": f"How many {i}?", "Level": level, "Final answer": answer}
    row.update(overrides, file_name="")
    return row


def test_world_round_trips(world_dir):
    train, test = load_world(world_dir)
    tables = [pq.read_table(world_dir / f"{s}.parquet").to_pylist() for s in ("train", "test")]
    for questions, rows in zip((train, test), tables, strict=True):
        assert [q.id for q in questions] == [r["id"] for r in rows]
        for q, r in zip(questions, rows, strict=True):
            assert q.ground_truth == tuple(r["golden_answers"]) and q.question == r["question"]
            assert q.level == r["extra_info"]["level"] and q.data_source == f"minigaia_l{q.level}"
            assert q.prompt == tuple(r["prompt"]) and q.prompt[0]["role"] == "user"
            assert q.extra["gold_doc_ids"] == r["extra_info"]["gold_doc_ids"]
            assert "level" not in q.extra and q.extra["ability"] == "fact-reasoning"
    assert {q.level for q in train} == {q.level for q in test} == {1, 2, 3}
    assert load_questions(world_dir / "test.parquet") == test


def test_world_gaia_metadata_matches_its_test_split(world_dir):
    _, test = load_world(world_dir)
    gaia = load_questions(world_dir / "metadata.jsonl")
    assert [(q.id, q.ground_truth[0], q.level) for q in gaia] == [
        (q.id, q.ground_truth[0], q.level) for q in test
    ]
    assert gaia[0].data_source == f"gaia_l{gaia[0].level}" and gaia[0].prompt == ()


def test_incomplete_world_says_how_to_build_it(tmp_path):
    (tmp_path / "train.parquet").write_bytes(b"")
    with pytest.raises(
        DatasetError, match=r"not a complete world: .* python -m pipeline\.assets\.world"
    ):
        load_world(tmp_path)


def test_search_r1_target_as_list_and_as_plain_string(tmp_path):
    as_list = load_search_r1(
        write_parquet(tmp_path / "l.parquet", [search_r1_row(0, ["Paris", "paris"])])
    )
    assert as_list == [
        Question(
            id="q0",
            question="What is the capital of country 0?",
            ground_truth=("Paris", "paris"),
            data_source="nq",
            level=None,
            prompt=({"role": "user", "content": "Answer. Question: capital 0?"},),
            extra={"split": "train", "index": 0, "ability": "fact-reasoning"},
        )
    ]
    as_string = load_search_r1(write_parquet(tmp_path / "s.parquet", [search_r1_row(0, "Paris")]))
    assert as_string[0].ground_truth == ("Paris",)


def test_search_r1_fallbacks(tmp_path):
    rows = [search_r1_row(i, golden_answers=[f"a{i}"]) for i in range(2)]
    for row in rows:
        del row["reward_model"], row["question"], row["id"]
    (q0, q1) = load_search_r1(write_parquet(tmp_path / "f.parquet", rows))
    assert q0.ground_truth == ("a0",) and q1.ground_truth == ("a1",)
    assert q0.question == "Answer. Question: capital 0?"  # the last user message
    assert (q0.id, q1.id) == ("0", "1")  # extra_info.index
    for row in rows:
        del row["extra_info"]
    ids = [q.id for q in load_search_r1(write_parquet(tmp_path / "nq_train.parquet", rows))]
    assert ids == ["nq_train-0", "nq_train-1"]


def test_ids_repeating_across_data_sources_are_read_with_the_source_in_front(tmp_path):
    """Search-R1's published files keep FlashRAG's ids, which restart in every dataset: read
    as `prepare search_r1` writes them, `<data_source>_<id>`, so nothing merges two prompts."""
    rows = [
        search_r1_row(i, id=f"train_{i}", data_source=source)
        for source in ("nq", "hotpotqa")
        for i in range(2)
    ]
    ids = [q.id for q in load_search_r1(write_parquet(tmp_path / "train.parquet", rows))]
    assert ids == ["nq_train_0", "nq_train_1", "hotpotqa_train_0", "hotpotqa_train_1"]
    for row in rows:  # ids from extra_info.index restart the same way
        del row["id"]
    ids = [q.id for q in load_search_r1(write_parquet(tmp_path / "index.parquet", rows))]
    assert ids == ["nq_0", "nq_1", "hotpotqa_0", "hotpotqa_1"]
    unique = [search_r1_row(0, data_source="nq"), search_r1_row(1, data_source="hotpotqa")]
    ids = [q.id for q in load_search_r1(write_parquet(tmp_path / "unique.parquet", unique))]
    assert ids == ["q0", "q1"]  # a file whose ids are unique keeps them as written


def test_a_repeat_within_one_source_or_made_by_the_prefix_is_refused(tmp_path):
    rows = [
        search_r1_row(0, data_source="nq"),
        search_r1_row(1, id="q0", data_source="hotpotqa"),
        search_r1_row(2, id="q0", data_source="hotpotqa"),
    ]
    path = write_parquet(tmp_path / "d.parquet", rows)
    with pytest.raises(
        DatasetError,
        match=r"rows 1 and 2: field 'id' value 'q0' is duplicated within data_source 'hotpotqa'$",
    ):
        load_search_r1(path)
    rows = [  # nq + "_x_q0" and nq_x + "_q0" are one id once qualified
        search_r1_row(0, id="x_q0", data_source="nq"),
        search_r1_row(1, id="x_q0", data_source="hotpotqa"),
        search_r1_row(2, id="q0", data_source="nq_x"),
    ]
    path = write_parquet(tmp_path / "e.parquet", rows)
    with pytest.raises(
        DatasetError, match=r"rows 0 and 2: field 'id' value 'nq_x_q0' is duplicated$"
    ):
        load_search_r1(path)


def test_gaia_level_as_int_and_as_string(tmp_path):
    path = write_jsonl(tmp_path / "metadata.jsonl", [gaia_row(0, 1), "", gaia_row(1, "3")])
    q0, q1 = load_gaia(path)
    assert load_questions(path) == [q0, q1]
    assert (q0.level, q0.data_source, q0.ground_truth) == (1, "gaia_l1", ("42",))
    assert (q1.level, q1.data_source, q1.id) == (3, "gaia_l3", "t1")
    assert q1.extra == {"file_name": ""}


def bad_missing_column(tmp_path):
    rows = [search_r1_row(i) for i in range(3)]
    for row in rows:
        del row["data_source"]
    return write_parquet(tmp_path / "d.parquet", rows), "all 3 rows", "data_source"


def bad_null_ground_truth(tmp_path):
    rows = [search_r1_row(0), search_r1_row(1, target=None)]
    return write_parquet(tmp_path / "d.parquet", rows), "row 1", "reward_model.ground_truth.target"


def bad_empty_ground_truth(tmp_path):
    rows = [search_r1_row(0), search_r1_row(1), search_r1_row(2, target=[""])]
    return write_parquet(tmp_path / "d.parquet", rows), "row 2", "reward_model.ground_truth.target"


def bad_question_type(tmp_path):
    return (
        write_parquet(tmp_path / "d.parquet", [search_r1_row(0, question=7)]),
        "row 0",
        "question",
    )


def bad_duplicate_id(tmp_path):
    rows = [search_r1_row(0), search_r1_row(1), search_r1_row(2, id="q0")]
    return write_parquet(tmp_path / "d.parquet", rows), "rows 0 and 2", "id"


def bad_json_line(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [gaia_row(0), '{"task_id": "t1", ', gaia_row(2)])
    return path, "line 2", "invalid JSON"


def bad_missing_final_answer(tmp_path):
    rows = [gaia_row(0), "", gaia_row(1, answer="")]
    return write_jsonl(tmp_path / "m.jsonl", rows), "line 3", "Final answer"


def bad_gaia_level(tmp_path):
    return write_jsonl(tmp_path / "m.jsonl", [gaia_row(0, level="hard")]), "line 1", "Level"


def bad_gaia_duplicate(tmp_path):
    rows = [gaia_row(0), "", gaia_row(1), gaia_row(0)]
    return write_jsonl(tmp_path / "m.jsonl", rows), "lines 1 and 4", "task_id"


def bad_not_parquet(tmp_path):
    path = tmp_path / "d.parquet"
    path.write_text("id,question\n1,hello\n")
    return path, "not a readable Parquet file", ""


def bad_unknown_suffix(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("id,question\n")
    return path, "unknown question file type '.csv'", ""


def bad_missing_file(tmp_path):
    return tmp_path / "absent.jsonl", "no such file", ""


@pytest.mark.parametrize(
    "make",
    [
        bad_missing_column,
        bad_null_ground_truth,
        bad_empty_ground_truth,
        bad_question_type,
        bad_duplicate_id,
        bad_json_line,
        bad_missing_final_answer,
        bad_gaia_level,
        bad_gaia_duplicate,
        bad_not_parquet,
        bad_unknown_suffix,
        bad_missing_file,
    ],
)
def test_bad_files_fail_with_one_line_naming_file_place_and_field(tmp_path, make):
    path, place, name = make(tmp_path)
    with pytest.raises(DatasetError) as caught:
        load_questions(path)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    assert place in message
    if name and name != "invalid JSON":
        assert f"field '{name}'" in message
    assert name in message


def test_prompts_longer_than_max_prompt_tokens_are_skipped_and_counted(tmp_path):
    from transformers import AutoTokenizer

    from actors.formats import prompt_ids
    from pipeline.assets.datasets import Question, drop_long_prompts
    from pipeline.assets.tiny_policy import build_tiny_policy

    policy = build_tiny_policy(
        tmp_path / "tiny", [f"Where was person {i} born?" for i in range(300)], vocab_size=300
    )
    tokenizer = AutoTokenizer.from_pretrained(policy)
    short = Question("s", "Where was Ann born?", ("x",), "q")
    long = Question("l", "Where was Ann born? " * 40, ("x",), "q")
    limit = len(prompt_ids(tokenizer, ["search"], short.question))
    kept, skipped = drop_long_prompts([short, long, short], tokenizer, ["search"], limit)
    assert [q.id for q in kept] == ["s", "s"] and skipped == 1
    # the python instruction is longer: the same limit now skips the short one too
    assert drop_long_prompts([short], tokenizer, ["search", "python"], limit) == ([], 1)


def test_the_run_trains_on_data_train_files(tmp_path):
    """data.type search_r1 / gaia: the questions come from data.train_files, in order."""
    from transformers import AutoTokenizer

    from pipeline.assets.tiny_policy import build_tiny_policy
    from pipeline.assets.world import main as world_main
    from pipeline.backends.runtime import RuntimeUnavailable
    from pipeline.config.loader import load_config
    from pipeline.runtime.stream import question_stream

    assert world_main(["--out", str(tmp_path / "world"), "--seed", "1"]) == 0
    tokenizer = AutoTokenizer.from_pretrained(
        build_tiny_policy(tmp_path / "tiny", ["Where was it?"] * 50, vocab_size=300)
    )
    files = [str(tmp_path / "world" / "test.parquet"), str(tmp_path / "world" / "metadata.jsonl")]
    config = load_config(
        "configs/local.yaml",
        [
            "data.type=search_r1",
            f"data.train_files=[{files[0]},{files[1]}]",
            "data.shuffle=false",
            "data.max_prompt_tokens=4096",
        ],
    )
    tasks, skipped = question_stream(config, None, tokenizer)
    expected = load_questions(files[0]) + load_questions(files[1])
    first = [next(tasks) for _ in range(len(expected[:32]))]
    assert skipped == 0 and [q.id for q in first] == [q.id for q in expected[:32]]
    (tmp_path / "bad.jsonl").write_text('{"task_id": "a", "Question": "Q?"}\n')
    bad = load_config(
        "configs/local.yaml", ["data.type=gaia", f"data.train_files=[{tmp_path / 'bad.jsonl'}]"]
    )
    with pytest.raises(RuntimeUnavailable, match=r"data.train_files: .*bad\.jsonl"):
        question_stream(bad, None, tokenizer)
