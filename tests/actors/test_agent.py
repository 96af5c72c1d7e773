import asyncio
from dataclasses import dataclass, field

import numpy as np
import pytest

from actors.agent import AgentLoop, AgentSettings
from actors.embedded import EmbeddedEngine
from actors.engine import Generation
from actors.formats import CORRECTION, parse_action
from actors.tools import SEARCH_SCHEMA, PythonTool, SearchTool
from buffers.strata import RandomStrata, ToolSignature
from retrieval.client import RetrievalClient
from retrieval.corpus import Passage
from retrieval.server import create_app, serve


@dataclass(frozen=True)
class Task:
    id: str
    question: str
    ground_truth: tuple[str, ...]
    data_source: str = "minigaia_l1"
    extra: dict = field(default_factory=dict, hash=False)  # the row's other fields


class StubClient:
    """A retrieval client stand-in for tool-level tests (the end-to-end test uses the real server)."""

    def __init__(self):
        self.queries = []

    async def search(self, query, topk=3):
        self.queries.append(query)
        return [(Passage("d1", '"Varno Telik"\nVarno Telik was born in Quorvex.'), 0.9)]


class Script:
    """Steer the real tiny model so that its generated tokens follow `text` (one token per forward)."""

    def __init__(self, engine: EmbeddedEngine, text: str):
        self.ids = engine.tokenizer.encode(text, add_special_tokens=False)
        self.step = 0
        self.handle = engine.model.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        if self.step < len(self.ids):
            output.logits[:, -1, self.ids[self.step]] = 1e9
        self.step += 1
        return output

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


@pytest.fixture
def engine(tiny_policy_dir):
    return EmbeddedEngine.from_pretrained(tiny_policy_dir, max_batch_size=4)


def agent(engine, tools=None, **settings):
    tools = {"search": SearchTool(StubClient())} if tools is None else tools
    return AgentLoop(engine, engine.tokenizer, tools, AgentSettings(**settings))


def run(coro):
    return asyncio.run(coro)


def segments(trajectory):
    """(mask value, decoded text) runs of a trajectory."""
    out, start = [], 0
    mask = trajectory.loss_mask
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((int(mask[start]), trajectory.token_ids[start:i]))
            start = i
    return out


def test_search_then_answer_token_in_token_out(engine):
    loop = agent(engine)
    task = Task("q1", "Where was Varno Telik born?", ("Quorvex",))
    with Script(
        engine, "<think> search </think><search> Varno Telik </search><answer> Quorvex </answer>"
    ):
        t = run(loop.run(task, "q1@0", 3))
    t.validate()
    assert (t.prompt_id, t.sample_index, t.finish_reason) == ("q1@0", 3, "answer")
    assert t.reward == 1.0 and t.tool_names == ["search"] and t.stratum == 1
    runs = segments(t)
    assert [m for m, _ in runs] == [1, 0, 1]  # generated, observation, generated
    observation = engine.tokenizer.decode(runs[1][1])
    assert observation.startswith("\n\n<information>") and observation.endswith(
        "</information>\n\n"
    )
    assert "Doc 1(Title: Varno Telik) Varno Telik was born in Quorvex." in observation
    generated = np.asarray(t.loss_mask) == 1
    assert (t.token_versions[generated] == 0).all() and (t.token_versions[~generated] == -1).all()
    assert (t.behavior_logprobs[~generated] == 0).all() and (
        t.behavior_logprobs[generated] <= 0
    ).all()
    assert loop.tools["search"].client.queries == ["Varno Telik"]
    # The prompt holds the instruction and the question; ids are never re-derived from text.
    assert "Question: Where was Varno Telik born?" in engine.tokenizer.decode(t.prompt_token_ids)


def test_the_stratum_is_the_configured_stratifiers_recorded_at_collection(engine):
    """The learner, the buffer's books and the spill all read Trajectory.stratum: it must be
    what learner.stratifier says, not a tool-call count taken on the side."""
    signature = ToolSignature(["search", "python"], max_calls=4)  # one search: 1; one python: 5
    loop = agent(engine, stratifier=signature, max_turns=2)
    task = Task("q1", "Where was Varno Telik born?", ("Quorvex",))
    with Script(
        engine, "<search> Varno Telik </search><search> again </search><answer> x </answer>"
    ):
        t = run(loop.run(task, "q1@0", 0))
    assert t.tool_names == ["search", "search"] and t.stratum == 2
    loop = agent(engine, stratifier=RandomStrata(1000, seed=3))
    with Script(engine, "<answer> x </answer>"):
        t = run(loop.run(task, "q1@0", 5))
    assert t.stratum == int(RandomStrata(1000, seed=3)([[]], ["q1@0#5"])[0])


@pytest.mark.parametrize(
    "answer, beta, reward", [("Paris", 0.3, 0.3), ("Quorvex", 0.3, 1.0), ("Paris", 0.0, 0.0)]
)
def test_first_occurrence_latent_reward(engine, answer, beta, reward):
    """TSPO: the search found the gold answer (the stub's passage names Quorvex); a wrong final
    answer still earns beta, and the record says where the answer first appeared."""
    loop = agent(engine, latent_reward=beta)
    task = Task("q1", "Where was Varno Telik born?", ("Quorvex",))
    with Script(engine, f"<search> Varno Telik </search><answer> {answer} </answer>"):
        t = run(loop.run(task, "q1@0", 0))
    t.validate()
    assert t.reward == pytest.approx(reward) and t.latent_reward == pytest.approx(
        reward if answer == "Paris" else 0.0
    )
    assert t.first_answer_turn == 0
    first_observation = int(np.flatnonzero(np.asarray(t.loss_mask) == 0)[0])
    assert t.first_answer_token == first_observation  # the tokens before it are the finding turn


def test_answer_appears_uses_the_exact_match_normalisation():
    from actors.rewards import answer_appears

    assert answer_appears("Varno Telik was born in QUORVEX.", ["Quorvex"])
    assert (
        answer_appears("born in the city of New-York", ["new york", "x"]) is False
    )  # punctuation joins
    assert answer_appears("born in the city of new york", ["New York"])
    assert not answer_appears("Quorvexian history", ["Quorvex"])  # a whole-word span only
    assert not answer_appears("anything", [""])


def test_the_last_turn_may_only_answer(engine):
    loop = agent(engine, max_turns=2)
    search = "<search> Varno Telik </search>"
    # Two searches use up the turns; the third search is not executed, and no answer follows.
    with Script(engine, search * 3 + "<|endoftext|>"):
        t = run(loop.run(Task("q", "?", ("Quorvex",)), "q@0", 0))
    assert (
        t.tool_names == ["search", "search"] and t.finish_reason == "no_answer" and t.reward == 0.0
    )
    assert len(loop.tools["search"].client.queries) == 2


@pytest.mark.parametrize(
    "bad",
    [
        "<search></search>",  # empty query
        "<python> print(1) </python>",  # a tool that is not enabled
        "I will not use tags at all<|endoftext|>",  # no action
        "</search>",  # closing tag with no opening
        "<calculator> x </calculator><|endoftext|>",  # a tool that does not exist (browse does now)
    ],
)
def test_invalid_actions_get_a_correction_and_the_loop_goes_on(engine, bad):
    loop = agent(engine)
    with Script(engine, bad + "<answer> Quorvex </answer>"):
        t = run(loop.run(Task("q", "?", ("Quorvex",)), "q@0", 0))
    assert loop.stats.invalid_actions == 1 and t.tool_names == [] and t.reward == 1.0
    observations = [engine.tokenizer.decode(ids) for m, ids in segments(t) if m == 0]
    assert observations == [CORRECTION]


def test_hostile_output_is_contained(engine):
    loop = agent(engine, max_new_tokens_per_turn=64, max_response_tokens=200)
    rng = np.random.default_rng(0)
    garbage = engine.tokenizer.decode(rng.integers(0, len(engine.tokenizer), 300).tolist())
    with Script(engine, garbage):
        t = run(loop.run(Task("q", "?", ("Quorvex",)), "q@0", 0))
    t.validate()
    assert len(t.token_ids) <= 200 and t.reward in (0.0, 1.0)
    with Script(engine, "<answer></answer>"):
        empty = run(loop.run(Task("q", "?", ("Quorvex",)), "q@1", 0))
    assert (empty.finish_reason, empty.reward) == ("answer", 0.0)


def test_huge_queries_are_cut_before_they_reach_the_server():
    client = StubClient()
    result = run(SearchTool(client)({"query": "x " * 100_000}))
    assert result.ok and len(client.queries[0]) <= 512


def test_response_budget_ends_the_trajectory(engine):
    loop = agent(engine, max_response_tokens=12, max_new_tokens_per_turn=8)
    with Script(engine, "<search> Varno Telik </search>" + " word" * 50):
        t = run(loop.run(Task("q", "?", ("Quorvex",)), "q@0", 0))
    assert len(t.token_ids) == 12 and t.finish_reason == "length"


def test_python_tool_in_the_sandbox(engine):
    loop = agent(engine, tools={"python": PythonTool(timeout_s=5)})
    with Script(engine, "<python>print(1998 - 1961)</python><answer> 37 </answer>"):
        t = run(loop.run(Task("q", "How many years?", ("37",), "minigaia_l3"), "q@0", 0))
    observation = next(engine.tokenizer.decode(ids) for m, ids in segments(t) if m == 0)
    assert (
        observation == "\n\n<output>37\n</output>\n\n"
        and t.reward == 1.0
        and t.tool_names == ["python"]
    )


def test_a_failing_tool_is_an_observation_not_a_crash(engine):
    class Broken:
        name, schema, open_tag, close_tag = (
            "search",
            SEARCH_SCHEMA,
            "<information>",
            "</information>",
        )

        async def __call__(self, arguments):
            raise ConnectionError("index on fire")

    loop = agent(engine, tools={"search": Broken()})
    with Script(engine, "<search> a </search><answer> Quorvex </answer>"):
        t = run(loop.run(Task("q", "?", ("Quorvex",)), "q@0", 0))
    assert loop.stats.tools.errors["search"] == 1 and t.reward == 1.0
    assert "index on fire" in engine.tokenizer.decode(t.token_ids)


def test_retokenisation_drift_is_measured_and_ids_are_kept(engine):
    tok = engine.tokenizer
    # A word that is one token in this vocabulary: spelling it letter by letter drifts.
    word = next(
        w
        for w in ("Varno", "Telik", "born", "search")
        if len(tok.encode(w, add_special_tokens=False)) == 1
    )
    pieces = [tok.convert_tokens_to_ids(c) for c in word]
    loop = agent(engine, tools={})
    script = Script(engine, "<answer>")
    script.ids += pieces + tok.encode("</answer>", add_special_tokens=False)
    with script:
        t = run(loop.run(Task("q", "?", (word,)), "q@0", 0))
    assert t.token_ids[1 : 1 + len(pieces)].tolist() == pieces and t.reward == 1.0
    assert loop.stats.retokenize_drift == 1


def test_parse_action():
    stop = Generation(finish_reason="stop", stop="</search>")
    assert parse_action("<think>x</think><search> a b </search>", stop) == ("search", "a b")
    assert parse_action("<search><search> inner </search>", stop) == ("search", "inner")
    assert parse_action("no opening </search>", stop) is None
    assert parse_action("<search> a", Generation(finish_reason="length")) is None


def test_end_to_end_with_the_real_retrieval_server(engine, world_index):
    _, search = world_index
    question = "Varno"  # any query: we check the observation is the server's top-3 for it

    async def scenario():
        app = create_app(search, {})
        runner, port = await serve(app, "127.0.0.1", 0)
        try:
            async with RetrievalClient(f"http://127.0.0.1:{port}") as client:
                loop = agent(
                    engine, tools={"search": SearchTool(client, topk=3)}, max_observation_tokens=800
                )
                with Script(engine, f"<search> {question} </search><answer> x </answer>"):
                    t = await loop.run(Task("q", "?", ("y",)), "q@0", 0)
                expected = await client.search(question, 3)
                return t, expected
        finally:
            await runner.cleanup()

    t, expected = run(scenario())
    text = engine.tokenizer.decode(t.token_ids)
    for passage, _ in expected:
        assert f"(Title: {passage.title})" in text
