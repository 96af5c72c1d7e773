"""actors/scoring.py: rewards that see the trajectory, weighed, timed and guarded; the built-ins
give today's numbers; a remote reward against a real aiohttp server on 127.0.0.1."""

import asyncio
import json
import threading
import time

import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.reward_view import RewardTask, RewardView
from actors.rewards import REWARDS, extract_answer, format_reward, score
from actors.scoring import RemoteReward, Scoring, Term


def view(response="<answer>Quorvex</answer>", calls=(), observations=()):
    return RewardView(
        answer=extract_answer(response),
        response=response,
        tool_calls=tuple(calls),
        observations=tuple(observations),
        turns=len(calls) + 1,
    )


TASK = RewardTask("Where was Varno Telik born?", ("Quorvex",), "q1", "minigaia_l1", {"hops": 2})


def run(coro):
    return asyncio.run(coro)


PIECES = ["<answer>", "</answer>", "<think>", "</think>", "<search>", "</search>", " "]
WORDS = ["Paris", "paris", "the", "$1,234.50", "1234.5", "12%", "12", "a, b", "x"]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(PIECES + WORDS), max_size=12),
    st.lists(st.sampled_from(WORDS), max_size=3),
    st.sampled_from(["nq", "minigaia_l2", "gaia_l1", "GAIA"]),
    st.sampled_from([None, "exact_match", "f1", "gaia"]),
    st.sampled_from([0.0, 0.1, 0.25, 1.0]),
)
def test_the_built_ins_on_the_contract_give_todays_numbers_exactly(
    pieces, golden, source, kind, weight
):
    """The reward the loop gave before rewards saw the trajectory (`score`, text in) is what
    the built-ins give through the contract, to the last bit, format bonus included."""
    response = "".join(pieces)
    task = RewardTask("q", tuple(golden), "q", source)
    scored = run(Scoring.of(kind, weight)(view(response), task))
    assert scored.reward == score(response, list(golden), source, kind, weight)
    assert scored.outcome == score(response, list(golden), source, kind, 0.0)
    assert scored.errors == 0
    itemized = {kind or "exact_match": scored.outcome, "format": format_reward(response)}
    assert scored.components == ({} if weight == 0 else itemized)


def test_a_reward_reads_the_tool_calls_and_the_rows_fields():
    """A reward that pays for the answer only when a lookup of the right entity came first, and
    reads a field of the row that is not one of Strata's."""

    def grounded(v, task):
        looked = any(n == "lookup" and a.get("entity") == "Varno Telik" for n, a in v.tool_calls)
        found = any("Quorvex" in o for o in v.observations)
        return float(looked and found and v.answer == task.answers[0]) / task.extra["hops"]

    calls = [("lookup", {"entity": "Varno Telik", "field": "born"})]
    scoring = Scoring.of(grounded)
    assert run(scoring(view(calls=calls, observations=["born in Quorvex"]), TASK)).reward == 0.5
    assert run(scoring(view(), TASK)).reward == 0.0  # the right answer, but no lookup
    assert (
        run(scoring(view(calls=[("lookup", {"entity": "x"})], observations=["?"]), TASK)).reward
        == 0.0
    )


def test_a_weighted_list_sums_its_terms_and_logs_each_by_name():
    async def judge(v, task):  # async: run on the loop
        return {"correct": 1.0, "tools": 0.5 * len(v.tool_calls)}

    def brevity(v, task):  # sync: run in a thread
        return 1.0 - len(v.response) / 100

    scoring = Scoring.of(
        [
            Term("judge", judge, 0.5),
            Term("brevity", brevity, 2.0),
            Term("em", REWARDS["exact_match"]),
        ],
        format_weight=0.1,
    )
    response = "<answer>Quorvex</answer>"  # 24 characters, well formed
    scored = run(scoring(view(response, calls=[("search", {"query": "q"})]), TASK))
    assert scored.components == {
        "judge/correct": 1.0,
        "judge/tools": 0.5,
        "brevity": pytest.approx(0.76),
        "em": 1.0,
        "format": 1.0,
    }
    assert scored.outcome == pytest.approx(0.5 * 1.5 + 2.0 * 0.76 + 1.0)
    assert scored.reward == pytest.approx(scored.outcome + 0.1)
    assert scored.errors == 0


def test_one_dict_reward_logs_its_keys_and_sums_them():
    scored = run(Scoring.of(lambda v, t: {"correct": 1.0, "cost": -0.25})(view(), TASK))
    assert (scored.reward, scored.components) == (0.75, {"correct": 1.0, "cost": -0.25})
    assert run(Scoring.of(lambda v, t: 0.5)(view(), TASK)).components == {}  # one plain reward


@pytest.mark.parametrize(
    "reward, said",
    [
        (lambda v, t: 1 / 0, "raised ZeroDivisionError: division by zero"),
        (lambda v, t: float("nan"), "gave nan, not a finite number or a dict of them"),
        (lambda v, t: "1.0", "gave '1.0', not a finite number"),
        (lambda v, t: {"a": None}, "gave {'a': None}, not a finite number"),
        (lambda v, t: {1: 1.0}, "gave a dict with the key 1: keys must be names"),
    ],
)
def test_a_reward_that_fails_scores_0_and_is_counted(reward, said, capsys):
    scoring = Scoring([Term("judge", reward), Term("em", REWARDS["exact_match"])])
    scored = run(scoring(view(), TASK))
    assert (scored.reward, scored.errors, scoring.errors) == (1.0, 1, 1)
    assert scored.components == {"judge": 0.0, "em": 1.0}
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and f"strata: reward 'judge' {said}" in line
    assert "scored 0 (1 failed so far)" in line


def test_failures_are_said_at_the_1st_10th_and_100th(capsys):
    scoring = Scoring.of(lambda v, t: 1 / 0)

    async def many():
        for _ in range(120):
            assert (await scoring(view(), TASK)).reward == 0.0

    run(many())
    said = capsys.readouterr().out.splitlines()
    assert [line.rsplit("(", 1)[1] for line in said] == [
        "1 failed so far)",
        "10 failed so far)",
        "100 failed so far)",
    ]
    assert scoring.errors == 120


def test_a_sync_reward_runs_beside_the_loop_and_one_that_hangs_times_out(capsys):
    """A sync reward sleeping 0.3 s holds no one: the loop ticks meanwhile. One that never
    returns scores 0 at its limit, and the process can still exit (a daemon thread)."""
    release = threading.Event()

    def slow(v, t):
        time.sleep(0.3)
        return 1.0

    def hangs(v, t):
        release.wait()
        return 1.0

    async def race():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticking = asyncio.create_task(ticker())
        slow_scored = await Scoring([Term("slow", slow)])(view(), TASK)
        start = time.perf_counter()
        hung = await Scoring([Term("hangs", hangs, timeout_s=0.2)])(view(), TASK)
        waited = time.perf_counter() - start
        ticking.cancel()
        return slow_scored, hung, waited, ticks

    slow_scored, hung, waited, ticks = run(race())
    release.set()
    assert slow_scored.reward == 1.0 and ticks >= 15  # ~40 ticks of 10 ms in 0.5 s
    assert (hung.reward, hung.errors) == (0.0, 1) and 0.2 <= waited < 1.0
    assert "strata: reward 'hangs' ran past its 0.2 s limit: scored 0" in capsys.readouterr().out


def test_an_async_reward_past_its_limit_scores_0():
    async def sleepy(v, t):
        await asyncio.sleep(10)

    scored = run(Scoring([Term("sleepy", sleepy, timeout_s=0.05)])(view(), TASK))
    assert (scored.reward, scored.errors) == (0.0, 1)


def test_an_unknown_built_in_is_refused_in_one_line():
    with pytest.raises(
        ValueError, match="no built-in reward 'bleu'; the built-ins are exact_match"
    ):
        Scoring.of("bleu")
    with pytest.raises(ValueError, match="two rewards are named 'format'"):
        Scoring.of(Term("format", REWARDS["format"]), format_weight=0.5)


# ------------------------------------------------------------------------ the remote reward


class RewardServer:
    """A reward server on 127.0.0.1 answering `answers` in turn, the last one ever after (an
    int: that HTTP status; "hang": no answer; else the JSON), recording what it was sent."""

    def __init__(self, answers):
        self.answers, self.seen = list(answers), []
        self.stop = asyncio.Event()  # lets a hanging answer go at the end

    async def handle(self, request):
        self.seen.append(await request.json())
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if answer == "hang":
            await self.stop.wait()
        if isinstance(answer, int):
            return web.Response(status=answer, text="down")
        return web.json_response(answer)


async def with_server(answers, reward_kwargs, scoring_of=None):
    server = RewardServer(answers)
    app = web.Application()
    app.router.add_post("/score", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        remote = RemoteReward(f"http://127.0.0.1:{port}/score", **reward_kwargs)
        scoring = (scoring_of or (lambda r: Scoring([Term("remote", r, timeout_s=None)])))(remote)
        calls = [("lookup", {"entity": "Varno Telik", "field": "born"})]
        start = time.perf_counter()
        scored = await scoring(view(calls=calls, observations=["born in Quorvex"]), TASK)
        return scored, server.seen, time.perf_counter() - start
    finally:
        server.stop.set()
        await runner.cleanup()


def test_a_remote_reward_is_sent_the_view_and_the_task_and_retried():
    """Two 503s, then an answer: three requests, the wait doubling between them."""
    scored, seen, took = run(
        with_server([503, 500, {"reward": 0.75}], {"retries": 2, "backoff_s": 0.05})
    )
    assert (scored.reward, scored.errors, len(seen)) == (0.75, 0, 3)
    assert took >= 0.05 + 0.1
    sent = seen[0]
    assert sent["view"]["tool_calls"] == [["lookup", {"entity": "Varno Telik", "field": "born"}]]
    assert (
        sent["view"]["observations"] == ["born in Quorvex"] and sent["view"]["answer"] == "Quorvex"
    )
    assert sent["task"] == {
        "question": "Where was Varno Telik born?",
        "answers": ["Quorvex"],
        "id": "q1",
        "data_source": "minigaia_l1",
        "extra": {"hops": 2},
    }


def test_a_remote_rewards_components_are_logged_per_name():
    answer = {"rewards": {"correct": 1.0, "grounded": 0.5}}
    scored, _, _ = run(with_server([answer], {}))
    assert (scored.reward, scored.components) == (1.5, {"correct": 1.0, "grounded": 0.5})


def test_a_remote_reward_that_hangs_scores_0_after_its_tries(capsys):
    scored, seen, took = run(
        with_server(["hang"], {"timeout_s": 0.2, "retries": 1, "backoff_s": 0.01})
    )
    assert (scored.reward, scored.errors, len(seen)) == (0.0, 1, 2)
    assert 0.4 <= took < 2.0
    out = capsys.readouterr().out
    assert "2 attempt(s) failed, the last: no answer within 0.2 s: scored 0" in out


@pytest.mark.parametrize(
    "answers, said",
    [
        ([404], "answered HTTP 404"),  # not retried
        ([{"score": 1.0}], "answered {'score': 1.0}: expected {\"reward\": number}"),
        ([{"reward": "high"}], "gave 'high', not a finite number"),
    ],
)
def test_a_remote_reward_that_answers_wrongly_fails_at_once(answers, said, capsys):
    scored, seen, _ = run(with_server(answers, {"retries": 3, "backoff_s": 0.01}))
    assert (scored.reward, scored.errors, len(seen)) == (0.0, 1, 1)
    assert said in capsys.readouterr().out


def test_a_remote_reward_nobody_serves_fails_after_its_tries():
    import socket

    with socket.socket() as s:  # a port nobody listens on (bound, then closed)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    remote = RemoteReward(f"http://127.0.0.1:{port}/score", retries=1, backoff_s=0.01)
    scored = run(Scoring([Term("remote", remote, timeout_s=None)])(view(), TASK))
    assert (scored.reward, scored.errors) == (0.0, 1)


def test_the_view_and_task_go_as_json_whatever_the_row_holds():
    import numpy as np

    from actors.reward_view import dumps

    task = RewardTask("q", ("a",), "1", "nq", {"golden": np.array(["a", "b"]), "n": np.int64(3)})
    sent = json.loads(dumps(view(), task))
    assert sent["task"]["extra"] == {"golden": ["a", "b"], "n": 3}
