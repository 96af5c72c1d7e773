"""A simulated run (`actors.engine.type: simulated`): the real streaming loop, group buffer,
admission, actor pools and agent loops over simulated GPU servers, tools and learner, on a
virtual clock.

`simulate(config, run_dir)` builds the parts from the config and runs `pipeline.runtime.stream.stream`
unchanged under `pipeline.runtime.virtual_time`: the servers (`actors.simulated`) decode on a GPU timing
model, tools sleep a drawn latency, and the learner step sleeps `train_step_s + train_s_per_token
x tokens / learner_ranks` and then publishes (every server loads `params_b x 2 / sync_gb_per_s`
seconds). Nothing is trained: rewards, losses and the model do not matter here, only when each
trajectory is generated, admitted, trained or dropped, and how long everyone waited. The run
directory gets what a run's does (the Parquet spill, metrics.jsonl, accounting.json) plus
`simulation.json`: the figures `benchmarks/cluster_sim.py` compares.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from actors.agent import AgentLoop
from actors.formats import CORRECTION, PYTHON_INSTRUCTION, SEARCH_INSTRUCTION
from actors.pool import ActorPool
from actors.simulated import GpuModel, SimulatedEngine, SimulatedServer, SimulatedTool, Workload
from actors.tools import ToolStats
from buffers.records import Group
from pipeline.assets.datasets import Question
from pipeline.assets.tiny_policy import train_tokenizer
from pipeline.backends.simulated import SimulatedEngine as SimulatedConfig
from pipeline.config.schema import StrataConfig
from pipeline.loggers import LoggerError, Loggers, open_loggers
from pipeline.runtime import virtual_time
from pipeline.runtime.accounting import write_json
from pipeline.runtime.parts import agent_settings, make_buffer
from pipeline.runtime.roles import Roles
from pipeline.runtime.stream import ActorStats, RunSummary, stream, task_stream


def sim_tokenizer():
    """A small byte-level BPE tokenizer with the agent's tags (trained here, in about a second),
    in which the simulated filler words are one token each (the agent loop's cost per token is
    then what it is for a real model's tokens)."""

    texts = [SEARCH_INSTRUCTION + PYTHON_INSTRUCTION, CORRECTION] * 20
    return train_tokenizer(texts + [" word passage simulated query"] * 200, vocab_size=1000)


def sim_questions(count: int = 1000) -> list[Question]:
    return [
        Question(f"sim-{i}", f"Simulated question {i}?", ("simulated",), "sim")
        for i in range(count)
    ]


class SimulatedRoles(Roles):
    """The learner as a timing model: a step sleeps for its tokens, a publish for every server's
    load (in simulated seconds, so it measures its publish itself). It records the staleness of
    every trajectory it trains."""

    def __init__(
        self, sim: SimulatedConfig, engine: SimulatedEngine, agents: list[AgentLoop]
    ) -> None:
        super().__init__()
        self.sim, self.engine, self.agents = sim, engine, agents
        self._version = 0
        self.staleness: Counter = Counter()  # learner version - oldest token version -> count
        self.busy_s = 0.0
        self.sync_s = 0.0

    @property
    def version(self) -> int:
        return self._version

    async def step(self, groups: list[Group]) -> dict:
        members = [t for g in groups for t in g.members]
        tokens = sum(len(t.prompt_token_ids) + len(t.token_ids) for t in members)
        for t in members:
            sampled = [v for v in t.token_versions if v >= 0]
            self.staleness[int(self._version - min(sampled, default=self._version))] += 1
        seconds = (
            self.sim.train_step_s + self.sim.train_s_per_token * tokens / self.sim.learner_ranks
        )
        await asyncio.sleep(seconds)
        self.busy_s += seconds
        self._version += 1
        calls = [len(t.tool_names) for t in members]
        return {
            "groups": len(groups),
            "trained_tokens": tokens,
            "step_seconds": seconds,
            "reward_mean": sum(t.reward for t in members) / max(len(members), 1),
            "tool_calls_mean": sum(calls) / max(len(calls), 1),
        }

    async def publish(self) -> dict:
        clock = asyncio.get_running_loop().time
        began = clock()
        await self.engine.update_weights(self._version)
        took = clock() - began
        self.sync_s += took
        return {
            "published": True,
            "weight_sync_seconds": took,
            "served_version": self._version,
            "served_version_min": self._version,
            "weight_sync_failures": 0,
        }

    async def checkpoint(self, directory: Path, extra: dict) -> Path:
        """No weights to save: the step and cursor only, so a run directory looks like a run's."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"step-{self._version:06d}.json"
        write_json(path, {**extra, "simulated": True})
        return path

    async def actor_stats(self) -> dict[str, ActorStats]:
        tools = ToolStats()
        for agent in self.agents:
            for name, n in agent.stats.tools.calls.items():
                tools.calls[name] += n
                tools.seconds[name] += agent.stats.tools.seconds[name]
        return {"simulated": ActorStats(self.engine.version, self.engine.generated_tokens, tools)}


@dataclass
class SimResult:
    """What a simulated run measured, in simulated seconds."""

    steps: int
    seconds: float
    trajectories: int
    trajectories_per_s: float  # over the steps after warm-up (the first fifth left out)
    learner_busy_s: float
    learner_idle_s: float  # waiting for groups
    learner_sync_s: float  # publishing weights (neither busy nor idle in the stream's books)
    server_busy_fraction: float  # decoding or prefilling, mean over servers
    server_loading_fraction: float
    server_draining_fraction: float
    staleness: dict[int, int]
    per_stratum: dict[int, dict[str, int]]
    real_seconds: float
    settings: dict = field(default_factory=dict)
    interrupted: bool = False  # stopped by SIGTERM or Ctrl-C (books and checkpoint written)

    @property
    def learner_idle_fraction(self) -> float:
        return self.learner_idle_s / max(self.seconds, 1e-9)


def steady_throughput(metrics: list[dict]) -> float:
    """Trajectories trained per simulated second after the first fifth of the steps (warm-up:
    the pipeline filling), from the steps' elapsed times."""
    if len(metrics) < 2:
        return float("nan")
    start = len(metrics) // 5
    a, b = metrics[max(start - 1, 0)], metrics[-1]
    trained = b["trajectories_per_s"] * b["elapsed_s"] - a["trajectories_per_s"] * a["elapsed_s"]
    return trained / max(b["elapsed_s"] - a["elapsed_s"], 1e-9)


async def _simulate(
    config: StrataConfig,
    run_dir: Path,
    loggers: Loggers | None = None,
    stop_on_signal: bool = False,
) -> SimResult:
    sim: SimulatedConfig = config.actors.engine  # WHOLE_RUNS["simulated"]: the engine is simulated
    tokenizer = sim_tokenizer()
    gpu = GpuModel(sim.step_s, sim.step_per_seq_s, sim.prefill_per_token_s, sim.max_batch)
    # observations as long as the agent keeps (actors.max_observation_tokens): search results
    # usually fill it, and encoding more would only cost Python time
    workload = Workload(
        sim.tool_call_p,
        sim.turn_tokens_median,
        sim.turn_tokens_sigma,
        tuple(sim.tool_latency_s),
        config.actors.max_observation_tokens,
    )
    servers = [
        SimulatedServer(f"server-{i}", gpu, sim.partial_rollouts) for i in range(sim.num_servers)
    ]
    engine = SimulatedEngine(
        servers, tokenizer, workload, seed=config.runtime.seed, load_s=sim.load_s
    )
    tools = {
        name: SimulatedTool(name, workload, seed=config.runtime.seed + 1 + i)
        for i, name in enumerate(config.actors.tool_names)
    }
    settings = agent_settings(config.actors, config.learner.stratifier)
    agents = [
        AgentLoop(engine, tokenizer, tools, settings, actor_id=f"pool-{i}")
        for i in range(config.actors.num_pools)
    ]
    buffer = make_buffer(
        config.buffer,
        run_dir,
        config.learner.groups_per_step,
        dynamic_sampling=config.learner.dynamic_sampling,
    )
    tasks = task_stream(
        sim_questions(config.data.num_questions), config.data.seed, config.data.shuffle
    )
    pools = [
        ActorPool(
            agent,
            buffer,
            tasks,
            group_size=config.buffer.group_size,
            concurrency=config.actors.concurrency,
            name=agent.actor_id,
        )
        for agent in agents
    ]
    roles = SimulatedRoles(sim, engine, agents)
    summary = RunSummary()
    began = time.perf_counter()
    loop, task, stopping = asyncio.get_running_loop(), asyncio.current_task(), []

    def stop() -> None:  # SIGTERM, Ctrl-C: cancel the stream at its next await, once
        if not stopping:
            stopping.append(True)
            task.cancel()

    signals = (signal.SIGTERM, signal.SIGINT) if stop_on_signal else ()
    for number in signals:
        loop.add_signal_handler(number, stop)
    try:
        await asyncio.wait_for(
            # virtual seconds, nothing hangs: a long simulated step would outlast any stop's wait
            stream(
                config, roles, buffer, pools, run_dir, summary, loggers=loggers, bounded_stop=False
            ),
            sim.time_limit_s,
        )
    except TimeoutError:
        pass  # the simulated time limit: the books are written on the way out
    except asyncio.CancelledError:
        if not stopping:
            raise
        task.uncancel()  # stopped on purpose: the stream wrote its books and checkpoint
    finally:
        for number in signals:
            loop.remove_signal_handler(number)
        await engine.close()
    total = max(summary.seconds, 1e-9)
    per_server = len(servers) * total
    return SimResult(
        steps=summary.steps,
        seconds=summary.seconds,
        trajectories=summary.trajectories,
        trajectories_per_s=steady_throughput(summary.metrics),
        learner_busy_s=summary.learner_busy_s,
        learner_idle_s=summary.learner_idle_s,
        learner_sync_s=roles.sync_s,
        server_busy_fraction=sum(s.stats.busy_s for s in servers) / per_server,
        server_loading_fraction=sum(s.stats.loading_s for s in servers) / per_server,
        server_draining_fraction=sum(s.stats.draining_s for s in servers) / per_server,
        staleness=dict(sorted(roles.staleness.items())),
        per_stratum={int(k): v for k, v in summary.accounting.get("per_stratum", {}).items()},
        real_seconds=time.perf_counter() - began,
        settings=sim.model_dump(mode="json"),
        interrupted=bool(stopping),
    )


def simulate(
    config: StrataConfig,
    run_dir: str | Path,
    loggers: Loggers | None = None,
    stop_on_signal: bool = False,
) -> SimResult:
    """Run `config` (actors.engine.type simulated) to learner.max_steps on the virtual clock;
    writes run_dir/simulation.json and returns its figures. `loggers` (pipeline.loggers) are fed
    after every step, in simulated seconds; with
    `stop_on_signal` SIGTERM or Ctrl-C stops the run as it stops a real one (books, checkpoint)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    result = virtual_time.run(_simulate(config, run_dir, loggers, stop_on_signal))
    write_json(run_dir / "simulation.json", asdict(result))
    return result


NOT_SIMULATED = (
    "model",
    "data (but num_questions, seed, shuffle)",
    "retrieval",
    "eval",
    "learner.lr",
    "learner.advantage",
    "learner.importance",
    "learner.kl_coef",
    "learner.zero_stage",
    "learner.num_ranks",
)


def run_simulated(config: StrataConfig, run_dir: Path) -> int:
    """`python -m pipeline.launch` with actors.engine.type simulated: one line on what does not
    act, the simulation (metrics.loggers as in a real run; SIGTERM or Ctrl-C
    stops it cleanly), one line of results."""

    print(
        f"strata: simulated run (actors.engine.type simulated): no model is trained, so "
        f"{', '.join(NOT_SIMULATED)} do not act; timings are simulated seconds",
        flush=True,
    )
    try:
        loggers = open_loggers(config, run_dir)
    except LoggerError as exc:  # a taken metrics port, a missing package, ...
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2
    try:
        r = simulate(config, run_dir, loggers, stop_on_signal=True)
    except KeyboardInterrupt:  # SIGTERM or Ctrl-C before the stream began: nothing to write
        print("strata: interrupted before the simulation began", file=sys.stderr)
        return 130
    finally:
        loggers.close()
    stale = ", ".join(f"{k}: {v}" for k, v in r.staleness.items())
    print(
        f"strata: simulated {r.steps} steps, {r.trajectories} trajectories in {r.seconds:.0f} s "
        f"({r.real_seconds:.0f} s real): {r.trajectories_per_s:.2f} trajectories/s after warm-up, "
        f"learner idle {r.learner_idle_fraction:.0%}, servers busy {r.server_busy_fraction:.0%}; "
        f"staleness {{{stale}}}; {run_dir / 'simulation.json'}",
        flush=True,
    )
    if r.interrupted:
        print(
            "strata: interrupted: the books and a checkpoint of the steps so far are written",
            file=sys.stderr,
        )
        return 130
    return 0 if r.steps else 1
