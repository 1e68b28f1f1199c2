"""Per-update metrics: a progress bar, CSV, TensorBoard, and a learning curve at the end.

``RunLog`` writes the rows; each flow's metrics class turns a step's reports into a row. The
reasoning flow's columns are listed in docs/reasoning.md; the embodied flow's, logged every
update (``metrics.csv`` columns and TensorBoard scalars):

  env_steps            env steps so far (all envs; a chunk counts the actions it ran)
  time_s / update_s    wall time since the start (of a resumed run: since it resumed) / of
                       this update (incl. weight sync)
  env_steps_per_s      env steps taken by this process / time_s: end-to-end throughput,
                       training included
  episode_return       mean raw (unnormalised) return of the episodes that ended in this
                       update; the previous value when none ended
  episode_length       their mean length; episodes: how many ended
  env_faults           env steps in this update that raised or gave a non-finite reward or
                       observation: each ended its episode (truncated, reward 0) and the
                       env was made again (EnvBatch._fault)
  success_rate         the fraction of them that reached success (the env's info["success"]
                       at any step: ManiSkill, Meta-World); the previous value when none
                       ended; absent for envs that report no success
  policy_loss, value_loss, entropy, approx_kl, clip_fraction, grad_norm, epochs,
  explained_variance   PPO statistics averaged over the minibatches and the actor's ranks
  policy_lag           policy versions between the weights trained and the oldest that
                       collected the data (0 on-policy; up to runner.max_staleness)
  staleness_<j>        the share of the update's env steps whose actions came from weights j
                       versions older than those trained (staleness_0 = 1 on-policy)
  weight_latency_s     runner.in_flight_updates: from an update's end to the rollout taking
                       its weights between env steps, averaged over this rollout's loads
                       (absent when it took none)
  weight_sync_s        actor -> rollout weight broadcast time
  {env,rollout,actor}_busy_s / _idle_s
                       per-component busy time (stepping, inferring, training) and idle
                       time (waiting for actions, observations, trajectories or a device
                       lock), averaged over the component's ranks; with the rollout
                       fused into the env workers, rollout_busy_s is their inference time
"""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from m2flow.runtime.files import write_whole


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
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(*zip(*points), marker="o" if len(points) < 30 else None)
        ax.set_xlabel(self.x.replace("_", " "))
        ax.set_ylabel(self.y.replace("_", " "))
        ax.set_title(self.out_dir.name)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = self.out_dir / "learning_curve.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
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


class Staleness:
    """How old the trained data was, and how soon new weights reached the rollout: the share
    of what a step trained on (tokens, env steps) j versions behind the weights trained
    (``staleness_j``), and ``weight_latency_s``: from an update's end to the rollout loading
    its weights, averaged over the loads during this step's stream (absent when it loaded
    none: without in-flight updates, or when no push arrived while it ran)."""

    def __init__(self) -> None:
        self.update_ends: dict[int, float] = {}  # weights version -> when the update that made it ended

    def row(self, lags: list[dict[int, int]], rollout: list[dict], actor: list[dict]) -> dict[str, float]:
        """``lags``: per actor rank, how many trained items were j versions old; ``rollout``
        reports carry ``weight_loads`` (version, time), ``actor`` reports ``version`` (the
        weights the update made) and ``update_end``."""
        total: dict[int, int] = {}
        for counts in lags:
            for lag, n in counts.items():
                total[lag] = total.get(lag, 0) + n
        n = sum(total.values())
        out = {f"staleness_{lag}": c / n for lag, c in sorted(total.items())} if n else {}
        delays = [t - self.update_ends[v] for r in rollout for v, t in r.get("weight_loads", ())
                  if v in self.update_ends]
        if delays:
            out["weight_latency_s"] = sum(delays) / len(delays)
        for r in actor:
            if "update_end" in r:
                self.update_ends[r["version"]] = max(self.update_ends.get(r["version"], 0.0), r["update_end"])
        return out


class EmbodiedMetrics:
    """The embodied flow's rows (module docstring), against env steps."""

    x, y, x_name = "env_steps", "episode_return", "update"

    def __init__(self, progress_total: int):
        self.progress_total = progress_total
        self.staleness = Staleness()
        self.env_steps = self.start_steps = 0
        self.last_return = self.last_success = math.nan

    def state_dict(self) -> dict[str, float]:
        return {"env_steps": self.env_steps, "last_return": self.last_return, "last_success": self.last_success}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Continues a run: throughput counts the steps this process adds."""
        self.env_steps = self.start_steps = state["env_steps"]
        self.last_return, self.last_success = state["last_return"], state["last_success"]

    def row(self, update: int, report: dict[str, Any], update_s: float, time_s: float) -> dict[str, float]:
        env, rollout, actor = report["env"], report["rollout"], report["actor"]
        self.env_steps += sum(e["env_steps"] for e in env)
        episodes = [ep for e in env for ep in e["episodes"]]
        if episodes:
            self.last_return = sum(r for r, _, _ in episodes) / len(episodes)
        successes = [s for _, _, s in episodes if s is not None]
        if successes:
            self.last_success = sum(successes) / len(successes)
        row: dict[str, float] = {
            "update": update, "env_steps": self.env_steps, "time_s": time_s, "update_s": update_s,
            "env_steps_per_s": (self.env_steps - self.start_steps) / time_s, "episode_return": self.last_return,
            "episode_length": sum(n for _, n, _ in episodes) / len(episodes) if episodes else math.nan,
            "episodes": len(episodes), "weight_sync_s": report["sync"]["weight_sync_s"],
            "env_faults": sum(e["env_faults"] for e in env),
        }
        if not math.isnan(self.last_success):
            row["success_rate"] = self.last_success
        row |= across_ranks(actor, ("busy_s", "idle_s", "lock_wait_s", "step_lags", "version", "update_end"))
        row |= self.staleness.row([r["step_lags"] for r in actor], rollout, actor)
        for name, ranks in (("env", env), ("rollout", rollout), ("actor", actor)):
            for k in ("busy_s", "idle_s"):
                row[f"{name}_{k}"] = sum(r[k] for r in ranks) / len(ranks)
        return row

    def summary(self, row: dict[str, float]) -> str:
        success = "" if math.isnan(self.last_success) else f"  success {self.last_success:.2f}"
        return f"{row['env_steps_per_s']:,.0f} steps/s  return {self.last_return:.1f}{success}"


class ReasoningMetrics:
    """The reasoning flow's rows (documented in docs/reasoning.md), against steps."""

    x, y, x_name = "step", "eval_reward", "step"

    def __init__(self, progress_total: int):
        self.progress_total = progress_total
        self.staleness = Staleness()
        # step -> the prompt index of every completion trained on (a step done again after a
        # restart from a checkpoint replaces what it trained before)
        self.trained: dict[int, list[int]] = {}

    def state_dict(self) -> dict[str, float]:
        return {}

    def load_state_dict(self, state: dict[str, float]) -> None:
        pass

    def summary(self, row: dict[str, float]) -> str:
        return f"reward {row['reward']:.3f}  {row['step_s']:.1f} s/step"

    def _staleness(self, rollout: list[dict], actor: list[dict]) -> dict[str, float]:
        return {"stale_dropped": sum(r.get("stale_dropped", 0) for r in actor)} | self.staleness.row(
            [r.get("token_lags", {}) for r in actor], rollout, actor)

    def row(self, i: int, report: dict[str, Any], step_s: float, time_s: float) -> dict[str, float]:
        """The metrics of step ``i + 1`` (steps count from 1; row 0 is the evaluation before training)."""
        rollout, (reward,), (inference,), actor = report["rollout"], report["reward"], report["inference"], report["actor"]
        row: dict[str, float] = {"step": i + 1, "time_s": time_s, "step_s": step_s}
        row |= {k: v for k, v in reward.items() if k not in ("busy_s", "idle_s")}
        completions = max(1, sum(r["completions"] for r in rollout))
        row["completion_tokens"] = sum(r["completion_tokens"] for r in rollout)
        row["completion_length"] = row["completion_tokens"] / completions
        row["truncated"] = sum(r["truncated"] for r in rollout) / completions
        row["rollout_tokens_per_s"] = row["completion_tokens"] / max(max(r["busy_s"] for r in rollout), 1e-9)
        for k in ("decode_steps", "graph_replays"):  # over the rollout ranks
            row[k] = sum(r.get(k, 0) for r in rollout)
        row["prompts_joined_early"] = sum(r.get("joined_early", 0) for r in rollout)
        skip = ("busy_s", "idle_s", "lock_wait_s", "time_s", "peak_memory_mb", "version", "tokens", "micro_batches",
                "completion_tokens", "optimizer_steps", "skipped_steps", "inert_rows", "stale_dropped", "token_lags",
                "update_end", "trained_prompts", "update_busy_s")
        row |= across_ranks(actor, skip)
        row["optimizer_steps"] = actor[0]["optimizer_steps"] if "optimizer_steps" in actor[0] else math.nan
        row["inert_rows"] = sum(r["inert_rows"] if "inert_rows" in r else 0 for r in actor)
        row["actor_update_busy_s"] = sum(r["update_busy_s"] for r in actor) / len(actor)
        row |= self._staleness(rollout, actor)
        self.trained[i + 1] = [p for r in actor for p in r.get("trained_prompts", ())]
        if "logprob_diff_max" in inference:
            row["logprob_diff_max"] = inference["logprob_diff_max"]
        row |= {k: report["sync"][k] if k in report["sync"] else 0.0 for k in ("weight_sync_s", "weight_mb")}
        parts = [("rollout", rollout), ("reward", [reward]), ("inference", [inference]), ("actor", actor)]
        if "critic" in report:
            (critic,) = report["critic"]
            row |= {k: v for k, v in critic.items() if k not in ("busy_s", "idle_s", "peak_memory_mb")}
            parts.append(("critic", [critic]))
        for name, ranks in parts:
            for k in ("busy_s", "idle_s"):
                row[f"{name}_{k}"] = sum(r[k] for r in ranks) / len(ranks)
            if "peak_memory_mb" in ranks[0]:
                row[f"{name}_peak_memory_mb"] = max(r["peak_memory_mb"] for r in ranks)
        return row
