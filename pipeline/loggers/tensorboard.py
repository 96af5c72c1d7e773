"""`tensorboard`: event files under run_dir/tensorboard (`tensorboard --logdir runs/`).

Scalars under the names of pipeline.loggers.base, the resolved config and each evaluation's rows
as text (a markdown table: TensorBoard has no tables), the report's plots as images. A resumed run
writes on in the same directory; the events of the steps after its checkpoint, which it redoes,
are purged from what TensorBoard shows.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from pipeline.loggers.base import (
    EVAL_COLUMNS,
    Logger,
    StepRecord,
    eval_scalars,
    eval_table,
    train_scalars,
)

if TYPE_CHECKING:
    from pipeline.config.schema import StrataConfig


class TensorBoardLogger(Logger):
    name = "tensorboard"
    needs = "tensorboard"

    def __init__(self, config: StrataConfig, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer_class = SummaryWriter
        self.directory = run_dir / "tensorboard"
        self.config_text = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
        self.writer = None

    def begin(self, step: int) -> None:
        # purge_step: TensorBoard drops what the interrupted process wrote after the checkpoint.
        self.writer = self.writer_class(
            str(self.directory), purge_step=step + 1 if step else None, flush_secs=10
        )
        if not step:
            self.writer.add_text("config", f"```yaml\n{self.config_text}```", 0)

    def log_step(self, record: StepRecord) -> None:
        step = int(record.metrics["step"])
        for tag, value in train_scalars(record.metrics).items():
            self.writer.add_scalar(tag, value, step)

    def log_eval(self, step: int, rows: list) -> None:
        for tag, value in eval_scalars(rows).items():
            self.writer.add_scalar(tag, value, step)
        lines = ["| " + " | ".join(EVAL_COLUMNS) + " |", "|" + " --- |" * len(EVAL_COLUMNS)]
        lines += ["| " + " | ".join(map(str, row)) + " |" for row in eval_table(step, rows)]
        self.writer.add_text("eval/table", "\n".join(lines), step)

    def log_report(self, step: int, images: list[Path]) -> None:
        import matplotlib.image

        for path in images:
            pixels = matplotlib.image.imread(path)[..., :3]  # RGBA -> RGB, floats in [0, 1]
            self.writer.add_image(f"report/{path.stem}", pixels, step, dataformats="HWC")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
