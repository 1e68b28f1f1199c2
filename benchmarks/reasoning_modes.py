"""M2Flow benchmark for reasoning RL: the same GRPO steps collocated and disaggregated, one run.

Both modes run the preset ``reasoning/grpo_arith_smollm2`` with the same overrides (the same
prompts, sampling, micro-batching and seed), one after the other in this process:

  collocated  rollout, inference and actor share every device and take turns under the
              device locks (each phase uses all cores);
  disaggregated   the rollout on the first half of the devices, reward, inference and actor on
              the rest; completed groups stream on while the rollout generates, and the actor
              runs forward and backward on each as it arrives.

  <mode>-ahead  the same placement with ``runner.max_staleness=1``: each step's rollout
              runs while the actor trains on the previous step's completions (one policy
              version old); the last timed step also counts the wait for the rollout it
              started (a step returns before it ends), then one more, untimed step trains on it.
  <mode>-fsdp   the same with ``algorithm.data_parallel=fsdp``: the actor ranks (two in hybrid
              mode) shard the model instead of each holding all of it.

Reported per mode: seconds per step after ``--warmup`` steps (mean and each), generated
tokens per step, and each component's busy and idle seconds per step (averaged over the
timed steps); then collocated / <mode> step time for every other mode (the acceptance
ratio, >= 1.2, is the disaggregated one's), and the first mode's / each other's.

    python benchmarks/reasoning_modes.py [--model smollm2] [--steps 3] [--warmup 1] \
        [--override rollout.max_new_tokens=128 ...]

Prints one JSON object on stdout (progress on stderr).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time

COMPONENTS = ("rollout", "reward", "inference", "actor")


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    from m2flow.config import load_config
    from m2flow.runners.reasoning import ReasoningMetrics
    from m2flow.runners.reasoning import ReasoningRunner

    placement, *flags = mode.split("-")
    if set(flags) - {"ahead", "fsdp"}:
        raise ValueError(f"mode {mode!r}: a placement mode, optionally with -ahead and/or -fsdp")
    ahead = int("ahead" in flags)
    overrides = [f"model.path={args.model}", f"placement.mode={placement}", f"data.prompts_per_step={args.prompts}",
                 f"runner.max_staleness={ahead}",
                 f"rollout.n={args.n}", f"rollout.max_new_tokens={args.max_new_tokens}",
                 f"placement.granularity={args.granularity}", "runner.progress=false",
                 f"runner.out_dir={tempfile.mkdtemp(prefix=f'm2flow-{mode}-')}",
                 *(["algorithm.data_parallel=fsdp"] if "fsdp" in flags else []), *args.override]
    runner = ReasoningRunner(load_config("reasoning/grpo_arith_smollm2", overrides))
    rows = []
    try:
        for i in range(args.warmup + args.steps):
            start = time.perf_counter()
            report = runner.step(i, ahead=ahead)
            row = ReasoningMetrics(0).row(i, report, time.perf_counter() - start, 0.0)
            print(f"{mode} step {i + 1}: {row['step_s']:.2f} s, {row['completion_tokens']} tokens, "
                  f"reward {row['reward']:.3f}", file=sys.stderr)
            if i >= args.warmup:
                rows.append(row)
        if ahead:
            # The timed window ends once the rollout its last step started is done: a step
            # that generates ahead returns before that rollout ends, which would leave it out.
            start = time.perf_counter()
            runner.streams.wait_ahead()
            rows[-1]["step_s"] += time.perf_counter() - start
            runner.step(args.warmup + args.steps)  # trains on the last rollout started ahead
    finally:
        runner.close()
    mean = lambda key: statistics.fmean(r[key] for r in rows)  # noqa: E731
    return {
        "step_s": mean("step_s"), "steps_s": [round(r["step_s"], 3) for r in rows],
        "completion_tokens_per_step": mean("completion_tokens"), "reward": mean("reward"),
        "weight_sync_s": mean("weight_sync_s"),
        "components": {c: {"busy_s": round(mean(f"{c}_busy_s"), 3), "idle_s": round(mean(f"{c}_idle_s"), 3)}
                       for c in COMPONENTS},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--granularity", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--modes", nargs="+", default=["collocated", "disaggregated"])
    p.add_argument("--override", nargs="*", default=[], help="more key=value overrides for both modes")
    args = p.parse_args()

    import torch

    results = {mode: run_mode(mode, args) for mode in args.modes}
    out = {"benchmark": "reasoning_modes", "model": args.model, "prompts_per_step": args.prompts, "n": args.n,
           "max_new_tokens": args.max_new_tokens, "granularity": args.granularity, "timed_steps": args.steps,
           "modes": results, "torch": torch.__version__, "python": platform.python_version()}
    if "collocated" in results:
        out["speedup_vs_collocated"] = {m: results["collocated"]["step_s"] / r["step_s"]
                                        for m, r in results.items() if m != "collocated"}
    first = args.modes[0]
    out[f"speedup_vs_{first}"] = {m: results[first]["step_s"] / r["step_s"] for m, r in results.items() if m != first}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
