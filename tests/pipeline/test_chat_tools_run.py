"""`actors.format: chat_tools` end to end on the embedded default: the warm start learns the chat
format (a cache entry of its own), the agent calls tools in it, the books balance. A file of its
own: its warm start (the agents' runs' too) builds beside the other end-to-end runs."""

import json

from buffers.reader import read_trajectories
from tests.conftest import assert_accounting
from tests.pipeline.test_agent_run import COMMON
from tests.pipeline.test_local_run import launch


def test_a_run_speaks_the_chat_templates_tool_calls(tmp_path, run_cache):
    run_dir = tmp_path / "run"
    # The agents' runs' settings (tests/pipeline/test_agent_run.py: search alone, observations
    # of 256 tokens), so the two files share one warm start of the chat format: whichever runs
    # first builds it. At 6 epochs (loss 0.65), half the other runs' 12, a configs/local.yaml run
    # with these settings made 0.50-0.75 tool calls per trajectory in its first two steps
    # (2-core machine, 2026-11-27).
    sets = [*COMMON]
    proc = launch(run_dir, run_cache, *(a for s in sets for a in ("--set", s)))
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-2000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["version"] for s in steps] == [1.0, 2.0]
    table, bad = read_trajectories(run_dir / "trajectories", ["text", "tool_names", "stratum"])
    texts, tools = table["text"].to_pylist(), table["tool_names"].to_pylist()
    calls = [t for t, names in zip(texts, tools, strict=True) if names]
    assert not bad and calls  # the warm start learnt the format: it calls tools
    for text in calls:  # each call as JSON, each result in the template's tool turn
        assert '<tool_call>\n{"name": "search", "arguments": {"query": ' in text
        assert "</tool_call><|im_end|>\n<|im_start|>tool\n" in text
    assert not any("<information>" in t for t in texts)  # no tags-format observation
    assert table["stratum"].to_pylist() == [len(names) for names in tools]  # valid calls
    assert_accounting(run_dir)
