"""Run directories: a fresh one for a new run (never an earlier run's), the one a `--resume`
goes on with (checked: a checkpoint, the same settings), and removing what a launch that failed
before it started left behind."""

from __future__ import annotations

import time
from pathlib import Path

from pipeline.config.loader import ConfigError, load_config
from pipeline.config.schema import StrataConfig


def new_run_dir(config: StrataConfig, config_path: str, requested: str | None) -> Path:
    """A run directory that holds nothing yet: the requested one, or a fresh timestamped one."""
    if requested is not None:
        run_dir = Path(requested)
        if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
            raise ConfigError(
                f"--run-dir {run_dir} already exists and is not an empty directory: "
                "pick a new one so no earlier run is overwritten"
            )
        run_dir.mkdir(parents=True, exist_ok=True)
        return run_dir
    stem = f"{Path(config_path).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    parent = Path(config.runtime.runs_dir)
    for attempt in range(1000):
        run_dir = parent / (stem if attempt == 0 else f"{stem}-{attempt}")
        try:
            run_dir.mkdir(parents=True, exist_ok=False)
            return run_dir
        except FileExistsError:
            continue
    raise ConfigError(f"could not create a fresh run directory under {parent}")


def discard_if_unstarted(run_dir: Path, created: bool) -> None:
    """After a launch that failed before the run started (e.g. a data file the assets cannot
    read), the run directory holds only its config.yaml: remove it, and the directory when this
    launch created it, so a refused launch leaves nothing behind. Anything more (a server's log,
    a step's metrics) is what the user needs to see why, and stays."""
    if sorted(p.name for p in run_dir.iterdir()) != ["config.yaml"]:
        return
    (run_dir / "config.yaml").unlink()
    if created:
        run_dir.rmdir()


RESUMABLE_CHANGES = {"learner.max_steps"}


def _flat(data: dict, prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def resumable_run_dir(config: StrataConfig, requested: str | None) -> Path:
    """The run directory to resume, checked: it has a checkpoint and was run with `config`'s
    settings (apart from `RESUMABLE_CHANGES`)."""
    if requested is None:
        raise ConfigError("--resume needs --run-dir DIR: the directory of the run to go on with")
    run_dir = Path(requested)
    if not (run_dir / "checkpoints" / "latest").is_file():
        raise ConfigError(
            f"--resume: {run_dir} holds no checkpoint (no checkpoints/latest): start it without --resume"
        )
    saved = load_config(run_dir / "config.yaml")
    old, new = _flat(saved.model_dump(mode="json")), _flat(config.model_dump(mode="json"))
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    changed = [k for k in changed if k not in RESUMABLE_CHANGES]
    if changed:
        raise ConfigError(
            f"--resume: the settings differ from the run's own {run_dir / 'config.yaml'} in "
            f"{', '.join(changed)}: resume with the same config (only learner.max_steps may change)"
        )
    return run_dir
