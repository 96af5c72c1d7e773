"""Words of the mini-GAIA world: invented names, passage sentences and the agent's instruction.

Every function takes the `random.Random` it draws from, so the world's seed fixes every string.
Names are built from random syllables so that no prior knowledge can answer a question.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

# Repeats weight the draw: mostly plain consonant-vowel syllables, so names read like "Varno Telik".
ONSETS = tuple("bdfgklmnprstvz") * 3 + ("br", "dr", "kr", "tr", "th", "sh", "qu", "", "", "")
VOWELS = ("a", "e", "i", "o", "u") * 4 + ("ai", "ei", "ou")
INNER_CODAS = ("",) * 8 + ("r", "l", "n", "s")  # ends a syllable inside a word
FINAL_CODAS = ("",) * 4 + ("n", "r", "l", "s", "k", "x", "th")  # ends the word

PROFESSIONS = (
    "architect",
    "painter",
    "chemist",
    "engineer",
    "novelist",
    "composer",
    "surgeon",
    "historian",
    "photographer",
    "sculptor",
    "economist",
    "botanist",
    "journalist",
    "violinist",
    "astronomer",
    "lawyer",
    "cartographer",
    "carpenter",
)
GENRES = ("drama", "comedy", "thriller", "documentary", "western", "musical", "war", "mystery")
INDUSTRIES = (
    "shipping",
    "software",
    "textile",
    "brewing",
    "mining",
    "publishing",
    "pharmaceutical",
    "aerospace",
    "furniture",
    "insurance",
    "glassware",
    "railway",
)
FILM_NOUNS = (
    "Saga",
    "Tides",
    "Harbor",
    "Winter",
    "Echoes",
    "Lanterns",
    "Crossing",
    "Orchard",
    "Signal",
    "Mirror",
    "Garden",
    "Voyage",
    "Ashes",
    "Frontier",
    "Letters",
    "Silence",
    "Summer",
    "River",
)
COMPANY_SUFFIXES = (
    "Labs",
    "Works",
    "Systems",
    "Holdings",
    "Foundry",
    "Group",
    "Industries",
    "Partners",
    "Trading",
    "Motors",
    "Studios",
    "Mills",
)
CITY_KINDS = ("river", "coastal", "hill", "market", "mountain", "harbor", "university")
PERSON_DEEDS = (
    "later taught at a regional academy",
    "published two short memoirs",
    "spent many years working abroad",
    "received a civic award late in life",
    "kept detailed diaries that survive today",
    "was active in several local societies",
)

# Words of the templates: an invented name must never collide with one of them.
_RESERVED = {w.lower() for w in FILM_NOUNS + COMPANY_SUFFIXES} | {"the", "of", "and"}

INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first "
    "every time you get new information. After reasoning, if you find you lack some knowledge, "
    "you can call a search engine by <search> query </search> and it will return the top "
    "searched results between <information> and </information>. If you need to calculate, you "
    "can run Python code by <python> code </python> and it will return what the code prints "
    "between <output> and </output>. You can search and run code as many times as you want. If "
    "you find no further external knowledge needed, you can directly provide the answer inside "
    "<answer> and </answer>, without detailed illustrations. For example, "
    "<answer>Beijing</answer>. Question: {question}\n"
)


def user_prompt(question: str) -> list[dict[str, str]]:
    """The chat messages of one question: a single user turn, as in Search-R1's parquet."""
    return [{"role": "user", "content": INSTRUCTION.format(question=question)}]


def article(noun: str) -> str:
    return f"an {noun}" if noun[0] in "aeiou" else f"a {noun}"


class NameMaker:
    """Names composed from small pools of invented words, so that every word recurs across many
    names and a held-out entity is a new combination of words seen in training: what a policy has
    to learn is to copy a name from a passage, not to spell an unseen one. A person is a first name
    and a surname, a city two words, a film a word and a noun, a company a word and a suffix;
    countries are single words. Every word belongs to one pool only (a question never contains its
    answer by accident) and every name is used once.

    `expected` is how many names of each kind the world will ask for; a pool is sized so that the
    combinations outnumber them `COMBINATIONS` times.
    """

    COMBINATIONS = 3

    def __init__(self, rng: random.Random, expected: dict[str, int]) -> None:
        self.rng = rng
        self.used: set[str] = set(_RESERVED)  # words
        self.taken: set[tuple[str, ...]] = set()  # names, as their parts
        square = {
            k: max(4, math.ceil(math.sqrt(n * self.COMBINATIONS))) for k, n in expected.items()
        }
        self.first = self._pool(square["person"], (2,))
        self.last = self._pool(square["person"], (2, 3))
        self.city_first = self._pool(square["city"], (2,))
        self.city_last = self._pool(square["city"], (2, 3))
        film_words = math.ceil(expected["film"] * self.COMBINATIONS / len(FILM_NOUNS))
        self.film_words = self._pool(max(4, film_words), (2, 3))
        company_words = math.ceil(expected["company"] * self.COMBINATIONS / len(COMPANY_SUFFIXES))
        self.company_words = self._pool(max(4, company_words), (2, 3))

    def parts(self) -> dict[str, list[str]]:
        """The pools names are composed from, by part: what a warm start may rename names with
        (a first name by another first name, and so on) so that no fact can be memorised."""
        return {
            "first_name": self.first,
            "surname": self.last,
            "city_first": self.city_first,
            "city_last": self.city_last,
            "film_word": self.film_words,
            "company_word": self.company_words,
        }

    def word(self, syllables: tuple[int, ...] = (2,)) -> str:
        """A new invented word, never drawn before by this maker."""
        rng = self.rng
        while True:
            n = rng.choice(syllables)
            codas = [rng.choice(INNER_CODAS) for _ in range(n - 1)] + [rng.choice(FINAL_CODAS)]
            word = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + coda for coda in codas)
            if len(word) >= 4 and "quu" not in word and word not in self.used:
                self.used.add(word)
                return word.capitalize()

    def _pool(self, size: int, syllables: tuple[int, ...]) -> list[str]:
        return [self.word(syllables) for _ in range(size)]

    def _combine(self, *pools: Sequence[str]) -> tuple[str, ...]:
        while True:  # the pools hold COMBINATIONS times the names asked for: this ends quickly
            parts = tuple(self.rng.choice(pool) for pool in pools)
            if parts not in self.taken:
                self.taken.add(parts)
                return parts

    def person(self) -> str:
        return " ".join(self._combine(self.first, self.last))

    def city(self) -> str:
        return " ".join(self._combine(self.city_first, self.city_last))

    def country(self) -> str:
        return self.word((3,))

    def film(self) -> str:
        word, noun = self._combine(self.film_words, FILM_NOUNS)
        return self.rng.choice((f"{word} {noun}", f"The {noun} of {word}", f"The {word} {noun}"))

    def company(self) -> str:
        return " ".join(self._combine(self.company_words, COMPANY_SUFFIXES))


def person_text(rng: random.Random, name: str, born: int, city: str, profession: str) -> str:
    surname, deed = name.split()[-1], rng.choice(PERSON_DEEDS)
    return rng.choice(
        (
            f"{name} (born {born} in {city}) is {article(profession)}. {surname} {deed}.",
            f"{name} is {article(profession)} who was born in the city of {city} in {born}. "
            f"Over a long career {surname} {deed}.",
            f"Born in {city} in {born}, {name} trained as {article(profession)} and {deed}.",
        )
    )


def city_text(rng: random.Random, name: str, country: str, founded: int, population: int) -> str:
    kind = rng.choice(CITY_KINDS)
    return rng.choice(
        (
            f"{name} is a {kind} city in {country}. It was founded in {founded} and has a "
            f"population of about {population:,}.",
            f"Founded in {founded}, {name} is a {kind} city in {country} with roughly "
            f"{population:,} inhabitants.",
            f"The {kind} city of {name} lies in {country}. Records date its founding to "
            f"{founded}; about {population:,} people live there today.",
        )
    )


def film_text(rng: random.Random, title: str, director: str, year: int, genre: str) -> str:
    return rng.choice(
        (
            f"{title} is a {year} {genre} film directed by {director}.",
            f"Released in {year}, the {genre} film {title} was directed by {director}.",
            f"{title} is a {genre} film by the director {director}, first shown in {year}.",
        )
    )


def company_text(
    rng: random.Random, name: str, founder: str, founded: int, hq: str, industry: str
) -> str:
    return rng.choice(
        (
            f"{name} is {article(industry)} company founded in {founded} by {founder}. Its headquarters "
            f"are in {hq}.",
            f"Founded by {founder} in {founded}, {name} is {article(industry)} firm headquartered in {hq}.",
            f"{name}, {article(industry)} business based in {hq}, was established in {founded} by "
            f"{founder}.",
        )
    )
