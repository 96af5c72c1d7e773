"""Step-level credit: GiGPO's step groups and advantages against a loop written from the paper's
equations (arXiv 2505.10978, eqs. 6-8), its composition with the episode's advantage, and the
edge cases (a turn alone in its state, equal returns, a trajectory of one turn)."""

import math
import random
import statistics

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from buffers.records import Group
from buffers.testing import synthetic_trajectory
from learner import step_credit
from learner.algorithm import plan_step
from learner.step_credit import (
    STEP_CREDITS,
    Registered,
    gigpo,
    igpo,
    register_step_credit,
    step_advantages,
    turns,
)
from pipeline.config.schema import LearnerConfig


def agent_trajectory(prompt, index, searches, reward, seed=0):
    """Turns of 3 generated tokens; after each but the last, the observation of its query (2
    tokens, the same for the same query)."""
    rng = random.Random(seed * 1000 + index)
    ids, mask = [], []
    for query in searches:
        ids += [rng.randrange(100, 200) for _ in range(3)]
        mask += [1, 1, 1]
        ids += [query, query + 1]  # what the search returned for this query
        mask += [0, 0]
    ids += [rng.randrange(100, 200) for _ in range(3)]  # the answering turn
    mask += [1, 1, 1]
    t = synthetic_trajectory(prompt, index, tokens=len(ids), reward=reward, seed=seed)
    t.token_ids = np.array(ids, dtype=np.int32)
    t.loss_mask = np.array(mask, dtype=np.int8)
    t.behavior_logprobs = np.where(t.loss_mask == 1, -1.0, 0.0).astype(np.float32)
    t.token_versions = np.where(t.loss_mask == 1, 0, -1).astype(np.int32)
    t.tool_names = ["search"] * len(searches)
    t.stratum = len(searches)
    return t


def loop_gigpo(trajectories, groups, gamma, eps):
    """The paper's step advantage as loops: state of turn k = the observations before it;
    return = gamma^(K-1-k) * reward; normalised among the group's turns in the same state."""
    steps = []  # (trajectory, turn, group, state, return)
    for i, t in enumerate(trajectories):
        spans, observations, in_obs, current = [], [], False, []
        for pos, (tok, m) in enumerate(
            zip(t.token_ids.tolist(), t.loss_mask.tolist(), strict=True)
        ):
            if m == 0:
                current.append(tok)
                in_obs = True
                continue
            if in_obs:
                observations.append(tuple(current))
                current, in_obs = [], False
            if not spans or spans[-1][1] != pos:
                spans.append([pos, pos + 1, tuple(observations)])
            else:
                spans[-1][1] = pos + 1
        for k, (start, end, state) in enumerate(spans):
            steps.append(
                (i, start, end, groups[i], state, gamma ** (len(spans) - 1 - k) * t.reward)
            )
    out = [[0.0] * len(t.token_ids) for t in trajectories]
    for i, start, end, g, state, ret in steps:
        same = [s[5] for s in steps if s[3] == g and s[4] == state]
        if len(same) < 2:
            continue
        mean, std = statistics.fmean(same), statistics.pstdev(same)
        for p in range(start, end):
            out[i][p] = (ret - mean) / (std + eps)
    return out


queries = st.lists(st.sampled_from([10, 20, 30]), min_size=0, max_size=3)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(queries, st.sampled_from([0.0, 1.0, 0.5])), min_size=1, max_size=8),
    st.sampled_from([1.0, 0.9, 0.5]),
)
def test_gigpo_equals_the_papers_loop(members, gamma):
    trajectories = [
        agent_trajectory(f"p{i % 2}", i, searches, reward)
        for i, (searches, reward) in enumerate(members)
    ]
    groups = [i % 2 for i in range(len(members))]
    got = gigpo(trajectories, torch.tensor(groups), gamma=gamma, eps=1e-6)
    want = loop_gigpo(trajectories, groups, gamma, 1e-6)
    for g, w in zip(got, want, strict=True):
        assert g.tolist() == pytest.approx(w, abs=1e-5)


def test_turns_and_states_of_an_agent_trajectory():
    t = agent_trajectory("p", 0, [10, 20], 1.0)
    assert turns(t) == [(0, 3, ()), (5, 8, ((10, 11),)), (10, 13, ((10, 11), (20, 21)))]


def test_gigpo_credits_the_turn_after_the_search_that_paid_and_composes_with_the_episode():
    """Two members searched 10 first; then one searched 20 (and was right), one 30 (wrong):
    their second turns stand in the same state (they saw the same first result), so GiGPO tells
    them apart there; the first turns of all four share the prompt's state."""
    members = [
        agent_trajectory("p", 0, [10, 20], 1.0),
        agent_trajectory("p", 1, [10, 30], 0.0),
        agent_trajectory("p", 2, [], 0.0),
        agent_trajectory("p", 3, [], 1.0),
    ]
    config = LearnerConfig(
        advantage={"type": "grpo"}, step_credit={"type": "gigpo", "omega": 0.5, "gamma": 0.9}
    )
    plan = plan_step([Group("p", tuple(members))], config)
    episode = plan.advantages.tolist()
    first = [0.81, 0.0, 0.0, 1.0]  # gamma^(turns after) * reward of each member's first turn
    mean, std = statistics.fmean(first), statistics.pstdev(first)
    for i, t in enumerate(members):
        (start, end, _), *_ = turns(t)
        want = episode[i] + 0.5 * (first[i] - mean) / (std + 1e-6)
        assert plan.per_token[i][start:end].tolist() == pytest.approx([want] * 3, abs=1e-5)
    second = [0.9, 0.0]  # members 0 and 1 after the same first observation
    for i in (0, 1):
        start, end, _ = turns(members[i])[1]
        step = (second[i] - 0.45) / (0.45 + 1e-6)
        assert plan.per_token[i][start:end].tolist() == pytest.approx(
            [episode[i] + 0.5 * step] * 3, abs=1e-5
        )
    for i in (0, 1):  # the answering turns: each alone in its state (different second results)
        start, end, _ = turns(members[i])[2]
        assert plan.per_token[i][start:end].tolist() == pytest.approx([episode[i]] * 3)
    assert math.isclose(sum(episode), 0.0, abs_tol=1e-9)
    moved = [  # what the step credit added, over the generated tokens of all four
        abs(float(plan.per_token[i][p]) - episode[i])
        for i, t in enumerate(members)
        for p in range(len(t.token_ids))
        if t.loss_mask[p]
    ]
    assert plan.metrics["step_advantage_abs_mean"] == pytest.approx(statistics.fmean(moved))


def test_gigpo_is_refused_beside_turn_credit():
    with pytest.raises(ValueError, match="use one"):
        LearnerConfig(step_credit={"type": "gigpo"}, turn_credit=0.2)
    LearnerConfig(step_credit={"type": "gigpo"})
    with pytest.raises(ValueError, match="omega"):
        LearnerConfig(step_credit={"type": "none", "omega": 1.0})  # a key none does not have


def loop_igpo(trajectories, groups, gamma, eps, chance):
    """IGPO as loops: P_k = chance(trajectory, start of turn k); IG_k = P_{k+1} - P_k for each
    turn followed by an observation; z-scored over the group's such turns; A_step(k) = sum over
    k' >= k of gamma^(k'-k) * normalised IG_k'; the answering turn 0."""
    spans = [turns(t) for t in trajectories]
    gains = []  # (i, k, group, IG)
    for i, (t, s) in enumerate(zip(trajectories, spans, strict=True)):
        for k in range(len(s) - 1):
            gains.append((i, k, groups[i], chance(t, s[k + 1][0]) - chance(t, s[k][0])))
    norm = {}
    for i, k, g, ig in gains:
        same = [x[3] for x in gains if x[2] == g]
        std = statistics.pstdev(same) if len(same) > 1 else 0.0
        norm[i, k] = (ig - statistics.fmean(same)) / (std + eps) if len(same) > 1 else 0.0
    out = [[0.0] * len(t.token_ids) for t in trajectories]
    for i, s in enumerate(spans):
        for k in range(len(s) - 1):
            value = sum(gamma ** (j - k) * norm[i, j] for j in range(k, len(s) - 1))
            for p in range(s[k][0], s[k][1]):
                out[i][p] = value
    return out


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(queries, st.sampled_from([0.0, 1.0])), min_size=1, max_size=8),
    st.sampled_from([1.0, 0.8]),
    st.integers(0, 1000),
)
def test_igpo_equals_the_papers_loop(members, gamma, salt):
    from learner.step_credit import igpo

    trajectories = [
        agent_trajectory(f"p{i % 2}", i, searches, reward)
        for i, (searches, reward) in enumerate(members)
    ]
    groups = [i % 2 for i in range(len(members))]

    def chance(t, cut):  # any deterministic probability of the gold answer at a cut
        return random.Random(hash((t.sample_index, cut, salt))).random()

    def scorer(items):
        return [math.log(max(chance(t, cut), 1e-300)) for t, cut in items]

    got = igpo(trajectories, torch.tensor(groups), gamma=gamma, eps=1e-6, scorer=scorer)
    want = loop_igpo(trajectories, groups, gamma, 1e-6, chance)
    for g, w in zip(got, want, strict=True):
        assert g.tolist() == pytest.approx(w, abs=1e-4)


def test_igpo_is_refused_where_rank_0_cannot_run_the_model_alone():
    with pytest.raises(ValueError, match="use zero_stage 0-2 or one rank"):
        LearnerConfig(step_credit={"type": "igpo"}, zero_stage=3, num_ranks=2)
    LearnerConfig(step_credit={"type": "igpo"}, zero_stage=2, num_ranks=2)


def test_a_step_credit_registers_once_under_its_name_with_its_parameters(monkeypatch):
    monkeypatch.setattr(step_credit, "STEP_CREDITS", dict(STEP_CREDITS))

    def probe(trajectories, group_ids, *, gamma):
        return []

    register_step_credit("probe", probe, "gamma")
    register_step_credit("scored", probe, "gamma", scored=True)
    assert step_credit.STEP_CREDITS["probe"] == Registered(probe, ("gamma",), False)
    assert step_credit.STEP_CREDITS["scored"] == Registered(probe, ("gamma",), True)
    with pytest.raises(ValueError, match="step credit 'gigpo' is registered twice"):
        register_step_credit("gigpo", probe)
    assert step_credit.STEP_CREDITS["gigpo"] == STEP_CREDITS["gigpo"]


def test_igpo_needs_a_scorer_and_calls_it_only_with_something_to_score():
    members = [agent_trajectory("p", i, [7, 9][: i + 1], float(i)) for i in range(2)]
    groups, episode = torch.tensor([0, 0]), torch.tensor([0.25, -0.5])
    with pytest.raises(
        ValueError, match=r"^step credit igpo scores the gold answer with the policy: no scorer$"
    ):
        step_advantages("igpo", members, groups, episode, 0.5, gamma=1.0, eps=1e-6)
    asked = []

    def scorer(items):
        asked.append(len(items))
        return [-float(cut) for _, cut in items]

    got = step_advantages("igpo", members, groups, episode, 0.5, scorer, gamma=1.0, eps=1e-6)
    steps = igpo(members, groups, gamma=1.0, eps=1e-6, scorer=scorer)
    for a, s, g in zip(episode.tolist(), steps, got, strict=True):
        assert g.tolist() == pytest.approx((a + 0.5 * s).tolist())
    assert asked[0] > 0 and any(float(s.abs().max()) > 0 for s in steps)

    def refuse(items):
        raise AssertionError("nothing to score: the scorer (a forward pass) is not called")

    assert igpo([], torch.tensor([], dtype=torch.int64), gamma=1.0, eps=1e-6, scorer=refuse) == []


def test_gigpo_and_igpo_with_a_large_eps_or_none_follow_their_loops():
    """eps 0.5 weighs in the denominator (the loops' (x - mean) / (std + eps)); eps 0 on equal
    returns or gains gives 0, not a division by 0; a flat step group before a spread one does
    not stop the spread one's normalisation."""
    members = [agent_trajectory("p", i, [7, 9][: i % 3], [1.0, 0.0, 0.5][i % 3]) for i in range(4)]
    groups = [0, 0, 0, 0]
    got = gigpo(members, torch.tensor(groups), gamma=0.9, eps=0.5)
    want = loop_gigpo(members, groups, 0.9, 0.5)
    assert any(max(abs(x) for x in w) > 0.1 for w in want)
    for g, w in zip(got, want, strict=True):
        assert g.tolist() == pytest.approx(w, abs=1e-6)
    # group 0 flat (two one-turn members rewarded alike), then group 1 spread
    flat_first = [agent_trajectory(f"p{i // 2}", i, [], [1.0, 1.0, 1.0, 0.0][i]) for i in range(4)]
    got = gigpo(flat_first, torch.tensor([0, 0, 1, 1]), gamma=0.9, eps=0.0)
    assert [float(g.abs().max()) for g in got] == [0.0, 0.0, 1.0, 1.0]

    def chance(t, cut):
        return random.Random(hash((t.sample_index, cut, 3))).random()

    def scorer(items):
        return [math.log(chance(t, cut)) for t, cut in items]

    searchers = [agent_trajectory("p", i, [7, 9, 11][: 1 + i % 3], 1.0) for i in range(4)]
    got = igpo(searchers, torch.tensor(groups), gamma=0.9, eps=0.5, scorer=scorer)
    want = loop_igpo(searchers, groups, 0.9, 0.5, chance)
    assert any(max(abs(x) for x in w) > 0.1 for w in want)
    for g, w in zip(got, want, strict=True):
        assert g.tolist() == pytest.approx(w, abs=1e-6)
    same = igpo(
        searchers,
        torch.tensor(groups),
        gamma=0.9,
        eps=0.0,
        scorer=lambda items: [-1.0] * len(items),
    )
    assert all(float(s.abs().max()) == 0.0 for s in same)


def test_an_observation_before_the_first_generated_token_is_the_first_turns_state():
    t = agent_trajectory("p", 0, [7], 1.0)
    t.token_ids = np.array([42, *t.token_ids.tolist()], dtype=np.int32)
    t.loss_mask = np.array([0, *t.loss_mask.tolist()], dtype=np.int8)
    spans = turns(t)
    assert spans[0] == (1, 4, ((42,),))
    assert spans[1][2] == ((42,), (7, 8))
