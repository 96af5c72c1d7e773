"""`python -m pipeline.experiment`: validation before any run, the run list, resuming, failures;
and `python -m pipeline.experiment_report` on run directories written here. The launch
subprocess is a fake (`run=`) except in the one end-to-end test at the end."""

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from pipeline.config.loader import write_resolved_config
from pipeline.config.overrides import OverrideError, parse_override, parse_value
from pipeline.experiments import run as experiment
from pipeline.experiments.data import level_accuracy, moving_average
from pipeline.experiments.plan import override_text, plan, read_experiment
from pipeline.experiments.report import main as report_main
from tests.conftest import assert_accounting, child_env
from tests.pipeline.test_local_run import SHORT

ROOT = Path(__file__).resolve().parents[2]
LOCAL = str(ROOT / "configs" / "local.yaml")
ABLATION = {
    "grpo": {"learner.advantage.alpha": 0.0},
    "san": {"learner.advantage.alpha": 1.0},
    "blend": {"learner.advantage.alpha": 0.6},
    "random_k2": {"learner.stratifier.type": "random", "learner.stratifier.k": 2},
    "random_k3": {"learner.stratifier.type": "random", "learner.stratifier.k": 3},
}


def write_experiment(tmp_path, **fields) -> Path:
    """An experiment file in tmp_path: two variants, one seed, 3 steps, unless `fields` say otherwise."""
    body = {
        "base": LOCAL,
        "out": str(tmp_path / "out"),
        "seeds": [0],
        "set": {"learner.max_steps": 3},
        "variants": {
            "grpo": {"learner.advantage.alpha": 0.0},
            "san": {"learner.advantage.alpha": 1.0},
        },
    } | fields
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


class FakeLaunch:
    """Records each launch command line; `rc` maps run names to exit statuses (default 0)."""

    def __init__(self, rc=None, check=None):
        self.calls, self.rc, self.check = [], rc or {}, check

    def __call__(self, argv, log, cwd):
        name = Path(argv[argv.index("--run-dir") + 1]).name
        if self.check is not None:
            self.check(name, argv)
        self.calls.append((name, argv))
        return self.rc.get(name, 0)


def records(tmp_path) -> dict[str, dict]:
    body = json.loads((tmp_path / "out" / "experiment.json").read_text())
    return {r["name"]: r for r in body["runs"]}


# ------------------------------------------------------------------------------ validation


def test_an_unknown_key_is_one_line_and_exit_2(tmp_path, capsys):
    path = write_experiment(tmp_path, runer="ray")
    fake = FakeLaunch()
    assert experiment.main([str(path)], run=fake) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown key 'runer'" in err and str(path) in err
    assert fake.calls == []


def test_a_bad_override_in_the_last_variant_fails_before_any_run(tmp_path, capsys):
    variants = {**ABLATION, "random_k3": {"learner.stratifier.kk": 3}}
    path = write_experiment(tmp_path, variants=variants, seeds=[0, 1, 2])
    fake = FakeLaunch()
    assert experiment.main([str(path)], run=fake) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "variants.random_k3 (random_k3-seed0)" in err and "learner.stratifier.kk" in err
    assert (
        "did you mean 'learner.stratifier.k'? it is a key of learner.stratifier.type random" in err
    )
    assert fake.calls == [] and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seeds": [1, 1]}, "must be distinct"),
        ({"variants": {"a/b": {}}}, "names a directory"),
        ({"variants": {"grpo": {"runtime.seed": 4}}}, "the experiment's `seeds` set it"),
        ({"set": {"learner.max_steps": 0}}, "set: "),
        ({"base": "configs/nope.yaml"}, "base configs/nope.yaml: no such file"),
    ],
)
def test_other_mistakes_are_one_line(tmp_path, capsys, change, message):
    path = write_experiment(tmp_path, **change)
    assert experiment.main([str(path)], run=FakeLaunch()) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_dry_run_lists_the_fifteen_runs_of_the_ablation(tmp_path, monkeypatch, capsys):
    # The file's paths are relative to the working directory: one with the repository's configs
    # and none of its runs (a finished ablation there, run with other settings, would be refused).
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "runs" / "experiments" / "ablation"
    assert (
        experiment.main(["configs/experiments/ablation.yaml", "--dry-run"], run=FakeLaunch()) == 0
    )
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert len(lines) == 15 and {line[0] for line in lines} == {
        f"{v}-seed{s}" for v in ABLATION for s in range(3)
    }
    grpo0 = next(line for line in lines if line[0] == "grpo-seed0")
    assert grpo0[2:] == [
        "--set",
        "learner.max_steps=200",
        "--set",
        "eval.every_steps=100",
        "--set",
        "learner.advantage.alpha=0.0",
        "--set",
        "runtime.seed=0",
    ]
    assert not out.exists()  # a dry run writes nothing
    estimators = plan(read_experiment("configs/experiments/estimators.yaml"), "estimators.yaml")
    assert (
        len(estimators) == 33
    )  # 11 variants x 3 seeds: latent rewards, REINFORCE++, step credit, PPO
    names = {run.name for run in estimators}
    assert {"grpo_folr-seed0", "reinforce_pp_baseline-seed2", "blend_igpo-seed1"} <= names
    for path in sorted((ROOT / "configs" / "experiments").glob("*.yaml")):  # each one plans
        assert len(plan(read_experiment(path), path.name)) >= 6, path


@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=False)
        | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3),
        max_leaves=6,
    )
)
def test_an_override_reads_back_as_the_value_the_yaml_gave(value):
    try:
        text = override_text("learner.advantage.alpha", value)
    except OverrideError:
        return  # said in one line, before any run
    assert parse_override(text) == ("learner.advantage.alpha", value)


def test_override_text_examples():
    assert override_text("learner.advantage.alpha", 0.0) == "learner.advantage.alpha=0.0"
    assert override_text("actors.tools", ["search"]) == "actors.tools=[search]"
    assert override_text("x.name", "1") == "x.name='1'"  # a string, not the int 1
    assert parse_value(override_text("x.y", {"type": "random", "k": 2})[4:]) == {
        "type": "random",
        "k": 2,
    }


# ---------------------------------------------------------------------------------- running


def make_run_dir(run, *, checkpoint: int | None, report: bool) -> None:
    write_resolved_config(run.config, run.run_dir)
    if checkpoint is not None:
        (run.run_dir / "checkpoints").mkdir()
        (run.run_dir / "checkpoints" / "latest").write_text(f"step-{checkpoint:06d}\n")
    if report:
        (run.run_dir / "report.md").write_text("# report\n")


def test_done_runs_are_skipped_unfinished_ones_resumed_half_made_ones_restarted(tmp_path, capsys):
    path = write_experiment(tmp_path, seeds=[0, 1, 2])
    runs = {r.name: r for r in plan(read_experiment(path), str(path))}
    make_run_dir(runs["grpo-seed0"], checkpoint=3, report=True)  # done
    make_run_dir(
        runs["grpo-seed1"], checkpoint=1, report=True
    )  # interrupted (report, no final checkpoint)
    make_run_dir(runs["grpo-seed2"], checkpoint=2, report=False)  # killed
    make_run_dir(runs["san-seed0"], checkpoint=None, report=False)  # never got a checkpoint
    (tmp_path / "out" / "san-seed1").mkdir()  # empty: launch takes it as it is

    def check(name, argv):  # what launch would refuse: a used directory without --resume
        run_dir = tmp_path / "out" / name
        assert ("--resume" in argv) == (run_dir.exists() and any(run_dir.iterdir()))

    fake = FakeLaunch(check=check)
    assert experiment.main([str(path)], run=fake) == 0
    resumed = [name for name, argv in fake.calls if "--resume" in argv]
    assert [name for name, _ in fake.calls] == [
        "grpo-seed1",
        "grpo-seed2",
        "san-seed0",
        "san-seed1",
        "san-seed2",
    ]
    assert resumed == ["grpo-seed1", "grpo-seed2"]
    out = capsys.readouterr().out
    assert "skip grpo-seed0" in out and "san-seed0" in out and "removed, starting again" in out
    assert "end grpo-seed1 rc 0" in out
    books = records(tmp_path)
    assert {n: r["action"] for n, r in books.items()} == {
        "grpo-seed0": "skip",
        "grpo-seed1": "resume",
        "grpo-seed2": "resume",
        "san-seed0": "restart",
        "san-seed1": "start",
        "san-seed2": "start",
    }
    assert all(r["status"] == "done" for r in books.values())
    argv = dict(fake.calls)["san-seed2"]
    assert argv[1:4] == ["-m", "pipeline.launch", LOCAL] and argv[-2:] == [
        "--set",
        "runtime.seed=2",
    ]


def test_a_run_dir_made_with_other_settings_is_refused_up_front(tmp_path, capsys):
    path = write_experiment(tmp_path)
    runs = {r.name: r for r in plan(read_experiment(path), str(path))}
    make_run_dir(runs["san-seed0"], checkpoint=1, report=False)
    path = write_experiment(
        tmp_path,
        variants={
            "grpo": {"learner.advantage.alpha": 0.0},
            "san": {"learner.advantage.alpha": 0.9},
        },
    )
    fake = FakeLaunch()
    assert experiment.main([str(path)], run=fake) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "learner.advantage.alpha" in err and "san-seed0" in err
    assert fake.calls == []


def test_a_failed_run_is_reported_and_the_others_go_on(tmp_path, capsys):
    path = write_experiment(tmp_path, seeds=[0, 1])
    fake = FakeLaunch(rc={"grpo-seed0": 1})
    assert experiment.main([str(path)], run=fake) == 1
    assert len(fake.calls) == 4
    out = capsys.readouterr().out
    assert "end grpo-seed0 rc 1" in out and "not done: grpo-seed0 (rc 1)" in out
    books = records(tmp_path)
    assert books["grpo-seed0"]["status"] == "failed" and books["san-seed1"]["status"] == "done"
    assert isinstance(books["san-seed1"]["seconds"], float)


def test_only_runs_those_variants_and_keeps_the_others_records(tmp_path, capsys):
    path = write_experiment(tmp_path)
    assert experiment.main([str(path)], run=FakeLaunch(rc={"grpo-seed0": 1})) == 1
    fake = FakeLaunch()
    assert experiment.main([str(path), "--only", "san"], run=fake) == 0
    assert [name for name, _ in fake.calls] == ["san-seed0"]
    books = records(tmp_path)
    assert books["grpo-seed0"]["status"] == "failed" and books["san-seed0"]["status"] == "done"


def test_ray_needs_free_metrics_ports(tmp_path, capsys):
    path = write_experiment(tmp_path, runner="ray")
    assert experiment.main([str(path)], run=FakeLaunch()) == 2
    assert "metrics.port: 0" in capsys.readouterr().err


def test_run_logged_appends_the_output_and_returns_the_status(tmp_path):
    log = tmp_path / "logs" / "x.log"
    code = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    assert experiment.run_logged([sys.executable, "-c", code], log, tmp_path) == 3
    text = log.read_text()
    assert text.startswith("$ ") and "out\n" in text and "err\n" in text


@pytest.mark.system
def test_the_ray_runner_runs_each_command_as_a_task_in_this_directory(tmp_path):
    from pipeline.experiments.plan import Run

    jobs = []
    for i in range(3):
        run = Run(
            f"v-seed{i}",
            "v",
            i,
            tmp_path / f"v-seed{i}",
            tmp_path / "logs" / f"v-seed{i}.log",
            [],
            1,
        )
        code = f"import os; print(os.getcwd()); raise SystemExit({i})"
        jobs.append((run, [sys.executable, "-c", code]))
    done = []
    experiment.run_on_ray(jobs, experiment.run_logged, lambda r, rc, s: done.append((r.name, rc)))
    assert sorted(done) == [("v-seed0", 0), ("v-seed1", 1), ("v-seed2", 2)]
    assert str(Path.cwd()) in (tmp_path / "logs" / "v-seed2.log").read_text()


# ----------------------------------------------------------------------------------- report

QUESTIONS = {"minigaia_l1": 10, "minigaia_l2": 6, "minigaia_l3": 4}
LAST = {  # accuracy per level at the last evaluation, one entry per seed
    "grpo": {
        "minigaia_l1": [0.5, 0.6, 0.4],
        "minigaia_l2": [0.2, 0.3, 0.1],
        "minigaia_l3": [0.0, 0.25, 0.5],
    },
    "blend": {
        "minigaia_l1": [0.5, 0.5, 0.6],
        "minigaia_l2": [0.5, 0.6, 0.7],
        "minigaia_l3": [0.5, 0.5, 0.75],
    },
}


def eval_record(
    step: int, accuracy: dict[str, float], tool_calls: float, malformed: float = 0.0
) -> dict:
    rows = []
    for tools, scale in ((True, 1.0), (False, 0.5)):  # without tools: half the accuracy
        total = sum(accuracy[s] * q for s, q in QUESTIONS.items()) / sum(QUESTIONS.values())
        for name, acc, q in [
            *((s, accuracy[s], q) for s, q in QUESTIONS.items()),
            ("all", total, 20),
        ]:
            rows.append(
                {
                    "name": name,
                    "tools": tools,
                    "questions": q,
                    "samples": 1,
                    "accuracy": acc * scale,
                    "pass_at_k": None,
                    "tool_calls": tool_calls if tools else 0.0,
                    "response_tokens": 50.0,
                    "format_errors": malformed,
                }
            )
    return {"step": step, "version": step, "samples": 1, "seconds": 1.0, "rows": rows}


def write_synthetic_experiment(out: Path, theorem1: bool = True, evals: bool = True) -> None:
    runs = []
    for variant, alpha in (("grpo", 0.0), ("blend", 0.6)):
        for seed in range(3):
            run_dir = out / f"{variant}-seed{seed}"
            run_dir.mkdir(parents=True)
            (run_dir / "config.yaml").write_text(
                yaml.safe_dump({"learner": {"alpha": alpha, "stratifier": {"type": "tool_calls"}}})
            )
            metrics = []
            for step in range(1, 7):
                m = {
                    "step": step,
                    "reward_mean": 0.1 * step + alpha,
                    "tool_calls_mean": 1.0 + seed,
                    "stratum/0/count": 4.0,
                    "stratum/1/count": 12.0,
                    "stratum/1/in_stratum_adv_var": float("nan"),
                }
                if theorem1:
                    m |= {
                        "theorem1_global_var": 0.2,
                        "theorem1_in_stratum": 0.15,
                        "theorem1_cross_stratum": 0.05,
                        "theorem1_cross_stratum_chance": 0.02,
                    }
                metrics.append(m)
            (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
            if evals:
                first = eval_record(0, dict.fromkeys(QUESTIONS, 0.1), 1.0)
                last = eval_record(
                    6, {s: LAST[variant][s][seed] for s in QUESTIONS}, 2.0 + seed, 0.1 * seed
                )
                (run_dir / "eval.jsonl").write_text(
                    json.dumps(first) + "\n" + json.dumps(last) + "\n"
                )
            per_stratum = {
                "0": {"generated": 30},
                "1": {"generated": 70 if variant == "grpo" else 10},
            }
            (run_dir / "accounting.json").write_text(json.dumps({"per_stratum": per_stratum}))
            runs.append({"name": run_dir.name, "variant": variant, "seed": seed, "status": "done"})
    body = {
        "experiment": "configs/experiments/x.yaml",
        "runs": runs,
        "config": {
            "variants": {
                "grpo": {"learner.advantage.alpha": 0.0},
                "blend": {"learner.advantage.alpha": 0.6},
            }
        },
    }
    (out / "experiment.json").write_text(json.dumps(body))


def table_rows(doc: str, section: str) -> dict[tuple[str, ...], list[str]]:
    """The table rows of a section, keyed by their first cell (and the tools cell if any)."""
    part = doc.split(f"## {section}")[1].split("\n## ")[0]
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in part.splitlines()
        if line.startswith("| ")
    ]
    return {(r[0], r[1]) if r[1] in ("yes", "none") else (r[0],): r for r in rows[1:]}


def spread_text(values: list[float]) -> str:
    m, sd = statistics.mean(values), statistics.stdev(values)  # sample std, as the table says
    return f"{m:.3f} ± {sd:.3f} ({min(values):.3f}–{max(values):.3f})"


def test_the_report_tables_figures_and_findings(tmp_path, capsys):
    out, doc = tmp_path / "exp", tmp_path / "docs" / "results" / "ablation.md"
    write_synthetic_experiment(out)
    notes = tmp_path / "notes.md"
    notes.write_text("## Reading\n\nWritten by hand.\n")
    assert report_main([str(out), "--doc", str(doc), "--smooth", "3", "--notes", str(notes)]) == 0
    text = doc.read_text()
    assert "\n## Reading\n\nWritten by hand.\n\n## Figures" in text
    last = table_rows(text, "Held-out accuracy, last evaluation")
    cells = last["grpo", "yes"]
    l2, l3 = LAST["grpo"]["minigaia_l2"], LAST["grpo"]["minigaia_l3"]
    assert cells[3] == "6"  # the step of the last evaluation
    assert cells[4] == spread_text(LAST["grpo"]["minigaia_l1"])
    assert cells[7] == spread_text([(6 * a + 4 * b) / 10 for a, b in zip(l2, l3, strict=True)])
    l2, l3 = LAST["blend"]["minigaia_l2"], LAST["blend"]["minigaia_l3"]
    blend_l23 = [(6 * a + 4 * b) / 10 for a, b in zip(l2, l3, strict=True)]
    assert last["blend", "yes"][7] == spread_text(blend_l23)
    blend_all = [
        (10 * a + 6 * b + 4 * c) / 20 for a, b, c in zip(*LAST["blend"].values(), strict=True)
    ]
    assert last["blend", "none"][8] == spread_text([0.5 * a for a in blend_all])  # no tools: half
    first = table_rows(text, "Held-out accuracy, first evaluation")
    assert (
        first["grpo", "yes"][3] == "0" and first["grpo", "yes"][7] == "0.100 ± 0.000 (0.100–0.100)"
    )
    end = table_rows(text, "End of training")["grpo",]
    assert end[2] == "6" and end[5] == "3.00 ± 1.00 (2.00–4.00)"  # held-out tool calls: 2, 3, 4
    assert end[6] == "0.10 ± 0.10 (0.00–0.20)"  # malformed held-out answers: 0, 0.1, 0.2
    says = text.split("## What the numbers say")[1].split("\n## ")[0]
    assert "trained 6 learner steps" in says
    assert f"highest L2+L3 accuracy (seed mean) is blend's, {spread_text(blend_l23)}" in says
    assert "GRPO (grpo) has" in says and "L2+L3 accuracy, blend − grpo: +" in says
    assert "(3 vs 3 runs)" in says and "with 80% power" in says
    assert "grpo 0.0500 (25% of Var[A_G]; by chance 10%)" in says
    assert "labels shuffled within each group" in says
    for name in ("accuracy", "reward-mean", "tool-calls-mean", "theorem1", "strata"):
        png = doc.parent / f"ablation-{name}.png"
        assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG" and f"]({png.name})" in text
    assert "python -m pipeline.experiment configs/experiments/x.yaml" in text
    assert (
        f"python -m pipeline.experiment_report {out} --doc {doc} --smooth 3 --notes {notes}" in text
    )
    assert report_main([str(out), "--notes", str(tmp_path / "missing.md")]) == 2
    assert capsys.readouterr().err.startswith("strata: error: --notes")


def test_the_report_says_what_is_missing(tmp_path, capsys):
    out = tmp_path / "exp"
    write_synthetic_experiment(out, theorem1=False, evals=False)
    assert report_main([str(out)]) == 0
    text = (out / "results.md").read_text()
    assert "No run has a held-out evaluation" in text and "no Theorem 1 terms" in text
    assert not (out / "results-theorem1.png").exists() and (out / "results-strata.png").is_file()
    assert report_main([str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_levels_pool_their_sources_weighted_by_questions():
    rows = [
        {"name": "level 2", "tools": True, "questions": 3, "accuracy": 1.0},
        {"name": "gaia_l3", "tools": True, "questions": 1, "accuracy": 0.0},
        {"name": "nq", "tools": True, "questions": 5, "accuracy": 0.2},
        {"name": "all", "tools": True, "questions": 9, "accuracy": 0.44},
    ]
    assert level_accuracy({"rows": rows}) == {"L2": 1.0, "L3": 0.0, "L2+L3": 0.75, "all": 0.44}


def test_moving_average_is_trailing():
    import numpy as np

    assert moving_average(np.array([1.0, 2.0, 3.0, 4.0]), 2).tolist() == [1.0, 1.5, 2.5, 3.5]
    assert moving_average(np.array([1.0, 5.0]), 1).tolist() == [1.0, 5.0]


# ------------------------------------------------------------------------------ end to end


# Two estimator variants far from the default, each a whole set of the options a user combines.
ESTIMATORS = {
    # MC-GRPO, a sequence mask, TSPO's latent reward; CISPO, an entropy bonus, DAPO's overlong
    # treatments and dynamic sampling, REINFORCE++'s KL in the reward, GiGPO
    "mc_cispo": {
        "learner.advantage.type": "mc_grpo",
        "learner.importance.type": "seq_mask",
        "actors.latent_reward": 0.2,
        "learner.surrogate.type": "cispo",
        "learner.dual_clip": None,
        "learner.entropy_coef": 0.01,
        "learner.overlong_filter": True,
        "actors.overlong_buffer": 64,
        "learner.dynamic_sampling": True,
        "learner.kl_coef": 0.01,
        "learner.kl_in_reward": True,
        "learner.step_credit.type": "gigpo",
    },
    # PPO's critic and GAE, two epochs, GSPO's sequence ratio
    "ppo_gae": {
        "learner.advantage.type": "gae",
        "learner.ppo_epochs": 2,
        "learner.ratio": "sequence",
        "learner.loss_agg": "seq-mean-token-mean",
        "learner.importance.type": "none",
        "metrics.plots": True,  # critic.png, a panel only GAE has
    },
}


def test_two_estimators_run_end_to_end_resume_as_done_and_are_reported(tmp_path, run_cache):
    """As a user types it: the experiment launches each run (two estimators and corrections far
    from the default, `ESTIMATORS`), a second call skips both, and the report reads them. Short
    runs as in test_local_run, evaluated at the start and the end."""
    common = dict(parse_override(text) for text in SHORT[1::2])
    common |= {
        "runtime.cache_dir": str(run_cache),
        "learner.max_steps": 2,
        "eval.every_steps": 2,
        "eval.max_questions": 4,
    }
    path = write_experiment(tmp_path, set=common, variants=ESTIMATORS)
    argv = [sys.executable, "-m", "pipeline.experiment", str(path)]
    done = subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, timeout=900, env=child_env()
    )
    out = tmp_path / "out"
    logs = "".join(p.read_text()[-2000:] for p in (out / "logs").glob("*.log"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:] + logs
    assert "end mc_cispo-seed0 rc 0" in done.stdout and "end ppo_gae-seed0 rc 0" in done.stdout
    assert {n: r["status"] for n, r in records(tmp_path).items()} == {
        "mc_cispo-seed0": "done",
        "ppo_gae-seed0": "done",
    }
    for name in ("mc_cispo-seed0", "ppo_gae-seed0"):
        run_dir = out / name
        assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-000002"
        assert (run_dir / "report.md").is_file() and (out / "logs" / f"{name}.log").is_file()
        steps = metrics(run_dir)
        assert [s["version"] for s in steps] == [1.0, 2.0]
        assert all(math.isfinite(s["loss"]) and "logprob_gap_abs_mean" in s for s in steps)
        assert all(0 <= s["overlong_share"] <= 1 and s["entropy"] > 0 for s in steps)
    mc_steps = metrics(out / "mc_cispo-seed0")
    # dynamic sampling refilled every step: none empty, and the books count what it filtered
    assert mc_steps[-1]["empty_steps"] == 0 and all(s["skipped_groups"] == 0 for s in mc_steps)
    books = assert_accounting(out / "mc_cispo-seed0")
    assert books["total"]["filtered"] == mc_steps[-1]["filtered"]
    # the critic's figures, in the run's report.md too
    assert all(
        s["value_loss"] >= 0 and "explained_variance" in s for s in metrics(out / "ppo_gae-seed0")
    )
    report = (out / "ppo_gae-seed0" / "report.md").read_text()
    assert "critic's value loss" in report and (out / "ppo_gae-seed0" / "critic.png").is_file()

    again = subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, timeout=300, env=child_env()
    )
    assert again.returncode == 0 and again.stdout.count("strata: experiment: skip ") == 2, (
        again.stdout
    )

    doc = tmp_path / "docs" / "ablation.md"
    assert report_main([str(out), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert ("ppo_gae", "yes") in table_rows(text, "Held-out accuracy, last evaluation")
    assert "trained 2 learner steps" in text and (doc.parent / "ablation-accuracy.png").is_file()
    for name in ("mc_cispo-seed0", "ppo_gae-seed0"):
        assert_accounting(out / name)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_tie_at_the_top_is_said_as_a_tie(tmp_path):
    from pipeline.experiments.data import RunData
    from pipeline.experiments.findings import accuracy_findings

    record = eval_record(4, dict.fromkeys(QUESTIONS, 0.25), 1.0)
    groups = {
        v: [RunData(f"{v}-seed0", v, 0, tmp_path, [], [record], None, {}, "done")]
        for v in ("grpo", "san")
    }
    line = accuracy_findings(groups, "grpo")[0]
    assert "(seed mean), 0.250, is shared by grpo, san. GRPO (grpo) is among them." in line


def test_random_strata_are_placed_against_grpo_and_in_stratum_variance_is_averaged(tmp_path):
    from pipeline.experiments.data import RunData
    from pipeline.experiments.findings import findings

    def runs(variant, accuracies, stratifier="tool_calls"):
        config = {
            "learner": {
                "stratifier": {"type": stratifier},
                "alpha": 0.0 if variant == "grpo" else 0.6,
            }
        }
        metrics = [
            {
                "step": 1,
                "stratum/0/in_stratum_adv_var": 1.0,
                "stratum/1/in_stratum_adv_var": float("nan"),
            },
            {
                "step": 2,
                "stratum/0/in_stratum_adv_var": 0.5,
                "stratum/1/in_stratum_adv_var": 0.7,
                "generated_tokens_per_s": 1000.0 * (1 + len(accuracies) % 2),
                "elapsed_s": 2000.0,
            },
        ]
        return [
            RunData(
                f"{variant}-seed{k}",
                variant,
                k,
                tmp_path,
                metrics,
                [eval_record(2, dict.fromkeys(QUESTIONS, a), 1.0)],
                None,
                config,
                "done",
            )
            for k, a in enumerate(accuracies)
        ]

    groups = {
        "grpo": runs("grpo", [0.1, 0.2, 0.3]),
        "random_k2": runs("random_k2", [0.15, 0.2, 0.25], "random"),
        "random_k3": runs("random_k3", [0.25, 0.5, 0.6], "random"),
        "random_k4": runs("random_k4", [0.4, 0.5, 0.6], "random"),
    }
    says = "\n".join(findings(groups, "grpo", 5))
    assert (
        "Random strata (a control) at the last evaluation, L2+L3 accuracy against GRPO's 0.200 ± 0.100 (0.100–0.300)"
        in says
    )
    assert "random_k2 0.200 ± 0.050 (0.150–0.250) (random_k2 − grpo: +0.000" in says
    # ranges that do not overlap are no test: 3 vs 3 runs cannot give a permutation p below 0.1
    assert (
        "random_k4 0.500 ± 0.100 (0.400–0.600) (random_k4 − grpo: +0.300, 95% interval "
        "[+0.073, +0.527] (Welch), Welch p = 0.021, permutation p = 0.1 (3 vs 3 runs): "
        "no significant difference" in says
    )
    assert "above GRPO" not in says
    assert (
        "Tokens generated per run (seed means;" in says and ": grpo 4.00M; random_k2 4.00M" in says
    )
    # per step the mean over strata with a finite variance (1.0, then 0.6), then over steps: 0.8
    assert (
        "mean over strata and steps of cells whose rewards vary, seed means: grpo 0.80; random_k2 0.80"
        in says
    )
