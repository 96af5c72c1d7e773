"""The embedded default's policy: a tiny Qwen2-architecture model built from config, with a
byte-level BPE tokenizer trained offline on the bundled world's text. Nothing is downloaded.

The agent's tags are single tokens (added, not special, so decoding keeps them) and the chat
template is Qwen's ChatML layout, so the agent loop treats this model like any HF chat model.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from learner.weight_sync import save_hf

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
TAG_TOKENS = [
    "<think>",
    "</think>",
    "<search>",
    "</search>",
    "<information>",
    "</information>",
    "<python>",
    "</python>",
    "<output>",
    "</output>",
    "<answer>",
    "</answer>",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2000):
    """A byte-level BPE tokenizer (any text encodes; no unknown tokens) wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TAG_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tokenizer.add_tokens(TAG_TOKENS)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_policy(
    out_dir: str | os.PathLike[str],
    texts: Iterable[str],
    *,
    layers: int = 2,
    hidden_size: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate_size: int = 512,
    vocab_size: int = 2000,
    max_position: int = 1024,
    seed: int = 0,
) -> Path:
    """Train the tokenizer, initialise the model, save both as an HF directory (atomically)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    tokenizer = train_tokenizer(texts, vocab_size)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)

    return save_hf(out_dir, model, tokenizer)
