"""`wandb`: a Weights & Biases run, in the mode W&B's own environment variables choose
(WANDB_MODE=offline logs with no account and no network, as the tests do; WANDB_PROJECT, default
`strata`; WANDB_ENTITY; WANDB_DIR, default the run directory).

Scalars under the names of pipeline.loggers.base (`train/*` at the learner's step, `eval/*`
against `eval/step`: evaluations finish while later steps train, and W&B's own step only goes
up), the resolved config as the run's config, each evaluation's rows as the table `eval/table`,
the report's plots as images. The W&B run's id is kept in run_dir/wandb_run_id, so `--resume`
logs on into the same W&B run.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.loggers.base import (
    EVAL_COLUMNS,
    Logger,
    LoggerError,
    StepRecord,
    eval_scalars,
    eval_table,
    train_scalars,
)

RUN_ID_FILE = "wandb_run_id"

if TYPE_CHECKING:
    from pipeline.config.schema import StrataConfig


class WandbLogger(Logger):
    name = "wandb"
    needs = "wandb"

    def __init__(self, config: StrataConfig, run_dir: Path) -> None:
        import wandb

        id_file = run_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        self.wandb = wandb
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "strata"),
                name=run_dir.name,
                id=run_id,
                # Offline, W&B starts a new local run with this id whatever it is told (`wandb
                # sync` joins them); online it goes on with the run of this id.
                resume=None if os.environ.get("WANDB_MODE") == "offline" else "allow",
                dir=os.environ.get("WANDB_DIR", str(run_dir)),
                config=config.model_dump(mode="json"),
            )
        except Exception as exc:  # no account in online mode, a refused id, ...
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise LoggerError(
                f"metrics.loggers wandb: W&B did not start the run: {first} (W&B's own variables "
                "choose its mode: WANDB_MODE=offline logs with no account and no network)"
            ) from exc
        id_file.write_text(run_id + "\n")
        self.run.define_metric("eval/*", step_metric="eval/step")

    def log_step(self, record: StepRecord) -> None:
        self.run.log(train_scalars(record.metrics), step=int(record.metrics["step"]))

    def log_eval(self, step: int, rows: list) -> None:
        table = self.wandb.Table(columns=list(EVAL_COLUMNS), data=eval_table(step, rows))
        self.run.log({"eval/step": step, **eval_scalars(rows), "eval/table": table})

    def log_report(self, step: int, images: list[Path]) -> None:
        self.run.log({f"report/{p.stem}": self.wandb.Image(str(p)) for p in images})

    def close(self) -> None:
        self.run.finish()
