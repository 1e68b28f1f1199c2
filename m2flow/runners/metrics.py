"""Per-update metrics: a progress bar, CSV, TensorBoard, and a learning curve at the end.

``RunLog`` writes the rows; each flow's metrics class (in the flow's own file) turns a step's
reports (``workers.reports``) into a row, with ``trained_stats``, ``component_times`` and
``Staleness`` from here, and checks the step's samples with a ``Ledger``.
"""

from __future__ import annotations

import csv
import math
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from m2flow.runtime.files import write_whole

if TYPE_CHECKING:
    from m2flow.workers.reports import Report, RolloutReport, SampleId, TrainReport


def _number(text: str) -> float:
    """A CSV cell as written: an int stays an int (a resumed run's rows read as they were)."""
    try:
        return int(text)
    except ValueError:
        return float(text)


class RunLog:
    """A run's rows: CSV (``metrics.csv``), TensorBoard scalars, a rich progress bar, and a
    curve of ``y`` against ``x`` (``learning_curve.png``) at the end; its notes on the console
    and, time-stamped, in ``log.txt``."""

    def __init__(self, out_dir: str | Path, total: float, x: str, y: str, progress: bool = True):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._csv = None  # metrics.csv, open for appending once written whole
        self.tb = None
        self.history = []
        self.x, self.y = x, y
        self.console = Console()
        self.tb = self._tensorboard(None)
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[stats]}"),
                                 TimeElapsedColumn(), console=self.console, disable=not progress)
        self.task = self.progress.add_task("train", total=total, stats="")
        self.progress.start()
        self.log_file = open(self.out_dir / "log.txt", "a")

    def note(self, text: str) -> None:
        self.console.print(text)
        self.write(text)

    def write(self, text: str) -> None:
        """To ``log.txt`` only (a worker's whole traceback: the console gets its summary)."""
        self.log_file.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")
        self.log_file.flush()

    @property
    def history(self) -> list[dict[str, float]]:
        """The rows so far; set (a resumed run's), the next row rewrites metrics.csv whole."""
        return self._history

    @history.setter
    def history(self, rows: list[dict[str, float]]) -> None:
        self._history = rows
        self._close_csv()
        if self.tb is not None:  # a run that starts (again): TensorBoard forgets what came after these rows
            self.tb.close()
            self.tb = self._tensorboard(int(rows[-1][self.x]) + 1 if rows else 0)

    def _tensorboard(self, purge_step: int | None) -> Any:
        """A writer of ``tensorboard/``; with ``purge_step``, readers drop the scalars an earlier
        writer logged at that step or later (a resumed or restarted run logs them again)."""
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(self.out_dir / "tensorboard"), purge_step=purge_step)

    def read_csv(self) -> list[dict[str, float]]:
        path = self.out_dir / "metrics.csv"
        if not path.exists():
            return []
        with open(path, newline="") as f:
            # A blank cell: a column the row did not have (a NaN is written "nan"). A row with
            # fewer cells than the header was cut short by a crash mid-write: dropped.
            return [{k: _number(v) for k, v in row.items() if v} for row in csv.DictReader(f)
                    if None not in row.values()]

    def record(self, row: dict[str, float], stats: str) -> dict[str, float]:
        """Appends ``row``: to metrics.csv, TensorBoard scalars at step ``row[x]``, progress bar."""
        self.history.append(row)
        self._scalars(row, row[self.x])
        if self._csv is not None and row.keys() <= set(self._csv[1].fieldnames):
            self._csv[1].writerow(row)  # a row appended: a long run's logging stays O(1) per row
            self._csv[0].flush()
        else:
            self._write_csv()
        self.progress.update(self.task, completed=row[self.x], stats=stats)
        return row

    def amend(self, row: dict[str, float], values: dict[str, float]) -> None:
        """Adds ``values`` to ``row``, one of the rows recorded (a deferred evaluation's):
        metrics.csv is written again, the values go to TensorBoard at the row's step."""
        row |= values
        self._scalars(values, row[self.x])
        self._write_csv()

    def _scalars(self, values: dict[str, float], step: float) -> None:
        """TensorBoard scalars at ``step``: every value but the x axis's own and NaNs."""
        for k, v in values.items():
            if k != self.x and not (isinstance(v, float) and math.isnan(v)):
                self.tb.add_scalar(k, v, step)

    def _write_csv(self) -> None:
        """The whole file (a new column, or rows set), then kept open to append to. Written
        beside and renamed over the old one: a crash or a full disk midway leaves the rows
        there were, which a resume reads back."""
        self._close_csv()
        keys = list(dict.fromkeys(k for row in self.history for k in row))

        def write(tmp: Path) -> None:
            with open(tmp, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=keys)
                writer.writeheader()
                writer.writerows(self.history)

        path = write_whole(self.out_dir / "metrics.csv", write)
        f = open(path, "a", newline="")
        self._csv = (f, csv.DictWriter(f, fieldnames=keys))

    def _close_csv(self) -> None:
        if self._csv is not None:
            self._csv[0].close()
            self._csv = None

    def close(self) -> Path | None:
        self.progress.stop()
        self.tb.close()
        self.log_file.close()
        self._close_csv()
        return self.plot()

    def plot(self) -> Path | None:
        points = [(r[self.x], r[self.y]) for r in self.history if not math.isnan(r.get(self.y, math.nan))]
        if not points:
            return None
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6, 4))  # fixed margins (inches: 0.85 left, 0.6 below, 0.4 above)
        fig.subplots_adjust(left=0.85 / 6, right=1 - 0.2 / 6, bottom=0.6 / 4, top=1 - 0.4 / 4)
        ax = fig.add_subplot()
        ax.plot(*zip(*points), marker="o" if len(points) < 30 else None)
        ax.set_xlabel(self.x.replace("_", " "))
        ax.set_ylabel(self.y.replace("_", " "))
        ax.set_title(self.out_dir.name)
        ax.grid(alpha=0.3)
        path = self.out_dir / "learning_curve.png"
        fig.savefig(path, dpi=100)
        return path


OLDEST = ("policy_lag",)  # the oldest data of any rank, not a mean over them
SHARES = ("loss",)  # each rank's share of the step's mean (LMTrainer.train_step): their mean is the step's


def across_ranks(ranks: list[dict[str, Any]], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The actor ranks' training statistics as one row: each number's mean over the ranks
    that report a finite one, weighted by the completion tokens each forwarded
    (``forwarded_tokens``; equal weights where the ranks do not report it). A rank that
    forwarded nothing (all its rows inert) reports nan statistics and weighs nothing; a
    value that is not a number, or that no rank has finite, is the first rank's that has it.
    The keys of ``OLDEST`` and any ``*_max`` are the largest any rank reports instead; those
    of ``SHARES`` the plain mean over every rank."""
    out: dict[str, Any] = {}
    weights = [float(r.get("forwarded_tokens", 1)) for r in ranks]
    keys = dict.fromkeys(k for r in ranks for k in r)  # in order: a rank that forwarded nothing lacks some
    for key in keys:
        if key in skip or key == "forwarded_tokens":
            continue
        if key in OLDEST or key.endswith("_max"):
            values = [r[key] for r in ranks if key in r]
            finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
            out[key] = max(finite) if finite else values[0]
            continue
        if key in SHARES:
            out[key] = sum(r[key] for r in ranks if key in r) / len(ranks)
            continue
        first = next(r[key] for r in ranks if key in r)
        numbers = [(r[key], w) for r, w in zip(ranks, weights)
                   if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool) and math.isfinite(r[key])]
        total = sum(w for _, w in numbers)
        if len({v for v, _ in numbers}) == 1:  # one rank, or the same on all (grad_norm): as it is, an int an int
            out[key] = numbers[0][0]
        else:
            out[key] = sum(v * w for v, w in numbers) / total if total else first
    return out


def trained_stats(trainer: list[TrainReport]) -> dict[str, Any]:
    """The trainer ranks' statistics as one row (``across_ranks``, each rank weighted by its
    ``forwarded_tokens`` where it reports them), with ``policy_lag``: the oldest data any
    rank trained on."""
    return across_ranks([{**r.stats, "policy_lag": r.policy_lag}
                         | ({} if r.forwarded_tokens is None else {"forwarded_tokens": r.forwarded_tokens})
                         for r in trainer])


def component_times(components: dict[str, list[Report]], memory: bool = False) -> dict[str, float]:
    """``<component>_busy_s`` and ``<component>_idle_s``: each component's seconds averaged
    over its ranks' reports; with ``memory``, ``<component>_peak_memory_mb`` too, the largest
    of its ranks', for the components that measure it."""
    row: dict[str, float] = {}
    for name, ranks in components.items():
        row[f"{name}_busy_s"] = sum(r.busy_s for r in ranks) / len(ranks)
        row[f"{name}_idle_s"] = sum(r.idle_s for r in ranks) / len(ranks)
        if memory and ranks[0].peak_memory_mb is not None:
            row[f"{name}_peak_memory_mb"] = max(r.peak_memory_mb for r in ranks)
    return row


class SamplesLost(RuntimeError):
    """A step trained on a sample twice, lost one it collected, or trained on one it never collected."""


class Ledger:
    """Every step's samples by their ids, from its reports' ``collected``, ``dropped`` and
    ``trained``: each flow's metrics record each step, and the same check holds in every flow,
    that whatever was collected for a step's stream was trained on once or dropped on purpose.
    ``trained``: step -> the ids trained on, in the trainer ranks' order (a step done again after
    a restart from a checkpoint replaces what it trained before)."""

    def __init__(self) -> None:
        self.trained: dict[int, list[SampleId]] = {}

    def record(self, step: int, report: Mapping[str, Any]) -> None:
        """Step ``step``'s reports (component -> its ranks' reports; other entries, the weight
        sync's, are not a component's): ``SamplesLost`` unless each sample collected was trained
        on once or dropped, and each trained on was collected."""
        ranks = [r for reports in report.values() if isinstance(reports, list) for r in reports]
        collected, trained = {i for r in ranks for i in r.collected}, [i for r in ranks for i in r.trained]
        dropped = {i for r in ranks for i in r.dropped}
        twice = sorted(i for i, n in Counter(trained).items() if n > 1)
        lost, stray = sorted(collected - dropped - set(trained)), sorted(set(trained) - collected)
        problems = [f"{what} ({len(ids)}): {ids[:8]}" for what, ids in (
            ("trained on twice", twice), ("lost: collected, neither trained on nor dropped", lost),
            ("trained on but never collected", stray)) if ids]
        if problems:
            raise SamplesLost(f"step {step}'s samples: " + "; ".join(problems))
        self.trained[step] = trained


class Staleness:
    """How old the trained data was, and how soon new weights reached the rollout: the share
    of what a step trained on (tokens, env steps) j versions behind the weights trained
    (``staleness_j``), and ``weight_latency_s``: from an update's end to the rollout loading
    its weights, averaged over the loads during this step's stream (absent when it loaded
    none: without in-flight updates, or when no push arrived while it ran)."""

    def __init__(self) -> None:
        self.update_ends: dict[int, float] = {}  # weights version -> when the update that made it ended

    def row(self, rollout: list[RolloutReport], actor: list[TrainReport]) -> dict[str, float]:
        """From the rollout ranks' ``weight_loads`` (version, time) and the actor ranks' ``lags``
        (how many trained items were j versions old), ``version`` (the weights the update
        made) and ``update_end``."""
        total: dict[int, int] = {}
        for r in actor:
            for lag, n in r.lags.items():
                total[lag] = total.get(lag, 0) + n
        n = sum(total.values())
        out = {f"staleness_{lag}": c / n for lag, c in sorted(total.items())} if n else {}
        delays = [t - self.update_ends[v] for r in rollout for v, t in r.weight_loads if v in self.update_ends]
        if delays:
            out["weight_latency_s"] = sum(delays) / len(delays)
        for r in actor:
            self.update_ends[r.version] = max(self.update_ends.get(r.version, 0.0), r.update_end)
        return out
