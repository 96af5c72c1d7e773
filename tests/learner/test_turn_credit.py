"""Turn-level credit (learner/turn_credit.py) against its rules written as a loop over
trajectories: "found it" normalised per group as GRPO would, the early and late advantages of a
member that found the answer and of one that did not, and the split of a row's tokens at the
finding observation."""

import statistics

import pytest
import torch

from buffers.testing import synthetic_trajectory
from learner.turn_credit import finding_advantage, found_answer, token_advantages, turn_credit

# per trajectory: its group and the token of its finding observation (-1: found nothing; 0
# and 1, the edges of an early part); a group of four split two and two, a group whose members
# all found it, and a group of one
GROUPS = [5, 5, 5, 5, 2, 2, 2, 9]
FIRST = [4, -1, 11, -1, 0, 7, 1, 6]
ADVANTAGES = [0.8, -0.4, -1.2, 0.5, 0.3, -0.7, 1.1, -0.9]


def trajectories(first: list[int]):
    out = []
    for i, token in enumerate(first):
        t = synthetic_trajectory("p", i, tokens=12)
        if token >= 0:
            t.first_answer_turn, t.first_answer_token = 0, token
        out.append(t)
    return out


def loop_finding(found: list[bool], groups: list[int], eps: float) -> list[float]:
    """(f - mean) / (pstdev + eps) over each trajectory's group; 0 in a group of one."""
    out = []
    for g in groups:
        f = [float(x) for x, h in zip(found, groups, strict=True) if h == g]
        mean, std = statistics.fmean(f), statistics.pstdev(f)
        out.append(0.0 if len(f) < 2 else (float(found[len(out)]) - mean) / (std + eps))
    return out


def test_found_answer_is_whether_a_finding_observation_was_recorded():
    assert found_answer(trajectories(FIRST)).tolist() == [t >= 0 for t in FIRST]
    assert found_answer(trajectories(FIRST)).dtype == torch.bool


@pytest.mark.parametrize("eps", [1e-6, 0.25])
def test_the_finding_advantage_is_found_it_normalised_in_its_group(eps):
    found = torch.tensor([t >= 0 for t in FIRST])
    got = finding_advantage(found, torch.tensor(GROUPS), eps)
    assert got.dtype == torch.float64
    want = loop_finding(found.tolist(), GROUPS, eps)
    assert got.tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert want[0] > 0 > want[1] and want[4:] == [0.0] * 4  # both signs; all found; one alone


@pytest.mark.parametrize("beta", [0.3, 1.5])
def test_a_finder_is_credited_before_its_finding_and_judged_by_the_outcome_after(beta):
    eps = 0.25
    batch = trajectories(FIRST)
    advantages = torch.tensor(ADVANTAGES, dtype=torch.float64)
    late, early = turn_credit(batch, torch.tensor(GROUPS), advantages, beta, eps)
    credit = loop_finding([t >= 0 for t in FIRST], GROUPS, eps)
    for i, (a, f, token) in enumerate(zip(ADVANTAGES, credit, FIRST, strict=True)):
        if token >= 0:  # found it: max(A, 0) + beta F before, A from the observation on
            assert early[i] == pytest.approx(max(a, 0.0) + beta * f, abs=1e-12)
            assert late[i] == pytest.approx(a, abs=1e-12)
        else:  # found nothing: A + beta F (F < 0 here) on every token
            assert late[i] == pytest.approx(a + beta * f, abs=1e-12) == early[i]
    assert early[2] > late[2] + 0.5  # a wrong finder's early turns gain what its outcome lost


def test_token_advantages_split_each_row_at_its_finding_observation():
    batch = trajectories(FIRST)
    late = torch.tensor([float(i) for i in range(len(FIRST))], dtype=torch.float64)
    early = -10.0 - late
    width = 10  # under one finding token (11): the whole row is early
    got = token_advantages(batch, late, early, width)
    assert got.dtype == torch.float32 and got.shape == (len(FIRST), width)
    for row, token in enumerate(FIRST):
        want = [float(early[row]) if j < token else float(late[row]) for j in range(width)]
        assert got[row].tolist() == want
