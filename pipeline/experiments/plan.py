"""What `python -m pipeline.experiment` runs: the experiment file's schema, and the list of runs
(variant x seed) with their `--set` overrides, resolved configs and what to do with each run
directory (start, resume, restart or skip), every one checked before any run starts."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from pipeline.config.base import Section
from pipeline.config.loader import ConfigError, load_config, read_yaml
from pipeline.config.overrides import OverrideError, parse_value
from pipeline.config.schema import StrataConfig
from pipeline.runtime.preflight import refused_for_training, unavailable
from pipeline.runtime.run_dir import RESUMABLE_CHANGES

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
SEED_KEY = "runtime.seed"


class ExperimentConfig(Section):
    """An experiment file (configs/experiments/*.yaml): variants x seeds of one base run config."""

    base: str = Field(min_length=1)
    """Run config every run starts from, e.g. configs/local.yaml (relative to the working directory)."""
    out: str = Field(min_length=1)
    """Experiment directory: one run directory <out>/<variant>-seed<k> per run, their output in
    <out>/logs/, and <out>/experiment.json."""
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    """One run per variant and seed; the seed goes into the run's runtime.seed."""
    runner: Literal["sequential", "ray"] = "sequential"
    """sequential: one run after another; ray: each run a Ray task on a private loopback cluster
    (one CPU each, so as many at once as the machine has cores)."""
    set: dict[str, Any] = Field(default_factory=dict)
    """Dotted overrides every run gets, before its variant's (e.g. learner.max_steps: equal compute)."""
    variants: dict[str, dict[str, Any]] = Field(min_length=1)
    """Variant name -> dotted overrides, as `launch --set key=value` takes them."""
    endpoints: list[Literal["L1", "L2", "L3", "L2+L3", "all", "chains"]] = Field(
        default_factory=list
    )
    """Pre-registered endpoints the report tests every variant against GRPO on: held-out
    accuracy at the last evaluation by level, or `chains` (the share of two-hop training
    trajectories with two or more searches over the last quarter of policy versions; needs
    buffer.spill). Empty: the report's usual comparison (L2+L3) only."""

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, seeds: list[int]) -> list[int]:
        if any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
            raise ValueError(f"seeds {seeds} must be distinct and >= 0")
        return seeds

    @model_validator(mode="after")
    def _names_and_keys(self) -> ExperimentConfig:
        for name in self.variants:
            if not _NAME.fullmatch(name):
                raise ValueError(
                    f"variant name {name!r} names a directory: use letters, digits, _ . -"
                )
        for where, overrides in [
            ("set", self.set),
            *((f"variants.{n}", o) for n, o in self.variants.items()),
        ]:
            if SEED_KEY in overrides:
                raise ValueError(
                    f"{where} sets {SEED_KEY}: the experiment's `seeds` set it, one run per seed"
                )
        return self


def read_experiment(path: str | Path) -> ExperimentConfig:
    """The validated experiment file, or a one-line ConfigError naming the file and the key."""
    raw = read_yaml(path)
    try:
        return ExperimentConfig.model_validate(raw)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in error["loc"])
        if error["type"] == "extra_forbidden":
            valid = ", ".join(ExperimentConfig.model_fields)
            raise ConfigError(f"{path}: unknown key '{where}' (valid keys: {valid})") from None
        message = error["msg"].removeprefix("Value error, ")
        raise ConfigError(f"{path}: {where + ': ' if where else ''}{message}") from None


def override_text(key: str, value: Any) -> str:
    """`key=value` that `--set` parses back to exactly `value` (as YAML gave it)."""
    text = f"{key}={_value_text(value)}"
    if parse_value(text.partition("=")[2]) != value:  # a string that parse_value cannot carry
        raise OverrideError(f"{key}: the value {value!r} cannot be written as --set {key}=...")
    return text


def _value_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(_value_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_value_text(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if parse_value(text) == text and text == text.strip() and not set(text) & set(",[]{}'\""):
        return text
    return f"'{text}'" if "'" not in text else f'"{text}"'


@dataclass
class Run:
    """One variant x seed: its directory, its overrides, and how it went."""

    name: str
    variant: str
    seed: int
    run_dir: Path
    log: Path
    overrides: list[str]
    max_steps: int
    action: str = "start"  # start | resume | restart | skip
    status: str = "pending"  # pending | running | done | failed | interrupted
    rc: int | None = None
    seconds: float | None = None
    config: StrataConfig | None = field(default=None, repr=False)  # resolved, for checks


def plan(experiment: ExperimentConfig, source: str, only: list[str] | None = None) -> list[Run]:
    """Every run of `experiment` (of the variants in `only`), each resolved config validated and
    each run directory's state checked; the first problem is a one-line ConfigError."""

    names = list(experiment.variants)
    unknown = [n for n in only or [] if n not in experiment.variants]
    if unknown:
        raise ConfigError(
            f"--only {' '.join(unknown)}: no such variant in {source} (variants: {', '.join(names)})"
        )
    if not Path(experiment.base).is_file():
        raise ConfigError(
            f"{source}: base {experiment.base}: no such file (paths are relative to the working directory {Path.cwd()})"
        )
    try:  # the common overrides alone first, so a problem there is not blamed on a variant
        load_config(experiment.base, [override_text(k, v) for k, v in experiment.set.items()])
    except (ConfigError, OverrideError) as exc:
        raise ConfigError(f"{source}: set: {exc}") from None
    out = Path(experiment.out)
    runs = []
    for variant in [n for n in names if not only or n in only]:
        for seed in experiment.seeds:
            name = f"{variant}-seed{seed}"
            where = f"{source}: variants.{variant} ({name})"
            try:
                common = [override_text(k, v) for k, v in experiment.set.items()]
                own = [override_text(k, v) for k, v in experiment.variants[variant].items()]
                overrides = [*common, *own, f"{SEED_KEY}={seed}"]
                config = load_config(experiment.base, overrides)
            except (ConfigError, OverrideError) as exc:
                raise ConfigError(f"{where}: {exc}") from None
            problem = unavailable(config) or refused_for_training(config)
            if problem:
                raise ConfigError(f"{where}: {problem}")
            run = Run(
                name,
                variant,
                seed,
                out / name,
                out / "logs" / f"{name}.log",
                overrides,
                config.learner.max_steps,
                config=config,
            )
            run.action = action_for(run.run_dir, config, where)
            runs.append(run)
    return runs


def parallel_problem(runs: list[Run]) -> str | None:
    """Why these runs cannot run side by side on one machine (the ray runner), in one line."""
    configs = [(r.name, r.config) for r in runs if r.action != "skip" and r.config is not None]
    ports = [(n, c.metrics.port) for n, c in configs if c.metrics.prometheus and c.metrics.port]
    if len(configs) > 1 and ports:
        return (
            f"runner ray runs several of the {len(configs)} runs at once, and {ports[0][0]} serves metrics on the "
            f"fixed port {ports[0][1]}: add metrics.port: 0 (any free port) to the experiment's `set`"
        )
    nested = [n for n, c in configs if c.runtime.starts_ray]
    if nested:
        return (
            f"runner ray runs each run as a Ray task, and {nested[0]} uses runtime.type ray "
            "(a Ray cluster of its own): use runner sequential for Ray runs"
        )
    return None


def checkpoint_step(run_dir: Path) -> int | None:
    """The learner step of the run's latest checkpoint (checkpoints/latest names step-NNNNNN)."""
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    digits = pointer.read_text().strip().removeprefix("step-")
    return int(digits) if digits.isdigit() else 0


def action_for(run_dir: Path, config: StrataConfig, where: str) -> str:
    """start (no directory, or an empty one), restart (a directory without a checkpoint: an
    attempt that never checkpointed), resume (a checkpoint short of learner.max_steps, or no
    report yet) or skip (done: report.md and the final checkpoint). A directory with a checkpoint
    must have been run with the same settings: resuming allows only learner.max_steps to differ."""
    if not run_dir.exists() or (run_dir.is_dir() and not any(run_dir.iterdir())):
        return "start"
    if not run_dir.is_dir():
        raise ConfigError(f"{where}: {run_dir} exists and is not a directory: move it away")
    step = checkpoint_step(run_dir)
    if step is None:
        return "restart"
    changed = changed_settings(run_dir, config, where)
    if changed:
        raise ConfigError(
            f"{where}: {run_dir} was run with other settings ({', '.join(changed)} differ from "
            "its config.yaml): restore them in the experiment file, or move the directory away to rerun"
        )
    done = (run_dir / "report.md").is_file() and step >= config.learner.max_steps
    return "skip" if done else "resume"


def changed_settings(run_dir: Path, config: StrataConfig, where: str) -> list[str]:
    """Dotted keys whose value in `run_dir/config.yaml` differs from `config`'s, apart from those
    `launch --resume` may change."""

    try:
        saved = load_config(run_dir / "config.yaml")
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}: move {run_dir} away to rerun it") from None
    changed = _differences(saved.model_dump(mode="json"), config.model_dump(mode="json"))
    return [k for k in changed if k not in RESUMABLE_CHANGES]


def _differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys at which two nested mappings differ."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [] if old == new else [prefix.rstrip(".")]
    keys = sorted(old.keys() | new.keys())
    return [d for k in keys for d in _differences(old.get(k), new.get(k), f"{prefix}{k}.")]
