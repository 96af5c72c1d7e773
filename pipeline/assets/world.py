"""`python -m pipeline.assets.world --out DIR --seed S [--size small|medium]`: the offline mini-GAIA world.

An invented knowledge base (people, cities, films and companies with made-up names, one passage
each, plus distractors nobody asks about) and questions about it: one hop (L1), two hops through
a bridge entity (L2), two hops and a subtraction (L3). Written as a wiki-18 corpus, Search-R1
parquet splits, GAIA metadata for the test split and demonstration trajectories. The seed and size
fix every byte of every file.

What makes it a test bed for stratified advantages:
- Some attributes follow skewed (Zipf) frequencies: countries of cities, birthplaces, professions,
  headquarters. A guess without searching that follows these priors is right sometimes (about a
  fifth of the time for a country, never for a year), so trajectories with 0, 1 and 2 searches
  have different reward means: the cross-stratum bias the paper is about. The priors are kept
  flat enough that two searches pay more than a guess on two-hop questions (at version 3 the
  most common country answered two thirds of them and the policy unlearnt searching). `skew`
  (`data.world_skew`, `--skew`) steepens them: at 1.3 a guess pays about what a chain of two
  searches pays a warm-started policy (docs/results/skewed.md).
- The trap knob, `chains_astray` (`data.world_chains_astray`, `--chains-astray`): the share of the
  two-search demonstrations whose second query goes astray. With it high, a warm-started policy's
  chains pay less than a guess at the start (docs/results/trap_gaia.md). Only the demos change.
- Where the warm start starts: `chain_demos` (`data.world_chain_demos`, `--chain-demos`), the
  share of two-hop and three-step demos that chain two searches, and `guess_sharpness`
  (`data.world_guess_sharpness`, `--guess-sharpness`), how sharply a demo's guess favours the
  commonest training answer (pipeline/assets/world_demos.py). Only the demos change; unset, the
  world is the same byte for byte (tests/pipeline/test_world.py pins its digest).
- Held-out questions are about new entities: the test split's subjects are never the subject or
  the bridge of a training question, so what transfers is how to search, not memorised answers.
  Their names are new combinations of words that training names use too (`NameMaker`), so a
  policy can copy them from a question or a passage with tokens it has learnt.
- Both splits are written in a seeded shuffled order, so their first N questions (the
  `data.num_questions` a run takes, `eval.max_questions`) mix the levels.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.assets.world_demos import make_demos
from pipeline.assets.world_questions import (
    City,
    Company,
    Entities,
    Film,
    Person,
    WorldQuestion,
    questions_for,
)
from pipeline.assets.world_text import (
    GENRES,
    INDUSTRIES,
    PROFESSIONS,
    NameMaker,
    city_text,
    company_text,
    film_text,
    person_text,
    user_prompt,
)
from retrieval.corpus import Passage, make_contents, write_corpus

VERSION = 4  # 2: skewed priors, held-out entities, shuffled order; 3: names composed from pools;
# 4: flatter priors (skew 0.6, 12 countries in small): a guess had beaten a search on two-hop questions
TEST_SHARE = 0.2  # of the core entities of each kind: the held-out subjects
SKEW = 0.6  # exponent of the skewed attributes' frequencies (weight of the i-th value: 1 / i**SKEW)
KINDS = ("person", "city", "film", "company")


@dataclass(frozen=True)
class Size:
    countries: int
    cities: int
    people: int
    films: int
    companies: int
    distractor_share: float  # distractor entities per core entity, per kind
    questions: tuple[int, int, int]  # L1, L2, L3
    max_demos: int


SIZES = {
    "small": Size(12, 50, 200, 100, 100, 0.3, (220, 180, 160), 600),
    "medium": Size(30, 500, 2000, 1000, 1000, 0.3, (2200, 1800, 1600), 3000),
}

_PROMPT = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
SEARCH_R1_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("question", pa.string()),
        ("golden_answers", pa.list_(pa.string())),
        ("data_source", pa.string()),
        ("prompt", _PROMPT),
        ("ability", pa.string()),
        (
            "reward_model",
            pa.struct(
                [
                    ("style", pa.string()),
                    ("ground_truth", pa.struct([("target", pa.list_(pa.string()))])),
                ]
            ),
        ),
        (
            "extra_info",
            pa.struct(
                [
                    ("split", pa.string()),
                    ("index", pa.int64()),
                    ("level", pa.int64()),
                    ("hop_queries", pa.list_(pa.string())),
                    ("gold_doc_ids", pa.list_(pa.string())),
                ]
            ),
        ),
    ]
)


class WorldError(ValueError):
    """A world that cannot be built or written; one line saying what to do."""


@dataclass(frozen=True, eq=False)
class World:
    seed: int
    size: str
    passages: tuple[Passage, ...]  # sorted by id
    kinds: dict[str, str]  # passage id -> "person" | "city" | "film" | "company"
    questions: tuple[WorldQuestion, ...]  # training, then test (each shuffled), `split` set
    demos: tuple[dict, ...] = ()
    name_parts: dict[str, list[str]] | None = None  # NameMaker.parts()
    skew: float = SKEW  # exponent of the skewed attributes' frequencies
    chains_astray: float | None = None  # share of two-search demos astray (None: the default mix)
    chain_demos: float | None = None  # share of L2/L3 demos that chain (None: as written)
    guess_sharpness: float | None = None  # exponent on a guess's answer frequency (None: as drawn)

    def split(self, name: str) -> list[WorldQuestion]:
        return [q for q in self.questions if q.split == name]

    @property
    def counts(self) -> dict[str, int]:
        levels = {f"l{n}": sum(q.level == n for q in self.questions) for n in (1, 2, 3)}
        kinds = {f"{k}_passages": sum(v == k for v in self.kinds.values()) for k in KINDS}
        return {
            "passages": len(self.passages),
            **kinds,
            "questions": len(self.questions),
            **levels,
            "train": len(self.split("train")),
            "test": len(self.split("test")),
            "demos": len(self.demos),
        }


def _rng(seed: int, stream: str) -> random.Random:
    # One stream per stage, so that changing how demos are drawn leaves the world itself unchanged.
    return random.Random(f"mini-gaia/{seed}/{stream}")


def _entities(
    rng: random.Random,
    names: NameMaker,
    size: Size,
    share: float,
    countries: list[str],
    skew: float,
) -> Entities:
    def n(count: int) -> int:
        return _count(count, share)

    def skewed(values: list) -> object:
        """One of `values`, the i-th (from 1) with weight 1 / i**skew: a prior a guess can follow."""
        return rng.choices(values, [1 / (i + 1) ** skew for i in range(len(values))])[0]

    cities = [
        City(
            names.city(),
            skewed(countries),
            rng.randint(1000, 1850),
            rng.randrange(8_000, 2_500_000, 500),
        )
        for _ in range(n(size.cities))
    ]
    city_names = [c.name for c in cities]
    people = [
        Person(
            names.person(),
            rng.randint(1890, 1995),
            skewed(city_names),
            skewed(list(PROFESSIONS)),
        )
        for _ in range(n(size.people))
    ]
    films = []
    for _ in range(n(size.films)):
        director = rng.choice(people)
        year = rng.randint(director.born + 22, min(director.born + 70, 2023))
        films.append(Film(names.film(), director.name, year, rng.choice(GENRES)))
    companies = []
    for _ in range(n(size.companies)):
        founder = rng.choice(people)
        founded = rng.randint(founder.born + 20, min(founder.born + 65, 2023))
        hq = skewed(city_names)
        companies.append(
            Company(names.company(), founder.name, founded, hq, rng.choice(INDUSTRIES))
        )
    return Entities(cities, people, films, companies)


def _passages(
    rng: random.Random, groups: list[Entities]
) -> tuple[list[Passage], dict[str, str], dict[str, str]]:
    """(passages sorted by id, passage id -> kind, entity name -> passage id)."""
    items = []
    for e in groups:
        items += [
            ("city", c.name, city_text(rng, c.name, c.country, c.founded, c.population))
            for c in e.cities
        ]
        items += [
            ("person", p.name, person_text(rng, p.name, p.born, p.city, p.profession))
            for p in e.people
        ]
        items += [
            ("film", f.name, film_text(rng, f.name, f.director, f.year, f.genre)) for f in e.films
        ]
        items += [
            ("company", c.name, company_text(rng, c.name, c.founder, c.founded, c.hq, c.industry))
            for c in e.companies
        ]
    # Shuffled before numbering, so an id says nothing about what kind of entity it holds.
    rng.shuffle(items)
    passages, kinds, doc = [], {}, {}
    for i, (kind, name, text) in enumerate(items):
        pid = f"doc-{i:06d}"
        passages.append(Passage(pid, make_contents(name, text)))
        kinds[pid], doc[name] = kind, pid
    return passages, kinds, doc


def _split(
    rng: random.Random, core: Entities, questions: list[WorldQuestion]
) -> list[WorldQuestion]:
    """Held-out entities: TEST_SHARE of each kind's core entities (at least one). A question about
    one is a test question; a question that passes through one (its bridge) is asked nowhere, so
    no training question mentions a held-out entity. Both splits come in a seeded shuffled order,
    so that any first N questions mix the levels."""
    held_out: set[str] = set()
    for entities in core.by_kind().values():
        names = sorted(e.name for e in entities)
        held_out.update(rng.sample(names, max(1, round(len(names) * TEST_SHARE))))
    train, test = [], []
    for q in questions:
        if q.subject in held_out:
            test.append(replace(q, split="test"))
        elif q.bridge not in held_out:
            train.append(replace(q, split="train"))
    rng.shuffle(train)
    rng.shuffle(test)
    return train + test


def _count(count: int, share: float) -> int:
    return max(1, round(count * share))


def _expected_names(size: Size) -> dict[str, int]:
    """How many names of each kind the core entities and the distractors take together."""
    counts = {"person": size.people, "city": size.cities, "film": size.films}
    counts["company"] = size.companies
    return {k: n + _count(n, size.distractor_share) for k, n in counts.items()}


def build_world(
    seed: int,
    size: str = "small",
    skew: float = SKEW,
    chains_astray: float | None = None,
    chain_demos: float | None = None,
    guess_sharpness: float | None = None,
) -> World:
    """The world for this seed, size, prior skew and demo mix, in memory; `write_world` puts it
    on disk. `chains_astray`, `chain_demos` and `guess_sharpness` change the demonstrations
    only: passages and questions stay."""
    if not 0 <= skew <= 4:
        raise WorldError(f"the world's skew must lie in [0, 4] (got {skew}); the default is {SKEW}")
    if chains_astray is not None and not 0 <= chains_astray <= 1:
        raise WorldError(
            f"the share of chain demos astray must lie in [0, 1] (got {chains_astray}); "
            "leave it unset for the default mix"
        )
    if chain_demos is not None and not 0 <= chain_demos <= 1:
        raise WorldError(
            f"the share of two-hop demos that chain must lie in [0, 1] (got {chain_demos}); "
            "leave it unset for the default mix"
        )
    if guess_sharpness is not None and not 0 <= guess_sharpness <= 64:
        raise WorldError(
            f"the guess sharpness must lie in [0, 64] (got {guess_sharpness}); "
            "leave it unset for guesses drawn by answer frequency"
        )
    if size not in SIZES:
        raise WorldError(f"unknown world size {size!r}; choose one of: {', '.join(SIZES)}")
    if seed < 0:  # random.Random(-s) equals random.Random(s): negative seeds would alias
        raise WorldError(f"the world's seed must be >= 0 (got {seed})")
    spec, rng = SIZES[size], _rng(seed, "entities")
    names = NameMaker(rng, _expected_names(spec))
    countries = [names.country() for _ in range(spec.countries)]
    core = _entities(rng, names, spec, 1.0, countries, skew)
    # Distractors link only among themselves: no question starts from or passes through one.
    distractors = _entities(rng, names, spec, spec.distractor_share, countries, skew)
    passages, kinds, doc = _passages(_rng(seed, "text"), [core, distractors])
    questions = questions_for(_rng(seed, "questions"), core, doc, spec.questions)
    questions = _split(_rng(seed, "split"), core, questions)
    train = [q for q in questions if q.split == "train"]
    # A demo's guess follows the training answers' frequencies: the prior a policy can learn.
    guesses: dict[str, list[str]] = {}
    for q in train:
        guesses.setdefault(q.answer_kind, []).append(q.answer[0])
    demos = make_demos(
        train,
        passages,
        kinds,
        guesses,
        _rng(seed, "demos"),
        spec.max_demos,
        chains_astray,
        chain_demos,
        guess_sharpness,
    )
    return World(
        seed,
        size,
        tuple(passages),
        kinds,
        tuple(questions),
        tuple(demos),
        names.parts(),
        skew,
        chains_astray,
        chain_demos,
        guess_sharpness,
    )


# ------------------------------------------------------------------------------------------ files


def search_r1_table(questions: list[WorldQuestion], split: str) -> pa.Table:
    """Questions as rows of Search-R1's parquet (`index` counts rows within the split)."""
    rows = [
        {
            "id": q.id,
            "question": q.question,
            "golden_answers": list(q.answer),
            "data_source": q.data_source,
            "prompt": user_prompt(q.question),
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": list(q.answer)}},
            "extra_info": {
                "split": split,
                "index": index,
                "level": q.level,
                "hop_queries": list(q.hop_queries),
                "gold_doc_ids": list(q.gold_doc_ids),
            },
        }
        for index, q in enumerate(questions)
    ]
    return pa.Table.from_pylist(rows, schema=SEARCH_R1_SCHEMA)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as fh:
        fh.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def _write_files(world: World, out: Path) -> None:
    write_corpus(world.passages, out / "corpus.jsonl")
    for split in ("train", "test"):
        table = search_r1_table(world.split(split), split)
        pq.write_table(table, out / f"{split}.parquet", compression="zstd")
    gaia = [
        {
            "task_id": q.id,
            "Question": q.question,
            "Level": q.level,
            "Final answer": q.answer[0],
            "file_name": "",
        }
        for q in world.split("test")
    ]
    _write_jsonl(out / "metadata.jsonl", gaia)
    _write_jsonl(out / "demos.jsonl", list(world.demos))
    manifest = {
        "seed": world.seed,
        "size": world.size,
        "skew": world.skew,
        "chains_astray": world.chains_astray,
        # Written only when set: the default world's manifest stays as it was, byte for byte.
        **({"chain_demos": world.chain_demos} if world.chain_demos is not None else {}),
        **({"guess_sharpness": world.guess_sharpness} if world.guess_sharpness is not None else {}),
        "counts": world.counts,
        "version": VERSION,
        "name_parts": world.name_parts,
    }
    # Last: a directory holding world.json holds a complete world.
    (out / "world.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def write_world(world: World, out_dir: str | os.PathLike[str], *, force: bool = False) -> None:
    """Write the world's files into `out_dir`, all or nothing.

    The files go into a temporary sibling directory that is renamed into place at the end. A
    non-empty `out_dir` is refused, and with `force` replaced only if it holds an earlier world.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise WorldError(f"--out {out} exists and is not a directory")
    occupied = out.is_dir() and any(out.iterdir())
    if occupied and not force:
        raise WorldError(f"--out {out} exists and is not empty; pass --force to replace it")
    if occupied and not (out / "world.json").is_file():
        raise WorldError(
            f"--out {out} holds files but no world.json; not replacing it, even with --force"
        )
    existing = next((a for a in out.parents if a.exists()), None)
    if existing is not None and not existing.is_dir():
        raise WorldError(f"cannot write to --out {out}: {existing} is a file, not a directory")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    except OSError as exc:
        raise WorldError(f"cannot write to {out.parent}: {exc.strerror or exc}") from None
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    try:
        _write_files(world, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; a world is meant to be shared
        if occupied:
            out.rename(old)
        elif out.is_dir():
            out.rmdir()
        tmp.rename(out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.is_dir() and not out.exists():
            old.rename(out)  # put the earlier world back
        if isinstance(exc, OSError):
            raise WorldError(f"cannot write the world to {out}: {exc.strerror or exc}") from None
        raise
    shutil.rmtree(old, ignore_errors=True)


# -------------------------------------------------------------------------------------------- CLI


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage block
        raise WorldError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m pipeline.assets.world",
        description="Write the offline mini-GAIA world: corpus, questions, GAIA metadata, demos.",
    )
    p.add_argument("--out", required=True, help="directory to write the world into")
    p.add_argument("--seed", type=int, default=0, help="seed of the generator (default 0)")
    p.add_argument("--size", default="small", help=f"one of {', '.join(SIZES)} (default small)")
    p.add_argument(
        "--skew",
        type=float,
        default=SKEW,
        help=f"exponent of the skewed priors a guess can follow (default {SKEW})",
    )
    p.add_argument(
        "--chains-astray",
        type=float,
        default=None,
        help="share of the two-search demos whose second query goes astray (the trap knob; "
        "default: the world's own mix, 0.5 of two-hop and 0.4 of three-step chains)",
    )
    p.add_argument(
        "--chain-demos",
        type=float,
        default=None,
        help="share of the two-hop and three-step demos that chain two searches "
        "(default: the world's own mix, 0.2 of two-hop and 0.25 of three-step ones)",
    )
    p.add_argument(
        "--guess-sharpness",
        type=float,
        default=None,
        help="a demo's guess is drawn with weight frequency ** this over the training answers "
        "(1: by frequency, large: the commonest; default: drawn by frequency as written)",
    )
    p.add_argument("--force", action="store_true", help="replace an earlier world in --out")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        start = time.perf_counter()
        world = build_world(
            args.seed,
            args.size,
            args.skew,
            args.chains_astray,
            args.chain_demos,
            args.guess_sharpness,
        )
        write_world(world, args.out, force=args.force)
    except WorldError as exc:
        print(f"strata world: error: {exc}", file=sys.stderr)
        return 2
    c = world.counts
    print(
        f"wrote {args.out} in {time.perf_counter() - start:.2f}s: {c['passages']} passages, "
        f"{c['questions']} questions (L1 {c['l1']}, L2 {c['l2']}, L3 {c['l3']}; "
        f"train {c['train']}, test {c['test']}), {c['demos']} demos"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
