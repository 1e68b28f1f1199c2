"""Running statistics for observation normalisation and reward scaling."""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium.wrappers.utils import RunningMeanStd as _GymRunningMeanStd


class RunningMeanStd(_GymRunningMeanStd):
    """Mean, variance and count of a stream of batches (the parallel Welford update).

    gymnasium's class, with the same maths as SB3's VecNormalize (the count starts at
    ``epsilon`` = 1e-4 so the first update is not a division by zero), plus a state dict
    so that checkpoints restore the statistics exactly.
    """

    def __init__(self, shape: tuple[int, ...] = (), epsilon: float = 1e-4) -> None:
        super().__init__(epsilon=epsilon, shape=shape, dtype=np.float64)

    def update(self, batch: np.ndarray) -> None:
        """Fold in a batch of samples, stacked along axis 0."""
        batch = np.asarray(batch, dtype=np.float64)
        n = batch.shape[0]
        if n == 0:  # no env stepped (every episode of a GRPO window over): nothing to fold in
            return
        # The same moments as np.mean/np.var, at about half the cost on the tiny batches of
        # one env step, where numpy's Python-level wrappers dominate.
        batch_mean = batch.sum(axis=0) / n
        centred = batch - batch_mean
        self.update_from_moments(batch_mean, (centred * centred).sum(axis=0) / n, n)

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean.copy(), "var": self.var.copy(), "count": float(self.count)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mean = np.asarray(state["mean"], dtype=np.float64)
        if mean.shape != self.mean.shape:
            raise ValueError(f"running-stat shape {mean.shape} does not match {self.mean.shape}")
        self.mean = mean.copy()
        self.var = np.asarray(state["var"], dtype=np.float64).copy()
        self.count = float(state["count"])
