"""Off-policy corrections: what each does with the weight w = exp(proximal - behaviour) of a token,
the gap between the policy before this step (whose log-probs the learner computes) and the actor
that sampled the token, possibly versions old (AReaL's decoupled objective):

    none      nothing
    tis       the loss times min(w, cap)                           (truncated importance sampling)
    mask      tokens with w > cap are dropped
    icepop    tokens with w outside [floor, cap] are dropped       (IcePop's two-sided mask)
    seq_mask  whole sequences whose geometric-mean weight exp(mean log w) leaves [floor, cap]
              are dropped                                          (sequence-level masked IS)

Each registers itself with `register_correction(name, fn, *params, drops=...)` right after its
def (a call, not a decorator: mutmut 3 does not mutate decorated functions): a function
`(log_w, loss_mask, **params) -> (multiplier, kept)` of [B, T] tensors, whose keyword parameters
are the fields of its config section (`learner.importance: {type: NAME, ...}`,
pipeline/config/algorithm.py). `drops`: it drops tokens, so the learner must know the kept
tokens of the whole step before its first micro-batch (each weighs its share of them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

Apply = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Kind:
    apply: Apply
    params: tuple[str, ...]
    drops: bool


CORRECTIONS: dict[str, Kind] = {}
"""`learner.importance.type` -> the correction; filled by `register_correction`."""


def register_correction(name: str, apply: Apply, *params: str, drops: bool = False) -> None:
    """Register `apply` as correction `name`, taking keyword `params`: called right after its def
    (not a decorator, which mutmut would not mutate behind)."""
    if name in CORRECTIONS:
        raise ValueError(f"correction {name!r} is registered twice")
    CORRECTIONS[name] = Kind(apply, params, drops)


def _none(log_w: torch.Tensor, loss_mask: torch.Tensor):
    return torch.ones_like(log_w), loss_mask


register_correction("none", _none)


def _tis(log_w: torch.Tensor, loss_mask: torch.Tensor, *, cap: float = 2.0):
    return torch.clamp(torch.exp(log_w), max=cap), loss_mask


register_correction("tis", _tis, "cap")


def _mask(log_w: torch.Tensor, loss_mask: torch.Tensor, *, cap: float = 2.0):
    return torch.ones_like(log_w), loss_mask * (torch.exp(log_w) <= cap).to(loss_mask.dtype)


register_correction("mask", _mask, "cap", drops=True)


def _icepop(log_w: torch.Tensor, loss_mask: torch.Tensor, *, floor: float = 0.5, cap: float = 2.0):
    w = torch.exp(log_w)
    return torch.ones_like(log_w), loss_mask * ((w >= floor) & (w <= cap)).to(loss_mask.dtype)


register_correction("icepop", _icepop, "floor", "cap", drops=True)


def _seq_mask(
    log_w: torch.Tensor, loss_mask: torch.Tensor, *, floor: float = 0.5, cap: float = 2.0
):
    mask = loss_mask.to(log_w.dtype)
    geo = torch.exp((log_w * mask).sum(-1) / mask.sum(-1).clamp(min=1)).unsqueeze(-1)
    return torch.ones_like(log_w), loss_mask * ((geo >= floor) & (geo <= cap)).to(loss_mask.dtype)


register_correction("seq_mask", _seq_mask, "floor", "cap", drops=True)


@dataclass(frozen=True)
class Correction:
    """A chosen correction and its parameters: `Correction("tis", {"cap": 1.5})`."""

    name: str = "none"
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in CORRECTIONS:
            raise ValueError(
                f"unknown importance correction {self.name!r}: use {', '.join(CORRECTIONS)}"
            )
        unknown = sorted(set(self.params) - set(CORRECTIONS[self.name].params))
        if unknown:
            takes = ", ".join(CORRECTIONS[self.name].params) or "no parameters"
            raise ValueError(f"correction {self.name} takes {takes}, not {', '.join(unknown)}")

    @classmethod
    def from_section(cls, section: Any) -> Correction:
        """From a `learner.importance` config section (read by attribute)."""
        return cls(section.type, {p: getattr(section, p) for p in CORRECTIONS[section.type].params})

    @property
    def active(self) -> bool:
        """It reads the proximal log-probs (every correction but none)."""
        return self.name != "none"

    @property
    def drops(self) -> bool:
        return CORRECTIONS[self.name].drops

    def apply(
        self, log_w: torch.Tensor, loss_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss's multiplier, the tokens kept) for log-weights `log_w` (no gradient)."""
        return CORRECTIONS[self.name].apply(log_w.detach(), loss_mask, **self.params)


NO_CORRECTION = Correction()
