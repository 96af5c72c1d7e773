"""pipeline/plugins.py: names, entry points and import strings, and their one-line refusals."""

import re
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from pipeline.config.loader import ConfigError, dump_config, load_config
from pipeline.plugins import PluginError, available, origin, resolve


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """A package installed the way pip leaves one: its module and a dist-info with
    entry_points.txt on a sys.path entry, which importlib.metadata finds as it finds any."""
    site = tmp_path / "site"
    (site / "toy_strata").mkdir(parents=True)
    (site / "toy_strata" / "__init__.py").write_text(
        textwrap.dedent(
            """
            def halves(tools, max_calls, *, cut=2):
                return lambda calls, keys=None: [int(len(c) >= cut) for c in calls]

            def needs_k(rewards, group_ids, strata, *, k):
                return rewards

            def shout(view, task):
                return 1.0
            """
        )
    )
    info = site / "toy_strata-0.3.dist-info"
    info.mkdir()
    info.joinpath("METADATA").write_text("Metadata-Version: 2.1\nName: toy-strata\nVersion: 0.3\n")
    info.joinpath("entry_points.txt").write_text(
        "[strata.stratifiers]\nhalves = toy_strata:halves\n\n"
        "[strata.rewards]\nshout = toy_strata:shout\nbroken = toy_strata:missing\n"
    )
    monkeypatch.syspath_prepend(str(site))
    yield site
    sys.modules.pop("toy_strata", None)


def test_an_entry_point_name_resolves_to_its_object(installed):
    import toy_strata

    assert resolve("stratifiers", "halves") is toy_strata.halves
    assert resolve("rewards", "shout") is toy_strata.shout
    assert ("halves", "entry point toy-strata==0.3 (toy_strata:halves)") in available("stratifiers")
    assert origin("stratifiers", "halves") == "entry point toy-strata==0.3 (toy_strata:halves)"


def test_a_built_in_name_comes_first():
    from buffers.strata import STRATIFIERS

    assert resolve("stratifiers", "random") is STRATIFIERS["random"]
    assert origin("stratifiers", "random") == "built-in"


def test_an_unknown_name_is_one_line_listing_the_known_and_the_plug_ins(installed):
    with pytest.raises(PluginError) as error:
        resolve("stratifiers", "thirds", "learner.stratifier.type")
    assert str(error.value) == (
        "learner.stratifier.type: unknown stratifier 'thirds'; known: tool_calls, "
        "tool_signature, random; plug-ins found (entry points strata.stratifiers): halves "
        "(toy-strata==0.3); or give an import string package.module:attr or "
        "path/to/file.py:attr"
    )
    with pytest.raises(PluginError, match=r"plug-ins found \(entry points strata.agents\): none;"):
        resolve("agents", "nobody", "actors.agent")


def test_an_entry_point_that_does_not_load_says_why(installed):
    with pytest.raises(PluginError) as error:
        resolve("rewards", "broken", "actors.reward")
    assert str(error.value) == (
        "actors.reward: reward 'broken' (entry point toy_strata:missing of toy-strata==0.3) "
        "cannot be loaded: AttributeError: module 'toy_strata' has no attribute 'missing'"
    )


def test_an_import_string_of_a_file_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "scoring.py").write_text(
        "class Judge:\n    def score(self, view, task):\n        return 0.5\n"
    )
    judge = resolve("rewards", "mine/scoring.py:Judge", "actors.reward")
    assert judge().score(None, None) == 0.5
    assert resolve("rewards", "mine/scoring.py:Judge.score") is judge.score  # imported once
    assert origin("rewards", "mine/scoring.py:Judge") == "import string"


def test_an_import_string_of_a_module(installed):
    import toy_strata

    assert resolve("tools", "toy_strata:shout") is toy_strata.shout


@pytest.mark.parametrize(
    ("spec", "failure"),
    [
        ("no_such_pkg.mod:fn", "ModuleNotFoundError: No module named 'no_such_pkg'"),
        ("toy_strata:nothing", "AttributeError: module 'toy_strata' has no attribute 'nothing'"),
        ("gone/file.py:fn", "FileNotFoundError: no such file gone/file.py (relative to "),
        ("bad.py:fn", "ZeroDivisionError: division by zero"),
        (":fn", None),
    ],
)
def test_an_import_string_that_fails_says_what_failed(
    installed, tmp_path, monkeypatch, spec, failure
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.py").write_text("x = 1 / 0\n")
    with pytest.raises(PluginError) as error:
        resolve("rewards", spec, "actors.reward")
    message = str(error.value)
    assert "\n" not in message
    if failure is None:
        assert message == (
            "actors.reward: import string ':fn' must be package.module:attr or path/to/file.py:attr"
        )
    else:
        assert message.startswith(f"actors.reward: cannot import {spec!r}: {failure}")
    assert "_strata_plugin_bad" not in " ".join(sys.modules)  # a failed file is not kept


# ------------------------------------------------------------------ learner.stratifier / advantage


@pytest.fixture
def registries():
    """The registries a plug-in section fills, as they were before the test."""
    from buffers import strata
    from learner import estimators

    saved = dict(strata.STRATIFIERS), dict(estimators.ESTIMATORS)
    yield
    for registry, before in zip((strata.STRATIFIERS, estimators.ESTIMATORS), saved, strict=True):
        registry.clear()
        registry.update(before)


LOCAL = str(Path(__file__).resolve().parents[2] / "configs" / "local.yaml")


def test_a_plug_in_stratifier_by_entry_point_assigns_the_strata(installed, registries):
    from pipeline.runtime.parts import agent_settings

    config = load_config(LOCAL, ["learner.stratifier={type: halves, cut: 3}"])
    assert config.learner.stratifier.type == "halves" and config.learner.stratifier.cut == 3
    settings = agent_settings(config.actors, config.learner.stratifier)
    assert list(settings.stratifier([["search"] * 3, ["search"], []])) == [1, 0, 0]
    dumped = yaml.safe_load(dump_config(config))["learner"]["stratifier"]
    assert dumped == {"type": "halves", "cut": 3}
    assert load_config(LOCAL, ["learner.stratifier.type=halves"]).learner.stratifier.cut == 2


def test_a_plug_in_estimator_from_a_file_trains_the_step(tmp_path, monkeypatch, registries):
    from buffers.records import Group
    from buffers.testing import synthetic_trajectory
    from learner.algorithm import plan_step

    monkeypatch.chdir(tmp_path)
    (tmp_path / "centred.py").write_text(
        "def centred(rewards, group_ids, strata, *, shift=0.0):\n"
        "    return rewards - rewards.mean() + shift\n"
    )
    config = load_config(LOCAL, ["learner.advantage={type: centred.py:centred, shift: 0.5}"])
    members = tuple(synthetic_trajectory("p", i, reward=float(i)) for i in range(4))
    plan = plan_step([Group("p", members)], config.learner)
    assert plan.advantages.tolist() == [-1.0, 0.0, 1.0, 2.0]
    assert plan.keep.tolist() == [True] * 4


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (
            "learner.stratifier={type: halves, k: 3}",
            "learner.stratifier.type = 'halves': the plug-in takes cut, not k: remove it",
        ),
        (
            "learner.stratifier.type=thirds",
            "learner.stratifier.type = 'thirds': unknown stratifier 'thirds'; known: tool_calls, "
            "tool_signature, random; plug-ins found (entry points strata.stratifiers): halves "
            "(toy-strata==0.3); or give an import string",
        ),
        (
            "learner.advantage.type=toy_strata:nothing",
            "learner.advantage.type = 'toy_strata:nothing': cannot import 'toy_strata:nothing': "
            "AttributeError: module 'toy_strata' has no attribute 'nothing'",
        ),
        (
            "learner.advantage.type=toy_strata:needs_k",
            "learner.advantage.type = 'toy_strata:needs_k': the plug-in needs k: give it in this "
            "section",
        ),
    ],
)
def test_a_plug_in_section_is_refused_in_one_line(installed, registries, setting, message):
    with pytest.raises(ConfigError) as error:
        load_config(LOCAL, [setting])
    assert f"{LOCAL} (--set {setting}): {message}" in str(error.value)


# ------------------------------------------------------------------------ launch's flags


def test_list_plugins_prints_every_kind_from_where(installed, registries, capsys):
    from pipeline.launch import main

    assert main([LOCAL, "--list-plugins", "--set", "learner.stratifier.type=halves"]) == 0
    out = capsys.readouterr().out
    assert "stratifiers (entry points strata.stratifiers):\n" in out
    assert "  random          built-in\n" in out
    assert (
        "  halves          entry point toy-strata==0.3 (toy_strata:halves)"
        "  <- learner.stratifier.type\n"
    ) in out
    assert re.search(r"\n  shout +entry point toy-strata==0\.3 \(toy_strata:shout\)\n", out)
    assert "  tool_calls      built-in\n" in out  # the config's choice moved to the plug-in
    assert main(["--list-plugins"]) == 0  # no config needed
    assert "halves" in capsys.readouterr().out


def test_dry_run_names_the_plug_ins_it_resolved(installed, registries, tmp_path, capsys):
    from pipeline.launch import main

    monkey_file = tmp_path / "strata_file.py"
    monkey_file.write_text("def fn(rewards, group_ids, strata):\n    return rewards\n")
    given = ["learner.stratifier.type=halves", f"learner.advantage.type={monkey_file}:fn"]
    assert main([LOCAL, "--dry-run", *[a for s in given for a in ("--set", s)]]) == 0
    out = capsys.readouterr().out
    assert out.endswith(
        "# plug-in learner.stratifier.type: halves (entry point toy-strata==0.3 "
        "(toy_strata:halves))\n"
        f"# plug-in learner.advantage.type: {monkey_file}:fn (import string)\n"
    )
    assert yaml.safe_load(out)["learner"]["stratifier"] == {"type": "halves", "cut": 2}
