"""The agent loop scores what it did (actors/agent.py, actors/scoring.py): the reward sees the
tool calls with their arguments, the observations, the turns and the row's own fields; its
named parts ride on the trajectory; a reward that fails leaves a whole trajectory scored 0."""

import asyncio

import pytest

from actors.agent import AgentLoop, AgentSettings
from actors.scoring import Term
from actors.tools import SearchTool
from tests.actors.test_agent import Script, StubClient, Task, engine  # noqa: F401 (a fixture)

TASK = Task("q1", "Where was Varno Telik born?", ("Quorvex",), extra={"hops": 2, "gold": "d1"})
STEERED = "<search> Varno Telik </search><answer> Quorvex </answer>"


def loop(engine, reward, **settings):  # noqa: F811 (the fixture's name)
    tools = {"search": SearchTool(StubClient())}
    return AgentLoop(engine, engine.tokenizer, tools, AgentSettings(reward=reward, **settings))


def test_the_reward_reads_the_calls_the_observations_and_the_rows_fields(engine):  # noqa: F811
    seen = []

    def grounded(view, task):
        seen.append((view, task))
        searched = [a["query"] for name, a in view.tool_calls if name == "search"]
        found = any(task.answers[0] in o for o in view.observations)
        return {
            "correct": float(view.answer == task.answers[0]),
            "grounded": float(found and bool(searched)),
        }

    agent = loop(engine, (Term("judge", grounded),), format_weight=0.5)
    with Script(engine, STEERED):
        t = asyncio.run(agent.run(TASK, "q1@0", 0))
    t.validate()
    ((view, task),) = seen
    assert view.tool_calls == (("search", {"query": "Varno Telik"}),)
    assert (
        len(view.observations) == 1 and "Varno Telik was born in Quorvex." in view.observations[0]
    )
    assert (view.answer, view.turns) == ("Quorvex", 2) and view.response.endswith("</answer>")
    assert (task.id, task.answers, task.data_source, task.extra) == (
        "q1",
        ("Quorvex",),
        "minigaia_l1",
        {"hops": 2, "gold": "d1"},
    )
    assert t.reward_components == {"judge/correct": 1.0, "judge/grounded": 1.0, "format": 1.0}
    assert t.reward == 1.0 + 1.0 + 0.5


def test_a_reward_that_raises_scores_0_and_the_trajectory_is_whole(engine, capsys):  # noqa: F811
    def broken(view, task):
        raise KeyError("no such column")

    agent = loop(engine, broken, latent_reward=0.3)
    with Script(engine, "<search> Varno Telik </search><answer> Paris </answer>"):
        t = asyncio.run(agent.run(TASK, "q1@0", 0))
    t.validate()  # recorded as any other: its tokens, its tools, its stratum
    assert (t.reward, t.latent_reward, t.tool_names, t.finish_reason) == (
        0.0,
        0.0,
        ["search"],
        "answer",
    )
    assert agent.stats.reward_errors == 1 and agent.stats.trajectories == 1
    assert (
        "strata: reward 'broken' raised KeyError: 'no such column': scored 0"
        in capsys.readouterr().out
    )


@pytest.mark.parametrize("reward", [None, "exact_match"])
def test_todays_reward_is_unchanged_and_has_no_parts(engine, reward):  # noqa: F811
    agent = loop(engine, reward)
    with Script(engine, STEERED):
        t = asyncio.run(agent.run(TASK, "q1@0", 0))
    assert (t.reward, t.reward_components, agent.stats.reward_errors) == (1.0, {}, 0)
