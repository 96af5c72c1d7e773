"""`python -m pipeline.replay RUN_DIR`: recompute advantages offline from a run's trajectory files.

Reads every conforming Parquet file under RUN_DIR/trajectories/, keeps the complete prompt groups,
recomputes Stratified GRPO advantages under the α, ε and stratifier you give, prints a per-stratum
table and optionally writes the advantages (`--out`) and a plot against policy version (`--plot`).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
import yaml

from buffers.reader import TrajectoryFileError, read_trajectories
from buffers.strata import STRATIFIERS, make_stratifier
from learner.advantages import stratified_advantages_with_stats
from learner.estimators import ESTIMATORS, estimate
from learner.telemetry import stratum_summary

COLUMNS = [
    "prompt_id",
    "sample_index",
    "reward",
    "stratum",
    "num_tool_calls",
    "tool_names",
    "policy_version",
    "status",
    "consumed_version",
]


class ReplayError(ValueError):
    """A problem the user can fix; one line."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.replay", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "run_dir", help="a run directory (holding trajectories/) or a folder of Parquet files"
    )
    p.add_argument(
        "--alpha",
        type=float,
        help="blend (stratified); default: the run's learner.advantage.alpha, else 0.6",
    )
    p.add_argument(
        "--estimator",
        choices=sorted(ESTIMATORS),
        help="advantage estimator; default: the run's learner.advantage.type, else stratified",
    )
    p.add_argument(
        "--eps",
        type=float,
        help="std stabiliser; default: the run's learner.advantage.eps, else 1e-6",
    )
    p.add_argument(
        "--stratifier",
        choices=["recorded", "tool_calls", "tool_signature", "random"],
        default="recorded",
        help="recorded: the stratum column as written (default); or recompute one",
    )
    p.add_argument("--k", type=int, default=2, help="strata for --stratifier random")
    p.add_argument("--seed", type=int, default=0, help="seed for --stratifier random")
    p.add_argument(
        "--group-size",
        type=int,
        help="default: the run's buffer.group_size, else the largest group",
    )
    p.add_argument("--status", action="append", help="only rows with this status (repeatable)")
    p.add_argument(
        "--out", help="write prompt_id, sample_index, stratum, reward, advantage, ... as Parquet"
    )
    p.add_argument("--plot", help="write a PNG of reward and tool calls against policy version")
    p.add_argument(
        "--skip-bad", action="store_true", help="skip (and list) unreadable or non-conforming files"
    )
    return p


def _run_config(run_dir: Path) -> dict:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return {}
    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ReplayError(f"{path}: invalid YAML ({str(exc).splitlines()[0]})") from None


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """`write` to a file beside `path` (same suffix: a plot's format follows it), then put it in
    place: nothing half-written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def complete_groups(table: pa.Table, group_size: int) -> tuple[pa.Table, int, int]:
    """Rows of groups with exactly `group_size` distinct samples; (table, groups kept, groups skipped)."""
    counts = table.group_by("prompt_id").aggregate(
        [("sample_index", "count_distinct"), ("sample_index", "count")]
    )
    ok = pc.and_(
        pc.equal(counts["sample_index_count_distinct"], group_size),
        pc.equal(counts["sample_index_count"], group_size),
    )
    keep = counts.filter(ok)["prompt_id"]
    rows = table.filter(pc.is_in(table["prompt_id"], value_set=keep))
    return rows, len(keep), counts.num_rows - len(keep)


def _strata(table: pa.Table, args: argparse.Namespace, config: dict) -> torch.Tensor:
    if args.stratifier == "recorded":
        return torch.from_numpy(table["stratum"].to_numpy().astype(np.int64))
    if args.stratifier == "tool_calls":
        return torch.from_numpy(table["num_tool_calls"].to_numpy().astype(np.int64))
    actors = config.get("actors", {})
    given = {"k": args.k, "seed": args.seed}
    stratifier = make_stratifier(
        args.stratifier,
        tools=actors.get("tools", ["search", "python"]),
        max_calls=actors.get("max_turns", 8),
        **{p: given[p] for p in STRATIFIERS[args.stratifier].params},
    )
    if args.stratifier == "random":  # by trajectory key, as the agent loop assigns them
        keys = [
            f"{p}#{i}"
            for p, i in zip(
                table["prompt_id"].to_pylist(), table["sample_index"].to_pylist(), strict=True
            )
        ]
        return torch.from_numpy(stratifier([()] * table.num_rows, keys))
    if table["tool_names"].null_count:
        raise ReplayError(
            "--stratifier tool_signature needs the tool_names column, which these files lack"
        )
    return torch.from_numpy(stratifier(table["tool_names"].to_pylist()))


def _plot(table: pa.Table, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    version = table["policy_version"].to_numpy()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, column, label in [
        (axes[0], "reward", "reward"),
        (axes[1], "num_tool_calls", "tool calls"),
    ]:
        values = table[column].to_numpy().astype(float)
        jitter = np.random.default_rng(0).uniform(-0.15, 0.15, len(values))
        ax.scatter(version + jitter, values, s=6, alpha=0.25, label="trajectory")
        versions = np.unique(version)
        ax.plot(
            versions,
            [values[version == v].mean() for v in versions],
            "o-",
            color="C3",
            label="mean",
        )
        ax.set_xlabel("policy version")
        ax.set_ylabel(f"{label} per trajectory")
        ax.legend(loc="best")
    fig.suptitle(f"{table.num_rows} trajectories")
    fig.tight_layout()
    write_atomically(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)


def _estimator_params(estimator: str, args: argparse.Namespace, learner_cfg: dict) -> dict:
    """The estimator's parameters: --alpha / --eps, else the run's learner.advantage section
    (learner.alpha / learner.eps in runs written before they moved there), else the defaults."""
    section = learner_cfg.get("advantage", {})
    takes = ESTIMATORS[estimator].params
    params = {}
    for name, default in (("alpha", 0.6), ("eps", 1e-6)):
        flag = getattr(args, name)
        if flag is not None and name not in takes:
            raise ReplayError(
                f"--{name} does not act for estimator {estimator} (it takes {', '.join(takes) or 'nothing'})"
            )
        if name in takes:
            params[name] = (
                flag if flag is not None else section.get(name, learner_cfg.get(name, default))
            )
    if not 0 <= params.get("alpha", 0) <= 1 or params.get("eps", 0) < 0:
        raise ReplayError(f"--alpha must lie in [0, 1] and --eps be >= 0 (got {params})")
    return params


def replay(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ReplayError(f"run directory not found: {run_dir}")
    source = run_dir / "trajectories" if (run_dir / "trajectories").is_dir() else run_dir
    config = _run_config(run_dir)
    learner_cfg, buffer_cfg = config.get("learner", {}), config.get("buffer", {})
    estimator = args.estimator or learner_cfg.get("advantage", {}).get("type", "stratified")
    params = _estimator_params(estimator, args, learner_cfg)

    table, bad = read_trajectories(source, COLUMNS, skip_bad=args.skip_bad)
    for error in bad:
        print(f"skipped {error}", file=sys.stderr)
    if args.status:
        table = table.filter(pc.is_in(table["status"], value_set=pa.array(args.status)))
    if table.num_rows == 0:
        raise ReplayError(f"no trajectories under {source}")
    group_size = args.group_size or buffer_cfg.get("group_size")
    if group_size is None:
        group_size = int(
            pc.max(
                table.group_by("prompt_id").aggregate([("prompt_id", "count")])["prompt_id_count"]
            ).as_py()
        )
    table, kept, skipped = complete_groups(table, group_size)
    print(f"{source}: {kept} complete groups of {group_size}, {skipped} incomplete groups skipped")
    if kept == 0:
        raise ReplayError(f"no complete group of {group_size} under {source}")

    rewards = torch.from_numpy(table["reward"].to_numpy().astype(np.float64))
    group_ids = torch.from_numpy(
        table["prompt_id"].dictionary_encode().combine_chunks().indices.to_numpy().astype(np.int64)
    )
    strata = _strata(table, args, config)
    result = stratified_advantages_with_stats(rewards, group_ids, strata)  # the strata's statistics
    chosen = estimate(estimator, rewards, group_ids, strata, **params)

    consumed = table["consumed_version"].to_numpy(zero_copy_only=False).astype(np.float64)
    staleness = np.where(consumed >= 0, consumed - table["policy_version"].to_numpy(), np.nan)
    extra = {
        "mean_staleness": torch.from_numpy(staleness),
        "mean_tool_calls": torch.from_numpy(table["num_tool_calls"].to_numpy().astype(np.float64)),
    }
    summary = stratum_summary(result, rewards, strata, extra, advantages=chosen.advantages)
    given = "".join(f", {name} {value}" for name, value in params.items())
    print(f"estimator {estimator}{given}, stratifier {args.stratifier}")
    header = f"{'stratum':>8} {'count':>8} {'mean reward':>12} {'in-stratum adv var':>19} {'mean staleness':>15} {'mean tool calls':>16}"
    print(header)
    for stratum, row in summary.items():
        print(
            f"{stratum:>8} {int(row['count']):>8} {row['mean_reward']:>12.4f} {row['in_stratum_adv_var']:>19.4f} "
            f"{row['mean_staleness']:>15.2f} {row['mean_tool_calls']:>16.2f}"
        )

    if args.out:
        out = pa.table(
            {
                "prompt_id": table["prompt_id"],
                "sample_index": table["sample_index"],
                "stratum": pa.array(strata.numpy().astype(np.int32)),
                "reward": table["reward"],
                "advantage": pa.array(chosen.advantages.numpy().astype(np.float32)),
                "in_loss": pa.array(chosen.keep.numpy()),
                "policy_version": table["policy_version"],
                "num_tool_calls": table["num_tool_calls"],
                "status": table["status"],
            }
        )
        write_atomically(Path(args.out), lambda tmp: pq.write_table(out, tmp, compression="zstd"))
        print(f"wrote {out.num_rows} rows to {args.out}")
    if args.plot:
        _plot(table, Path(args.plot))
        print(f"wrote {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return replay(args)
    except (ReplayError, TrajectoryFileError) as exc:
        print(f"strata replay: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"strata replay: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
