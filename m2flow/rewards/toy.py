"""Toy rewards that a randomly initialised model can learn in a few steps: for tests and demos
of the reasoning flow, where real reasoning is out of reach."""

from __future__ import annotations

from m2flow.rewards.math import in_process


@in_process
def digit_share(completion: str, answer: str) -> float:
    """The share of the completion's characters that are digits (0 for an empty one)."""
    return sum(c.isdigit() for c in completion) / len(completion) if completion else 0.0
