"""A built-in task for the search tool: multi-hop questions about invented entities, whose facts
are in a corpus that ships with the package (``m2flow/tools/corpora/invented.jsonl.gz``, the search
tool's built-in corpus ``invented``) and in no model's weights.

The world (made once from a fixed seed; ``world()``): countries, towns in them, people born in
a town in a year, each with a mentor; companies, each founded by a person in a year and
headquartered in a town; inventions, each made by a person. The corpus has one document per
entity, its facts in sentences that name the entities it is linked to; answering a question
takes two searches or more (the company's founder, then where the founder was born).

The held-out split is held out three times over: its questions are about entities that no
training question asks about (answers cannot be remembered from training), a share of each
kind's phrasings is never used for training, and one kind (``HELD_OUT_KINDS``: the country a
company's founder was born in, three hops) appears in the held-out split only. The reference
answer is a name (or a year); ``m2flow.rewards.match:exact_match`` scores it.
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from m2flow.data.problems import Problem
from m2flow.tools.search import CORPORA

CORPUS = CORPORA / "invented.jsonl.gz"  # the shipped corpus: ``write_corpus`` makes it
SEED = 2026
SPLITS = ("train", "test")
HELD_OUT_SHARE = 5  # every 5th entity of each kind is asked about in the held-out split only
# the search tool as the presets offer it, and as the demonstrations show it answering
SEARCH = {"path": "search", "corpus": "invented", "k": 3, "max_chars": 300}


@dataclass(frozen=True)
class Person:
    name: str
    town: str
    born: int
    mentor: str | None
    trade: str


@dataclass(frozen=True)
class Company:
    name: str
    founder: str
    founded: int
    town: str
    makes: str


@dataclass(frozen=True)
class Invention:
    name: str
    inventor: str
    year: int


@dataclass(frozen=True)
class World:
    countries: dict[str, str]  # country -> its capital (a town)
    towns: dict[str, tuple[str, str]]  # town -> (its country, its river)
    people: dict[str, Person]
    companies: dict[str, Company]
    inventions: dict[str, Invention]


_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr", "kr", "tr",
           "th", "sh", "vl", "zh", "qu")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ou", "ei")
_CODAS = ("", "", "n", "r", "s", "l", "th", "nd", "rk", "x")
_TRADES = ("engineer", "chemist", "weaver", "architect", "cartographer", "glassmaker", "botanist", "clockmaker")
_GOODS = ("lamps", "ropes", "lenses", "clocks", "dyes", "bicycles", "pumps", "paper", "kettles", "telescopes")
_THINGS = ("loom", "compass", "press", "valve", "kiln", "sextant", "lathe", "bellows", "sieve", "pulley")


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)) + rng.choice(_CODAS)


def _names(rng: random.Random, n: int, make: Callable[[random.Random], str], taken: set[str]) -> list[str]:
    out = []
    while len(out) < n:
        name = make(rng)
        if name.lower() not in taken:
            taken.add(name.lower())
            out.append(name)
    return out


@cache
def world(seed: int = SEED) -> World:
    """The invented world (deterministic from ``seed``)."""
    rng = random.Random(f"m2flow-invented:{seed}")
    taken: set[str] = set()
    countries = _names(rng, 10, lambda r: _word(r, 2).capitalize() + r.choice(("land", "ia", "mark", "stan")), taken)
    rivers = _names(rng, 20, lambda r: _word(r, 2).capitalize(), taken)
    towns = _names(rng, 60, lambda r: _word(r, rng.choice((2, 3))).capitalize(), taken)
    town_of = {t: (countries[i % len(countries)], rng.choice(rivers)) for i, t in enumerate(towns)}
    capitals = {c: next(t for t in towns if town_of[t][0] == c) for c in countries}
    people_names = _names(rng, 200, lambda r: f"{_word(r, 2).capitalize()} {_word(r, 2).capitalize()}", taken)
    people: dict[str, Person] = {}
    for i, name in enumerate(people_names):
        mentor = people_names[rng.randrange(i)] if i else None
        people[name] = Person(name, rng.choice(towns), rng.randint(1820, 1900), mentor, rng.choice(_TRADES))
    companies: dict[str, Company] = {}
    for name in _names(rng, 100, lambda r: _word(r, 2).capitalize() + " " + r.choice(("Works", "Labs", "Company",
                                                                                       "Foundry", "Mills")), taken):
        founder = rng.choice(people_names[20:])  # a founder who has a mentor
        companies[name] = Company(name, founder, people[founder].born + rng.randint(25, 45), rng.choice(towns),
                                  rng.choice(_GOODS))
    inventions: dict[str, Invention] = {}
    for name in _names(rng, 60, lambda r: f"{_word(r, 2)} {r.choice(_THINGS)}", taken):
        inventor = rng.choice(people_names)
        inventions[name] = Invention(name, inventor, people[inventor].born + rng.randint(20, 50))
    return World(capitals, town_of, people, companies, inventions)


def documents(w: World) -> list[dict[str, str]]:
    """The corpus: one document per entity (``title``, ``text``), its facts in sentences."""
    docs = []
    for country, capital in w.countries.items():
        towns = sorted(t for t, (c, _) in w.towns.items() if c == country)
        docs.append({"title": country, "text": f"{country} is a country. Its capital is {capital}. Its towns "
                                               f"include {', '.join(towns)}."})
    for town, (country, river) in w.towns.items():
        docs.append({"title": town, "text": f"{town} is a town in {country}, on the river {river}."})
    founded: dict[str, list[str]] = {}
    for c in w.companies.values():
        founded.setdefault(c.founder, []).append(c.name)
    for p in w.people.values():
        text = f"{p.name} was a {p.trade}, born in {p.town} in {p.born}."
        if p.mentor:
            text += f" {p.name} was trained by {p.mentor}."
        if p.name in founded:
            text += f" {p.name} founded {' and '.join(founded[p.name])}."
        docs.append({"title": p.name, "text": text})
    for c in w.companies.values():
        docs.append({"title": c.name, "text": f"{c.name} is a company that makes {c.makes}. It was founded in "
                                              f"{c.founded} by {c.founder}, and is headquartered in {c.town}."})
    for i in w.inventions.values():
        docs.append({"title": f"The {i.name}", "text": f"The {i.name} was invented by {i.inventor} in {i.year}."})
    return docs


def write_corpus(path: str | Path = CORPUS) -> Path:
    """Writes the corpus as JSON lines, gzipped if the name ends in ``.gz`` (the shipped file is
    this function's output)."""
    path = Path(path)
    text = "".join(json.dumps(d) + "\n" for d in documents(world())).encode("utf-8")
    path.write_bytes(gzip.compress(text, mtime=0) if path.suffix == ".gz" else text)
    return path


@dataclass(frozen=True)
class Kind:
    name: str
    about: Callable[[World], list[str]]  # the entities its questions are about
    answer: Callable[[World, str], str]
    phrasings: tuple[str, ...]  # the last HELD_OUT_PHRASINGS of them are the held-out split's
    hops: int


def _founder(w: World, c: str) -> Person:
    return w.people[w.companies[c].founder]


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("founder_birthplace", lambda w: list(w.companies), lambda w, c: _founder(w, c).town, (
        "In which town was the founder of {x} born?", "Where was the person who founded {x} born?",
        "{x} was founded by someone. In what town was that person born?",
        "Name the birthplace of the founder of {x}.",
        "Which town is the birthplace of {x}'s founder?", "The founder of {x} was born in which town?"), 2),
    Kind("headquarters_country", lambda w: list(w.companies), lambda w, c: w.towns[w.companies[c].town][0], (
        "In which country is {x} headquartered?", "Which country are the headquarters of {x} in?",
        "{x} has its headquarters in a town. Which country is that town in?",
        "Name the country where {x} has its headquarters.",
        "What country is home to the headquarters of {x}?", "The headquarters of {x} lie in which country?"), 2),
    Kind("mentor_birthplace", lambda w: [p for p in w.people if w.people[p].mentor],
         lambda w, p: w.people[w.people[p].mentor].town, (
             "In which town was the person who trained {x} born?", "Where was the mentor of {x} born?",
             "{x} was trained by someone. In what town was that person born?",
             "Name the birthplace of {x}'s mentor.",
             "Which town is the birthplace of the one who trained {x}?", "{x}'s mentor was born in which town?"), 2),
    Kind("inventor_birth_year", lambda w: list(w.inventions), lambda w, i: str(w.people[w.inventions[i].inventor].born), (
        "In which year was the inventor of the {x} born?", "When was the person who invented the {x} born?",
        "The {x} was invented by someone. In what year was that person born?",
        "Give the birth year of the inventor of the {x}.",
        "What year was the {x}'s inventor born in?", "The inventor of the {x} was born in which year?"), 2),
    Kind("founder_country", lambda w: list(w.companies), lambda w, c: w.towns[_founder(w, c).town][0], (
        "In which country was the founder of {x} born?", "The founder of {x} was born in a town of which country?",
        "Which country is the founder of {x} from by birth?"), 3),
)}
HELD_OUT_KINDS = ("founder_country",)
HELD_OUT_PHRASINGS = 2


def phrasings(kind: Kind, split: str) -> tuple[str, ...]:
    """The phrasings of ``kind`` that ``split`` uses."""
    if kind.name in HELD_OUT_KINDS:
        return kind.phrasings if split == "test" else ()
    return kind.phrasings[-HELD_OUT_PHRASINGS:] if split == "test" else kind.phrasings[:-HELD_OUT_PHRASINGS]


def entities(kind: Kind, split: str, w: World) -> list[str]:
    """The entities ``split``'s questions of ``kind`` are about: every ``HELD_OUT_SHARE``-th the
    held-out split's, the others training's."""
    return [x for i, x in enumerate(kind.about(w)) if (i % HELD_OUT_SHARE == 0) == (split == "test")]


def invented_problems(n: int, split: str = "train", seed: int = 0) -> list[Problem]:
    """``n`` distinct questions of ``split``, the kinds taking turns (at most as many as there
    are: ``ValueError`` past it). Each Problem's ``id`` names its kind, phrasing and entity
    (``invented-<kind>-<phrasing>-<entity>``)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    w = world()
    pool = [(k, p, x) for k in KINDS.values() for p in phrasings(k, split) for x in entities(k, split, w)]
    if n > len(pool):
        raise ValueError(f"invented: {split} has {len(pool)} distinct questions, asked for {n}")
    rng = random.Random(f"m2flow-invented-questions:{seed}:{split}")
    by_kind: dict[str, list] = {}
    for item in pool:
        by_kind.setdefault(item[0].name, []).append(item)
    for items in by_kind.values():
        rng.shuffle(items)
    out: list[Problem] = []
    queues = list(by_kind.values())
    while len(out) < n:
        for items in queues:
            if items and len(out) < n:
                kind, phrasing, x = items.pop()
                place = kind.phrasings.index(phrasing)
                out.append(Problem(phrasing.format(x=x), kind.answer(w, x), id=f"invented-{kind.name}-{place}-{x}"))
    return out


def hops(problem: Problem) -> list[str]:
    """The entities a problem's answer is found through, in order (a demonstration's searches)."""
    _, kind, _, x = problem.id.split("-", 3)
    w = world()
    if kind in ("founder_birthplace", "founder_country"):
        chain = [x, w.companies[x].founder]
        return chain + ([w.people[chain[1]].town] if kind == "founder_country" else [])
    if kind == "headquarters_country":
        return [x, w.companies[x].town]
    if kind == "mentor_birthplace":
        return [x, w.people[x].mentor]
    return [f"The {x}", w.inventions[x].inventor]
