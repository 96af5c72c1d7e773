"""The hop's speed: how fast a run's chains learn their second hop, relative to how fast the run
moves between strata, read from its first policy versions in the trap bandit's terms (its
`--hop-speed`).

Whether the blend rescues a trapped policy is a race. Damping moves the chain share away from
chaining more slowly (the stratum's speed), which helps only if the hops are learned while there
are still chains to learn them on (the hop's speed). The bandit (`trap.py`) has both as
parameters: its stratum logits move at lr, its hop logits at lr times `hop_speed`. A run's first
versions show both on its two-hop questions:

- the chains' pay velocity: the least-squares slope, over policy versions, of the reward of the
  trajectories with two or more searches;
- the stratum's velocity: the slope of the chain share (1 for a trajectory with two or more
  searches, 0 for the rest).

The bandit matched to the run (P(chain) p0, depth M, a guess paying p_guess, the run's group size
and estimator: `diagnose.py`) moves at its start, per step at lr 1 and hop speed 1, by exactly
(`trap_exact.expected_update`: u_s and u_h its expected stratum and hop updates; c = p0, q = 1/M):

    chain share    dc/dt    = 2 c (1 - c) u_s
    chains' pay    d(q²)/dt = 2 q² (1 - q) (1 + 1 / (M - 1)) u_h

Each observed slope over the bandit's says how fast the run moves in bandit steps a version; the
ratio of the two is the hop's speed relative to the stratum's, what the bandit calls hop speed:

    hop speed = (pay slope / d(q²)/dt) / (share slope / dc/dt)

Its 95% interval is the percentiles of the same ratio over bootstrap draws of questions (a
question's trajectories share its difficulty), clipped at 0: chains whose pay fell have hops
that did not learn. The speed is not measured (None, with the reason) where the stratum's own
speed is not seen: the share slope's interval reaches 0 or lies on the side opposite the
bandit's, or the bandit's stratum does not move at all (pure SAN, or chains that pay what a
guess pays): a speed relative to a stratum that does not move is not defined.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from learner.estimators import ESTIMATORS
from pipeline.experiments.searches import Trajectories
from pipeline.experiments.trap_exact import expected_update


@dataclass(frozen=True)
class HopSpeed:
    versions: int
    """Policy versions read: 0 to versions - 1."""
    questions: int
    """Two-hop questions, the bootstrap's units."""
    chains: int
    """Trajectories with two or more searches: the pay slope's points."""
    pay_slope: float
    """The chains' pay, per version (NaN: chains at fewer than two versions)."""
    pay_slope_ci: tuple[float, float]
    share_slope: float
    """The chain share, per version."""
    share_slope_ci: tuple[float, float]
    bandit_pay: float
    """The matched bandit's chains' pay, per step at hop speed 1, at its start."""
    bandit_share: float
    """The matched bandit's chain share, per step, at its start."""
    speed: float | None
    """The hop speed (None: not measured, `reason` says why)."""
    speed_ci: tuple[float, float] | None
    reason: str
    """Why the speed is not measured ("" when it is)."""


def estimator_of(advantage: dict[str, Any]) -> tuple[str, dict[str, float]]:
    """The estimator name and parameters of a run's `learner.advantage` section, as
    `learner.estimators.estimate` takes them (its own defaults for those not written)."""
    name = advantage.get("type") or "stratified"
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}: use {', '.join(ESTIMATORS)}")
    return name, {p: float(advantage[p]) for p in ESTIMATORS[name].params if p in advantage}


def bandit_velocities(
    p0: float,
    depth: int,
    p_guess: float,
    group_size: int,
    estimator: str = "stratified",
    params: dict[str, float] | None = None,
) -> tuple[float, float]:
    """(chain share, chains' pay) per step of the matched bandit at its start, lr 1, hop speed 1."""
    found = expected_update(p0, 1 / depth, p_guess, group_size, estimator, **(params or {}))
    q = 1 / depth
    share = 2 * p0 * (1 - p0) * found.stratum
    pay = 2 * q * q * (1 - q) * (1 + 1 / (depth - 1)) * found.hop
    return share, pay


def _slopes(
    version: np.ndarray, y: np.ndarray, cluster: np.ndarray, clusters: int, draws: np.ndarray
) -> tuple[float, np.ndarray]:
    """The least-squares slope of `y` on `version`, and the same on each row of `draws` (cluster
    indices drawn with replacement), from each cluster's sums. NaN where the versions do not
    vary."""
    v = version.astype(float)
    sums = np.stack(
        [np.bincount(cluster, weights=w, minlength=clusters) for w in (np.ones_like(v), v, v * v)]
        + [np.bincount(cluster, weights=w, minlength=clusters) for w in (y, v * y)]
    )

    def slope(s: np.ndarray) -> np.ndarray:
        n, sv, svv, sy, svy = s
        spread = n * svv - sv * sv
        ok = spread > 1e-9 * np.maximum(n * svv, 1.0)
        return np.where(ok, (n * svy - sv * sy) / np.where(ok, spread, 1.0), np.nan)

    return float(slope(sums.sum(axis=1))), slope(sums[:, draws].sum(axis=2))


def _interval(values: np.ndarray) -> tuple[float, float]:
    finite = values[np.isfinite(values)]
    if not len(finite):
        return float("nan"), float("nan")
    low, high = np.percentile(finite, [2.5, 97.5])
    return float(low), float(high)


def measure(
    early: Trajectories,
    versions: int,
    bandit_share: float,
    bandit_pay: float,
    resamples: int = 2000,
    seed: int = 0,
) -> HopSpeed:
    """The hop speed from `early`, a run's two-hop trajectories of policy versions below
    `versions`, against the matched bandit's velocities (`bandit_velocities`)."""
    ids, cluster = np.unique(early.question, return_inverse=True)
    chain = early.searches >= 2
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(ids), (resamples, len(ids)))
    share, shares = _slopes(early.version, chain.astype(float), cluster, len(ids), draws)
    pay, pays = _slopes(early.version[chain], early.reward[chain], cluster[chain], len(ids), draws)
    share_ci, pay_ci = _interval(shares), _interval(pays)
    reason = ""
    if len(np.unique(early.version)) < 2:
        reason = "the trajectories are of one policy version: nothing has moved yet"
    elif not np.isfinite(pay):
        reason = "chains at fewer than two policy versions: their pay has no slope"
    elif bandit_share == 0 or bandit_pay <= 0:
        reason = (
            "the matched bandit's chain share does not move at its start (no trap to race)"
            if bandit_share == 0
            else "the matched bandit's hops do not learn at its start"
        )
    elif not (share_ci[0] > 0 or share_ci[1] < 0):
        reason = (
            f"the chain share did not move detectably ({share:+.4f} a version, 95% interval "
            f"[{share_ci[0]:+.4f}, {share_ci[1]:+.4f}]): read more versions or pool more runs"
        )
    elif (share > 0) != (bandit_share > 0):
        reason = (
            f"the chain share moved {'up' if share > 0 else 'down'} ({share:+.4f} a version) "
            f"where the matched bandit's moves {'up' if bandit_share > 0 else 'down'}"
        )
    speed = speed_ci = None
    if not reason:
        ratio = (pays / bandit_pay) / (shares / bandit_share)
        speed = max(0.0, (pay / bandit_pay) / (share / bandit_share))
        low, high = _interval(ratio)
        speed_ci = (max(0.0, low), max(0.0, high))
    return HopSpeed(
        versions,
        len(ids),
        int(chain.sum()),
        pay,
        pay_ci,
        share,
        share_ci,
        bandit_pay,
        bandit_share,
        speed,
        speed_ci,
        reason,
    )


def line(h: HopSpeed) -> str:
    """The measurement in one line."""
    seen = (
        f"chains' pay {h.pay_slope:+.4f} a version [{h.pay_slope_ci[0]:+.4f}, "
        f"{h.pay_slope_ci[1]:+.4f}], chain share {h.share_slope:+.4f} [{h.share_slope_ci[0]:+.4f}, "
        f"{h.share_slope_ci[1]:+.4f}] (versions 0-{h.versions - 1}, {h.questions} questions, "
        f"{h.chains} chains); the matched bandit at hop speed 1: {h.bandit_pay:+.4f} and "
        f"{h.bandit_share:+.4f} a step"
    )
    if h.speed is None or h.speed_ci is None:
        return f"hop speed: not measured, {h.reason} ({seen})"
    return (
        f"hop speed {h.speed:.2f}, 95% interval [{h.speed_ci[0]:.2f}, {h.speed_ci[1]:.2f}] "
        f"(the hops' speed over the stratum's, each against the bandit's: {seen})"
    )
