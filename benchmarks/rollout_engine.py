"""Rollout engine benchmark: TorchEngine against transformers' ``model.generate()``.

Same model, same chat-formatted arithmetic prompts, same sampling (temperature 1 unless
``--temperature`` says otherwise, top-p 1,
no top-k), same number of sequences in flight (``--batch``: generate() gets batch/samples
prompts x samples at a time, the engine keeps batch slots busy), completions stopping at EOS
so lengths vary. Both are warmed up first, then run alternately ``--repeats`` times.
Throughput is generated tokens (through the EOS, padding after it not counted) per second
of wall time. Prints one JSON object; ``ratio`` (best run against best run) > 1 means the
engine is faster; ``ratio_median`` and ``ratio_cpu_time`` (tokens per CPU-second) help tell
a real difference from a neighbour's load on a shared machine.

    python benchmarks/rollout_engine.py                      # SmolLM2-135M-Instruct, fp32, CPU
    python benchmarks/rollout_engine.py --model tiny-llama   # fast smoke test
    python benchmarks/rollout_engine.py --device cuda --sides engine engine_graphs   # CUDA graphs

``--sides`` picks what runs: ``generate``, ``engine`` and ``engine_graphs`` (the engine with
``cuda_graphs=True``: decode steps replayed as CUDA graphs on a GPU, at fixed shapes but
eager on a CPU). ``ratio`` compares the engine with generate(), ``ratio_graphs`` the engine
with graphs against without, each where both ran.

Continuous generation across training steps (``rollout.continuous``): ``engine_steps`` cuts
the prompts into steps of ``--prompts-per-step`` and generates each step in a call of its
own, as a rollout does that drains between steps; ``engine_continuous`` generates the same
steps in one call, each next step's prompts added (the engine's ``more``) once the last
one's have all started, as a rollout running ahead does when the weights allow it.
``ratio_continuous`` compares the two (``--graphs``: both with ``cuda_graphs=True``), and
``decode_steps_ratio_continuous`` their decode forwards (the draining side's over the
continuous one's, medians over the runs): where a decode step costs the same at any number
of rows (bound by kernel launches), the ratio the time would show:

    python benchmarks/rollout_engine.py --sides engine_steps engine_continuous [--device cuda --graphs]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from m2flow.data import arithmetic_problems, build_prompts
from m2flow.engines import SamplingParams, TorchEngine
from m2flow.models.lm import load_lm

TARGET_RATIO = 1.5


def run_generate(model, tokenizer, prompts: list[list[int]], samples: int, batch: int, max_new_tokens: int,
                 seed: int, temperature: float = 1.0) -> list[int]:
    """Completion lengths from model.generate(), batch // samples prompts per call, left-padded."""
    torch.manual_seed(seed)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    pad = eos if pad is None else pad
    per_call = max(1, batch // samples)
    lengths = []
    for start in range(0, len(prompts), per_call):
        chunk = prompts[start:start + per_call]
        width = max(map(len, chunk))
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True, temperature=temperature,
                             top_p=1.0, top_k=0, max_new_tokens=max_new_tokens, num_return_sequences=samples,
                             eos_token_id=eos, pad_token_id=pad)
        for row in out[:, width:].tolist():
            lengths.append(row.index(eos) + 1 if eos in row else len(row))
    return lengths


def run_engine(engine: TorchEngine, prompts: list[list[int]], samples: int, max_new_tokens: int,
               seed: int, temperature: float = 1.0) -> list[int]:
    params = SamplingParams(n=samples, temperature=temperature, top_p=1.0, max_new_tokens=max_new_tokens, seed=seed)
    lengths = [len(c.token_ids) for group in engine.generate(prompts, params) for c in group]
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return lengths


def run_steps(engine: TorchEngine, prompts: list[list[int]], per_step: int, samples: int, max_new_tokens: int,
              seed: int, continuous: bool, temperature: float = 1.0) -> tuple[list[int], int]:
    """The prompts in steps of ``per_step``: a call each, or one call that takes each next
    step through ``more``. The completions' lengths, and the decode forwards over the calls."""
    params = SamplingParams(n=samples, temperature=temperature, top_p=1.0, max_new_tokens=max_new_tokens, seed=seed)
    steps = [prompts[i:i + per_step] for i in range(0, len(prompts), per_step)]
    if continuous:
        rest = iter(steps[1:])
        calls = [engine.generate(steps[0], params, more=lambda: next(rest, []))]
    else:
        calls = [engine.generate(step, params) for step in steps]
    lengths, forwards = [], 0
    for call in calls:
        lengths += [len(c.token_ids) for group in call for c in group]
        forwards += engine.stats["decode_steps"]  # each call's stats start at 0
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return lengths, forwards


def timed(fn, decode_steps=lambda: None) -> dict:
    """``fn``'s tokens and rates; ``decode_steps``: its decode forwards, where counted."""
    wall, cpu = time.perf_counter(), time.process_time()
    lengths = fn()
    decode_steps = decode_steps()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"tokens": sum(lengths), "seconds": round(wall, 3), "cpu_seconds": round(cpu, 3),
            "tokens_per_s": round(sum(lengths) / wall, 2), "tokens_per_cpu_s": round(sum(lengths) / max(cpu, 1e-6), 2),
            "lengths": lengths, **({"decode_steps": decode_steps} if decode_steps is not None else {})}


def summary(runs: list[dict]) -> dict:
    """Best and median over the runs: on a shared machine the best run is the least disturbed
    one; tokens per CPU-second is the figure least moved by other processes."""
    rates = [r["tokens_per_s"] for r in runs]
    lengths = [n for r in runs for n in r.pop("lengths")]
    return {"tokens_per_s_best": max(rates), "tokens_per_s_median": round(statistics.median(rates), 2),
            "tokens_per_cpu_s_best": max(r["tokens_per_cpu_s"] for r in runs),
            "mean_length": round(statistics.mean(lengths), 1), "max_length": max(lengths), "runs": runs}


def ratio(result: dict, ours: str, theirs: str, into: str) -> None:
    """``into`` (best against best), ``into``_median and ``into``_cpu_time, where both sides ran."""
    if ours in result and theirs in result:
        a, b = result[ours], result[theirs]
        result[into] = round(a["tokens_per_s_best"] / b["tokens_per_s_best"], 2)
        result[into + "_median"] = round(a["tokens_per_s_median"] / b["tokens_per_s_median"], 2)
        result[into + "_cpu_time"] = round(a["tokens_per_cpu_s_best"] / b["tokens_per_cpu_s_best"], 2)


SIDES = ("generate", "engine", "engine_graphs", "engine_steps", "engine_continuous")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny-llama, ... (m2flow.models.lm.load_lm)")
    parser.add_argument("--prompts", type=int, default=16, help="distinct prompts per run")
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt")
    parser.add_argument("--batch", type=int, default=32, help="sequences in flight, for both")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--sides", nargs="+", default=["generate", "engine"], choices=SIDES,
                        help="what runs, alternately, in this order")
    parser.add_argument("--prompts-per-step", type=int, default=4, help="engine_steps, engine_continuous: a step's prompts")
    parser.add_argument("--temperature", type=float, default=1.0, help="every side's sampling temperature")
    parser.add_argument("--graphs", action="store_true", help="engine_steps, engine_continuous: cuda_graphs=True")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model, tokenizer = load_lm(args.model)
    model.to(args.device)
    problems = arithmetic_problems(args.prompts, seed=args.seed)
    prompts = [list(p.token_ids) for p in build_prompts(problems, tokenizer)]
    engines = {"engine": TorchEngine(model, tokenizer, max_batch_size=args.batch),
               "engine_graphs": TorchEngine(model, tokenizer, max_batch_size=args.batch, cuda_graphs=True),
               **{side: TorchEngine(model, tokenizer, max_batch_size=args.batch, cuda_graphs=args.graphs)
                  for side in ("engine_steps", "engine_continuous")}}

    forwards: dict[str, int] = {}  # the decode forwards of each steps side's last run

    def run(side: str, few: list[list[int]], samples: int, batch: int, max_new_tokens: int, seed: int) -> list[int]:
        if side == "generate":
            return run_generate(model, tokenizer, few, samples, batch, max_new_tokens, seed, args.temperature)
        if side in ("engine_steps", "engine_continuous"):
            lengths, forwards[side] = run_steps(engines[side], few, args.prompts_per_step, samples, max_new_tokens,
                                                seed, side == "engine_continuous", args.temperature)
            return lengths
        return run_engine(engines[side], few, samples, max_new_tokens, seed, args.temperature)

    for side in args.sides:  # warm-up: allocator, thread pools, lazy imports, kernels
        run(side, prompts[:2], 2, 4, 8, args.seed)
    load_before = os.getloadavg()[0]  # the machine may be shared: report how busy it was
    runs: dict[str, list[dict]] = {side: [] for side in args.sides}
    with torch.inference_mode():
        for r in range(args.repeats):
            for side in args.sides:
                runs[side].append(timed(lambda: run(side, prompts, args.samples, args.batch, args.max_new_tokens,
                                                    args.seed + r),
                                        lambda: forwards.get(side)))
    device = torch.device(args.device)
    result = {
        "benchmark": "rollout_engine", "model": args.model, "dtype": str(model.dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "threads": args.threads,
        "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
        "prompts": args.prompts, "prompts_per_step": args.prompts_per_step, "graphs": args.graphs, "temperature": args.temperature,
        "samples": args.samples, "batch": args.batch, "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats, "prompt_tokens_mean": round(statistics.mean(map(len, prompts)), 1),
        **{side: summary(side_runs) for side, side_runs in runs.items()},
        **{f"{side}_stats_last_run": engines[side].stats for side in args.sides if side in engines},
        "load_average_1min": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
    }
    ratio(result, "engine", "generate", "ratio")
    ratio(result, "engine_graphs", "engine", "ratio_graphs")
    ratio(result, "engine_continuous", "engine_steps", "ratio_continuous")
    if "engine_continuous" in result and "engine_steps" in result:
        median = {side: statistics.median(r["decode_steps"] for r in result[side]["runs"])
                  for side in ("engine_steps", "engine_continuous")}
        result["decode_steps_ratio_continuous"] = round(median["engine_steps"] / median["engine_continuous"], 3)
    result["target"] = TARGET_RATIO
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
