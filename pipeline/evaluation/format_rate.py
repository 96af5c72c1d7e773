"""How well a policy follows the agent format: the real agent loop on held-out world questions.

Runs `AgentLoop` with the embedded engine, the real search tool (a retrieval server on 127.0.0.1)
and the sandboxed python tool, greedy and sampled, and reports the share of well-formed
trajectories, answers, tool-call counts and exact match. Used after the warm start.
"""

from __future__ import annotations

import asyncio
import os
import random
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from actors.agent import AgentLoop, AgentSettings
from actors.rewards import format_reward
from pipeline.assets.datasets import load_world
from pipeline.backends.embedded import EmbeddedEngine
from pipeline.backends.local import LocalRuntime
from pipeline.config.schema import ActorsConfig, StrataConfig
from pipeline.runtime.parts import open_acting
from retrieval.build import build

LOCAL_AGENT = AgentSettings(
    max_turns=4, max_new_tokens_per_turn=64, max_response_tokens=640, max_observation_tokens=128
)
"""The agent of configs/local.yaml: demos are laid out as it lays out trajectories."""


@dataclass(frozen=True)
class FormatReport:
    temperature: float  # 0: greedy
    trajectories: int
    well_formed: float
    """Share whose generated text passes `format_reward`: tags closed, none nested, and it ends
    with its one answer. A trajectory cut by the response budget is not well formed."""
    answered: float
    """Share that ended with an answer (the loop's finish reason)."""
    mean_tool_calls: float
    tool_calls: dict[int, float]
    """Share of trajectories by number of tool calls: the strategy mix."""
    exact_match: float
    finish: dict[str, int]
    seconds: float

    @classmethod
    def of(cls, temperature: float, results: list[tuple], seconds: float) -> FormatReport:
        """Figures over (trajectory, its generated text) pairs."""
        n = len(results)
        calls = Counter(t.num_tool_calls for t, _ in results)
        return cls(
            temperature,
            n,
            well_formed=sum(format_reward(text) for _, text in results) / n,
            answered=sum(t.finish_reason == "answer" for t, _ in results) / n,
            mean_tool_calls=sum(k * v for k, v in calls.items()) / n,
            tool_calls={k: v / n for k, v in sorted(calls.items())},
            exact_match=sum(t.reward for t, _ in results) / n,
            finish=dict(Counter(t.finish_reason for t, _ in results)),
            seconds=seconds,
        )

    def line(self) -> str:
        mix = ", ".join(f"{k}: {v:.0%}" for k, v in self.tool_calls.items())
        name = "greedy" if self.temperature <= 0 else f"T={self.temperature:g}"
        return (
            f"{name:>6}: well-formed {self.well_formed:.0%}, answered {self.answered:.0%}, exact "
            f"match {self.exact_match:.0%}, tool calls {self.mean_tool_calls:.2f} ({mix}); "
            f"finish {self.finish}; {self.trajectories} questions in {self.seconds:.0f}s"
        )


def generated_text(trajectory, tokenizer) -> str:
    """The policy's own text: the generated runs of a trajectory, decoded run by run (as the
    loop decodes its turns), without the observations between them."""
    runs: list[list[int]] = [[]]
    for token, mask in zip(
        trajectory.token_ids.tolist(), trajectory.loss_mask.tolist(), strict=True
    ):
        if mask:
            runs[-1].append(token)
        elif runs[-1]:
            runs.append([])
    return "".join(tokenizer.decode(r, skip_special_tokens=False) for r in runs)


def pick_questions(questions: Sequence, n: int | None, seed: int = 0) -> list:
    """`n` questions drawn over the whole split (every level), in file order; None: all."""
    if n is None or n >= len(questions):
        return list(questions)
    return [questions[i] for i in sorted(random.Random(seed).sample(range(len(questions)), n))]


def format_rate(
    model_dir: str | os.PathLike[str],
    world_dir: str | os.PathLike[str],
    n: int | None = None,
    *,
    temperatures: Sequence[float] = (0.0, 1.0),
    tools: Sequence[str] = ("search", "python"),
    settings: AgentSettings = LOCAL_AGENT,
    index_dir: str | os.PathLike[str] | None = None,
    concurrency: int = 32,
    seed: int = 0,
) -> list[FormatReport]:
    """Run the real agent loop on `n` held-out test questions, once per temperature, searching a
    MiniLM index of the world through the real retrieval server on 127.0.0.1.

    `index_dir`: an index of the world's corpus, built there first if missing; None builds one
    in a temporary directory (about ten seconds).
    """

    questions = pick_questions(load_world(world_dir)[1], n, seed)
    with tempfile.TemporaryDirectory(prefix="strata-warm-index-") as scratch:
        index = Path(index_dir) if index_dir is not None else Path(scratch) / "index"
        if not (index / "meta.json").is_file():
            build(str(Path(world_dir) / "corpus.jsonl"), str(index), quiet=True)
        run = _measure(
            Path(model_dir), index, questions, temperatures, tools, settings, concurrency, seed
        )
        return asyncio.run(run)


async def _measure(
    model_dir: Path,
    index: Path,
    questions: list,
    temperatures: Sequence[float],
    tools: Sequence[str],
    settings: AgentSettings,
    concurrency: int,
    seed: int,
) -> list[FormatReport]:
    config = StrataConfig(
        actors=ActorsConfig(tools=list(tools), engine=EmbeddedEngine(max_batch_size=concurrency)),
        runtime=LocalRuntime(seed=seed),
    )
    acting = await open_acting(config, model_dir, index_dir=index)
    gate = asyncio.Semaphore(concurrency)
    try:

        async def one(agent: AgentLoop, i: int, question) -> tuple:
            async with gate:
                trajectory = await agent.run(question, question.id, i)
            return trajectory, generated_text(trajectory, acting.tokenizer)

        reports = []
        for temperature in temperatures:
            agent = acting.agent(
                "format-rate", replace(settings, temperature=temperature, reward="exact_match")
            )
            start = time.monotonic()
            results = await asyncio.gather(*(one(agent, i, q) for i, q in enumerate(questions)))
            reports.append(FormatReport.of(temperature, results, time.monotonic() - start))
        return reports
    finally:
        await acting.close()


# ------------------------------------------------------------------------------------------ CLI
