"""Two versions of m2flow side by side in one run: the code at an old commit against the code
at a new one (or the working tree), measured by one of the peer benchmarks.

How:
  - Each side's code is a detached ``git worktree`` of its commit in a temporary directory
    (removed at the end, then ``git worktree prune``); ``--new worktree`` takes this checkout's
    working tree as it is, uncommitted edits included. The trees' modules are byte-compiled
    before the first run, so that neither side pays for it in a timed run.
  - Both sides run the same harness: the benchmark script (and its ``common.py``) of the *new*
    side's tree, so that a change to how a benchmark measures cannot pass for a change of
    speed. The only difference between the sides is the m2flow package imported: the script
    runs with ``PYTHONPATH=<the side's tree>`` and its working directory there (Ray's workers
    put the driver's working directory on their path; the embedded cluster's processes
    inherit the driver's environment). Before a side's first run, a probe process started the
    same way prints where ``m2flow`` comes from, in it and in a Ray worker it starts; a path
    outside the side's tree stops the run. The harness must work with the old code too: where
    a benchmark script calls into m2flow by a name the old code lacks, it fails there.
  - The sides run one at a time, each a fresh process, in pairs whose order alternates:
    old, new; then new, old; ... (``--pairs``). Every run records the 1-minute load average
    before and after it and the benchmark's own JSON output (with the machine's fp32 matmul
    speed at its start and end).
  - Each finished run is appended to a journal (``--journal``; by default a file under
    /tmp/m2flow-versions/ named after the settings, the revisions resolved to commits): the
    same command run again goes on from it, running only the runs it lacks (``--pairs``
    may grow). A journal line of other settings is left out.

What each benchmark gives per side (``FIGURES``), and the options it is run with before the
ones given after ``--`` (``DEFAULT_ARGS``; a later option of the same name wins):
  embodied_vs_sb3   m2flow's env steps/s per mode, the median over seeds (``--no-sb3``: SB3's
                    side is the same code on both sides and is not run)
  reasoning_vs_trl  m2flow's seconds per step per variant and beta, the median over the timed
                    steps (``--variants m2flow_collocated m2flow_collocated_all_rows --rounds 1``:
                    no TRL side; each pair is one round)
  runtime           m2flow's side of each measurement: p2p 100 MB GB/s, channel 10 MB and 1 KB
                    items/s (medians over ``--reps``), a group call's ms (its baselines still run)

Reported (one JSON object on stdout, progress on stderr): per figure and pair the new/old
ratio, taken so that above 1 means the new code is faster (speeds: new / old; times: old /
new), and its median and min-max spread over the pairs, with each side's values; the load
around the runs and the matmul readings. ``--record`` appends the run to
benchmarks/record.jsonl as comparison ``versions/<benchmark>`` and writes docs/benchmarks.md
again (scripts/benchmark_table.py).

    python benchmarks/versions.py --old REV [--new REV|worktree] --benchmark NAME [--pairs 3]
        [--journal PATH] [--record] [-- options of the benchmark]

The three comparisons with the code of b5027a7 (three pairs each):

    .venv/bin/python benchmarks/versions.py --old b5027a7 --new HEAD --pairs 3 --benchmark runtime
    .venv/bin/python benchmarks/versions.py --old b5027a7 --new HEAD --pairs 3 \\
        --benchmark embodied_vs_sb3 -- --env HalfCheetah-v5 --steps 200000 --seeds 1 2 --modes collocated
    .venv/bin/python benchmarks/versions.py --old b5027a7 --new HEAD --pairs 3 \\
        --benchmark reasoning_vs_trl -- --betas 0

A smoke run: ``--pairs 1`` and the benchmark's cheapest settings (``runtime``: ``-- --quick
--reps 1``; ``embodied_vs_sb3``: ``-- --quick``; ``reasoning_vs_trl``: ``-- --model tiny-llama
--max-new-tokens 8 --betas 0``).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from common import append_jsonl, json_safe, load1, log, read_jsonl, side_order, spread

REPO = Path(__file__).resolve().parents[1]
SIDES = ("old", "new")
JOURNAL_DIR = Path(tempfile.gettempdir()) / "m2flow-versions"

DEFAULT_ARGS = {
    "embodied_vs_sb3": ["--no-sb3"],
    "reasoning_vs_trl": ["--variants", "m2flow_collocated", "m2flow_collocated_all_rows", "--rounds", "1"],
    "runtime": [],
}
TITLES = {
    "embodied_vs_sb3": "m2flow's code against an earlier commit's: embodied PPO env steps/s "
                       "(benchmarks/embodied_vs_sb3.py, m2flow's side)",
    "reasoning_vs_trl": "m2flow's code against an earlier commit's: GRPO step time "
                        "(benchmarks/reasoning_vs_trl.py, m2flow's side)",
    "runtime": "m2flow's code against an earlier commit's: the runtime's p2p, channel and group-call figures "
               "(benchmarks/runtime.py, m2flow's side)",
}

# A figure: (label, value, kind); kind "speed" (higher is faster) or "time" (lower is faster).
Figure = tuple[str, float, str]


def embodied_figures(report: dict) -> list[Figure]:
    return [(f"{mode} env steps/s", report["summary"]["env_steps_per_s"][mode]["median"], "speed")
            for mode in report["modes"]]


def reasoning_figures(report: dict) -> list[Figure]:
    return [(f"{variant} s/step, {key}", per[variant]["spread"]["median"], "time")
            for key, per in report["seconds_per_step"].items() for variant in per if variant.startswith("m2flow")]


def runtime_figures(report: dict) -> list[Figure]:
    return [("p2p 100 MB GB/s", report["p2p_100MB"]["GBps"]["m2flow"]["median"], "speed"),
            ("channel 10 MB items/s", report["channel_10MB"]["items_per_s"]["m2flow"]["median"], "speed"),
            ("channel 1 KB items/s", report["channel_1KB"]["items_per_s"]["m2flow"]["median"], "speed"),
            ("group call ms", report["group_call"]["m2flow_ms"]["median"], "time")]


FIGURES: dict[str, Callable[[dict], list[Figure]]] = {
    "embodied_vs_sb3": embodied_figures,
    "reasoning_vs_trl": reasoning_figures,
    "runtime": runtime_figures,
}


# -- the sides' code -----------------------------------------------------------------------
def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def resolve(rev: str) -> str:
    """A revision as its full commit id (``worktree`` as itself)."""
    if rev == "worktree":
        return rev
    try:
        return git("rev-parse", "--verify", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError:
        raise SystemExit(f"{rev}: not a commit of {REPO}") from None


def worktree_state() -> str:
    """What the working tree's m2flow is: HEAD, and a hash of its uncommitted edits (tracked
    and untracked files under m2flow/), so that a journal is not resumed on other code."""
    head = git("rev-parse", "HEAD")
    h = hashlib.sha1(git("diff", "HEAD", "--", "m2flow").encode())
    for name in git("ls-files", "--others", "--exclude-standard", "--", "m2flow").splitlines():
        h.update(name.encode() + b"\0" + (REPO / name).read_bytes())
    return f"{head}+{h.hexdigest()[:12]}"


def make_trees(commits: dict[str, str], root: Path) -> dict[str, Path]:
    """Each side's tree: a detached worktree of its commit under ``root`` (the working tree for
    ``worktree``), its modules byte-compiled."""
    trees = {}
    for side, commit in commits.items():
        if commit == "worktree":
            trees[side] = REPO
            continue
        path = root / side
        git("worktree", "add", "--detach", str(path), commit)
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(path / "m2flow")], check=True)
        trees[side] = path
        log(f"{side}: {commit[:10]} in {path}")
    return trees


def remove_trees(trees: dict[str, Path]) -> None:
    for path in trees.values():
        if path != REPO:
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], check=False, cwd=REPO,
                           capture_output=True)
    subprocess.run(["git", "worktree", "prune"], check=False, cwd=REPO, capture_output=True)


def side_env(tree: Path) -> dict[str, str]:
    """The environment of a side's processes: its tree first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


PROBE = r"""
import json, os, shutil, sys, tempfile
import m2flow
out = {"driver": m2flow.__file__}
import ray
tmp = tempfile.mkdtemp(prefix="m2v-ray-")
try:
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, _temp_dir=tmp)

    @ray.remote(num_cpus=0)
    def where():
        import m2flow
        return m2flow.__file__

    out["ray_worker"] = ray.get(where.remote(), timeout=120)
except Exception as e:
    out["ray_error"] = f"{type(e).__name__}: {e}"
finally:
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)
print(json.dumps(out))
"""


def probe(side: str, tree: Path) -> dict:
    """Where m2flow comes from in a process started as the side's benchmark is, and in a Ray
    worker it starts; stops the run if either is outside the side's tree."""
    env = side_env(tree) | {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # Ray on the loopback address, as m2flow's
    rc, stdout, stderr = communicate([sys.executable, "-c", PROBE], tree, env, stderr=subprocess.PIPE)
    if rc:
        raise SystemExit(f"{side}: the probe failed:\n{stderr[-3000:]}")
    where = json.loads(stdout.strip().splitlines()[-1])
    package = (tree / "m2flow").resolve()
    for key in ("driver", "ray_worker"):
        if key in where:
            log(f"{side}: m2flow in the {key.replace('_', ' ')}: {where[key]}")
            if not Path(where[key]).resolve().is_relative_to(package):
                raise SystemExit(f"{side}: m2flow comes from {where[key]}, not from {package}")
    if "ray_error" in where:
        log(f"{side}: the Ray worker probe did not run ({where['ray_error']}); the driver's m2flow is the tree's")
    return where


# -- one run -------------------------------------------------------------------------------
def communicate(cmd: list[str], cwd: Path, env: dict[str, str], stderr=None) -> tuple[int, str, str | None]:
    """Runs ``cmd``, its stdout (and stderr if asked) captured. Stopped (an exception here, a
    signal), the process is asked to stop (SIGTERM) and given 60 s to shut its Ray cluster
    down before it is killed."""
    child = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        out, err = child.communicate()
    except BaseException:
        child.terminate()
        try:
            child.wait(60)
        except subprocess.TimeoutExpired:
            child.kill()
        raise
    return child.returncode, out, err


def parse_report(stdout: str) -> dict:
    """The benchmark's JSON object: its stdout, or the last object that starts a line there
    (what went before it is passed on to stderr)."""
    try:
        return json.loads(stdout)
    except json.JSONDecodeError:
        start = stdout.rfind("\n{")
        if start < 0:
            raise
        sys.stderr.write(stdout[:start + 1])
        return json.loads(stdout[start + 1:])


def run_side(script: Path, args: list[str], tree: Path) -> tuple[dict, dict]:
    """Runs the benchmark on the side's code: its stdout is its report, its stderr ours."""
    before, t0 = load1(), time.perf_counter()
    rc, stdout, _ = communicate([sys.executable, str(script), *args], tree, side_env(tree))
    if rc:
        raise SystemExit(f"{script.name} exited with {rc} (the journal keeps the runs before it)")
    return parse_report(stdout), {"load_before": before, "load_after": load1(),
                                  "wall_s": round(time.perf_counter() - t0, 1)}


# -- the summary ---------------------------------------------------------------------------
def summarise(benchmark: str, runs: dict[tuple[int, str], dict], pairs: int) -> dict:
    """Per figure: each side's value and the new/old ratio (above 1: new faster) per pair,
    and the ratio's spread over the pairs both of whose sides ran."""
    figures: dict[str, dict] = {}
    for p in range(pairs):
        if not all((p, side) in runs for side in SIDES):
            continue
        got = {side: {label: (v, kind) for label, v, kind in FIGURES[benchmark](runs[p, side]["report"])}
               for side in SIDES}
        for label, (old, kind) in got["old"].items():
            if label not in got["new"] or old is None or got["new"][label][0] is None:
                continue
            new = got["new"][label][0]
            f = figures.setdefault(label, {"kind": kind, "pair": [], "old": [], "new": [], "new_over_old": []})
            f["pair"].append(p)
            f["old"].append(old)
            f["new"].append(new)
            f["new_over_old"].append(round(new / old if kind == "speed" else old / new, 4))
    for f in figures.values():
        f["spread"] = spread(f["new_over_old"], 3)
    return figures


def readings(runs: list[dict]) -> tuple[list[float] | None, dict[str, list[float]] | None]:
    """The lowest and highest 1-minute load around the runs, and the matmul GFLOP/s by thread
    count over the benchmarks' own readings (at each one's start and end)."""
    loads = [r[k] for r in runs for k in ("load_before", "load_after") if r.get(k) is not None]
    matmul: dict[str, list[float]] = {}
    for r in runs:
        for when in ("start", "end"):
            speed = r["report"].get("machine_speed", {}).get(when)
            if speed:
                for threads, gflops in zip(speed["matmul_threads"], speed["matmul_gflops"]):
                    matmul.setdefault(str(threads), []).append(gflops)
    return ([min(loads), max(loads)] if loads else None,
            {t: [round(min(v)), round(max(v))] for t, v in matmul.items()} or None)


def record_line(summary: dict, command: str) -> dict:
    """The run as a line of benchmarks/record.jsonl (scripts/benchmark_table.py's RUN_KEYS)."""
    old, new = summary["old"], summary["new"]
    new_name = f"the working tree on {new['head'][:7]}" if new["commit"] == "worktree" else new["commit"][:7]
    figures = [{"label": f"{label}, {'new / old' if f['kind'] == 'speed' else 'old / new'}",
                "value": f["spread"]["median"], **({"low": f["spread"]["min"], "high": f["spread"]["max"]}
                                                   if f["spread"]["n"] > 1 else {"low": None, "high": None}),
                "n": f["spread"]["n"], "unit": "x"} for label, f in summary["figures"].items()]
    return {
        "comparison": f"versions/{summary['benchmark']}", "title": TITLES[summary["benchmark"]],
        "date": time.strftime("%Y-%m-%d"), "time": time.strftime("%H:%M"),
        "commit": (new["head"] if new["commit"] == "worktree" else new["commit"])[:7],
        "command": command, "load": summary["load"], "matmul_gflops": summary["matmul_gflops"], "figures": figures,
        "note": (f"{new_name} against {old['commit'][:7]}, {summary['pairs_done']} pair(s) in alternating order, "
                 "the new side's harness; above 1: the new code faster"),
    }


def record(summary: dict, command: str) -> None:
    """Appends the run to benchmarks/record.jsonl, checked as scripts/benchmark_table.py checks
    it, and writes docs/benchmarks.md from the record."""
    spec = importlib.util.spec_from_file_location("benchmark_table", REPO / "scripts" / "benchmark_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    line = json_safe(record_line(summary, command))
    table.append_run(line)
    log(f"recorded in {table.RECORD.relative_to(REPO)} as {line['comparison']}; docs/benchmarks.md written")


def shown(path: str) -> str:
    """A path as the record's commands write it: relative to the repository where it is inside."""
    p = Path(path)
    return str(p.relative_to(REPO)) if p.is_absolute() and p.is_relative_to(REPO) else path


# -- driver --------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                usage="%(prog)s --old REV [--new REV|worktree] --benchmark NAME [--pairs N] "
                                      "[--journal PATH] [--record] [-- options of the benchmark]")
    p.add_argument("--old", required=True, help="the old side's commit (any git revision)")
    p.add_argument("--new", default="HEAD",
                   help="the new side's commit, or 'worktree': this checkout as it is (default: HEAD)")
    p.add_argument("--benchmark", required=True, choices=sorted(FIGURES))
    p.add_argument("--pairs", type=int, default=3, help="pairs of runs, the order of each alternating (default 3)")
    p.add_argument("--journal", help="append each finished run here and skip those it holds "
                                     f"(default: a file under {JOURNAL_DIR} named after the settings)")
    p.add_argument("--record", action="store_true",
                   help="append the result to benchmarks/record.jsonl and write docs/benchmarks.md")
    args = p.parse_args(ours)
    if args.pairs < 1:
        p.error(f"--pairs must be at least 1, got {args.pairs}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the worktrees are removed

    commits = {"old": resolve(args.old), "new": resolve(args.new)}
    if commits["old"] == commits["new"]:
        log("old and new are the same commit: an A/A run")
    bench_args = [*DEFAULT_ARGS[args.benchmark], *extra]
    settings = {"benchmark": args.benchmark, "old": commits["old"],
                "new": worktree_state() if commits["new"] == "worktree" else commits["new"], "args": bench_args,
                "harness": "new"}
    key = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]
    journal = args.journal or str(JOURNAL_DIR / f"{args.benchmark}-{commits['old'][:7]}-{settings['new'][:7]}-{key}.jsonl")
    Path(journal).parent.mkdir(parents=True, exist_ok=True)
    lines = read_jsonl(journal)
    runs = {(r["pair"], r["side"]): r for r in lines if r.get("settings") == settings}
    if len(runs) < len(lines):
        log(f"{journal}: {len(lines) - len(runs)} line(s) of other settings left out")
    todo = [(i, side) for i in range(args.pairs) for side in side_order(SIDES, i) if (i, side) not in runs]
    log(f"{args.benchmark}: {args.pairs} pair(s), {len(runs)} run(s) in {journal}, {len(todo)} to run")

    root = Path(tempfile.mkdtemp(prefix="m2flow-versions-"))
    trees: dict[str, Path] = {}
    try:
        if todo:
            trees = make_trees(commits, root)
            harness = trees["new"] / "benchmarks" / f"{args.benchmark}.py"
            if not harness.is_file():
                raise SystemExit(f"the new side has no {harness.relative_to(trees['new'])}")
            where = {}
            for i, side in todo:
                if side not in where:
                    where[side] = probe(side, trees[side])
                log(f"[pair {i + 1}/{args.pairs}] {side} ({commits[side][:10]}): {harness.name} {shlex.join(bench_args)}")
                report, around = run_side(harness, bench_args, trees[side])
                entry = {"settings": settings, "pair": i, "side": side, "commit": commits[side],
                         "m2flow_file": where[side], "date": time.strftime("%Y-%m-%d %H:%M"), **around,
                         "figures": {label: v for label, v, _ in FIGURES[args.benchmark](report)}, "report": report}
                append_jsonl(journal, entry)
                runs[i, side] = json_safe(entry)
                log(f"  {entry['figures']}, load {around['load_before']} -> {around['load_after']}, {around['wall_s']} s")
    finally:
        remove_trees(trees)
        shutil.rmtree(root, ignore_errors=True)

    used = [runs[i, side] for i in range(args.pairs) for side in SIDES if (i, side) in runs]
    load, matmul = readings(used)
    figures = summarise(args.benchmark, runs, args.pairs)
    summary = {
        "benchmark": args.benchmark, "args": bench_args,
        "old": {"rev": args.old, "commit": commits["old"]},
        "new": {"rev": args.new, "commit": commits["new"], "head": git("rev-parse", "HEAD"), "state": settings["new"]},
        "harness": f"benchmarks/{args.benchmark}.py of the new side's tree", "pairs": args.pairs,
        "pairs_done": sum(all((i, s) in runs for s in SIDES) for i in range(args.pairs)),
        "runs": [{k: r[k] for k in ("pair", "side", "date", "load_before", "load_after", "wall_s", "figures",
                                    "m2flow_file")} for r in used],
        "figures": figures, "load": load, "matmul_gflops": matmul, "journal": journal,
    }
    print(json.dumps(json_safe(summary), indent=1))
    if args.record:
        if not figures:
            raise SystemExit("nothing to record: no pair has both sides")
        again = [a for a in ours if a != "--record"] + (["--", *extra] if extra else [])
        record(summary, shlex.join([shown(sys.executable), shown(str(Path(__file__).resolve())), *again]))


if __name__ == "__main__":
    main()
