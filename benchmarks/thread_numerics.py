"""Whether the rollout's samples depend on how many threads generate them (a plan's devices).

The rollout engine (``TorchEngine``) samples ``--samples`` completions for each of
``--prompts`` chat-formatted arithmetic prompts (temperature 0.7, up to ``--max-new-tokens``,
one sampling seed) on 1 thread and on ``--threads`` threads, in float32 and with the model
rounded to bfloat16 (``rollout.dtype``). A plan that gives the rollout one CPU slot instead of
two changes just that. Prints one JSON object: per dtype, how many completions came out token
for token the same (matched by prompt and sample index) and, for the others, the position of
their first differing token. Not a timing: what it tells is why two on-policy runs of one
seed in two plans part ways (docs/async-grpo-runs.md, the asynchronous GRPO pairs).

    python benchmarks/thread_numerics.py                      # SmolLM2-135M-Instruct
    python benchmarks/thread_numerics.py --model tiny-llama   # fast smoke test
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Run  # noqa: E402

from m2flow.data import arithmetic_problems, build_prompts  # noqa: E402
from m2flow.engines import SamplingParams, TorchEngine  # noqa: E402
from m2flow.models.lm import load_lm  # noqa: E402


def completions(model, tok, prompts: list[list[int]], params: SamplingParams, threads: int) -> list[list[int]]:
    """Every completion's tokens, ordered by (prompt, sample)."""
    torch.set_num_threads(threads)
    got = [c for group in TorchEngine(model, tok).generate(prompts, params) for c in group]
    return [c.token_ids for c in sorted(got, key=lambda c: (c.prompt_index, c.sample_index))]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=int, default=2, help="compared with 1 thread")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    bench = Run()
    model, tok = load_lm(args.model)
    model.requires_grad_(False)
    models = {"float32": model, "bfloat16": copy.deepcopy(model).to(torch.bfloat16)}
    prompts = [list(q.token_ids) for q in build_prompts(arithmetic_problems(args.prompts, seed=0), tok)]
    params = SamplingParams(n=args.samples, temperature=0.7, max_new_tokens=args.max_new_tokens, seed=1)
    report = {"model": args.model, "threads": [1, args.threads], "prompts": args.prompts, "samples": args.samples,
              "max_new_tokens": args.max_new_tokens}
    for dtype, m in models.items():
        one, many = (completions(m, tok, prompts, params, t) for t in (1, args.threads))
        apart = sorted(first_difference(a, b) for a, b in zip(one, many) if a != b)
        report[dtype] = {"identical": len(one) - len(apart), "completions": len(one),
                         "first_difference_at_token": apart}
    print(json.dumps(report | bench.finish(torch=torch.__version__), indent=1))


if __name__ == "__main__":
    main()
