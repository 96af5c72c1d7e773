"""`python -m pipeline.assets.prepare search_r1`: FlashRAG's layout in (the fixtures hold rows as
the published files have them), Search-R1's parquet out, read back by `load_search_r1`."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.assets.datasets import load_search_r1
from pipeline.assets.prepare import main
from pipeline.assets.search_r1_data import TEST_SPLITS

FIXTURES = Path(__file__).parent / "fixtures" / "flashrag"

# Search-R1's scripts/data_process/qa_search_test_merge.py, make_prefix(template_type="base"),
# written out as it concatenates: the prompt the paper trains and evaluates with.
PUBLISHED_PREFIX = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every "
    "time you get new information. After reasoning, if you find you lack some knowledge, you can "
    "call a search engine by <search> query </search> and it will return the top searched results "
    "between <information> and </information>. You can search as many times as your want. If you "
    "find no further external knowledge needed, you can directly provide the answer inside <answer> "
    "and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. "
    "Question: {question}\n"
)


def run(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_prepares_the_published_schema_with_counts_and_a_manifest(tmp_path, capsys):
    out = tmp_path / "search_r1"
    code, printed, _ = run(["search_r1", "--source", str(FIXTURES), "--out", str(out)], capsys)
    assert code == 0
    # nq/train.jsonl repeats one question (case and "?" aside); hotpotqa/train.jsonl repeats one of
    # nq's: written all the same, and counted
    assert (
        "train.parquet  nq               nq/train.jsonl                    4        4        1"
        in printed
    )
    assert "hotpotqa/train.jsonl              3        3        1" in printed
    manifest = json.loads((out / "manifest.json").read_text())
    for entry in manifest["inputs"]:
        assert (
            entry["sha256"] == hashlib.sha256((FIXTURES / entry["path"]).read_bytes()).hexdigest()
        )
    test_counts = manifest["outputs"]["test.parquet"]["by_source"]
    assert list(test_counts) == list(TEST_SPLITS)  # the paper's column order
    assert (
        test_counts["hotpotqa"]["file"] == "hotpotqa/dev.jsonl"
    )  # no test split: dev, as Search-R1

    table = pq.read_table(out / "test.parquet")
    assert table.column_names[3:] == [
        "data_source",
        "prompt",
        "ability",
        "reward_model",
        "extra_info",
    ]
    row = table.slice(0, 1).to_pylist()[0]
    assert row["data_source"] == "nq"
    assert row["question"] == "who got the first nobel prize in physics?"
    assert row["prompt"] == [
        {"role": "user", "content": PUBLISHED_PREFIX.format(question=row["question"])}
    ]
    assert row["reward_model"] == {
        "style": "rule",
        "ground_truth": {"target": ["Wilhelm Conrad Röntgen"]},
    }
    assert row["extra_info"] == {"split": "test", "index": 0}

    test = load_search_r1(out / "test.parquet")
    assert len(test) == 14 and len({q.id for q in test}) == 14  # "test_0" in every benchmark
    train = load_search_r1(out / "train.parquet")
    assert [q.data_source for q in train] == ["nq"] * 4 + ["hotpotqa"] * 3


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('{"id": "x", "question": "q"}', "golden_answers"),
        ('{"id": "x", "question": "", "golden_answers": ["a"]}', "question"),
        ('{"question": "q", "golden_answers": ["a"]}', "id"),
        ('{"id": "x", "question": "q", "golden_answers": [1]}', "golden_answers"),
        ('{"id": "test_0", "question": "q", "golden_answers": ["a"]}', "id"),  # repeats line 1
    ],
)
def test_a_bad_row_is_one_line_naming_file_line_and_field_and_nothing_is_written(
    tmp_path, capsys, line, field
):
    source = tmp_path / "flashrag"
    shutil.copytree(FIXTURES, source)
    bad = source / "popqa" / "test.jsonl"
    bad.write_text(bad.read_text() + line + "\n")
    out = tmp_path / "out"
    code, _, err = run(["search_r1", "--source", str(source), "--out", str(out)], capsys)
    assert code == 2
    assert err.count("\n") == 1
    assert f"{bad}: line 3: field '{field}'" in err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["flashrag"]


def test_a_line_that_is_not_json_is_one_line_naming_it(tmp_path, capsys):
    source = tmp_path / "flashrag"
    shutil.copytree(FIXTURES, source)
    bad = source / "musique" / "dev.jsonl"
    bad.write_text(bad.read_text() + '{"id": "x", "question": \n')
    code, _, err = run(["search_r1", "--source", str(source), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and f"{bad}: line 3: invalid JSON" in err and err.count("\n") == 1


def test_a_missing_split_file_names_the_layout(tmp_path, capsys):
    source = tmp_path / "flashrag"
    shutil.copytree(FIXTURES, source)
    (source / "bamboogle" / "test.jsonl").unlink()
    code, _, err = run(["search_r1", "--source", str(source), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "bamboogle/test.jsonl: no such file" in err and "<dataset>/<split>" in err


def test_prepared_files_are_replaced_only_with_force(tmp_path, capsys):
    out = tmp_path / "out"
    args = ["search_r1", "--source", str(FIXTURES), "--out", str(out)]
    assert run(args, capsys)[0] == 0
    code, _, err = run(args, capsys)
    assert code == 2 and "--force" in err
    assert run([*args, "--force"], capsys)[0] == 0


def test_a_hub_source_is_refused_offline_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["search_r1", "--source", "RUC-NLPIR/FlashRAG_datasets", "--out", str(tmp_path / "o")]
    code, _, err = run(args, capsys)
    assert code == 2 and err.count("\n") == 1 and "offline" in err
    assert not (tmp_path / "o").exists()


def test_every_row_is_kept_as_search_r1_keeps_it(tmp_path, capsys):
    # A question shared by two benchmarks, and PopQA's templated question about two people of one
    # name: Search-R1's merge scripts keep every row, so each benchmark keeps the paper's n.
    source = tmp_path / "flashrag"
    shutil.copytree(FIXTURES, source)
    shared = '{"id": "test_2", "question": "who got the first nobel prize in physics", "golden_answers": ["Röntgen"]}'
    (source / "triviaqa" / "test.jsonl").write_text(
        (source / "triviaqa" / "test.jsonl").read_text() + shared + "\n"
    )
    popqa = source / "popqa" / "test.jsonl"
    twin = '{"id": "test_2", "question": "What is George Rankin\'s occupation?", "golden_answers": ["soldier"]}'
    popqa.write_text(popqa.read_text() + twin + "\n")
    out = tmp_path / "out"
    code, _, _ = run(["search_r1", "--source", str(source), "--out", str(out)], capsys)
    assert code == 0
    manifest = json.loads((out / "manifest.json").read_text())
    test_counts = manifest["outputs"]["test.parquet"]["by_source"]
    assert test_counts["triviaqa"]["repeated_questions"] == 1  # nq's, written again
    assert test_counts["popqa"]["repeated_questions"] == 1
    for name in ("train.parquet", "test.parquet"):
        by_source = manifest["outputs"][name]["by_source"]
        for source_name, counts in by_source.items():
            lines = (source / counts["file"]).read_text().splitlines()
            assert counts["read"] == counts["written"] == len(lines), (name, source_name)
        rows = load_search_r1(out / name)
        assert (
            len(rows)
            == manifest["outputs"][name]["rows"]
            == sum(c["written"] for c in by_source.values())
        )
        assert len({q.id for q in rows}) == len(rows)
        table = pq.read_table(out / name)
        assert table.column("id").to_pylist() == [q.id for q in rows]  # the ids as written
    test = pq.read_table(out / "test.parquet").to_pylist()
    assert [r["id"] for r in test if r["data_source"] == "popqa"] == [
        "popqa_test_0",
        "popqa_test_1",
        "popqa_test_2",
    ]
    assert [r["extra_info"]["index"] for r in test if r["data_source"] == "triviaqa"] == [0, 1, 2]
    train = pq.read_table(out / "train.parquet").column("data_source").to_pylist()
    assert train == ["nq"] * 4 + ["hotpotqa"] * 3
    # what departs from Search-R1's files is said in the manifest
    assert any("metadata" in d for d in manifest["departures"])
    assert any("<dataset>_<FlashRAG id>" in d for d in manifest["departures"])
