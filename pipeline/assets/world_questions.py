"""Entities of the mini-GAIA world and the question templates asked about them.

A template starts from one entity and follows relations: one (L1, the answer is in the entity's
own passage), or two through a bridge entity named only in the first passage (L2). L3 follows two
and subtracts the bridge's year from a year of the starting entity. For every hop a question keeps
the query an agent would issue, the passage that answers it and the fact it finds there.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, replace

from pipeline.assets.world_text import article


@dataclass(frozen=True)
class City:
    name: str
    country: str
    founded: int
    population: int


@dataclass(frozen=True)
class Person:
    name: str
    born: int
    city: str
    profession: str


@dataclass(frozen=True)
class Film:
    name: str  # the title
    director: str
    year: int
    genre: str


@dataclass(frozen=True)
class Company:
    name: str
    founder: str
    founded: int
    hq: str
    industry: str


@dataclass(frozen=True)
class Entities:
    cities: list[City]
    people: list[Person]
    films: list[Film]
    companies: list[Company]

    def by_kind(self) -> dict[str, list]:
        return {
            "person": self.people,
            "city": self.cities,
            "film": self.films,
            "company": self.companies,
        }


@dataclass(frozen=True)
class WorldQuestion:
    id: str
    level: int
    template: str
    question: str
    answer: tuple[str, ...]  # acceptable answers, canonical first
    answer_kind: str  # city | country | person | profession | year | number
    subject: str  # the entity the question names
    bridge: str  # the entity the first hop leads to; "" for L1
    hop_queries: tuple[str, ...]
    gold_doc_ids: tuple[str, ...]
    hop_facts: tuple[str, ...]  # what each gold passage says, in words (demonstrations reuse it)
    operands: tuple[int, ...] = ()  # L3: answer == operands[0] - operands[1]
    split: str = ""

    @property
    def data_source(self) -> str:
        return f"minigaia_l{self.level}"


# (kind, relation) -> (words of the search query, attribute, fact, kind of the value)
RELATIONS = {
    ("person", "birthplace"): ("birthplace", "city", "{n} was born in {v}", "city"),
    ("person", "birth_year"): ("birth year", "born", "{n} was born in {v}", "year"),
    ("person", "profession"): ("profession", "profession", "{n} is {a}", "profession"),
    ("film", "director"): ("film director", "director", "{n} was directed by {v}", "person"),
    ("film", "year"): ("film release year", "year", "{n} was released in {v}", "year"),
    ("company", "founder"): ("founder", "founder", "{n} was founded by {v}", "person"),
    ("company", "year"): ("founding year", "founded", "{n} was founded in {v}", "year"),
    ("company", "hq"): ("headquarters", "hq", "{n} is headquartered in {v}", "city"),
    ("city", "country"): ("city country", "country", "{n} is a city in {v}", "country"),
    ("city", "year"): ("city founding year", "founded", "{n} was founded in {v}", "year"),
}


@dataclass(frozen=True)
class Template:
    level: int
    kind: str  # kind of the entity the question names
    relations: tuple[str, ...]  # followed from that entity; with two, the first leads to a bridge
    phrasings: tuple[str, ...]  # "{n}" is the entity's name
    minus: str = ""  # L3: the named entity's year relation; answer = that year - the bridge's year

    @property
    def name(self) -> str:
        return "_".join(
            (self.kind, *self.relations, *([f"minus_{self.minus}"] if self.minus else []))
        )


TEMPLATES = (
    Template(1, "person", ("birthplace",), ("In which city was {n} born?", "Where was {n} born?")),
    Template(
        1,
        "person",
        ("birth_year",),
        ("In what year was {n} born?", "What is the birth year of {n}?"),
    ),
    Template(
        1, "person", ("profession",), ("What is the profession of {n}?", "What does {n} work as?")
    ),
    Template(
        1,
        "film",
        ("year",),
        ("In what year was the film {n} released?", "When was the film {n} released?"),
    ),
    Template(
        1,
        "film",
        ("director",),
        ("Who directed the film {n}?", "Who is the director of the film {n}?"),
    ),
    Template(
        1,
        "company",
        ("year",),
        ("In what year was {n} founded?", "When was the company {n} founded?"),
    ),
    Template(
        1, "company", ("founder",), ("Who founded {n}?", "Who is the founder of the company {n}?")
    ),
    Template(
        1,
        "company",
        ("hq",),
        ("In which city is {n} headquartered?", "Where are the headquarters of {n}?"),
    ),
    Template(
        1,
        "city",
        ("country",),
        ("In which country is the city of {n}?", "The city of {n} lies in which country?"),
    ),
    Template(1, "city", ("year",), ("In what year was the city of {n} founded?",)),
    Template(
        2,
        "film",
        ("director", "birthplace"),
        (
            "In which city was the director of the film {n} born?",
            "Where was the director of {n} born?",
        ),
    ),
    Template(
        2,
        "film",
        ("director", "birth_year"),
        ("In what year was the director of the film {n} born?",),
    ),
    Template(
        2, "company", ("founder", "birthplace"), ("In which city was the founder of {n} born?",)
    ),
    Template(
        2, "company", ("founder", "profession"), ("What is the profession of the founder of {n}?",)
    ),
    Template(
        2,
        "company",
        ("hq", "country"),
        ("In which country is {n} headquartered?", "In which country are the headquarters of {n}?"),
    ),
    Template(2, "person", ("birthplace", "country"), ("In which country was {n} born?",)),
    Template(
        3,
        "company",
        ("founder", "birth_year"),
        ("How many years after the birth of the founder of {n} was {n} founded?",),
        "year",
    ),
    Template(
        3,
        "film",
        ("director", "birth_year"),
        ("How many years after the birth of its director was the film {n} released?",),
        "year",
    ),
    Template(
        3,
        "person",
        ("birthplace", "year"),
        ("How many years after the founding of the city where {n} was born was {n} born?",),
        "birth_year",
    ),
    Template(
        3,
        "company",
        ("hq", "year"),
        ("How many years after the founding of its headquarters city was {n} founded?",),
        "year",
    ),
)


class _Asker:
    def __init__(self, rng: random.Random, e: Entities, doc: dict[str, str]) -> None:
        self.rng, self.doc = rng, doc
        self.entity = {x.name: (kind, x) for kind, xs in e.by_kind().items() for x in xs}

    def hop(self, name: str, relation: str) -> tuple[str, str, object, str]:
        """(query, fact, value, kind of value) of one relation of the named entity."""
        kind, entity = self.entity[name]
        words, attribute, fact, value_kind = RELATIONS[kind, relation]
        value = getattr(entity, attribute)
        fact = fact.format(n=name, v=value, a=article(str(value)))
        return f"{name} {words}", fact, value, value_kind

    def ask(self, t: Template, name: str) -> WorldQuestion:
        query, fact, value, kind = self.hop(name, t.relations[0])
        queries, docs, facts, bridge, operands = [query], [name], [fact], "", ()
        if len(t.relations) == 2:
            bridge = str(value)
            query, fact2, value, kind = self.hop(bridge, t.relations[1])
            queries.append(query)
            docs.append(bridge)
            facts.append(fact2)
        if t.minus:
            _, year_fact, year, _ = self.hop(name, t.minus)
            facts[0] = f"{facts[0]}. {year_fact}"
            operands, value, kind = (year, value), year - value, "number"
        answers = [str(value)]
        if kind == "profession":
            answers.append(article(str(value)))
        elif kind == "number":
            answers.append(f"{value} years")
        return WorldQuestion(
            id="",
            level=t.level,
            template=t.name,
            question=self.rng.choice(t.phrasings).format(n=name),
            answer=tuple(answers),
            answer_kind=kind,
            subject=name,
            bridge=bridge,
            hop_queries=tuple(queries),
            gold_doc_ids=tuple(self.doc[d] for d in docs),
            hop_facts=tuple(facts),
            operands=operands,
        )


def _mentions(text: str, phrase: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(phrase)}(?!\w)", text) is not None


def questions_for(
    rng: random.Random, e: Entities, doc: dict[str, str], counts: tuple[int, int, int]
) -> list[WorldQuestion]:
    """`counts[level - 1]` numbered questions per level about the entities `e`.

    A level takes its templates in turn, so its relations are evenly mixed; no template is asked
    twice about the same entity.
    """
    asker, by_kind = _Asker(rng, e, doc), e.by_kind()
    questions = []
    for level in (1, 2, 3):
        queues = [
            (t, rng.sample(by_kind[t.kind], len(by_kind[t.kind])))
            for t in TEMPLATES
            if t.level == level
        ]
        made, wanted = 0, counts[level - 1]
        while made < wanted and any(pool for _, pool in queues):
            for t, pool in queues:
                if not pool or made == wanted:
                    continue
                q = asker.ask(t, pool.pop().name)
                if any(_mentions(q.question, a) for a in q.answer):
                    continue  # the question would give its answer away
                questions.append(replace(q, id=f"minigaia-l{level}-{made:06d}"))
                made += 1
    return questions
