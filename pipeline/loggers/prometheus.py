"""`prometheus`: the run's live series (pipeline.runtime.metrics), served on
metrics.host:metrics.port for Prometheus to scrape and Grafana to show (ops/)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.loggers.base import Logger, StepRecord
from pipeline.runtime.metrics import RunMetrics

if TYPE_CHECKING:
    from pipeline.config.schema import StrataConfig


class PrometheusLogger(Logger):
    name = "prometheus"

    def __init__(self, config: StrataConfig, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.metrics = RunMetrics()
        self.metrics.declare_tools(
            config.actors.tool_names, [server.name for server in config.actors.mcp_servers]
        )
        # Serving starts here: a taken port stops the run before anything is built.
        host = config.metrics.host
        port = self.metrics.serve(host, config.metrics.port)
        (run_dir / "metrics_url").write_text(f"http://{host}:{port}/metrics\n")
        print(f"strata: metrics on http://{host}:{port}/metrics", flush=True)

    def log_step(self, record: StepRecord) -> None:
        self.metrics.observe_step(record.metrics, record.trajectories, record.idle_s)
        self.metrics.sample(record.buffer_stats, record.actors)

    def log_eval(self, step: int, rows: list) -> None:
        self.metrics.observe_eval(step, rows)

    def close(self) -> None:
        self.metrics.close()

    def discard(self) -> None:
        (self.run_dir / "metrics_url").unlink(missing_ok=True)
