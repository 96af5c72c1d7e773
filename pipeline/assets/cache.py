"""What a run needs on disk, built once and reused: the mini-GAIA world, its faiss index and the
warm-started tiny policy. Each lives in the cache under a name that says what it was built from,
and each builder writes atomically, so an interrupted build is simply redone next time. Runs that
share a cache directory (a sweep, a test suite in several processes) build each asset once: the
builder holds a lock file beside it (`.NAME.lock`) and the others wait, then find it built.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from filelock import FileLock

from learner.sft import Training
from pipeline.assets.warm_start import DEFAULT_TRAINING, LOCAL_AGENT, warm_start, warm_start_key
from pipeline.assets.world import SKEW, VERSION, build_world, write_world
from pipeline.config.schema import PretrainedModel, StrataConfig, TinyModel
from retrieval.build import build
from retrieval.corpus import corpus_hash
from retrieval.index import FORMAT_VERSION, build_settings
from retrieval.kinds import IndexSpec


@dataclass(frozen=True)
class Assets:
    world_dir: Path | None  # the mini-GAIA world (None for other data types)
    index_dir: Path | None  # the retrieval index (None when a server URL is configured)
    policy_dir: Path  # an HF model directory


def _say(message: str, quiet: bool) -> None:
    if not quiet:
        print(f"strata: {message}", flush=True)


@contextmanager
def _building(target: Path) -> Iterator[None]:
    """Hold `target`'s build lock: one process at a time checks whether it is built and builds it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.with_name(f".{target.name}.lock")):
        yield


def _world_version(world_dir: Path) -> int | None:
    try:
        return json.loads((world_dir / "world.json").read_text(encoding="utf-8")).get("version")
    except (OSError, ValueError, AttributeError):
        return None


def prepare_world(config: StrataConfig, quiet: bool = False) -> Path:

    data = config.data
    # The default world keeps the directory name it had before the skew could be set.
    skew = "" if data.world_skew == SKEW else f"-skew{data.world_skew!r}"  # exact: 1.3 vs 1.3000001
    if data.world_chains_astray is not None:
        skew += f"-astray{data.world_chains_astray!r}"
    if data.world_chain_demos is not None:
        skew += f"-chains{data.world_chain_demos!r}"
    if data.world_guess_sharpness is not None:
        skew += f"-sharp{data.world_guess_sharpness!r}"
    target = Path(config.runtime.cache_dir) / f"world-{data.world_size}-seed{data.seed}{skew}"
    with _building(target):
        if _world_version(target) != VERSION:  # none yet, or one an earlier Strata wrote
            _say(f"building the mini-GAIA world ({data.world_size}{skew}) in {target}", quiet)
            world = build_world(
                data.seed,
                data.world_size,
                data.world_skew,
                data.world_chains_astray,
                data.world_chain_demos,
                data.world_guess_sharpness,
            )
            write_world(world, target, force=target.exists())
    return target


def prepare_index(config: StrataConfig, corpus: Path, quiet: bool = False) -> Path:

    if config.retrieval.index_dir is not None:
        return Path(config.retrieval.index_dir)
    digest = corpus_hash(corpus)[:12]
    encoder = config.retrieval.encoder.replace("/", "_")
    r = config.retrieval
    spec = IndexSpec(r.index, nlist=r.nlist, hnsw_m=r.hnsw_m, pq_m=r.pq_m)
    settings = "".join(f"-{k}{v}" for k, v in build_settings(spec).items())
    target = Path(config.runtime.cache_dir) / f"index-{digest}-{encoder}-{r.index}{settings}"
    meta = target / "meta.json"
    with _building(target):
        described = json.loads(meta.read_text()) if meta.is_file() else {}
        if not (
            described.get("corpus_sha256", "").startswith(digest)
            and described.get("format") == FORMAT_VERSION  # an older format is rebuilt
        ):
            _say(f"indexing {corpus} with {config.retrieval.encoder} into {target}", quiet)
            build(
                str(corpus),
                str(target),
                config.retrieval.encoder,
                spec,
                force=True,
                quiet=quiet,
            )
    return target


WARM_START_TOOLS = {"web_search": "search"}
"""A run's tool -> the tool whose demonstrations the tiny policy's warm start trains on."""


def prepare_policy(
    config: StrataConfig, world_dir: Path | None, quiet: bool = False, index_dir: Path | None = None
) -> Path:
    if isinstance(config.model, PretrainedModel):
        path = Path(config.model.path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model.path {path} is not an HF model directory (no config.json)"
            )
        _say(f"policy: {path} (model.path, used as it is)", quiet)
        return path
    assert isinstance(config.model, TinyModel)
    if world_dir is None:
        raise ValueError(
            "model.type tiny is warm-started on the mini-GAIA world: set data.type mini_gaia"
        )

    # The demos teach the tags the run's tools answer: web_search answers <search> as the local
    # search does (its demos' results are then the world's own); browse and plug-ins have none.
    taught = (WARM_START_TOOLS.get(t, t) for t in config.actors.tool_names)
    tools = tuple(dict.fromkeys(t for t in taught if t in ("search", "python")))
    training: Training = replace(DEFAULT_TRAINING, max_epochs=config.model.warm_start_epochs)
    # The directory is named by the key: two recipes never share (or replace) a cache entry.
    settings = replace(LOCAL_AGENT, format=config.actors.format)  # demos in the run's format
    key = warm_start_key(
        world_dir, config.model, tools, settings, training, index_dir, config.retrieval.topk
    )
    name = (
        f"policy-tiny-seed{config.model.seed}-{training.max_epochs}ep-{world_dir.name}-{key[:12]}"
    )
    target = Path(config.runtime.cache_dir) / name
    with _building(target):
        return warm_start(
            world_dir,
            target,
            config.model,
            tools=tools,
            settings=settings,
            training=training,
            timeout_s=config.model.warm_start_timeout_s,
            progress=not quiet,
            index_dir=index_dir,  # demos then show what this run's searches return
            topk=config.retrieval.topk,
        )


def prepare_assets(config: StrataConfig, quiet: bool = False) -> Assets:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The tiny policy's tokenizer and warm start come from the world, whatever the run trains on.
    worldly = config.data.type == "mini_gaia" or isinstance(config.model, TinyModel)
    world = prepare_world(config, quiet) if worldly else None
    index = None
    if "search" in config.actors.tools and config.retrieval.url is None:
        corpus = (
            Path(config.retrieval.corpus)
            if config.retrieval.corpus
            else (world / "corpus.jsonl" if world else None)
        )
        if corpus is None:
            raise ValueError(
                "the search tool needs retrieval.url, retrieval.index_dir or retrieval.corpus"
            )
        index = prepare_index(config, corpus, quiet)
    return Assets(world, index, prepare_policy(config, world, quiet, index))
