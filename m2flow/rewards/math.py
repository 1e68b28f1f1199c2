"""Rewards for math answers. Each reward is ``fn(completion, answer) -> float``.

``math_reward`` compares the completion's final answer with the reference through
math-verify (so ``\\boxed{1/2}`` matches ``0.5``); math-verify times itself out with
``signal.alarm``, which works only in a process's main thread, so the scorer runs it in a
worker process. Rewards marked ``in_process`` are pure string work and run in place.
"""

from __future__ import annotations

import re
from collections.abc import Callable

RewardFn = Callable[[str, str], float]

# A comma is a thousands separator only between groups of three digits ("1,234"); "2,3" is two numbers.
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d)|-?\d+(?:\.\d+)?|-?\.\d+")
_GROUPED = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def in_process(fn: RewardFn) -> RewardFn:
    """Marks a reward safe to call in any thread of the caller's process (no signals, no
    heavy imports), so the scorer skips the worker process for it."""
    fn.in_process = True  # type: ignore[attr-defined]
    return fn


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None
    if there is none or it is left open."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def last_number(text: str) -> str | None:
    """The last number in the text, thousands separators dropped ("1,234.5" -> "1234.5")."""
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def final_answer(completion: str) -> str | None:
    """What a completion answers: its last ``\\boxed{}``, or else (none, or an empty one, as
    small models write when told to box the answer) its last number."""
    return last_boxed(completion) or last_number(completion)


def reference_answer(answer: str) -> str:
    """A reference may be a bare answer ("72", "\\frac{1}{2}") or a whole solution with a
    ``\\boxed{}``; never cut it to its last number ("1/2" is not "2")."""
    boxed = last_boxed(answer)
    return (boxed if boxed is not None else answer).strip()


def _plain(number: str) -> str:
    """A number's text without its thousands separators ("1,000", "1{,}000", "1\\,000"); any
    other comma stays, so "2,3" is no number."""
    number = number.strip().replace("{,}", ",").replace("\\,", ",")
    return number.replace(",", "") if _GROUPED.fullmatch(number) else number


def _same_number(a: str, b: str) -> bool:
    try:
        return float(_plain(a)) == float(_plain(b))
    except ValueError:
        return False


def math_reward(completion: str, answer: str, timeout_seconds: int = 5) -> float:
    """1.0 if the completion's final answer equals the reference mathematically, else 0.0."""
    pred, gold = final_answer(completion), reference_answer(answer)
    if pred is None:
        return 0.0
    if pred == gold or _same_number(pred, gold):  # most answers: no sympy needed
        return 1.0
    from math_verify import parse, verify

    # Wrapping both in \boxed{} makes math-verify take them whole, as LaTeX or plain math.
    gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=timeout_seconds)
    pred_parsed = parse(f"\\boxed{{{pred}}}", parsing_timeout=timeout_seconds)
    if not gold_parsed or not pred_parsed:
        return 0.0
    return float(verify(gold_parsed, pred_parsed, timeout_seconds=timeout_seconds))


@in_process
def last_number_reward(completion: str, answer: str) -> float:
    """1.0 if the completion's last number equals the reference number, else 0.0: the peer
    benchmark's reward (benchmarks/reasoning_vs_trl.py), string work only."""
    pred = last_number(completion)
    return float(pred is not None and (pred == answer.strip() or _same_number(pred, answer)))


@in_process
def format_reward(completion: str, answer: str) -> float:
    """1.0 if the completion states its answer in a closed, non-empty ``\\boxed{}``."""
    return float(bool(last_boxed(completion)))


def _import_math_verify() -> None:
    import math_verify  # noqa: F401


math_reward.warmup = _import_math_verify  # type: ignore[attr-defined]  # the scorer's worker imports sympy up front
