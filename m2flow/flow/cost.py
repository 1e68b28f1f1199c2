"""A profile (measured costs, as a JSON file) and the cost and memory model fitted from it.

A profile holds points: a component's phase (``work``: a link of the makers' chain on one
chunk; ``train``/``update``: the trainer; ``sync``: the weight broadcast) took ``seconds`` on
``items`` items over ``devices`` devices. It also holds each component's switch cost (taking
the devices from another component), its peak memory, and the hardware it came from.

The model, per component and phase, is the best non-negative fit of

    seconds = a + b * items / devices + c * log2(devices) + e * items * log2(devices) / devices

(a fixed cost per call; work shared out over the devices; a data-parallel cost per call that
grows with the ranks, such as an all-reduce; and work shared out less well the more devices
share it, such as a process's threads over CPU slots), over the subsets of those terms, fewest
first, so that a component measured at one device count is not given a device effect it was
never seen to have; among as many terms, those without ``e`` first, so that it is taken only
where the points show that the device effect grows with the items. (SmolLM2's actor on two
slots trains about 1.3x as fast as on one, not 2x; read as a fixed cost per call, that made a
step cut into many small chunks look far slower than it is.) Across nodes the ``c`` term is
multiplied by ``internode`` (the ratio of intra- to inter-node bandwidth).

The trainer's ``train`` items are the rows it forwarded: a reasoning trainer skips the rows
whose gradient is zero (a group whose samples all got the same reward), and how many it skips
follows the step's rewards (SmolLM2's actor on the arithmetic preset, on two CPU slots, took
13.8 s for a step of 32 rows forwarded and 0.1 s for one of none). Counted per row received,
two probes that happened to skip different shares could give costs on one and on two devices
that contradict each other; per row forwarded they agree, and a step is predicted at the
share the profile saw (``Profile.trained_share``). It skips whole groups (a prompt's samples),
so the rows it forwards vary from step to step: a step is predicted over steps whose rows are
the quantiles of the binomial count of groups forwarded at that share (``step_scales``), as a
stream ahead absorbs a long update only as far as it is ahead.

``Profile.contention``: how much slower each component works while another process computes
beside it on the node (a fraction; a CPU profile of a flow that may run ahead measures it, see
``runners.probes`` and ``flow.hidden_costs``); the simulator slows overlapping tasks by it. A
profile without it (one of an earlier version, or of a GPU node) leaves it out: every task is
priced as if it ran alone.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import os
import platform
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from m2flow.runtime.files import write_text

PHASES = ("work", "hop", "train", "update", "sync")


class ProfileError(ValueError):
    """A file that holds no profile."""


@dataclass(frozen=True)
class Point:
    component: str
    phase: str
    items: float
    devices: int
    seconds: float


@dataclass
class Profile:
    key: str  # what the profile is of: the preset and the config values that change costs
    hardware: dict[str, Any]
    points: list[Point] = field(default_factory=list)
    switch_s: dict[str, float] = field(default_factory=dict)
    hop_s: float = 0.0  # a message between two processes of the chain
    memory_mb: dict[str, float] = field(default_factory=dict)  # peak per device, per component
    device_memory_mb: float | None = None
    profiling_s: float = 0.0
    runs: list[dict[str, Any]] = field(default_factory=list)  # what was run to measure it
    config: dict[str, Any] = field(default_factory=dict)  # the resolved config it was measured with
    # The share of its rows the trainer forwarded over the probes' timed updates (a reasoning
    # trainer skips the rows of zero gradient: how many follows the rewards): the train points
    # are per row forwarded, and a step is predicted at this share.
    trained_share: float = 1.0
    # Per component: the fraction by which it works slower while another process computes
    # beside it on the node (measured where a probe ran the split components at once).
    contention: dict[str, float] = field(default_factory=dict)

    def save(self, path: str | Path) -> Path:
        """Writes the profile whole (a crash leaves the old file or none, never a part)."""
        return write_text(path, json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """``ProfileError`` if ``path`` holds no profile (not JSON, or not one ``save`` wrote)."""
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (ValueError, TypeError, KeyError, AttributeError) as e:  # json.JSONDecodeError is a ValueError
            raise ProfileError(f"{path} holds no profile ({type(e).__name__}: {' '.join(str(e).split())})") from None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        """A profile as ``save`` wrote it; keys this version does not know are left out."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known} | {"points": [Point(**p) for p in data["points"]]})

    def matches(self, key: str, hardware: dict[str, Any]) -> bool:
        return self.key == key and self.hardware == hardware


def hardware() -> dict[str, Any]:
    """What a profile's numbers depend on: the processor, its cores, the GPUs and torch."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "gpus": gpus, "torch": torch.__version__.split("+")[0]}


def profile_key(preset: str, values: dict[str, Any]) -> str:
    """A short key for a preset and the config values its costs depend on."""
    blob = json.dumps(values, sort_keys=True, default=str)
    return f"{preset}:{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


# -- the model ------------------------------------------------------------------------------

def _features(items: float, devices: int) -> list[float]:
    return [1.0, items / devices, math.log2(devices), items * math.log2(devices) / devices]


PER_ITEM_DEVICE_TERM = 3  # e's index: tried after the subsets of as many terms without it


@dataclass
class Fit:
    coef: tuple[float, float, float, float]  # a, b, c, e (the order of _features)
    points: int
    loo_error: float | None  # median relative leave-one-out error (None: too few points)

    def __call__(self, items: float, devices: int, internode: float = 1.0) -> float:
        a, b, c, e = self.coef
        d = max(devices, 1)
        return a + b * items / d + e * items * math.log2(d) / d + c * math.log2(d) * internode


def _nnls(rows: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The least-squares fit with non-negative coefficients, over the subsets of the terms
    (fewest terms first, so a term the points cannot tell apart stays zero; among as many
    terms, those without the per-item device term first)."""
    best, best_err = np.zeros(rows.shape[1]), math.inf
    n = rows.shape[1]
    for k in range(1, n + 1):
        for cols in sorted(itertools.combinations(range(n), k), key=lambda c: PER_ITEM_DEVICE_TERM in c):
            sub = rows[:, cols]
            if np.linalg.matrix_rank(sub) < k:
                continue
            coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if (coef < 0).any():
                continue
            err = float(np.sum((sub @ coef - y) ** 2))
            if math.isinf(best_err) or err < best_err - max(best_err * 1e-9, 1e-18):  # exact fits: the first
                best_err, best = err, np.zeros(n)
                best[list(cols)] = coef
    return best


def fit(points: list[Point]) -> Fit:
    rows = np.array([_features(p.items, p.devices) for p in points])
    y = np.array([p.seconds for p in points])
    # Relative error matters (a 10 ms call and a 10 s one alike): weight each point by 1/y.
    w = 1.0 / np.maximum(y, 1e-6)
    coef = _nnls(rows * w[:, None], y * w)
    loo = None
    if len(points) >= 3:
        errs = []
        for i in range(len(points)):
            keep = [j for j in range(len(points)) if j != i]
            c = _nnls(rows[keep] * w[keep, None], y[keep] * w[keep])
            errs.append(abs(float(rows[i] @ c) - y[i]) / max(y[i], 1e-9))
        loo = float(np.median(errs))
    return Fit(tuple(float(x) for x in coef), len(points), loo)


class CostModel:
    """Seconds per (component, phase, items, devices), switch costs and memory, from a profile."""

    def __init__(self, profile: Profile, internode: float = 1.0, devices_per_node: int | None = None):
        self.profile = profile
        self.internode = internode
        self.devices_per_node = devices_per_node
        self.trained_share = profile.trained_share  # of the trainer's rows: its ``train`` items scale by it
        groups: dict[tuple[str, str], list[Point]] = {}
        for p in profile.points:
            groups.setdefault((p.component, p.phase), []).append(p)
        self.fits = {k: fit(v) for k, v in groups.items()}

    @property
    def switch_s(self) -> dict[str, float]:
        return self.profile.switch_s

    @property
    def contention(self) -> dict[str, float]:
        """The profile's contention, measured on one node: none for a plan over several
        (``devices_per_node``), whose components need not share one."""
        return {} if self.devices_per_node is not None else self.profile.contention

    def __call__(self, component: str, phase: str, items: float, devices: int) -> float:
        if phase == "hop":
            return self.profile.hop_s
        f = self.fits.get((component, phase))
        if f is None:
            return 0.0  # a phase the profile never saw take time (none measured)
        if phase == "train":
            items *= self.trained_share
        across = self.devices_per_node is not None and devices > self.devices_per_node
        return f(items, devices, self.internode if across else 1.0)

    def at_share(self, trained_share: float) -> CostModel:
        """The same model, the trainer forwarding ``trained_share`` of its rows (a probe's own)."""
        other = copy.copy(self)
        other.trained_share = trained_share
        return other

    def train_scales(self, groups: int, steps: int = 24) -> list[float]:
        """Per step, the trainer's rows over their mean (``step_scales``) where it skips rows a
        group at a time (``Shape.row_groups``) and skipped some while profiled; else none."""
        return step_scales(self.trained_share, groups, steps) if groups and 0 < self.trained_share < 1 else []

    def memory_mb(self, component: str) -> float:
        return self.profile.memory_mb.get(component, 0.0)

    def report(self) -> str:
        """Each fit, its points and its held-out error."""
        lines = [f"  {'component.phase':<18} {'a (s)':>9} {'b (s/item/dev)':>15} {'c (s/log2 dev)':>15} "
                 f"{'e (s/item/dev per log2 dev)':>28} {'points':>6} {'held-out err':>12}"]
        for (c, ph), f in sorted(self.fits.items()):
            err = "-" if f.loo_error is None else f"{f.loo_error:.1%}"
            lines.append(f"  {c + '.' + ph:<18} {f.coef[0]:9.4f} {f.coef[1]:15.6f} {f.coef[2]:15.4f} "
                         f"{f.coef[3]:28.6f} {f.points:>6} {err:>12}")
        return "\n".join(lines)

    def contention_report(self) -> str:
        """The slowdowns measured for components computing at once, if any."""
        slow = {c: x for c, x in self.contention.items() if x > 0}
        if not self.contention:
            return ""
        if not slow:
            return "  contention: none measured (components computing at once did not slow each other)"
        return ("  contention (slower while another process computes beside it): "
                + ", ".join(f"{c} {x:+.0%}" for c, x in sorted(slow.items())))

    def share_report(self) -> str:
        """How much of its batch the trainer is predicted to forward, where not all of it."""
        if self.trained_share >= 1.0:
            return ""
        return (f"  the trainer forwarded {self.trained_share:.0%} of its rows while profiled (rows of zero "
                f"gradient are skipped): its training is predicted at that share")

    def held_out_error(self) -> float | None:
        errs = [f.loo_error for f in self.fits.values() if f.loo_error is not None]
        return float(np.median(errs)) if errs else None


def step_scales(share: float, groups: int, steps: int) -> list[float]:
    """``steps`` steps' rows over their mean when each of ``groups`` groups of rows is forwarded
    with probability ``share``, independently: the binomial count's quantiles at ``steps``
    evenly spaced probabilities, in a fixed shuffled order (one plan, one prediction)."""
    cdf, total = [], 0.0
    for k in range(groups + 1):
        total += math.comb(groups, k) * share ** k * (1 - share) ** (groups - k)
        cdf.append(total)
    counts = [next((k for k, c in enumerate(cdf) if c >= (i + 0.5) / steps), groups) for i in range(steps)]
    np.random.default_rng(0).shuffle(counts)
    mean = sum(counts) / steps
    return [c / mean for c in counts] if mean > 0 else []


# -- from measured steps to points ----------------------------------------------------------

def trained_rows(shape, row: dict[str, Any]) -> float:
    """The rows the trainer forwarded in a step: its batch less the rows it skipped
    (``inert_rows``: a reasoning trainer's rows of zero gradient; none elsewhere)."""
    inert = row.get("inert_rows") or 0
    return float(shape.batch) - (inert if inert == inert else 0)  # NaN: none reported


def points_from_rows(shape, layout, rows: list[dict[str, Any]]) -> list[Point]:
    """A probe run's points: each component's busy time per step (the metrics' ``<c>_busy_s``,
    a rank's mean) cut into the tasks the simulator makes of that step (``simulate.step_tasks``).
    The trainer's ``train`` points count the rows it forwarded (``trained_rows``), so that
    probes whose steps skipped more or fewer rows give one cost per row."""
    out = []
    sizes = shape.items / max(1, min(shape.chunks, shape.items))
    chunks = max(1, min(shape.chunks, shape.items))
    for row in rows:
        for comp in shape.chain:
            devices = layout.count(comp)
            if comp in shape.batched:
                out.append(Point(comp, "work", shape.items, devices, row[f"{comp}_busy_s"] / shape.repeats))
            else:
                out.append(Point(comp, "work", sizes, devices, row[f"{comp}_busy_s"] / (shape.repeats * chunks)))
            other = shape.beside.get(comp)  # what it calls as it works, on a process of its own
            if other is not None and f"{other}_busy_s" in row:
                whole = comp in shape.batched
                out.append(Point(other, "work", shape.items if whole else sizes, layout.count(other),
                                 row[f"{other}_busy_s"] / (shape.repeats * (1 if whole else chunks))))
        t, devices = shape.trainer, layout.count(shape.trainer)
        trained = trained_rows(shape, row)
        if shape.trainer_streams:
            update = row.get(f"{t}_update_busy_s")
            if update is None:  # a profile of an earlier version: the update folded into the chunks' time
                out.append(Point(t, "train", trained / chunks, devices, row[f"{t}_busy_s"] / chunks))
            else:  # the chunks' forward and backward, and the step's update (the optimizer step) apart
                out.append(Point(t, "train", trained / chunks, devices, (row[f"{t}_busy_s"] - update) / chunks))
                out.append(Point(t, "update", shape.batch, devices, update))
        else:
            out.append(Point(t, "train", trained, devices, row[f"{t}_busy_s"]))
        if row["weight_sync_s"] > 0:
            out.append(Point(t, "sync", shape.batch, devices, row["weight_sync_s"]))
    return out


def calibrate(step_s: float, predict_with) -> float:
    """The value ``x >= 0`` for which ``predict_with(x)`` (a step time that does not fall as
    ``x`` grows) comes closest to the measured ``step_s``: a cost the busy times cannot show
    (a device hand-over, a message between processes), read off a whole step's time."""
    lo, hi = 0.0, max(step_s, 1e-6)
    if predict_with(lo) >= step_s:
        return 0.0
    while predict_with(hi) < step_s and hi < 1e6:
        hi *= 2
    if predict_with(hi) < step_s:
        return 0.0  # the cost does not move the prediction (nothing in the step pays it)
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predict_with(mid) < step_s else (lo, mid)
    return (lo + hi) / 2
