"""A run's trace, read back: what each component's processes did and when.

Every process records spans (``m2flow.runtime.trace``): its group calls, channel waits, device
lock waits and holds, point-to-point receives, (language models) the onloads and offloads
of a context switch, and each tool call (category ``tool``, on the thread that ran it: it
overlaps the rollout's decoding, so it is a row of its own in Perfetto, not a state below). At the end of a run the runner writes them all to ``trace.json`` (open it
in Perfetto) and draws the last update as ``timeline.png``; ``m2flow trace RUN_DIR`` prints
the per-component summary.

A span's state, by its category and name:

  computing            a group call, less the waits and switches inside it
  waiting on channel   a channel get or put that waited ("channel")
  waiting on lock      waiting for a device lock ("lock", "wait devices ...")
  waiting on message   a point-to-point receive ("recv")
  switching            onload / offload around a device-lock turn ("switch")
  syncing weights      the trainer's push_weights and the receivers' pull_weights calls
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

STATES = ("computing", "syncing weights", "waiting on channel", "waiting on lock", "waiting on message", "switching")
COLOURS = {"computing": "#4c78a8", "syncing weights": "#f58518", "waiting on channel": "#d3d3d3",
           "waiting on lock": "#e45756", "waiting on message": "#b8b8b8", "switching": "#54a24b"}
_SYNC_CALLS = ("push_weights", "pull_weights")


def state_of(event: dict[str, Any]) -> str | None:
    cat, name = event.get("cat"), event.get("name", "")
    if cat == "call":
        return "syncing weights" if name.rpartition(".")[2] in _SYNC_CALLS else "computing"
    if cat == "channel":
        return "waiting on channel"
    if cat == "lock":
        return "waiting on lock" if name.startswith("wait") else None  # holds are not a state of their own
    if cat == "recv":
        return "waiting on message"
    if cat == "switch":
        return "switching"
    return None  # the driver's update spans, sends (not waits), ...


def read(path: str | Path) -> list[dict[str, Any]]:
    """The events of a ``trace.json`` file (or of a run directory's)."""
    path = Path(path)
    if path.is_dir():
        path = path / "trace.json"
    if not path.is_file():
        raise FileNotFoundError(f"no trace at {path} (a run writes trace.json into runner.out_dir at its end)")
    return json.loads(path.read_text())["traceEvents"]


def processes(events: Iterable[dict[str, Any]]) -> dict[int, str]:
    """pid -> process name ("env-3f2a1b:0", the driver's)."""
    return {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}


def component_of(process: str) -> str:
    """``env-3f2a1b:0`` -> ``env``; other names as they are."""
    group = process.rpartition(":")[0] or process
    return group.rpartition("-")[0] or group


def seconds_by_state(events: list[dict[str, Any]], start_us: float | None = None,
                     end_us: float | None = None) -> dict[str, dict[str, float]]:
    """Process name -> state -> seconds, within [start_us, end_us] when given. The waits and
    switches inside a call (same thread, within its span) are taken off that call's time."""
    names = processes(events)
    lo = start_us if start_us is not None else -float("inf")
    hi = end_us if end_us is not None else float("inf")
    out: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(STATES, 0.0))
    calls: dict[tuple[int, int], list[list]] = defaultdict(list)  # (pid, tid) -> [start, end, state, seconds]
    waits = []
    for e in events:
        if e.get("ph") != "X" or (state := state_of(e)) is None:
            continue
        seconds = max(0.0, min(e["ts"] + e["dur"], hi) - max(e["ts"], lo)) / 1e6
        if state in ("computing", "syncing weights"):
            calls[(e["pid"], e["tid"])].append([e["ts"], e["ts"] + e["dur"], state, seconds])
        else:
            waits.append((e, state, seconds))
    for e, state, seconds in waits:
        out[names.get(e["pid"], str(e["pid"]))][state] += seconds
        inside = next((c for c in calls.get((e["pid"], e["tid"]), ()) if c[0] <= e["ts"] and e["ts"] + e["dur"] <= c[1]),
                      None)
        if inside is not None:
            inside[3] -= seconds
    for (pid, _), spans in calls.items():
        for _, _, state, seconds in spans:
            out[names.get(pid, str(pid))][state] += max(0.0, seconds)
    return dict(out)


def summary(events: list[dict[str, Any]]) -> str:
    """Per component (its ranks added up): seconds in each state and the share computing."""
    per: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(STATES, 0.0))
    ranks: dict[str, int] = defaultdict(int)
    for process, times in seconds_by_state(events).items():
        c = component_of(process)
        ranks[c] += 1
        for s, v in times.items():
            per[c][s] += v
    head = ["component", "ranks", *STATES, "computing share"]
    rows = [[c, str(ranks[c]), *(f"{per[c][s]:.2f}" for s in STATES),
             f"{per[c]['computing'] / max(sum(per[c].values()), 1e-9):.0%}"] for c in sorted(per)]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in [head, *rows]) + \
        "\n(seconds, summed over each component's ranks)"


def render(events: list[dict[str, Any]], path: str | Path, window: tuple[float, float], title: str = "") -> Path:
    """A PNG of ``window`` (microseconds, wall clock): a row per process, its spans coloured by
    state; waits drawn over the calls they happen in. Margins are set in inches from the
    labels' lengths (a layout engine measuring every text costs a run's end more than the
    drawing)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    names = processes(events)
    lo, hi = window
    bars: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)  # (process, state) -> (start, width)
    for e in events:
        if e.get("ph") == "X" and (state := state_of(e)) and e["ts"] < hi and e["ts"] + e["dur"] > lo:
            a, b = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
            bars[(names.get(e["pid"], str(e["pid"])), state)].append(((a - lo) / 1e6, (b - a) / 1e6))
    rows = sorted({p for p, _ in bars})
    width, height = 11.0, 0.45 * len(rows) + 1.5
    left = 0.3 + 0.075 * max((len(r) for r in rows), default=4)  # inches: the longest name at 10 pt
    fig = Figure(figsize=(width, height))
    fig.subplots_adjust(left=left / width, right=1 - 0.25 / width, bottom=0.9 / height, top=1 - 0.4 / height)
    ax = fig.add_subplot()
    for state in STATES:  # calls first, their waits over them
        for i, p in enumerate(rows):
            if bars.get((p, state)):
                ax.broken_barh(bars[(p, state)], (i - 0.35, 0.7), facecolors=COLOURS[state], linewidth=0)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # the first process on top
    ax.set_xlim(0, (hi - lo) / 1e6)
    ax.set_xlabel("seconds")
    ax.set_title(title)
    fig.legend([Rectangle((0, 0), 1, 1, color=COLOURS[s]) for s in STATES], STATES, loc="lower center", ncol=6,
               fontsize=8, frameon=False)
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path
