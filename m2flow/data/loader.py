"""A batch iterator over prompts with a resumable position: a run restored from a
checkpoint sees exactly the batches it would have seen had it not stopped."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

T = TypeVar("T")


class PromptLoader(Generic[T]):
    """Endless batches of ``batch_size`` items, epoch after epoch. Each epoch's order is a
    permutation drawn from (seed, epoch), so it needs no saved state beyond the position.
    With ``drop_last`` (the default) every batch is full: the few items left at the end of
    an epoch wait for the next permutation, as RL steps want a fixed number of prompts."""

    def __init__(self, items: Sequence[T], batch_size: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True):
        if not 0 < batch_size <= len(items):
            raise ValueError(f"batch_size {batch_size} must be in 1..{len(items)} (the number of items)")
        self.items, self.batch_size, self.shuffle, self.drop_last = items, batch_size, shuffle, drop_last
        self.seed = seed
        self.epoch, self.position = 0, 0  # position: items of this epoch already handed out
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.items))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.items))

    def __iter__(self) -> Iterator[list[T]]:
        return self

    def __next__(self) -> list[T]:
        left = len(self.items) - self.position
        if left == 0 or (self.drop_last and left < self.batch_size):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        idx = self._order[self.position:self.position + self.batch_size]
        self.position += len(idx)
        return [self.items[i] for i in idx]

    def __len__(self) -> int:
        """Batches per epoch."""
        n, b = len(self.items), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_items": len(self.items)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_items"] != len(self.items):
            raise ValueError(f"state is for {state['num_items']} items, this loader has {len(self.items)}")
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
