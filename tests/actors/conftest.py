"""A tiny Qwen2 policy (random weights, tokenizer trained on synthetic agent text), built once."""

import pytest

from pipeline.tiny_policy import build_tiny_policy

TEXTS = [
    f"Question {i}: where was Varno Telik born? <think> I should search. </think> <search> Varno Telik "
    f"</search> <information> Doc 1(Title: Varno Telik) born in Quorvex in {1900 + i % 90}. </information> "
    f"<python> print({i} + 1) </python> <output> {i + 1} </output> <answer> Quorvex </answer>"
    for i in range(2000)
]


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory):
    return build_tiny_policy(tmp_path_factory.mktemp("policy") / "tiny", TEXTS, vocab_size=600)
