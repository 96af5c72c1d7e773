"""The mini-GAIA world: same seed same bytes, questions answerable only through their gold passages,
well-formed files in the formats the pipeline reads."""

import hashlib
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.assets.world import SEARCH_R1_SCHEMA, VERSION, build_world, main, write_world
from pipeline.assets.world_demos import strategy_weights
from retrieval.corpus import format_passages, read_corpus

FILES = [
    "corpus.jsonl",
    "demos.jsonl",
    "metadata.jsonl",
    "test.parquet",
    "train.parquet",
    "world.json",
]
TAGS = ("think", "search", "information", "python", "output", "answer")


@pytest.fixture(scope="module")
def world_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("world") / "small"
    write_world(build_world(7, "small"), out)
    return out


@pytest.fixture(scope="module")
def corpus(world_dir):
    return {p.id: p for p in read_corpus(world_dir / "corpus.jsonl")}


@pytest.fixture(scope="module")
def questions(world_dir):
    rows = []
    for split in ("train", "test"):
        rows += pq.read_table(world_dir / f"{split}.parquet").to_pylist()
    return rows


@pytest.fixture(scope="module")
def demos(world_dir):
    return [json.loads(line) for line in (world_dir / "demos.jsonl").open()]


def mentions(text, phrase):
    return re.search(rf"(?<!\w){re.escape(phrase)}(?!\w)", text) is not None


def years(text):
    return [int(y) for y in re.findall(r"(?<!\d)\d{4}(?!\d)", text)]


def test_same_seed_writes_the_same_bytes_and_another_seed_does_not(tmp_path):
    for name, seed in [("a", "3"), ("b", "3"), ("c", "4")]:
        assert main(["--out", str(tmp_path / name), "--seed", seed]) == 0
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == FILES
    for name in FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    for name in ["corpus.jsonl", "train.parquet", "demos.jsonl"]:
        assert (tmp_path / "a" / name).read_bytes() != (tmp_path / "c" / name).read_bytes(), name


def test_sizes_and_manifest(world_dir, corpus, questions, demos):
    manifest = json.loads((world_dir / "world.json").read_text())
    assert manifest["version"] == VERSION and manifest["seed"] == 7 and manifest["size"] == "small"
    counts = manifest["counts"]
    assert 400 <= len(corpus) == counts["passages"] <= 800
    assert 300 <= len(questions) == counts["questions"] <= 600
    assert counts["l1"] + counts["l2"] + counts["l3"] == len(questions)
    assert counts["demos"] == len(demos) >= 200
    assert sorted(corpus) == [p.id for p in read_corpus(world_dir / "corpus.jsonl")]


def test_parquet_has_search_r1_schema_and_prompt(world_dir):
    table = pq.read_table(world_dir / "train.parquet")
    assert table.schema.equals(SEARCH_R1_SCHEMA)
    row = table.slice(0, 1).to_pylist()[0]
    (message,) = row["prompt"]
    assert message["role"] == "user" and message["content"].rstrip().endswith(row["question"])
    for tag in ["<think>", "<search>", "<information>", "<python>", "<output>", "<answer>"]:
        assert tag in message["content"]
    assert row["ability"] == "fact-reasoning" and row["reward_model"]["style"] == "rule"
    assert row["reward_model"]["ground_truth"]["target"] == row["golden_answers"]
    assert row["extra_info"]["split"] == "train" and row["extra_info"]["index"] == 0


def test_gold_passages_hold_the_answers(corpus, questions):
    for q in questions:
        level, answer = q["extra_info"]["level"], q["golden_answers"][0]
        gold = [corpus[i] for i in q["extra_info"]["gold_doc_ids"]]
        assert len(gold) == len(q["extra_info"]["hop_queries"]) == (1 if level == 1 else 2)
        assert q["data_source"] == f"minigaia_l{level}"
        assert q["id"].startswith(f"minigaia-l{level}-")
        if level < 3:
            assert mentions(gold[-1].text, answer), q
        else:
            (a,), (b,) = years(gold[0].text), years(gold[1].text)
            assert answer == str(a - b) and a > b, q


def test_first_hop_names_the_bridge_of_the_second(corpus, questions):
    for q in questions:
        if q["extra_info"]["level"] == 1:
            continue
        first, second = (corpus[i] for i in q["extra_info"]["gold_doc_ids"])
        bridge = second.title
        assert mentions(first.text, bridge), q
        assert bridge in q["extra_info"]["hop_queries"][1]
        assert not mentions(q["question"], bridge)  # the bridge must be found, not read


def test_names_are_unique_and_questions_do_not_give_answers_away(corpus, questions):
    titles = [p.title for p in corpus.values()]
    assert len(set(titles)) == len(titles)
    ids = [q["id"] for q in questions]
    assert len(set(ids)) == len(ids)
    for q in questions:
        assert not any(mentions(q["question"], a) for a in q["golden_answers"]), q


def test_held_out_questions_are_about_entities_no_training_question_mentions():
    world = build_world(7, "small")
    train, test = world.split("train"), world.split("test")
    assert not {q.id for q in train} & {q.id for q in test}
    seen = {name for q in train for name in (q.subject, q.bridge) if name}
    assert test and not any(q.subject in seen for q in test)
    assert 0.15 < len(test) / (len(train) + len(test)) < 0.3
    for split in (train, test):  # shuffled: any first 30 questions mix the levels
        assert {q.level for q in split[:30]} == {1, 2, 3}


def test_held_out_names_are_new_combinations_of_words_seen_in_training():
    """A held-out subject's name is new, but (nearly) every word of it is in training questions:
    names are composed from pools, so copying one is copying tokens the policy has learnt."""
    world = build_world(7, "small")
    train, test = world.split("train"), world.split("test")
    seen = {w for q in train for w in re.findall(r"[A-Z]\w+", q.question)}
    words = [w for q in test for w in q.subject.split() if w not in ("The", "of")]
    assert sum(w in seen for w in words) > 0.9 * len(words)
    assert not {q.subject for q in test} & {q.subject for q in train}
    pools = world.name_parts
    assert pools and all(len(words) >= 4 for words in pools.values())
    everywhere = [w for words in pools.values() for w in words]
    assert len(everywhere) == len(set(everywhere))  # a word belongs to one pool only


def answer_counts(world) -> dict[str, Counter]:
    """How often each training answer occurs, per answer kind: the priors a guess can follow."""
    counts: dict[str, Counter] = {}
    for q in world.split("train"):
        counts.setdefault(q.answer_kind, Counter())[q.answer[0]] += 1
    return counts


def test_skewed_priors_make_a_guess_right_sometimes():
    """The most frequent training answer of a kind is right on a share of the held-out questions
    of that kind: about a fifth for countries, next to nothing for years."""
    by_kind = answer_counts(build_world(7, "small"))
    share = {k: c.most_common(1)[0][1] / sum(c.values()) for k, c in by_kind.items()}
    assert share["country"] > 0.15 and share["city"] > 0.08 and share["profession"] > 0.1
    assert share["year"] < 0.1 and share["number"] < 0.1


def guess_rate(world, level):
    """Expected accuracy on held-out questions of `level` of a guess drawn from the training
    answers' frequencies of the question's answer kind."""
    seen = answer_counts(world)
    rates = [
        seen[q.answer_kind][q.answer[0]] / sum(seen[q.answer_kind].values())
        for q in world.split("test")
        if q.level == level and q.answer_kind in seen
    ]
    return sum(rates) / len(rates)


def test_skew_steepens_the_priors_a_guess_follows():
    flat, steep = build_world(7, "small"), build_world(7, "small", skew=1.3)
    assert flat.skew == 0.6 and steep.skew == 1.3
    assert guess_rate(steep, 2) > 1.5 * guess_rate(flat, 2)
    assert flat.counts["passages"] == steep.counts["passages"]  # same entities, other attributes
    same = build_world(7, "small", skew=0.6)  # the default is skew 0.6, not another world
    assert same.passages == flat.passages and same.questions == flat.questions
    again = build_world(7, "small", skew=1.3)
    assert again.passages == steep.passages and again.questions == steep.questions


def test_skew_is_written_to_the_manifest_and_is_refused_out_of_range(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "w"), "--skew", "1.3"]) == 0
    assert json.loads((tmp_path / "w" / "world.json").read_text())["skew"] == 1.3
    assert main(["--out", str(tmp_path / "v"), "--skew", "9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "skew must lie in [0, 4] (got 9.0)" in err
    assert not (tmp_path / "v").exists()


def chain_demos(world):
    """(right, astray) two-search demos on multi-hop questions."""
    chains = [d for d in world.demos if d["level"] > 1 and d["strategy"].startswith("two_")]
    astray = sum(d["strategy"] == "two_searches_astray" for d in chains)
    return len(chains) - astray, astray


def test_the_trap_knob_changes_only_the_share_of_chain_demos_astray():
    default = build_world(7, "small")
    assert default.chains_astray is None
    right, astray = chain_demos(default)
    assert right > 0 and astray > 0
    trapped = build_world(7, "small", chains_astray=0.9)
    assert trapped.passages == default.passages and trapped.questions == default.questions
    right9, astray9 = chain_demos(trapped)
    assert astray9 / (right9 + astray9) > 0.75 > astray / (right + astray)
    assert chain_demos(build_world(7, "small", chains_astray=1.0))[0] == 0  # no right chain left
    assert chain_demos(build_world(7, "small", chains_astray=0.0))[1] == 0
    # With the knob set an astray chain searches twice (the second query repeats the subject)
    # and answers with the bridge: a hop short, always wrong, as the bandit's failed chain pays 0.
    astray_demos = [d for d in trapped.demos if d["strategy"] == "two_searches_astray"]
    for d in astray_demos:
        assert d["response"].count("<search>") == 2 and not d["correct"]
    bridges = {q.id: q.bridge for q in trapped.questions}
    assert all(
        d["response"].endswith(f"<answer> {bridges[d['id']]}</answer>") for d in astray_demos
    )
    default_astray = [d for d in default.demos if d["strategy"] == "two_searches_astray"]
    assert not any(  # without the knob they guess (from the training answers' frequencies)
        d["response"].endswith(f"<answer> {bridges[d['id']]}</answer>") for d in default_astray
    )


def test_the_trap_knob_is_written_to_the_manifest_and_refused_out_of_range(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "w"), "--chains-astray", "0.9"]) == 0
    assert json.loads((tmp_path / "w" / "world.json").read_text())["chains_astray"] == 0.9
    assert main(["--out", str(tmp_path / "v"), "--chains-astray", "1.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "must lie in [0, 1] (got 1.5)" in err
    assert not (tmp_path / "v").exists()


def _digest(out: Path) -> str:
    h = hashlib.sha256()
    for name in ("corpus.jsonl", "demos.jsonl", "metadata.jsonl", "world.json"):
        h.update((out / name).read_bytes())
    return h.hexdigest()


def test_the_start_knobs_unset_leave_the_worlds_byte_for_byte(tmp_path):
    # Digests of the text files written before data.world_chain_demos and
    # data.world_guess_sharpness existed (issue 59): unset, the knobs change nothing.
    write_world(build_world(0, "small"), tmp_path / "default")
    assert _digest(tmp_path / "default") == (
        "5079a9b33aa94798f92a62b37be7fe6ef2d2ec466b025289d7089d2202a33c7e"
    )
    write_world(build_world(3, "small", 1.3, 0.9), tmp_path / "trap")
    assert _digest(tmp_path / "trap") == (
        "b712693c79fb542192334a5068d3b5013860b835bbcf878f4480c4a1bd79aa30"
    )


def test_chain_demos_sets_the_share_of_multi_hop_demos_that_chain():
    default = build_world(7, "small")
    multi = [d for d in default.demos if d["level"] > 1]
    base = sum(d["strategy"].startswith("two_") for d in multi) / len(multi)
    assert 0.15 < base < 0.3  # as written: 0.2 of L2, 0.25 of L3
    half = build_world(7, "small", chain_demos=0.5)
    assert half.passages == default.passages and half.questions == default.questions
    multi = [d for d in half.demos if d["level"] > 1]
    assert 0.42 < sum(d["strategy"].startswith("two_") for d in multi) / len(multi) < 0.58
    assert not any(d["strategy"].startswith("two_") for d in half.demos if d["level"] == 1)
    assert all(not d["strategy"].startswith("two_") for d in build_world(7, chain_demos=0).demos)
    assert all(
        d["strategy"].startswith("two_")
        for d in build_world(7, "small", chains_astray=1.0, chain_demos=1).demos
        if d["level"] > 1
    )


def test_strategy_weights_keep_the_total_and_the_other_proportions():
    weights = strategy_weights(2, chains_astray=0.75, chain_demos=0.6)
    assert sum(weights.values()) == pytest.approx(100)
    assert weights["two_searches_astray"] == pytest.approx(45)  # 0.75 of the 60 that chain
    assert weights["two_searches"] == pytest.approx(15)
    assert weights["no_search"] / weights["one_search"] == pytest.approx(35 / 45)
    assert weights["no_search"] + weights["one_search"] == pytest.approx(40)
    assert strategy_weights(1, chain_demos=0.6) == strategy_weights(1)  # L1 has no chains


def _guess_pay(world) -> float:
    """Share of the L2 demos that answer without chaining and are right."""
    l2 = [d for d in world.demos if d["level"] == 2 and not d["strategy"].startswith("two_")]
    return sum(d["correct"] for d in l2) / len(l2)


def test_guess_sharpness_moves_guesses_towards_the_commonest_answer():
    flat = build_world(7, "small", 1.3, guess_sharpness=0.0)
    sharp = build_world(7, "small", 1.3, guess_sharpness=64.0)
    assert sharp.passages == flat.passages and sharp.questions == flat.questions
    assert _guess_pay(sharp) > _guess_pay(flat) + 0.1
    commonest = Counter(q.answer[0] for q in sharp.split("train") if q.answer_kind == "country")
    top = commonest.most_common(1)[0][0]
    train = {q.id: q for q in sharp.split("train")}
    guessed = [
        d["response"].rsplit("<answer> ", 1)[1].removesuffix("</answer>")
        for d in sharp.demos
        if d["strategy"] == "no_search" and train[d["id"]].answer_kind == "country"
    ]
    assert guessed and all(g == top for g in guessed)  # sharpness 64: always the commonest


def test_the_start_knobs_are_written_to_the_manifest_and_refused_out_of_range(tmp_path, capsys):
    argv = ["--out", str(tmp_path / "w"), "--chain-demos", "0.5", "--guess-sharpness", "2"]
    assert main(argv) == 0
    manifest = json.loads((tmp_path / "w" / "world.json").read_text())
    assert (manifest["chain_demos"], manifest["guess_sharpness"]) == (0.5, 2.0)
    for flag, value, says in (
        ("--chain-demos", "1.5", "chain must lie in [0, 1] (got 1.5)"),
        ("--guess-sharpness", "-1", "sharpness must lie in [0, 64] (got -1.0)"),
    ):
        assert main(["--out", str(tmp_path / "v"), flag, value]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err
        assert not (tmp_path / "v").exists()


def test_parquet_indexes_count_rows_within_the_split(world_dir):
    test = pq.read_table(world_dir / "test.parquet").to_pylist()
    assert [q["extra_info"]["index"] for q in test] == list(range(len(test)))


def test_gaia_metadata_matches_the_test_split(world_dir):
    lines = [json.loads(line) for line in (world_dir / "metadata.jsonl").open()]
    test = pq.read_table(world_dir / "test.parquet").to_pylist()
    assert [m["task_id"] for m in lines] == [q["id"] for q in test]
    for m, q in zip(lines, test, strict=True):
        assert set(m) == {"task_id", "Question", "Level", "Final answer", "file_name"}
        assert m["Question"] == q["question"] and m["Level"] == q["extra_info"]["level"]
        assert m["Final answer"] == q["golden_answers"][0] and m["file_name"] == ""


def check_tags(response):
    """Tags come in open/close pairs, never nested, and the response ends with one answer."""
    tokens = re.findall(rf"<(/?)({'|'.join(TAGS)})>", response)
    assert len(tokens) % 2 == 0
    for (slash_open, open_tag), (slash_close, close_tag) in zip(
        tokens[::2], tokens[1::2], strict=True
    ):
        assert (slash_open, slash_close, open_tag) == ("", "/", close_tag), response
    assert [t for _, t in tokens].count("answer") == 2 and response.endswith("</answer>")


def test_demos_are_well_formed_and_honest(corpus, questions, demos):
    by_title = {p.title: p for p in corpus.values()}
    by_id = {q["id"]: q for q in questions}
    assert {d["strategy"] for d in demos} == {
        "no_search",
        "one_search",
        "two_searches",
        "two_searches_python",
        "retry_search",
        "two_searches_astray",
    }
    assert 0.3 < sum(d["correct"] for d in demos) / len(demos) < 0.7
    chained = sum(d["response"].count("<search>") >= 2 for d in demos if d["level"] > 1)
    assert 0.1 < chained / sum(d["level"] > 1 for d in demos) < 0.35  # chaining is left to RL
    for d in demos:
        q = by_id[d["id"]]
        assert q["extra_info"]["split"] == "train" and d["answer"] == q["golden_answers"][0]
        check_tags(d["response"])
        final = re.search(r"<answer>(.*)</answer>$", d["response"]).group(1).strip()
        assert d["correct"] == (final == d["answer"])
        blocks = re.findall(r"<information>\n(.*?)</information>\n", d["response"], re.S)
        assert len(blocks) == d["response"].count("<search>")
        for block in blocks:
            shown = [by_title[t] for t in re.findall(r"^Doc \d\(Title: (.*?)\) ", block, re.M)]
            assert len(shown) == 3 and block == format_passages(shown)
        if d["strategy"] not in ("retry_search", "two_searches_astray"):  # astray on purpose
            gold = [corpus[i] for i in q["extra_info"]["gold_doc_ids"]]
            for block, passage in zip(blocks, gold, strict=False):
                assert f"(Title: {passage.title}) {passage.text}\n" in block
        for a, b, out in re.findall(
            r"<python>print\((\d+) - (\d+)\)</python><output>(.*?)\n", d["response"]
        ):
            assert int(a) - int(b) == int(out)
    wrong = Counter(d["strategy"] for d in demos if not d["correct"])
    assert wrong["no_search"] and wrong["one_search"] and wrong["two_searches"]  # L3 slips


def test_refuses_a_non_empty_out_without_force(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("keep me")
    assert main(["--out", str(tmp_path), "--seed", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("strata world: error: ") and err.count("\n") == 1 and "--force" in err
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    # --force replaces an earlier world, never a directory that holds something else
    assert main(["--out", str(tmp_path), "--seed", "1", "--force"]) == 2
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_force_replaces_an_earlier_world_and_leaves_nothing_behind(tmp_path):
    out = tmp_path / "world"
    assert main(["--out", str(out), "--seed", "1"]) == 0
    before = (out / "corpus.jsonl").read_bytes()
    assert main(["--out", str(out), "--seed", "2", "--force"]) == 0
    assert (out / "corpus.jsonl").read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["world"]
    assert json.loads((out / "world.json").read_text())["seed"] == 2


@pytest.mark.parametrize(
    "args, says",
    [
        (["--size", "huge"], "unknown world size 'huge'"),
        (["--seed", "-1"], "seed must be >= 0"),
        (["--seed", "x"], "invalid int value"),
        (["--out", "{file}/sub"], "cannot write"),
    ],
)
def test_user_errors_are_one_line(tmp_path, capsys, args, says):
    (tmp_path / "file").write_text("")
    args = [a.format(file=tmp_path / "file") for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "w")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("strata world: error: ") and err.count("\n") == 1 and says in err
    assert not (tmp_path / "w").exists()


def test_the_module_runs_as_a_command(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.assets.world",
            "--out",
            str(tmp_path / "w"),
            "--size",
            "big",
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_train_questions_read_back_through_arrow(world_dir):
    table = pq.read_table(world_dir / "train.parquet", columns=["extra_info"])
    levels = table.column("extra_info").combine_chunks().field("level")
    assert set(levels.to_pylist()) == {1, 2, 3}
    assert pa.types.is_int64(levels.type)
