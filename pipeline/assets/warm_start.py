"""Warm start of the embedded default's tiny policy: supervised fine-tuning on the world's demos.

    python -m pipeline.assets.warm_start --world DIR --out DIR [--size small] [--seed S] [--index DIR]

A policy with random weights never closes a tag, so RL from scratch has no signal. The warm
start builds the tokenizer and model from the world's text (`build_tiny_policy`, nothing is
downloaded), then fine-tunes on `demos.jsonl` laid out token for token as `AgentLoop` lays out a
trajectory: its prompt ids, then generated turns (loss) and tool observations (no loss) with the
loop's own observation ids. The demos mix strategies on purpose (no search, one, two, python, a
retry), so the policy learns the format and keeps the mix that stratified GRPO then sorts out.
Every epoch renames the demos' entities afresh (`NameSwap`, from the world's name pools): a policy
that memorised a few hundred demos would answer training questions from memory and held-out ones
not at all; renamed, it has to copy names and facts from the question and the passages.

The recipe is epochs, not seconds: training runs exactly `Training.max_epochs`, so a build is the
same (the same weights digest) on an idle or a busy machine of one kind. The optional timeout is a
guard: a build that passes it stops with one line and leaves nothing in the cache, never a
shorter-trained policy. The key hashes everything the weights depend on (data, architecture,
tools, layout, training, retrieval, torch version and thread count: another thread count or CPU
rounds floats otherwise) and the cache directory is named by it. A run's report.md and terminal
name the policy with a digest of its weights, so two runs can tell whether they started alike.
The HF directory is written atomically with a `warm_start.json` whose key makes a second call free.
`format_rate` runs the real agent loop, search server and sandbox on held-out test questions.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

from actors.agent import AgentLoop, AgentSettings
from actors.formats import FORMATS
from actors.tools import MAX_QUERY_CHARS, PythonTool, SearchTool
from learner.sft import SftExample, SftTimeout, Training, train_sft
from pipeline.assets.datasets import DatasetError
from pipeline.assets.name_swap import NameSwap
from pipeline.assets.tiny_policy import build_tiny_policy
from pipeline.assets.world import WorldError, build_world, write_world
from pipeline.config.schema import TinyModel
from pipeline.evaluation.format_rate import LOCAL_AGENT, format_rate
from retrieval.build import build
from retrieval.corpus import format_passages
from retrieval.server import load_search

DEFAULT_TRAINING = Training()
CODE_VERSION = 6  # 5: 60 epochs, no plateau stop; 6: epochs decide, the clock only guards
"""Bump when the data layout or the training changes: every cached warm start is then rebuilt."""
CACHE_FILE = "warm_start.json"
ARCHITECTURE = (
    "layers",
    "hidden_size",
    "heads",
    "kv_heads",
    "intermediate_size",
    "vocab_size",
    "max_position",
    "seed",
)
"""The TinyModel fields that make the weights (and key the cache); the others are run settings."""
_TOOL_TAGS = {"search": SearchTool, "python": PythonTool}  # the classes carry name and tags
_BY_OBSERVATION = {tool.open_tag: tool for tool in _TOOL_TAGS.values()}
_OBSERVATION = re.compile(r"(<information>|<output>)(.*?)(</information>|</output>)", re.S)
_ACTION_ENDS = ("</search>", "</python>", "</answer>")
_SEARCH_STEP = re.compile(r"<search>(.*?)</search>(\s*)<information>(.*?)</information>", re.S)


class WarmStartError(ValueError):
    """A world or a demo the warm start cannot use; the message says what to do, in one line."""


# --------------------------------------------------------------------------------- data layout


def layout_agent(tokenizer, tools: Sequence[str], settings: AgentSettings) -> AgentLoop:
    """An agent loop used for its prompt and observation layout only: it never generates."""
    return AgentLoop(None, tokenizer, {t: _TOOL_TAGS[t] for t in tools}, settings)  # type: ignore[arg-type]


def split_demo(response: str) -> list[tuple[str, str, str] | str]:
    """The demo's turns in order: generated text (str) and observations (open, body, close).

    The agent's observation layout brings its own blank lines around the tags, so the newline a
    demo writes after a closing tag is not generated text; nor is the newline demos write after
    `<information>` part of the body (SearchTool's result starts at `Doc 1`).
    """
    parts: list[tuple[str, str, str] | str] = []
    start = 0
    for match in _OBSERVATION.finditer(response):
        open_tag, body, close_tag = match.groups()
        parts += [response[start : match.start()], (open_tag, body.removeprefix("\n"), close_tag)]
        start = match.end()
    parts.append(response[start:])
    return [p if isinstance(p, tuple) else p.lstrip("\n") for p in parts]


def retrieved_observations(
    demos: Sequence[Mapping], index_dir: str | os.PathLike[str], topk: int
) -> list[dict]:
    """The demos with every search result replaced by what the run's index returns for that query.

    The world writes each search's result as the gold passage among random ones of its kind; the
    agent will see the retriever's top `topk` instead. Training on exactly those observations
    (queries normalised as `SearchTool` sends them) makes a demo the trajectory the agent loop
    would produce, so a policy that issues a demo's query sees the context it was trained on.
    """

    def normal(query: str) -> str:
        return " ".join(query.split())[:MAX_QUERY_CHARS]

    queries = sorted(
        {normal(m.group(1)) for d in demos for m in _SEARCH_STEP.finditer(d["response"])} - {""}
    )
    search = load_search(str(index_dir))
    shown = {
        q: format_passages([p for p, _ in hits])
        for q, hits in zip(queries, search(queries, topk), strict=True)
    }

    def swap(m: re.Match) -> str:
        body = shown.get(normal(m.group(1)), m.group(3).removeprefix("\n"))
        return f"<search>{m.group(1)}</search>{m.group(2)}<information>\n{body}</information>"

    return [{**d, "response": _SEARCH_STEP.sub(swap, d["response"])} for d in demos]


def demo_example(demo: Mapping, agent: AgentLoop) -> SftExample:
    """The token sequence the agent loop produces when it generates what the demo generated."""
    prompt = agent.prompt_ids(SimpleNamespace(question=demo["question"]))  # type: ignore[arg-type]
    ids: list[int] = []
    mask: list[int] = []
    for part in split_demo(demo["response"]):
        if isinstance(part, tuple):
            tool, body = _BY_OBSERVATION[part[0]], part[1]
            limit = agent.settings.max_observation_tokens
            piece, value = agent.format.observation_ids(agent.tokenizer, tool, body, limit), 0
        else:
            ends = [i + len(e) for e in _ACTION_ENDS if (i := part.find(e)) >= 0]
            if min(ends, default=-1) != len(part):  # the engine stops at the first action tag
                raise WarmStartError(
                    f"demo {demo.get('id')}: a turn must end at its first </search>, </python> or "
                    f"</answer>, got {part[-40:]!r}; rebuild the world with python -m pipeline.assets.world"
                )
            text = agent.format.from_tags(part)  # demos are written in tags
            piece, value = agent.tokenizer.encode(text, add_special_tokens=False), 1
        ids += piece
        mask += [value] * len(piece)
    return SftExample(prompt, ids, mask)


# ---------------------------------------------------------------------------------------- cache


def _architecture(model: TinyModel) -> dict:
    return {name: getattr(model, name) for name in ARCHITECTURE}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _index_identity(index_dir: str | os.PathLike[str] | None, topk: int) -> dict | None:
    """What the retrieved observations depend on: the index's corpus, encoder and kind, and k."""
    if index_dir is None:
        return None
    meta = json.loads((Path(index_dir) / "meta.json").read_text(encoding="utf-8"))
    return {k: meta.get(k) for k in ("corpus_sha256", "encoder", "encoder_style", "kind")} | {
        "topk": topk
    }


def cache_key(
    world_dir: str | os.PathLike[str],
    model: TinyModel,
    tools: Sequence[str],
    settings: AgentSettings,
    training: Training,
    retrieval: dict | None = None,
) -> str:
    """sha256 over everything the warm-started weights depend on (the seed is in `model`); the
    float kernels are named by torch's version and thread count (the CPU itself is not)."""
    import torch

    world = Path(world_dir)
    inputs = {
        "demos": _sha256(world / "demos.jsonl"),
        "corpus": _sha256(world / "corpus.jsonl"),  # the tokenizer is trained on it
        "model": _architecture(model),
        "tools": list(tools),
        "observation_tokens": settings.max_observation_tokens,
        "training": asdict(training),
        "retrieval": retrieval,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "code_version": CODE_VERSION,
    }
    if settings.format != "tags":  # keys of warm starts made before actors.format stay as they were
        inputs["format"] = settings.format
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def warm_start_key(
    world_dir: str | os.PathLike[str],
    model: TinyModel,
    tools: Sequence[str],
    settings: AgentSettings,
    training: Training,
    index_dir: str | os.PathLike[str] | None,
    topk: int,
) -> str:
    """`cache_key` of a warm start built with `index_dir`'s search results (if it searches)."""
    index = index_dir if "search" in tools else None
    return cache_key(world_dir, model, tools, settings, training, _index_identity(index, topk))


def cached(out_dir: str | os.PathLike[str], key: str) -> dict | None:
    """The record of a finished warm start in `out_dir` with this key, else None."""
    record = Path(out_dir) / CACHE_FILE
    try:
        info = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return info if info.get("key") == key and (record.parent / "config.json").is_file() else None


# ------------------------------------------------------------------------------------- training


def _read_world(world: Path) -> tuple[list[dict], list[str], dict[str, list[str]]]:
    """(demos, corpus passage texts, the pools names are composed from)."""
    lines = {}
    for name in ("demos.jsonl", "corpus.jsonl"):
        if not (world / name).is_file():
            raise WarmStartError(
                f"{world / name} is missing; build the world with python -m pipeline.assets.world --out {world}"
            )
        lines[name] = [json.loads(line) for line in (world / name).read_text("utf-8").splitlines()]
    if not lines["demos.jsonl"]:
        raise WarmStartError(f"{world / 'demos.jsonl'} holds no demos; rebuild the world")
    try:
        parts = json.loads((world / "world.json").read_text("utf-8")).get("name_parts") or {}
    except (OSError, ValueError, AttributeError):
        raise WarmStartError(
            f"{world / 'world.json'} is missing or unreadable; rebuild the world"
        ) from None
    return lines["demos.jsonl"], [p["contents"] for p in lines["corpus.jsonl"]], parts


def _replace_dir(tmp: Path, target: Path) -> None:
    """Move the finished `tmp` to `target`; an earlier `target` is removed only afterwards."""
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    if target.exists():
        target.rename(old)
    try:
        tmp.rename(target)
    except BaseException:
        if old.exists() and not target.exists():
            old.rename(target)
        raise
    shutil.rmtree(old, ignore_errors=True)


def warm_start(
    world_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    model: TinyModel | Mapping | None = None,
    *,
    tools: Sequence[str] = ("search", "python"),
    settings: AgentSettings = LOCAL_AGENT,
    training: Training = DEFAULT_TRAINING,
    timeout_s: float | None = None,
    progress: bool = True,
    index_dir: str | os.PathLike[str] | None = None,
    topk: int = 3,
) -> Path:
    """Build and fine-tune the tiny policy on the world's demos; returns the HF directory.

    `training.max_epochs` decides how long it trains. `timeout_s` guards the whole call,
    tokenizer included: past it, `WarmStartError` and nothing written. `settings` must be the
    run's agent settings (the observation cut is part of the layout). `index_dir`: the run's
    search index; the demos' search results are then what it returns (`retrieved_observations`),
    else the world's own. A directory holding a warm start with the same key is returned at once.
    """
    began = time.monotonic()
    world, target = Path(world_dir), Path(out_dir)
    spec = model if isinstance(model, TinyModel) else TinyModel.model_validate(dict(model or {}))
    if unknown := set(tools) - set(_TOOL_TAGS):
        raise WarmStartError(f"unknown tools {sorted(unknown)}: choose from {sorted(_TOOL_TAGS)}")
    demos, corpus, name_parts = _read_world(world)
    if "search" not in tools:
        index_dir = None
    key = warm_start_key(world, spec, tools, settings, training, index_dir, topk)
    if cached(target, key) is not None:
        if progress:
            print(f"strata: policy: {describe(target)} (cached)", flush=True)
        return target
    if target.exists() and any(target.iterdir()) and not (target / CACHE_FILE).is_file():
        raise WarmStartError(
            f"{target} holds files but no {CACHE_FILE}; not replacing it: choose another output directory"
        )

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        # The tokenizer sees every prompt and response as the agent writes them, so the
        # instruction that opens each prompt, and the format's calls, are learnt as whole words.
        speech = FORMATS[settings.format]
        opening = speech.instruction({t: _TOOL_TAGS[t] for t in tools})  # type: ignore[arg-type]
        prompts = [f"{opening} Question: {d['question']}\n" for d in demos]
        responses = [speech.from_tags(d["response"]) for d in demos]  # tags: as written
        build_tiny_policy(tmp / "init", corpus + prompts + responses, **_architecture(spec))
        tokenizer = AutoTokenizer.from_pretrained(tmp / "init", local_files_only=True)
        policy = AutoModelForCausalLM.from_pretrained(
            tmp / "init", local_files_only=True, dtype=torch.float32
        )
        agent = layout_agent(tokenizer, tools, settings)
        if index_dir is not None:
            demos = retrieved_observations(demos, index_dir, topk)
        swap = NameSwap(name_parts, spec.seed) if name_parts else None

        def examples(epoch: int) -> list[SftExample]:  # every epoch renames the demos afresh
            return [demo_example(swap(d, epoch) if swap else d, agent) for d in demos]

        if progress:
            print(
                f"warm start: {len(demos)} demos, {sum(map(len, examples(0))):,} tokens; tokenizer "
                f"and model built in {time.monotonic() - began:.1f}s",
                flush=True,
            )
        torch.manual_seed(spec.seed)
        deadline = None if timeout_s is None else began + timeout_s
        try:
            result = train_sft(
                policy, examples, tokenizer.pad_token_id, training, deadline, spec.seed, progress
            )
        except SftTimeout as exc:
            raise WarmStartError(
                f"the warm start passed its {timeout_s:g} s guard at {exc} (nothing was cached): "
                f"raise model.warm_start_timeout_s, or run it where the CPU is less busy"
            ) from None
        final = tmp / "model"
        policy.eval().save_pretrained(final)
        tokenizer.save_pretrained(final)
        record = {
            "key": key,
            "code_version": CODE_VERSION,
            "model": _architecture(spec),
            "tools": list(tools),
            "demos": len(demos),
            "renamed": swap is not None,
            "retrieval": _index_identity(index_dir, topk),
            "max_epochs": training.max_epochs,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "built": time.strftime("%Y-%m-%d %H:%M", time.localtime()),
            "seconds": round(time.monotonic() - began, 1),
            **result,
            "weights_sha256": _sha256(final / "model.safetensors"),
        }
        (final / CACHE_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        final.chmod(0o755)
        _replace_dir(final, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if progress:
        print(f"strata: policy: {describe(target)} (built now)", flush=True)
    return target


def _summary(record: Mapping) -> str:
    return (
        f"{len(record['epochs'])} epochs, {record['steps']} steps, loss "
        f"{record['first_loss']:.3f} -> {record['final_loss']:.3f}"
    )


def describe(policy_dir: Path) -> str:
    """How a cached warm start was made, in one line: the run prints it before it streams."""
    record = json.loads((policy_dir / CACHE_FILE).read_text(encoding="utf-8"))
    return (
        f"warm start {policy_dir}: {_summary(record)}, seed {record['model']['seed']}, "
        f"{record['threads']} threads, torch {record['torch']}, built {record['built']} in "
        f"{record['seconds']:.0f} s; weights sha256 {record['weights_sha256'][:16]}"
    )


# ------------------------------------------------------------------------------------ measuring


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.assets.warm_start", description=__doc__.split("\n")[0]
    )
    p.add_argument("--world", required=True, help="world directory (built there if it has none)")
    p.add_argument("--out", required=True, help="HF model directory to write (cached by key)")
    p.add_argument("--size", default="small", help="size of the world if it is built (small)")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the weights, the data order and a built world"
    )
    p.add_argument(
        "--epochs",
        type=int,
        default=DEFAULT_TRAINING.max_epochs,
        help=f"epochs of training ({DEFAULT_TRAINING.max_epochs})",
    )
    p.add_argument(
        "--timeout", type=float, help="seconds after which the build stops with an error (none)"
    )
    p.add_argument("--eval-n", type=int, help="test questions to measure (default: all)")
    p.add_argument("--no-eval", action="store_true", help="skip the format measurement")
    p.add_argument(
        "--index",
        help="index of the world's corpus: the demos' search results and the measurement use it (built if missing)",
    )
    p.add_argument(
        "--max-response-tokens",
        type=int,
        default=LOCAL_AGENT.max_response_tokens,
        help="the agent's response budget when measuring (configs/local.yaml: 384)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    try:
        world = Path(args.world)
        if not (world / "world.json").is_file():
            write_world(build_world(args.seed, args.size), world)
            print(f"built the {args.size} world (seed {args.seed}) in {world}", flush=True)
        if args.index and not (Path(args.index) / "meta.json").is_file():
            build(str(world / "corpus.jsonl"), args.index, quiet=True)
        start = time.monotonic()
        training = replace(DEFAULT_TRAINING, max_epochs=args.epochs)
        path = warm_start(
            world,
            args.out,
            TinyModel(seed=args.seed),
            training=training,
            timeout_s=args.timeout,
            index_dir=args.index,
        )
        record = json.loads((path / CACHE_FILE).read_text(encoding="utf-8"))
        print(
            f"warm start: {_summary(record)}; {time.monotonic() - start:.1f}s this call", flush=True
        )
        if not args.no_eval:
            settings = replace(LOCAL_AGENT, max_response_tokens=args.max_response_tokens)
            for report in format_rate(
                path, world, args.eval_n, settings=settings, index_dir=args.index
            ):
                print(report.line(), flush=True)
    except (WarmStartError, DatasetError, WorldError) as exc:
        print(f"strata warm-start: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
