"""What the peer benchmarks share: the machine's load and speed, the order of the sides,
spread summaries and strict JSON.

The machine may be shared and its speed drifts, so every benchmark
  - runs its sides in ABAB order (``side_order``: the order flips from one repetition to
    the next, so a slow drift touches both sides alike),
  - records the 1-minute load average before and after each timed side (``Loaded``),
  - measures the machine's fp32 matmul speed (a 1024x1024 product, on 1 thread and on all
    threads) at the start and at the end of the run (``Run``),
  - reports each figure's spread over the repetitions (``spread``: min, median, max).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
MATMUL_N = 1024


def load1() -> float:
    """The 1-minute load average."""
    return round(os.getloadavg()[0], 2)


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0))


def matmul_gflops(threads: int, n: int = MATMUL_N, min_s: float = 0.2) -> float:
    """GFLOP/s of an n x n fp32 matmul on ``threads`` torch threads, timed for ``min_s``
    seconds after one untimed product. The process's thread count is restored."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
        out = torch.empty(n, n)
        torch.mm(a, b, out=out)
        reps, start = 0, time.perf_counter()
        while True:
            torch.mm(a, b, out=out)
            reps += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_s:
                return round(2 * n**3 * reps / elapsed / 1e9, 1)
    finally:
        torch.set_num_threads(before)


def machine_speed() -> dict:
    """The machine's speed now: fp32 matmul GFLOP/s on 1 and on all threads, and the load."""
    n = cores()
    return {"load_1min": load1(), "matmul_threads": [1, n],
            "matmul_gflops": [matmul_gflops(1), matmul_gflops(n)]}


def side_order(sides: Sequence[T], repetition: int) -> list[T]:
    """ABAB ordering: the sides as given in even repetitions, reversed in odd ones."""
    return list(sides) if repetition % 2 == 0 else list(reversed(sides))


def loaded(fn: Callable[[], T]) -> tuple[T, dict]:
    """Runs ``fn`` and returns its result with the load average before and after it."""
    before = load1()
    result = fn()
    return result, {"load_before": before, "load_after": load1()}


def spread(values: Iterable[float | None], digits: int | None = None) -> dict | None:
    """min, median and max of the values that are numbers (None when there are none)."""
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return None
    out = {"min": min(vals), "median": statistics.median(vals), "max": max(vals), "n": len(vals)}
    if digits is not None:
        out = {k: (round(v, digits) if k != "n" else v) for k, v in out.items()}
    return out


class Run:
    """One benchmark run: the machine's speed at its start and end, and its wall time."""

    def __init__(self) -> None:
        self.began = time.perf_counter()
        self.start = machine_speed()

    def finish(self, **versions: str) -> dict:
        """The keys every report carries: ``machine`` (platform and versions), ``machine_speed``
        (at the start and the end of the run) and ``total_s``."""
        return {
            "machine": {"cpus": os.cpu_count(), "usable_cores": cores(), "platform": platform.platform(),
                        "python": platform.python_version(), **versions},
            "machine_speed": {"start": self.start, "end": machine_speed()},
            "total_s": round(time.perf_counter() - self.began, 1),
        }


def json_safe(x: Any) -> Any:
    """NaN becomes null, so the output is strict JSON."""
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return None if isinstance(x, float) and math.isnan(x) else x


def run_child(script: str, spec: dict) -> dict:
    """Runs one side in a fresh interpreter, ``script --child SPEC`` (its stdout goes to our
    stderr); the child writes its result as JSON to the path ``spec["result"]``, set here."""
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [sys.executable, script, "--child", json.dumps(spec | {"result": out.name})]
        subprocess.run(cmd, stdout=sys.stderr, check=True)
        return json.load(open(out.name))


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def append_jsonl(path: str | None, record: dict) -> None:
    """Appends ``record`` to the journal at ``path`` as one line of strict JSON (nothing
    without a path): a benchmark cut short keeps what it measured."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(json_safe(record)) + "\n")


def read_jsonl(path: str | None) -> list[dict]:
    """The records of the journal at ``path`` (none without a path or file); a line that is
    not JSON (the last one of a killed run, cut short) is left out, and said so."""
    if not path or not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                log(f"{path}:{n}: not JSON, left out")
    return records


def record_readings(report: dict, root: str) -> dict:
    """The record line's ``commit``, ``load`` and ``matmul_gflops`` (scripts/benchmark_table.py)
    of a report whose ``runs`` map each side to its repetitions (each with ``load_before`` and
    ``load_after``) and that carries ``Run.finish``'s ``machine_speed``."""
    loads = [x[k] for side in report["runs"].values() for x in side for k in ("load_before", "load_after")]
    speeds = report["machine_speed"]
    matmul = {str(t): [round(min(s["matmul_gflops"][i] for s in speeds.values())),
                       round(max(s["matmul_gflops"][i] for s in speeds.values()))]
              for i, t in enumerate(speeds["start"]["matmul_threads"])}
    commit = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], check=False, capture_output=True, text=True,
                            cwd=root).stdout.strip()
    return {"commit": commit or None, "load": [min(loads), max(loads)], "matmul_gflops": matmul}


def ratio_figures(ratios: dict[str, dict | None]) -> list[dict]:
    """Record figures (``unit`` x) of ratios given as ``spread``s, by label; those without one left out."""
    return [{"label": label, "value": s["median"], "low": s["min"], "high": s["max"], "n": s["n"], "unit": "x"}
            for label, s in ratios.items() if s]


def append_record(report: dict, root: str, command: str, comparison: str, title: str, figures: list[dict],
                  note: str) -> None:
    """Appends a run of ``command`` (``python benchmarks/...``) to benchmarks/record.jsonl, with the
    readings of ``report`` (``record_readings``), and writes docs/benchmarks.md
    (scripts/benchmark_table.py's ``append_run``)."""
    sys.path.insert(0, os.path.join(root, "scripts"))
    import benchmark_table as table

    readings = record_readings(report, root)
    table.append_run(json_safe({
        "comparison": comparison, "title": title, "date": time.strftime("%Y-%m-%d"), "time": time.strftime("%H:%M"),
        "commit": readings["commit"], "command": command.replace("python ", ".venv/bin/python ", 1),
        "load": readings["load"], "matmul_gflops": readings["matmul_gflops"], "figures": figures, "note": note}))
