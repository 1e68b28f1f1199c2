#!/usr/bin/env python3
"""docs/benchmarks.md, written from the run record benchmarks/record.jsonl, so that the two
cannot disagree.

    python scripts/benchmark_table.py           # writes docs/benchmarks.md
    python scripts/benchmark_table.py --check   # exit 1 if the page, or a README figure, differs

The record holds one JSON object a line, one line per benchmark run (RUN_KEYS below), oldest
first within each comparison: the last line of a comparison is its latest run, the one the
page's table shows. Figures (FIGURE_KEYS): ``value`` is the figure (a median over the
repetitions, a ratio or a count), ``low`` and ``high`` its spread (min and max over the ``n``
repetitions), each null when the run did not give it; ``unit`` is ``x`` for a ratio (above
1: the first-named side is faster), else what the number counts.

The README quotes some figures; a README line that cites docs/benchmarks.md with a figure
such as ``1.55x`` names the comparison's id, and ``--check`` (and tests/test_docs.py) fails
when such a figure is not the latest run's.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "benchmarks" / "record.jsonl"
PAGE = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
MAX_LINES = 150

RUN_KEYS = ("comparison", "title", "date", "time", "commit", "command", "load", "matmul_gflops", "figures", "note")
FIGURE_KEYS = ("label", "value", "low", "high", "n", "unit")
# the table's order: comparisons grouped by the start of their id, in the record's order within a group
ORDER = ("embodied_vs_sb3/", "embodied/", "sac_vs_sb3/", "sac_update/", "reasoning_vs_trl/", "agentic_vs_trl/", "grpo/",
         "rollout_engine/", "continuous_rollout/", "turns/", "reasoning_modes/", "precision/", "async_grpo/", "planner/",
         "runtime", "micro", "soak/")


# ------------------------------------------------------------------------------ the record

def _check_run(run: dict) -> None:
    """Raises ValueError naming what is wrong with one line of the record."""
    if not isinstance(run, dict) or tuple(run) != RUN_KEYS:
        raise ValueError(f"keys must be, in this order: {', '.join(RUN_KEYS)}")
    for key in ("comparison", "title", "date"):
        if not isinstance(run[key], str) or not run[key]:
            raise ValueError(f"{key}: a non-empty string")
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*", run["comparison"]):
        raise ValueError(f"comparison: letters, digits, _ . - and /, got {run['comparison']!r}")
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", run["date"]):
        raise ValueError(f"date: YYYY-MM-DD, got {run['date']!r}")
    if run["time"] is not None and not re.fullmatch(r"\d{2}:\d{2}", run["time"]):
        raise ValueError(f"time: HH:MM or null, got {run['time']!r}")
    for key in ("commit", "command", "note"):
        if run[key] is not None and not (isinstance(run[key], str) and run[key]):
            raise ValueError(f"{key}: a non-empty string or null")
    load = run["load"]
    if load is not None and not (isinstance(load, list) and len(load) == 2 and all(_num(v) for v in load)):
        raise ValueError("load: [lowest, highest] 1-minute load average around the run, or null")
    matmul = run["matmul_gflops"]
    if matmul is not None and not (isinstance(matmul, dict) and matmul and all(
            k.isdigit() and isinstance(v, list) and len(v) == 2 and all(_num(x) for x in v)
            for k, v in matmul.items())):
        raise ValueError("matmul_gflops: {threads: [lowest, highest] fp32 GFLOP/s}, or null")
    figures = run["figures"]
    if not isinstance(figures, list) or not figures:
        raise ValueError("figures: a non-empty list")
    for f in figures:
        if not isinstance(f, dict) or tuple(f) != FIGURE_KEYS:
            raise ValueError(f"a figure's keys must be, in this order: {', '.join(FIGURE_KEYS)}")
        if not isinstance(f["label"], str) or not isinstance(f["unit"], str) or not f["label"] or not f["unit"]:
            raise ValueError("a figure's label and unit: non-empty strings")
        for key in ("value", "low", "high"):
            if f[key] is not None and not _num(f[key]):
                raise ValueError(f"a figure's {key}: a number or null")
        if f["n"] is not None and not (isinstance(f["n"], int) and f["n"] > 0):
            raise ValueError("a figure's n: a positive integer or null")
        if (f["low"] is None) != (f["high"] is None):
            raise ValueError(f"{f['label']}: low and high both or neither")
        if f["value"] is None and f["low"] is None:
            raise ValueError(f"{f['label']}: a value or a spread")
        if f["low"] is not None and not f["low"] <= f["high"]:
            raise ValueError(f"{f['label']}: low above high")


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def read_record(path: Path = RECORD) -> list[dict]:
    """The record's runs, each checked; within a comparison the dates may not go back."""
    runs, last_date = [], {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            run = json.loads(line)
            _check_run(run)
            if run["date"] < last_date.get(run["comparison"], ""):
                raise ValueError(f"date {run['date']} before the comparison's line before it")
        except ValueError as e:  # json.JSONDecodeError is one
            raise ValueError(f"{path.name}:{n}: {e}") from None
        last_date[run["comparison"]] = run["date"]
        runs.append(run)
    return runs


def latest(runs: list[dict]) -> dict[str, dict]:
    """Each comparison's latest run (its last line), in the table's order."""
    last: dict[str, dict] = {}
    for run in runs:
        last.pop(run["comparison"], None)
        last[run["comparison"]] = run
    first = {c: i for i, c in reversed(list(enumerate(r["comparison"] for r in runs)))}

    def key(c: str) -> tuple[int, int]:
        group = next((i for i, p in enumerate(ORDER) if c == p or c.startswith(p)), len(ORDER))
        return group, first[c]
    return {c: last[c] for c in sorted(last, key=key)}


# ------------------------------------------------------------------------------ figures as text

def number(v: float, unit: str, sign: bool = False) -> str:
    """A figure's number: ratios with at least two decimals, thousands separated, a sign where asked."""
    if isinstance(v, float) and v.is_integer() and unit != "x":
        v = int(v) if abs(v) >= 100 else v
    text = f"{v:,}"
    if unit == "x" and "." in text and len(text.split(".")[1]) < 2:
        text += "0" * (2 - len(text.split(".")[1]))
    elif unit == "x" and "." not in text:
        text += ".00"
    return f"+{text}" if sign and v > 0 else text


def plain(f: dict) -> str:
    """A figure's value with its unit, or its spread where it has no value: '1.55x', '1.34-1.62x'."""
    unit = f["unit"]
    sign = unit == "points"
    sym, after = (unit, "") if unit in ("x", "%") else ("", f" {unit}")
    if f["value"] is not None:
        return f"{number(f['value'], unit, sign)}{sym}{after}"
    joint = " to " if sign else "-"
    return f"{number(f['low'], unit, sign)}{joint}{number(f['high'], unit, sign)}{sym}{after}"


def figure_text(f: dict) -> str:
    """'label: **1.55x** (1.51-1.57, n=3)': the value in bold, then its spread and n (n=1 left out)."""
    n = f"n={f['n']}" if f["n"] not in (None, 1) else None
    if f["value"] is None:
        return f"{f['label']}: **{plain(f)}**" + (f" ({n})" if n else "")
    sign = f["unit"] == "points"
    spread = None if f["low"] is None else (
        f"{number(f['low'], f['unit'], sign)} to {number(f['high'], f['unit'], sign)}" if sign
        else f"{number(f['low'], f['unit'])}-{number(f['high'], f['unit'])}")
    tail = ", ".join(t for t in (spread, n) if t)
    return f"{f['label']}: **{plain(f)}**" + (f" ({tail})" if tail else "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _when(run: dict) -> str:
    when = run["date"] + (f" {run['time']}" if run["time"] else "")
    return when + (f", `{run['commit']}`" if run["commit"] else "")


def table(last: dict[str, dict]) -> list[str]:
    rows = ["| comparison | latest figures: value (min-max over n repetitions) | run | command |",
            "| --- | --- | --- | --- |"]
    for c, run in last.items():
        figures = "; ".join(figure_text(f) for f in run["figures"])
        if run["note"]:
            figures += f". {run['note']}"
        command = f"`{run['command']}`" if run["command"] else "(not recorded)"
        rows.append(f"| {_cell(run['title'])} (`{c}`) | {_cell(figures)} | {_cell(_when(run))} | {_cell(command)} |")
    return rows


def bullets(items: list[str], width: int = 104) -> list[str]:
    """A Markdown list, each item wrapped to ``width`` columns."""
    return [line for item in items for line in textwrap.wrap(
        item, width, initial_indent="- ", subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)]


def fig(last: dict[str, dict], comparison: str, index: int = 0) -> str:
    """One figure of a comparison's latest run, as plain text: '1.55x', '1.34-1.62x'."""
    return plain(last[comparison]["figures"][index])


# ------------------------------------------------------------------------------ the page

def render(runs: list[dict]) -> str:
    last = latest(runs)
    one_thread = [v for r in runs if r["matmul_gflops"] for v in r["matmul_gflops"].get("1", [])]
    slowest, fastest = min(one_thread), max(one_thread)
    p = "async_grpo/SmolLM2-135M/pairs"
    one, two = "async_grpo/SmolLM2-135M/cost_one_ahead", "async_grpo/SmolLM2-135M/cost_two_ahead"
    # the step speed-up the time criterion (0.67x, i.e. 1.5x) needs, given the steps running ahead costs
    cost_lo, cost_hi = (1.5 * last[f"async_grpo/SmolLM2-135M/cost_{a}_ahead"]["figures"][0]["value"]
                        for a in ("one", "two"))
    lines = [
        "# Benchmarks",
        "",
        ("<!-- Written by scripts/benchmark_table.py from benchmarks/record.jsonl: edit the record, then run the "
         "script. -->"),
        "",
        "Each comparison below is measured side by side in one run: m2flow against a baseline or a peer",
        "(Stable-Baselines3, TRL's GRPOTrainer, transformers `generate()`, gloo, Ray's own calls), or one m2flow",
        "setting against another, on the same machine with the same settings. The sides run one at a time, in",
        "fresh processes, their order flipping from one repetition to the next (ABAB), so that a drift of the",
        "machine touches both. A figure's label names what it divides: of speeds (env steps/s, tokens/s), above",
        "1 means the first-named side is faster; of times, below 1 does. The figure in bold is the median over",
        "the repetitions (seeds, rounds or repeats), the spread in brackets their min-max, n their number.",
        "Every run records the 1-minute load average around its sides and the machine's fp32 matmul speed at",
        "its start and end: this project's machine (2 CPU cores, no GPU, unless a GPU is named) is shared and",
        (f"its speed drifts ({number(slowest, '')}-{number(fastest, '')} GFLOP/s on one thread over the "
         "record), so only ratios taken within one run"),
        "are compared, never absolute rates of different days.",
        "",
        "The table shows each comparison's latest run: its figures, when it ran (and on which commit) and the",
        "command that reproduces it. Every run, older ones too, is a line of `benchmarks/record.jsonl`, with its",
        "load and matmul readings. What each run showed, at length: docs/benchmark-runs.md (each benchmark's",
        "protocol and runs, and the test suite's times), docs/async-grpo-runs.md (every asynchronous GRPO pair)",
        "and docs/benchmarks-earlier.md (the figures of earlier protocols).",
        "",
        *table(last),
        "",
        "## Running the benchmarks",
        "",
        "```bash",
        "make bench    # installs the peers (the bench extra: stable-baselines3, trl), runs benchmarks/runtime.py",
        "```",
        "",
        "Each script in `benchmarks/` runs its sides itself and prints one JSON object: its figures with their",
        "spread and the load around each side, and for most the matmul readings at its start and end; `--help`",
        "lists its options. Beside the commands in the table:",
        "",
        "- `embodied_vs_sb3.py`: `--modes` (collocated, collocated-compiled, hybrid, disaggregated, ahead, ahead2,",
        "  async, async-auto), `--sb3-configs` (SB3's four configurations by default), `--hparams peers|tuned`.",
        "- `reasoning_vs_trl.py`, `rollout_engine.py`, `precision.py`, `reasoning_modes.py`: SmolLM2-135M-Instruct",
        "  on the CPU, `--model tiny-llama` for a quick look; `continuous_rollout.py`: the SmolLM2 preset;",
        "  `agentic_vs_trl.py`: its model made by a short warm start (`--sft-steps`) unless `--model-dir` names one.",
        "- `async_reasoning.py`: `--journal FILE` keeps each finished side, so that a run cut short, or pairs",
        "  from several runs, add up; `--control` adds on-policy in the async side's plan to each pair.",
        "- `planner.py` (a SmolLM2 sweep takes hours: `--journal` and `--resume`), `planner_replay.py` and",
        "  `predict_runs.py` (finished runs predicted again by the model as it is now).",
        "- `soak.py` (hours: workers killed during a run; run it with nothing else on the machine), `micro.py`,",
        "  `thread_numerics.py`.",
        "- `versions.py`: m2flow against its own code at an earlier commit (`--old REV --new REV|worktree`, each",
        "  commit a detached git worktree put first on `PYTHONPATH`), one harness for both (the new side's",
        "  `--benchmark embodied_vs_sb3|reasoning_vs_trl|runtime`, its options after `--`), in pairs of",
        "  alternating order (`--pairs`); m2flow's figures as new / old, above 1 the new code faster. Its journal",
        "  resumes a run cut short; `--record` adds the run as `versions/<benchmark>`.",
        "- On a GPU: `bash scripts/gpu_checks.sh OUT_DIR` runs the agentic flow's checks, the CUDA tests,",
        "  the rollout engine with CUDA graphs and continuous generation, and an asynchronous GRPO pair",
        "  over the GPU made two devices",
        "  (`OUT_DIR/machine.txt` names the machine, `OUT_DIR/<part>.log` holds each part's output); their",
        "  figures go into the record as runs of their own.",
        "",
        "## Limits",
        "",
        *bullets([
            (f"Asynchronous GRPO does not meet its criterion on this task (`{p}`): both parts held in "
             f"{fig(last, p, 0).split()[0]} of {last[p]['figures'][0]['n']} pairs, and the final accuracy, async "
             f"less on-policy, was {fig(last, p, 1)} on average. Running one and two versions ahead took "
             f"{fig(last, one)} and {fig(last, two)} the steps to the same accuracy as on-policy in the same plan, "
             f"so reaching the on-policy accuracy in 0.67x the time needs async steps about {cost_lo:.1f}-"
             f"{cost_hi:.1f}x as fast; they measured {fig(last, p, 2)} on one H100 and {fig(last, p, 3)} on two "
             "CPU slots. A single 24-step pair moves by 10-25 points with the round-off of its plan: compare "
             "plans and algorithms over several seeds."),
            ("On-policy embodied PPO does not reach 1.5x the env steps/s of Stable-Baselines3's fastest "
             f"configuration ({fig(last, 'embodied_vs_sb3/HalfCheetah-v5/collocated')}); two versions ahead it "
             f"runs {fig(last, 'embodied_vs_sb3/HalfCheetah-v5/async')} the on-policy run's speed."),
            ("Against TRL, 2x is reached only as shipped at beta 0, where rows of zero gradient are not forwarded "
             f"({fig(last, 'reasoning_vs_trl/SmolLM2-135M')}); every row forwarded "
             f"{fig(last, 'reasoning_vs_trl/SmolLM2-135M', 1)}, with a KL term "
             f"{fig(last, 'reasoning_vs_trl/SmolLM2-135M', 2)}."),
            ("Two CPU cores favour collocation: hybrid pipelining on Ant-v5 ran at "
             f"{fig(last, 'embodied_vs_sb3/Ant-v5/hybrid')} collocated's speed, and the channel carries 10 MB "
             f"items at {fig(last, 'runtime', 1)} the fastest Ray baseline's rate (the target was 3x)."),
            ("Not measured on a GPU yet: decode steps as CUDA graphs, continuous generation, sharded (FSDP) "
             "actor ranks over NCCL. The one H200 pair was cut short before its evaluations."),
        ]),
        "",
        "## Adding a run",
        "",
        "Append one line to `benchmarks/record.jsonl` (the last line of a comparison is its latest run):",
        "",
        "```json",
        '{"comparison": "embodied_vs_sb3/HalfCheetah-v5/async", "title": "the one-line name in the table",',
        ' "date": "YYYY-MM-DD", "time": "HH:MM", "commit": "abc1234", "command": "the exact command",',
        ' "load": [lowest, highest], "matmul_gflops": {"1": [lowest, highest], "2": [lowest, highest]},',
        ' "figures": [{"label": "async / collocated", "value": 1.55, "low": 1.51, "high": 1.57, "n": 3,',
        '              "unit": "x"}],',
        ' "note": "a short remark, or null"}',
        "```",
        "",
        "Unknown fields are null; `load` is the lowest and highest 1-minute load average read around the run,",
        "`matmul_gflops` the fp32 matmul speed by thread count at its start and end. Then",
        "`.venv/bin/python scripts/benchmark_table.py` writes this page, and `.venv/bin/pytest tests/test_docs.py`",
        "checks it, and that each README figure citing this page (with the comparison's id) is the latest run's.",
    ]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ the README's figures

RATIO = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(?:\s*-\s*(\d+(?:\.\d+)?))?x\b")


def readme_mismatches(text: str, last: dict[str, dict]) -> list[str]:
    """The README lines whose ratio figures (``1.55x``, ``1.34-1.62x``) disagree with the table.
    A line that names a comparison id, or whose next line does (a citation wrapped over two
    lines), may quote only numbers of that comparison's latest run; a line that cites
    docs/benchmarks.md with a ratio must name the comparison's id."""
    ids = {c: re.compile(rf"(?<![\w/.\-]){re.escape(c)}(?![\w/\-])") for c in last}
    cites = re.compile(r"docs/benchmarks\.md(?![\w-])")
    lines = text.splitlines()
    problems = []
    for n, line in enumerate(lines, 1):
        quoted = [float(x) for m in RATIO.finditer(line) for x in m.groups() if x is not None]
        if not quoted:
            continue
        following = lines[n] if n < len(lines) else ""
        named = [c for c, pattern in ids.items() if pattern.search(line)] or \
            [c for c, pattern in ids.items() if pattern.search(following)]
        if not named:
            if cites.search(line) or cites.search(following):
                problems.append(f"README.md:{n}: cites docs/benchmarks.md with a ratio but names no comparison id")
            continue
        allowed = {float(f[k]) for c in named for f in last[c]["figures"] for k in ("value", "low", "high")
                   if f[k] is not None}
        for x in quoted:
            if not any(abs(x - a) < 1e-9 for a in allowed):
                problems.append(f"README.md:{n}: {x:g}x is not among the latest figures of {', '.join(named)}")
    return problems


def append_run(run: dict) -> None:
    """Appends one run to the record, checked, and writes docs/benchmarks.md from the record
    (a benchmark's ``--record``)."""
    _check_run(run)
    with open(RECORD, "a") as f:
        f.write(json.dumps(run) + "\n")
    if main([]):
        raise SystemExit(f"{Path(__file__).name} did not write {PAGE.relative_to(ROOT)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 if docs/benchmarks.md or a README figure differs from the record")
    args = ap.parse_args(argv)
    runs = read_record()
    page = render(runs)
    if len(page.splitlines()) > MAX_LINES:
        print(f"the page would have {len(page.splitlines())} lines, over {MAX_LINES}", file=sys.stderr)
        return 1
    if not args.check:
        PAGE.write_text(page)
        return 0
    failed = False
    if not PAGE.exists() or PAGE.read_text() != page:
        print(f"{PAGE.relative_to(ROOT)} differs from what {Path(__file__).name} writes: run it", file=sys.stderr)
        failed = True
    for problem in readme_mismatches(README.read_text(), latest(runs)):
        print(problem, file=sys.stderr)
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
