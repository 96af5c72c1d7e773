"""Renaming the entities of a world's demonstrations, afresh every epoch of the warm start.

A tiny policy fine-tuned on a few hundred demos memorises them: asked a training question it
answers from memory, asked about a held-out entity it writes the memorised answer of a similar
name, and reinforcement learning then starts from rewards that are all 1 on training questions and
all 0 on held-out ones. Renaming each demo's names consistently (question, queries, passages,
thoughts and answer alike) with other words of the same pools keeps every demo a correct
trajectory but ties no fact to a name, so what the warm start teaches is to copy a name from the
question into a query and a fact from a passage into the answer.

The pools are the world's `name_parts` (world.json): a first name becomes another first name, a
film's word another film word. Countries, years, professions and the like stay as they are: they
are the priors a guess without searching may follow.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence


class NameSwap:
    """`swap(demo, epoch)`: the demo with its names renamed, the same way for the same
    (demo id, epoch) and differently for another epoch."""

    def __init__(self, parts: Mapping[str, Sequence[str]], seed: int = 0) -> None:
        self.parts = {pool: list(words) for pool, words in parts.items() if words}
        self.pool_of = {word: pool for pool, words in self.parts.items() for word in words}
        if not self.pool_of:
            raise ValueError("NameSwap needs at least one pool of words")
        words = sorted(self.pool_of, key=len, reverse=True)  # longest first: no prefix wins early
        self.pattern = re.compile(r"(?<!\w)(" + "|".join(map(re.escape, words)) + r")(?!\w)")
        self.seed = seed

    def mapping(self, texts: Sequence[str], rng: random.Random) -> dict[str, str]:
        """An injective renaming of the pool words in `texts`, each within its own pool: two
        different names stay different."""
        found = list(dict.fromkeys(m.group(1) for t in texts for m in self.pattern.finditer(t)))
        chosen: dict[str, str] = {}
        taken: dict[str, set[str]] = {}
        for word in found:
            pool = self.pool_of[word]
            used = taken.setdefault(pool, set())
            free = [w for w in self.parts[pool] if w not in used]
            chosen[word] = rng.choice(free) if free else word
            used.add(chosen[word])
        return chosen

    def __call__(self, demo: Mapping, epoch: int) -> dict:
        rng = random.Random(f"{self.seed}/{demo.get('id', '')}/{epoch}")
        fields = [k for k in ("question", "response", "answer") if isinstance(demo.get(k), str)]
        mapping = self.mapping([demo[k] for k in fields], rng)
        return {
            **demo,
            **{k: self.pattern.sub(lambda m: mapping[m.group(1)], demo[k]) for k in fields},
        }
