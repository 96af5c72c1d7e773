import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

from retrieval.encoders import EncoderError, load_encoder, resolve_encoder_path


def test_minilm_from_its_pip_package(encoder):
    assert encoder.dim == 384 and encoder.normalize and encoder.pooling == "mean"
    vectors = encoder.encode_queries(["where is Ardenport", "fruit of Belvaro", ""])
    assert vectors.shape == (3, 384) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    # MiniLM has no prefixes: the same text embeds the same as query and passage.
    np.testing.assert_allclose(
        encoder.encode_passages(["abc"]), encoder.encode_queries(["abc"]), atol=1e-6
    )
    similar = vectors[0] @ encoder.encode_passages(["Ardenport is a harbour town."])[0]
    unrelated = vectors[0] @ encoder.encode_passages(["The weather note is unrelated."])[0]
    assert similar > unrelated


def tiny_e5(directory):
    """A small random BERT with a word-level tokenizer, saved as an E5-style directory."""
    vocab = {
        w: i
        for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "query:", "passage:", "a", "b"])
    }
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")
    fast.save_pretrained(directory)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
    )
    BertModel(config).save_pretrained(directory)


def test_e5_style_prefixes_queries_and_passages(tmp_path):
    directory = tmp_path / "tiny-e5"
    tiny_e5(directory)
    e5 = load_encoder(str(directory))
    assert (e5.query_prefix, e5.passage_prefix) == ("query: ", "passage: ")
    q, p = e5.encode_queries(["a b"]), e5.encode_passages(["a b"])
    assert q.shape == (1, 16) and not np.allclose(q, p)
    plain = load_encoder(str(directory), style="plain")
    np.testing.assert_allclose(
        plain.encode_queries(["a b"]), plain.encode_passages(["a b"]), atol=1e-6
    )


def test_unknown_encoder_says_what_to_do():
    with pytest.raises(EncoderError, match="pip install no-such-encoder-pkg"):
        resolve_encoder_path("no-such-encoder-pkg")


def test_a_directory_without_a_model(tmp_path):
    with pytest.raises(EncoderError, match="cannot load encoder"):
        load_encoder(str(tmp_path))
