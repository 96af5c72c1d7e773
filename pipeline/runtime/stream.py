"""The streaming loop both runtimes share: the learner takes each complete group as it comes.

A runtime builds the roles (`Roles`: the learner and what publishes its weights, wherever they
live), the group buffer and the actor pools, and hands them to `stream`, which runs until
`learner.max_steps`: a step's groups in (due groups first, see `buffers.group_buffer`), one
learner step (the pools keep generating meanwhile), weights out, the buffer told which version
the engines now serve (which frees the admission places of the groups trained into it), metrics
and checkpoints written. A step none of whose groups is usable trains and publishes nothing: it
is counted (`empty_steps`) and its groups' places come back at once. The run directory gets
`metrics.jsonl` (one line per step) and `checkpoints/`; on a resumed run both continue.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from actors.pool import ActorPool
from actors.tools import ToolStats
from buffers.group_buffer import BufferStats, GroupBuffer
from buffers.records import Group
from pipeline.assets.datasets import (
    DatasetError,
    check_row_tools,
    drop_long_prompts,
    load_questions,
    load_world,
)
from pipeline.backends.runtime import RuntimeUnavailable
from pipeline.config.schema import StrataConfig
from pipeline.loggers import Loggers, StepRecord
from pipeline.runtime.accounting import accounting, add_accounting, write_json
from pipeline.runtime.recovery import save_run_checkpoint

if TYPE_CHECKING:
    from pipeline.runtime.roles import Roles

CURSOR_KEY = "tasks_started"
"""Checkpoint field: tasks the pools had started, so a resumed run goes on with the next ones."""
STOP_WAIT_S = 300.0
"""After a stop (SIGTERM, Ctrl-C), how long the learner step under way may still take to train,
publish and be recorded before it is given up (`StopDeadline`): a 7B step and its publish fit in
it; a server that stopped answering would otherwise hold the stop for good."""


class StopDeadline(Exception):
    """The step under way at a stop did not end within STOP_WAIT_S. It is given up, not
    checkpointed: the last checkpoint and the metrics.jsonl lines written stay as they are."""

    def __init__(self, waited_on: str, seconds: float) -> None:
        super().__init__(f"stop: {waited_on} did not finish in {seconds:g} s")


@dataclass
class RunSummary:
    steps: int = 0
    """The learner's step count at the end (on a resumed run, including the steps before)."""
    trajectories: int = 0
    seconds: float = 0.0
    learner_busy_s: float = 0.0
    learner_idle_s: float = 0.0
    metrics: list[dict] = field(default_factory=list)
    checkpoint: Path | None = None
    resumed_from: int = 0
    """Step of the checkpoint this run resumed from (0: a fresh run)."""
    books_before: dict = field(default_factory=dict)
    """The books (`pipeline.runtime.accounting`) of the processes before this one, from the checkpoint it
    resumed from; empty for a fresh run."""
    actor_restarts: int = 0
    retrieval_restarts: int = 0
    """Times the retrieval server (a Ray actor) was started again after it died."""
    skipped_prompts: int = 0
    """Training questions whose prompt was longer than data.max_prompt_tokens (never asked)."""
    empty_steps: int = 0
    """Steps whose groups were all unusable (e.g. zero variance): nothing trained or published."""
    accounting: dict = field(default_factory=dict)
    """The run's trajectory accounting at the end (`accounting()`)."""

    @property
    def busy_fraction(self) -> float:
        return self.learner_busy_s / max(self.seconds, 1e-9)


@dataclass
class ActorStats:
    """What the metrics read off one generation actor (an engine and the loops that use it)."""

    version: int
    generated_tokens: int
    tools: ToolStats
    server_rejoins: int = 0
    """Times one of its inference servers came back after failing (reloaded, readmitted)."""
    reward_errors: int = 0
    """Reward terms that raised, timed out or gave no number (each scored 0), in its loops."""
    mcp_restarts: dict[str, int] = field(default_factory=dict)
    """Times each of its MCP servers (by name) was started again after it died."""
    agent_failures: dict[str, int] = field(default_factory=dict)
    """Trajectories its custom or openai agents lost, by kind (actors.agent.AGENT_FAILURES)."""
    agent_rewrites: int = 0
    """Times those agents rewrote their history (new segments) in the trajectories delivered."""


def tool_fault_metrics(actors: dict[str, ActorStats]) -> dict[str, int]:
    """metrics.jsonl's tool faults, summed over the actors since they started: calls whose
    arguments did not fit the tool's schema (`tool_bad_calls`), per-trajectory states whose
    release raised (`tool_release_errors`), MCP servers started again after dying
    (`mcp_restarts`), each also per tool or server name where there was one
    (`tool_bad_calls/<tool>` ...)."""
    counts = {
        "tool_bad_calls": Counter(),
        "tool_release_errors": Counter(),
        "mcp_restarts": Counter(),
    }
    for actor in actors.values():
        counts["tool_bad_calls"].update(actor.tools.bad_calls)
        counts["tool_release_errors"].update(actor.tools.release_errors)
        counts["mcp_restarts"].update(actor.mcp_restarts)
    out = {key: sum(by_name.values()) for key, by_name in counts.items()}
    for key, by_name in counts.items():
        out.update({f"{key}/{name}": n for name, n in sorted(by_name.items()) if n})
    return out


def agent_metrics(actors: dict[str, ActorStats]) -> dict[str, int]:
    """metrics.jsonl's figures of custom and openai agents (actors.agent), summed over the
    actors since they started: trajectories lost (`agent_failures`, and
    `agent_failures/<kind>` for each kind there was: raised, timeout, exit, rewritten, invalid)
    and rewrites of an agent's history in the trajectories delivered (`agent_rewrites`)."""
    failures: Counter = Counter()
    for actor in actors.values():
        failures.update(actor.agent_failures)
    out = {
        "agent_failures": sum(failures.values()),
        "agent_rewrites": sum(a.agent_rewrites for a in actors.values()),
    }
    out.update({f"agent_failures/{kind}": n for kind, n in sorted(failures.items()) if n})
    return out


def question_stream(
    config: StrataConfig, world_dir: Path, tokenizer: Any, skip: int = 0
) -> tuple[Iterator, int]:
    """The run's training questions forever (`task_stream`): the first `data.num_questions` of
    the world's training split (mini_gaia) or of `data.train_files`, less those whose prompt is longer than `data.max_prompt_tokens`
    (skipped, and how many is returned and said in one line). RuntimeUnavailable if none fits."""
    try:
        if config.data.type == "mini_gaia":
            train = load_world(world_dir)[0]
        else:  # in the order given, each file as data.type (and data.fields) reads it
            train = []
            for path in config.data.train_files:
                read = load_questions(path, config.data)
                check_row_tools(read, config.actors.tool_names, path)
                train += read
    except DatasetError as exc:
        raise RuntimeUnavailable(f"data.train_files: {exc}") from None
    questions = train[: config.data.num_questions]
    kept, skipped = drop_long_prompts(
        questions, tokenizer, config.actors.tool_names, config.data.max_prompt_tokens
    )
    if not kept:
        raise RuntimeUnavailable(
            f"none of the {len(questions)} training questions fits data.max_prompt_tokens "
            f"{config.data.max_prompt_tokens} (instruction and chat template included): raise it"
        )
    if skipped:
        print(
            f"strata: skipped {skipped} of {len(questions)} training questions: their prompt is "
            f"longer than data.max_prompt_tokens {config.data.max_prompt_tokens}",
            flush=True,
        )
    return task_stream(kept, config.data.seed, config.data.shuffle, skip), skipped


def task_stream(questions: Sequence, seed: int, shuffle: bool, skip: int = 0) -> Iterator:
    """Questions forever, reshuffled each epoch with a seeded generator; the first `skip` are
    passed over (a resumed run continues where the checkpoint's pools had got to)."""

    def forever():
        rng = random.Random(seed)
        for _ in itertools.count():
            order = list(questions)
            if shuffle:
                rng.shuffle(order)
            yield from order

    return itertools.islice(forever(), skip, None)


async def _next_groups(buffer: GroupBuffer, version: int, count: int, pools: list[asyncio.Task]):
    """The buffer's next `count` groups; a pool that has failed raises its error instead (no
    group would ever come)."""

    def raise_failure(tasks) -> None:
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()

    raise_failure(pools)
    getting = asyncio.ensure_future(buffer.next_groups(version, count))
    watched = [task for task in pools if not task.done()]
    try:
        while True:
            done, _ = await asyncio.wait([getting, *watched], return_when=asyncio.FIRST_COMPLETED)
            if getting in done:
                return getting.result()
            raise_failure(done)
            watched = [task for task in watched if not task.done()]  # finished: out of tasks
    finally:
        if not getting.done():
            getting.cancel()


async def stream(
    config: StrataConfig,
    roles: Roles,
    buffer: GroupBuffer,
    pools: list[ActorPool],
    run_dir: Path,
    summary: RunSummary,
    progress: Callable[[dict], None] | None = None,
    loggers: Loggers | None = None,
    tasks_started: Callable[[], int] = lambda: 0,
    evaluator: Any = None,
    bounded_stop: bool = True,
) -> RunSummary:
    """Train until `learner.max_steps`; `summary` is filled in place, so the caller still has it
    when the run is interrupted. Checkpoints go to run_dir/checkpoints, also on the way out.
    `evaluator` (a pipeline.evaluation.heldout.PeriodicEval) evaluates the starting weights (step 0, unless
    resumed) and those of the steps it is due at. `bounded_stop`: a stop waits for the step under
    way at most STOP_WAIT_S, then raises StopDeadline with no checkpoint taken (False: as long as
    it takes, for a simulated run on a virtual clock, where nothing hangs)."""
    clock = asyncio.get_running_loop().time  # monotonic; a simulated run's own (virtual) time
    buffer.serve(roles.version)  # the engines serve the learner's weights from the start
    pool_tasks = [asyncio.create_task(pool.run()) for pool in pools]
    metrics_file = (run_dir / "metrics.jsonl").open("a")
    start = clock()
    trained = 0  # trajectories trained in this process (throughput counts only these)
    tokens_at_start = sum(s.generated_tokens for s in (await roles.actor_stats()).values())
    summary.steps = roles.version
    if loggers is not None:
        loggers.begin(roles.version)
    if evaluator is not None and roles.version == 0:  # the starting policy: what training adds
        evaluator.start(0, 0)

    doing = ["the learner step"]  # what a stop waits on, as its deadline's line names it

    async def one_step(groups: list[Group], waited: float) -> dict | None:
        """Train on `groups`, publish, record: the step's metrics (None: nothing trained)."""
        nonlocal trained
        busy = clock()
        summary.learner_idle_s += busy - waited
        doing[0] = f"the learner step toward version {roles.version + 1}"
        metrics = await roles.step(groups)  # the pools keep generating meanwhile
        summary.learner_busy_s += clock() - busy
        if not metrics.get("groups"):  # nothing usable: nothing trained, nothing published
            buffer.trained(groups, None)
            summary.empty_steps += 1
            if math.log10(summary.empty_steps).is_integer():  # the 1st, 10th, 100th, ...
                print(
                    f"strata: {summary.empty_steps} step(s) so far had no usable group (e.g. "
                    f"all rewards equal): nothing trained or published",
                    flush=True,
                )
            return None
        doing[0] = f"the publish of version {roles.version}"
        published = await roles.publish()
        metrics.update(published)
        # A failed publish frees the places at once: waiting for a version an engine may never
        # serve would hang the run. What an engine that kept older weights generates is
        # dropped as stale at consumption, and counted.
        buffer.trained(groups, roles.version if published["published"] else None)
        buffer.serve(published["served_version"])
        summary.steps = roles.version
        trained += sum(g.size for g in groups)
        summary.trajectories += sum(g.size for g in groups)
        elapsed = clock() - start
        stats = buffer.stats()
        doing[0] = f"the record of step {summary.steps}"
        actors = await roles.actor_stats()
        tokens = sum(s.generated_tokens for s in actors.values()) - tokens_at_start
        metrics.update(
            step=summary.steps,
            elapsed_s=elapsed,
            trajectories_per_s=trained / elapsed,
            generated_tokens_per_s=max(tokens, 0) / elapsed,
            buffer_ready=stats.ready_groups,
            buffer_open=stats.open_groups,
            dropped_stale=stats.dropped_stale,
            filtered=stats.filtered,
            filtered_groups=stats.filtered_groups,
            abandoned=stats.abandoned,
            abandoned_groups=stats.abandoned_groups,
            empty_steps=summary.empty_steps,
            skipped_prompts=summary.skipped_prompts,
            aborted=sum(p.stats.aborted for p in pools),
            server_rejoins=sum(a.server_rejoins for a in actors.values()),
            reward_errors=sum(a.reward_errors for a in actors.values()),
        )
        metrics.update(tool_fault_metrics(actors))
        metrics.update(agent_metrics(actors))
        metrics.update(fairness_metrics(stats))
        metrics_file.write(json.dumps(metrics) + "\n")
        metrics_file.flush()
        if loggers is not None:
            members = [t for g in groups for t in g.members]
            loggers.log_step(StepRecord(metrics, members, busy - waited, stats, actors))
        summary.metrics.append(metrics)
        if progress is not None:
            progress(metrics)
        return metrics

    finished = given_up = False
    wait_s = STOP_WAIT_S if bounded_stop else None
    try:
        while roles.version < config.learner.max_steps:
            waited = clock()
            groups = await _next_groups(
                buffer, roles.version, config.learner.groups_per_step, pool_tasks
            )
            # A stop asked during the step lets it end and be recorded (a step's training,
            # publish and metrics line go together), then stops the loop; the way out
            # checkpoints it. One that outlasts the stop's wait is given up whole: nothing of
            # it is checkpointed.
            try:
                recorded = await unstoppable(one_step(groups, waited), wait_s, lambda: doing[0])
            except StopDeadline:
                given_up = True
                raise
            if stop_asked():
                raise asyncio.CancelledError
            if recorded is None:
                continue
            every = config.learner.checkpoint_every
            if every and summary.steps % every == 0:
                extra = {"step": summary.steps, CURSOR_KEY: tasks_started()}
                await save_run_checkpoint(
                    roles, buffer, pools, run_dir, extra, summary.books_before
                )
            if evaluator is not None and evaluator.due(summary.steps):
                evaluator.start(summary.steps, roles.version)  # runs beside the next steps
        finished = True
    finally:
        summary.seconds = clock() - start
        metrics_file.close()
        for task in pool_tasks:
            task.cancel()
        await asyncio.gather(*pool_tasks, return_exceptions=True)
        if evaluator is not None:  # a finished run waits for its last evaluation
            await evaluator.close(wait=finished)
        # The books of the run so far: its spill holds every process's rows.
        summary.accounting = add_accounting(
            summary.books_before, accounting(await buffer.close(), pools)
        )
        write_json(run_dir / "accounting.json", summary.accounting)
        if not given_up:  # a step the stop let finish counts
            summary.steps = max(summary.steps, roles.version)
        if summary.steps > summary.resumed_from and not given_up:
            extra = {"step": summary.steps, CURSOR_KEY: tasks_started()}
            summary.checkpoint = await save_run_checkpoint(
                roles, buffer, pools, run_dir, extra, summary.books_before
            )
    return summary


T = TypeVar("T")


async def unstoppable(
    work: Coroutine[Any, Any, T],
    wait_s: float | None = None,
    waiting_on: Callable[[], str] = lambda: "the step under way",
) -> T:
    """`work` run to its end even when the task awaiting it is cancelled meanwhile (the run asked
    to stop): its result is returned, and the caller sees the stop with `stop_asked`. With
    `wait_s`, the first stop gives it that many seconds more: past them it is cancelled (a thread
    it waits on runs on, its result unread) and StopDeadline names `waiting_on()` then."""
    future = asyncio.ensure_future(work)
    loop = asyncio.get_running_loop()
    deadline = None
    while True:
        try:
            if deadline is None:
                return await asyncio.shield(future)
            await asyncio.wait([future], timeout=max(deadline - loop.time(), 0))
            if future.done():
                return future.result()
            waited_on = waiting_on()
            future.cancel()
            raise StopDeadline(waited_on, wait_s)
        except asyncio.CancelledError:
            if future.cancelled():  # the work itself was cancelled, not its caller
                raise
            if wait_s is not None and deadline is None:
                deadline = loop.time() + wait_s


def stop_asked() -> bool:
    """Whether this task was cancelled while `unstoppable` work let it wait."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def fairness_metrics(stats: BufferStats) -> dict[str, float]:
    """Per stratum, its share of the trajectories trained and of those generated (every finished
    trajectory that left the buffer: trained, dropped as stale or abandoned). Staleness that
    starves a stratum shows as a trained share below its generated share."""
    left = {
        s: c["released"] + c["dropped_stale"] + c["abandoned"] for s, c in stats.per_stratum.items()
    }
    generated, trained = sum(left.values()), stats.released
    out: dict[str, float] = {}
    for stratum, row in stats.per_stratum.items():
        if left[stratum]:
            out[f"stratum/{stratum}/generated_share"] = left[stratum] / max(generated, 1)
            out[f"stratum/{stratum}/trained_share"] = row["released"] / max(trained, 1)
    return out
