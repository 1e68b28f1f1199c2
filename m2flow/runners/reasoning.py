"""Reasoning RL: LM rollout, reward, inference and actor, as one short loop.

The loop in ``step`` is the same in every placement mode. Collocated, the components share
every device and take turns under the device locks: the rollout generates the whole batch,
then frees its KV cache (and on a GPU its weights) while the inference worker and the actor
use the devices; the actor's optimizer state leaves while the rollout generates. Pipelined,
the rollout has devices of its own and streams each group of completions on as soon as it
is complete: reward, reference/old log-probs and the actor's forward and backward (unless
its ranks are sharded) run on the first groups while the rollout still generates the rest. With ``algorithm.name=ppo`` a
critic sits between the inference worker and the actor: it adds values and GAE advantages.
"""

from __future__ import annotations

import math
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from m2flow.config.schema import ReasoningAlgorithmConfig
from m2flow.config.validate import check_values, resolved, validate
from m2flow.runners.metrics import RunLog
from m2flow.runtime import Channel, Cluster, DeviceLock, Placement, WorkerGroup
from m2flow.runtime.group import start_together, wait
from m2flow.workers.inference import InferenceWorker
from m2flow.workers.lm_actor import LMActorWorker
from m2flow.workers.lm_critic import LMCriticWorker
from m2flow.workers.lm_rollout import LMRolloutWorker
from m2flow.workers.reward import RewardWorker

COMPONENTS = ("rollout", "reward", "inference", "actor")
SINGLE_RANK = ("reward", "inference", "critic")  # each is one rank: the stream passes through it in order


def components_of(cfg: DictConfig) -> tuple[str, ...]:
    """The components a run creates: a critic only for ppo."""
    return (*COMPONENTS, "critic") if cfg.algorithm.name == "ppo" else COMPONENTS


def placement_config(cfg: DictConfig, num_devices: int, kind: str,
                     components: tuple[str, ...] = COMPONENTS) -> dict[str, Any]:
    """Device ranges per component for a placement mode.

    collocated: every component on every device; pipelined: the rollout on the first half
    of the devices, reward, inference, critic and actor on the second; hybrid: like
    pipelined, but the actor has a rank on every device, so the ranks beside the rollout join
    in once it has generated the step's batch; custom: ``placement.components`` as given. On
    CPU slots a component's devices form one rank (its threads span them), except the hybrid
    actor's; on GPUs, rollout and actor get a rank per device.
    """
    last = num_devices - 1
    if cfg.mode == "custom":
        given = OmegaConf.to_container(cfg.components, resolve=True)
        missing = [c for c in components if given.get(c) is None]
        if missing:
            raise ValueError(f"placement.mode=custom needs placement.components for {missing}")
        return {c: given[c] for c in components}
    if cfg.mode == "collocated":
        ranges = {c: f"0-{last}" for c in components}
    elif cfg.mode in ("pipelined", "hybrid"):
        if num_devices < 2:
            raise ValueError(f"placement.mode={cfg.mode} needs >= 2 devices (set cluster.cpu_slots=2 to run it on one core)")
        half = num_devices // 2
        rest = f"{half}-{last}"
        ranges = {"rollout": f"0-{half - 1}", "reward": rest, "inference": rest,
                  "actor": rest if cfg.mode == "pipelined" else f"0-{last}"}
        if "critic" in components:  # beside the inference worker, whose output it takes
            ranges["critic"] = rest
    else:
        raise ValueError(f"unknown placement.mode {cfg.mode!r}: collocated | pipelined | hybrid | custom")

    def span(r: str) -> int:
        lo, hi = (int(x) for x in r.split("-"))
        return hi - lo + 1

    out: dict[str, Any] = {}
    for c, r in ranges.items():
        whole = (kind == "cpu" and not (cfg.mode == "hybrid" and c == "actor")) or c in SINGLE_RANK
        out[c] = {"devices": r, "devices_per_proc": span(r)} if whole and span(r) > 1 else r
    return out


def check_config(cfg: DictConfig) -> None:
    """Config errors that would otherwise surface deep inside a worker: the checks of
    ``m2flow.config.validate`` (run when the config is loaded, again here for a config
    changed since). Raises a ``ConfigError``."""
    validate(cfg)


def check_ppo_config(a: DictConfig) -> None:
    """The algorithm section's keys in range, the critic's (ppo) among them."""
    check_values(resolved(a), ReasoningAlgorithmConfig, "algorithm.")


def load_prompts(cfg: DictConfig) -> tuple[list[dict], list[dict]]:
    """(train, test) prompts as ``{"index", "token_ids", "answer"}``, chat-formatted with
    the model's own tokenizer."""
    from m2flow.data import arithmetic_problems, build_prompts, load_problems
    from m2flow.models.lm import load_tokenizer

    d = cfg.data
    if d.source == "arithmetic":
        levels = list(d.levels)
        train = arithmetic_problems(d.train_size, levels, "train", seed=cfg.seed)
        test = arithmetic_problems(d.test_size, levels, "test", seed=cfg.seed)
    else:
        problems = load_problems(d.source, d.question_key, d.answer_key)
        if len(problems) <= d.test_size:
            raise ValueError(f"data.source={d.source}: {len(problems)} problems, not enough to hold out "
                             f"data.test_size={d.test_size} and train on the rest")
        cut = len(problems) - d.test_size  # the last test_size rows are held out
        train, test = problems[:cut], problems[cut:]
    tokenizer = load_tokenizer(cfg.model.path)

    def rows(problems):
        return [{"index": i, "token_ids": list(p.token_ids), "answer": p.problem.answer}
                for i, p in enumerate(build_prompts(problems, tokenizer, d.instruction))]

    return rows(train), rows(test)


class ReasoningRunner:
    def __init__(self, cfg: DictConfig, cluster: Cluster | None = None):
        from m2flow.data import PromptLoader

        check_config(cfg)
        self.cfg = cfg
        c = cfg.cluster
        self._own_cluster = cluster is None
        self.cluster = cluster or Cluster(c.address, num_cpus=c.num_cpus, cpu_slots=c.cpu_slots)
        components = components_of(cfg)
        ranges = placement_config(cfg.placement, len(self.cluster.devices), self.cluster.device_kind, components)
        self.placement = Placement.from_config(ranges, self.cluster)
        for name in (c for c in SINGLE_RANK if c in components):
            if self.placement[name].world_size != 1:
                raise ValueError(f"placement: {name} must be one rank, got {self.placement[name].world_size}")
        self.train_prompts, self.test_prompts = load_prompts(cfg)
        if cfg.data.prompts_per_step > len(self.train_prompts):
            raise ValueError(f"data.prompts_per_step={cfg.data.prompts_per_step} > {len(self.train_prompts)} train prompts")
        self.loader = PromptLoader(self.train_prompts, cfg.data.prompts_per_step, seed=cfg.seed)
        plain = OmegaConf.to_container(cfg, resolve=True)
        run = uuid.uuid4().hex[:6]
        self.names = {n: f"{n}-{run}" for n in components}
        devices = {n: {d.index for r in self.placement[n].ranks() for d in r.devices} for n in components}
        # Components that share a device with another (the reward aside: it holds no model)
        # take turns on it.
        heavy = [n for n in components if n != "reward"]
        turns = {n: any(devices[n] & devices[m] for m in heavy if m != n) for n in heavy}
        # Lock actors live as long as the process that made them: the driver.
        locks = DeviceLock(sorted(set().union(*devices.values())), holder="driver") if any(turns.values()) else None
        # The groups start their processes in parallel (importing torch and transformers and
        # building a model take seconds each).
        self.rollout = WorkerGroup(LMRolloutWorker, self.placement["rollout"], args=(plain, turns["rollout"]),
                                   name=self.names["rollout"], wait=False)
        self.reward = WorkerGroup(RewardWorker, self.placement["reward"], args=(plain,), name=self.names["reward"],
                                  wait=False)
        self.inference = WorkerGroup(InferenceWorker, self.placement["inference"], args=(plain, turns["inference"]),
                                     name=self.names["inference"], wait=False)
        self.actor = WorkerGroup(LMActorWorker, self.placement["actor"], args=(plain, turns["actor"]),
                                 name=self.names["actor"], wait=False)
        self.critic = None
        if "critic" in components:
            self.critic = WorkerGroup(LMCriticWorker, self.placement["critic"], args=(plain, turns["critic"]),
                                      name=self.names["critic"], wait=False)
        # Actor ranks take batches one at a time, so that a rank that is free takes the next.
        self.channels = {n: Channel.create(f"{n}-{run}", prefetch=1 if n == "batches" else 16)
                         for n in ("samples", "scored", "batches") + (("logprobs",) if self.critic else ())}
        start_together(*self.groups, channels=list(self.channels.values()), locks=locks)
        self.pending: tuple[int, dict[str, Any]] | None = None  # a stream started ahead (runner.collect_ahead)
        self.streams = 0  # streams launched: each step's is keyed by its number
        self.sharded = cfg.algorithm.get("data_parallel", "replicate") == "fsdp" and self.actor.world_size > 1

    def sync_weights(self) -> dict:
        """Actor rank 0 sends versioned weights, in buckets, to the rollout ranks and, when it
        recomputes old log-probs, the inference rank. Only receivers are sent to: a message
        nobody takes would pin the sender's shared-memory segment for good."""
        start = time.perf_counter()
        receivers = [self.rollout] + ([self.inference] if self.cfg.algorithm.old_logprobs == "recompute" else [])
        senders = None if self.sharded else [0]  # sharded: every actor rank helps gather the weights
        (pushed, *_), *_ = wait(self.actor.call("push_weights", [g.name for g in receivers], ranks=senders),
                                *(g.pull_weights(self.names["actor"]) for g in receivers))
        return pushed | {"weight_sync_s": time.perf_counter() - start}

    def launch(self, prompts: list[dict]) -> tuple[int, dict[str, Any]]:
        """Starts one step's stream, up to the batches channel: rollout -> reward -> inference
        (-> critic). The stream has a channel key of its own: a reader that prefetches can
        then never take items of the next step's stream, generated ahead into the same channels.
        Returns the key and the calls."""
        self.streams += 1
        key = self.streams
        samples, scored, batches = self.channels["samples"], self.channels["scored"], self.channels["batches"]
        calls = {"rollout": self.rollout.generate(prompts, samples, self.cfg.placement.granularity, key),
                 "reward": self.reward.score(samples, scored, len(prompts), key)}
        if self.critic:  # ppo: the critic adds values, advantages and returns on the way to the actor
            logprobs = self.channels["logprobs"]
            calls["inference"] = self.inference.logprobs(scored, logprobs, 1, key)
            calls["critic"] = self.critic.train(logprobs, batches, self.actor.world_size, key)
        else:
            calls["inference"] = self.inference.logprobs(scored, batches, self.actor.world_size, key)
        return key, calls

    def step(self, generate_next: bool = False) -> dict[str, Any]:
        """One policy update: the macro flow. Returns what each component reported.

        On-policy, the actor trains on the completions of the weights it starts from, as they
        stream in. With ``generate_next``, the next step's rollout starts with those weights as
        soon as this step's rollout is done, and runs while the actor trains: its data is then
        one version old (the ratio is taken against the log-probs it was sampled with)."""
        if self.pending is None:  # nothing generated ahead: the first step, or the one after a pause
            sync, (key, calls) = self.sync_weights(), self.launch(next(self.loader))
            ahead = self.launch(next(self.loader)) if generate_next else None  # same weights: it queues behind
        else:
            key, calls = self.pending
            # The receivers of the weights are done with this step's stream (the calls of one
            # worker run in order, so waiting is what a sync would do anyway).
            receivers = ["rollout"] + (["inference"] if self.cfg.algorithm.old_logprobs == "recompute" else [])
            wait(*(calls[n] for n in receivers))
            sync = self.sync_weights() if generate_next else {"weight_sync_s": 0.0}
            ahead = self.launch(next(self.loader)) if generate_next else None
        calls = calls | {"actor": self.actor.train(self.channels["batches"], key)}
        self.pending = ahead
        return dict(zip(calls, wait(*calls.values()))) | {"sync": sync}

    def wait_ahead(self) -> None:
        """Blocks until the stream a step started ahead (if any) is generated, scored and
        batched: what ``step(generate_next=True)`` leaves running when it returns."""
        if self.pending is not None:
            wait(*self.pending[1].values())

    def evaluate(self) -> dict[str, float]:
        """Mean reward of one greedy completion per held-out prompt (accuracy, with a 0/1 reward)."""
        self.sync_weights()
        texts = self.rollout.complete(self.test_prompts, 0.0).wait()
        (scores,) = self.reward.score_texts(texts, [p["answer"] for p in self.test_prompts]).wait()
        return {f"eval_{k}": v for k, v in scores.items()}

    def train(self) -> list[dict[str, float]]:
        r = self.cfg.runner
        log = RunLog(r.out_dir, r.steps, x="step", y="eval_reward", progress=r.progress)
        try:
            return self._train(log)
        finally:
            log.close()

    def _train(self, log: RunLog) -> list[dict[str, float]]:
        r = self.cfg.runner
        first = self.resume(r.resume, log) if r.get("resume") else 0
        log.note(self.cluster.describe() + "\n" + self.placement.describe()
                 + f"\n{self.cfg.algorithm.name}: steps {first}-{r.steps - 1} of {self.cfg.data.prompts_per_step} "
                   f"prompts x {self.cfg.rollout.n} samples; granularity {self.cfg.placement.granularity} group(s)")
        start = time.perf_counter()
        if first == 0:
            log.record({"step": 0, "time_s": 0.0, **self.evaluate()}, "evaluated")
        for step in range(first, r.steps):
            t0 = time.perf_counter()
            done = step + 1 == r.steps
            evaluating = done or (bool(r.eval_every) and (step + 1) % r.eval_every == 0)
            saving = done or (bool(r.checkpoint_every) and (step + 1) % r.checkpoint_every == 0)
            # Nothing is generated past an evaluation or a checkpoint (which holds no stream in flight).
            report = self.step(generate_next=bool(r.get("collect_ahead")) and not (evaluating or saving))
            if step == first:
                sync = report["sync"]
                log.note(f"weights: {sync['weight_mb']:.0f} MB in {sync['weight_buckets']} bucket(s) "
                         f"by {sync['weight_transport']}")
            row = step_row(step + 1, report, time.perf_counter() - t0, time.perf_counter() - start)
            if evaluating:
                row |= self.evaluate()
            log.record(row, f"reward {row['reward']:.3f}  {row['step_s']:.1f} s/step")
            if saving:
                self.checkpoint(step + 1)
        return log.history

    # -- checkpoints -----------------------------------------------------------------
    def _trained(self) -> dict[str, WorkerGroup]:
        """The components whose state a checkpoint holds."""
        return {"rollout": self.rollout, "actor": self.actor} | ({"critic": self.critic} if self.critic else {})

    def checkpoint(self, steps_done: int) -> Path:
        groups = self._trained()
        states = dict(zip(groups, wait(*(g.state() for g in groups.values()))))
        path = Path(self.cfg.runner.out_dir) / "checkpoints" / f"step_{steps_done:06d}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"steps_done": steps_done, "loader": self.loader.state_dict(), **states,
                    "config": OmegaConf.to_container(self.cfg, resolve=True)}, path)
        return path

    def resume(self, path: str, log: RunLog) -> int:
        ckpt = torch.load(path, weights_only=False)
        groups = self._trained()
        for name, group in groups.items():
            if name not in ckpt:
                raise ValueError(f"checkpoint {path} has no {name} state (a run with algorithm.name="
                                 f"{ckpt['config']['algorithm']['name']}): resume with the same algorithm")
            if len(ckpt[name]) != group.world_size:
                raise ValueError(f"checkpoint {path} has {len(ckpt[name])} {name} rank(s), this placement has "
                                 f"{group.world_size}: resume with the same placement")
        wait(*(group.load_state(ckpt[name]) for name, group in groups.items()))
        self.loader.load_state_dict(ckpt["loader"])
        log.history = [row for row in log.read_csv() if row["step"] <= ckpt["steps_done"]]
        return ckpt["steps_done"]

    @property
    def groups(self) -> list[WorkerGroup]:
        """The run's worker groups (a critic only for ppo)."""
        return [g for g in (self.rollout, self.reward, self.inference, self.actor, self.critic) if g is not None]

    def close(self) -> None:
        for channel in self.channels.values():
            channel.destroy()
        wait(self.reward.close())
        for g in self.groups:
            g.shutdown()
        if self._own_cluster:
            self.cluster.shutdown()


def step_row(step: int, report: dict[str, Any], step_s: float, time_s: float) -> dict[str, float]:
    """The metrics of one step (documented in docs/reasoning.md)."""
    rollout, (reward,), (inference,), actor = report["rollout"], report["reward"], report["inference"], report["actor"]
    row: dict[str, float] = {"step": step, "time_s": time_s, "step_s": step_s}
    row |= {k: v for k, v in reward.items() if k not in ("busy_s", "idle_s")}
    row["completion_tokens"] = sum(r["completion_tokens"] for r in rollout)
    row["completion_length"] = row["completion_tokens"] / max(1, sum(r["completions"] for r in rollout))
    row["truncated"] = sum(r["truncated"] for r in rollout) / max(1, sum(r["completions"] for r in rollout))
    row["rollout_tokens_per_s"] = row["completion_tokens"] / max(max(r["busy_s"] for r in rollout), 1e-9)
    skip = ("busy_s", "idle_s", "lock_wait_s", "time_s", "peak_memory_mb", "version", "tokens", "micro_batches",
            "completion_tokens", "optimizer_steps", "skipped_steps", "inert_rows")
    row |= {k: v for k, v in actor[0].items() if k not in skip}
    row["optimizer_steps"] = actor[0].get("optimizer_steps", math.nan)
    row["inert_rows"] = sum(r.get("inert_rows", 0) for r in actor)
    if "logprob_diff_max" in inference:
        row["logprob_diff_max"] = inference["logprob_diff_max"]
    row |= {k: report["sync"].get(k, 0.0) for k in ("weight_sync_s", "weight_mb")}  # 0: no sync this step
    parts = [("rollout", rollout), ("reward", [reward]), ("inference", [inference]), ("actor", actor)]
    if "critic" in report:
        (critic,) = report["critic"]
        row |= {k: v for k, v in critic.items() if k not in ("busy_s", "idle_s", "peak_memory_mb")}
        parts.append(("critic", [critic]))
    for name, ranks in parts:
        for k in ("busy_s", "idle_s"):
            row[f"{name}_{k}"] = sum(r[k] for r in ranks) / len(ranks)
        if "peak_memory_mb" in ranks[0]:
            row[f"{name}_peak_memory_mb"] = max(r["peak_memory_mb"] for r in ranks)
    return row
