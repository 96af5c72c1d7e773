"""A server that comes back is put back in a state to serve: the SGLang engine against the stand-in."""

import pytest

from actors.engine import EngineError
from actors.sglang import SGLangEngine
from tests.actors.test_sglang_engine import GREEDY, prompt, run, standin


def test_a_server_left_paused_is_continued_before_it_rejoins(tiny_policy_dir):
    """An update whose continue failed leaves the server paused; once it is down and answers
    /health again, the rejoin continues it, so requests routed to it are not parked forever."""

    async def scenario():
        async with (
            await standin(tiny_policy_dir) as server,
            SGLangEngine([server.url], cooldown_s=0.05, timeout_s=5) as engine,
        ):
            server.fail_next = 1
            with pytest.raises(EngineError, match="HTTP 500"):  # the server goes down
                await engine.generate(prompt(server.engine.tokenizer), GREEDY)
            await server._pause_generation({"mode": "abort"})  # ... and was left paused
            out = await engine.generate(prompt(server.engine.tokenizer), GREEDY)
            return out, server.paused, engine.stats()["rejoins"]

    out, paused, rejoins = run(scenario())
    assert len(out.token_ids) > 0 and not paused and rejoins == 1
