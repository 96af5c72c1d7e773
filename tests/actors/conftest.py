"""A tiny Qwen2 policy (random weights, tokenizer trained on synthetic agent text), built once."""

import pytest

from pipeline.assets.tiny_policy import build_tiny_policy

TEXTS = [
    f"Question {i}: where was Varno Telik born? <think> I should search. </think> <search> Varno Telik "
    f"</search> <information> Doc 1(Title: Varno Telik) born in Quorvex in {1900 + i % 90}. </information> "
    f"<python> print({i} + 1) </python> <output> {i + 1} </output> <answer> Quorvex </answer>"
    for i in range(2000)
]


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory):
    return build_tiny_policy(tmp_path_factory.mktemp("policy") / "tiny", TEXTS, vocab_size=600)


@pytest.fixture(scope="session")
def long_policy_dir(tmp_path_factory):
    """The tests' tiny policy with room for 4,096 positions: its 600-token vocabulary spells the
    tools' schemas in ~700 tokens."""
    return build_tiny_policy(
        tmp_path_factory.mktemp("policy") / "tiny", TEXTS, vocab_size=600, max_position=4096
    )


@pytest.fixture(scope="session")
def world_index(run_cache):
    """The default run's world (small, seed 0) and its index with the real MiniLM encoder, from
    the suite's shared asset cache (tests/conftest.py; built here if no run has built them yet):
    (index, search function)."""
    from pipeline.assets.cache import prepare_index, prepare_world
    from pipeline.config.loader import load_config
    from retrieval.encoders import load_encoder
    from retrieval.index import PassageIndex
    from retrieval.server import index_search

    config = load_config("configs/local.yaml", [f"runtime.cache_dir={run_cache}"])
    world = prepare_world(config, quiet=True)
    index = PassageIndex.load(prepare_index(config, world / "corpus.jsonl", quiet=True))
    return index, index_search(index, load_encoder(index.meta.encoder).encode_queries)
