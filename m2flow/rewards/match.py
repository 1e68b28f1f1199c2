"""Rewards for short text answers (a name, a year): the final answer, normalised, equal to the
reference. String work only: they run in the scorer's caller (``in_process``)."""

from __future__ import annotations

import re
import string

from m2flow.rewards.math import in_process, last_boxed, reference_answer

_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize(text: str) -> str:
    """Lower case, without punctuation, articles or repeated spaces (SQuAD's exact match)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in string.punctuation)
    return " ".join(_ARTICLES.sub(" ", text).split())


def final_text(completion: str) -> str:
    """What a completion answers: its last ``\\boxed{}``, or else its last non-empty line."""
    boxed = last_boxed(completion)
    if boxed:
        return boxed
    lines = [line for line in completion.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


@in_process
def exact_match(completion: str, answer: str) -> float:
    """1.0 when the completion's final answer, normalised, is the reference's; else 0.0."""
    return float(normalize(final_text(completion)) == normalize(reference_answer(answer)) != "")
