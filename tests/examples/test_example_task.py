"""The worked plug-in (examples/strata_example_task) as a user installs and trains it.

Its entry points are made visible without installing it: a dist-info written from its
pyproject.toml, on the launched process's PYTHONPATH beside the package (what `pip install -e`
leaves, less the copy). Its MCP server is started by the run as a config names it, with the
package on the server's PYTHONPATH (the SDK passes a server few variables of its own).

The tiny CPU policy has never seen the package's tools (it is warm-started on the mini-GAIA
world's search and python), so the run trains a copy taught by the package's own step
(`strata_example_task.teach`) from the shared warm start of the other end-to-end runs."""

import json
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path

import pyarrow.compute as pc

from buffers.reader import read_trajectories
from pipeline.assets.cache import prepare_assets
from pipeline.config.loader import load_config
from tests.conftest import assert_accounting, child_env

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "strata_example_task"
CONFIG = "examples/strata_example_task/config.yaml"
MCP = (
    f"actors.mcp_servers=[{{name: units, command: [{sys.executable}, -m, "
    "strata_example_task.units_server], tools: [km_to_miles], timeout_s: 30, "
    f"env: {{PYTHONPATH: {EXAMPLE}}}}}]"
)


def installed(tmp_path: Path) -> dict[str, str]:
    """The environment of a process that sees the package as installed: its entry points from
    a dist-info made of pyproject.toml's, the package importable."""
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    info = tmp_path / "site" / f"strata_example_task-{project['version']}.dist-info"
    info.mkdir(parents=True)
    info.joinpath("METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    groups = project["entry-points"]
    info.joinpath("entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in eps.items()) + "\n"
            for group, eps in groups.items()
        )
    )
    return {"PYTHONPATH": f"{info.parent}:{EXAMPLE}"}


def run(*argv: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=child_env() | env,
        timeout=timeout,
    )


def test_the_plug_ins_resolve_by_entry_point_and_by_import_string(tmp_path):
    listed = run(
        "-m", "pipeline.launch", CONFIG, "--list-plugins", env=installed(tmp_path), timeout=120
    )
    assert listed.returncode == 0, listed.stderr[-2000:]
    for name, value in [
        ("lookup", "strata_example_task.tools:lookup"),
        ("atlas", "strata_example_task.reward:score"),
        ("atlas", "strata_example_task.data:load"),
    ]:
        assert f"entry point strata-example-task==0.1.0 ({value})" in listed.stdout, listed.stdout
        assert name in listed.stdout

    # Not installed: the names are refused in one line, the import strings do the same work.
    bare = {"PYTHONPATH": str(EXAMPLE)}
    refused = run("-m", "pipeline.launch", CONFIG, "--dry-run", env=bare, timeout=120)
    assert refused.returncode != 0
    assert (
        refused.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "unknown reward 'atlas'; known: exact_match, f1, gaia, format; plug-ins found "
            "(entry points strata.rewards): none; or give an import string package.module:attr "
            "or path/to/file.py:attr"
        )
    )
    strings = [
        "--set",
        "actors.tools=[strata_example_task.tools:lookup]",
        "--set",
        "actors.reward=strata_example_task.reward:score",
    ]
    dry = run("-m", "pipeline.launch", CONFIG, "--dry-run", *strings, env=bare, timeout=120)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert (
        "# plug-in actors.tools[0]: strata_example_task.tools:lookup (import string)" in dry.stdout
    )


def test_the_example_trains_calls_its_tools_and_balances_its_books(tmp_path, run_cache):
    env = installed(tmp_path)
    cache = f"runtime.cache_dir={run_cache}"
    # The warm start the other end-to-end runs share (configs/local.yaml at 12 epochs), found (or
    # built) here rather than in a process of its own (~10 s of CPU for its imports)
    base = load_config(ROOT / "configs" / "local.yaml", [cache, "model.warm_start_epochs=12"])
    base_policy = prepare_assets(base, quiet=True).policy_dir
    policy = tmp_path / "policy"
    taught = run(
        "-m",
        "strata_example_task.teach",
        CONFIG,
        "--out",
        str(policy),
        "--policy",
        str(base_policy),
        "--set",
        cache,
        "--set",
        MCP,
        env=env,
        timeout=900,
    )
    assert taught.returncode == 0, taught.stderr[-2000:]

    run_dir = tmp_path / "run"
    settings = [
        cache,
        MCP,
        "model.type=hf",
        f"model.path={policy}",
        "model.dtype=float32",
        "learner.max_steps=2",
        "eval.every_steps=0",
        "metrics.port=0",
        "metrics.plots=false",
    ]
    sets = [a for s in settings for a in ("--set", s)]
    proc = run(
        "-m", "pipeline.launch", CONFIG, "--run-dir", str(run_dir), *sets, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step    2/2" in proc.stdout

    table, bad = read_trajectories(
        run_dir / "trajectories", ["tool_names", "reward", "reward_components", "status"]
    )
    assert not bad and table.num_rows
    calls = Counter(name for names in table["tool_names"].to_pylist() for name in names)
    print(f"tool calls per tool: {dict(calls)} over {table.num_rows} trajectories")
    assert calls["lookup"] > 0 and calls["units_km_to_miles"] > 0, calls
    assert set(calls) <= {"lookup", "units_km_to_miles"}
    released = table.filter(pc.equal(table["status"], "released")).to_pylist()
    for row in released:
        parts = dict(row["reward_components"])
        assert set(parts) == {"correct", "looked_up"}  # one reward: its parts, unprefixed
        assert abs(row["reward"] - parts["correct"] - parts["looked_up"]) < 1e-6
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and all("reward/looked_up" in s for s in steps)
    books = assert_accounting(run_dir)
    assert sum(row["generated"] for row in books["per_stratum"].values()) == table.num_rows
    assert (run_dir / "logs" / "mcp-units.log").is_file()
