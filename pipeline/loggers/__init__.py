"""Where a run's figures go besides metrics.jsonl (which every run writes): `metrics.loggers`.

Each logger is a module here holding one `Logger` (pipeline.loggers.base: the interface and the
naming scheme all of them share) and its line in LOGGERS below; the config, its reference
(docs/config.md) and the runtimes pick it up from there. `open_loggers` opens the chosen ones
before the run is built (a taken port or a missing package stops it at once) and returns one
`Loggers` that hands every record to each.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.loggers.base import Logger, LoggerError, StepRecord
from pipeline.loggers.prometheus import PrometheusLogger
from pipeline.loggers.tensorboard import TensorBoardLogger
from pipeline.loggers.wandb import WandbLogger

if TYPE_CHECKING:
    from pipeline.config.schema import StrataConfig

LOGGERS: dict[str, type[Logger]] = {
    c.name: c for c in (PrometheusLogger, TensorBoardLogger, WandbLogger)
}
"""`metrics.loggers` entry -> its logger. The trackers' packages are imported when a run opens
them (they are heavy), so the config loads without them."""


PORT_REMEDY = "set metrics.port, or leave prometheus out of metrics.loggers"
"""What to do when the Prometheus endpoint's port is taken."""


class Loggers:
    """The chosen loggers as one: each call goes to every one of them, in `metrics.loggers` order."""

    def __init__(self, loggers: list[Logger]) -> None:
        self.loggers = loggers
        self.begun = False

    def begin(self, step: int) -> None:
        self.begun = True
        for logger in self.loggers:
            logger.begin(step)

    def log_step(self, record: StepRecord) -> None:
        for logger in self.loggers:
            logger.log_step(record)

    def log_eval(self, step: int, rows: list) -> None:
        for logger in self.loggers:
            logger.log_eval(step, rows)

    def log_report(self, step: int, images: list[Path]) -> None:
        for logger in self.loggers:
            logger.log_report(step, images)

    def close(self) -> None:
        """Close each logger; when the run never began streaming (it stopped while being built),
        also remove what opening them wrote, so a refused launch leaves its directory bare."""
        for logger in reversed(self.loggers):
            logger.close()
        if not self.begun:
            for logger in self.loggers:
                logger.discard()


def open_loggers(config: StrataConfig, run_dir: Path) -> Loggers:
    """The loggers `config.metrics.loggers` names, open; LoggerError, one line, (with the ones
    already open closed again) when one cannot open: a missing package, a taken metrics port."""
    opened: list[Logger] = []
    try:
        for name in config.metrics.loggers:
            cls = LOGGERS[name]
            try:
                opened.append(cls(config, run_dir))
            except ImportError as exc:
                raise LoggerError(
                    f"metrics.loggers {name} needs the {cls.needs} package ({exc}): `make setup` "
                    f"installs it, or pip install {cls.needs}; or leave {name} out"
                ) from exc
            except OSError as exc:  # e.g. the metrics port is taken
                raise LoggerError(f"{exc} ({PORT_REMEDY})") from exc
    except BaseException:
        Loggers(opened).close()  # never begun: what they wrote goes too
        raise
    return Loggers(opened)
