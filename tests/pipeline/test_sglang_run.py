"""The whole pipeline through SGLang's HTTP API, on CPU: `python -m pipeline.launch` generating on
two stand-in SGLang servers (tests/actors/sglang_standin.py, separate processes serving the
policy with real log-probs; one reports per-token weight-version spans as SGLang 0.5.19+ does,
the other only its weight_version, as older servers do), local and Ray runtimes. One server is
killed (SIGKILL) mid-run and started again on its port, as a supervisor would: its in-flight
trajectories are abandoned and counted, the run goes on, and the server rejoins only after
loading the latest published checkpoint. Each server keeps a log of what it truly generated with
which weights, so the run's per-token version labels are checked against the truth."""

import importlib.util
import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest

from actors.servers import free_port, healthy
from buffers.reader import read_trajectories
from pipeline.assets.cache import prepare_assets
from pipeline.config.loader import load_config
from tests.conftest import assert_accounting
from tests.pipeline.test_local_run import ROOT, SHORT, launch
from tests.pipeline.test_ray_run import RAY, wait_for_step


class StandIn:
    """A stand-in SGLang server process on a fixed port, restartable there."""

    def __init__(self, policy: Path, truth: Path, spans: bool) -> None:
        self.policy, self.truth, self.spans = policy, truth, spans
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.spawn()
        self.wait_healthy()

    def spawn(self) -> None:
        argv = [
            sys.executable,
            "-m",
            "tests.actors.sglang_standin",
            "--model-path",
            str(self.policy),
            "--port",
            str(self.port),
            "--standin-truth",
            str(self.truth),
            *(["--standin-spans"] if self.spans else []),
        ]
        self.process = subprocess.Popen(
            argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + 120
        while not healthy(self.url):
            assert self.process.poll() is None, f"the stand-in on {self.url} exited"
            assert time.monotonic() < deadline, f"the stand-in on {self.url} never answered"
            time.sleep(0.2)

    def kill_mid_request(self) -> None:
        """SIGKILL it while it is generating (waits for a request in flight)."""
        deadline = time.monotonic() + 120
        while self.in_flight() == 0:
            assert time.monotonic() < deadline, f"no request reached {self.url}"
            time.sleep(0.005)
        self.kill()

    def in_flight(self) -> int:
        with urllib.request.urlopen(f"{self.url}/get_server_info", timeout=5) as answer:
            return json.loads(answer.read())["standin_in_flight"]

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def events(self) -> list[dict]:
        return [json.loads(line) for line in self.truth.read_text().splitlines()]


@pytest.fixture
def servers(tmp_path, run_cache):
    """Two stand-in servers on the run's warm-started policy (built first if the cache has none)."""
    config = load_config("configs/local.yaml", [f"runtime.cache_dir={run_cache}", *SHORT[1::2]])
    policy = Path(prepare_assets(config, quiet=True).policy_dir)
    pair = [StandIn(policy, tmp_path / f"truth-{i}.jsonl", spans=i == 0) for i in range(2)]
    try:
        for server in pair:  # both start up side by side (each imports torch: seconds)
            server.spawn()
        for server in pair:
            server.wait_healthy()
        yield pair
    finally:
        for server in pair:
            if server.process is not None and server.process.poll() is None:
                server.kill()


def engine_on(servers) -> list[str]:
    urls = ", ".join(s.url for s in servers)
    return ["--set", f"actors.engine={{type: sglang, urls: [{urls}]}}"]


def run_killing_one(run_dir, run_cache, servers, *extra) -> str:
    """Launch, SIGKILL the second server mid-request after the first step, start it again on its port;
    once it has rejoined and generated, let the run go on a few steps more, then end it with
    SIGTERM (checkpointed, flushed). The run's stdout."""
    proc = launch(
        run_dir,
        run_cache,
        *engine_on(servers),
        "--set",
        "learner.max_steps=100000",
        "--set",
        "buffer.max_staleness=1",
        *extra,
    )
    seen: list[str] = []
    try:
        wait_for_step(proc, 1, seen)
        servers[1].kill_mid_request()
        time.sleep(1.0)
        servers[1].start()
        deadline = time.monotonic() + 300
        while not serving_again(servers[1]):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the restarted server never rejoined"
            time.sleep(0.5)
        step = len((run_dir / "metrics.jsonl").read_text().splitlines())
        wait_for_step(proc, step + 3, seen)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
        (run_dir.parent / "launcher.err").write_text(err)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:] + out[-2000:]  # ended by SIGTERM, cleanly
    return "".join(seen) + out


def serving_again(server: StandIn) -> bool:
    events = server.events()
    restart = max(i for i, e in enumerate(events) if e["event"] == "start")
    return any(e["event"] == "generate" for e in events[restart:])


def check_run(run_dir: Path, servers) -> dict:
    """The run-directory checks of an SGLang run; the run's books."""
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = len(steps)
    assert [s["version"] for s in steps] == [float(v) for v in range(1, last + 1)]
    assert steps[-1]["served_version"] == last  # what the servers report serving at the end

    # every checkpoint a server loaded is one the run published, in order, and it succeeded
    weights = run_dir / "weights"
    for server in servers:
        updates = [e for e in server.events() if e["event"] == "update"]
        assert updates and all(e["success"] for e in updates)
        loaded = [int(e["weight_version"]) for e in updates]
        assert loaded == sorted(loaded) and loaded[-1] == last
        assert all(Path(e["model_path"]).parent == weights.resolve() for e in updates)
        assert all(
            Path(e["model_path"]).name == f"v{int(e['weight_version']):06d}" for e in updates
        )
    from transformers import AutoModelForCausalLM  # the checkpoints are HF models a server reloads

    assert (
        AutoModelForCausalLM.from_pretrained(weights / f"v{last:06d}").config.model_type == "qwen2"
    )

    # the killed server: its new process loaded the latest weights before it generated anything
    events = servers[1].events()
    restart = max(i for i, e in enumerate(events) if e["event"] == "start")
    after = [e for e in events[restart + 1 :] if e["event"] in ("update", "generate")]
    assert after and after[0]["event"] == "update", (
        "the restarted server generated on its start-up weights"
    )
    assert all(
        min(e["versions"]) >= int(after[0]["weight_version"])
        for e in after
        if e["event"] == "generate"
    )

    assert_labels_never_newer(
        run_dir, [e for s in servers for e in s.events() if e["event"] == "generate"]
    )
    books = assert_accounting(run_dir)
    config = load_config(run_dir / "config.yaml")
    per_step = config.learner.groups_per_step * config.buffer.group_size
    # the step under way at SIGTERM finishes and has its line; one that found no usable group
    # (all rewards equal) took its groups but trains nothing and has none
    empty = steps[-1]["empty_steps"] if steps else 0
    assert books["total"]["trained"] in ((last + empty) * per_step, (last + empty + 1) * per_step)
    assert (
        books["total"]["aborted"] >= 1
    )  # the killed server's requests in flight: their groups abandoned
    return books


def assert_labels_never_newer(run_dir: Path, generated: list[dict]) -> None:
    """Each generated turn of each spilled trajectory is one answer a server gave: its tokens'
    version labels are never newer than the weights that truly sampled them (the servers' logs).
    Turns are matched to answers by their token ids (largest labels first, each to the answer
    with the oldest weights that still covers it, so equal answers cannot hide a bad label)."""
    answers: dict[tuple, list[list[int]]] = defaultdict(list)
    for event in generated:
        answers[tuple(event["output_ids"])].append(event["versions"])
    table, bad = read_trajectories(
        run_dir / "trajectories", ["token_ids", "loss_mask", "token_versions"]
    )
    assert not bad
    turns = []
    for ids, mask, labels in zip(*(table[c].to_pylist() for c in table.column_names), strict=True):
        start = None
        for i, m in enumerate([*mask, 0]):
            if m and start is None:
                start = i
            elif not m and start is not None:
                turns.append((tuple(ids[start:i]), labels[start:i]))
                start = None
    assert turns
    for ids, labels in sorted(turns, key=lambda t: -max(t[1])):
        fits = [
            truth
            for truth in answers[ids]
            if all(a <= b for a, b in zip(labels, truth, strict=True))
        ]
        assert fits, (
            f"a turn labelled {labels} has no answer whose weights are that new: {answers[ids]}"
        )
        answers[ids].remove(min(fits, key=min))
    labelled = [label for _, labels in turns for label in labels]
    assert max(labelled) >= 1  # generated with published weights, not only the start-up ones


@pytest.mark.system
def test_a_local_run_on_two_sglang_servers_survives_one_being_killed(tmp_path, run_cache, servers):
    run_dir = tmp_path / "run"
    run_killing_one(run_dir, run_cache, servers)
    check_run(run_dir, servers)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1]["weight_sync_failures"] == 0  # the dead server was out of the updates
    assert steps[-1]["server_rejoins"] == 1


@pytest.mark.system
def test_a_ray_run_on_two_sglang_servers_survives_one_being_killed(tmp_path, run_cache, servers):
    """Each of the two pools owns one server (pool_urls): the killed one's pool waits for it."""
    run_dir = tmp_path / "run"
    run_killing_one(run_dir, run_cache, servers, *RAY)
    check_run(run_dir, servers)


@pytest.mark.gpu
@pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None, reason="needs sglang (pip install '.[gpu]')"
)
def test_a_run_on_real_sglang_servers_the_launcher_starts(tmp_path, run_cache):
    """On a machine with 2+ GPUs and SGLang: the launcher starts a real server on the last GPU
    (the learner keeps GPU 0), every publish lands, and the server is gone at the end."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: the learner's and the server's")
    run_dir = tmp_path / "run"
    proc = launch(
        run_dir,
        run_cache,
        "--set",
        "actors.engine={type: sglang, mem_fraction_static: 0.3}",
        "--set",
        "learner.max_steps=3",
    )
    out, err = proc.communicate(timeout=1800)
    assert proc.returncode == 0, err[-3000:] + out[-2000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["served_version_min"] for s in steps] == [1, 2, 3]
    assert steps[-1]["weight_sync_failures"] == 0
    assert (run_dir / "logs" / "sglang-server-0.log").is_file()
    assert_accounting(run_dir)
