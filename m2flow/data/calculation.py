"""A built-in task for tool use: calculations a small model cannot do in its head (multi-digit
products, long sums, powers, exact division, percentages), each asked in many phrasings.

Every kind of calculation has its own phrasings, and the held-out split is held out twice
over: a fixed share of each kind's phrasings is never used for training, and one kind
(``HELD_OUT_KINDS``: differences of products) appears in the held-out split only. A problem's
split is its phrasing's and kind's, so a model scored on the held-out split meets wordings
and a kind of question it never trained on. Generation is deterministic from (seed, split).

The reference answer is exact: an integer, or a decimal with at most two places (percentages
are chosen so that they have one)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from m2flow.data.problems import Problem

SPLITS = ("train", "test")


@dataclass(frozen=True)
class Kind:
    name: str
    make: Callable[[random.Random], tuple[dict, str, str]]  # -> (the phrasing's fields, expression, answer)
    phrasings: tuple[str, ...]  # the last HELD_OUT_PHRASINGS of them are the held-out split's


def _product(rng: random.Random) -> tuple[dict, str, str]:
    a, b = rng.randint(100, 9999), rng.randint(12, 999)
    return {"a": a, "b": b}, f"{a}*{b}", str(a * b)


def _sum(rng: random.Random) -> tuple[dict, str, str]:
    terms = [rng.randint(10, 9999) for _ in range(rng.randint(5, 8))]
    listed = ", ".join(map(str, terms[:-1])) + f" and {terms[-1]}"
    return {"terms": listed, "plus": " + ".join(map(str, terms))}, " + ".join(map(str, terms)), str(sum(terms))


def _power(rng: random.Random) -> tuple[dict, str, str]:
    a, b = rng.randint(3, 19), rng.randint(4, 9)
    return {"a": a, "b": b}, f"{a}**{b}", str(a ** b)


def _division(rng: random.Random) -> tuple[dict, str, str]:
    q, d = rng.randint(101, 9999), rng.randint(13, 97)
    return {"n": q * d, "d": d}, f"{q * d}/{d}", str(q)


def _percent(rng: random.Random) -> tuple[dict, str, str]:
    p, n = rng.choice([5, 12, 15, 18, 22, 35, 45, 65, 85, 125]), rng.randint(20, 9999) * 4
    value = p * n / 100  # a multiple of 4 times p: at most two decimal places
    answer = f"{value:.2f}".rstrip("0").rstrip(".")
    return {"p": p, "n": n}, f"{p}/100*{n}", answer


def _difference_of_products(rng: random.Random) -> tuple[dict, str, str]:
    a, b, c, d = rng.randint(100, 999), rng.randint(12, 99), rng.randint(10, 99), rng.randint(12, 99)
    return {"a": a, "b": b, "c": c, "d": d}, f"{a}*{b} - {c}*{d}", str(a * b - c * d)


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("product", _product, (
        "What is {a} times {b}?", "Compute {a} * {b}.", "Multiply {a} by {b}.",
        "A box holds {b} items. How many items are in {a} boxes?", "What is the product of {a} and {b}?",
        "Each of {a} tickets costs {b} dollars. What do they cost together, in dollars?")),
    Kind("sum", _sum, (
        "What is {plus}?", "Add up {terms}.", "Find the sum of {terms}.",
        "A shop sold {terms} items on successive days. How many items did it sell in all?",
        "Compute the total of {terms}.", "What do {terms} add up to?")),
    Kind("power", _power, (
        "What is {a} to the power of {b}?", "Compute {a}^{b}.", "What is {a} raised to the {b}th power?",
        "A colony of bacteria grows {a}-fold every hour, from one cell. How many cells are there after {b} hours?",
        "Evaluate {a}**{b}.", "Multiply {a} by itself {b} times: what do you get?")),
    Kind("division", _division, (
        "What is {n} divided by {d}?", "Compute {n} / {d}.", "Divide {n} by {d}.",
        "{n} marbles are shared equally among {d} children. How many does each child get?",
        "How many times does {d} go into {n}?", "What is the quotient of {n} and {d}?")),
    Kind("percent", _percent, (
        "What is {p}% of {n}?", "Compute {p} percent of {n}.", "Find {p}% of {n}.",
        "A price of {n} dollars is raised by {p}%. By how many dollars does it rise?",
        "What is {p} per cent of {n}?", "Take {p}% of {n}. What is the result?")),
    Kind("difference_of_products", _difference_of_products, (
        "What is {a} times {b} minus {c} times {d}?", "Compute {a}*{b} - {c}*{d}.",
        "A crate holds {b} bottles and {a} crates arrive; {c} boxes of {d} bottles leave. How many bottles "
        "are left?")),
)}
HELD_OUT_KINDS = ("difference_of_products",)
HELD_OUT_PHRASINGS = 2  # of each training kind's phrasings, the last two are held out


def phrasings(kind: Kind, split: str) -> tuple[str, ...]:
    """The phrasings of ``kind`` that ``split`` uses."""
    if kind.name in HELD_OUT_KINDS:
        return kind.phrasings if split == "test" else ()
    return kind.phrasings[-HELD_OUT_PHRASINGS:] if split == "test" else kind.phrasings[:-HELD_OUT_PHRASINGS]


def calculation_problems(n: int, split: str = "train", seed: int = 0) -> list[Problem]:
    """``n`` distinct problems of ``split``, the kinds taking turns. Each Problem's ``id`` names
    its kind, phrasing and expression (``calc-<kind>-<phrasing>-<expression>``)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    kinds = [k for k in KINDS.values() if phrasings(k, split)]
    rng = random.Random(f"m2flow-calculation:{seed}:{split}")
    seen: set[str] = set()
    out: list[Problem] = []
    while len(out) < n:
        kind = kinds[len(out) % len(kinds)]
        for _ in range(1000):
            fields, expression, answer = kind.make(rng)
            index = rng.randrange(len(phrasings(kind, split)))
            question = phrasings(kind, split)[index].format(**fields)
            if question not in seen:
                break
        else:
            raise ValueError(f"{kind.name}: too few distinct {split} problems for n={n}")
        seen.add(question)
        place = kind.phrasings.index(phrasings(kind, split)[index])
        out.append(Problem(question, answer, id=f"calc-{kind.name}-{place}-{expression.replace(' ', '')}"))
    return out


def expression_of(problem: Problem) -> str:
    """The expression a problem asks for (from its id), as the calculator tool takes it."""
    return problem.id.split("-", 3)[3]
