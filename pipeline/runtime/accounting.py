"""The run's books: where every trajectory went (`accounting.json`), per stratum and in all.

generated = trained + filtered + dropped_stale + abandoned + failed + in_flight, per stratum
(filtered: groups dynamic sampling left out, `learner.dynamic_sampling`). A resumed run's
books are the books kept in the checkpoint it resumed from plus its own (`add_accounting`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from actors.pool import ActorPool
from buffers.group_buffer import BufferStats
from buffers.reader import read_trajectories

PARTS = ("trained", "filtered", "dropped_stale", "abandoned", "failed", "in_flight")
"""What `generated` splits into, per stratum."""


def accounting(stats: BufferStats, pools: Sequence[ActorPool]) -> dict:
    """Where every trajectory went, per stratum and in all, from the buffer's books and the
    pools': generated = trained + filtered + dropped_stale + abandoned + failed + in_flight,
    where trained is what the learner consumed (a step may still skip a group it cannot use,
    counted as `skipped_groups` in metrics.jsonl), filtered what dynamic sampling left out,
    failed a record the buffer rejected, and in_flight what the buffer still held. Trajectories whose
    generation failed (`aborted`: engine errors, generations the server cut off) never got a
    stratum: they are counted in all only."""
    per_stratum = {
        int(s): {
            "generated": c["put"] + c["rejected"],
            "trained": c["released"],
            "filtered": c["filtered"],
            "dropped_stale": c["dropped_stale"],
            "abandoned": c["abandoned"],
            "failed": c["rejected"],
            "in_flight": c["pending"],
        }
        for s, c in stats.per_stratum.items()
    }
    total = {k: sum(row[k] for row in per_stratum.values()) for k in ("generated", *PARTS)}
    total["aborted"] = sum(p.stats.aborted for p in pools)
    return {"per_stratum": per_stratum, "total": total}


def read_accounting(run_dir: Path) -> dict:
    path = run_dir / "accounting.json"
    return json.loads(path.read_text()) if path.is_file() else {"per_stratum": {}, "total": {}}


def add_accounting(earlier: dict, now: dict) -> dict:
    """Two processes' books of one run, added up (a resumed run); `{}` is no books."""
    per_stratum: dict = {}
    for books in (earlier, now):
        for stratum, row in books.get("per_stratum", {}).items():
            into = per_stratum.setdefault(int(stratum), {})
            for key, value in row.items():
                into[key] = into.get(key, 0) + value
    before, after = earlier.get("total", {}), now.get("total", {})
    total = {k: before.get(k, 0) + after.get(k, 0) for k in before.keys() | after.keys()}
    return {"per_stratum": per_stratum, "total": total}


SPILLED_AS = {
    "trained": "released",
    "filtered": "filtered",
    "dropped_stale": "dropped_stale",
    "abandoned": "abandoned",
    "in_flight": "pending",
}
"""The spill status of each kind of trajectory the books count (`failed` ones are not spilled)."""


def audit(run_dir: Path) -> list[str]:
    """What is wrong with a finished run's books (empty: they balance): per stratum, generated =
    trained + filtered + dropped_stale + abandoned + failed + in_flight in accounting.json, and the Parquet
    spill holds exactly as many rows of each status per stratum, in files that all read."""

    path = Path(run_dir) / "accounting.json"
    if not path.is_file():
        return [f"{path}: missing"]
    books = json.loads(path.read_text())
    table, bad = read_trajectories(Path(run_dir) / "trajectories", ["stratum", "status"])
    problems = [f"unreadable spill file {b}" for b in bad]
    spilled = Counter(zip(table["stratum"].to_pylist(), table["status"].to_pylist(), strict=True))
    if not books["per_stratum"]:
        problems.append("no trajectory was accounted for")
    for stratum, row in books["per_stratum"].items():
        parts = sum(row.get(k, 0) for k in PARTS)  # books from before `filtered` lack it
        if row["generated"] != parts:
            problems.append(
                f"stratum {stratum}: generated {row['generated']} != {parts}, the sum of its parts ({row})"
            )
        for key, status in SPILLED_AS.items():
            if spilled[int(stratum), status] != row.get(key, 0):
                problems.append(
                    f"stratum {stratum}: {row.get(key, 0)} {key} in the books, {spilled[int(stratum), status]} rows {status!r} in the spill"
                )
    expected = sum(row["generated"] - row["failed"] for row in books["per_stratum"].values())
    if sum(spilled.values()) != expected:
        problems.append(f"the spill holds {sum(spilled.values())} rows, the books {expected}")
    return problems


def write_json(path: Path, data: dict) -> None:
    """`path` whole or not at all (a temporary name, then a rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
