"""Demonstration trajectories on the mini-GAIA world, for warm-starting a tiny policy.

The demos teach the format and single searches; chaining two searches is left mostly to RL. On
one-hop questions (L1) they mostly search once; on multi-hop ones (L2, L3) they mostly answer
from memory, or search once and guess the rest: a guess follows the training answers' frequencies
(`guesses`), so it is right sometimes. A minority chain two searches, right or astray (the second
query names the question's subject again instead of the bridge), so a warm-started policy chains
now and then, and reinforcement learning has something to make a habit of. `correct` says whether
the final answer equals the canonical gold answer.

`chains_astray` (`data.world_chains_astray`) is the trap knob: the share of the two-search demos
whose second query goes astray; set, an astray chain also answers with the bridge entity (a
wrong answer: it stopped a hop short) instead of guessing, so that, as in the trap bandit
(pipeline/experiments/trap.py), a chain pays only when both hops are right. Raised, a
warm-started policy chains about as often but its chains pay less than a guess at the start,
so a group-wide baseline pushes it away from chaining before it learns the second query
(docs/results/trap_gaia.md).

Two more knobs shape where a warm-started policy starts (issue 59's window world), each off by
default (None: the demos as written, byte for byte):
- `chain_demos` (`data.world_chain_demos`): the share of L2 and L3 demos that chain two searches
  (as written: 0.2 of L2, 0.25 of L3); the other strategies share the rest in their proportions.
- `guess_sharpness` (`data.world_guess_sharpness`): a guess of a named answer (city, person,
  country, profession) is drawn with weight frequency ** sharpness over the distinct training
  answers: 1 is the frequencies as today (drawn another way), 0 uniform, and large values tend
  to always the commonest answer. Years and numbers are guessed as before.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from retrieval.corpus import Passage, format_passages

if TYPE_CHECKING:  # not at run time: `python -m pipeline.assets.world` would import world twice
    from pipeline.assets.world_questions import WorldQuestion

# Strategy weights per level (percent).
STRATEGIES = {
    1: {"one_search": 75, "no_search": 20, "retry_search": 5},
    2: {"no_search": 35, "one_search": 45, "two_searches": 10, "two_searches_astray": 10},
    3: {
        "no_search": 35,
        "one_search": 40,
        "two_searches_python": 10,
        "two_searches": 5,
        "two_searches_astray": 10,
    },
}


ASTRAY = "two_searches_astray"


def strategy_weights(
    level: int, chains_astray: float | None = None, chain_demos: float | None = None
) -> dict[str, float]:
    """`STRATEGIES[level]`, or with `chains_astray` set the same total weight of two-search
    strategies split so that this share of it goes astray (the rest keeps its proportions);
    with `chain_demos` set, the two-search strategies together take this share of the level's
    weight and the others the rest, each group in its own proportions (levels without chains:
    unchanged)."""
    weights = {k: float(v) for k, v in STRATEGIES[level].items()}
    if chain_demos is not None and ASTRAY in weights:
        if not 0 <= chain_demos <= 1:
            raise ValueError(f"chain_demos must lie in [0, 1] (got {chain_demos})")
        chains = [k for k in weights if k.startswith("two_searches")]
        whole, chained = sum(weights.values()), sum(weights[k] for k in chains)
        for k in weights:
            share = chain_demos / chained if k in chains else (1 - chain_demos) / (whole - chained)
            weights[k] *= share * whole
    if chains_astray is None or ASTRAY not in weights:
        return weights
    if not 0 <= chains_astray <= 1:
        raise ValueError(f"chains_astray must lie in [0, 1] (got {chains_astray})")
    right = [k for k in weights if k.startswith("two_searches") and k != ASTRAY]
    total = weights[ASTRAY] + sum(weights[k] for k in right)
    right_total = sum(weights[k] for k in right)
    if total == 0:  # chain_demos 0: no chain left to split
        return weights
    for k in right:
        weights[k] *= (1 - chains_astray) * total / right_total
    weights[ASTRAY] = chains_astray * total
    return weights


def _think(text: str) -> str:
    return f"<think>{text}</think>\n"


class _Demos:
    def __init__(
        self,
        passages: Sequence[Passage],
        kinds: Mapping[str, str],
        guesses: Mapping[str, Sequence[str]],
        rng: random.Random,
        astray_answers_bridge: bool = False,
        guess_sharpness: float | None = None,
    ) -> None:
        self.passage = {p.id: p for p in passages}
        self.astray_answers_bridge = astray_answers_bridge
        self.kinds, self.guesses, self.rng = kinds, guesses, rng
        # Sharpened: distinct answers, weight frequency ** sharpness, taken relative to the
        # commonest so that a large sharpness stays finite (it tends to the commonest answer).
        self.sharpened: dict[str, tuple[list[str], list[float]]] = {}
        if guess_sharpness is not None:
            for kind, answers in guesses.items():
                counts = Counter(answers)
                values = sorted(counts, key=lambda a: (-counts[a], a))
                top = counts[values[0]]
                weights = [(counts[a] / top) ** guess_sharpness for a in values]
                self.sharpened[kind] = (values, weights)
        self.same_kind: dict[str, list[str]] = {}
        for p in passages:
            self.same_kind.setdefault(kinds[p.id], []).append(p.id)

    def _search(self, query: str, ids: list[str]) -> str:
        shown = format_passages([self.passage[i] for i in ids])
        # " query": a name after the tag tokenizes as it does in running text, so copying it from
        # the question or a passage is copying tokens, not spelling them anew.
        return f"<search> {query}</search><information>\n{shown}</information>\n"

    def _others(self, gold: str, n: int) -> list[str]:
        # Passages of the same kind look like what a retriever returns next to the gold one.
        drawn = self.rng.sample(self.same_kind[self.kinds[gold]], n + 1)
        return [i for i in drawn if i != gold][:n]

    def _hop(self, q: WorldQuestion, hop: int) -> str:
        ids = self._others(q.gold_doc_ids[hop], 2)
        ids.insert(self.rng.choices((0, 1, 2), (6, 3, 2))[0], q.gold_doc_ids[hop])
        return self._search(q.hop_queries[hop], ids)

    def _guess(self, q: WorldQuestion) -> str:
        if q.answer_kind == "year":
            return str(self.rng.randint(1890, 2020))
        if q.answer_kind == "number":
            value = int(q.answer[0])
            return str(self.rng.randint(max(1, value // 2), value * 2))
        if q.answer_kind in self.sharpened:
            values, weights = self.sharpened[q.answer_kind]
            return self.rng.choices(values, weights)[0]
        return self.rng.choice(self.guesses[q.answer_kind])

    def _plan(self, q: WorldQuestion) -> str:
        if q.level == 1:
            return _think(f"I do not know this fact about {q.subject}, so I will search for it.")
        then = " and then subtract the two years" if q.level == 3 else ""
        return _think(
            f"I need two facts: first about {q.subject}, then about the entity it leads to{then}. "
            f"I will search for {q.subject} first."
        )

    def _bridge(self, q: WorldQuestion) -> str:
        return _think(f"{q.hop_facts[0]}. Next I need to search for {q.bridge}.")

    def _solve(self, q: WorldQuestion) -> tuple[str, str]:
        """The right path from the first search on: (response tail, answer)."""
        answer = q.answer[0]
        if q.level == 1:
            return self._hop(q, 0) + _think(f"{q.hop_facts[0]}. So the answer is {answer}."), answer
        text = self._hop(q, 0) + self._bridge(q) + self._hop(q, 1)
        if q.level == 2:
            return text + _think(f"{q.hop_facts[1]}. So the answer is {answer}."), answer
        a, b = q.operands
        text += _think(f"{q.hop_facts[1]}. I will compute {a} - {b}.")
        text += f"<python>print({a} - {b})</python><output>{a - b}\n</output>\n"
        return text + _think(f"The difference is {a - b} years."), answer

    def respond(self, q: WorldQuestion, strategy: str) -> tuple[str, str]:
        """(response, final answer) for one question and strategy."""
        if strategy == "no_search":
            guess = self._guess(q)
            return _think(f"I think I remember this: the answer is {guess}."), guess
        text = self._plan(q)
        if strategy == "retry_search":
            bad = q.hop_queries[0].replace(q.subject, "").strip() or "search"
            text += self._search(bad, self._others(q.gold_doc_ids[0], 3))
            text += _think(
                f"These results are not about {q.subject}. I will search again and name it."
            )
        if strategy == "one_search" and q.level > 1:
            guess = self._guess(q)
            text += self._hop(q, 0)
            text += _think(f"{q.hop_facts[0]}. I think I can answer the rest from memory: {guess}.")
            return text, guess
        if strategy == ASTRAY:  # the second query repeats the subject
            guess = self._guess(q)
            astray = q.hop_queries[1].replace(q.bridge, q.subject)
            text += self._hop(q, 0) + _think(f"{q.hop_facts[0]}. I need more about {q.subject}.")
            text += self._search(astray, [*self._others(q.gold_doc_ids[0], 2), q.gold_doc_ids[0]])
            if self.astray_answers_bridge:  # the trap: a chain that goes astray pays nothing
                return text + _think(f"So the answer is {q.bridge}."), q.bridge
            return text + _think(f"This does not say. I think the answer is {guess}."), guess
        if strategy == "two_searches" and q.level == 3:
            a, b = q.operands
            slip = a - b + self.rng.choice((-10, -1, 1, 10))
            text += self._hop(q, 0) + self._bridge(q) + self._hop(q, 1)
            return text + _think(f"{q.hop_facts[1]}. So {a} - {b} = {slip} years."), str(slip)
        tail, answer = self._solve(q)
        return text + tail, answer


def make_demos(
    questions: Sequence[WorldQuestion],
    passages: Sequence[Passage],
    kinds: Mapping[str, str],
    guesses: Mapping[str, Sequence[str]],
    rng: random.Random,
    limit: int,
    chains_astray: float | None = None,
    chain_demos: float | None = None,
    guess_sharpness: float | None = None,
) -> list[dict]:
    """One demonstration per question (a seeded sample of `limit` of them when there are more).

    `guesses` holds, by answer kind (city, person, country, profession), the answers a guess is
    drawn from: the training answers, repeated as often as they occur. `chains_astray`,
    `chain_demos`: see `strategy_weights` (None: `STRATEGIES` as written); `guess_sharpness`:
    see the module's docstring (None: a guess is a uniform draw from `guesses`).
    """
    if guess_sharpness is not None and not 0 <= guess_sharpness <= 64:
        raise ValueError(f"guess_sharpness must lie in [0, 64] (got {guess_sharpness})")
    chosen = list(questions)
    if len(chosen) > limit:
        chosen = sorted(rng.sample(chosen, limit), key=lambda q: q.id)
    demos = _Demos(
        passages,
        kinds,
        guesses,
        rng,
        astray_answers_bridge=chains_astray is not None,
        guess_sharpness=guess_sharpness,
    )
    rows = []
    for q in chosen:
        weights_by_name = strategy_weights(q.level, chains_astray, chain_demos)
        names, weights = zip(*weights_by_name.items(), strict=True)
        strategy = rng.choices(names, weights)[0]
        response, answer = demos.respond(q, strategy)
        rows.append(
            {
                "id": q.id,
                "question": q.question,
                "answer": q.answer[0],
                "level": q.level,
                "strategy": strategy,
                "correct": answer == q.answer[0],
                "response": response + f"<answer> {answer}</answer>",
            }
        )
    return rows
