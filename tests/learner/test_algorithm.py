"""A step's plan (learner/algorithm.py): the chosen estimator's advantages, and per-stratum
telemetry of the advantages that train, whatever the estimator."""

import statistics

import pytest
from pydantic import BaseModel

from buffers.records import Group
from buffers.testing import synthetic_trajectory
from learner.algorithm import plan_step
from learner.estimators import ESTIMATORS

# two groups of 4: stratum = number of tool calls (0 or 2), rewards chosen so the strata differ
ROWS = [
    [(1.0, 2), (1.0, 2), (0.0, 0), (1.0, 0)],
    [(0.0, 2), (1.0, 2), (0.0, 0), (0.0, 0)],
]


def groups() -> list[Group]:
    made = []
    for g, rows in enumerate(ROWS):
        members = []
        for i, (reward, calls) in enumerate(rows):
            t = synthetic_trajectory(f"p{g}", i, reward=reward, tool_names=["search"] * calls)
            t.stratum = calls
            members.append(t)
        made.append(Group(f"p{g}", tuple(members)))
    return made


class Section(BaseModel):
    type: str
    alpha: float = 0.6
    eps: float = 1e-6


class Learner(BaseModel):
    advantage: Section
    drop_zero_variance_groups: bool = False
    turn_credit: float = 0.0


def plan(kind: str, alpha: float = 0.6):
    return plan_step(groups(), Learner(advantage=Section(type=kind, alpha=alpha)))


def gn() -> list[float]:
    """GRPO's advantages of ROWS, by hand (population std, eps 1e-6)."""
    out = []
    for rows in ROWS:
        rewards = [r for r, _ in rows]
        mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
        out += [(r - mean) / (std + 1e-6) for r in rewards]
    return out


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_telemetry_is_of_the_advantages_that_train(kind):
    step = plan(kind)
    strata = [calls for rows in ROWS for _, calls in rows]
    for stratum in (0, 2):
        trained = [a for a, s in zip(step.advantages.tolist(), strata, strict=True) if s == stratum]
        assert step.metrics[f"stratum/{stratum}/mean_advantage"] == pytest.approx(
            statistics.fmean(trained), abs=1e-9
        )


def test_the_blends_stratum_mean_is_its_residual_offset():
    """SAN is centred inside every (group, stratum) cell, so a stratum's mean blended advantage
    is (1 - alpha) times its mean GN advantage (Eq. 4's residual cross-stratum offset)."""
    strata = [calls for rows in ROWS for _, calls in rows]
    for alpha in (0.0, 0.6, 1.0):
        step = plan("stratified", alpha)
        for stratum in (0, 2):
            gn_mean = statistics.fmean(
                [a for a, s in zip(gn(), strata, strict=True) if s == stratum]
            )
            assert step.metrics[f"stratum/{stratum}/mean_advantage"] == pytest.approx(
                (1 - alpha) * gn_mean, abs=1e-6
            )
    assert plan("grpo").advantages.tolist() == pytest.approx(gn(), abs=1e-9)


def test_grpo_in_stratum_variance_is_grpos_not_the_blends():
    grpo, blend = plan("grpo"), plan("stratified", 0.6)
    assert grpo.metrics["stratum/2/in_stratum_adv_var"] != pytest.approx(
        blend.metrics["stratum/2/in_stratum_adv_var"]
    )


def latent_group(correct: int, beta: float = 0.2) -> Group:
    """A group of 8: `correct` right answers, one wrong answer whose search found the gold
    passage (reward beta, TSPO's latent reward), the rest wrong."""
    members = []
    for i in range(8):
        reward = 1.0 if i < correct else (beta if i == correct else 0.0)
        t = synthetic_trajectory("p", i, reward=reward, tool_names=["search"])
        t.stratum = 1
        if i == correct:
            t.latent_reward, t.first_answer_turn, t.first_answer_token = beta, 0, 4
        members.append(t)
    return Group("p", tuple(members))


@pytest.mark.parametrize("kind", ["grpo", "stratified"])
def test_the_latent_reward_punishes_the_finding_turns_when_others_answered_right(kind):
    """The hazard of the current reading of TSPO's latent reward (docs/architecture.md,
    Rewards): beta goes to wrong answers only, so in a group with right answers the finder's
    reward is below the group's mean and the turns it is trained on (those up to the finding
    observation) get a negative advantage; in a group of wrong answers they get a positive one."""
    learner = Learner(advantage=Section(type=kind))
    finder = plan_step([latent_group(correct=3)], learner).advantages[3]
    assert finder < 0
    alone = plan_step([latent_group(correct=0)], learner).advantages[0]
    assert alone > 0


def found_group(correct: int, finders: set[int]) -> Group:
    """A group of 8, outcome rewards only: `correct` right answers first; `finders` the members
    whose observations held a gold answer (from token 4 on)."""
    members = []
    for i in range(8):
        t = synthetic_trajectory("p", i, reward=float(i < correct), tool_names=["search"])
        t.stratum = 1
        if i in finders:
            t.first_answer_turn, t.first_answer_token = 0, 4
        members.append(t)
    return Group("p", tuple(members))


@pytest.mark.parametrize("kind", ["grpo", "stratified"])
def test_turn_credit_credits_the_finding_turns_and_judges_the_rest_by_the_outcome(kind):
    """The other reading (learner/turn_credit.py): in the hazard's group (3 right answers that
    found the gold answer, one wrong answer that found it too, 4 that found nothing), the wrong
    finder's turns up to the finding observation get a positive advantage, its later turns the
    outcome's negative one; the members that found nothing get less than the outcome gives."""
    beta = 0.3
    group = found_group(correct=3, finders={0, 1, 2, 3})
    outcome = plan_step([group], Learner(advantage=Section(type=kind)))
    step = plan_step([group], Learner(advantage=Section(type=kind), turn_credit=beta))
    f = [1.0] * 4 + [0.0] * 4
    mean, std = statistics.fmean(f), statistics.pstdev(f)
    credit = [beta * (x - mean) / (std + 1e-6) for x in f]  # +0.3 for finders, -0.3 for the rest
    a = outcome.advantages.tolist()
    assert a[3] < 0  # the outcome alone would punish the wrong finder everywhere
    assert step.advantages[3] == pytest.approx(a[3])  # its turns after the finding observation
    assert step.early[3] == pytest.approx(credit[3]) and step.early[3] > 0  # the finding turns
    for i in range(3):  # right finders: credited before, the outcome after
        assert step.early[i] == pytest.approx(a[i] + credit[i]) and step.advantages[i] == a[i]
    for i in range(4, 8):  # found nothing: the outcome and the missed finding, on every token
        assert step.advantages[i] == pytest.approx(a[i] + credit[i]) == step.early[i]
    assert step.metrics["found_answer_share"] == 0.5


def test_turn_credit_changes_nothing_where_every_member_found_it_or_none_did():
    learner = Learner(advantage=Section(type="grpo"), turn_credit=0.5)
    plain = Learner(advantage=Section(type="grpo"))
    for finders in (set(), set(range(8))):
        group = found_group(correct=0 if not finders else 5, finders=finders)
        step, outcome = plan_step([group], learner), plan_step([group], plain)
        assert step.advantages.tolist() == pytest.approx(outcome.advantages.tolist())
        if not finders:
            assert step.early.tolist() == pytest.approx(outcome.advantages.tolist())
    assert plan_step([found_group(3, {0})], plain).early is None  # off: no per-token split


def test_the_rewards_named_parts_are_averaged_per_step():
    """`reward/<name>`: each part's mean over the trajectories that carry it (a dict reward that
    failed on one trajectory carries none of its keys there); no parts, no keys."""
    made = groups()
    parts = [
        {"judge/correct": 1.0, "format": 1.0},
        {"judge/correct": 0.0, "format": 1.0},
        {"format": 0.0},  # the judge failed here
        {"judge/correct": 1.0, "format": 0.5},
    ]
    for t, p in zip(made[0].members, parts, strict=True):
        t.reward_components = p
    metrics = plan_step(made, Learner(advantage=Section(type="grpo"))).metrics
    assert metrics["reward/judge/correct"] == pytest.approx(2 / 3)
    assert metrics["reward/format"] == pytest.approx(2.5 / 4)
    assert not [k for k in plan("grpo").metrics if k.startswith("reward/")]
