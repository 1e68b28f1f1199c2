"""What each component's call reports to the runner for a step: one dataclass per kind of
report, every field documented. A flow's metrics class turns a step's reports into its
metrics row (``runners/metrics.py`` has what the flows share); reports cross process
boundaries pickled by Ray, so they hold numbers, strings, lists and tuples (a trainer's
statistics: a table of name -> number).

Every report says where the call's time went (``Report``: a ``runtime.Clock``'s seconds), and
which samples of the step's stream it made, dropped on purpose or trained on, by their ids: the
runner's ``Ledger`` (``runners/metrics.py``) checks with them, the same way in every flow, that
nothing collected is lost and nothing trained twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

# A sample's id, unique within a step's stream: embodied, an env's index (its trajectory in the
# stream, ``envs.trajectory.Trajectory.ids``); reasoning, (a prompt's index, a completion's index in
# its group) (``engines.batch.SequenceBatch.ids``)
SampleId = Union[int, tuple[int, int]]


@dataclass(kw_only=True)
class Report:
    """Where a call's time went (``runtime.Clock``), where it measures it its memory, and the
    samples it made, dropped or trained on."""

    busy_s: float = 0.0  # working: stepping envs, inferring, generating, scoring, training
    idle_s: float = 0.0  # waiting: for input, for weights, for a device turn
    lock_wait_s: float = 0.0  # of idle_s, the wait for a device turn (0 where the call does not tell it apart)
    peak_memory_mb: float | None = None  # the process's peak (CUDA max allocated, else peak RSS); None: not measured
    collected: list[SampleId] = field(default_factory=list)  # the samples it made for the stream (env, rollout)
    dropped: list[SampleId] = field(default_factory=list)  # those it left out on purpose (reward, select, actor)
    trained: list[SampleId] = field(default_factory=list)  # those it trained on (the trainer)


# -- embodied ------------------------------------------------------------------------------
@dataclass(kw_only=True)
class EnvReport(Report):
    """An env rank's part of one rollout (``EnvWorker.interact``)."""

    env_steps: int = 0  # env steps its envs took (a chunk of actions counts those it ran)
    env_faults: int = 0  # env steps since its last report that raised or gave a non-finite value
    # each episode that ended: its raw return, length and success (None: the env reports none);
    # GRPO: also those cut at the window's end, with their partial return
    episodes: list[tuple[float, int, bool | None]] = field(default_factory=list)


@dataclass(kw_only=True)
class RolloutReport(Report):
    """A rollout rank's inference for one stream (``RolloutWorker.act``; fused, the env
    worker's ``act``), and the base of the LM rollout's."""

    # (version, wall time) of each push of the actor's weights it took while it ran (in-flight updates)
    weight_loads: list[tuple[int, float]] = field(default_factory=list)


@dataclass(kw_only=True)
class TrainReport(Report):
    """A trainer rank's update (the embodied ``ActorWorker.train``, ``LMActorWorker.train``)."""

    # its training statistics, the metrics columns a flow averages over the ranks
    # (``runners.metrics.across_ranks``): the embodied actor's PPO_STATS, grad_norm, epochs,
    # explained_variance; the LM actor's loss, grad_norm and what its loss function reports
    stats: dict[str, float] = field(default_factory=dict)
    policy_lag: int = 0  # versions between the weights it trained and the oldest that made its data
    lags: dict[int, int] = field(default_factory=dict)  # versions behind -> items trained on (env steps, tokens)
    version: int = 0  # of the weights its update made
    update_end: float = 0.0  # wall time (time.time) at which its update ended
    forwarded_tokens: int | None = None  # its weight in the statistics' means (LM); None: every rank alike


@dataclass(kw_only=True)
class LMTrainReport(TrainReport):
    """An LM actor rank's update (``LMActorWorker.train``)."""

    optimizer_steps: int = 0  # optimizer steps taken (0 when every group was dropped)
    inert_rows: int = 0  # rows taken but not forwarded: their loss and gradient are exactly zero
    stale_dropped: int = 0  # rows dropped untrained: older than runner.max_staleness allows
    update_busy_s: float = 0.0  # of busy_s, the update apart from the streamed batches' forward and backward


@dataclass(kw_only=True)
class WeightSync:
    """A push of the trainer's weights to the receivers (``push_weights``), and the runner's
    report of a step's weight sync (``runners.streams.Streams``)."""

    weight_sync_s: float = 0.0  # seconds: the push (the trainer's), the whole sync (the runner's)
    weight_mb: float | None = None  # megabytes sent (the LM actor's); None: not counted
    weight_buckets: int | None = None  # the buckets they went in (the LM actor's)
    weight_transport: str | None = None  # how the last bucket travelled (runtime.comm's transport name)


# -- reasoning -----------------------------------------------------------------------------
@dataclass(kw_only=True)
class GenerateReport(RolloutReport):
    """An LM rollout rank's completions of one stream (``LMRolloutWorker.generate``)."""

    groups: int = 0  # prompts whose group of completions went out
    completions: int = 0  # completions that went out
    completion_tokens: int = 0  # their tokens
    truncated: int = 0  # of them, those cut at rollout.max_new_tokens
    joined_early: int = 0  # prompts that joined an earlier stream's decode batch (rollout.continuous)
    decode_steps: int = 0  # the engine's decode forwards (the torch engine's; 0 for others)
    graph_replays: int = 0  # of them, replays of a captured CUDA graph
    turns: int = 0  # the model's turns in the completions (one each where no tool answers)
    tool_calls: int = 0  # the calls they made (a malformed one included)
    tool_errors: int = 0  # of them, those answered with an error
    answered: int = 0  # completions whose last turn made no call (the model answered)
    tool_tokens: int = 0  # of completion_tokens, those the tools' results (and the turns' separators) added
    tool_seconds: list[float] = field(default_factory=list)  # each call's time, as the tool ran it
    tool_wait_s: float = 0.0  # the seconds the completions spent waiting on their tools' results, summed


@dataclass(kw_only=True)
class RewardReport(Report):
    """The reward worker's scores of one stream (``RewardWorker.score``)."""

    reward: float = 0.0  # mean reward of every completion scored (before the overlong penalty)
    reward_std: float = 0.0  # its standard deviation
    groups: int = 0  # groups scored
    groups_kept: int = 0  # of them, those passed on (dynamic sampling drops those whose rewards are all equal)
    reward_timeouts: int = 0  # completions whose scoring timed out (scored 0)
    parts: dict[str, float] = field(default_factory=dict)  # ``reward_<function>`` -> that function's mean score


@dataclass(kw_only=True)
class ToolReport(Report):
    """A tool worker's calls since its last report (``ToolWorker.report``): ``busy_s`` while at
    least one ran, ``idle_s`` the rest of the time."""

    calls: int = 0  # tool calls it ran (a turn's several calls count one each)
    trajectories: int = 0  # trajectories whose stateful tools it holds now


@dataclass(kw_only=True)
class InferenceReport(Report):
    """The inference worker's pass over one stream (``InferenceWorker.logprobs``)."""

    # the largest difference between the sampling log-probs and those it recomputed with the
    # same weights (round-off); None: it recomputed none with the sampling weights
    logprob_diff_max: float | None = None


@dataclass(kw_only=True)
class CriticReport(Report):
    """The critic's pass over one stream and its update (``LMCriticWorker.train``)."""

    # value_mean, return_mean, explained_variance (before the update), value_loss,
    # value_clip_fraction, critic_grad_norm; empty when every group was dropped
    stats: dict[str, float] = field(default_factory=dict)


@dataclass(kw_only=True)
class SelectReport(Report):
    """The rejection flow's selection of one stream (``SelectWorker.best``)."""

    groups: int = 0  # groups read
    kept: int = 0  # completions passed on to the actor
