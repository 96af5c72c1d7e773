"""Read a run's TensorBoard events and offline W&B runs back with each library's own reader, and
hold them against the run's metrics.jsonl and eval.jsonl (pipeline/loggers: the naming scheme)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from pipeline.loggers.base import EVAL_FIELDS


def same(a: float, b: float, rel: float = 0.0) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rel, abs_tol=rel)


def expected_train(steps: list[dict]) -> dict[int, dict[str, float]]:
    """step -> train/<key> -> value: what every logger must hold (bools as 0/1, text left out)."""
    return {
        int(line["step"]): {
            f"train/{k}": float(v) for k, v in line.items() if isinstance(v, int | float)
        }
        for line in steps
    }


def expected_eval(run_dir: Path) -> dict[int, dict[str, float]]:
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    return {
        e["step"]: {
            f"eval/{r['name']}/{'tools' if r['tools'] else 'no_tools'}/{f}": float(r[f])
            for r in e["rows"]
            for f in EVAL_FIELDS
            if r[f] is not None
        }
        for e in evals
    }


def tensorboard_events(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    everything = {"scalars": 0, "images": 0, "tensors": 0}
    return EventAccumulator(str(run_dir / "tensorboard"), size_guidance=everything).Reload()


def wandb_records(run_dir: Path) -> list[tuple[str, list[dict]]]:
    """Each offline W&B run of the run directory (one per process): its id and history rows
    (key -> value; a nested value such as a table as its own dict)."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal.datastore import DataStore

    runs = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        store = DataStore()
        store.open_for_scan(str(path))
        rows, config = [], {}
        while (data := store.scan_data()) is not None:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "history":
                row: dict = {}
                for item in record.history.item:
                    keys = list(item.nested_key) or [item.key]
                    target = row
                    for key in keys[:-1]:
                        target = target.setdefault(key, {})
                    target[keys[-1]] = json.loads(item.value_json)
                rows.append(row)
            elif record.WhichOneof("record_type") == "run":  # the config W&B was started with
                config |= {i.key: json.loads(i.value_json) for i in record.run.config.update}
        runs.append((path.stem.removeprefix("run-"), rows, config))
    return runs


def assert_logged(run_dir: Path, steps: list[dict], eval_steps: list[int]) -> None:
    """TensorBoard and W&B hold each scalar of each metrics.jsonl line at its step (once), each
    evaluation's numbers and table, the config and the report's plots."""
    train, evals = expected_train(steps), expected_eval(run_dir)
    assert sorted(evals) == eval_steps

    events = tensorboard_events(run_dir)
    tags = events.Tags()
    for step, scalars in train.items():
        for tag, value in scalars.items():
            logged = [e.value for e in events.Scalars(tag) if e.step == step]
            assert len(logged) == 1 and same(logged[0], value, 1e-6), (tag, step, logged, value)
    for step, scalars in evals.items():
        for tag, value in scalars.items():
            logged = [e.value for e in events.Scalars(tag) if e.step == step]
            assert len(logged) == 1 and same(logged[0], value, 1e-6), (tag, step, logged, value)
    assert {e.step for e in events.Tensors("eval/table/text_summary")} == set(eval_steps)
    assert [e.step for e in events.Tensors("config/text_summary")] == [0]
    assert "report/reward" in tags["images"]

    runs = wandb_records(run_dir)
    ids = {run_id for run_id, _, _ in runs}
    assert len(runs) == 2 and len(ids) == 1  # two processes, one W&B run
    assert ids == {(run_dir / "wandb_run_id").read_text().strip()}
    rows = [row for _, history, _ in runs for row in history]
    for step, scalars in train.items():
        logged = [row for row in rows if row.get("_step") == step and "train/step" in row]
        assert len(logged) == 1, (step, len(logged))
        for tag, value in scalars.items():
            assert same(float(logged[0][tag]), value), (tag, step)
    for step, scalars in evals.items():
        logged = [row for row in rows if row.get("eval/step") == step]
        assert len(logged) == 1 and logged[0]["eval/table"]["_type"] == "table-file"
        assert all(same(float(logged[0][tag]), value) for tag, value in scalars.items())
    assert any(row.get("report/reward", {}).get("_type") == "image-file" for row in rows)
    config = runs[-1][2]
    assert config["buffer"]["group_size"] == 4 and config["learner"]["max_steps"] == 4
