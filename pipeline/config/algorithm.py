"""The algorithm's config sections: one per advantage estimator (`learner.advantage`, registered
in learner/estimators.py), one per off-policy correction (`learner.importance`,
learner/corrections.py) and one per stratifier (`learner.stratifier`, buffers/strata.py), each
holding the parameters its registered function takes and nothing else, so a key that does not
act for the chosen one is refused rather than ignored. A test checks each section's fields
against its function's parameters.

Either section also takes a plug-in: `type` is then an entry point's name (groups
strata.estimators, strata.stratifiers) or an import string (pipeline/plugins.py), and the
section's other keys are the plug-in's parameters, checked against the ones it takes.
"""

from __future__ import annotations

import inspect
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, model_validator

from buffers import strata
from pipeline.config.base import Section, backend_union, shown
from pipeline.plugins import PLUGGED, resolve


class StratifiedAdvantage(Section):
    """Stratified GRPO (Algorithm 1): alpha * A_SAN + (1 - alpha) * A_GN."""

    type: Literal["stratified"] = "stratified"
    """Stratified advantage normalisation blended with group normalisation."""
    alpha: float = Field(0.6, ge=0, le=1)
    """Blend: A = alpha * A_SAN + (1 - alpha) * A_GN; 0 is GRPO, 1 is pure SAN."""
    eps: float = Field(1e-6, ge=0, le=1)
    """Added to every std before dividing."""


class GrpoAdvantage(Section):
    """GRPO: (r - mean_g) / (std_g + eps)."""

    type: Literal["grpo"] = "grpo"
    """Group-normalised advantages."""
    eps: float = Field(1e-6, ge=0, le=1)
    """Added to every group's std before dividing."""


class DrGrpoAdvantage(Section):
    """Dr. GRPO: r - mean_g, no division by the std."""

    type: Literal["dr_grpo"] = "dr_grpo"
    """Mean-centred advantages."""


class RlooAdvantage(Section):
    """RLOO: r - the mean of the group's other members."""

    type: Literal["rloo"] = "rloo"
    """Leave-one-out baseline."""


class McGrpoAdvantage(Section):
    """MC-GRPO: (r - median_g) / (MAD_g + eps); an odd group's pivot is left out of the loss."""

    type: Literal["mc_grpo"] = "mc_grpo"
    """Median-centred advantages."""
    eps: float = Field(1e-6, ge=0, le=1)
    """Added to every group's MAD (or its std, where the MAD is 0) before dividing."""


class ReinforcePpAdvantage(Section):
    """REINFORCE++ (arXiv 2501.03262): (r - mean_step) / (std_step + eps), no group baseline."""

    type: Literal["reinforce_pp"] = "reinforce_pp"
    """Normalised over the whole step; a group of one still gets a signal."""
    eps: float = Field(1e-6, ge=0, le=1)
    """Added to the step's std before dividing."""


class ReinforcePpBaselineAdvantage(Section):
    """REINFORCE++-baseline: (r - mean_g) / (std over the step of r - mean_g, + eps)."""

    type: Literal["reinforce_pp_baseline"] = "reinforce_pp_baseline"
    """The group mean as baseline, the whole step's spread as scale."""
    eps: float = Field(1e-6, ge=0, le=1)
    """Added to the step's std before dividing."""


class PpoClipSurrogate(Section):
    """PPO's clipped surrogate with dual clip (learner.clip_low, clip_high, dual_clip)."""

    no_dual_clip: ClassVar[str] = ""
    """Why learner.dual_clip does not act with this surrogate ("": it does)."""
    sequence_ratio: ClassVar[bool] = True
    """Whether it takes GSPO's sequence ratio (learner.ratio: sequence)."""
    type: Literal["ppo_clip"] = "ppo_clip"
    """max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), at most -A dual_clip for A < 0."""


class CispoSurrogate(Section):
    """CISPO (arXiv 2506.13585): -sg(clip(r, 1 - clip_low, 1 + clip_high)) A log pi."""

    no_dual_clip: ClassVar[str] = "its weight is capped at 1 + clip_high"
    sequence_ratio: ClassVar[bool] = False
    type: Literal["cispo"] = "cispo"
    """The clipped ratio as a weight without gradient: no token loses its gradient; needs
    learner.dual_clip null and learner.ratio token."""


class ClipCovSurrogate(Section):
    """Clip-Cov (arXiv 2505.22617): ppo_clip, and a random share of the tokens of high
    covariance between advantage and log-prob carry no loss."""

    no_dual_clip: ClassVar[str] = "Clip-Cov's paper and verl clip as PPO without one"
    sequence_ratio: ClassVar[bool] = False
    type: Literal["clip_cov"] = "clip_cov"
    """ppo_clip without dual clip, covariance-chosen tokens left out; needs learner.dual_clip
    null and learner.ratio token."""
    share: float = Field(2e-4, gt=0, le=1)
    """Share of the trained tokens left out (at least one), chosen at random among the eligible."""
    low_cov: float = 1.0
    """Eligible: covariance (A - mean A)(log pi - mean log pi) above this..."""
    high_cov: float = 5.0
    """...and below this (and not clipped by PPO already)."""


class KlCovSurrogate(Section):
    """KL-Cov (arXiv 2505.22617): -A r, plus coef |log r| on the tokens of highest covariance."""

    no_dual_clip: ClassVar[str] = "it does not clip"
    sequence_ratio: ClassVar[bool] = False
    type: Literal["kl_cov"] = "kl_cov"
    """No clip; a KL penalty on the top covariance tokens; needs learner.dual_clip null and
    learner.ratio token."""
    share: float = Field(2e-3, gt=0, le=1)
    """Share of the trained tokens penalised (at least one), by covariance, highest first."""
    coef: float = Field(1.0, ge=0)
    """Weight of |log pi - log pi_old| on those tokens."""


SURROGATES = (PpoClipSurrogate, CispoSurrogate, ClipCovSurrogate, KlCovSurrogate)
"""`learner.surrogate.type` -> its section; the first is the default."""
SurrogateConfig = backend_union(SURROGATES)


class NoStepCredit(Section):
    """No step-level credit: every token of a trajectory takes its episode's advantage."""

    type: Literal["none"] = "none"
    """Episode-level advantages only."""


class GigpoStepCredit(Section):
    """GiGPO (arXiv 2505.10978): A = A_episode + omega * A_step, A_step a turn's discounted
    return normalised among the group's turns taken from the same state (learner/step_credit.py)."""

    type: Literal["gigpo"] = "gigpo"
    """Step groups by state: the observations a turn has seen so far."""
    omega: float = Field(1.0, ge=0, le=10)
    """Weight of the step-level advantage."""
    gamma: float = Field(0.95, gt=0, le=1)
    """Discount of the outcome per later turn."""
    eps: float = Field(1e-6, ge=0, le=1)
    """Added to every step group's std before dividing."""


class IgpoStepCredit(Section):
    """IGPO (arXiv 2510.14967): A = A_episode + omega * A_step, A_step the discounted sum of a
    turn's and its later turns' information gains (how much each observation raised the policy's
    probability of the gold answer), normalised in the group (learner/step_credit.py)."""

    type: Literal["igpo"] = "igpo"
    """Turn credit by information gain; scored by the learner's model (not with ZeRO-3 over
    several ranks)."""
    omega: float = Field(1.0, ge=0, le=10)
    """Weight of the step-level advantage."""
    gamma: float = Field(1.0, gt=0, le=1)
    """Discount of a later turn's gain."""
    eps: float = Field(1e-6, ge=0, le=1)
    """Added to the group's std of the gains before dividing."""


STEP_CREDITS = (NoStepCredit, GigpoStepCredit, IgpoStepCredit)
"""`learner.step_credit.type` -> its section; the first is the default."""
StepCreditConfig = backend_union(STEP_CREDITS)


class GigpoAdvantage(GigpoStepCredit):
    """GiGPO as its paper states it: GRPO's episode advantage (eps) + omega * GiGPO's step
    advantage (learner/step_credit.py). For the stratified blend in its place, keep
    learner.advantage stratified and set learner.step_credit.type gigpo."""


class IgpoAdvantage(IgpoStepCredit):
    """IGPO as its paper states it: GRPO's episode advantage (eps) + omega * the information
    gain step advantage (learner/step_credit.py). For the stratified blend in its place, keep
    learner.advantage stratified and set learner.step_credit.type igpo."""


class GaeAdvantage(Section):
    """PPO's GAE with a learned critic (Search-R1's PPO baseline; learner/gae.py, learner/critic.py):
    an advantage per generated token, observation tokens skipped."""

    type: Literal["gae"] = "gae"
    """GAE over the generated tokens with a critic trained on the same ranks."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount per generated token."""
    lam: float = Field(1.0, ge=0, le=1)
    """GAE's lambda: 1 is the Monte Carlo return minus V, 0 one-step TD."""
    critic_lr: float | None = Field(None, gt=0, le=1)
    """The critic's peak learning rate (AdamW, the policy's schedule); null: learner.lr."""
    value_clip: float | None = Field(0.5, gt=0)
    """PPO's value clip: V moves at most this far from its value before the step; null: off."""


ADVANTAGES = (
    StratifiedAdvantage,
    GrpoAdvantage,
    DrGrpoAdvantage,
    RlooAdvantage,
    McGrpoAdvantage,
    ReinforcePpAdvantage,
    ReinforcePpBaselineAdvantage,
    GigpoAdvantage,
    IgpoAdvantage,
    GaeAdvantage,
)
"""`learner.advantage.type` -> its section; the first is the default. The episode-level ones are
learner/estimators.py's; gigpo and igpo add their step credit to GRPO's; gae is the critic's."""


class PluginSection(Section):
    """A section whose `type` names a plug-in and whose other keys are its parameters."""

    model_config = ConfigDict(extra="allow")
    KIND: ClassVar[str] = ""
    """The plug-in kind (pipeline/plugins.py) `type` names."""
    LEADING: ClassVar[int] = 0
    """Positional parameters every plug-in of the kind takes before its own ones."""
    BUILTIN: ClassVar[tuple[str, ...]] = ()
    type: str
    """A plug-in's entry-point name or an import string `package.module:attr` /
    `path/to/file.py:attr`."""

    @classmethod
    def takes(cls, found: Any) -> tuple[Any, tuple[str, ...], tuple[str, ...]]:
        """(callable, its parameters, those without a default) of the resolved plug-in: a
        registry entry (`.params`) as is, else a callable's parameters after the kind's leading
        positional ones."""
        if hasattr(found, "params"):
            made = getattr(found, "make", None) or found.fn
            return made, tuple(found.params), ()
        if not callable(found):
            raise ValueError(f"the plug-in is a {type(found).__name__}, not a callable")
        try:
            listed = list(inspect.signature(found).parameters.values())
        except (TypeError, ValueError):  # builtins without a signature: no parameters of its own
            return found, (), ()
        own = [
            p for p in listed[cls.LEADING :] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        required = tuple(p.name for p in own if p.default is p.empty)
        return found, tuple(p.name for p in own), required

    @model_validator(mode="before")
    @classmethod
    def _plugin_parameters(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        name = data.get("type")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(
                f"must be one of {', '.join(cls.BUILTIN)}, a plug-in's name or an import "
                f"string package.module:attr, not {shown(name)}"
            )
        made, params, required = cls.takes(resolve(cls.KIND, name))
        given = [k for k in data if k != "type"]
        unknown = [k for k in given if k not in params]
        if unknown:
            raise ValueError(
                f"the plug-in takes {', '.join(params) or 'no parameters'}, not "
                f"{', '.join(unknown)}: remove {'it' if len(unknown) == 1 else 'them'}"
            )
        missing = [k for k in required if k not in data]
        if missing:
            raise ValueError(f"the plug-in needs {', '.join(missing)}: give it in this section")
        filled = dict(data)
        defaults = {}
        if not hasattr(made, "params"):
            try:
                defaults = {p.name: p.default for p in inspect.signature(made).parameters.values()}
            except (TypeError, ValueError):
                defaults = {}
        for key in params:  # defaults spelled out, as a dumped config has them, when plain
            if key not in filled and _plain(defaults.get(key, inspect.Parameter.empty)):
                filled[key] = defaults[key]
        cls.register(name, made, tuple(k for k in params if k in filled))
        PLUGGED[cls.KIND].add(name)
        return filled

    @classmethod
    def register(cls, name: str, made: Any, params: tuple[str, ...]) -> None:
        """Put the plug-in into its kind's registry under `name`, so the code that looks a
        built-in up by `type` finds it the same way (in every process that validates the config)."""
        raise NotImplementedError


def _plain(value: object) -> bool:
    """Whether `value` is a YAML scalar or a list / mapping of them (a default a dump can hold)."""
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def with_plugins(classes: tuple[type[Section], ...], plugin: type[PluginSection]) -> Any:
    """`backend_union(classes)`, and `plugin` for any other `type` string. The plug-in's tag is
    "type", so a refusal's location reads `<section>.type = <what the config gave>`."""
    tags = [c.model_fields["type"].default for c in classes]
    members = [Annotated[c, Tag(t)] for c, t in zip(classes, tags, strict=True)]

    def pick(value: object) -> str | None:
        if isinstance(value, dict):
            tag = value.get("type", tags[0])
            return tag if isinstance(tag, str) and tag in tags else "type"
        return "type" if isinstance(value, plugin) else getattr(value, "type", None)

    union = Union[(*members, Annotated[plugin, Tag("type")])]
    return Annotated[union, Discriminator(pick)]


class PluginAdvantage(PluginSection):
    """A plug-in estimator: `fn(rewards, group_ids, strata, **params)` returning
    learner.estimators.Estimate or a tensor of advantages (every trajectory kept), from an entry
    point of strata.estimators or an import string; this section's other keys are its keyword
    parameters (checked against its signature)."""

    KIND: ClassVar[str] = "estimators"
    LEADING: ClassVar[int] = 3
    BUILTIN: ClassVar[tuple[str, ...]] = tuple(c.model_fields["type"].default for c in ADVANTAGES)

    @classmethod
    def register(cls, name: str, made: Any, params: tuple[str, ...]) -> None:
        from learner import estimators  # torch: only for a plug-in estimator

        def fn(rewards, group_ids, strata, **kwargs) -> estimators.Estimate:
            out = made(rewards, group_ids, strata, **kwargs)
            if isinstance(out, estimators.Estimate):
                return out
            advantages = estimators.torch.as_tensor(out, dtype=rewards.dtype)
            return estimators.Estimate(advantages, estimators.torch.ones_like(rewards).bool())

        estimators.ESTIMATORS[name] = estimators.Estimator(fn, params)


AdvantageConfig = with_plugins(ADVANTAGES, PluginAdvantage)


class ToolCallsStrata(Section):
    """The paper's stratifier: stratum k = k tool calls."""

    type: Literal["tool_calls"] = "tool_calls"
    """The number of tool calls."""


class ToolSignatureStrata(Section):
    """Counts per tool: two searches and a python call differ from three searches."""

    type: Literal["tool_signature"] = "tool_signature"
    """The count of each tool (actors.tools), up to actors.max_turns each."""


class RandomStrata(Section):
    """Random strata: the paper's structure-blind control (its Table 7)."""

    type: Literal["random"] = "random"
    """A hash of the seed and the trajectory's key, in [0, k)."""
    k: int = Field(2, ge=1, le=1024)
    """Number of strata."""
    seed: int = Field(0, ge=0)
    """Seed of the assignment."""


STRATIFIERS = (ToolCallsStrata, ToolSignatureStrata, RandomStrata)
"""`learner.stratifier.type` -> its section; the first is the default."""


class PluginStratifier(PluginSection):
    """A plug-in stratifier: a factory `make(tools, max_calls, **params)` returning a callable
    `(tool_calls, keys) -> one int stratum per trajectory` (buffers/strata.py), from an entry
    point of strata.stratifiers or an import string; this section's other keys are its keyword
    parameters (checked against its signature)."""

    KIND: ClassVar[str] = "stratifiers"
    LEADING: ClassVar[int] = 2
    BUILTIN: ClassVar[tuple[str, ...]] = tuple(c.model_fields["type"].default for c in STRATIFIERS)

    @classmethod
    def register(cls, name: str, made: Any, params: tuple[str, ...]) -> None:
        strata.STRATIFIERS[name] = strata.Registered(made, params)


StratifierConfig = with_plugins(STRATIFIERS, PluginStratifier)


class NoImportance(Section):
    """No correction: the PPO ratio is taken against the proximal policy as it is."""

    type: Literal["none"] = "none"
    """No importance correction."""


class TisImportance(Section):
    """Truncated importance sampling: the loss times min(w, cap)."""

    type: Literal["tis"] = "tis"
    """Truncated importance sampling."""
    cap: float = Field(2.0, gt=1)
    """Truncation of the weight w = pi_prox / pi_behav."""


class MaskImportance(Section):
    """Tokens whose weight exceeds cap are dropped from the loss."""

    type: Literal["mask"] = "mask"
    """One-sided token mask."""
    cap: float = Field(2.0, gt=1)
    """Tokens with w = pi_prox / pi_behav above this are dropped."""


class IcePopImportance(Section):
    """IcePop: tokens whose weight lies outside [floor, cap] are dropped."""

    type: Literal["icepop"] = "icepop"
    """Two-sided token mask."""
    floor: float = Field(0.5, ge=0, lt=1)
    """Tokens with w = pi_prox / pi_behav below this are dropped."""
    cap: float = Field(2.0, gt=1)
    """Tokens with w above this are dropped."""


class SeqMaskImportance(Section):
    """Sequence-level masked IS: sequences whose geometric-mean weight leaves [floor, cap] are dropped."""

    type: Literal["seq_mask"] = "seq_mask"
    """Sequence mask."""
    floor: float = Field(0.5, ge=0, lt=1)
    """Sequences whose geometric-mean w = pi_prox / pi_behav is below this are dropped."""
    cap: float = Field(2.0, gt=1)
    """Sequences whose geometric-mean w is above this are dropped."""


IMPORTANCE = (NoImportance, TisImportance, MaskImportance, IcePopImportance, SeqMaskImportance)
"""`learner.importance.type` -> its section; the first is the default."""
ImportanceConfig = backend_union(IMPORTANCE)
