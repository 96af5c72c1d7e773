"""The streaming loop with the real buffer, pools and admission; the learner and the agent are
the fakes of `pipeline.runtime.fakes` (a step sleeps; a trajectory takes longer the more tools it calls)."""

import asyncio
import itertools
import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from actors.pool import ActorPool
from buffers.group_buffer import GroupBuffer
from pipeline.config.schema import BufferConfig, LearnerConfig, StrataConfig
from pipeline.runtime.fakes import SimulatedAgent, SimulatedEngine, SimulatedRoles, SimulatedTask
from pipeline.runtime.parts import make_buffer
from pipeline.runtime.stream import RunSummary, stream
from tests.conftest import assert_accounting, child_env


class Hanging(SimulatedAgent):
    """Sample 0 of every fifth prompt never finishes (a stuck tool): its group can only time out."""

    async def run(self, task, prompt_id, sample_index):
        if sample_index == 0 and int(task.id) % 5 == 0:
            await asyncio.sleep(3600)
        return await super().run(task, prompt_id, sample_index)


def simulate(
    tmp_path,
    *,
    eta,
    steps,
    pools=2,
    groups_per_step=2,
    group_size=4,
    empty=(),
    agent=SimulatedAgent,
    timeout_s=None,
    concurrency=8,
    per_call_s=0.02,
    due_first=True,
):
    config = StrataConfig(
        buffer=BufferConfig(group_size=group_size, max_staleness=eta, group_timeout_s=timeout_s),
        learner=LearnerConfig(groups_per_step=groups_per_step, max_steps=steps),
    )
    engine = SimulatedEngine()
    roles = SimulatedRoles(engine, step_s=0.02, empty=set(empty))
    buffer = GroupBuffer(
        group_size=group_size,
        max_staleness=eta,
        groups_per_step=groups_per_step,
        group_timeout_s=timeout_s,
        due_first=due_first,
    )
    tasks = (SimulatedTask(str(i)) for i in itertools.count())
    actors = [
        ActorPool(
            agent(engine, per_call_s=per_call_s, actor_id=f"pool-{i}"),
            buffer,
            tasks,
            group_size=group_size,
            concurrency=concurrency,
            name=f"pool-{i}",
        )
        for i in range(pools)
    ]
    summary = RunSummary()
    coro = stream(config, roles, buffer, actors, tmp_path, summary)
    asyncio.run(asyncio.wait_for(coro, 120))  # a hang fails the test instead of the suite
    return summary, roles, buffer


def test_a_step_with_no_usable_group_trains_and_publishes_nothing_and_the_run_goes_on(tmp_path):
    summary, roles, _ = simulate(tmp_path, eta=0, steps=3, empty={0, 2})
    assert summary.steps == 3 and summary.empty_steps == 2
    assert roles.published == [1, 2, 3]  # never the same version twice
    assert_accounting_books(summary)


def test_eta_zero_with_two_pools_and_timed_out_groups_finishes(tmp_path):
    """With η = 0 every place is needed for the next step: one group that times out and keeps
    its place would stop admission for good."""
    summary, _, buffer = simulate(tmp_path, eta=0, steps=6, agent=Hanging, timeout_s=0.5)
    stats = buffer.stats()
    assert summary.steps == 6 and stats.abandoned_groups >= 1
    assert stats.dropped_stale == 0  # η = 0 and yet nothing was too stale
    assert_accounting_books(summary)


def shares(summary) -> dict[int, float]:
    """Per stratum: its share of the trained trajectories over its share of those generated."""
    books = summary.accounting["per_stratum"]
    left = {s: r["trained"] + r["dropped_stale"] + r["abandoned"] for s, r in books.items()}
    trained = sum(r["trained"] for r in books.values())
    return {
        int(s): (r["trained"] / trained) / (left[s] / sum(left.values())) for s, r in books.items()
    }


@pytest.mark.parametrize("eta", [1, 2])
def test_no_stratum_is_starved_under_staleness(tmp_path, eta):
    """Trajectories with more tool calls take longer. Per stratum, the share of the trained
    trajectories is within 5% (relative) of its share of those generated, and nothing is too
    stale; first-complete-first-out alone, on the same workload, starves the slowest stratum."""
    summary, _, buffer = simulate(tmp_path, eta=eta, steps=40, groups_per_step=4, concurrency=16)
    assert summary.steps == 40 and buffer.stats().dropped_stale == 0
    assert min(shares(summary).values()) >= 0.95, shares(summary)

    (tmp_path / "fifo").mkdir()
    fifo, _, buffer = simulate(
        tmp_path / "fifo", eta=eta, steps=40, groups_per_step=4, concurrency=16, due_first=False
    )
    assert buffer.stats().dropped_stale > 0 and shares(fifo)[3] < 0.95, shares(fifo)


def assert_accounting_books(summary):
    for row in summary.accounting["per_stratum"].values():
        parts = ("trained", "dropped_stale", "abandoned", "failed", "in_flight")
        assert row["generated"] == sum(row[k] for k in parts)


def spilled(tmp_path, max_steps: int):
    """(config, engine, buffer spilling into `tmp_path`, one pool) of a run of `max_steps`."""
    config = StrataConfig(
        buffer=BufferConfig(group_size=4, max_staleness=1),
        learner=LearnerConfig(groups_per_step=2, max_steps=max_steps),
    )
    engine = SimulatedEngine()
    buffer = make_buffer(config.buffer, tmp_path, 2)
    tasks = (SimulatedTask(str(i)) for i in itertools.count())
    pool = ActorPool(SimulatedAgent(engine), buffer, tasks, group_size=4, concurrency=8)
    return config, engine, buffer, pool


def test_the_run_dir_books_agree_with_the_spill(tmp_path):
    config, engine, buffer, pool = spilled(tmp_path, 4)
    summary = RunSummary()
    asyncio.run(
        asyncio.wait_for(
            stream(config, SimulatedRoles(engine), buffer, [pool], tmp_path, summary), 120
        )
    )
    assert summary.steps == 4
    assert_accounting(tmp_path)


class StoppedInStep(SimulatedRoles):
    """Stops the run (cancels the task running the loop, as SIGTERM does) while step `at`
    trains, and records the steps that checkpoints were taken at."""

    def __init__(self, engine, at: int, task: asyncio.Task):
        super().__init__(engine, step_s=0.05)
        self.at, self.task, self.checkpoints = at, task, []

    async def step(self, groups):
        if self.calls + 1 == self.at:
            self.task.cancel()
        return await super().step(groups)

    async def checkpoint(self, directory, extra):
        self.checkpoints.append(extra["step"])
        return directory


@pytest.mark.parametrize("at", [1, 3])
def test_a_stop_during_a_step_lets_it_train_and_records_it_before_stopping(tmp_path, at):
    """The step under way trains whole (its version is the checkpoint's), is published and gets
    its metrics line like any other; no step starts after it; the books balance."""
    config, engine, buffer, pool = spilled(tmp_path, 100)
    summary, roles = RunSummary(), None

    async def run():
        nonlocal roles
        roles = StoppedInStep(engine, at, asyncio.current_task())
        await stream(config, roles, buffer, [pool], tmp_path, summary)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(run())
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["version"] for line in lines] == [float(v) for v in range(1, at + 1)]
    assert roles.calls == at and roles.published == list(range(1, at + 1))
    assert summary.steps == at and roles.checkpoints == [at]
    assert_accounting(tmp_path)


# A run as `pipeline.runtime.run` stops it (its SIGTERM handler, its exit), the learner side the
# fake of pipeline.runtime.fakes: its checkpoints are written as learner/checkpoint.py writes
# them (whole, then `latest`), and its publish of version HANG never returns (a server that stops
# answering, in a thread, as a blocking weight update is). Nothing is built: no assets, no loggers.
HUNG_PUBLISH_RUN = textwrap.dedent(
    """
    import asyncio, itertools, json, os, sys, time
    from pathlib import Path

    from actors.pool import ActorPool
    from pipeline.config.schema import BufferConfig, LearnerConfig, MetricsConfig, StrataConfig
    from pipeline.runtime import run, stream
    from pipeline.runtime.fakes import SimulatedAgent, SimulatedEngine, SimulatedRoles, SimulatedTask
    from pipeline.runtime.parts import make_buffer

    run_dir, hang, stream.STOP_WAIT_S = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])

    class HungPublish(SimulatedRoles):
        async def publish(self):
            if self.version == hang:
                print(f"publishing {hang}", flush=True)
                await asyncio.to_thread(time.sleep, 3600)
            return await super().publish()

        async def checkpoint(self, directory, extra):
            target = directory / f"step-{extra['step']:06d}"
            target.mkdir(parents=True)
            (target / "learner.json").write_text(json.dumps({"version": self.version}))
            (directory / ".latest.tmp").write_text(target.name + "\\n")
            os.replace(directory / ".latest.tmp", directory / "latest")
            return target

    async def runner(config, assets, run_dir, progress, summary, resume=False, loggers=None):
        engine = SimulatedEngine()
        buffer = make_buffer(config.buffer, run_dir, config.learner.groups_per_step)
        tasks = (SimulatedTask(str(i)) for i in itertools.count())
        pool = ActorPool(SimulatedAgent(engine), buffer, tasks, group_size=4, concurrency=8)
        roles = HungPublish(engine, step_s=0.02)
        return await stream.stream(config, roles, buffer, [pool], run_dir, summary, progress)

    run.RUNNERS["local"] = runner
    run.prepare_assets = lambda config: None
    config = StrataConfig(
        buffer=BufferConfig(group_size=4, max_staleness=1),
        learner=LearnerConfig(groups_per_step=2, max_steps=100, checkpoint_every=2),
        metrics=MetricsConfig(loggers=[]),
    )
    sys.exit(run.run(config, "config.yaml", run_dir))
    """
)


def test_a_stop_waits_for_a_hung_publish_only_so_long_and_keeps_what_was_committed(tmp_path):
    """SIGTERM while the publish of version 5 hangs: after STOP_WAIT_S the run exits non-zero
    with one line naming the publish and the checkpoint it leaves (step 4's, written before),
    which is untouched, as are the metrics lines of steps 1 to 4."""
    run_dir, wait_s = tmp_path / "run", 3.0
    run_dir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", HUNG_PUBLISH_RUN, str(run_dir), "5", str(wait_s)],
        cwd=Path(__file__).resolve().parents[2],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stdout:
            if line.startswith("publishing 5"):
                break
        else:
            pytest.fail(f"the run ended before the publish of version 5: {proc.stderr.read()}")
        checkpoint = (run_dir / "checkpoints" / "step-000004" / "learner.json").read_bytes()
        stopped = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=wait_s + 20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"SIGTERM during a hung publish: still running {wait_s + 20:g} s later")
        took = time.monotonic() - stopped
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert proc.returncode == 1, err
    assert wait_s <= took < wait_s + 20
    assert err.count("\n") == 1, err
    assert err.startswith(
        "strata: stop: the publish of version 5 did not finish in 3 s; exiting — checkpoint "
        "step 4 (checkpoints/step-000004) is intact: go on with --resume --run-dir "
    ), err
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-000004\n"
    assert (run_dir / "checkpoints" / "step-000004" / "learner.json").read_bytes() == checkpoint
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-000002", "step-000004"]
    assert not list(checkpoints.rglob("*000005*"))  # nothing of step 5 was checkpointed
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]
