"""The `RolloutEngine` protocol: token ids in, token ids with behaviour log-probs and versions out.

Every backend (the embedded torch engine, SGLang or vLLM servers) returns, for each generated token,
the log-prob it was sampled with and the policy version that sampled it: importance correction and
the staleness bound downstream are only as true as these two numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    """Generation ends once the text generated so far contains one of these; it is kept, not trimmed."""


@dataclass
class Generation:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """log pi(token | context) under the sampling policy: log_softmax(logits / temperature)."""
    versions: list[int] = field(default_factory=list)
    """Policy version that produced each token (weights may change mid-generation)."""
    finish_reason: FinishReason = "length"
    stop: str | None = None  # the stop string that ended it, if any


class EngineError(RuntimeError):
    """The engine could not generate (server dead, timeout); the trajectory is aborted and counted."""


class NoServerBack(EngineError):
    """Every server stayed down (or held for a restart) for the engine's whole timeout: trying
    the request again would only wait as long again."""


class GenerationAborted(EngineError):
    """The server ended a generation early (finish_reason "abort", e.g. paused for a weight
    update): the answer is cut off, so the trajectory is aborted and its group abandoned, never
    trained as if the agent had given it."""


class RolloutEngine(Protocol):
    generated_tokens: int
    """Tokens generated so far (throughput metrics)."""
    tokenizer: Any
    """The policy's tokenizer when the engine holds one (in-process); None for servers."""

    @property
    def version(self) -> int:
        """The policy version new tokens are sampled with."""
        ...

    async def served_versions(self) -> dict[str, int]:
        """The version each server (or the one in-process model) serves, as it says itself."""
        ...

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation: ...

    async def update_weights(
        self,
        version: int,
        *,
        state_dict: Mapping[str, object] | None = None,
        path: str | None = None,
    ) -> None:
        """Serve `version` from now on: in-process tensors (`state_dict`) or an HF checkpoint (`path`)."""
        ...

    async def close(self) -> None: ...
