"""Agentic benchmark: m2flow's multi-turn GRPO step against TRL's ``GRPOTrainer(tools=...)``,
side by side in one run.

Protocol, the same for both systems:

  model    SmolLM2-135M-Instruct (fp32, CPU) with TRL's bundled Qwen2.5 chat template, which
           renders tool calls and results with SmolLM2's own ChatML tokens (SmolLM2's template
           drops tool calls, and TRL refuses a template that cannot render them). As shipped, the
           model writes no call; ``--sft-steps`` (default 10) first runs m2flow's supervised warm
           start (``m2flow sft sft/calc_smollm2``, its built-in demonstrations) on that model, so
           that the timed steps call the calculator. Both systems load the directory it writes
           (``--model-dir`` takes one prepared before).
  task     ``agentic/tool_arith_smollm2``'s calculations, in the order m2flow's prompt loader
           draws them; the calculator (``m2flow.tools.calculator:calculator``, the same Python
           function in both) offered through the template's ``tools=``; the prompt token ids
           checked identical in both.
  step     4 prompts x 8 samples = 32 trajectories, temperature 0.7, top-p 1, no top-k, up to
           3 turns (TRL: ``max_tool_calling_iterations`` 2), at most 288 tokens after the prompt
           (the model's and the tools', TRL's ``max_completion_length``; m2flow: a turn of at most
           288 and ``rollout.max_total_tokens`` the longest prompt + 288), lr 1e-5, one optimizer
           step, clip 0.2, group-normalised advantages, no KL term.
  reward   1 if the final answer equals the reference (math-verify,
           ``m2flow.rewards.math:math_reward`` on the last assistant message in TRL, the preset's
           ``math`` reward in m2flow).
  batches  TRL: per_device_train_batch_size 8 x gradient_accumulation_steps 4; m2flow: one group
           a micro-batch (``algorithm.max_tokens_per_micro_batch`` 8 x (longest prompt + 288)).
  threads  every core: TRL ``torch.set_num_threads(cores)``; m2flow one CPU slot per core.

Variants: ``trl`` (its defaults: gradient checkpointing on), ``trl_no_gc``, ``trl_cb`` (no gradient
checkpointing, generation by transformers' continuous batching), ``m2flow_collocated``
(as shipped: completions of zero advantage, whose gradient is zero, are not forwarded) and
``m2flow_collocated_all_rows`` (every row forwarded, as TRL does). Each runs in a fresh
subprocess per round, ``--warmup`` untimed steps then ``--steps`` timed ones; the order flips
from round to round and round r draws its prompts with seed r. The ratios are TRL s/step over
m2flow s/step per round (> 1: m2flow faster), against the faster TRL configuration of each
round, with their spread. Also reported per side: turns, tool calls and completion tokens per
trajectory, and the reward, so that the two sides' work can be compared.

    python benchmarks/agentic_vs_trl.py --record                 # the protocol; appends to benchmarks/record.jsonl
    python benchmarks/agentic_vs_trl.py --model tiny-llama --sft-steps 0 --rounds 1 --steps 1 --turn-tokens 8  # smoke

Prints one JSON object on stdout; progress goes to stderr. Needs TRL (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import Run, append_record, json_safe, loaded, log, ratio_figures, run_child, side_order, spread
from reasoning_vs_trl import ratio_table, trl_clock

PRESET = "agentic/tool_arith_smollm2"
PROMPTS_PER_STEP, SAMPLES, TURNS, TURN_TOKENS, LR, TEMPERATURE = 4, 8, 3, 96, 1e-5, 0.7
MICRO_BATCH = 8
VARIANTS = ("trl", "trl_no_gc", "trl_cb", "m2flow_collocated", "m2flow_collocated_all_rows")
ROOT = Path(__file__).resolve().parents[1]


def budget(turn_tokens: int) -> int:
    """Tokens after the prompt, the model's and the tools': TRL's ``max_completion_length``."""
    return TURNS * turn_tokens


def base_config(model_dir: str, seed: int, turn_tokens: int, longest: int = 0):
    """The preset with the protocol's values (``longest``: the longest prompt of every round,
    0 while it is not known)."""
    from m2flow.config import load_config

    total = budget(turn_tokens)
    overrides = [f"model.path={model_dir}", f"seed={seed}", f"data.prompts_per_step={PROMPTS_PER_STEP}",
                 f"rollout.n={SAMPLES}", f"rollout.max_new_tokens={total}", f"rollout.temperature={TEMPERATURE}",
                 "rollout.top_p=1.0", "rollout.top_k=0", f"tools.max_turns={TURNS}", f"algorithm.lr={LR}",
                 "algorithm.kl_coef=0", "algorithm.name=grpo", "algorithm.loss_agg=token-mean", "algorithm.clip=0.2",
                 "placement.mode=collocated", "runner.progress=false"]
    if longest:
        overrides += [f"rollout.max_total_tokens={longest + total}",
                      f"algorithm.max_tokens_per_micro_batch={MICRO_BATCH * (longest + total)}"]
    return load_config(PRESET, overrides)


def step_prompts(cfg, steps: int) -> list[int]:
    """The indices of the training prompts of m2flow's first ``steps`` steps, in its loader's
    order (the loader's order depends on their number and the seed only)."""
    from m2flow.data import PromptLoader

    loader = PromptLoader(range(cfg.data.train_size), cfg.data.prompts_per_step, seed=cfg.seed)
    return [i for _ in range(steps) for i in next(loader)]


def prepare_model(name: str, root: Path, sft_steps: int) -> str:
    """SmolLM2 (or a tiny model) with TRL's Qwen2.5 template, then ``sft_steps`` of m2flow's
    warm start on it; the directory both systems load."""
    from trl.chat_template_utils import qwen2_5_chat_template

    from m2flow.models.lm import load_lm

    model, tokenizer = load_lm(name)
    tokenizer.chat_template = qwen2_5_chat_template
    out = root / f"{name}-qwen2.5-template"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if not sft_steps:
        return str(out)
    log(f"warm start: {sft_steps} steps of sft/calc_smollm2 on {out}")
    sft = root / "sft"
    subprocess.run([sys.executable, "-m", "m2flow", "sft", "sft/calc_smollm2", f"model.path={out}",
                    f"runner.steps={sft_steps}", f"runner.eval_every={sft_steps}", f"runner.out_dir={sft}",
                    "runner.progress=false"], stdout=sys.stderr, check=True, cwd=root)
    return str(sft / "model")


def longest_prompt(model_dir: str, rounds: int, turn_tokens: int) -> int:
    from m2flow.data.prompts import load_prompts

    return max(len(p["token_ids"]) for r in range(rounds) for p in load_prompts(base_config(model_dir, r, turn_tokens))[0])


# -- TRL ------------------------------------------------------------------------------
def run_trl(spec: dict) -> dict:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from m2flow.data.prompts import GENERATED, load_prompts
    from m2flow.rewards.math import math_reward
    from m2flow.tools.calculator import calculator as m2flow_calculator

    def calculator(expression: str):  # m2flow's, its schema as m2flow offers it (no "return" entry)
        return m2flow_calculator(expression)

    calculator.__doc__ = m2flow_calculator.__doc__
    torch.set_num_threads(spec["threads"])
    steps = spec["warmup"] + spec["steps"]
    cfg = base_config(spec["model_dir"], spec["seed"], spec["turn_tokens"], spec["longest"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"], local_files_only=True)
    drawn = step_prompts(cfg, steps)
    generated = GENERATED[cfg.data.source](cfg.data.train_size, "train", seed=cfg.seed)
    problems = [generated[i] for i in drawn]
    instruction = cfg.data.instruction
    rows = [{"prompt": [{"role": "user", "content": f"{p.question}\n{instruction}" if instruction else p.question}],
             "answer": p.answer} for p in problems]
    theirs = [tokenizer.apply_chat_template(r["prompt"], tools=[calculator], add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"] for r in rows]
    train = load_prompts(cfg)[0]
    ours = [train[i]["token_ids"] for i in drawn]
    if theirs != ours:
        raise RuntimeError("TRL's chat-templated prompt tokens (tools included) differ from m2flow's")

    def math(completions, answer, **_):
        return [math_reward(c[-1]["content"] if isinstance(c, list) else c, a) for c, a in zip(completions, answer)]

    total = budget(spec["turn_tokens"])
    args = trl.GRPOConfig(
        output_dir=spec["out_dir"], max_steps=steps, per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=PROMPTS_PER_STEP * SAMPLES // MICRO_BATCH, num_generations=SAMPLES,
        max_completion_length=total, max_tool_calling_iterations=TURNS - 1, temperature=TEMPERATURE, top_p=1.0,
        top_k=0, learning_rate=LR, beta=0.0, epsilon=0.2, gradient_checkpointing=spec["variant"] == "trl",
        use_transformers_continuous_batching=spec["variant"] == "trl_cb", bf16=False, fp16=False, use_cpu=True,
        shuffle_dataset=False, seed=cfg.seed, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32, local_files_only=True)
    clock = trl_clock()
    trainer = trl.GRPOTrainer(model=model, reward_funcs=math, args=args, train_dataset=Dataset.from_list(rows),
                              processing_class=tokenizer, tools=[calculator], callbacks=[clock])
    trainer.train()
    step_s = [b - a for a, b in zip(clock.marks, clock.marks[1:])]
    if len(step_s) != steps:
        raise RuntimeError(f"expected {steps} optimizer steps, timed {len(step_s)}")
    timed = slice(spec["warmup"], None)
    logs = [row for row in clock.logs if "reward" in row][timed]

    def mean(key: str) -> float | None:
        vals = [r[key] for r in logs if r.get(key) is not None]
        return statistics.fmean(vals) if vals else None

    return {
        "step_s": statistics.fmean(step_s[timed]), "steps_s": step_s[timed], "warmup_s": step_s[:spec["warmup"]],
        "reward": mean("reward"), "completion_tokens": mean("completions/mean_length"),
        "tool_calls": mean("tools/call_frequency"), "tool_failures": mean("tools/failure_frequency"),
        "frac_reward_zero_std": [r.get("frac_reward_zero_std") for r in logs],
        "logged_keys": sorted({k for r in logs for k in r}),
        "settings": {"loss_type": args.loss_type, "gradient_checkpointing": args.gradient_checkpointing,
                     "max_completion_length": args.max_completion_length,
                     "max_tool_calling_iterations": args.max_tool_calling_iterations,
                     "use_transformers_continuous_batching": args.use_transformers_continuous_batching,
                     "torch_threads": torch.get_num_threads()},
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
    }


# -- m2flow ---------------------------------------------------------------------------
def run_m2flow(spec: dict) -> dict:
    from m2flow.runners.agentic import AgenticMetrics, AgenticRunner

    cfg = base_config(spec["model_dir"], spec["seed"], spec["turn_tokens"], spec["longest"])
    cfg.runner.out_dir = spec["out_dir"]
    cfg.algorithm.skip_inert_rows = spec["variant"] != "m2flow_collocated_all_rows"
    with contextlib.redirect_stdout(sys.stderr):
        runner = AgenticRunner(cfg)
        try:
            rows = []
            for i in range(spec["warmup"] + spec["steps"]):
                t0 = time.perf_counter()
                report = runner.step(i)
                dt = time.perf_counter() - t0
                rows.append(AgenticMetrics(0).row(i, report, dt, dt))
                log(f"    step {i + 1}: {dt:.1f} s")
        finally:
            runner.close()
    timed = rows[spec["warmup"]:]

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in timed)

    return {
        "step_s": mean("step_s"), "steps_s": [r["step_s"] for r in timed], "warmup_s": [r["step_s"] for r in rows[:spec["warmup"]]],
        "reward": mean("reward"), "completion_tokens": mean("completion_length"), "turns": mean("turns"),
        "tool_calls": mean("tool_calls"), "tool_error_rate": mean("tool_error_rate"),
        "inert_rows": [r["inert_rows"] for r in timed],
        "split": {k: mean(k) for k in ("rollout_busy_s", "reward_busy_s", "actor_busy_s", "weight_sync_s") if k in timed[0]},
        "settings": {"placement.mode": "collocated", "algorithm.skip_inert_rows": cfg.algorithm.skip_inert_rows,
                     "rollout.max_new_tokens": cfg.rollout.max_new_tokens,
                     "rollout.max_total_tokens": cfg.rollout.max_total_tokens,
                     "algorithm.max_tokens_per_micro_batch": cfg.algorithm.max_tokens_per_micro_batch,
                     "cluster.cpu_slots": cfg.cluster.cpu_slots or os.cpu_count()},
    }


# -- driver ---------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds of every variant, each in a fresh process")
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--model", default="smollm2", help="smollm2, or tiny-llama for a smoke test")
    p.add_argument("--model-dir", help="a model directory prepared before (with a template that renders tool calls)")
    p.add_argument("--sft-steps", type=int, default=10, help="steps of m2flow's warm start before the comparison")
    p.add_argument("--turn-tokens", type=int, default=TURN_TOKENS,
                   help=f"the budget after the prompt is {TURNS} x this (the protocol's {TURN_TOKENS})")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--record", action="store_true", help="append the run to benchmarks/record.jsonl")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        spec = json.loads(args.child)
        result = (run_trl if spec["variant"].startswith("trl") else run_m2flow)(spec)
        Path(spec["result"]).write_text(json.dumps(json_safe(result)))
        return
    for name in ("rounds", "steps", "turn_tokens", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")

    import ray
    import torch
    import transformers
    import trl

    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "ray": ray.__version__,
                "trl": trl.__version__}
    root = Path(tempfile.mkdtemp(prefix="m2flow-agentic-vs-trl-"))
    bench = Run()
    model_dir = args.model_dir or prepare_model(args.model, root, args.sft_steps)
    longest = longest_prompt(model_dir, args.rounds, args.turn_tokens)
    variants = list(dict.fromkeys(args.variants))
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    order = []
    for r in range(args.rounds):
        order.append(side_order(variants, r))
        for variant in order[-1]:
            log(f"[round {r + 1}/{args.rounds}] {variant}: {args.warmup} warm-up + {args.steps} timed steps")
            spec = {"variant": variant, "seed": r, "steps": args.steps, "warmup": args.warmup, "threads": args.threads,
                    "turn_tokens": args.turn_tokens, "model_dir": model_dir, "longest": longest,
                    "out_dir": str(root / f"{variant}-round{r}")}
            res, load = loaded(lambda: run_child(__file__, spec))  # noqa: B023
            runs[variant].append(res | load | {"round": r, "seed": r})
            log(f"  {res['step_s']:.2f} s/step  (steps {', '.join(f'{x:.1f}' for x in res['steps_s'])}), "
                f"tool calls {res['tool_calls']}, load {load['load_before']} -> {load['load_after']}")
    ratios = ratio_table({"beta=0": runs}, args.rounds).get("beta=0", {})
    report = {
        "benchmark": "agentic_vs_trl", "model": args.model, "model_dir": model_dir, "sft_steps": args.sft_steps,
        "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup, "order": order,
        "protocol": {"prompts_per_step": PROMPTS_PER_STEP, "samples": SAMPLES, "turns": TURNS,
                     "tokens_after_prompt": budget(args.turn_tokens), "longest_prompt": longest,
                     "temperature": TEMPERATURE, "lr": LR, "dtype": "float32", "reward": "math"},
        "seconds_per_step": {v: spread([x for res in runs[v] for x in res["steps_s"]], 2) for v in variants},
        "ratios_trl_over_m2flow": ratios,
        "runs": runs,
        **bench.finish(**versions),
    }
    print(json.dumps(json_safe(report), indent=1))
    if args.record:
        record(report, " ".join(["python", "benchmarks/agentic_vs_trl.py", *sys.argv[1:]]))


def record(report: dict, command: str) -> None:
    ratios = {f"{label}, TRL / m2flow s/step":
              report["ratios_trl_over_m2flow"].get(variant, {}).get("vs_fastest_trl", {}).get("spread")
              for variant, label in (("m2flow_collocated", "as shipped"),
                                     ("m2flow_collocated_all_rows", "every row forwarded"))}
    calls = {v: spread([x["tool_calls"] for x in report["runs"][v]], 2) for v in report["runs"]}
    model = {"smollm2": "SmolLM2-135M"}.get(report["model"], report["model"])
    append_record(report, str(ROOT), command, f"agentic_vs_trl/{model}",
                  f"Multi-turn GRPO step with a calculator against TRL's GRPOTrainer(tools=) "
                  f"({', '.join(v for v in report['runs'] if v.startswith('trl'))}; {model}, "
                  f"4 prompts x 8, 3 turns, fp32 on CPU)",
                  ratio_figures(ratios),
                  f"after {report['sft_steps']} warm-start steps; tool calls per trajectory (median over rounds): "
                  + ", ".join(f"{v} {c['median']}" for v, c in calls.items() if c))


if __name__ == "__main__":
    main()
