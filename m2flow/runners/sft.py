"""Supervised fine-tuning (``m2flow sft``): the actor learns the assistant's turns of chats.

    data --batches--> actor

The data worker holds the run's chats, tokenized as the agentic rollout makes a trajectory
(``m2flow.data.chats``: the loss on the tokens the assistant wrote, tool calls included) and
packed into rows of at most ``data.max_tokens`` (each chat attending to itself only). Each step
it sends ``data.rows_per_step`` rows to the actor's ranks, in an order drawn anew each epoch
from the run's seed, so that a resumed run takes the rows the run would have taken. The actor
takes a supervised step (``algorithm.name=sft``: the mean negative log-likelihood of those
tokens) with the trainer, checkpoints and Plan of the other flows. Every ``runner.eval_every``
steps (and before the first, and after the last) ``eval_loss``: that of the held-out chats.
At the end, the weights and tokenizer as a transformers checkpoint, ``<runner.out_dir>/model``:
a run with ``model.path=<runner.out_dir>/model`` (an RL run, say) starts from them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Mapping

import torch
from omegaconf import MISSING, DictConfig, OmegaConf

from m2flow.config.schema import (AT_LEAST_1, BaseConfig, ModelConfig, ReasoningAlgorithmConfig,
                                  ReasoningPlacementConfig, ReasoningRunnerConfig, opt, section)
from m2flow.config.validate import ConfigError, check_custom_placement, check_model
from m2flow.data.chats import DEMONSTRATIONS, load_chats, packed_rows
from m2flow.engines.batch import SequenceBatch
from m2flow.flow import Plan, Workflow
from m2flow.flow.simulate import Shape
from m2flow.runners import reasoning
from m2flow.runners.base import Runner
from m2flow.runners.flow import Flow
from m2flow.runners.metrics import Ledger, component_times, trained_stats
from m2flow.runtime import Channel, Clock, Worker
from m2flow.runtime.group import GroupHandle
from m2flow.workers.lm_actor import LMActorWorker
from m2flow.workers.lm_common import END
from m2flow.workers.reports import Report

COMPONENTS = ("data", "actor")


@dataclass
class SFTDataConfig:
    source: str = opt(MISSING, "the chats: a .jsonl file of {messages, tools} rows (OpenAI's message format) | "
                               "calculation (demonstrations: the calculator tool on the built-in calculations) | "
                               "invented (the search tool on the built-in questions about invented entities)")
    train_size: int = opt(1024, "calculation, invented: demonstrations made for training", within=AT_LEAST_1)
    test_size: int = opt(MISSING, "held-out chats: a file's last rows, or made (calculation, invented)",
                         within=AT_LEAST_1)
    instruction: str = opt("Put the final answer in \\boxed{}.", "calculation, invented: appended to every question")
    max_tokens: int = opt(1024, "a packed row's tokens at most (a longer chat is cut to it)", within=AT_LEAST_1)
    rows_per_step: int = opt(MISSING, "packed rows per update", within=AT_LEAST_1)


@dataclass
class SFTAlgorithmConfig(ReasoningAlgorithmConfig):
    name: str = opt("sft", "sft: the negative log-likelihood of the assistant's tokens", choices=("sft",))
    critic_lr: float = opt(1.0, "unused: no critic")


@dataclass
class SFTPlacementConfig(ReasoningPlacementConfig):
    components: Dict[str, Any] = opt(dict.fromkeys(COMPONENTS), "mode custom: device ranges per component")


@dataclass
class SFTConfig(BaseConfig):
    flow: str = opt("sft", "which macro flow runs it")
    model: ModelConfig = section(ModelConfig, "the language model to fine-tune")
    data: SFTDataConfig = section(SFTDataConfig, "the chats")
    algorithm: SFTAlgorithmConfig = section(SFTAlgorithmConfig, "the objective and its optimiser")
    runner: ReasoningRunnerConfig = section(ReasoningRunnerConfig, "the training loop")
    placement: SFTPlacementConfig = section(SFTPlacementConfig, "which devices each component runs on")


def check(d: Mapping, training: bool = True) -> None:  # the rules between keys, on the resolved config
    check_model(d["model"]["path"])
    check_custom_placement(d["placement"], COMPONENTS)
    if d["algorithm"]["kl_coef"]:
        raise ConfigError("algorithm.kl_coef", "must be 0: this flow has no reference model")
    if d["algorithm"]["data_parallel"] != "replicate":
        raise ConfigError("algorithm.data_parallel", "must be replicate: the supervised flow does not shard yet")
    source = d["data"]["source"]
    if source not in DEMONSTRATIONS and not Path(source).is_file():
        raise ConfigError("data.source", f"no file {source!r} (a .jsonl of chats, or {' | '.join(DEMONSTRATIONS)})")


def chats(cfg: Mapping) -> tuple[list[dict], list[dict]]:
    """(train, held-out) chats: a file's last ``test_size`` rows are held out."""
    d = cfg["data"]
    if d["source"] in DEMONSTRATIONS:
        made = DEMONSTRATIONS[d["source"]]
        return (made(d["train_size"], "train", cfg["seed"], d["instruction"]),
                made(d["test_size"], "test", cfg["seed"], d["instruction"]))
    rows = load_chats(d["source"])
    if len(rows) <= d["test_size"]:
        raise ValueError(f"data.source={d['source']} has {len(rows)} chats, not enough to hold out "
                         f"{d['test_size']} and train on the rest")
    return rows[:-d["test_size"]], rows[-d["test_size"]:]


@dataclass(kw_only=True)
class DataReport(Report):
    rows: int = 0  # packed rows sent
    tokens: int = 0  # their tokens
    learned: int = 0  # of them, the assistant's (in the loss)


class DataWorker(Worker):
    def __init__(self, cfg: dict, train: list[dict], test: list[dict]):
        """``train``, ``test``: the chats (read by the driver: a file need not be on this node)."""
        from m2flow.models.lm import load_tokenizer

        tokenizer = load_tokenizer(cfg["model"]["path"])
        size = cfg["data"]["max_tokens"]
        self.train, self.test = packed_rows(train, tokenizer, size), packed_rows(test, tokenizer, size)
        self.per_step, self.seed = cfg["data"]["rows_per_step"], cfg["seed"]
        self.orders: dict[int, list[int]] = {}  # epoch -> its order of the rows

    def rows_of(self, step: int) -> list[tuple[int, int]]:
        """Step ``step``'s rows as (row, epoch): each epoch a new order, drawn from the seed."""
        n, out = len(self.train), []
        for k in range(step * self.per_step, (step + 1) * self.per_step):
            epoch = k // n
            if epoch not in self.orders:
                self.orders[epoch] = random.Random(f"m2flow-sft:{self.seed}:{epoch}").sample(range(n), n)
            out.append((self.orders[epoch][k % n], epoch))
        return out

    def batches(self, batches_out: Channel, step: int, version: int, readers: int, key: int = 0) -> DataReport:
        """Step ``step``'s rows to the actor's ``readers`` ranks (a share each, then the end marker)."""
        clock, ids = Clock(), self.rows_of(step)
        with clock.busy():
            batch = self.train.select([row for row, _ in ids])
            batch.ids, batch.extras["version"] = torch.tensor(ids), version
            for share in torch.arange(len(batch)).tensor_split(readers):
                if len(share):
                    batches_out.put(batch.select(share), key)
            for _ in range(readers):
                batches_out.put(END, key)
            batches_out.flush()
        return DataReport(**clock.report(), rows=len(batch), tokens=int(batch.attention_mask.sum()),
                          learned=int(batch.completion_mask.sum()), collected=ids)

    def held_out(self) -> SequenceBatch:
        return self.test


class SFTRunner(Runner):
    def prepare(self) -> None:
        self.plain = OmegaConf.to_container(self.cfg, resolve=True)
        try:
            self.chats = chats(self.plain)  # a file that is no chat file fails before any process starts
        except (ValueError, OSError) as e:
            raise ConfigError("data.source", str(e)) from None
        from m2flow.models.lm import max_positions

        room = max_positions(self.cfg.model.path)
        if room is not None and self.cfg.data.max_tokens > room:
            raise ConfigError("data.max_tokens", f"{self.cfg.data.max_tokens} passes the {room} positions of "
                                                 f"{self.cfg.model.path}: a chat is cut to data.max_tokens")
        self.total = self.cfg.runner.steps
        self.metrics = SFTMetrics(self.total)
        # the actor's: no rollout, its log-probs at temperature 1 (Dr. GRPO's constant length unused)
        self.actor_cfg = self.plain | {"rollout": {"temperature": 1.0, "max_new_tokens": self.cfg.data.max_tokens}}

    def worker_args(self, component: str, take_turns: bool) -> tuple:
        return (self.plain, *self.chats) if component == "data" else (self.actor_cfg, take_turns, self.plan.offload)

    def launch(self, key: int, trained_by: int) -> dict[str, GroupHandle]:
        """The rows of the step that the weights of version ``trained_by`` train on: step ``trained_by``."""
        return {"data": self.groups["data"].batches(self.channels["batches"], trained_by, trained_by,
                                                    self.groups["actor"].world_size, key)}

    # the reasoning flow's: the actor trains on the stream's batches; evaluated before the first
    # step, every runner.eval_every steps and after the last
    step, evaluates = reasoning.ReasoningRunner.step, reasoning.ReasoningRunner.evaluates

    def evaluate(self) -> dict[str, float]:
        (held_out,) = self.groups["data"].held_out().wait()
        return {"eval_loss": self.groups["actor"].held_out_loss(held_out, ranks=[0]).wait()[0]}

    def describe(self, first: int) -> str:
        return f"sft: steps {first}-{self.total - 1} of {self.cfg.data.rows_per_step} packed rows"

    def train(self, evaluate: bool = True, checkpoint: bool = True, trace: bool = True) -> list[dict[str, float]]:
        rows = super().train(evaluate, checkpoint, trace)
        if checkpoint:  # a run's, not a profiling probe's
            self.groups["actor"].save_model(str(Path(self.cfg.runner.out_dir) / "model"), ranks=[0]).wait()
        return rows


class SFTMetrics:
    """A step's row: ``loss`` (the learned tokens' mean negative log-likelihood), ``grad_norm``,
    ``rows``, ``tokens`` and ``learned_share`` (of the rows' tokens, those in the loss), each
    component's busy and idle seconds; ``eval_loss`` where evaluated."""

    x, y, x_name = "step", "eval_loss", "step"

    def __init__(self, progress_total: int):
        self.progress_total, self.ledger = progress_total, Ledger()

    def state_dict(self) -> dict[str, float]:
        return {}

    def load_state_dict(self, state: dict[str, float]) -> None:
        pass

    def summary(self, row: dict[str, float]) -> str:
        return f"loss {row['loss']:.3f}  {row['step_s']:.1f} s/step"

    def row(self, i: int, report: dict[str, Any], step_s: float, time_s: float) -> dict[str, float]:
        (data,), actor = report["data"], report["actor"]
        self.ledger.record(i + 1, report)
        return ({"step": i + 1, "time_s": time_s, "step_s": step_s, "rows": data.rows, "tokens": data.tokens,
                 "learned_share": data.learned / max(1, data.tokens), "weight_sync_s": report["sync"].weight_sync_s}
                | trained_stats(actor) | component_times({"data": [data], "actor": actor}))


def score(cfg: DictConfig, ckpt: dict, episodes: int = 0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``m2flow eval``: the held-out chats' loss under the checkpoint's weights, and per chat its
    learned tokens and their loss."""
    from m2flow.engines.scoring import learned_nll
    from m2flow.runners.evaluate import checkpoint_lm

    plain, model, tokenizer = checkpoint_lm(cfg, ckpt)
    _, test = chats(plain)
    examples = []
    for i, chat in enumerate(test):
        total, count = learned_nll(model, packed_rows([chat], tokenizer, cfg.data.max_tokens),
                                   cfg.algorithm.max_tokens_per_micro_batch)
        examples.append({"index": i, "learned_tokens": count, "loss": total / max(1, count)})
    tokens = sum(e["learned_tokens"] for e in examples)
    return {"source": cfg.data.source, "chats": len(examples),
            "eval_loss": sum(e["loss"] * e["learned_tokens"] for e in examples) / max(1, tokens)}, examples


def shape(cfg: DictConfig, plan: Plan, fused: bool) -> Shape:
    """The data worker hands the step's rows over at once; the actor trains on them as they come."""
    return Shape(("data",), "actor", cfg.data.rows_per_step, 1, receivers=(), trainer_streams=True)


def probe_sizes(cfg: DictConfig, devices: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Steps of half the configured rows (at least 1), the other size all of them."""
    r = cfg.data.rows_per_step
    return {"data.rows_per_step": max(1, r // 2)}, {}, {"data.rows_per_step": r}


WORKFLOW = Workflow("sft", components=COMPONENTS, makers=("data",), trainer="actor", channels=("batches",),
                    splits={"disaggregated": ((("data",), 0.5), (("actor",), None)), "hybrid": ((("data",), 0.5),)},
                    single_rank=("data",), whole_on_cpu=COMPONENTS, light=("data",), gpu_collectives=("actor",))

FLOW = Flow(
    "sft", WORKFLOW, {"data": DataWorker, "actor": LMActorWorker}, SFTRunner, config=SFTConfig, check=check,
    length_key="runner.steps", shape=shape, knobs=lambda cfg: {}, length=lambda cfg, n: {"runner.steps": n},
    probe_sizes=probe_sizes, score=score, duration="step_s", probe_updates=2,
    sized_on_one_device=False, stateful=("actor",), resume_keys=("model.path", "data.source"),
    prefetch={"batches": 1}, receivers=lambda cfg: [])
