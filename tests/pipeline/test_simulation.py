"""A simulated run (actors.engine.type simulated): launched as a user types it, the books of the
real buffer balance; the staleness bound and the partial-rollout switch act."""

import json
import subprocess
import sys

from pipeline.config_loader import load_config
from pipeline.simulation import simulate
from tests.conftest import assert_accounting, child_env
from tests.pipeline.test_local_run import ROOT

SIM = ["actors.engine.type=simulated", "actors.engine.num_servers=2", "actors.tools=[search]",
       "actors.concurrency=64", "actors.max_turns=4", "buffer.group_size=4", "learner.groups_per_step=4",
       "metrics.port=0"]  # fmt: skip


def test_a_simulated_run_launches_and_its_books_balance(tmp_path):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "pipeline.launch", "configs/local.yaml", "--run-dir", str(run_dir),
            *(a for s in [*SIM, "learner.max_steps=6"] for a in ("--set", s))]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300, env=child_env())  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-2000:]
    assert (
        "no model is trained, so model, data (but num_questions, seed, shuffle), retrieval"
        in done.stdout
    )
    result = json.loads((run_dir / "simulation.json").read_text())
    assert result["steps"] == 6 and result["trajectories"] == 6 * 4 * 4
    assert 0 < result["server_busy_fraction"] <= 1 and result["seconds"] > result["real_seconds"]
    assert max(int(k) for k in result["staleness"]) <= 2  # local.yaml's buffer.max_staleness
    assert_accounting(run_dir)


def test_without_partial_rollouts_servers_drain_before_each_load(tmp_path):
    figures = {}
    for partial in (True, False):
        config = load_config("configs/local.yaml", [*SIM, "learner.max_steps=8",
                             f"actors.engine.partial_rollouts={str(partial).lower()}"])  # fmt: skip
        figures[partial] = simulate(config, tmp_path / f"partial-{partial}")
    assert figures[True].server_draining_fraction == 0 < figures[False].server_draining_fraction
    assert figures[True].steps == figures[False].steps == 8


def test_a_simulated_run_under_ray_is_refused_in_one_line(tmp_path):
    argv = [sys.executable, "-m", "pipeline.launch", "configs/local.yaml", "--run-dir", str(tmp_path / "r"),
            "--set", "actors.engine.type=simulated", "--set", "runtime.type=ray"]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300, env=child_env())  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].endswith("runs on the local runtime only: use --set runtime.type=local")  # fmt: skip
