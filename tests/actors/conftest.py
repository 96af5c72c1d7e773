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
def world_index(tmp_path_factory):
    """The small mini-GAIA world, indexed with the real MiniLM encoder: (index, search function)."""
    import os

    from pipeline.assets.world import build_world, write_world
    from retrieval.build import build
    from retrieval.encoders import load_encoder
    from retrieval.index import PassageIndex
    from retrieval.server import index_search

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    root = tmp_path_factory.mktemp("world")
    write_world(build_world(seed=0, size="small"), root / "world")
    build(str(root / "world" / "corpus.jsonl"), str(root / "index"), quiet=True)
    index = PassageIndex.load(root / "index")
    return index, index_search(index, load_encoder(index.meta.encoder).encode_queries)
