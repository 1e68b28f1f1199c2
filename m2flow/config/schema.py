"""The typed config: one dataclass per section, each key with its default, its one-line doc
and, where it has one, the range or the choices it allows (checked by ``validate``).

A config's root is its flow's (``config/flows.py``: the flow's ``FLOW.config``), chosen by a
preset's ``flow``: ``EmbodiedConfig`` and ``ReasoningConfig`` here for the embodied and
reasoning flows, a flow's own elsewhere (built from these sections); every root has ``name``,
``flow``, ``seed``, ``cluster`` and the common ``runner`` keys. A preset is a
delta over these defaults. ``MISSING`` (``???``) marks a key without a default: every preset
sets it (the presets disagree on it and the code reads it without a fallback).
``m2flow config PRESET --docs`` prints the resolved config with each key's doc.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

# Names the code accepts, kept here so that a config is checked without importing torch;
# tests/test_config.py asserts that each equals the code's own list.
EMBODIED_ALGORITHMS = ("ppo", "grpo")  # m2flow.workers.actor.ActorWorker: grpo (no critic), else ppo
ACTIVATIONS = ("tanh", "relu")  # m2flow.models.policies.ACTIVATIONS
POLICY_KINDS = ("actor_critic", "squashed_gaussian")  # m2flow.models.policies.build_policy
REASONING_ALGORITHMS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "ppo")  # m2flow.workers.lm_actor.ALGORITHMS
BACKENDS = ("torch", "vllm")  # m2flow.engines.BACKENDS
DTYPES = ("float32", "bfloat16", "float16")  # m2flow.workers.lm_common.DTYPES
BUILTIN_MODELS = ("smollm2", "tiny-gemma", "tiny-llama", "tiny-qwen2")  # m2flow.models.lm: SMOLLM2, TINY_CONFIGS
BUILTIN_REWARDS = ("exact_match", "format", "last_number", "math")  # m2flow.rewards.scorer.BUILTIN
ARITHMETIC_LEVELS = (1, 2, 3, 4, 5)  # m2flow.data.arithmetic.LEVELS
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3", "abs")
CORRECTIONS = ("none", "tis", "decoupled")  # m2flow.algorithms.offpolicy.CORRECTIONS


@dataclass(frozen=True)
class Range:
    """Numbers allowed: ``lo``/``hi`` bounds, each closed unless ``*_open``."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, x: float) -> bool:
        if isinstance(x, float) and math.isnan(x):
            return False
        if self.lo is not None and (x <= self.lo if self.lo_open else x < self.lo):
            return False
        return self.hi is None or (x < self.hi if self.hi_open else x <= self.hi)

    def __str__(self) -> str:
        def num(x: float) -> str:
            return f"{x:g}"

        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {num(self.lo)}"
        if self.lo is None:
            return f"{'<' if self.hi_open else '<='} {num(self.hi)}"
        return f"in {'(' if self.lo_open else '['}{num(self.lo)}, {num(self.hi)}{')' if self.hi_open else ']'}"


POSITIVE = Range(0, lo_open=True)
NON_NEGATIVE = Range(0)
AT_LEAST_1 = Range(1)
UNIT = Range(0, 1)  # [0, 1]
FRACTION = Range(0, 1, lo_open=True)  # (0, 1]


def opt(default: Any, doc: str, *, within: Range | None = None, choices: tuple | None = None) -> Any:
    """A key: its default, its doc, and what values it allows (for a list, each item)."""
    meta = {"doc": doc, "within": within, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type, doc: str) -> Any:
    return field(default_factory=cls, metadata={"doc": doc})


# -------------------------------------------------------------------- shared


@dataclass
class ClusterConfig:
    address: Optional[str] = opt(None, 'null: embedded local Ray; "auto" or host:port: an existing cluster')
    num_cpus: Optional[int] = opt(None, "embedded Ray's CPUs (null: all cores)", within=AT_LEAST_1)
    cpu_slots: Optional[int] = opt(None, "devices per GPU-less node (null: one per core)", within=AT_LEAST_1)
    gpu_slots: int = opt(1, "devices per GPU: k > 1 makes each GPU k devices whose processes run on it at once "
                            "(sharing its memory and compute, no turns)", within=AT_LEAST_1)


@dataclass
class RunnerConfig:
    """The runner keys both flows have."""

    max_staleness: int = opt(0, "policy versions the trained data may lag the weights: 0 on-policy; k: the rollout "
                                "runs up to k updates ahead of the actor (placement=auto: plans may)",
                             within=NON_NEGATIVE)
    checkpoint_every: int = opt(0, "updates between checkpoints; 0: only at the end", within=NON_NEGATIVE)
    checkpoint_every_min: float = opt(30.0, "minutes between checkpoints taken by time (also), each replacing the one "
                                            "before it (a restart or a stop then loses at most that much); 0: none",
                                      within=NON_NEGATIVE)
    max_restarts: int = opt(3, "times in a row a run starts its groups again (from its last checkpoint) after a worker "
                            "process died; a checkpoint written between two deaths starts the count again",
                            within=NON_NEGATIVE)
    on_node_loss: str = opt("continue", "the Ray cluster lost a node the plan placed ranks on: continue (from the "
                                        "last checkpoint, on the devices left, where the placement mode lays itself "
                                        "out on them, else collocated; counts as a restart) | fail (end, naming the "
                                        "node)", choices=("continue", "fail"))
    on_node_return: str = opt("grow", "a run that went on on fewer devices, at each checkpoint while the Ray cluster "
                                      "lists more: grow (onto every device listed, under its first placement mode "
                                      "where that lays itself out on them; from that checkpoint, not a restart) | "
                                      "stay", choices=("grow", "stay"))
    hang_timeout_s: float = opt(1800.0, "seconds without progress (no update ending, no channel item moving, no device "
                                "lock changing hands) after which the run stops with a report of every worker's stacks; "
                                "0: never", within=NON_NEGATIVE)
    stall_warning: float = opt(10.0, "a spell with nothing moving this many times as long as the longest since the "
                                     "first update ended (and at least 60 s) is told, with every rank's stacks "
                                     "(stall-*.txt), the run going on; 0: never", within=NON_NEGATIVE)
    resume: Optional[str] = opt(None, "a checkpoint file (.safetensors) to continue from, or auto: the latest "
                                "complete one in runner.out_dir/checkpoints (none: start afresh)")
    out_dir: str = opt("runs/${name}", "where metrics, logs and checkpoints go")
    progress: bool = opt(True, "show a progress bar")


@dataclass
class BaseConfig:
    name: str = opt(MISSING, "the run's name (runner.out_dir defaults to runs/<name>)")
    flow: str = opt(MISSING, "which macro flow runs it: embodied | reasoning")
    seed: int = opt(0, "seeds every component (each derives its own stream from it)", within=NON_NEGATIVE)
    cluster: ClusterConfig = section(ClusterConfig, "where it runs")


# -------------------------------------------------------------------- embodied


@dataclass
class EnvConfig:
    id: str = opt(MISSING, "a gymnasium id (e.g. CartPole-v1), maniskill:<id>, metaworld:<id> or module:EnvId")
    num_envs: int = opt(MISSING, "envs in total, split over the env ranks", within=AT_LEAST_1)
    kwargs: Dict[str, Any] = opt({}, "keyword arguments to the env's make (any keys)")
    obs_norm: bool = opt(False, "normalise observations with running statistics")
    reward_scale: bool = opt(False, "scale rewards by a running estimate of the return's spread")
    group_size: int = opt(1, "envs per GRPO group (same seed every episode); 1: no groups", within=AT_LEAST_1)


@dataclass
class PolicyConfig:
    hidden: List[int] = opt([64, 64], "widths of the MLP's hidden layers", within=AT_LEAST_1)
    activation: str = opt("tanh", "the MLP's activation", choices=ACTIVATIONS)
    log_std_init: float = opt(0.0, "initial log standard deviation of continuous actions")
    ortho_init: bool = opt(True, "orthogonal init (SB3 default); false: PyTorch's default init")
    chunk: int = opt(1, "actions per inference (action chunks)", within=AT_LEAST_1)
    kind: str = opt("actor_critic", "actor_critic (PPO, GRPO: a policy and a value MLP) | squashed_gaussian (SAC, "
                                    "CrossQ, RLPD: a Gaussian tanh-squashed to the action bounds, ReLU, no value)",
                    choices=POLICY_KINDS)
    batch_renorm: bool = opt(False, "squashed_gaussian: batch renormalisation in the MLP (CrossQ's)")


@dataclass
class EmbodiedAlgorithmConfig:
    name: str = opt("ppo", "ppo | grpo (no critic: episode returns normalised within env groups)",
                    choices=EMBODIED_ALGORITHMS)
    gamma: float = opt(MISSING, "discount per env step", within=UNIT)
    gae_lambda: float = opt(MISSING, "GAE's lambda", within=UNIT)
    clip: float = opt(0.2, "PPO's ratio clip", within=POSITIVE)
    clip_high: Optional[float] = opt(None, "asymmetric clip (clip-higher); null: same as clip", within=POSITIVE)
    value_clip: Optional[float] = opt(None, "how far a value may move from the one the advantages used; null: no clip",
                                      within=POSITIVE)
    ent_coef: float = opt(0.0, "entropy bonus coefficient")
    vf_coef: float = opt(0.5, "value loss coefficient (unused without a critic)", within=NON_NEGATIVE)
    max_grad_norm: float = opt(0.5, "gradients are clipped to this global norm", within=POSITIVE)
    lr: float = opt(MISSING, "Adam's learning rate", within=POSITIVE)
    anneal_lr: bool = opt(False, "decay the learning rate linearly to 0 over the run; false: constant")
    epochs: int = opt(MISSING, "passes over each update's data", within=AT_LEAST_1)
    minibatch_size: int = opt(MISSING, "env steps per minibatch, in total, split over the actor ranks",
                              within=AT_LEAST_1)
    norm_adv: bool = opt(True, "normalise advantages per minibatch (must be false for grpo: its advantages "
                               "are normalised within groups)")
    target_kl: Optional[float] = opt(None, "stop an update's epochs once the mean KL exceeds it; null: never",
                                     within=POSITIVE)
    compile: bool = opt(False, "torch.compile the minibatch loss: faster updates after a one-off compile")
    off_policy: str = opt("none", "the correction for data older weights sampled: none | tis (truncated importance "
                                  "sampling) | decoupled (PPO around the newest weights; docs/reasoning.md)",
                          choices=CORRECTIONS)
    is_cap: float = opt(2.0, "off_policy: the importance weight's cap (tis: truncated to it; decoupled: actions "
                             "above it dropped)", within=POSITIVE)


@dataclass
class EmbodiedRunnerConfig(RunnerConfig):
    rollout_steps: int = opt(MISSING, "env steps per env per update", within=AT_LEAST_1)
    total_env_steps: int = opt(MISSING, "env steps in all; updates = total_env_steps / (rollout_steps x num_envs)",
                               within=AT_LEAST_1)
    target_return: Optional[float] = opt(None, "stop early once an update's mean episode return reaches it "
                                               "(collecting ahead: after training on what was collected ahead)")
    stages: int = opt(1, "elastic pipelining: env batches per env rank (1: no pipelining)", within=AT_LEAST_1)
    eval_every: int = opt(0, "updates between evaluations of the deterministic policy on envs of their own (also "
                             "before the first and after the last); 0: none", within=NON_NEGATIVE)
    eval_episodes: int = opt(10, "episodes per evaluation (runner.eval_every)", within=AT_LEAST_1)
    in_flight_updates: bool = opt(False, "runner.max_staleness >= 1: new weights reach the rollout between env steps, "
                                         "each step records its version (fresher data, not reproducible run to run); "
                                         "false: a rollout ends with the weights it started with")


MODES = ("collocated", "disaggregated", "hybrid", "custom", "auto")
PLAN_DOC = "a plan file (YAML: components, fuse, granularity, stages, run_ahead, offload) run as it is, instead of mode"
# Keys that were renamed: their old name's error says the new one.
RENAMED = {"runner.collect_ahead": "runner.max_staleness (true: 1)", "placement.staleness": "runner.max_staleness"}
# Keys that were removed: their error says what took their place.
REMOVED = {"runner.log_every": "every update is logged (metrics.csv, TensorBoard): drop the key"}
STALENESS_COST_DOC = ("mode auto: how many more steps than on-policy a run 1, 2, ... versions ahead takes to the "
                      "same learning, as shares (0.34: 1.34x the steps); the planner picks the least predicted step "
                      "time x (1 + the share at the plan's run-ahead), past the list at its last entry's rate a "
                      "version ([]: the fastest)")
PROFILE_DOC = "mode auto: the profile file to reuse or write (null: runs/profiles/<preset>-<config hash>.json)"


@dataclass
class EmbodiedPlacementConfig:
    mode: str = opt("collocated", " | ".join(MODES) + " (auto: profiled, planned, run)", choices=MODES)
    plan: Optional[str] = opt(None, PLAN_DOC)
    profile: Optional[str] = opt(None, PROFILE_DOC)
    actor_devices_per_proc: int = opt(1, "> 1: each actor rank spans that many devices (fewer ranks, fewer "
                                         "all-reduces)", within=AT_LEAST_1)
    fuse: bool = opt(True, "env and rollout on the same devices: run the rollout inside the env workers")
    staleness_cost: List[float] = opt([], STALENESS_COST_DOC + " ([] here: on HalfCheetah, PPO with the decoupled "
                                          "objective up to two versions ahead ended at on-policy's return at the "
                                          "same env steps)", within=NON_NEGATIVE)
    components: Dict[str, Any] = opt({"env": None, "rollout": None, "actor": None},
                                     "mode custom: device ranges per component, e.g. placement.components.actor=0-1")


@dataclass
class EmbodiedConfig(BaseConfig):
    flow: str = opt("embodied", "which macro flow runs it: embodied | reasoning")
    seed: int = opt(1, "seeds every component (each derives its own stream from it)", within=NON_NEGATIVE)
    env: EnvConfig = section(EnvConfig, "the simulator")
    policy: PolicyConfig = section(PolicyConfig, "the actor-critic network")
    algorithm: EmbodiedAlgorithmConfig = section(EmbodiedAlgorithmConfig, "the RL algorithm and its optimiser")
    runner: EmbodiedRunnerConfig = section(EmbodiedRunnerConfig, "the training loop")
    placement: EmbodiedPlacementConfig = section(EmbodiedPlacementConfig, "which devices each component runs on")


# -------------------------------------------------------------------- reasoning


@dataclass
class ModelConfig:
    path: str = opt(MISSING, f"a checkpoint directory or a built-in model: {' | '.join(BUILTIN_MODELS)}")
    dtype: str = opt("float32", "the weights' dtype", choices=DTYPES)
    autocast: Optional[str] = opt(None, "training under autocast, e.g. bfloat16 (GPU, or a CPU with bf16 "
                                        "instructions); null: off", choices=DTYPES)


@dataclass
class DataConfig:
    source: str = opt("arithmetic", "the built-in arithmetic word problems | calculation (the built-in calculations "
                                    "for tools: held-out phrasings and kinds) | invented (multi-hop questions about "
                                    "invented entities, for the search tool's corpus 'invented') | a .jsonl / "
                                    ".parquet file")
    question_key: str = opt("question", "a file row's question field")
    answer_key: str = opt("answer", "a file row's reference answer field")
    levels: List[int] = opt([1], "arithmetic difficulty levels (1-5)", choices=ARITHMETIC_LEVELS)
    train_size: int = opt(MISSING, "problems generated for training (arithmetic, calculation, invented)", within=AT_LEAST_1)
    test_size: int = opt(MISSING, "held-out problems: generated (arithmetic, calculation, invented) or a file's last rows",
                         within=NON_NEGATIVE)
    instruction: str = opt("Put the final answer in \\boxed{}.", "appended to every question")
    prompts_per_step: int = opt(MISSING, "prompts per policy update", within=AT_LEAST_1)


@dataclass
class RolloutConfig:
    backend: str = opt("torch", "the generation engine: torch | vllm (GPU)", choices=BACKENDS)
    gpu_memory_utilization: float = opt(0.5, "vllm: its share of the GPU (weights, activations, KV cache)",
                                        within=FRACTION)
    n: int = opt(MISSING, "samples per prompt: the group size", within=AT_LEAST_1)
    temperature: float = opt(1.0, "sampling temperature; 0: greedy", within=NON_NEGATIVE)
    top_p: float = opt(1.0, "nucleus sampling's probability mass", within=FRACTION)
    top_k: int = opt(0, "sample among the k likeliest tokens; 0: all", within=NON_NEGATIVE)
    max_new_tokens: int = opt(MISSING, "tokens per completion at most", within=AT_LEAST_1)
    stop: List[str] = opt([], "strings that end a completion")
    max_batch_size: int = opt(32, "sequences generated at once (continuous batching refills slots)", within=AT_LEAST_1)
    cuda_graphs: bool = opt(False, "torch backend: decode steps at fixed shapes, replayed as CUDA graphs where the "
                                   "rollout is on a GPU (a small model's steps are bound by kernel launches); "
                                   "elsewhere the same steps run eagerly, no faster")
    dtype: Optional[str] = opt(None, "the rollout's weights, e.g. bfloat16: the actor's weights rounded as they "
                                     "arrive, the sampling log-probs theirs (the loss's ratio sees the difference); "
                                     "null: model.dtype", choices=DTYPES)
    partial: bool = opt(True, "runner.max_staleness >= 1: new weights reach the rollout between decode steps and the "
                              "sequences in flight go on with them (each token records its version); false: a step's "
                              "generation ends with the weights it started with")
    continuous: bool = opt(True, "with rollout.partial, running ahead, on devices of its own: the rollout's decode batch "
                                 "never drains between steps; once a step's prompts have all started, the next "
                                 "step's join as slots free up, on weights at most one version behind those that train "
                                 "on them (no token older than runner.max_staleness allows)")


@dataclass
class RewardConfig:
    functions: Dict[str, float] = opt({}, f"reward -> weight; a reward is {' | '.join(BUILTIN_REWARDS)} or "
                                          "package.module:function")
    timeout_s: float = opt(10.0, "seconds a completion's scoring may take", within=POSITIVE)
    overlong_buffer: int = opt(0, "DAPO soft overlong penalty over the last N tokens (0: off)", within=NON_NEGATIVE)
    overlong_factor: float = opt(1.0, "the overlong penalty at rollout.max_new_tokens", within=NON_NEGATIVE)


@dataclass
class ReasoningAlgorithmConfig:
    name: str = opt(MISSING, " | ".join(REASONING_ALGORITHMS), choices=REASONING_ALGORITHMS)
    clip: float = opt(0.2, "PPO's ratio clip", within=POSITIVE)
    clip_high: Optional[float] = opt(None, "DAPO clip-higher; null: same as clip", within=POSITIVE)
    dual_clip: Optional[float] = opt(None, "c > 1 bounds the loss of negative advantages; null: off",
                                     within=Range(1, lo_open=True))
    loss_agg: str = opt("token-mean", " | ".join(LOSS_AGGS), choices=LOSS_AGGS)
    kl_coef: float = opt(0.0, "KL coefficient; 0: no reference model", within=NON_NEGATIVE)
    kl_kind: str = opt("k3", "the KL estimator: " + " | ".join(KL_KINDS), choices=KL_KINDS)
    kl_in_reward: bool = opt(False, "false: KL term in the loss (GRPO); true: in the reward (REINFORCE++, PPO)")
    entropy_coef: float = opt(0.0, "entropy bonus coefficient")
    dynamic_sampling: bool = opt(False, "DAPO: drop groups whose rewards are all equal")
    old_logprobs: str = opt("rollout", "rollout (the sampling log-probs) | recompute (inference worker)",
                            choices=("rollout", "recompute"))
    off_policy: str = opt("none", "the correction for data older weights sampled: none | tis (truncated importance "
                                  "sampling) | decoupled (PPO around the newest weights; docs/reasoning.md)",
                          choices=CORRECTIONS)
    is_cap: float = opt(2.0, "off_policy: the importance weight's cap (tis: truncated to it; decoupled: tokens "
                             "above it dropped)", within=POSITIVE)
    lr: float = opt(MISSING, "the actor's AdamW learning rate", within=POSITIVE)
    weight_decay: float = opt(0.0, "AdamW's weight decay", within=NON_NEGATIVE)
    max_grad_norm: Optional[float] = opt(1.0, "gradients are clipped to this global norm; 0 or null: no clipping",
                                         within=NON_NEGATIVE)
    epochs: int = opt(1, "passes over each step's data", within=AT_LEAST_1)
    mini_batches: int = opt(1, "optimizer steps per epoch", within=AT_LEAST_1)
    max_tokens_per_micro_batch: int = opt(MISSING, "tokens per forward/backward pass (bounds activation memory)",
                                          within=AT_LEAST_1)
    share_prompts: bool = opt(True, "forward each distinct prompt once per micro-batch (docs/reasoning.md)")
    skip_inert_rows: bool = opt(True, "do not forward rows whose gradient is exactly zero (docs/reasoning.md)")
    data_parallel: str = opt("replicate", "actor ranks: replicate (all-reduced gradients) | fsdp (weights, "
                                          "gradients, optimizer state sharded)", choices=("replicate", "fsdp"))
    gae_gamma: float = opt(1.0, "ppo: discount per token", within=UNIT)
    gae_lambda: float = opt(0.95, "ppo: GAE's lambda", within=UNIT)
    critic_lr: float = opt(MISSING, "ppo: the critic's AdamW learning rate", within=POSITIVE)
    value_clip: Optional[float] = opt(0.2, "ppo: how far a value may move from the one the advantages used "
                                           "(null: no clip)", within=POSITIVE)
    critic_epochs: int = opt(1, "ppo: critic passes over the step, each in mini_batches", within=AT_LEAST_1)


@dataclass
class ReasoningRunnerConfig(RunnerConfig):
    steps: int = opt(MISSING, "policy updates", within=AT_LEAST_1)
    eval_every: int = opt(0, "steps between held-out evaluations (0: only at the start and the end)",
                          within=NON_NEGATIVE)
    eval_deferred: bool = opt(False, "save the weights at each evaluation step and evaluate them once training "
                                     "ends, instead of pausing it (streams generated ahead keep running)")


@dataclass
class ReasoningPlacementConfig:
    mode: str = opt("collocated", " | ".join(MODES) + " (auto: profiled, planned, run)", choices=MODES)
    plan: Optional[str] = opt(None, PLAN_DOC)
    profile: Optional[str] = opt(None, PROFILE_DOC)
    granularity: int = opt(1, "prompt groups per streamed micro-batch", within=AT_LEAST_1)
    staleness_cost: List[float] = opt([0.22, 0.34], STALENESS_COST_DOC + " ([0.22, 0.34] here: GRPO on SmolLM2 "
                                                     "one and two versions ahead took 1.22x and 1.34x the steps of "
                                                     "on-policy runs to the same held-out accuracy)",
                                      within=NON_NEGATIVE)
    components: Dict[str, Any] = opt({"rollout": None, "reward": None, "inference": None, "actor": None,
                                      "critic": None},
                                     "mode custom: device ranges per component (critic: ppo only)")


@dataclass
class ReasoningConfig(BaseConfig):
    flow: str = opt("reasoning", "which macro flow runs it: embodied | reasoning")
    model: ModelConfig = section(ModelConfig, "the language model (policy, reference, critic backbone)")
    data: DataConfig = section(DataConfig, "the prompts")
    rollout: RolloutConfig = section(RolloutConfig, "generation")
    reward: RewardConfig = section(RewardConfig, "scoring the completions")
    algorithm: ReasoningAlgorithmConfig = section(ReasoningAlgorithmConfig, "the RL algorithm and its optimiser")
    runner: ReasoningRunnerConfig = section(ReasoningRunnerConfig, "the training loop")
    placement: ReasoningPlacementConfig = section(ReasoningPlacementConfig, "which devices each component runs on")

