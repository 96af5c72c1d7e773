"""Teach the tiny CPU policy the atlas's tools, so that a CPU run shows them called.

    python -m strata_example_task.teach examples/strata_example_task/config.yaml --out DIR

Strata's tiny policy is warm-started on its own mini-GAIA world, where the tools are search and
python: it has never seen `<lookup>` and does not call it (0 of 32 samples at temperature 1.0).
A real model reads the tool's schema in the prompt; the tiny one has to be shown. This writes a
copy of the run's warm start fine-tuned on one demonstration per training question (look the key
up, convert a river's length with the MCP server, answer), tokenised exactly as the agent loop
would see the run: the same prompt (the tools' lines come from the run's own tool objects, the
MCP server started and listed), the same observation layout. Train on it with

    python -m pipeline.launch examples/strata_example_task/config.yaml \
        --set model.type=hf --set model.path=DIR --set model.dtype=float32

This is the example's own step, not a Strata feature: nothing here is needed with a model that
reads instructions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from strata_example_task.atlas import DATA, atlas, km_to_miles

MCP_TOOL = "units_km_to_miles"


def demo(row: dict) -> list[tuple[str, str | None]]:
    """The demonstration of one question: (generated text, None) and (tool name, its result)."""
    table, key = row["table"], row["key"]
    value = atlas()[table][key]
    call = json.dumps({"table": table, "key": key})
    parts: list[tuple[str, str | None]] = [
        (f"<lookup> {call}</lookup>", None),
        ("lookup", str(value)),
    ]
    if table == "river_km":
        parts += [
            (
                f"<{MCP_TOOL}> {json.dumps({'km': value})}</{MCP_TOOL}>",
                None,
            ),
            (MCP_TOOL, str(km_to_miles(value))),
        ]
    answer = row["gold"][0]
    parts.append((f"<think>The answer is {answer}.</think>\n<answer> {answer}</answer>", None))
    return parts


async def examples(config, tokenizer, rows: list[dict], log_dir: Path) -> list:
    """The SFT examples of `rows`, with the run's own tools (its MCP server started, then
    stopped) making the prompts and observations."""
    from actors.formats import FORMATS
    from learner.sft import SftExample
    from pipeline.runtime.parts import make_tools, open_mcp_servers

    tools = make_tools(config.actors, config.retrieval, None)
    servers = await open_mcp_servers(config.actors, tools, log_dir)
    try:
        fmt = FORMATS[config.actors.format]
        limit = config.actors.max_observation_tokens
        out = []
        for row in rows:
            allowed = row.get("allowed")
            offered = {n: t for n, t in tools.items() if allowed is None or n in allowed}
            prompt = fmt.prompt_ids(tokenizer, offered, row["prompt"])
            ids: list[int] = []
            mask: list[int] = []
            for text, result in demo(row):
                if result is None:
                    piece = tokenizer.encode(fmt.from_tags(text), add_special_tokens=False)
                else:
                    piece = fmt.observation_ids(tokenizer, tools[text], result, limit)
                ids += piece
                mask += [1 if result is None else 0] * len(piece)
            out.append(SftExample(prompt, ids, mask))
        return out
    finally:
        for server in servers:
            await server.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="the example's config (its tools, format and model)")
    parser.add_argument("--out", required=True, help="where the taught policy is written")
    parser.add_argument("--set", action="append", default=[], help="a config override")
    parser.add_argument(
        "--policy", help="the policy to teach (default: the config's own warm start, built once)"
    )
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from learner.sft import Training, train_sft
    from pipeline.assets.cache import prepare_assets
    from pipeline.config.loader import load_config

    config = load_config(args.config, args.set)
    policy = Path(args.policy) if args.policy else prepare_assets(config).policy_dir
    tokenizer = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy)
    rows = [json.loads(line) for line in (DATA / "train.jsonl").read_text().splitlines()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    taught = asyncio.run(examples(config, tokenizer, rows, out))
    start = time.monotonic()
    training = Training(lr=args.lr, max_epochs=args.epochs, warmup_steps=5)
    train_sft(model, taught, tokenizer.pad_token_id, training, None, seed=0, progress=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(
        f"taught {policy.name} on {len(taught)} demonstrations, {args.epochs} epochs in "
        f"{time.monotonic() - start:.0f} s: {out}"
    )


if __name__ == "__main__":
    main()
