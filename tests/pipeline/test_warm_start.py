"""The warm start: demos laid out as the agent loop lays out trajectories, a short real training
run on the default run's world (the suite's shared assets; cached on the second call), and the
format measurement end to end."""

import asyncio
import hashlib
import json
import re
import shutil
import time
from dataclasses import replace

import pytest

from actors.agent import AgentLoop
from actors.engine import Generation
from actors.tools import PythonTool, SearchTool
from learner.sft import SftTimeout, Training, learning_rate, sft_loss, shared_prefix, train_sft
from pipeline.assets.cache import prepare_index, prepare_world
from pipeline.assets.warm_start import (
    CACHE_FILE,
    DEFAULT_TRAINING,
    LOCAL_AGENT,
    WarmStartError,
    cache_key,
    cached,
    demo_example,
    format_rate,
    layout_agent,
    retrieved_observations,
    warm_start,
)
from pipeline.config.loader import load_config
from pipeline.config.schema import TinyModel
from retrieval.corpus import read_corpus

EPOCHS = 2  # about 12 s here (one thread): enough for the loss to fall by more than 0.5
TOOLS = ("search", "python")
# The local agent with room for the longest demo: the layout is compared where nothing is cut.
ROOMY = replace(LOCAL_AGENT, max_response_tokens=1024)


@pytest.fixture(scope="module")
def config(run_cache):
    """The default run's config on the suite's shared asset cache (tests/conftest.py)."""
    return load_config("configs/local.yaml", [f"runtime.cache_dir={run_cache}"])


@pytest.fixture(scope="module")
def world(config):
    """The default run's world (small, seed 0), read only here."""
    return prepare_world(config, quiet=True)


@pytest.fixture(scope="module")
def index(world, config):
    """The default run's index of that world."""
    return prepare_index(config, world / "corpus.jsonl", quiet=True)


@pytest.fixture(scope="module")
def warm(world, tmp_path_factory):
    """A short warm start (`EPOCHS`) of the default-size policy: (directory, its training)."""
    training = replace(DEFAULT_TRAINING, max_epochs=EPOCHS)
    return warm_start(
        world, tmp_path_factory.mktemp("warm") / "policy", training=training
    ), training


@pytest.fixture(scope="module")
def tokenizer(warm):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(warm[0], local_files_only=True)


def demos(world) -> list[dict]:
    return [json.loads(line) for line in (world / "demos.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------- layout


class ReplayEngine:
    """Generates the demo's turns, one per call, ending where the engine would stop."""

    version = 0

    def __init__(self, tokenizer, turns: list[list[int]]):
        self.tokenizer, self.turns = tokenizer, list(turns)

    async def generate(self, prompt_ids, params):
        ids = self.turns.pop(0)
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        stop = next(s for s in params.stop if text.endswith(s))
        return Generation(ids, [0.0] * len(ids), [0] * len(ids), "stop", stop)


class DemoRetrieval:
    """The retrieval client at its boundary: each query returns the passages the demo shows."""

    def __init__(self, response: str, corpus):
        by_title = {p.title: p for p in corpus}
        self.hits = {}
        for query, shown in re.findall(
            r"<search>(.*?)</search><information>(.*?)</information>", response, re.S
        ):
            titles = re.findall(r"Doc \d+\(Title: (.*?)\) ", shown)
            self.hits[" ".join(query.split())] = [(by_title[t], 1.0) for t in titles]

    async def search(self, query, topk=3):
        return self.hits[query]


@pytest.mark.parametrize("strategy", ["two_searches_python", "retry_search", "no_search"])
def test_a_demo_is_the_sequence_the_agent_loop_produces(world, tokenizer, strategy):
    # The longest demo of the strategy: its observations run past the agent's cut.
    demo = max(
        (d for d in demos(world) if d["strategy"] == strategy), key=lambda d: len(d["response"])
    )
    # The turns the policy generates: the demo without its observations and the newline after them.
    turns = re.split(
        r"<information>.*?</information>\n|<output>.*?</output>\n", demo["response"], flags=re.S
    )
    engine = ReplayEngine(tokenizer, [tokenizer.encode(t, add_special_tokens=False) for t in turns])
    tools = {
        "search": SearchTool(DemoRetrieval(demo["response"], read_corpus(world / "corpus.jsonl"))),
        "python": PythonTool(),
    }
    loop = AgentLoop(engine, tokenizer, tools, ROOMY)
    task = type(
        "Task",
        (),
        {
            "id": demo["id"],
            "question": demo["question"],
            "ground_truth": (demo["answer"],),
            "data_source": "minigaia",
        },
    )
    trajectory = asyncio.run(loop.run(task, demo["id"], 0))
    assert trajectory.finish_reason == "answer" and not engine.turns

    example = demo_example(demo, layout_agent(tokenizer, TOOLS, ROOMY))
    assert example.prompt_ids == trajectory.prompt_token_ids.tolist()
    assert example.response_ids == trajectory.token_ids.tolist()
    assert example.loss_mask == trajectory.loss_mask.tolist()
    generated = [t for t, m in zip(example.response_ids, example.loss_mask, strict=True) if m]
    assert tokenizer.decode(generated, skip_special_tokens=False) == "".join(turns)
    assert example.loss_mask[-1] == 1 and turns[-1].endswith("</answer>")
    if strategy == "two_searches_python":
        bodies = re.findall(r"<information>(.*?)</information>", demo["response"], re.S)
        assert max(len(tokenizer.encode(b)) for b in bodies) > ROOMY.max_observation_tokens


def test_the_learning_rate_warms_up_then_decays_over_the_planned_steps():
    t = Training(lr=1.0, warmup_steps=10, final_lr=0.1)
    assert learning_rate(t, 0, 0.0) == pytest.approx(0.1)
    assert learning_rate(t, 9, 0.0) == pytest.approx(1.0)
    assert learning_rate(t, 50, 0.5) == pytest.approx(0.55)
    assert learning_rate(t, 50, 1.0) == learning_rate(t, 50, 2.0) == pytest.approx(0.1)


def test_the_shared_prefix_changes_nothing_in_the_loss(world, warm, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(warm[0], local_files_only=True)
    agent = layout_agent(tokenizer, TOOLS, LOCAL_AGENT)
    batch = [demo_example(d, agent) for d in demos(world)[:4]]
    prefix = shared_prefix(batch)
    assert len(prefix) > 50  # the instruction
    with torch.no_grad():
        fast, n, _ = sft_loss(model, batch, prefix, tokenizer.pad_token_id)
        total = 0.0
        for e in batch:  # one sequence at a time, the model's own shifted loss
            labels = [-100] * len(e.prompt_ids) + [
                t if m else -100 for t, m in zip(e.response_ids, e.loss_mask, strict=True)
            ]
            out = model(
                input_ids=torch.tensor([e.prompt_ids + e.response_ids]),
                labels=torch.tensor([labels]),
            )
            total += out.loss.item() * sum(e.loss_mask)
    assert n == sum(sum(e.loss_mask) for e in batch)
    assert fast.item() == pytest.approx(total / n, rel=1e-4)


def test_the_weights_follow_the_epochs_not_the_clock(world, warm, tokenizer):
    """Same data and seed on an idle CPU and beside a busy process, with and without a deadline:
    bit-identical weights (a time budget once cut a busy machine's warm start short)."""
    import subprocess
    import sys

    import torch
    from transformers import AutoModelForCausalLM

    agent = layout_agent(tokenizer, TOOLS, LOCAL_AGENT)
    batch = [demo_example(d, agent) for d in demos(world)[:16]]
    training = Training(batch_tokens=1024, max_epochs=2, warmup_steps=2)

    def train(deadline):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(
            warm[0], local_files_only=True, dtype=torch.float32
        )
        result = train_sft(
            model, batch, tokenizer.pad_token_id, training, deadline, seed=0, progress=False
        )
        assert len(result["epochs"]) == 2 and result["steps"] >= 2
        return model.state_dict()

    idle = train(None)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])]
    try:
        loaded = train(time.monotonic() + 600)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert all(torch.equal(idle[k], loaded[k]) for k in idle)


def test_a_deadline_stops_training_instead_of_shortening_it(world, warm, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    agent = layout_agent(tokenizer, TOOLS, LOCAL_AGENT)
    batch = [demo_example(d, agent) for d in demos(world)[:8]]
    model = AutoModelForCausalLM.from_pretrained(
        warm[0], local_files_only=True, dtype=torch.float32
    )
    with pytest.raises(SftTimeout, match="epoch 1 of 3, step 0"):
        train_sft(
            model,
            batch,
            tokenizer.pad_token_id,
            Training(max_epochs=3),
            time.monotonic() - 1,
            seed=0,
            progress=False,
        )


def test_a_warm_start_past_its_guard_caches_nothing(world, tmp_path):
    target = tmp_path / "policy"
    with pytest.raises(
        WarmStartError,
        match=r"passed its 0\.001 s guard at epoch 1 of 60.*raise model\.warm_start_timeout_s",
    ):
        warm_start(world, target, timeout_s=0.001, progress=False)
    assert not target.exists() and not list(tmp_path.iterdir())


# -------------------------------------------------------------------------------- warm start


def test_a_short_warm_start_learns_and_writes_a_loadable_model(warm):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, _ = warm
    record = json.loads((path / CACHE_FILE).read_text())
    assert record["max_epochs"] == len(record["epochs"]) == EPOCHS
    assert record["steps"] > 0 and record["final_loss"] < record["first_loss"] - 0.5
    assert (
        record["weights_sha256"]
        == hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    )
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 128
    assert tokenizer.convert_tokens_to_ids("</answer>") != tokenizer.unk_token_id
    assert not [p.name for p in path.parent.iterdir() if p.name.startswith(".")]  # no leftovers


def test_a_second_call_is_served_from_the_cache(world, warm, capsys):
    path, _ = warm
    weights = path / "model.safetensors"
    written = weights.stat().st_mtime_ns
    start = time.monotonic()
    assert warm_start(world, path, training=warm[1]) == path
    assert time.monotonic() - start < 2.0
    assert weights.stat().st_mtime_ns == written
    said = capsys.readouterr().out
    assert f"{EPOCHS} epochs" in said and "(cached)" in said and "weights sha256" in said


def test_the_cache_key_follows_the_demos(world, warm, tmp_path):
    copy = tmp_path / "world"
    shutil.copytree(world, copy)
    args = (TinyModel(), TOOLS, LOCAL_AGENT, warm[1])
    key = cache_key(copy, *args)
    assert key == cache_key(world, *args) and cached(warm[0], key) is not None
    lines = (copy / "demos.jsonl").read_text().splitlines(keepends=True)
    (copy / "demos.jsonl").write_text("".join(lines[:-1]))
    changed = cache_key(copy, *args)
    assert changed != key and cached(warm[0], changed) is None
    assert cache_key(world, TinyModel(seed=1), *args[1:]) != key
    assert cache_key(world, args[0], ("search",), *args[2:]) != key
    assert cache_key(world, *args[:3], replace(warm[1], max_epochs=EPOCHS + 1)) != key


def test_the_cache_key_names_the_float_kernels(world, warm):
    import torch

    args = (world, TinyModel(), TOOLS, LOCAL_AGENT, warm[1])
    threads = torch.get_num_threads()
    key = cache_key(*args)
    try:
        torch.set_num_threads(threads + 1)
        assert cache_key(*args) != key  # another thread count rounds floats otherwise
    finally:
        torch.set_num_threads(threads)


def test_a_world_without_demos_is_refused_in_one_line(tmp_path):
    with pytest.raises(WarmStartError, match=r"demos\.jsonl is missing; build the world"):
        warm_start(tmp_path, tmp_path / "policy")


def test_demo_searches_show_what_the_runs_index_returns(world, index):
    from retrieval.corpus import format_passages
    from retrieval.server import load_search

    original = demos(world)[:40]
    swapped = retrieved_observations(original, index, topk=3)
    search = load_search(str(index))
    step = re.compile(r"<search>(.*?)</search><information>\n(.*?)</information>", re.S)
    changed = 0
    for before, after in zip(original, swapped, strict=True):
        for m in step.finditer(after["response"]):
            query = " ".join(m.group(1).split())
            assert m.group(2) == format_passages([p for p, _ in search([query], 3)[0]])
        same = lambda r: step.sub("<search>\\1</search>", r)  # noqa: E731
        assert same(before["response"]) == same(after["response"])  # only the results differ
        changed += before["response"] != after["response"]
    assert changed > 0
    key = lambda r: cache_key(world, TinyModel(), TOOLS, LOCAL_AGENT, Training(), r)  # noqa: E731
    assert key(None) != key({"corpus_sha256": "x", "topk": 3})


# ----------------------------------------------------------------------------- measurement


def test_the_format_rate_runs_the_agent_end_to_end(world, warm, index):
    reports = format_rate(warm[0], world, n=8, temperatures=(0.0, 1.0), index_dir=index)
    assert [r.temperature for r in reports] == [0.0, 1.0]
    for r in reports:
        assert r.trajectories == 8 and sum(r.finish.values()) == 8
        for share in (r.well_formed, r.answered, r.exact_match, *r.tool_calls.values()):
            assert 0.0 <= share <= 1.0
        assert sum(r.tool_calls.values()) == pytest.approx(1.0)
        assert 0 <= r.mean_tool_calls <= LOCAL_AGENT.max_turns
