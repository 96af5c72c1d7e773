"""`actors.agent` (issue 70): builtin, custom and openai, each a section chosen by `type`; the
agent plug-in found by name or import string (pipeline/plugins.py, the strata.agents group);
each actors key acts for the type or is refused at load in one line; the resolved config loads
again; the registry builds each type (pipeline/runtime/parts.py's AGENT_TYPES)."""

import sys
import textwrap

import pytest
import yaml

from actors.agent import AgentLoop
from actors.custom_agent import CustomAgent
from actors.openai_agent import CommandRunner, FunctionRunner, OpenAIAgent
from pipeline.config.loader import ConfigError, dump_config, load_config
from pipeline.runtime.parts import AGENT_TYPES, AgentParts, agent_settings, make_agent
from pipeline.runtime.preflight import unavailable

LOCAL = "configs/local.yaml"
OPENAI_OK = ["actors.tools=[search]", "actors.max_observation_tokens=256"]  # local.yaml's differ


@pytest.fixture
def agents(tmp_path, monkeypatch):
    """A module of agents (`agents_mod`) and a package that registers one as an entry point
    (`toy_agents`, group strata.agents), as pip leaves them."""
    site = tmp_path / "site"
    site.mkdir()
    code = textwrap.dedent(
        """
        async def search_agent(task, endpoint):
            return "an answer"

        def sync_agent(task, endpoint):
            return None

        def one_argument(task):
            return None

        class Custom:
            async def run(self, task, ctx):
                return "an answer"

        class SyncRun:
            def run(self, task, ctx):
                return None
        """
    )
    (site / "agents_mod.py").write_text(code)
    (site / "toy_agents.py").write_text(code)
    info = site / "toy_agents-1.0.dist-info"
    info.mkdir()
    info.joinpath("METADATA").write_text("Metadata-Version: 2.1\nName: toy-agents\nVersion: 1.0\n")
    info.joinpath("entry_points.txt").write_text(
        "[strata.agents]\nsearcher = toy_agents:search_agent\nmine = toy_agents:Custom\n"
    )
    monkeypatch.syspath_prepend(str(site))
    yield site
    for name in ("agents_mod", "toy_agents"):
        sys.modules.pop(name, None)


def refusal(*sets: str) -> str:
    with pytest.raises(ConfigError) as error:
        load_config(LOCAL, list(sets))
    message = str(error.value)
    assert "\n" not in message
    return message


def test_each_type_loads_and_its_resolved_config_loads_again(agents, tmp_path):
    configs = {
        "builtin": load_config(LOCAL),
        "custom": load_config(LOCAL, ["actors.agent={type: custom, path: mine}"]),
        "openai": load_config(
            LOCAL, ["actors.agent={type: openai, path: agents_mod:search_agent}", *OPENAI_OK]
        ),
        "command": load_config(
            LOCAL,
            [
                "actors.agent={type: openai, command: [python, agent.py], deadline_s: 30, "
                "on_rewrite: drop}",
                *OPENAI_OK,
            ],
        ),
    }
    assert configs["builtin"].actors.agent.type == "builtin"
    assert configs["command"].actors.agent.on_rewrite == "drop"
    for name, config in configs.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(dump_config(config))
        again = load_config(path)  # every key written out, each at its value: no refusal
        assert again.actors.agent == config.actors.agent
        assert (
            yaml.safe_load(path.read_text())["actors"]["agent"]["type"] == config.actors.agent.type
        )


SEARCH = "actors.agent={type: openai, path: agents_mod:search_agent}"


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ["actors.agent={type: builtin, path: agents_mod:search_agent}"],
            "actors.agent.path does not act for actors.agent.type builtin (it is a key of "
            "custom, openai): remove it",
        ),
        (
            ["actors.agent={type: openai, deadline_s: 60}", *OPENAI_OK],
            "actors.agent: give either path (a function agent(task, endpoint)) or command (a "
            "program)",
        ),
        (
            ["actors.agent={type: openai, path: agents_mod:search_agent, command: [ls]}"],
            "actors.agent: give either path",
        ),
        (
            ["actors.agent={type: openai, command: [no-such-agent-program]}", *OPENAI_OK],
            "actors.agent.command = ['no-such-agent-program']: 'no-such-agent-program' is no "
            "program on PATH nor an executable file",
        ),
        (
            ["actors.agent={type: openai, path: agents_mod:one_argument}", *OPENAI_OK],
            "actors.agent.path = 'agents_mod:one_argument': agents_mod:one_argument must take "
            "(task, endpoint)",
        ),
        (
            ["actors.agent={type: openai, path: agents_mod:Custom}", *OPENAI_OK],
            "agents_mod:Custom is a class, not a function agent(task, endpoint)",
        ),
        (
            ["actors.agent={type: custom, path: agents_mod:SyncRun}"],
            "actors.agent.path = 'agents_mod:SyncRun': agents_mod:SyncRun is a class without "
            "async run(task, ctx)",
        ),
        (
            ["actors.agent={type: custom, path: nobody}"],
            "actors.agent.path = 'nobody': unknown agent 'nobody'; known: none; plug-ins found "
            "(entry points strata.agents): mine (toy-agents==1.0), searcher (toy-agents==1.0); "
            "or give an import string",
        ),
        (
            ["actors.agent={type: custom, path: agents_mod:Custom, deadline_s: 0}"],
            "actors.agent.deadline_s = 0: input should be greater than 0",
        ),
        (
            ["actors.agent={type: custom, path: agents_mod:Custom, on_rewrite: keep}"],
            "actors.agent.on_rewrite = 'keep': input should be 'segment' or 'drop'",
        ),
        (
            [SEARCH],
            "actors: tools: 'python': an openai agent runs its own tools; tools may hold only "
            "search (Strata serves the retrieval index at endpoint.search_url) or be []",
        ),
        (
            [SEARCH, "actors.tools=[search]"],
            "actors: max_observation_tokens does not act for agent.type openai (the agent runs "
            "its own tools): remove it, or set agent.type builtin or custom",
        ),
        (
            [SEARCH, *OPENAI_OK, "actors.mcp_servers=[{name: u, command: [x]}]"],
            "actors: mcp_servers does not act for agent.type openai",
        ),
        (
            [SEARCH, *OPENAI_OK, "actors.python_timeout_s=9"],
            "actors: python_timeout_s does not act for agent.type openai",
        ),
        (
            [SEARCH, *OPENAI_OK, "actors.web.num_results=3"],
            "actors: web does not act for agent.type openai",
        ),
        (
            [SEARCH, *OPENAI_OK, "actors.latent_reward=0.2"],
            "actors: latent_reward does not act for agent.type openai (the agent runs its own "
            "loop)",
        ),
        (
            ["actors.agent={type: custom, path: mine}", "actors.latent_reward=0.2"],
            "actors: latent_reward needs the built-in loop's record of where an observation "
            "held the gold answer, which a custom agent does not keep: remove it, or set "
            "agent.type builtin",
        ),
        (
            ["actors.agent={type: custom, path: mine}", "learner.turn_credit=0.5"],
            "learner.turn_credit needs the built-in loop's record of where an observation held "
            "the gold answer, which a custom agent does not keep: set it to 0, or "
            "actors.agent.type builtin",
        ),
        (
            [
                "actors.agent={type: custom, path: mine}",
                "actors.format=chat_tools",
                "model={type: hf, path: /nowhere}",
            ],
            "actors.format does not act for actors.agent.type custom with model.type hf (the "
            "agent writes its own prompts; the format only chooses what the tiny policy's warm "
            "start teaches): remove it",
        ),
    ],
)
def test_a_key_that_does_not_act_for_the_type_is_refused_in_one_line(agents, sets, message):
    assert message in refusal(*sets)


def test_keys_that_act_for_each_type_load(agents):
    custom = load_config(
        LOCAL,
        [
            "actors.agent={type: custom, path: agents_mod:Custom}",
            "actors.format=chat_tools",  # the tiny policy's warm start learns the chat format
            "actors.max_observation_tokens=64",
            "actors.python_timeout_s=9",
            "actors.overlong_buffer=64",
            "actors.format_weight=0.1",
        ],
    )
    assert custom.actors.max_observation_tokens == 64
    openai = load_config(LOCAL, [SEARCH, "actors.tools=[]", "actors.max_observation_tokens=256"])
    assert openai.actors.tools == []
    assert load_config(LOCAL, [SEARCH, *OPENAI_OK, "actors.temperature=0.5"])


def test_the_simulated_engine_runs_only_the_built_in_loop(agents):
    config = load_config(
        LOCAL,
        ["actors.engine={type: simulated}", "actors.agent={type: custom, path: mine}"],
    )
    assert unavailable(config) == (
        "actors.engine.type simulated runs Strata's own loop on simulated text, not a custom "
        "agent: use --set actors.agent.type=builtin"
    )


def test_list_plugins_shows_the_agents_and_the_one_the_config_uses(agents, capsys):
    from pipeline.launch import main

    assert main([LOCAL, "--list-plugins", "--set", "actors.agent={type: custom, path: mine}"]) == 0
    out = capsys.readouterr().out
    assert "agents (entry points strata.agents):\n" in out
    assert (
        "  mine      entry point toy-agents==1.0 (toy_agents:Custom)  <- actors.agent.path\n" in out
    )
    assert "  searcher  entry point toy-agents==1.0 (toy_agents:search_agent)\n" in out
    assert main([LOCAL, "--dry-run", "--set", "actors.agent={type: custom, path: mine}"]) == 0
    assert capsys.readouterr().out.endswith(
        "# plug-in actors.agent.path: mine (entry point toy-agents==1.0 (toy_agents:Custom))\n"
    )


def test_the_registry_builds_each_type_on_the_acting_parts(agents, tmp_path):
    from pipeline.assets.tiny_policy import CHAT_TEMPLATE, train_tokenizer
    from tests.actors.conftest import TEXTS

    tokenizer = train_tokenizer(TEXTS[:200], 600)
    tokenizer.chat_template = CHAT_TEMPLATE

    class Endpoint:
        model_name = "strata-policy"
        base_url = "http://127.0.0.1:1/v1"

    built = {}
    for kind, sets in {
        "builtin": [],
        "custom": ["actors.agent={type: custom, path: mine, deadline_s: 7}"],
        "openai": [SEARCH, *OPENAI_OK],
        "command": ["actors.agent={type: openai, command: [python, a.py]}", *OPENAI_OK],
    }.items():
        config = load_config(LOCAL, sets)
        settings = agent_settings(config.actors, config.learner.stratifier)
        parts = AgentParts(
            config, None, tokenizer, {}, settings, "pool-3", Endpoint(), "http://s", tmp_path
        )
        built[kind] = make_agent(parts)
    assert type(built["builtin"]) is AgentLoop
    assert type(built["custom"]) is CustomAgent and built["custom"].deadline_s == 7
    assert type(built["custom"].agent).__name__ == "Custom"
    assert type(built["openai"]) is OpenAIAgent
    assert type(built["openai"].runner) is FunctionRunner and built["openai"].runner.is_async
    assert built["openai"].search_url == "http://s"  # actors.tools [search]: served to it
    assert type(built["command"].runner) is CommandRunner
    assert built["command"].runner.argv[0] == sys.executable
    assert built["command"].runner.log_path == tmp_path / "agent-pool-3.log"
    assert {name: t.endpoint for name, t in AGENT_TYPES.items()} == {
        "builtin": False,
        "custom": False,
        "openai": True,
    }
