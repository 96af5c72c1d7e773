"""Hostile configs, fuzzed: mutated YAML configs with `--set` overrides either load or fail with
the loader's own error, one line naming the file (and the key when a key is the problem); never
another exception, which would reach the user as a traceback. `make fuzz` runs the config
property on 10,000 configs. Question files and trajectory files: test_hostile_data.py."""

import copy
import math
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml
from hypothesis import event, given
from hypothesis import strategies as st

from pipeline.config.loader import ConfigError, load_config, model_classes, read_yaml
from pipeline.config.schema import StrataConfig
from tests.faults.hostile import FUZZ, TEXT, assert_one_line, escaped

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "configs" / "local.yaml"
BASE = yaml.safe_load(LOCAL.read_text())

# ------------------------------------------------------------------------------------- values

ODD = [
    None,
    True,
    0,
    -1,
    -(2**63),
    2**64,
    10**40,
    0.5,
    -1e308,
    math.nan,
    math.inf,
    -math.inf,
    "",
    " ",
    "\n",
    "\t",
    "null",
    "~",
    "yes",
    "0x1F",
    "1e400",
    ".nan",
    "x" * 10_000,
    "\u2028",
    "é\x85",
    "\x00",
    [],
    [None],
    [[[]]],
    {},
    {"type": "nope"},
    {"a": {"b": {"c": 1}}},
]
SCALARS = st.one_of(
    st.sampled_from(ODD).map(copy.deepcopy),  # copies: a mutation must not change ODD itself
    st.booleans(),
    st.integers(),
    st.integers(min_value=2**63),
    st.floats(),
    TEXT,
)
VALUES = st.one_of(
    SCALARS, st.lists(SCALARS, max_size=3), st.dictionaries(TEXT, SCALARS, max_size=3)
)
KEYS = st.one_of(
    TEXT.filter(bool),
    st.sampled_from(["Type", "alpha ", " ", "a.b", "a\nb", "a\u2028b", "<<", "?", "-", "x" * 300]),
    st.integers(),
    st.none(),
    st.booleans(),
    st.floats(),
)


def _schema_keys(model, prefix=""):
    for name, field in model.model_fields.items():
        yield prefix + name
        for member in model_classes(field.annotation):
            yield from _schema_keys(member, f"{prefix}{name}.")


SCHEMA_KEYS = sorted(set(_schema_keys(StrataConfig)))
FIELD_NAMES = {key.rpartition(".")[2] for key in SCHEMA_KEYS}


# ---------------------------------------------------------------------------------- documents


class Document(NamedTuple):
    data: bytes
    mutations: tuple = ()
    """(op, path) of each change made to configs/local.yaml; empty for any other document."""


BOMB = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefg", "bcdefgh", strict=True)
)  # 9^8 strings in 8 lines, as *h
BROKE_THE_LOADER = [  # (document, overrides, what the one line says): each once let out a traceback
    (b"learner:\n  alpha: !!int abc\n", [], ":2:10: invalid YAML: cannot read 'abc' as !!int"),
    (b"learner:\n  alpha: !!bool abc\n", [], "cannot read 'abc' as !!bool"),  # KeyError
    (b"learner:\n  alpha: !!timestamp x\n", [], "cannot read 'x' as !!timestamp"),  # AttributeError
    (b"learner:\n  alpha: !!float ''\n", [], "cannot read '' as !!float"),  # IndexError
    (b"learner:\n  alpha: " + b"9" * 5000 + b"\n", [], "as !!int"),  # int() stops at 4300 digits
    (
        b"learner:\n  advantage:\n    alpha: 0x" + b"F" * 5000 + b"\n",
        [],
        "learner.advantage.alpha = a number of over 4300 digits",
    ),  # repr() did
    (b"[" * 1000 + b"]" * 1000, [], "invalid YAML: nested too deeply"),  # RecursionError
    (b"", ["a=" + "[" * 3000 + "]" * 3000], "brackets nested too deeply"),  # ... in parse_value
    # Were two lines: a newline in a key, or in a --set.
    (b'learner:\n  "a\\nb": 1\n', [], "unknown key 'learner.a\\nb'"),
    (
        b"",
        ["learner.advantage.alpha=2\n3"],
        "(--set learner.advantage.alpha=2\\n3): learner.advantage.alpha = '2\\n3'",
    ),
    # A type (a union's tag) of a billion strings hung inside pydantic, which str()-ed it whole.
    ((BOMB + "model:\n  type: *h\n").encode(), [], "model.type = '[[...], [...], "),
    # Not a traceback, but no fix either: 'unable to extract tag using discriminator pick()'.
    (b"actors:\n  engine: 5\n", [], "actors.engine = 5: must be a section (key: value lines)"),
]
HOSTILE_YAML = [document for document, _, _ in BROKE_THE_LOADER] + [
    (BOMB + "eval:\n  data: *h\n").encode(),
    b"learner: &a\n  x: *a\n",
    b"actors:\n  tools: &a [*a]\n",
    b"!!python/object/apply:os.system [echo hi]\n",
    b"learner:\n  alpha: !!binary '@@@'\n",
    b"learner: !!set {a, b}\n",
    b"learner:\n  <<: 5\n",
    b"? [a]\n: 1\n",
    b"learner:\n\talpha: 1\n",
    b"learner: {}\nlearner: {alpha: 2}\n",
    b"---\na: 1\n---\nb: 2\n",
    b"---\n",
    b"{learner: {alpha: 0.5",
    b"\xef\xbb\xbflearner:\n  alpha: 0.5\n",
    b"\xff\xfe\x00l\x00",
    b"learner:\n  alpha: 1\x00\n",
    b"5: 1\n",
    b"~: 1\n",
    b"learner:\n  ~: 1\n",
    b"actors:\n  engine:\n    type: {a: 1}\n",
    b"model:\n  type: [1]\n",
]


@st.composite
def mutated_configs(draw) -> Document:
    """configs/local.yaml with keys dropped, values replaced (whole sections included) and unknown
    keys added at any depth."""
    doc, mutations = copy.deepcopy(BASE), []
    for _ in range(draw(st.integers(0, 4))):
        path, parent, node = [], None, doc
        while isinstance(node, dict) and node and draw(st.integers(0, 3)):
            key = draw(st.sampled_from(sorted(node, key=repr)))
            path, parent, node = [*path, key], node, node[key]
        op = draw(st.sampled_from(["drop", "replace", "unknown"]))
        if op == "drop" and path:
            del parent[path[-1]]
        elif op == "replace":
            value = draw(VALUES)
            if path:
                parent[path[-1]] = value
            else:
                doc = value
        elif op == "unknown" and isinstance(node, dict):
            key = draw(KEYS)
            node[key] = draw(VALUES)
            path = [*path, key]
        else:
            continue
        mutations.append((op, tuple(path)))
    data = yaml.safe_dump(doc, allow_unicode=True, sort_keys=False).encode()
    damage = draw(st.sampled_from(["none"] * 6 + ["truncate", "insert"]))
    if damage != "none":  # invalid YAML bytes
        cut = draw(st.integers(0, len(data)))
        junk = b"" if damage == "truncate" else draw(st.binary(min_size=1, max_size=8))
        return Document(data[:cut] + junk + (data[cut:] if junk else b""))
    return Document(data, tuple(mutations))


DOCUMENTS = st.one_of(
    mutated_configs(),
    st.sampled_from(HOSTILE_YAML).map(Document),
    VALUES.map(lambda v: Document(yaml.safe_dump(v, allow_unicode=True).encode())),
    st.binary(max_size=64).map(Document),
)
ODD_OVERRIDES = [
    "",
    "nan",
    "inf",
    "-1",
    "1e999",
    "[",
    "]",
    "{",
    "}",
    "[a, [b",
    "{a: 1",
    "{a}",
    "{: 1}",
    "{a: {b: 1}}",
    "null",
    "~",
    "true",
    "'",
    '"',
    "9" * 5000,
    "[" * 3000,
    "[" * 3000 + "]" * 3000,
    "0x" + "F" * 50,
    "[1, 2, 3]",
    "{type: vllm, urls: [http://127.0.0.1:1]}",
    "vllm",
    "sglang",
    "hf",
    "ray",
    "simulated",
    "\u2028",
    "\x00",
    "2\n3",
]
OVERRIDE_VALUES = st.one_of(TEXT, st.sampled_from(ODD_OVERRIDES), VALUES.map(str))
OVERRIDE_KEYS = st.one_of(
    st.sampled_from(SCHEMA_KEYS),
    st.lists(
        st.sampled_from([*sorted(FIELD_NAMES), "x", "type", "urls"]), min_size=1, max_size=4
    ).map(".".join),
    TEXT,
)
OVERRIDES = st.lists(
    st.one_of(st.builds("{}={}".format, OVERRIDE_KEYS, OVERRIDE_VALUES), TEXT), max_size=3
)


@FUZZ
@given(document=DOCUMENTS, overrides=OVERRIDES)
def test_config_loads_or_fails_in_one_line(scratch, document, overrides):
    path = scratch / "config.yaml"
    path.write_bytes(document.data)
    try:
        load_config(path, overrides)
    except ConfigError as exc:
        message = str(exc)
    else:
        event("loads")
        return
    event("ConfigError")
    assert_one_line(message, str(path), *(["--set "] if overrides else []))
    if overrides or len(document.mutations) != 1 or "invalid YAML" in message:
        return
    op, keys = document.mutations[0]
    if op == "unknown" and isinstance(keys[-1], str) and keys[-1] not in FIELD_NAMES:
        if reads_back(path, keys):
            assert "unknown key" in message and escaped(".".join(keys)) in message, message
    elif op == "replace" and keys:
        assert f" {keys[0]}" in message, message  # the section, or a key in it


def reads_back(path: Path, keys: tuple) -> bool:
    """Whether YAML reads the key at `keys` back as that string (`1e5` is a float to it)."""
    node = read_yaml(path)
    for key in keys[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
    return isinstance(node, dict) and keys[-1] in node


@pytest.mark.parametrize("document, overrides, says", BROKE_THE_LOADER)
def test_what_broke_the_config_loader_fails_in_one_line(scratch, document, overrides, says):
    path = scratch / "broke.yaml"
    path.write_bytes(document)
    with pytest.raises(ConfigError) as failure:
        load_config(path, overrides)
    assert_one_line(str(failure.value), str(path), *(["--set "] if overrides else []))
    assert says in str(failure.value)


def test_a_yaml_alias_bomb_fails_fast_in_a_short_line(scratch):
    # 9^8 strings through aliases: the error line once held every one of them (seconds, tens of
    # MB), and a `type` of them hung inside pydantic.
    for use in ("eval:\n  data: *h\n", "model:\n  type: *h\n", "learner: *h\n"):
        path = scratch / "bomb.yaml"
        path.write_text(BOMB + use)
        with pytest.raises(ConfigError) as failure:
            load_config(path)
        assert_one_line(str(failure.value), str(path))
        assert len(str(failure.value)) < 300, str(failure.value)


# ---------------------------------------------------------------------------------------- CLI


@pytest.mark.parametrize(
    "text, overrides",
    [
        ("learner:\n  alpha: !!int abc\n", []),  # was a ValueError traceback
        ('learner:\n  "a\\nb": 1\n', ["learner.advantage.alpha=2\n3"]),  # was two lines
        ("", ["a=" + "[" * 3000 + "]" * 3000]),  # was a RecursionError traceback
        ("- just\n- a list\n", []),
    ],
)
def test_cli_refuses_hostile_config_in_one_line(tmp_path, text, overrides):
    path = tmp_path / "hostile.yaml"
    path.write_text(text)
    argv = [sys.executable, "-m", "pipeline.launch", str(path), "--dry-run"]
    for override in overrides:
        argv += ["--set", override]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert done.stderr.startswith("strata: error: ") and done.stderr.count("\n") == 1, done.stderr
    assert str(path) in done.stderr or "--set " in done.stderr
