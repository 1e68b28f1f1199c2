"""A sum tree over non-negative values: set values by index and draw indices in proportion to
them, both in O(log n) numpy operations for a whole batch (prioritised replay, Schaul et al.
2016)."""

from __future__ import annotations

import numpy as np


class SumTree:
    def __init__(self, size: int):
        self.size = size
        self.leaves = 1 << max(0, (size - 1).bit_length())  # a power of two >= size
        self.tree = np.zeros(2 * self.leaves, np.float64)  # node i's children: 2i and 2i + 1; root 1

    @property
    def total(self) -> float:
        return float(self.tree[1])

    def values(self) -> np.ndarray:
        return self.tree[self.leaves:self.leaves + self.size]

    def set(self, index: np.ndarray, values: np.ndarray) -> None:
        """``values`` (>= 0) at ``index``; every sum above them made again."""
        node = self.leaves + np.asarray(index)
        self.tree[node] = values
        node = np.unique(node // 2)
        while node[0] >= 1:
            self.tree[node] = self.tree[2 * node] + self.tree[2 * node + 1]
            if node[0] == 1:
                break
            node = np.unique(node // 2)

    def find(self, mass: np.ndarray) -> np.ndarray:
        """For each ``mass`` in [0, total): the index whose value's span holds it."""
        node = np.ones(len(mass), np.int64)
        mass = np.array(mass, np.float64)
        while node[0] < self.leaves:
            left = self.tree[2 * node]
            right = mass >= left
            mass = np.where(right, mass - left, mass)
            node = 2 * node + right
        return node - self.leaves
