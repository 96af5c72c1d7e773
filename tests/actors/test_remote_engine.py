"""What every server engine shares (actors.remote.RemoteEngine), through the SGLang engine against
local stand-in servers: a server being restarted is held out of rotation and readmitted on the
last published checkpoint."""

import asyncio

import pytest

from actors.engine import NoServerBack
from actors.sglang import SGLangEngine
from tests.actors.test_sglang_engine import GREEDY, new_weights, prompt, run, standin


def test_a_held_server_is_skipped_and_readmission_loads_the_last_published_checkpoint(
    tiny_policy_dir, tmp_path
):
    """What the launcher does with a server it restarts: hold it while it is down (no requests,
    no update), then readmit it, which loads the checkpoint the others serve first."""
    update_dir = new_weights(tiny_policy_dir, tmp_path / "step-1")

    async def scenario():
        async with (
            await standin(tiny_policy_dir) as a,
            await standin(tiny_policy_dir) as b,
            SGLangEngine([a.url, b.url]) as engine,
        ):
            ids = prompt(a.engine.tokenizer)
            engine.hold(b.url)
            await asyncio.gather(*(engine.generate(ids, GREEDY) for _ in range(4)))
            await engine.update_weights(1, path=update_dir)  # b is held: skipped, no error
            calls_while_held = list(b.calls)
            version = await engine.readmit(b.url)
            after = await asyncio.gather(*(engine.generate(ids, GREEDY) for _ in range(6)))
            return calls_while_held, version, dict(b.bodies), b.calls, after, engine.version

    calls_while_held, version, bodies, calls, after, engine_version = run(scenario())
    assert calls_while_held == []
    assert version == 1 and engine_version == 1
    assert bodies["update_weights_from_disk"] == {
        "model_path": str(update_dir),
        "weight_version": "1",
    }
    assert "generate" in calls  # back in rotation
    assert {tuple(g.token_ids) for g in after} == {
        tuple(after[0].token_ids)
    }  # same weights on both
    assert all(set(g.versions) == {1} for g in after)


def test_while_every_server_is_held_requests_wait_for_one_to_be_readmitted(tiny_policy_dir):
    async def scenario():
        async with (
            await standin(tiny_policy_dir) as a,
            SGLangEngine([a.url], timeout_s=30) as engine,
        ):
            ids = prompt(a.engine.tokenizer)
            engine.hold(a.url)
            waiting = asyncio.create_task(engine.generate(ids, GREEDY))
            await asyncio.sleep(0.3)
            held_calls, done_early = list(a.calls), waiting.done()
            version = await engine.readmit(a.url)  # nothing published: its start-up weights
            out = await waiting
            engine.hold(a.url)
            engine.timeout_s = 0.2
            with pytest.raises(NoServerBack, match=r"none was back within 0\.2 s"):
                await engine.generate(ids, GREEDY)
            return held_calls, done_early, version, out

    held_calls, done_early, version, out = run(scenario())
    assert held_calls == [] and not done_early
    assert version == 0 and set(out.versions) == {0} and out.token_ids
