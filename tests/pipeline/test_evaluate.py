"""Held-out evaluation on the mini-GAIA world with the warm-started tiny policy: periodically
inside a launched run, then standalone on that run's checkpoint, as a user types it."""

import asyncio
import json
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from actors.engine import EngineError, NoServerBack
from actors.rewards import score
from actors.session_agent import AgentFailed
from buffers.records import Trajectory, from_arrow, to_arrow
from pipeline.assets.datasets import load_questions
from pipeline.config.schema import StrataConfig
from pipeline.evaluation.heldout import (
    EVAL_ATTEMPTS,
    Item,
    Row,
    eval_settings,
    generated_text,
    main,
    run_items,
)
from pipeline.runtime.metrics import RunMetrics
from tests.conftest import assert_accounting, child_env
from tests.pipeline.test_local_run import ROOT, SHORT, launch

EVAL = [
    "--set",
    "eval.every_steps=2",
    "--set",
    "eval.max_questions=12",
    "--set",
    "eval.train_questions=6",
    "--set",
    "metrics.plots=true",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, run_cache):
    """A 4-step run evaluating every 2 steps: (run_dir, world_dir, stdout)."""
    run_dir = tmp_path_factory.mktemp("eval") / "run"
    proc = launch(
        run_dir, run_cache, "--set", "learner.max_steps=4", "--set", "buffer.max_staleness=1", *EVAL
    )
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:] + out[-2000:]
    assert_accounting(run_dir)
    (world,) = run_cache.glob("world-*")
    return run_dir, world, out


def test_a_run_evaluates_every_few_steps_and_reports_it(trained):
    run_dir, world, out = trained
    records = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]  # the starting policy first; the last is waited for
    # Step 2 is skipped, and says so, when step 0's evaluation outlasts two learner steps (a
    # loaded machine): only the newest due step waits for a running evaluation.
    skipped = "strata: eval at step 2 skipped for step 4" in out
    assert steps == ([0, 4] if skipped else [0, 2, 4]), (steps, out[-2000:])
    sources = list(
        dict.fromkeys(q.data_source for q in load_questions(world / "test.parquet")[:12])
    )
    for record in records:
        # the embedded engine evaluates a snapshot: every trajectory comes from that version
        assert record["served_versions"] == [record["version"]] * 2, record["served_versions"]
        rows = [Row(**r) for r in record["rows"]]
        # held-out with tools, the no-tools baseline, then the training questions (with tools)
        assert [r.name for r in rows if r.tools] == [*sources, "all", "training questions"]
        assert [r.name for r in rows if not r.tools] == [*sources, "all"]
        assert all(r.questions == 12 for r in rows if r.name == "all")
        assert [r.questions for r in rows if r.name == "training questions"] == [6]
    for suffix in (".json", ".md", ".trajectories.parquet"):
        assert (run_dir / "eval" / f"step-000004{suffix}").is_file()
    made = pq.read_table(
        run_dir / "eval" / "step-000004.trajectories.parquet", columns=["actor_id", "prompt_id"]
    )
    train_ids = {f"{q.id}@train.parquet" for q in load_questions(world / "train.parquet")[:6]}
    by_actor = {}
    for actor, prompt in zip(
        made["actor_id"].to_pylist(), made["prompt_id"].to_pylist(), strict=True
    ):
        by_actor.setdefault(actor, set()).add(prompt)
    assert by_actor["eval-train"] == train_ids and not by_actor["eval"] & train_ids
    assert "strata: eval at step 4: accuracy" in out and ", training questions " in out
    report = (run_dir / "report.md").read_text()
    assert "## Held-out evaluation (step 4" in report and (run_dir / "eval.png").is_file()
    assert "| accuracy on training questions (6 q, step 0 -> 4) |" in report


def test_eval_accuracy_is_exported_per_source():
    from prometheus_client import generate_latest

    metrics = RunMetrics()
    metrics.observe_eval(
        6,
        [
            Row("level 1", True, 4, 1, 0.5, None, 1.0, 20.0, 0.0),
            Row("level 1", False, 4, 1, 0.25, None, 0.0, 9.0, 0.0),
        ],
    )
    text = generate_latest(metrics.registry).decode()
    assert 'strata_eval_accuracy{source="level 1",tools="yes"} 0.5' in text
    assert 'strata_eval_accuracy{source="level 1",tools="no"} 0.25' in text
    assert "strata_eval_step 6.0" in text


def test_standalone_evaluation_of_a_run_by_source_and_level(trained, run_cache, tmp_path):
    run_dir, world, _ = trained
    out = tmp_path / "results" / "eval.json"
    argv = [
        sys.executable,
        "-m",
        "pipeline.evaluate",
        str(run_dir),
        "--config",
        "configs/local.yaml",
        "--set",
        f"runtime.cache_dir={run_cache}",
        *SHORT,
        "--data",
        str(world / "test.parquet"),
        str(world / "metadata.jsonl"),
        "--max-questions",
        "12",
        "--samples",
        "3",
        "--out",
        str(out),
    ]
    done = subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, timeout=900, env=child_env()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["checkpoint"].endswith("checkpoints/step-000004/hf") and result["samples"] == 3
    rows = [Row(**r) for r in result["rows"]]

    parquet = load_questions(world / "test.parquet")[:12]
    gaia = load_questions(world / "metadata.jsonl")[:12]
    names = [
        *dict.fromkeys(q.data_source for q in parquet),
        *dict.fromkeys(f"level {q.level}" for q in gaia),
        "all",
    ]
    assert [r.name for r in rows if r.tools] == names
    assert [r.name for r in rows if not r.tools] == names

    # every accuracy agrees with the rewards recomputed from the written trajectories
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(result["checkpoint"])
    trajectories = from_arrow(pq.read_table(out.with_name("eval.trajectories.parquet")))
    assert len(trajectories) == 2 * (12 + 12) * 3
    row_of = {f"{q.id}@test.parquet": q.data_source for q in parquet}
    row_of |= {f"{q.id}@metadata.jsonl": f"level {q.level}" for q in gaia}
    for row in rows:
        actor = "eval" if row.tools else "eval-no-tools"
        members = [
            t
            for t in trajectories
            if t.actor_id == actor and row.name in (row_of[t.prompt_id], "all")
        ]
        rewards = [
            score(generated_text(t, tokenizer), list(t.ground_truth), t.data_source, "exact_match")
            for t in members
        ]
        assert row.accuracy == pytest.approx(np.mean(rewards), abs=1e-9), row
        assert row.questions == len(members) // 3 and row.pass_at_k >= row.accuracy
        if not row.tools:
            assert row.tool_calls == 0 and all(not t.tool_names for t in members)
    overall = {r.tools: r for r in rows if r.name == "all"}
    assert overall[True].tool_calls > 0  # the policy does search when it may
    table = out.with_suffix(".md").read_text()
    assert table.startswith("| data | tools | questions | accuracy (mean@3) | pass@3 |")
    assert "| level 1 | none |" in table and "| level 1 | none |" in done.stdout


def bad_gaia(tmp_path):
    path = tmp_path / "metadata.jsonl"
    rows = [
        {"task_id": "a", "Question": "Q?", "Level": 1, "Final answer": "x"},
        {"task_id": "b", "Question": "Q?", "Level": 2},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def bad_parquet(tmp_path):
    import pyarrow as pa

    path = tmp_path / "test.parquet"
    pq.write_table(
        pa.table(
            {
                "id": ["a", "b"],
                "question": ["Q?", "Q?"],
                "data_source": ["nq", "nq"],
                "golden_answers": [["x"], []],
            }
        ),
        path,
    )
    return path


def broken_checkpoint(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    return folder


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("not_a_model", "is not an HF model directory"),
        ("broken_weights", "model.safetensors is unreadable"),
        ("csv", "unknown question file type '.csv'"),
        ("gaia_without_answer", "metadata.jsonl: line 2: field 'Final answer' is missing"),
        ("parquet_without_answer", "test.parquet: row 1: field 'golden_answers' is empty"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(case, expected, trained, tmp_path, capsys):
    run_dir, _, _ = trained
    checkpoint, data = run_dir, []
    if case == "not_a_model":
        checkpoint = tmp_path
    elif case == "broken_weights":
        checkpoint = broken_checkpoint(tmp_path)
    elif case == "csv":
        (tmp_path / "q.csv").write_text("id,question\n")
        data = [str(tmp_path / "q.csv")]
    elif case == "gaia_without_answer":
        data = [str(bad_gaia(tmp_path))]
    else:
        data = [str(bad_parquet(tmp_path))]
    out = tmp_path / "out" / "eval.json"
    argv = [str(checkpoint), "--config", str(ROOT / "configs" / "local.yaml"), "--out", str(out)]
    code = main(argv + (["--data", *data] if data else []))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and expected in err, err
    assert not (tmp_path / "out").exists()


def test_held_out_accuracy_is_the_outcome_reward_only():
    """A format bonus or a latent reward shapes training; accuracy is the answer's score alone
    (with actors.latent_reward 0.2 a wrong answer had counted 0.2 at every evaluation)."""
    config = StrataConfig.model_validate(
        {"actors": {"latent_reward": 0.2, "format_weight": 0.1, "temperature": 0.7}}
    )
    one, many = eval_settings(config, 1), eval_settings(config, 4)
    assert (one.latent_reward, one.format_weight, one.temperature) == (0.0, 0.0, 0.0)
    assert (many.latent_reward, many.temperature) == (0.0, 0.7)


class FlakyLoop:
    """An agent loop whose engine fails the first `failures` trajectories (a server killed
    mid-request), then answers: stands in for the agent pipeline.evaluation.heldout.run_items runs."""

    failures = 0

    def __init__(self, *args, **kwargs) -> None:
        pass

    async def run(self, question, key: str, sample: int):
        if FlakyLoop.failures > 0:
            FlakyLoop.failures -= 1
            raise EngineError("cannot reach http://127.0.0.1:1/generate: Server disconnected")
        return (key, sample)


@pytest.mark.parametrize("failures", [0, 2, EVAL_ATTEMPTS])
def test_an_evaluation_runs_again_what_a_dead_server_cut_off(failures, capsys):
    """A server killed while it answered an evaluation (the step-0 evaluation of
    test_ray_run.py's vLLM run, seen failing that way) costs those trajectories another try,
    not the evaluation; a trajectory that fails EVAL_ATTEMPTS times fails it, as before."""
    FlakyLoop.failures = failures
    items = [Item(None, "held-out", f"q{i}") for i in range(3)]  # type: ignore[arg-type]

    def run():
        return asyncio.run(run_items(FlakyLoop(), items, 2, 1, "eval"))

    if failures == EVAL_ATTEMPTS:  # with one slot, all of them hit the first trajectory
        with pytest.raises(EngineError, match="Server disconnected"):
            run()
        return
    assert run() == [(f"q{i}", k) for i in range(3) for k in range(2)]  # all, in input order
    out = capsys.readouterr().out
    assert (f"eval: {failures} trajectories cut off by the engine were run again" in out) == bool(
        failures
    )


class LosingAgent:
    """An agent of one's own that loses the trajectory of question q1 (it raised)."""

    async def run(self, question, key: str, sample: int):
        if key == "q1":
            raise AgentFailed(
                "raised", "the agent raised ModelBehaviorError: Tool python not found"
            )
        return Trajectory(key, sample, [5], [1], [-0.1], [0], reward=1.0)


def test_an_agent_that_loses_a_trajectory_costs_that_answer_not_the_evaluation(capsys):
    """A custom or openai agent's lost trajectory is a wrong answer (0, counted, said); the
    example agent's 60-step run saw every held-out evaluation fail on the first such one."""
    items = [Item(None, "held-out", f"q{i}") for i in range(3)]  # type: ignore[arg-type]
    made = asyncio.run(run_items(LosingAgent(), items, 1, 2, "eval"))
    assert [(t.prompt_id, t.reward, t.finish_reason) for t in made] == [
        ("q0", 1.0, "stop"),
        ("q1", 0.0, "agent_failed"),
        ("q2", 1.0, "stop"),
    ]
    assert "eval: 1 trajectories the agent lost scored 0 (first: the agent raised" in (
        capsys.readouterr().out
    )
    assert to_arrow(made).num_rows == 3  # the outputs' Parquet takes it


def test_an_evaluation_does_not_wait_again_for_servers_that_never_came_back():
    """NoServerBack: the engine already waited its whole timeout for a live server; a second
    try would wait as long again, so the evaluation fails at once."""
    calls = []

    class NoServers(FlakyLoop):
        async def run(self, question, key: str, sample: int):
            calls.append(key)
            raise NoServerBack("every vllm server is down and none was back within 600 s")

    items = [Item(None, "held-out", "q0")]  # type: ignore[arg-type]
    with pytest.raises(NoServerBack):
        asyncio.run(run_items(NoServers(), items, 1, 1, "eval"))
    assert calls == ["q0"]
