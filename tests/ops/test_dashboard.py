"""The Grafana dashboard's queries against a real Prometheus scraping a real short run.

Runs where Debian's `prometheus` binary is installed (`make setup` installs it as root with apt;
else `apt-get install prometheus`), else skips."""

import json
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import assert_accounting, assert_loopback_listeners
from tests.pipeline.test_local_run import launch

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")


def test_dashboard_is_valid_and_covers_the_design_metrics():
    dashboard = json.loads((ROOT / "ops" / "grafana" / "strata.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for name in [
        "strata_generated_tokens_total",
        "strata_trajectories_total",
        "strata_learner_steps_total",
        "strata_staleness",
        "strata_buffer_groups",
        "strata_reward",
        "strata_tool_calls_per_trajectory",
        "strata_learner_step_seconds",
        "strata_learner_idle_seconds_total",
        "strata_weight_sync_seconds",
        "strata_tool_call_seconds",
        "strata_tool_errors_total",
        "strata_eval_accuracy",
        "strata_learner_rank_seconds_total",
        "strata_learner_rank_idle_seconds_total",
        "strata_learner_rank_tokens_total",
        "strata_objective",
    ]:
        assert name in exprs, name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def query(port: int, expr: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())["data"]["result"]


@pytest.mark.skipif(PROMETHEUS is None, reason="Debian's prometheus binary is not installed")
@pytest.mark.system
def test_every_panel_query_returns_data_from_a_live_run(tmp_path, run_cache):
    metrics_port, prom_port = free_port(), free_port()
    run = launch(
        tmp_path / "run",
        run_cache,
        "--set",
        "learner.max_steps=100000",
        "--set",
        f"metrics.port={metrics_port}",
        "--set",
        "eval.every_steps=2",
        "--set",
        "eval.max_questions=8",
    )
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s}\nscrape_configs:\n  - job_name: strata\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]\n"
    )
    prom = None
    try:
        steps = 0
        for line in run.stdout:
            steps += line.startswith("step ")
            if steps == 1 and prom is None:
                prom = subprocess.Popen(
                    [
                        PROMETHEUS,
                        f"--config.file={config}",
                        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                        f"--web.listen-address=127.0.0.1:{prom_port}",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            if steps >= 8:
                break
        assert steps >= 8, "the run ended early"
        listening = assert_loopback_listeners(run.pid)  # the metrics endpoint, the retrieval server
        assert metrics_port in {port for _, port, _ in listening}
        dashboard = json.loads((ROOT / "ops" / "grafana" / "strata.json").read_text())
        exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
        deadline = time.monotonic() + 60  # rates need two scrapes inside their window
        while True:
            empty = [expr for expr in exprs if not query(prom_port, expr)]
            if not empty or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert not empty, empty
    finally:
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=120)
        if prom is not None:
            prom.terminate()
            prom.wait(timeout=30)
    assert_accounting(tmp_path / "run")
