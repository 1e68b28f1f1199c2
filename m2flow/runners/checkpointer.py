"""A run's checkpoints, as the runner's part ``Checkpointer``: what it writes (every stateful
component's state on all its ranks, the metrics' running values, the flow's own state, the
config) and how a run continues from one, on the same placement or another (the states spread
over the ranks there are now). The file itself (one safetensors file, written atomically, and
which of a directory's is the latest complete one) is ``runners/checkpoint.py``'s.

It uses of the runner: its config, flow, workflow, groups (and whether two are fused), metrics,
streams, ``worker_args`` and the flow's own state (``extra_state``/``load_extra_state``); and
the run's ``Progress`` (``runners/status.py``), whose ``last_checkpoint`` it sets.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

from omegaconf import DictConfig, OmegaConf

from m2flow.config.validate import ConfigError
from m2flow.flow import Workflow
from m2flow.runners import checkpoint as checkpoints
from m2flow.runners.flow import Flow
from m2flow.runners.metrics import RunLog
from m2flow.runners.status import Progress
from m2flow.runners.streams import Streams
from m2flow.runtime import WorkerGroup
from m2flow.runtime.group import wait


class Owner(Protocol):
    """What a ``Checkpointer`` uses of the runner that owns it."""

    cfg: DictConfig
    flow: Flow
    workflow: Workflow
    groups: dict[str, WorkerGroup]
    fused: bool
    metrics: Any  # the flow's metrics: row, state_dict, load_state_dict, x_name
    streams: Streams
    total: int
    progress: Progress

    def worker_args(self, component: str, take_turns: bool) -> tuple: ...
    def extra_state(self) -> dict[str, Any]: ...
    def load_extra_state(self, state: dict[str, Any]) -> None: ...


class Checkpointer:
    def __init__(self, runner: Owner):
        self.runner = runner
        self.at = time.perf_counter()  # when the last was written (or the loop began): ``checkpoint_every_min``
        self.rolling: Path | None = None  # the last, if taken by time: the next one replaces it

    def save(self, done: int, log: RunLog, rolling: bool = False) -> Path:
        """Every stateful component's state (all ranks), the metrics' running values and the
        flow's own (data order), so that a resumed run continues exactly as an uninterrupted one,
        ``done`` updates in. A ``rolling`` one (taken by time) is deleted once a newer
        checkpoint of this run is written."""
        run = self.runner
        owned = {c: g for c, g in self.stateful().items() if g is not None}
        states = dict(zip(owned, wait(*(g.state() for g in owned.values()))))
        path = checkpoints.directory(run.cfg.runner.out_dir) / f"{run.metrics.x_name}_{done:06d}{checkpoints.SUFFIX}"
        checkpoints.save(path, {"done": done, "logged_to": log.history[-1][log.x] if log.history else 0,
                                "metrics": run.metrics.state_dict(), "extra": run.extra_state(),
                                "states": {c: states.get(c) for c in self.stateful()},
                                "config": OmegaConf.to_container(run.cfg, resolve=True)})
        self.at = time.perf_counter()
        if self.rolling not in (None, path):
            self.rolling.unlink(missing_ok=True)
        run.progress.last_checkpoint, self.rolling = path, (path if rolling else None)
        run.progress.in_a_row = 0
        return path

    def origin(self, log: RunLog) -> str | None:
        """``runner.resume``: a checkpoint file, or ``auto``: the latest complete one in this
        run's directory (none: the run starts afresh)."""
        r = self.runner.cfg.runner
        if r.resume != "auto":
            return r.resume
        found = checkpoints.latest(checkpoints.directory(r.out_dir), log=log.note)
        log.note(f"resume=auto: continuing from {found}" if found else
                 f"resume=auto: no complete checkpoint in {checkpoints.directory(r.out_dir)}; starting afresh")
        return None if found is None else str(found)

    def load(self, path: str, log: RunLog) -> int:
        """Loads a checkpoint written by ``save`` into every group; returns the first update to run."""
        run = self.runner
        ckpt = checkpoints.load(path)
        written = OmegaConf.create(ckpt["config"])
        for key in run.flow.resume_keys:  # what its states' shapes (or meaning) depend on
            then, now = OmegaConf.select(written, key), OmegaConf.select(run.cfg, key)
            if OmegaConf.is_config(then):
                then, now = OmegaConf.to_container(then), OmegaConf.to_container(now)
            if then != now:
                raise ConfigError("runner.resume", f"checkpoint {path} was written with {key}={then}, this run has "
                                                   f"{key}={now}: resume with the same {key}")
        x = run.metrics.x_name
        if ckpt["done"] > run.total:
            length = run.flow.length_key
            raise ConfigError(length, f"checkpoint {path} is {ckpt['done']} {x}s in, past the {run.total} "
                                      f"of this run: raise {length} to continue it")
        if ckpt["done"] == run.total:
            log.note(f"checkpoint {path} is {run.total} of {run.total} {x}s in: nothing left to train")
        states, moved = {}, []
        for c, group in self.stateful().items():
            if c not in ckpt["states"]:
                raise ConfigError("runner.resume", f"checkpoint {path} has no {c} state (a run with algorithm.name="
                                                   f"{ckpt['config']['algorithm']['name']}): resume with the same "
                                                   "algorithm")
            saved = ckpt["states"][c]
            if group is None or saved is None:  # fused into its host, now or then: the host's state serves
                if (group is None) != (saved is None):
                    moved.append(f"{c} {'fused' if saved is None else 'in processes of its own'} then, "
                                 f"{'fused' if group is None else 'in processes of its own'} now")
                continue
            try:
                states[c] = run.flow.workers[c].reshard(saved, group.world_size, *run.worker_args(c, False))
            except ValueError as e:
                raise ConfigError("runner.resume", f"checkpoint {path}'s {c} state does not fit this placement "
                                                   f"({e})") from None
            if len(saved) != group.world_size:
                moved.append(f"{c} {len(saved)} rank(s) then, {group.world_size} now")
        if moved:
            log.note(f"checkpoint {path} was written on another placement ({'; '.join(moved)}): its states are "
                     "spread over this one's ranks")
        wait(*(run.groups[c].load_state(state) for c, state in states.items()))
        run.streams.synced = None  # the loaded weights go out before the first step, whatever was synced before
        run.metrics.load_state_dict(ckpt["metrics"])
        run.load_extra_state(ckpt["extra"])
        log.history = [row for row in log.read_csv() if row[log.x] <= ckpt["logged_to"]]
        return ckpt["done"]

    def stateful(self) -> dict[str, WorkerGroup | None]:
        """Stateful component -> its group; None for one fused into another's processes."""
        run = self.runner
        fused = run.workflow.fusable[1] if run.fused else None
        return {c: (None if c == fused else run.groups[c]) for c in run.flow.stateful if c in run.groups}
