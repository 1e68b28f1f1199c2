"""The receiving side of the actor's weight pushes, for every worker whose model follows the
actor's (embodied rollout, LM rollout, inference): taking pushes in order until a version is
in (``pull_weights``), or every push that has arrived, without waiting (``take_newer``:
in-flight weight updates). A subclass says how one push is loaded (``_receive``)."""

from __future__ import annotations

import time

from m2flow.runtime import Worker


class WeightFollower(Worker):
    version: int  # of the weights held

    def _receive(self, actor_group: str) -> int:
        """Loads one push of the actor's (waiting for it); its version."""
        raise NotImplementedError

    def pull_weights(self, actor_group: str, version: int | None = None) -> int:
        """Takes the actor's next push; returns the version held. With ``version``, pushes are
        taken until that version is in (an older one that in-flight updates left untaken is
        loaded and superseded). At least one push is taken: a resumed run may send an older
        version than the one held."""
        while True:
            got = self._receive(actor_group)
            if version is None or got >= version:
                return got

    def take_newer(self, actor_group: str) -> list[tuple[int, float]]:
        """Loads every push of the actor's that has arrived, in order, without waiting for one;
        the (version, wall time) of each, once it was in."""
        taken = []
        while self.broadcast_ready((actor_group, 0)):
            taken.append((self._receive(actor_group), time.time()))
        return taken
