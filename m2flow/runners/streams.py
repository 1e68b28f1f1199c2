"""A run's weight sync and its data streams: each step trains on one stream (the data the
flow's ``launch`` makes), launched at its step or ahead of it while earlier steps train, up to
the plan's run-ahead (``Plan.run_ahead``, ``runner.max_staleness``); the trainer's weights go
to the flow's receivers before a stream that needs them.

The runner owns one ``Streams`` per start of its groups (a restart begins anew) and asks it
for the stream of each step (``next``); the flow's ``launch`` reads ``synced`` (the version
its receivers hold at the least)."""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable

from m2flow.runtime import WorkerGroup
from m2flow.runtime.group import GroupHandle, wait
from m2flow.workers.reports import WeightSync


class Streams:
    def __init__(self, trainer: WorkerGroup, receivers: list[WorkerGroup], senders: list[int] | None,
                 in_flight: bool, launch: Callable[[int, int], dict[str, GroupHandle]], updates: int = 0,
                 launched: int = 0):
        """``trainer`` sends its weights from ranks ``senders`` (None: every rank) to every rank
        of each of ``receivers``; ``in_flight``: every receiver takes the trainer's pushes itself
        (in-flight weight updates), so a stream ahead needs only the push; ``launch(key,
        trained_by)`` starts one stream's calls; ``updates``: the version of the trainer's
        weights now (a resumed run's); ``launched``: the streams launched before (by the run's
        earlier groups: keys are never used twice)."""
        self.trainer, self.receivers, self.senders = trainer, receivers, senders
        self.in_flight, self.launch = in_flight, launch
        self.updates = updates  # steps that train (each changes the weights a sync sends)
        self.synced: int | None = None  # ``updates`` at the last weight sync (None: never synced)
        self.launched = launched  # data streams launched: each is keyed by its number
        # streams launched ahead of their step: key, calls, the sync started before them (or None)
        self.ahead: deque[tuple[int, dict[str, GroupHandle], list[GroupHandle] | None]] = deque()

    def sync_weights(self) -> WeightSync:
        """The trainer sends its weights, tagged with their version, to every rank of each
        receiver; skipped when they have not changed since the last sync. Only receivers are
        sent to: a message nobody takes would pin the sender's shared-memory segment."""
        start = time.perf_counter()
        pending = self.send_weights()
        if pending is None:
            return WeightSync()
        return dataclasses.replace(self.synced_report(pending), weight_sync_s=time.perf_counter() - start)

    def send_weights(self, pull: bool = True) -> list[GroupHandle] | None:
        """Starts a sync without waiting for it: the trainer's push (the weights of version
        ``updates``) into every receiver's mailbox and, with ``pull``, each receiver's pull,
        which takes pushes in order until it has that version (without: the receivers take
        them themselves). None when the weights have not changed since the last sync, or when
        nothing receives them (a supervised flow)."""
        if self.synced == self.updates or not self.receivers:
            self.synced = self.updates
            return None
        self.synced = self.updates
        return [self.trainer.call("push_weights", [g.name for g in self.receivers], ranks=self.senders),
                *(g.pull_weights(self.trainer.name, self.updates) for g in self.receivers if pull)]

    @staticmethod
    def synced_report(pending: list[GroupHandle] | None) -> WeightSync:
        """Waits for a sync ``send_weights`` started; the trainer's report of its push (its
        first sender's)."""
        if pending is None:
            return WeightSync()
        (pushed, *_), *_ = wait(*pending)
        return pushed or WeightSync()

    def next(self, ahead: int) -> tuple[int, dict[str, GroupHandle], WeightSync]:
        """This step's data stream (its key, its calls, the sync report before it): launched
        ahead by an earlier step, or now after a weight sync. Then streams are launched until
        ``ahead`` of them are in flight behind this one, each once the last one launched is
        made, after a sync of the weights this step starts from if they changed; or, with
        ``in_flight`` updates, at once, after only the trainer's push (its report comes with the
        step that trains on that stream). Launched at step i with ``ahead = k``, stream i + k's
        data is at most k versions old when it is trained on."""
        if not self.ahead:
            sync, (key, calls) = self.sync_weights(), self._launch(self.updates)
        else:
            key, calls, pending = self.ahead.popleft()
            sync = self.synced_report(pending)
        while len(self.ahead) < ahead:
            pending = None
            if self.in_flight:  # every receiver takes pushes itself
                pending = self.send_weights(pull=False)
            else:
                # Ray runs a threaded actor's calls in no guaranteed order: a stream's calls
                # are made once the last stream's are done (the same data and the same state
                # per stream, run after run), and a pull only then.
                wait(*(self.ahead[-1][1] if self.ahead else calls).values())
                if self.synced != self.updates:
                    sync = self.sync_weights()
            self.ahead.append((*self._launch(self.updates + len(self.ahead) + 1), pending))
        self.updates += 1  # the trainer trains on this stream: the next sync has new weights to send
        return key, calls, sync

    def _launch(self, trained_by: int) -> tuple[int, dict[str, GroupHandle]]:
        self.launched += 1
        return self.launched, self.launch(self.launched, trained_by)

    def wait_ahead(self) -> None:
        """Blocks until the streams launched ahead (if any) are made: what ``next(ahead=k)``
        leaves running when its step returns. The next steps train on them."""
        for _, calls, pending in self.ahead:
            self.synced_report(pending)
            wait(*calls.values())
