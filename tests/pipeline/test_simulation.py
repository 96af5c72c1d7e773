"""A simulated run (actors.engine.type simulated): launched as a user types it, the books of the
real buffer balance; the staleness bound and the partial-rollout switch act."""

import json
import subprocess
import sys
from dataclasses import asdict

import pytest

from pipeline.config.loader import load_config
from pipeline.runtime.simulated import simulate
from tests.conftest import assert_accounting, child_env
from tests.pipeline.test_local_run import ROOT

SIM = [
    "actors.engine.type=simulated",
    "actors.engine.num_servers=2",
    "actors.tools=[search]",
    "actors.concurrency=64",
    "actors.max_turns=4",
    "buffer.group_size=4",
    "learner.groups_per_step=4",
    "metrics.port=0",
]


def test_a_simulated_run_launches_and_its_books_balance(tmp_path):
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "pipeline.launch",
        "configs/local.yaml",
        "--run-dir",
        str(run_dir),
        *(a for s in [*SIM, "learner.max_steps=6"] for a in ("--set", s)),
    ]
    done = subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, timeout=300, env=child_env()
    )
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
        config = load_config(
            "configs/local.yaml",
            [*SIM, "learner.max_steps=8", f"actors.engine.partial_rollouts={str(partial).lower()}"],
        )
        figures[partial] = simulate(config, tmp_path / f"partial-{partial}")
    assert figures[True].server_draining_fraction == 0 < figures[False].server_draining_fraction
    assert figures[True].steps == figures[False].steps == 8


def test_a_simulated_run_under_ray_is_refused_in_one_line(tmp_path):
    argv = [
        sys.executable,
        "-m",
        "pipeline.launch",
        "configs/local.yaml",
        "--run-dir",
        str(tmp_path / "r"),
        "--set",
        "actors.engine.type=simulated",
        "--set",
        "runtime.type=ray",
    ]
    done = subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, timeout=300, env=child_env()
    )
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .endswith("runs on the local runtime only: use --set runtime.type=local")
    )


def test_a_simulated_run_feeds_the_prometheus_metrics_in_simulated_seconds(tmp_path):
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from pipeline.loggers import open_loggers

    config = load_config("configs/local.yaml", [*SIM, "learner.max_steps=5", "metrics.port=0"])
    (tmp_path / "run").mkdir()
    loggers = open_loggers(config, tmp_path / "run")
    try:
        result = simulate(config, tmp_path / "run", loggers)
    finally:
        loggers.close()
    metrics = loggers.loggers[0].metrics
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for s in family.samples
    }
    assert samples["strata_learner_steps_total", ()] == result.steps == 5
    books = assert_accounting(tmp_path / "run")
    assert (
        samples["strata_trajectories_total", (("status", "released"),)]
        == books["total"]["trained"]
        == 5 * 16
    )
    assert samples["strata_staleness_count", ()] == 5 * 16  # one observation per trained trajectory
    assert samples["strata_generated_tokens_total", ()] > 0
    # step durations are the simulated learner's, not this machine's
    assert abs(samples["strata_learner_step_seconds_sum", ()] - result.learner_busy_s) < 1e-6


@pytest.mark.parametrize(  # SIGINT's launch: make test-system
    "stop", ["SIGTERM", pytest.param("SIGINT", marks=pytest.mark.system)]
)
def test_a_signal_stops_a_simulated_launch_with_its_books_and_a_checkpoint(tmp_path, stop):
    import os
    import signal
    import time
    import urllib.request

    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "pipeline.launch",
        "configs/local.yaml",
        "--run-dir",
        str(run_dir),
        *(
            a
            for s in [*SIM, "learner.max_steps=1000000", "metrics.loggers=[prometheus]"]
            for a in ("--set", s)
        ),
    ]
    child = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env()
    )
    try:
        deadline = time.monotonic() + 120
        steps = run_dir / "metrics.jsonl"
        while not (steps.exists() and len(steps.read_text().splitlines()) >= 3):
            assert child.poll() is None and time.monotonic() < deadline, child.communicate()
            time.sleep(0.2)
        url = (run_dir / "metrics_url").read_text().strip()
        assert url.startswith("http://127.0.0.1:")
        scraped = urllib.request.urlopen(url, timeout=10).read().decode()
        steps_seen = [
            float(line.split()[-1])
            for line in scraped.splitlines()
            if line.startswith("strata_learner_steps_total ")
        ]
        assert steps_seen and steps_seen[0] >= 3  # the endpoint follows the run while it runs
        os.kill(child.pid, getattr(signal, stop))  # SIGINT: Ctrl-C
        _, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 130, err[-3000:]
    assert "strata: interrupted: the books and a checkpoint" in err
    result = json.loads((run_dir / "simulation.json").read_text())
    assert result["interrupted"] and 3 <= result["steps"] < 1000000
    assert (run_dir / "checkpoints" / f"step-{result['steps']:06d}.json").is_file()
    books = assert_accounting(run_dir)
    # the books count as trained what the learner took: the step the stop cut short is in them
    assert result["trajectories"] <= books["total"]["trained"] <= result["trajectories"] + 16


def test_a_simulated_run_is_the_same_every_time(tmp_path):
    """Seeded, on a virtual clock: what lets benchmarks/cluster_sim.py run cases side by side, each
    in a process of its own. The second run is in another process with another hash seed (set
    and dict orders of strings differ), as the benchmark's workers are."""
    overrides = [*SIM, "learner.max_steps=4"]
    first = asdict(simulate(load_config("configs/local.yaml", overrides), tmp_path / "a"))
    code = (
        "import json; from dataclasses import asdict; from pipeline.config.loader import load_config; "
        "from pipeline.runtime.simulated import simulate; "
        f"r = asdict(simulate(load_config('configs/local.yaml', {overrides!r}), {str(tmp_path / 'b')!r})); "
        "print('RESULT', json.dumps(r))"
    )
    env = {**child_env(), "PYTHONHASHSEED": "12345"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    second = json.loads(done.stdout.rsplit("RESULT ", 1)[1])
    first = json.loads(json.dumps(first))  # the same types as the JSON read back
    first.pop("real_seconds"), second.pop("real_seconds")
    assert first == second and first["steps"] == 4
    assert_accounting(tmp_path / "a")
    assert_accounting(tmp_path / "b")
