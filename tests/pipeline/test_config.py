from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from pipeline.backends.sglang import SGLangEngine
from pipeline.config.algorithm import PluginSection
from pipeline.config.loader import (
    ConfigError,
    dump_config,
    load_config,
    model_classes,
    read_yaml,
)
from pipeline.config.overrides import OverrideError, apply_override, parse_override, parse_value
from pipeline.config.schema import PretrainedModel, StrataConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["local", "gaia", "search_r1"])
def test_shipped_configs_validate_and_round_trip(name, tmp_path):
    config = load_config(CONFIGS / f"{name}.yaml")
    again = tmp_path / "resolved.yaml"
    again.write_text(dump_config(config))
    assert load_config(again) == config


def test_the_recipes_say_what_the_paper_says():
    r1 = load_config(CONFIGS / "search_r1.yaml")
    assert isinstance(r1.model, PretrainedModel) and "Qwen2.5-3B" in r1.model.path
    assert (r1.learner.advantage.alpha, r1.buffer.group_size, r1.learner.lr) == (0.6, 8, 1e-6)
    assert (r1.learner.kl_coef, r1.learner.kl_kind, r1.learner.clip_low) == (0.001, "k3", 0.2)
    assert (r1.actors.max_turns, r1.retrieval.topk, r1.data.type) == (4, 3, "search_r1")
    # "global batch size 256" in verl counts prompts: 256 groups of 8 a step
    assert r1.learner.groups_per_step * r1.buffer.group_size == 2048
    gaia = load_config(CONFIGS / "gaia.yaml")
    assert isinstance(gaia.actors.engine, SGLangEngine) and "Qwen3-8B" in gaia.model.path
    assert gaia.actors.tools == ["web_search", "browse", "python"] and gaia.actors.reward == "gaia"
    local = load_config(CONFIGS / "local.yaml")
    assert (local.model.type, local.actors.engine.type, local.runtime.type) == (
        "tiny",
        "embedded",
        "local",
    )


def _sections(model: type[BaseModel]):
    yield model
    for field in model.model_fields.values():
        for member in model_classes(field.annotation):
            yield from _sections(member)


def test_every_field_is_documented_and_extra_keys_are_forbidden():
    seen = set()
    for section in _sections(StrataConfig):
        if section in seen:
            continue
        seen.add(section)
        # a plug-in's section takes its parameters, checked against the plug-in's own signature
        extra = "allow" if issubclass(section, PluginSection) else "forbid"
        assert section.model_config.get("extra") == extra, section.__name__
        for name, field in section.model_fields.items():
            assert field.description, f"{section.__name__}.{name} has no docstring"
    assert len(seen) >= 12


def test_backend_type_may_be_left_out():
    config = StrataConfig.model_validate({"model": {"layers": 4}, "runtime": {"seed": 3}})
    assert config.model.type == "tiny" and config.model.layers == 4
    assert config.runtime.type == "local" and config.runtime.seed == 3


@pytest.mark.parametrize(
    "text, value",
    [
        ("3", 3),
        ("-2", -2),
        ("0.5", 0.5),
        ("1e-6", 1e-6),
        ("true", True),
        ("False", False),
        ("null", None),
        ("~", None),
        ("none", "none"),  # a word, as in YAML: learner.importance=none must not become null
        ("[search,python]", ["search", "python"]),
        ("[1, 2.5, [a, 'b,c']]", [1, 2.5, ["a", "b,c"]]),
        ("[]", []),
        ("'007'", "007"),
        ("http://127.0.0.1:30000", "http://127.0.0.1:30000"),
    ],
)
def test_override_values_are_typed(text, value):
    assert parse_value(text) == value
    assert type(parse_value(text)) is type(value)


def test_override_application():
    raw = {"learner": {"alpha": 0.6}}
    key, value = parse_override("learner.stratifier.type=random")
    apply_override(raw, key, value)
    assert raw == {"learner": {"alpha": 0.6, "stratifier": {"type": "random"}}}
    with pytest.raises(OverrideError, match=r"'learner\.alpha' is a value"):
        apply_override(raw, "learner.alpha.low", 1)
    for bad in ["alpha", "=3", "learner..alpha=1", "learner.advantage.alpha"]:
        with pytest.raises(OverrideError, match=r"dotted\.key=value"):
            parse_override(bad)


def test_yaml_reads_exponent_floats(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learner:\n  lr: 1e-6\n  advantage: {eps: 1.0e-8}\n")
    config = load_config(path)
    assert config.learner.lr == 1e-6 and config.learner.advantage.eps == 1e-8


@pytest.mark.parametrize(
    "text, overrides, expected",
    [
        (
            "learner:\n  advantage:\n    alpah: 0.5\n",
            [],
            "{p}: unknown key 'learner.advantage.alpah' (did you mean 'learner.advantage.alpha'?)",
        ),
        ("bogus: 1\n", [], "{p}: unknown key 'bogus' (valid keys: model, data, actors"),
        (
            "learner:\n  advantage:\n    alpha: 1.5\n",
            [],
            "{p}: learner.advantage.alpha = 1.5: input should be less than or equal to 1",
        ),
        (
            "",
            ["learner.advantage.alpha=-1"],
            "{p} (--set learner.advantage.alpha=-1): learner.advantage.alpha = -1: input should be greater",
        ),
        (
            "",
            ["actors.tools=[search,web]"],
            "actors: tools[1]: unknown tool 'web'; known: search, python, web_search, browse;",
        ),
        (
            "",
            ["actors.engine.type=tgi"],
            "actors.engine.type = 'tgi': use one of 'embedded', 'sglang', 'vllm'",
        ),
        (
            "",
            [
                "actors.engine.type=sglang",
                "actors.engine.urls=[http://127.0.0.1:1]",
                "actors.engine.tp_size=2",
            ],
            "(--set actors.engine.tp_size=2): actors.engine: tp_size set the servers the launcher "
            "starts, but urls names running ones: drop one or the other",
        ),
        (
            "actors:\n  engine: {type: sglang, num_servers: 2, tp_size: 2, gpus: [0, 1, 2]}\n",
            [],
            "{p}: actors.engine: gpus [0, 1, 2] must name 4 different GPUs (num_servers 2 x "
            "tp_size 2), or be left empty",
        ),
        (
            "runtime: {type: ray, learner_rendezvous_port: 29500}\n",
            [],
            "{p}: runtime.learner_rendezvous_port places the learner's ranks: it acts with "
            "learner.num_ranks > 1 only",
        ),
        ("model:\n  heads: 3\n", [], "{p}: model: hidden_size 128 must be divisible by heads 3"),
        (
            "learner:\n  advantage: {eps: .nan}\n",
            [],
            "learner.advantage.eps = nan: input should be a finite number",
        ),
        (
            "learner:\n  alpha: 0.8\n",
            [],
            "{p}: learner: learner.alpha moved to learner.advantage.alpha",
        ),
        (
            "learner:\n  advantage: {type: grpo, alpha: 0.8}\n",
            [],
            "{p}: learner.advantage.alpha does not act for learner.advantage.type grpo (it is a key "
            "of stratified): remove it, or give the whole section, e.g. --set 'learner.advantage={{type: grpo}}'",
        ),
        ("learner: [1\n", [], "{p}:2:1: invalid YAML"),
        ("- 1\n", [], "{p}: the top level must be a mapping of sections, got list"),
        ("data:\n  type: gaia\n", [], "{p}: data: data.type 'gaia' needs data.train_files"),
        (
            "data: {type: search_r1, train_files: [t.parquet], world_skew: 1.3}\n",
            [],
            "{p}: data: data.world_skew shapes the mini_gaia world only; data.type is "
            "'search_r1': remove it",
        ),
        ("", ["data.world_skew=5"], "data.world_skew = 5: input should be less than or equal to 4"),
        (
            "",
            ["actors.latent_reward=0.2", "learner.turn_credit=0.2"],
            "{p}: actors.latent_reward and learner.turn_credit are two readings of TSPO's latent "
            "reward: set one of them, the other to 0",
        ),
        (
            "",
            ["learner.advantage.type=gae", "learner.step_credit.type=gigpo"],
            "learner.step_credit and learner.advantage.type gae each give a "
            "trajectory's tokens their own advantages: use one (gigpo / igpo as "
            "learner.step_credit compose with the stratified blend)",
        ),
        (
            "",
            ["learner.advantage.type=igpo", "learner.zero_stage=3", "learner.num_ranks=2"],
            "igpo scores gold answers with the model on rank 0 alone, which ZeRO-3 "
            "shards over the ranks: use zero_stage 0-2 or one rank with it",
        ),
        (
            "",
            ["learner.advantage.type=gae", "actors.latent_reward=0.2"],
            "actors.latent_reward moves TSPO's reward into a group-normalised advantage; "
            "learner.advantage.type gae takes the outcome reward through its critic: use one",
        ),
        (
            "",
            ["learner.advantage.type=gae", "learner.advantage.alpha=0.5"],
            "learner.advantage.alpha does not act for learner.advantage.type gae",
        ),
        (
            "",
            ["learner.advantage.alpha"],
            "--set 'learner.advantage.alpha': expected dotted.key=value",
        ),
        (
            "",
            ["actors.engine={type sglang}"],
            "--set 'actors.engine={{type sglang}}': expected {{key: value, ...}}, got 'type sglang'",
        ),
    ],
)
def test_config_errors_are_one_clear_line(tmp_path, text, overrides, expected):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert "\n" not in message
    assert expected.format(p=path) in message


def test_missing_config_file_names_the_path(tmp_path):
    with pytest.raises(ConfigError, match=r"config file not found: .*nope\.yaml"):
        read_yaml(tmp_path / "nope.yaml")


def test_dump_holds_every_default():
    dumped = yaml.safe_load(dump_config(StrataConfig()))
    assert set(dumped) == {
        "model",
        "data",
        "actors",
        "buffer",
        "learner",
        "retrieval",
        "runtime",
        "metrics",
        "eval",
    }
    assert dumped["learner"]["stratifier"] == {"type": "tool_calls"}
    assert dumped["learner"]["advantage"] == {"type": "stratified", "alpha": 0.6, "eps": 1e-6}


def test_setting_a_plain_type_field_keeps_the_sections_other_keys():
    """data.type picks a kind, not a backend union: every key of the section holds for every
    kind, so a --set of the type drops nothing (and notes nothing)."""
    notes: list[str] = []
    config = load_config(
        CONFIGS / "local.yaml",
        ["data.type=search_r1", "data.train_files=[/data/train.parquet]"],
        notes,
    )
    assert (config.data.type, config.data.num_questions, config.data.max_prompt_tokens) == (
        "search_r1",
        400,
        256,
    )
    assert notes == []


def test_the_config_reference_is_made_from_the_schema():
    """docs/config.md is what `python -m pipeline.config_doc` prints: regenerate it after a
    schema change."""
    from pipeline.config.doc import render

    reference = (CONFIGS.parent / "docs" / "config.md").read_text()
    assert reference == render(), (
        "docs/config.md is stale: python -m pipeline.config_doc > docs/config.md"
    )
    for key in (
        "learner.advantage.type",
        "learner.importance.floor",
        "learner.ratio",
        "actors.engine.device",
    ):
        assert f"`{key}`" in reference


def test_each_estimator_section_holds_exactly_its_parameters():
    """learner.advantage's sections and learner/estimators.py's registry name the same
    estimators, each section's keys are its function's keyword parameters, with its defaults."""
    import inspect

    from learner.algorithm import CRITIC
    from learner.estimators import ESTIMATORS
    from learner.step_credit import STEP_CREDITS
    from pipeline.config.algorithm import ADVANTAGES

    types = {c.model_fields["type"].default for c in ADVANTAGES}
    assert types == set(ESTIMATORS) | set(STEP_CREDITS) | {CRITIC}
    assert not set(ESTIMATORS) & (set(STEP_CREDITS) | {CRITIC})
    for section in ADVANTAGES:
        name = section.model_fields["type"].default
        if name not in ESTIMATORS:  # GRPO's eps and the step credit's own (a test of their own)
            continue
        estimator = ESTIMATORS[name]
        assert set(section.model_fields) - {"type"} == set(estimator.params)
        signature = inspect.signature(estimator.fn).parameters
        for name in estimator.params:
            assert section.model_fields[name].default == signature[name].default


def test_each_stratifier_section_holds_exactly_its_parameters():
    import inspect

    from buffers.strata import STRATIFIERS as REGISTERED
    from pipeline.config.algorithm import STRATIFIERS

    assert {c.model_fields["type"].default for c in STRATIFIERS} == set(REGISTERED)
    for section in STRATIFIERS:
        registered = REGISTERED[section.model_fields["type"].default]
        assert set(section.model_fields) - {"type"} == set(registered.params)
        signature = inspect.signature(registered.make).parameters
        for name in registered.params:
            assert section.model_fields[name].default == signature[name].default
    with pytest.raises(
        ConfigError,
        match=r"learner\.stratifier\.k does not act for learner\.stratifier\.type tool_calls",
    ):
        load_config("configs/local.yaml", ["learner.stratifier.k=3"])


def test_each_correction_section_holds_exactly_its_parameters_and_old_spellings_say_where():
    import inspect

    from learner.corrections import CORRECTIONS
    from pipeline.config.algorithm import IMPORTANCE

    assert {c.model_fields["type"].default for c in IMPORTANCE} == set(CORRECTIONS)
    for section in IMPORTANCE:
        kind = CORRECTIONS[section.model_fields["type"].default]
        assert set(section.model_fields) - {"type"} == set(kind.params)
        signature = inspect.signature(kind.apply).parameters
        for name in kind.params:
            assert section.model_fields[name].default == signature[name].default
    local = "configs/local.yaml"
    for override, says in (
        ("learner.is_cap=3", r"learner\.is_cap moved to learner\.importance\.cap"),
        ("learner.importance=mask", r"learner\.importance is a section now: .*type: mask"),
        ("learner.importance.floor=0.2", r"learner\.importance\.floor does not act for .*type tis"),
    ):
        with pytest.raises(ConfigError, match=says):
            load_config(local, [override])
