"""The receiving side of the actor's weight pushes, for every worker whose model follows the
actor's (embodied rollout, LM rollout, inference): taking pushes in order until a version is
in (``pull_weights``), or every push that has arrived, without waiting (``take_newer``:
in-flight weight updates). A subclass says how one push is loaded (``_receive``).

``WeightReceiver`` is that side for a worker holding a language model (LM rollout,
inference): the actor sends its weights in buckets (``push_weights``), tagged with a
version; a receiver loads each bucket as it arrives, so no process holds a second full copy
of the model."""

from __future__ import annotations

import time

import torch

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


class WeightReceiver(WeightFollower):
    """A worker holding a language model that follows the actor's weights, pushed in buckets."""

    def _receive_model(self) -> torch.nn.Module:
        raise NotImplementedError

    def _load_bucket(self, tensors: dict[str, torch.Tensor]) -> None:
        state = self._receive_model().state_dict()
        with torch.no_grad():
            for name, t in tensors.items():
                state[name].copy_(t)  # in place: tied weights stay tied

    def _receive(self, actor_group: str) -> int:
        """One push: its buckets until the last (they follow each other at once)."""
        while True:
            message = self.broadcast(None, (actor_group, 0), self.group)
            self._load_bucket(message["tensors"])
            if message["last"]:
                self.version = message["version"]
                self._loaded(self.version)
                return self.version

    def _loaded(self, version: int) -> None:
        """Called once a push's weights are all in."""

    def weights_hash(self) -> str:
        from m2flow.engines.weights import weights_hash

        return weights_hash(self._receive_model())
