"""Soak: a run with a random worker process killed (SIGKILL) every few minutes, against
undisturbed runs of the same config, in one benchmark run.

    python benchmarks/soak.py --preset embodied/ppo_halfcheetah --kill-every-min 3 \\
        --override runner.total_env_steps=15000000 runner.checkpoint_every_min=1
    python benchmarks/soak.py --preset reasoning/grpo_arith_tiny --kill-every-min 3 \\
        --override runner.steps=8000 runner.checkpoint_every=40 runner.eval_every=1000

Sides, alternated: the disturbed run (seed S), and undisturbed runs with seeds S, S+1, S+2
(``--undisturbed``). Each run is ``m2flow train`` in a process of its own, with
``runner.max_restarts`` high enough for every kill. The killer picks, with a seeded RNG, one
of the disturbed run's worker processes (its component workers, not the channel or lock
actors) and kills it; the run must restart from its last checkpoint and finish.

Reported: every run's final metric (embodied: the last episode return; reasoning: the last
held-out reward), wall time and restarts; the kills; whether the disturbed run's final metric
lies within the undisturbed runs' spread, and whether it equals the undisturbed run of the
same seed (a resume is exact on CPU, so it should, to the bit), and row by row how many of
their logged updates (steps) hold the same values (every column but the timings).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from common import Run, json_safe, load1, log, side_order  # noqa: E402

M2FLOW = [sys.executable, "-m", "m2flow.cli"]
# A component's worker process (Ray titles an actor's process ray::<class>[.<method>]): the env,
# rollout, reward, inference, actor and critic workers; never Ray's own processes (its
# dashboard agent's death takes the node with it) nor the channel and lock actors.
WORKER = re.compile(r"^ray::\w*Worker\b")


def workers_of(pid: int) -> list[psutil.Process]:
    """The component worker processes under a training process (driver -> raylet -> workers)."""
    try:
        procs = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for p in procs:
        try:
            name = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if WORKER.match(name):
            found.append(p)
    return found


def final_metric(out: Path) -> tuple[str, float]:
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    for key in ("eval_reward", "episode_return"):
        values = [float(r[key]) for r in rows if r.get(key) not in (None, "", "nan")]
        if values:
            return key, values[-1]
    return "none", math.nan


# Columns that depend on the machine's speed, not on the run's course.
TIMING = re.compile(r"(_s$|memory|^update_end$)")  # time_s, step_s, env_steps_per_s, ...


def rows_by_index(out: Path) -> tuple[str, dict[int, dict[str, str]]]:
    """A run's logged rows by update (embodied) or step (reasoning); the last row of each wins
    (rows restored from a checkpoint's history may write the index as a float)."""
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    index = "update" if rows and "update" in rows[0] else "step"
    return index, {int(float(r[index])): r for r in rows}


def same(a: str | None, b: str | None) -> bool:
    """Two CSV cells hold the same number (``2873`` and ``2873.0`` do; so do two NaNs)."""
    if a == b:
        return True
    try:
        x, y = float(a), float(b)
    except (TypeError, ValueError):
        return False
    return x == y or (math.isnan(x) and math.isnan(y))


def same_course(a: Path, b: Path) -> dict:
    """Row by row, whether two runs logged the same values (every column but the timings)."""
    index, ra = rows_by_index(a)
    _, rb = rows_by_index(b)
    common = sorted(ra.keys() & rb.keys())
    differ = [k for k in common if any(not same(ra[k].get(c), rb[k].get(c)) for c in ra[k] if not TIMING.search(c))]
    return {"index": index, "compared": len(common), "identical": len(common) - len(differ),
            "only_in_one": len(ra.keys() ^ rb.keys()), "first_difference": differ[0] if differ else None}


def train(preset: str, overrides: list[str], out: Path, kill_every_s: float | None, rng: random.Random) -> dict:
    start, before = time.perf_counter(), load1()
    cmd = [*M2FLOW, "train", preset, *overrides, f"runner.out_dir={out}", "runner.progress=false"]
    proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr)
    kills: list[dict] = []

    def killer() -> None:
        while proc.poll() is None:
            deadline = time.monotonic() + kill_every_s
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
            victims = workers_of(proc.pid)
            if proc.poll() is not None or not victims:
                continue
            victim = rng.choice(sorted(victims, key=lambda p: p.pid))
            try:
                name = " ".join(victim.cmdline()).strip()
                os.kill(victim.pid, signal.SIGKILL)
                kills.append({"at_s": round(time.perf_counter() - start, 1), "pid": victim.pid, "process": name})
                log(f"killed {name} (pid {victim.pid})")
            except (psutil.Error, ProcessLookupError):
                pass

    thread = threading.Thread(target=killer, daemon=True) if kill_every_s else None
    if thread:
        thread.start()
    rc = proc.wait()
    if thread:
        thread.join(timeout=5)
    text = (out / "log.txt").read_text() if (out / "log.txt").exists() else ""
    key, value = final_metric(out) if rc == 0 else ("none", math.nan)
    return {"returncode": rc, "metric": key, "final": value, "run_s": round(time.perf_counter() - start, 1),
            "restarts": text.count("restart "), "kills": kills, "load_before": before, "load_after": load1()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True)
    p.add_argument("--override", nargs="*", default=[], help="key=value overrides for every run (its length)")
    p.add_argument("--kill-every-min", type=float, default=3.0)
    p.add_argument("--undisturbed", type=int, default=3, help="undisturbed runs (seeds S, S+1, ...)")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    run = Run()
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="m2flow-soak-"))
    sides = ["disturbed"] + [f"seed{args.seed + i}" for i in range(args.undisturbed)]
    results = {}
    for side in side_order(sides, 0):
        seed = args.seed if side == "disturbed" else int(side.removeprefix("seed"))
        log(f"== {side}")
        results[side] = train(args.preset, [*args.override, f"seed={seed}", "runner.max_restarts=1000"], tmp / side,
                              60 * args.kill_every_min if side == "disturbed" else None, rng)
    quiet = [results[s]["final"] for s in sides[1:] if results[s]["returncode"] == 0]
    disturbed = results["disturbed"]
    out = {"benchmark": "soak", "args": vars(args), "runs": results,
           "undisturbed_spread": {"min": min(quiet), "max": max(quiet)} if quiet else None,
           "completed": disturbed["returncode"] == 0,
           "within_spread": bool(quiet) and min(quiet) <= disturbed["final"] <= max(quiet),
           "equals_same_seed": disturbed["final"] == results[f"seed{args.seed}"]["final"],
           "kills": len(disturbed["kills"]), "restarts": disturbed["restarts"]}
    if disturbed["returncode"] == 0 and results[f"seed{args.seed}"]["returncode"] == 0:
        out["same_seed_course"] = same_course(tmp / "disturbed", tmp / f"seed{args.seed}")
    print(json.dumps(json_safe(out | run.finish()), indent=1))


if __name__ == "__main__":
    main()
