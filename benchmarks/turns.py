"""Multi-turn generation: does generation wait on tools, and how should a sequence rejoin?

16 prompts x 8 samples (the arithmetic task's chat prompts), at most 32 sequences in flight,
up to ``--turns`` turns a sequence: after each turn but the last, a tool answers with the
same few dozen tokens (a ChatML ``tool`` message and the next assistant prompt). Each
sequence samples from a random stream of its own, so every side makes the same trajectories
(checked: ``same_trajectories``); the sides differ only in how the tools answer and how a
sequence rejoins the batch:

- ``sleep``: the tool sleeps ``--tool-ms`` per call (on a thread, as tool workers answer);
  the sequence's KV is parked meanwhile and only the appended tokens are fed when it rejoins;
- ``no_sleep``: the same trajectories, the tool answering at once;
- ``prefill``: as ``no_sleep``, but a rejoining sequence is fed again whole (its KV made anew);
- ``variable``: as ``no_sleep``, its decode steps only as large as needed (not batch-invariant).

Every side but ``variable`` decodes batch-invariant steps (``TorchEngine(batch_invariant=True)``:
one shape for every step, each prompt prefilled alone), meant to make ``sleep`` and
``no_sleep`` the same trajectories to the last bit whichever sequences share a step;
``same_trajectories`` reports whether they were (docs/agentic.md: what held on SmolLM2).
The sides' sampled tokens differ by well under 1% then, so their rates still compare;
``prefill`` and ``variable`` compute the same sequences with other roundings.

Figures: sampled tokens per second of the whole call (tails included), ``sleep / no_sleep``
(generation does not wait on tools when it is near 1; the bar is 0.8), ``park / prefill``
(``no_sleep`` against ``prefill``: which way to rejoin) and ``invariant / variable`` (what
batch-invariant steps cost). Sides alternate, repeated ``--repeats`` times; the spread of
each ratio over the repetitions is reported.

    python benchmarks/turns.py                       # SmolLM2-135M-Instruct, fp32, CPU
    python benchmarks/turns.py --model tiny-llama --repeats 1 --prompts 4   # a smoke test
    python benchmarks/turns.py --record               # and append the run to benchmarks/record.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Run, append_record, json_safe, loaded, log, ratio_figures, side_order, spread  # noqa: E402

from m2flow.data import arithmetic_problems, build_prompts  # noqa: E402
from m2flow.engines import SamplingParams, TorchEngine  # noqa: E402
from m2flow.models.lm import load_lm  # noqa: E402

SIDES = ("sleep", "no_sleep", "prefill", "variable")
OBSERVATION = "\n<|im_start|>tool\nThe calculator says: {value}. Check it and give the final answer.<|im_end|>\n" \
              "<|im_start|>assistant\n"


def answering(tokenizer, pool: ThreadPoolExecutor, turns: int, sleep_s: float):
    """The ``turn_ended`` hook: a tool's answer after each turn but the last, ``sleep_s`` later."""
    def hook(end):
        if end.turns >= turns:
            return None
        tokens = tokenizer.encode(OBSERVATION.format(value=1000 + 7 * end.prompt_index + end.turns),
                                  add_special_tokens=False)

        def answer():
            if sleep_s:
                time.sleep(sleep_s)
            return tokens
        return pool.submit(answer)
    return hook


def run_side(engine: TorchEngine, prompts: list[list[int]], params: SamplingParams, hook) -> dict:
    wall = time.perf_counter()
    out = [c for group in engine.generate(prompts, params, turn_ended=hook) for c in group]
    wall = time.perf_counter() - wall
    sampled = sum(sum(c.mask) if c.mask else len(c.token_ids) for c in out)
    return {"seconds": round(wall, 3), "sampled_tokens": sampled, "tokens_per_s": round(sampled / wall, 2),
            "turns": sum(c.turns for c in out), **{k: engine.stats[k] for k in ("decode_steps", "tool_waits",
                                                                                 "extend_tokens")},
            "trajectories": {f"{c.prompt_index}.{c.sample_index}": c.token_ids for c in out}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64, help="per turn")
    p.add_argument("--tool-ms", type=float, default=200.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--record", action="store_true", help="append the run to benchmarks/record.jsonl")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    run = Run()
    model, tokenizer = load_lm(args.model)
    prompts = [list(x.token_ids) for x in build_prompts(arithmetic_problems(args.prompts, seed=args.seed), tokenizer)]
    params = SamplingParams(n=args.samples, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=args.seed,
                            max_total_tokens=max(map(len, prompts)) + args.turns * (args.max_new_tokens + 40))
    engines = {side: TorchEngine(model, tokenizer, max_batch_size=args.batch, resume="prefill" if side == "prefill"
                                 else "park", batch_invariant=side != "variable") for side in SIDES}
    pool = ThreadPoolExecutor(args.batch)
    hooks = {side: answering(tokenizer, pool, args.turns, args.tool_ms / 1000 if side == "sleep" else 0.0)
             for side in SIDES}
    with torch.inference_mode():
        for side in SIDES:  # warm-up
            list(engines[side].generate(prompts[:2], SamplingParams(n=2, max_new_tokens=8, seed=1, max_total_tokens=200),
                                        turn_ended=hooks[side]))
        runs = {side: [] for side in SIDES}
        for r in range(args.repeats):
            for side in side_order(SIDES, r):
                result, load = loaded(lambda: run_side(engines[side], prompts, params, hooks[side]))
                runs[side].append(result | load)
                log(f"repeat {r} {side}: {result['tokens_per_s']} tokens/s, {result['seconds']} s")
    first = runs["no_sleep"][0]["trajectories"]
    same = all(x["trajectories"] == first for side in ("sleep", "no_sleep") for x in runs[side])
    for side in SIDES:
        for x in runs[side]:
            del x["trajectories"]
    ratios = {"sleep / no_sleep": [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs["sleep"], runs["no_sleep"])],
              "park / prefill": [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs["no_sleep"], runs["prefill"])],
              "invariant / variable": [a["tokens_per_s"] / b["tokens_per_s"]
                                       for a, b in zip(runs["no_sleep"], runs["variable"])]}
    result = {"benchmark": "turns", "model": args.model, "prompts": args.prompts, "samples": args.samples,
              "batch": args.batch, "turns": args.turns, "max_new_tokens": args.max_new_tokens,
              "tool_ms": args.tool_ms, "repeats": args.repeats, "same_trajectories": same,
              "ratios": {k: spread(v, 3) for k, v in ratios.items()}, "runs": runs, **run.finish(torch=torch.__version__)}
    print(json.dumps(json_safe(result), indent=2))
    if args.record:
        record(result, " ".join(["python", "benchmarks/turns.py", *sys.argv[1:]]))


def record(result: dict, command: str) -> None:
    append_record(result, str(Path(__file__).resolve().parents[1]), command, f"turns/{result['model']}",
                  f"Multi-turn generation, {result['prompts']} prompts x {result['samples']} samples, "
                  f"{result['batch']} in flight, {result['turns']} turns, a tool of {result['tool_ms']:g} ms",
                  ratio_figures(result["ratios"]),
                  "sampled tokens/s over the whole call; sleep / no_sleep near 1: generation does not wait on tools "
                  f"(the same trajectories with and without the sleep: {result['same_trajectories']})")


if __name__ == "__main__":
    main()
