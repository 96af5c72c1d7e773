"""The simulated cluster (actors.simulated) on the virtual clock (pipeline.runtime.virtual_time): the GPU
model's timings exactly, weight updates with and without partial rollouts, and the real agent
loop on top."""

import asyncio
import time
from collections import Counter

import numpy as np
import pytest

from actors.agent import AgentLoop, AgentSettings
from actors.engine import SamplingParams
from actors.simulated import GpuModel, SimulatedEngine, SimulatedServer, SimulatedTool, Workload
from pipeline.assets.datasets import Question
from pipeline.runtime import virtual_time

GPU = GpuModel(step_s=0.01, step_per_seq_s=0.001, prefill_per_token_s=0.0001, max_batch=2)


def now() -> float:
    return asyncio.get_running_loop().time()


# --------------------------------------------------------------------------------- the clock


def test_an_hour_of_sleeping_takes_no_real_time_and_keeps_its_order():
    async def main():
        order = []

        async def sleeper(seconds, name):
            await asyncio.sleep(seconds)
            order.append((name, now()))

        await asyncio.gather(sleeper(3600, "b"), sleeper(60, "a"), sleeper(3600.5, "c"))
        return order

    began = time.monotonic()
    assert virtual_time.run(main()) == [("a", 60), ("b", 3600), ("c", 3600.5)]
    assert time.monotonic() - began < 2


def test_the_clock_stands_still_while_a_thread_works():
    async def main():
        marks = {}

        def work():
            time.sleep(0.2)  # real work: no simulated time passes

        async def worker():
            await asyncio.to_thread(work)
            marks["thread done"] = now()

        async def sleeper():
            await asyncio.sleep(10)
            marks["slept"] = now()

        await asyncio.gather(worker(), sleeper())
        return marks

    assert virtual_time.run(main()) == {"thread done": 0.0, "slept": 10.0}


# -------------------------------------------------------------------------------- one server


def run_server(requests, partial=True, update_at=None, load_s=0.0):
    """Send (start time, tokens, prefill) requests to one server; returns each one's
    (finish time, [version, tokens] segments) and the server."""

    async def main():
        server = SimulatedServer("s0", GPU, partial_rollouts=partial)

        async def one(start, tokens, prefill):
            await asyncio.sleep(start)
            segments = await server.decode(tokens, prefill)
            return now(), segments

        async def update():
            await asyncio.sleep(update_at)
            await server.update_weights(1, load_s)
            return now()

        jobs = [one(*r) for r in requests] + ([update()] if update_at is not None else [])
        done = await asyncio.gather(*jobs)
        await server.close()
        return done, server

    return virtual_time.run(main())


def test_one_sequence_decodes_at_the_batch_one_step_time():
    (finished,), server = run_server([(0.0, 100, 0)])
    assert finished[0] == pytest.approx(100 * 0.011) and finished[1] == [[0, 100]]
    assert server.stats.busy_s == pytest.approx(1.1) and server.stats.generated_tokens == 100


def test_a_batch_shares_the_steps_and_prefill_holds_the_server():
    # B = 2 from the start: each step 12 ms; the short one leaves at 50 steps, then B = 1
    (short, long), _ = run_server([(0.0, 50, 0), (0.0, 100, 0)])
    assert short[0] == pytest.approx(50 * 0.012)
    assert long[0] == pytest.approx(50 * 0.012 + 50 * 0.011)
    # 1000 prefill tokens (0.1 s) before the first decodes
    (alone,), _ = run_server([(0.0, 10, 1000)])
    assert alone[0] == pytest.approx(0.1 + 10 * 0.011)


def test_requests_beyond_the_batch_limit_queue():
    first, second, third = run_server([(0.0, 10, 0), (0.0, 10, 0), (0.0, 10, 0)])[0]
    assert first[0] == second[0] == pytest.approx(10 * 0.012)
    assert third[0] == pytest.approx(10 * 0.012 + 10 * 0.011)  # started when a place came free


def test_a_weight_update_splits_a_rollout_between_versions():
    (rollout, updated), server = run_server([(0.0, 100, 0)], update_at=0.55, load_s=0.2)
    assert rollout[1] == [[0, 50], [1, 50]]  # 50 tokens by 0.55 s, the rest after the load
    assert rollout[0] == pytest.approx(1.1 + 0.2) and updated == pytest.approx(0.75)
    assert server.stats.loading_s == pytest.approx(0.2)


def test_without_partial_rollouts_the_update_waits_for_the_running_sequences():
    (rollout, late, updated), server = run_server(
        [(0.0, 100, 0), (0.6, 10, 0)], partial=False, update_at=0.55, load_s=0.2
    )
    assert rollout == (pytest.approx(1.1), [[0, 100]])  # finished on the old weights
    assert updated == pytest.approx(1.1 + 0.2)  # drained, then loaded
    assert late[0] == pytest.approx(1.3 + 0.11) and late[1] == [[1, 10]]  # admitted after
    assert server.stats.draining_s == pytest.approx(1.1 - 0.55)


# --------------------------------------------------------------------- engine and agent loop


@pytest.fixture(scope="module")
def tokenizer():
    from actors.formats import CORRECTION, SEARCH_INSTRUCTION
    from pipeline.assets.tiny_policy import train_tokenizer

    return train_tokenizer(
        [SEARCH_INSTRUCTION, CORRECTION, "word passage simulated query"] * 20, 400
    )


def test_the_agent_loop_runs_on_the_simulated_engine_with_long_tailed_tool_calls(tokenizer):
    workload = Workload(tool_call_p=0.6, turn_tokens_median=40, tool_latency_s=(0.2, 2.0))
    settings = AgentSettings(
        max_turns=6,
        max_new_tokens_per_turn=2000,
        max_response_tokens=4000,
        max_observation_tokens=64,
    )
    question = Question("q1", "What is simulated?", ("simulated",), "sim")

    async def main():
        servers = [SimulatedServer(f"s{i}", GpuModel()) for i in range(2)]
        engine = SimulatedEngine(servers, tokenizer, workload, seed=1)
        loop = AgentLoop(
            engine, tokenizer, {"search": SimulatedTool("search", workload, seed=2)}, settings
        )
        made = await asyncio.gather(
            *(asyncio.create_task(loop.run(question, "p", i)) for i in range(400))
        )
        await engine.close()
        return made, loop.stats, now(), engine

    began = time.monotonic()
    made, stats, elapsed, engine = virtual_time.run(main())
    assert time.monotonic() - began < 60
    calls = Counter(len(t.tool_names) for t in made)
    assert stats.invalid_actions == 0 and all(t.finish_reason == "answer" for t in made)
    assert all(t.reward == 1.0 for t in made)  # "<answer> simulated </answer>"
    # geometric: P(0) = 0.4, P(1) = 0.24, ..., P(6) = 0.6^6 ~ 0.05 (the last turn must answer)
    assert 0.3 < calls[0] / 400 < 0.5 and 0.15 < calls[1] / 400 < 0.33 and calls[6] > 0
    assert max(calls) == 6 and elapsed > 0
    assert engine.generated_tokens == sum(int(np.sum(t.loss_mask)) for t in made)
    searches = sum(len(t.tool_names) for t in made)  # log-uniform on [0.2, 2]: mean 1.8 / ln 10
    assert stats.tools.seconds["search"] / searches == pytest.approx(1.8 / 2.302585, rel=0.1)


def test_a_turn_cut_at_its_budget_has_no_action(tokenizer):
    async def main():
        engine = SimulatedEngine(
            [SimulatedServer("s", GpuModel())],
            tokenizer,
            Workload(turn_tokens_median=500, turn_tokens_sigma=0.0),
        )
        made = await engine.generate(
            [1, 2, 3], SamplingParams(max_new_tokens=20, stop=("</answer>",))
        )
        await engine.close()
        return made

    made = virtual_time.run(main())
    assert (
        made.finish_reason == "length" and len(made.token_ids) == 20 and made.versions == [0] * 20
    )
