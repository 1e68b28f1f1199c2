"""bfloat16 against float32 for a reasoning step's two heavy parts, side by side in one run.

``generate``: the rollout engine (``TorchEngine``) samples ``--samples`` completions for each
of ``--prompts`` chat-formatted arithmetic prompts (temperature 0.7, up to ``--max-new-tokens``),
once with the model in float32 and once with it rounded to bfloat16 (``rollout.dtype``). The
completions differ (the rounding changes the draws), so the figure compared is the time per
decoded row (one sequence's token of one decode step), and the time per call is reported too.

``train``: the actor's forward and backward over those float32 completions, their prompts
included (``token_logprobs`` over whole rows, not the trainer's shared-prompt forward; every
token's log-prob summed and backpropagated), in float32 and under bfloat16 autocast
(``model.autocast``): the same tokens on both sides.

Both on ``--threads`` torch threads, the sides in ABAB order over ``--repeats`` repetitions
(each side warmed up first); prints one JSON object: per side the times' spread, and
``ratio`` (float32 time / bfloat16 time: > 1 means bfloat16 is faster) per repetition and
its spread. Whether the CPU has bfloat16 instructions (``avx512_bf16``, ``amx_bf16``) is
reported: without them torch emulates bfloat16 (not measured here).

    python benchmarks/precision.py                       # SmolLM2-135M-Instruct, 1 thread
    python benchmarks/precision.py --model tiny-llama    # fast smoke test
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Run, json_safe, loaded, log, side_order, spread  # noqa: E402

from m2flow.data import arithmetic_problems, build_prompts  # noqa: E402
from m2flow.engines import SamplingParams, TorchEngine  # noqa: E402
from m2flow.engines.batch import SequenceBatch  # noqa: E402
from m2flow.engines.scoring import autocast, token_logprobs  # noqa: E402
from m2flow.models.lm import load_lm  # noqa: E402

SIDES = ("float32", "bfloat16")


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in flags if "bf16" in f)


def generate(engine: TorchEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    start = time.perf_counter()
    completions = [c for group in engine.generate(prompts, params) for c in group]
    seconds = time.perf_counter() - start
    rows = engine.stats["decoded_rows"] + len(completions)  # decode rows, and each first token (prefill)
    return {"s": seconds, "ms_per_row": 1000 * seconds / rows, "tokens": sum(len(c.token_ids) for c in completions),
            "completions": completions}


def train(model, batch: SequenceBatch, dtype: torch.dtype | None) -> dict:
    start = time.perf_counter()
    with autocast(torch.device("cpu"), dtype):
        logprobs, _ = token_logprobs(model, batch, 0.7, False)
    logprobs.sum().backward()
    model.zero_grad(set_to_none=True)
    return {"s": time.perf_counter() - start}


def alternate(what: str, repeats: int, run: Callable[[str], dict]) -> dict[str, list[dict]]:
    """``run(side)`` for both sides, ABAB over ``repeats`` repetitions: per side, each
    repetition's result with the load before and after it."""
    results: dict[str, list[dict]] = {s: [] for s in SIDES}
    for r in range(repeats):
        for side in side_order(SIDES, r):
            result, load = loaded(lambda: run(side))
            results[side].append(result | load)
            log(f"{what} {side}: {result['s']:.2f} s")
    return results


def per_side(results: dict[str, list[dict]], *keys: str) -> dict[str, dict]:
    """Per side: each of ``keys``'s spread over the repetitions, and the loads around them."""
    return {s: {**{k: spread((x[k] for x in results[s]), 3) for k in keys},
                "load": [[x["load_before"], x["load_after"]] for x in results[s]]} for s in SIDES}


def ratios(results: dict[str, list[dict]], key: str) -> list[float]:
    """float32's ``key`` over bfloat16's, repetition by repetition."""
    return [round(a[key] / b[key], 3) for a, b in zip(results["float32"], results["bfloat16"])]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    bench = Run()
    model, tok = load_lm(args.model)
    model.requires_grad_(False)
    rounded = copy.deepcopy(model).to(torch.bfloat16)
    engines = {"float32": TorchEngine(model, tok), "bfloat16": TorchEngine(rounded, tok)}
    problems = arithmetic_problems(args.prompts + 1, seed=0)
    prompts = [list(p.token_ids) for p in build_prompts(problems, tok)]
    warm, prompts = prompts[:1], prompts[1:]
    params = SamplingParams(n=args.samples, temperature=0.7, max_new_tokens=args.max_new_tokens, seed=1)
    for engine in engines.values():
        generate(engine, warm, params)
    gen = alternate("generate", args.repeats, lambda side: generate(engines[side], prompts, params))
    # The actor's work: the float32 side's last completions, the same tokens for both sides.
    completions = gen["float32"][-1]["completions"]
    batch = SequenceBatch.from_completions([prompts[c.prompt_index] for c in completions],
                                           [c.token_ids for c in completions], pad_id=tok.pad_token_id or 0)
    model.requires_grad_(True).train()
    dtypes = {"float32": None, "bfloat16": torch.bfloat16}
    for side in SIDES:
        train(model, batch, dtypes[side])
    trained = alternate("train", args.repeats, lambda side: train(model, batch, dtypes[side]))
    generated = per_side(gen, "s", "ms_per_row")
    for side in SIDES:
        generated[side]["tokens"] = [x["tokens"] for x in gen[side]]
    report = {
        "model": args.model, "threads": args.threads, "prompts": args.prompts, "samples": args.samples,
        "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "cpu_bf16_flags": cpu_flags(),
        "generate": {**generated, "ratio_per_row": ratios(gen, "ms_per_row"), "ratio_per_call": ratios(gen, "s"),
                     "ratio_per_row_spread": spread(ratios(gen, "ms_per_row"), 3)},
        "train": {"tokens": int(batch.attention_mask.sum()), "rows": len(batch), **per_side(trained, "s"),
                  "ratio": ratios(trained, "s"), "ratio_spread": spread(ratios(trained, "s"), 3)},
        **bench.finish(torch=torch.__version__),
    }
    print(json.dumps(json_safe(report), indent=1))


if __name__ == "__main__":
    main()
