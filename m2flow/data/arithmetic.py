"""A built-in task: arithmetic word problems with graded difficulty, for demos and tests.

A problem is a start amount followed by operation sentences ("Mia buys 5 more apples."),
applied left to right; the answer is a non-negative integer. A level fixes the number of
operations, the operand range and the allowed operations (table ``LEVELS``).

Splits are disjoint by construction: each problem's arithmetic skeleton (``"7+5-3"``) is
hashed, and a fixed fraction of the hash space belongs to the held-out split whatever the
seed, so a held-out problem never shares its numbers and operations with a train problem,
not merely its wording. Generation is deterministic from (seed, split, level).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

from m2flow.data.problems import Problem


@dataclass(frozen=True)
class Level:
    steps: int  # operations after the start amount
    lo: int  # operand range for the start amount, + and -
    hi: int
    ops: str  # allowed operations, from "+-*/"; * and / use factors 2..9


LEVELS: dict[int, Level] = {
    1: Level(steps=1, lo=2, hi=20, ops="+-"),
    2: Level(steps=2, lo=2, hi=50, ops="+-"),
    3: Level(steps=2, lo=2, hi=100, ops="+-*"),
    4: Level(steps=3, lo=2, hi=100, ops="+-*/"),
    5: Level(steps=4, lo=10, hi=1000, ops="+-*/"),
}
SPLITS = ("train", "test")
HELD_OUT_BUCKETS = 5  # one skeleton in five is held out

NAMES = ("Mia", "Noah", "Ava", "Liam", "Zoe", "Omar", "Lena", "Ravi", "Emma", "Kai",
         "Sara", "Tom", "Yuki", "Ben", "Nina", "Leo", "Ines", "Sam", "Maya", "Jon")
ITEMS = ("apples", "marbles", "stickers", "coins", "books", "pencils", "cookies", "stamps",
         "cards", "shells")
SENTENCES = {
    "+": ("{name} buys {n} more {item}.", "{name} finds {n} more {item}.",
          "A friend gives {name} {n} more {item}."),
    "-": ("{name} gives {n} {item} to a friend.", "{name} loses {n} {item}.", "{name} sells {n} {item}."),
    "*": ("Then {name} gets {n} times as many {item} as before.",),
    "/": ("Then {name} splits the {item} into {n} equal groups and keeps one group.",),
}
FACTORS = range(2, 10)


def skeleton_split(skeleton: str) -> str:
    """The split a skeleton belongs to; sha256 rather than ``hash()``, which is salted per
    process."""
    bucket = int.from_bytes(hashlib.sha256(skeleton.encode()).digest()[:8], "little") % HELD_OUT_BUCKETS
    return "test" if bucket == 0 else "train"


def _steps(rng: random.Random, level: Level, value: int) -> tuple[int, list[tuple[str, int]]]:
    steps: list[tuple[str, int]] = []
    for _ in range(level.steps):
        # Only operations that keep the amount a non-negative integer.
        divisors = [f for f in FACTORS if value > 0 and value % f == 0]
        op = rng.choice([op for op in level.ops if (op != "-" or value > 0) and (op != "/" or divisors)])
        if op == "+":
            n = rng.randint(level.lo, level.hi)
        elif op == "-":
            n = rng.randint(min(level.lo, value), min(level.hi, value))
        elif op == "*":
            n = rng.choice(FACTORS)
        else:
            n = rng.choice(divisors)
        value = {"+": value + n, "-": value - n, "*": value * n, "/": value // n}[op]
        steps.append((op, n))
    return value, steps


def _problem(rng: random.Random, level: int) -> tuple[str, Problem]:
    start = rng.randint(LEVELS[level].lo, LEVELS[level].hi)
    answer, steps = _steps(rng, LEVELS[level], start)
    skeleton = str(start) + "".join(f"{op}{n}" for op, n in steps)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    sentences = [f"{name} has {start} {item}."]
    sentences += [rng.choice(SENTENCES[op]).format(name=name, n=n, item=item) for op, n in steps]
    sentences.append(f"How many {item} does {name} have now?")
    return skeleton, Problem(" ".join(sentences), str(answer), id=f"arith-{level}-{skeleton}", level=level)


def arithmetic_problems(n: int, levels: int | Sequence[int] = 1, split: str = "train", seed: int = 0) -> list[Problem]:
    """``n`` distinct problems of ``split`` ("train" or "test"); with several levels, problem
    i has level ``levels[i % len(levels)]``. The same arguments give the same problems."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    levels = [levels] if isinstance(levels, int) else list(levels)
    unknown = [lv for lv in levels if lv not in LEVELS]
    if unknown:
        raise ValueError(f"unknown levels {unknown}; known: {sorted(LEVELS)}")
    rngs = {lv: random.Random(f"m2flow-arith:{seed}:{split}:{lv}") for lv in levels}
    seen: set[str] = set()
    out: list[Problem] = []
    for i in range(n):
        lv = levels[i % len(levels)]
        for _ in range(10_000):
            skeleton, problem = _problem(rngs[lv], lv)
            if skeleton_split(skeleton) == split and problem.question not in seen:
                break
        else:
            raise ValueError(f"level {lv} has too few distinct {split} problems for n={n}")
        seen.add(problem.question)
        out.append(problem)
    return out
