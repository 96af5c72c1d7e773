"""Prometheus metrics of a run (each `strata_*` series is defined below), served on metrics.host:metrics.port.

One registry per run. The runtime calls `observe_step` after each learner step and `sample` for
the gauges and counters it reads off the buffer, the pools and the engines; every name starts with
`strata_`, counters end in `_total`, durations in `_seconds`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)
TRAJECTORY_FATES = ("released", "filtered", "dropped_stale", "abandoned", "rejected")
"""strata_trajectories_total's status label: the buffer's counters of the same names."""
TOOL_CALL_BUCKETS = (0, 1, 2, 3, 4, 6, 8)
REWARD_PREFIX = "reward/"
"""metrics.jsonl's `reward/<component>`: exported as strata_reward_component{component}."""


OFFPOLICY = (
    "logprob_gap_mean",
    "logprob_gap_abs_mean",
    "logprob_gap_tail_fraction",
    "clip_fraction",
    "mask_drop_fraction",
    "truncated_fraction",
    "sequence_drop_fraction",
    "staleness_token_mean",
)
"""The learner's per-step off-policy figures exported as strata_offpolicy{measure}."""

OBJECTIVE = (
    "entropy",
    "overlong_share",
    "step_advantage_abs_mean",
    "value_loss",
    "explained_variance",
)
"""The learner's per-step objective figures exported as strata_objective{measure}: the mean
entropy of the trained tokens (an entropy bonus acts on it), the share of the step's
trajectories cut by the response budget (DAPO's overlong filter and punishment act on them),
the mean |omega * A_step| that step-level credit adds to the generated tokens, and GAE's
critic: its value loss and the explained variance of the returns by its values before the step."""


@dataclass
class RunMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.trajectories = Counter(
            "strata_trajectories_total", "Trajectories by fate", ["status"], registry=r
        )
        self.groups_completed = Counter(
            "strata_groups_completed_total", "Groups released to the learner", registry=r
        )
        self.groups_abandoned = Counter(
            "strata_groups_abandoned_total", "Groups given up on (actor died, timeout)", registry=r
        )
        self.generated_tokens = Counter(
            "strata_generated_tokens_total", "Tokens sampled by the engines", registry=r
        )
        self.server_rejoins = Counter(
            "strata_server_rejoins_total",
            "Inference servers back in rotation after failing, on the published weights",
            registry=r,
        )
        self.learner_steps = Counter("strata_learner_steps_total", "Optimiser steps", registry=r)
        self.policy_version = Gauge("strata_policy_version", "Learner's policy version", registry=r)
        self.actor_version = Gauge(
            "strata_actor_policy_version", "Version an actor serves", ["actor"], registry=r
        )
        self.staleness = Histogram(
            "strata_staleness",
            "Version lag of trained tokens at consumption",
            buckets=STALENESS_BUCKETS,
            registry=r,
        )
        self.buffer_groups = Gauge(
            "strata_buffer_groups", "Groups in the buffer", ["state"], registry=r
        )
        self.reward = Gauge(
            "strata_reward", "Mean reward of the last step", ["stratum"], registry=r
        )
        self.reward_component = Gauge(
            "strata_reward_component",
            "Mean of each named part of the reward over the last step's trajectories (the terms "
            "of a weighted actors.reward, the keys of a reward's dict)",
            ["component"],
            registry=r,
        )
        self.reward_errors = Counter(
            "strata_reward_errors_total",
            "Reward terms that raised, timed out or gave no number (each scored 0)",
            registry=r,
        )
        self.agent_failures = Counter(
            "strata_agent_failures_total",
            "Trajectories a custom or openai agent lost (their groups abandoned), by kind: the "
            "agent raised, ran past its deadline, its program exited non-zero, it rewrote its "
            "history under on_rewrite drop, or it returned no answer, reward or None",
            ["kind"],
            registry=r,
        )
        self.agent_rewrites = Counter(
            "strata_agent_rewrites_total",
            "Rewrites of a custom or openai agent's history (new segments) in the trajectories "
            "delivered",
            registry=r,
        )
        self.mean_advantage = Gauge(
            "strata_stratum_mean_advantage",
            "Mean advantage of each stratum in the last step, under the estimator that trained "
            "(the blend's residual cross-stratum offset, (1 - alpha) times the GN offset)",
            ["stratum"],
            registry=r,
        )
        self.tool_calls = Histogram(
            "strata_tool_calls_per_trajectory",
            "Tool calls per trajectory",
            buckets=TOOL_CALL_BUCKETS,
            registry=r,
        )
        self.tool_seconds = Counter(
            "strata_tool_call_seconds", "Seconds spent in tool calls", ["tool"], registry=r
        )
        self.tool_errors = Counter(
            "strata_tool_errors_total", "Failed tool calls", ["tool"], registry=r
        )
        self.tool_bad_calls = Counter(
            "strata_tool_bad_calls_total",
            "Tool calls whose arguments did not fit the tool's schema (nothing ran; also errors)",
            ["tool"],
            registry=r,
        )
        self.tool_release_errors = Counter(
            "strata_tool_release_errors_total",
            "Per-trajectory tool states whose release raised",
            ["tool"],
            registry=r,
        )
        self.mcp_restarts = Counter(
            "strata_mcp_restarts_total",
            "MCP servers started (or reconnected) again after they died",
            ["server"],
            registry=r,
        )
        self.weight_sync = Histogram(
            "strata_weight_sync_seconds", "Weight publish time", registry=r
        )
        self.step_seconds = Histogram(
            "strata_learner_step_seconds", "Learner step time", registry=r
        )
        self.idle_seconds = Counter(
            "strata_learner_idle_seconds_total", "Learner time waiting for groups", registry=r
        )
        self.eval_accuracy = Gauge(
            "strata_eval_accuracy",
            "Held-out accuracy of the last evaluation (eval.every_steps)",
            ["source", "tools"],
            registry=r,
        )
        self.eval_step = Gauge(
            "strata_eval_step", "Learner step of the last evaluation", registry=r
        )
        self.offpolicy = Gauge(
            "strata_offpolicy",
            "Off-policy telemetry of the last step: the learner-behaviour log-prob "
            "gap (mean, abs mean, share of tokens beyond 1 nat), shares of tokens clipped, masked, "
            "truncated and of sequences dropped, token-weighted staleness",
            ["measure"],
            registry=r,
        )
        self.objective = Gauge(
            "strata_objective",
            "Objective telemetry of the last step: mean entropy of the trained tokens, share of "
            "trajectories cut by the response budget",
            ["measure"],
            registry=r,
        )
        self.stratum_share = Gauge(
            "strata_stratum_share",
            "Share of the generated (left the buffer) or trained trajectories "
            "per stratum; trained below generated: staleness starves the stratum",
            ["stratum", "kind"],
            registry=r,
        )
        self.rank_seconds = Counter(
            "strata_learner_rank_seconds_total",
            "Seconds each learner rank spent on its own micro-batches",
            ["rank"],
            registry=r,
        )
        self.rank_idle = Counter(
            "strata_learner_rank_idle_seconds_total",
            "Seconds each learner rank waited for the slowest rank at a step's reductions",
            ["rank"],
            registry=r,
        )
        self.rank_tokens = Counter(
            "strata_learner_rank_tokens_total",
            "Response tokens each learner rank trained",
            ["rank"],
            registry=r,
        )
        self._seen: dict[str, float] = {}
        for status in TRAJECTORY_FATES:
            self.trajectories.labels(status=status)  # every series exists from the first scrape

    def declare_tools(self, tools: Sequence[str], mcp_servers: Sequence[str] = ()) -> None:
        """Every tool's and MCP server's series, at 0 from the first scrape."""
        for tool in tools:
            for counter in (
                self.tool_seconds,
                self.tool_errors,
                self.tool_bad_calls,
                self.tool_release_errors,
            ):
                counter.labels(tool=tool)
        for server in mcp_servers:
            self.mcp_restarts.labels(server=server)

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP endpoint; returns the bound port (port 0 picks a free one)."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return server.server_port

    def close(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            server.shutdown()

    def _advance(self, counter, key: str, total: float, **labels: str) -> None:
        """Counters from cumulative totals read elsewhere: add what is new since the last read.
        A total that went down was reset (a restarted actor counts from 0 again)."""
        seen = self._seen.get(key, 0.0)
        delta = total - seen if total >= seen else total
        if delta > 0:
            (counter.labels(**labels) if labels else counter).inc(delta)
        self._seen[key] = total

    def observe_step(self, metrics: dict, trajectories: list, idle_s: float) -> None:
        self.learner_steps.inc()
        self.groups_completed.inc(metrics.get("groups", 0))
        self.policy_version.set(metrics.get("version", 0))
        self.step_seconds.observe(metrics.get("step_seconds", 0.0))
        if "weight_sync_seconds" in metrics:
            self.weight_sync.observe(metrics["weight_sync_seconds"])
        self.idle_seconds.inc(max(0.0, idle_s))
        for key in OFFPOLICY:
            if key in metrics:
                self.offpolicy.labels(measure=key).set(metrics[key])
        for key in OBJECTIVE:
            if key in metrics:
                self.objective.labels(measure=key).set(metrics[key])
        for key, value in metrics.items():
            if key.startswith(REWARD_PREFIX):
                self.reward_component.labels(component=key.removeprefix(REWARD_PREFIX)).set(value)
            elif key.startswith("stratum/") and key.endswith("/reward"):
                self.reward.labels(stratum=key.split("/")[1]).set(value)
            elif key.startswith("stratum/") and key.endswith("/mean_advantage"):
                self.mean_advantage.labels(stratum=key.split("/")[1]).set(value)
            elif key.startswith("rank/"):
                _, rank, measure = key.split("/")
                counter = {
                    "seconds": self.rank_seconds,
                    "idle_seconds": self.rank_idle,
                    "tokens": self.rank_tokens,
                }[measure]
                counter.labels(rank=rank).inc(max(0.0, value))
            elif key.startswith("stratum/") and key.endswith("_share"):
                _, stratum, kind = key.split("/")
                self.stratum_share.labels(stratum=stratum, kind=kind.removesuffix("_share")).set(
                    value
                )
        for t in trajectories:
            self.tool_calls.observe(len(t.tool_names))
            self.staleness.observe(max(0, int(metrics.get("version", 1)) - 1 - t.policy_version))

    def observe_eval(self, step: int, rows: list) -> None:
        """An evaluation's rows (pipeline.evaluation.heldout.Row): source is the row name (a data source,
        "level N" or "all"); tools "no" for the no-tools baseline."""
        self.eval_step.set(step)
        for row in rows:
            self.eval_accuracy.labels(source=row.name, tools="yes" if row.tools else "no").set(
                row.accuracy
            )

    def sample(self, buffer_stats, actors: dict) -> None:
        """Read the buffer's counters and each actor's (`streaming.ActorStats` by actor name)."""
        for status in TRAJECTORY_FATES:
            self._advance(
                self.trajectories, f"traj/{status}", getattr(buffer_stats, status), status=status
            )
        self._advance(self.groups_abandoned, "groups/abandoned", buffer_stats.abandoned_groups)
        self.buffer_groups.labels(state="open").set(buffer_stats.open_groups)
        self.buffer_groups.labels(state="ready").set(buffer_stats.ready_groups)
        for name, actor in actors.items():
            self.actor_version.labels(actor=name).set(actor.version)
            self._advance(self.generated_tokens, f"tokens/{name}", actor.generated_tokens)
            self._advance(self.server_rejoins, f"rejoins/{name}", actor.server_rejoins)
            self._advance(self.reward_errors, f"reward_errors/{name}", actor.reward_errors)
            self._advance(self.agent_rewrites, f"agent_rewrites/{name}", actor.agent_rewrites)
            for kind, total in actor.agent_failures.items():
                self._advance(self.agent_failures, f"agent/{name}/{kind}", total, kind=kind)
            tools = actor.tools
            per_tool = (
                (self.tool_seconds, "secs", tools.seconds),
                (self.tool_errors, "errs", tools.errors),
                (self.tool_bad_calls, "bad", tools.bad_calls),
                (self.tool_release_errors, "release", tools.release_errors),
            )
            for counter, kind, totals in per_tool:
                for tool, total in totals.items():
                    self._advance(counter, f"{kind}/{name}/{tool}", total, tool=tool)
            for server, restarts in actor.mcp_restarts.items():
                self._advance(self.mcp_restarts, f"mcp/{name}/{server}", restarts, server=server)
