"""metrics.loggers: the naming scheme, and the ways a logger refuses a run (one line, exit 2,
nothing left in the run directory)."""

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.config.loader import ConfigError, load_config
from pipeline.loggers import LOGGERS, LoggerError, open_loggers
from pipeline.loggers.base import eval_scalars, eval_table, train_scalars
from tests.conftest import child_env

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Row:  # the fields of pipeline.evaluation.heldout.Row the loggers read
    name: str
    tools: bool
    questions: int = 4
    samples: int = 1
    accuracy: float = 0.5
    pass_at_k: float | None = None
    tool_calls: float = 1.25
    response_tokens: float = 40.0
    format_errors: float = 0.0


def test_every_number_of_a_step_is_named_train_and_its_key():
    line = {"step": 3, "published": True, "loss": -0.5, "stratum/1/reward": 0.25, "note": "x"}
    assert train_scalars(line) == {
        "train/step": 3.0,
        "train/published": 1.0,
        "train/loss": -0.5,
        "train/stratum/1/reward": 0.25,
    }


def test_an_evaluation_is_named_by_row_and_tools_and_is_also_a_table():
    rows = [Row("all", True), Row("all", False, accuracy=0.25)]
    scalars = eval_scalars(rows)
    assert scalars["eval/all/tools/accuracy"] == 0.5
    assert scalars["eval/all/no_tools/accuracy"] == 0.25
    assert "eval/all/tools/pass_at_k" not in scalars  # greedy: no pass@k
    assert eval_table(7, rows)[1] == [7, "all", False, 4, 1, 0.25, None, 1.25, 40.0, 0.0]


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("metrics.loggers=[mlflow]", "no logger 'mlflow'; the loggers are prometheus, tensorboard"),
        ("metrics.enabled=false", "metrics.enabled was replaced by metrics.loggers"),
        ("metrics.loggers=[wandb,wandb]", "names a logger twice"),
    ],
)
def test_a_logger_the_config_cannot_have_is_refused_in_one_line(override, said):
    with pytest.raises(ConfigError, match=said):
        load_config("configs/local.yaml", [override])


def test_a_missing_package_is_named_and_the_loggers_opened_before_it_are_closed(
    tmp_path, monkeypatch
):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    config = load_config(
        "configs/local.yaml", ["metrics.loggers=[prometheus,tensorboard]", "metrics.port=0"]
    )
    closed = []
    monkeypatch.setattr(LOGGERS["prometheus"], "close", lambda self: closed.append(self))
    with pytest.raises(LoggerError, match="tensorboard needs the tensorboard package"):
        open_loggers(config, tmp_path)
    assert len(closed) == 1 and list(tmp_path.iterdir()) == []  # no metrics_url left


def test_wandb_online_without_an_account_stops_the_launch_in_one_line(tmp_path):
    """W&B's own variables choose its mode; online with no key it refuses, and the launch says
    how to log offline, before anything is built or written."""
    env = {k: v for k, v in child_env().items() if not k.startswith("WANDB_")}
    env |= {"WANDB_MODE": "online", "HOME": str(tmp_path), "WANDB_ERROR_REPORTING": "false"}
    run_dir = tmp_path / "run"
    sets = ["--set", "metrics.loggers=[prometheus,wandb]", "--set", "metrics.port=0"]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.launch",
            "configs/local.yaml",
            "--run-dir",
            str(run_dir),
            *sets,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 2, done.stderr
    error = [line for line in done.stderr.splitlines() if line.startswith("strata: error")]
    assert len(error) == 1 and "WANDB_MODE=offline" in error[0] and "API key" in error[0]
    assert not run_dir.exists()
