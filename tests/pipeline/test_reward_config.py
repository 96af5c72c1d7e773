"""`actors.reward`: a name, an import string, a weighted list or a remote reward; each form
loads, round-trips through the dumped config and becomes the terms the agent loop sums
(pipeline/runtime/parts.py's reward_terms); each mistake is one line."""

import asyncio
import textwrap

import pytest

from actors.reward_view import RewardTask, RewardView
from actors.rewards import REWARDS
from actors.scoring import RemoteReward, Scoring
from pipeline.config.loader import ConfigError, dump_config, load_config
from pipeline.runtime.parts import agent_settings, reward_terms

CONFIG = "configs/local.yaml"


@pytest.fixture
def plugin(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(
        textwrap.dedent(
            """
            def grounded(view, task, per_call=0.5):
                return {"correct": float(view.answer == task.answers[0]),
                        "calls": per_call * len(view.tool_calls)}

            class Judge:
                def __init__(self, scale=1.0):
                    self.scale = scale

                async def __call__(self, view, task):
                    return self.scale * float(view.answer is not None)

            NOT_A_REWARD = 3
            """
        )
    )
    return path


def load(*overrides):
    return load_config(CONFIG, [f"actors.reward={o}" for o in overrides])


def test_every_form_loads_round_trips_and_becomes_terms(plugin, tmp_path):
    forms = [
        "f1",
        f"{plugin}:grounded",
        f"{{fn: {plugin}:Judge, args: {{scale: 2}}, name: judge}}",
        f"[exact_match, {{fn: {plugin}:grounded, weight: 0.5, args: {{per_call: 1}}}}, "
        "{url: 'http://127.0.0.1:9/score', timeout_s: 2, retries: 1, weight: -1}]",
    ]
    for form in forms:
        config = load(form)
        again = tmp_path / "resolved.yaml"
        again.write_text(dump_config(config))
        assert load_config(again) == config, form

    (f1,) = reward_terms(load("f1").actors)
    assert (f1.name, f1.fn, f1.weight) == ("f1", REWARDS["f1"], 1.0)
    (judge,) = reward_terms(load(forms[2]).actors)
    assert (judge.name, judge.fn.scale) == ("judge", 2)
    em, grounded, remote = reward_terms(load(forms[3]).actors)
    assert (em.name, grounded.name, remote.name) == ("exact_match", "grounded", "remote")
    assert (grounded.weight, remote.weight, remote.timeout_s) == (0.5, -1.0, None)
    assert isinstance(remote.fn, RemoteReward) and (remote.fn.timeout_s, remote.fn.retries) == (
        2,
        1,
    )

    view = RewardView("Paris", "<answer>Paris</answer>", (("search", {"query": "q"}),), ("x",), 2)
    task = RewardTask("q", ("Paris",))
    scored = asyncio.run(Scoring([em, grounded])(view, task))
    assert scored.components == {"exact_match": 1.0, "grounded/correct": 1.0, "grounded/calls": 1.0}
    assert scored.reward == 1.0 + 0.5 * 2.0


def test_the_agent_settings_carry_the_terms_and_the_format_bonus(plugin):
    settings = agent_settings(
        load_config(CONFIG, [f"actors.reward={plugin}:grounded", "actors.format_weight=0.1"]).actors
    )
    scoring = Scoring.of(settings.reward, settings.format_weight)
    assert scoring.names == ["grounded", "format"]


@pytest.mark.parametrize(
    "reward, said",
    [
        (
            "bleu",
            "actors.reward = 'bleu': unknown reward 'bleu'; known: exact_match, f1, gaia, format",
        ),
        ("[f1, bleu]", "actors.reward = ['f1', 'bleu']: [1]: unknown reward 'bleu'"),
        (
            "{PLUGIN}:missing",
            "cannot import '{PLUGIN}:missing': AttributeError: module",
        ),
        ("{PLUGIN}:NOT_A_REWARD", "{PLUGIN}:NOT_A_REWARD is a int, not a reward function"),
        (
            "{fn: {PLUGIN}:grounded, args: {nope: 1}}",
            "actors.reward: args: got an unexpected keyword argument 'nope'",
        ),
        ("[]", "actors.reward = []: give at least one reward"),
        ("[f1, f1]", "two rewards are named 'f1': give one another name"),
        ("{fn: f1, wieght: 2}", "actors.reward: wieght: unknown key (did you mean 'weight'?)"),
        ("[f1, {fn: f1, name: g, weight: abc}]", "[1].weight: input should be a valid number"),
        (
            "{url: 'http://x', tries: 2}",
            "actors.reward: tries: unknown key (did you mean 'retries'?)",
        ),
        ("{url: 'ftp://x'}", "actors.reward: url: string should match pattern"),
        (
            "[f1, 3]",
            "[1]: must be a reward's name or import string, {fn: ...}, {url: ...}, or a list",
        ),
        ("{weight: 2}", "actors.reward: fn: field required"),
    ],
)
def test_a_reward_the_config_cannot_have_is_one_line(plugin, reward, said):
    with pytest.raises(ConfigError) as info:
        load(reward.replace("{PLUGIN}", str(plugin)))
    message = str(info.value)
    assert "\n" not in message and said.replace("{PLUGIN}", str(plugin)) in message


def test_the_format_bonus_and_a_reward_named_format_are_refused_together():
    with pytest.raises(ConfigError, match="format_weight adds the format reward under the name"):
        load_config(CONFIG, ["actors.reward=[f1, format]", "actors.format_weight=0.1"])
    assert load_config(CONFIG, ["actors.reward=[f1, {fn: format, weight: 0.1}]"])
