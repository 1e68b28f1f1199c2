"""The reasoning flow end to end on a tiny model: config checks, placements, weight sync,
log-prob agreement, and short trainings of every algorithm (in several modes) that must raise
the reward at the preset's learning rate."""

import csv
import json
import math
import os
import signal

import pytest
import torch

from m2flow.config import load_config
from m2flow.config.validate import ConfigError, validate as check_config
from m2flow.flow import Plan
from m2flow.runners.loop import Loop, barrier
from m2flow.runners.reasoning import WORKFLOW, ReasoningRunner
from m2flow.runtime.stop import RunStopped

PRESET = "reasoning/grpo_arith_tiny"


def test_bad_configs_are_named():
    cases = [
        ("algorithm.name=ppo2", r"algorithm.name: must be one of grpo \| dr_grpo .*, got 'ppo2'"),
        ("rollout.n=1", "rollout.n: algorithm.name=grpo compares the samples of a prompt: it must be >= 2"),
        ("algorithm.old_logprobs=actor", r"algorithm.old_logprobs: must be one of rollout \| recompute, got 'actor'"),
        ("algorithm.kl_in_reward=true", "algorithm.kl_in_reward: true needs algorithm.name=reinforce_pp"),
        ("placement.granularity=0", "placement.granularity: must be >= 1, got 0"),
        ("algorithm.data_parallel=zero3", r"algorithm.data_parallel: must be one of replicate \| fsdp, got 'zero3'"),
    ]
    for override, message in cases:  # rejected as the config loads
        with pytest.raises(ValueError, match=message):
            load_config(PRESET, [override])
    cfg = load_config(PRESET)
    cfg.rollout.n = 1  # changed after loading: the runner's check catches it
    with pytest.raises(ValueError, match="rollout.n: algorithm.name=grpo compares"):
        check_config(cfg)




def _train(cluster, pool, tmp_path, *overrides):
    cfg = load_config(PRESET, [f"runner.out_dir={tmp_path}", "runner.progress=false", *overrides])
    runner = ReasoningRunner(cfg, cluster=cluster, pool=pool)
    try:
        history = runner.train()
        hashes = [runner.groups["actor"].weights_hash().wait()[0], *runner.groups["rollout"].weights_hash().wait()]
        if cfg.algorithm.old_logprobs == "recompute":
            hashes += runner.groups["inference"].weights_hash().wait()
    finally:
        runner.close()
    return history, hashes


def _reward_gain(history):
    """Mean reward of the last fifth of the steps (at least 3) less that of the first fifth."""
    rewards = [row["reward"] for row in history if "reward" in row and not math.isnan(row["reward"])]
    k = max(3, len(rewards) // 5)
    return sum(rewards[-k:]) / k - sum(rewards[:k]) / k, rewards


# Every case trains 30 steps at the preset's learning rate (2e-3) and must raise the reward:
# seed 0 starts near 0.05 and ends each case's last 6 steps 0.24-0.85 above its first 6; the
# greedy held-out reward goes from 0 to 1. The overrides add each case's mechanics.
LEARNING = {
    # decode steps at fixed shapes (rollout.cuda_graphs: graphs on a GPU, eager here), dropped
    # at each turn's offload and made again; the recomputed log-probs check the sampling ones
    "grpo-collocated": ("placement.mode=collocated", "algorithm.old_logprobs=recompute", "rollout.cuda_graphs=true"),
    "grpo-disaggregated": ("placement.mode=disaggregated", "algorithm.old_logprobs=recompute"),
    # streamed: group-local advantages, one pass; dynamic sampling and the overlong penalty
    # (factor 0.1: at 1 the penalty for hitting max_new_tokens, not the digits, drives the run)
    "dr_grpo": ("algorithm.name=dr_grpo", "algorithm.loss_agg=seq-mean-token-sum-norm", "algorithm.dynamic_sampling=true",
                "reward.overlong_buffer=4", "reward.overlong_factor=0.1", "algorithm.kl_coef=0.01"),
    # gathered: batch-whitened advantages, KL in the reward, 2 epochs x 2 mini-batches, 2 actor ranks
    "reinforce_pp-hybrid": ("algorithm.name=reinforce_pp", "algorithm.kl_coef=0.05", "algorithm.kl_in_reward=true",
                            "algorithm.epochs=2", "algorithm.mini_batches=2", "placement.mode=hybrid"),
    # pipelined, each step's rollout generated while the actor trains on the previous one, new
    # weights taken between decode steps; the decoupled objective (the newest weights' log-probs
    # recomputed before each batch as the proximal policy, the sampling ones as behaviour)
    "rloo-pipelined-ahead": ("algorithm.name=rloo", "algorithm.dual_clip=3.0", "algorithm.entropy_coef=0.01",
                             "placement.mode=disaggregated", "runner.max_staleness=1", "algorithm.old_logprobs=recompute",
                             "algorithm.off_policy=decoupled"),
    # the 2 hybrid actor ranks shard weights, gradients and optimizer state (FSDP)
    "grpo-hybrid-fsdp": ("algorithm.name=grpo", "placement.mode=hybrid", "algorithm.data_parallel=fsdp",
                         "algorithm.mini_batches=2"),
    # an actor rank per slot; rollout and inference one rank each over both slots, the next
    # step's stream running while the actor finishes: were each actor rank to all-reduce under
    # its own lock, the inference (holding slot 0, wanting slot 1) would close a cycle. Truncated
    # importance sampling against the sampling log-probs, one version old (weights taken only
    # between steps' generations).
    "grpo-spanning-inference-ahead": ("algorithm.name=grpo", "algorithm.kl_coef=0.05", "runner.max_staleness=1",
                                      "algorithm.off_policy=tis", "rollout.partial=false",
                                      "placement.mode=custom",
                                      "placement.components.rollout={devices: '0-1', devices_per_proc: 2}",
                                      "placement.components.inference={devices: '0-1', devices_per_proc: 2}",
                                      "placement.components.reward=1-1", "placement.components.actor=0-1"),
    # hybrid on-policy GRPO; reinforce_pp and fsdp above also train in hybrid mode
    "grpo-hybrid": ("placement.mode=hybrid", "algorithm.old_logprobs=recompute"),
    # sampling with the weights rounded to bfloat16 and training under bfloat16 autocast; the
    # inference worker recomputes the log-probs with the float32 weights of the same version
    "grpo-bfloat16-rollout": ("rollout.dtype=bfloat16", "model.autocast=bfloat16", "algorithm.old_logprobs=recompute"),
}
# Slow (`pytest -m slow`): reinforce_pp's and dr_grpo's advantages, losses, dynamic sampling
# and overlong penalty have unit tests of their own (test_reasoning_algorithms.py); FSDP's
# training equals one process's (test_lm_training.py); generation and training on slots of
# their own run in rloo-pipelined-ahead, an actor beside the rollout on a shared slot in
# grpo-spanning-inference-ahead; bfloat16 sampling and autocast training have unit tests
# (test_engine.py, test_lm_training.py).
SLOW = {"grpo-hybrid", "reinforce_pp-hybrid", "dr_grpo", "grpo-hybrid-fsdp", "grpo-disaggregated",
        "grpo-bfloat16-rollout"}


def _option(overrides, key, default):
    return next((o.partition("=")[2] for o in overrides if o.startswith(f"{key}=")), default)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in LEARNING])
def test_training_raises_the_reward(cluster, pool, tmp_path, case):
    overrides = LEARNING[case]
    history, hashes = _train(cluster, pool, tmp_path, "runner.steps=30", *overrides)
    gain, rewards = _reward_gain(history)
    assert gain > 0.15, f"{case}: rewards {[round(r, 3) for r in rewards]}"
    # Greedy held-out answers flip late: with 4 hybrid ranks taking batches in whichever order
    # they are free (not seeded), reinforce_pp's greedy answers stayed at 0 in some 30-step runs
    # while its sampled reward rose; for it the sampled reward's gain is the check.
    if case != "reinforce_pp-hybrid":
        assert history[-1]["eval_reward"] > history[0]["eval_reward"] + 0.5, (history[0]["eval_reward"],
                                                                              history[-1]["eval_reward"])
    steps = [row for row in history if row["step"] > 0]
    assert [row["step"] for row in steps] == list(range(1, 31))
    # After the last sync (the final evaluation), every copy of the weights is the actor's
    # (a bfloat16 rollout's: the actor's rounded, so another hash).
    rounded = _option(overrides, "rollout.dtype", "float32") != "float32"
    if rounded:
        actor, rollout, inference = hashes
        assert inference == actor != rollout
    else:
        assert len(set(hashes)) == 1
    # Generated ahead, every step after the first trains on completions of the weights before
    # the last update (the last step too: it is generated ahead by step 29, and nothing is
    # generated past the final evaluation). Taking weights in flight, some tokens may be newer.
    ahead = "runner.max_staleness=1" in overrides
    lags = [row["policy_lag"] for row in steps]
    if ahead and "rollout.partial=false" not in overrides:
        assert lags[0] == 0 and set(lags) <= {0, 1}, lags
    else:
        assert lags == [0] + [1 if ahead else 0] * 29
    assert all(row["stale_dropped"] == 0 for row in steps)
    assert all(sum(v for k, v in row.items() if k.startswith("staleness_")) == pytest.approx(1) for row in steps)
    # the rollout's decode forwards, replayed as CUDA graphs only with rollout.cuda_graphs on a GPU
    graphs = _option(overrides, "rollout.cuda_graphs", "false") == "true" and torch.cuda.is_available()
    assert all(row["decode_steps"] > 0 and row["graph_replays"] == (row["decode_steps"] if graphs else 0)
               for row in steps), [(row["decode_steps"], row["graph_replays"]) for row in steps]
    # Weights go out only when they changed: not before step 1 (the first evaluation sent
    # them), nor in the last step generated ahead (its stream was launched by step 29). Taking
    # weights in flight, a step reports the push its stream was generated after instead: none
    # for steps 1 and 2 (both on the first weights), then that of update k - 2 for step k.
    partial = ahead and "rollout.partial=false" not in overrides
    expected = [False] + [True] * (28 if ahead else 29) + ([False] if ahead else [])
    assert [row["weight_mb"] > 0 for row in steps] == ([False, False] + [True] * 28 if partial else expected)
    # The inference worker recomputed the sampling log-probs with the weights that sampled them
    # (where it held those: the decoupled objective's proximal weights may be newer). Against
    # a bfloat16 rollout's log-probs the difference is the rounding's.
    if "algorithm.old_logprobs=recompute" in overrides:
        diffs = [row["logprob_diff_max"] for row in steps if "logprob_diff_max" in row]
        assert diffs and (max(diffs) <= 1e-3 if not rounded else 1e-3 < min(diffs) and max(diffs) < 0.5), diffs
    if _option(overrides, "algorithm.off_policy", "none") != "none":  # at most one version apart: weights near 1
        assert all(0.5 < row["is_weight_mean"] < 1.5 for row in steps), [row["is_weight_mean"] for row in steps]
    # Each step takes epochs x mini-batches optimizer steps (none when dynamic sampling drops
    # every group), and no step is skipped for a non-finite gradient.
    passes = int(_option(overrides, "algorithm.epochs", 1)) * int(_option(overrides, "algorithm.mini_batches", 1))
    assert [row["optimizer_steps"] for row in steps] == [passes if row["groups_kept"] else 0 for row in steps]
    assert all(math.isfinite(row["grad_norm"]) for row in steps if row["optimizer_steps"] > 0)
    dropping = "algorithm.dynamic_sampling=true" in overrides  # all-equal groups only (the toy reward seldom has them)
    assert all(row["groups"] == 4 and (dropping or row["groups_kept"] == 4) for row in steps)
    assert (tmp_path / "metrics.csv").is_file() and (tmp_path / "learning_curve.png").is_file()


def test_two_versions_ahead_with_weights_taken_in_flight(cluster, pool, tmp_path):
    """runner.max_staleness=2, disaggregated: the rollout generates up to two steps ahead and
    takes new weights between decode steps (rollout.partial). Every token trained on is at
    most two versions old and none is dropped (a step's generation starts on weights recent
    enough); the rollout loaded pushes while it generated; truncated importance sampling.
    Evaluations every 2 steps are deferred (runner.eval_deferred): the weights saved then are
    evaluated after the run, each row amended, the files deleted."""
    cfg = load_config(PRESET, [f"runner.out_dir={tmp_path}", "runner.progress=false", "runner.steps=8",
                               "runner.max_staleness=2", "placement.mode=disaggregated", "algorithm.off_policy=tis",
                               "runner.eval_every=2", "runner.eval_deferred=true"])
    runner = ReasoningRunner(cfg, cluster=cluster, pool=pool)
    try:
        history = runner.train()
        hashes = [runner.groups["actor"].weights_hash().wait()[0], *runner.groups["rollout"].weights_hash().wait()]
        trained = runner.metrics.trained
    finally:
        runner.close()
    # every completion of every step's prompts trained on once: none lost, none twice
    ids = [p for step in trained.values() for p in step]
    assert sorted(trained) == list(range(1, 9)) and all(ids.count(p) == cfg.rollout.n for p in set(ids))
    assert len(set(ids)) == 8 * cfg.data.prompts_per_step
    steps = [row for row in history if row["step"] > 0]
    assert [row["step"] for row in steps] == list(range(1, 9))
    assert all(row["policy_lag"] <= 2 and row["stale_dropped"] == 0 for row in steps)
    assert max(row["policy_lag"] for row in steps) >= 1  # it ran ahead
    # Continuous generation (rollout.continuous): later steps' prompts joined the decode batch
    # while an earlier step's were still generating (the bound above held all the same), on
    # weights at most one version behind those that trained on them: a step whose prompts all
    # joined early is at most one version old (two ahead, without that rule they joined at 2).
    assert sum(row["prompts_joined_early"] for row in steps) > 0, [row["prompts_joined_early"] for row in steps]
    joined = [(row["step"], row["policy_lag"]) for row in steps if row["prompts_joined_early"] == cfg.data.prompts_per_step]
    assert all(lag <= 1 for _, lag in joined), joined
    for row in steps:
        shares = {k: v for k, v in row.items() if k.startswith("staleness_")}
        assert set(shares) <= {"staleness_0", "staleness_1", "staleness_2"} and sum(shares.values()) == pytest.approx(1)
    assert any(row.get("weight_latency_s", -1.0) >= 0 for row in steps)  # absent where it loaded none
    # The last weights saved (the final update's) and loaded from their file for the last
    # evaluation: the rollout holds exactly the actor's weights.
    assert len(set(hashes)) == 1
    # Beside an inference worker that holds no model (no KL term, the sampling log-probs), the
    # actor takes no device turns: no lock held or waited for, nothing moved out.
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    actor = {e["pid"] for e in events if e.get("name") == "process_name" and e["args"]["name"].startswith("actor")}
    assert actor and not [e for e in events if e.get("pid") in actor and e.get("cat") in ("lock", "switch")]
    # Evaluated before training, then the weights saved after steps 2, 4, 6 and 8 (not a
    # barrier: nothing waits for an evaluation until the end), in metrics.csv too.
    assert [row["step"] for row in history if "eval_reward" in row] == [0, 2, 4, 6, 8]
    assert [row["step"] for row in history if "save_weights_s" in row] == [2, 4, 6, 8]
    assert not barrier(runner, 1, checkpoint=True, evaluate=True)  # step 2's
    rows = list(csv.DictReader((tmp_path / "metrics.csv").read_text().splitlines()))
    assert [int(float(r["step"])) for r in rows if r["eval_reward"]] == [0, 2, 4, 6, 8]
    assert not list((tmp_path / "saved_weights").iterdir())


def test_a_run_is_warm_in_a_pool_holding_every_process_it_would_start(cluster):
    """``warm_in``: a profile's probe is warm when the pool holds a process for every rank of
    every component the plan does not fuse into another's (``WorkerPool.holds``); one rank
    missing and it would start a process anew (on GPUs the probe then leaves its first update
    out)."""
    from m2flow.flow import Plan
    from m2flow.runners.reasoning import FLOW, WORKFLOW
    from m2flow.runtime.pool import WorkerPool

    cfg = load_config(PRESET)
    plan = Plan.for_mode(WORKFLOW, "disaggregated", len(cluster.devices))
    placement, host = plan.placement(cluster), plan.hosts(WORKFLOW)
    pool = WorkerPool()  # holds stand-ins, never started: nothing here runs
    assert not FLOW.warm_in(cfg, plan, cluster, pool)
    names = []
    for c in FLOW.components(cfg):
        if c not in host:
            for r in placement[c].ranks():
                names.append(f"{c}-{pool.tag}:{r.rank}")
                pool.give(names[-1], FLOW.workers[c], r.node_id, r.devices, object())
    assert len(names) >= 3 and FLOW.warm_in(cfg, plan, cluster, pool)
    pool._idle.pop(names[-1])
    assert not FLOW.warm_in(cfg, plan, cluster, pool)


@pytest.mark.slow  # 17-20 s; deferred evaluations run by default above, resumes in test_resume_reaches_the_same_weights
def test_a_stopped_runs_deferred_evaluations_are_made_when_it_resumes(cluster, pool, tmp_path, monkeypatch):
    """A run stopped after its last checkpoint but before its deferred evaluations (a time
    limit, a kill) keeps the weights it saved for them; resumed (``runner.resume=auto``), it
    trains nothing more, evaluates them and amends their rows: the figures of the run that
    was not stopped. So does one that SIGTERM stops during its first deferred evaluation."""
    args = ("runner.steps=4", "runner.eval_every=2", "runner.eval_deferred=true", "algorithm.share_prompts=false")
    straight = _train(cluster, pool, tmp_path / "straight", *args)[0]
    with monkeypatch.context() as m:  # stopped before the evaluations at the end
        m.setattr(Loop, "evaluate_deferred", lambda self, watchdog=None: None)
        cut = _train(cluster, pool, tmp_path / "cut", *args)[0]
    saved = tmp_path / "cut" / "saved_weights"
    assert sorted(p.name for p in saved.iterdir()) == ["step-2.safetensors", "step-4.safetensors"]
    assert [row["step"] for row in cut if "eval_reward" in row] == [0]

    resumed = _train(cluster, pool, tmp_path / "cut", *args, "runner.resume=auto")[0]

    def evals(history):
        return {row["step"]: row["eval_reward"] for row in history if "eval_reward" in row}

    assert sorted(evals(straight)) == [0, 2, 4] and evals(resumed) == evals(straight)
    assert [row["step"] for row in resumed] == [row["step"] for row in straight]  # nothing trained again
    assert not list(saved.iterdir())
    rows = list(csv.DictReader((tmp_path / "cut" / "metrics.csv").read_text().splitlines()))
    assert [int(float(r["step"])) for r in rows if r["eval_reward"]] == [0, 2, 4]
    # SIGTERM during the first deferred evaluation: that one is finished, the other left
    evaluate_saved = ReasoningRunner.evaluate_saved

    def signalled(self, path):
        if not self.cfg.runner.resume:
            os.kill(os.getpid(), signal.SIGTERM)
        return evaluate_saved(self, path)

    with monkeypatch.context() as m:
        m.setattr(ReasoningRunner, "evaluate_saved", signalled)
        with pytest.raises(RunStopped, match="stopped by SIGTERM with 1 deferred evaluation.s. left; the last "
                                             "checkpoint: .*step_000004.safetensors"):
            _train(cluster, pool, tmp_path / "signalled", *args)
        assert [p.name for p in (tmp_path / "signalled" / "saved_weights").iterdir()] == ["step-4.safetensors"]
        assert evals(_train(cluster, pool, tmp_path / "signalled", *args, "runner.resume=auto")[0]) == evals(straight)


def test_resume_reaches_the_same_weights(cluster, pool, tmp_path):
    """Stopped at step 2 and resumed to step 4: the same weights as 4 steps in one go, with a
    KL term to the reference model in the loss. Bit-exact needs the full forward: the
    shared-prompt one is reproducible within a process, but two runs in fresh processes
    differed in the last bits (a loss differed by 2e-7)."""
    exact = ("algorithm.share_prompts=false", "algorithm.kl_coef=0.05")
    straight = _train(cluster, pool, tmp_path / "straight", "runner.steps=4", *exact)[1]
    _train(cluster, pool, tmp_path / "split", "runner.steps=2", *exact)
    checkpoint = tmp_path / "split" / "checkpoints" / "step_000002.safetensors"
    pool.close()  # resumed in fresh processes: nothing the stopped run left in memory carries over
    resumed = _train(cluster, pool, tmp_path / "split", "runner.steps=4", f"runner.resume={checkpoint}", *exact)[1]
    assert resumed[0] == straight[0]
    history = (tmp_path / "split" / "metrics.csv").read_text().splitlines()
    assert [float(row.split(",")[0]) for row in history[1:]] == [0, 1, 2, 3, 4]
    # another model, or another data set, under the checkpoint: one line naming what differs
    with pytest.raises(ConfigError, match=r"runner.resume: checkpoint .*step_000002.safetensors was written with "
                                          r"model.path=tiny-llama, this run has model.path=tiny-qwen2: resume with "
                                          r"the same model.path"):
        _train(cluster, pool, tmp_path / "other", "runner.steps=4", f"runner.resume={checkpoint}",
               "model.path=tiny-qwen2", *exact)
    with pytest.raises(ConfigError, match=r"runner.resume: checkpoint .* was written with algorithm.name=grpo, this run "
                                          r"has algorithm.name=rloo: resume with the same algorithm.name"):
        _train(cluster, pool, tmp_path / "other", "runner.steps=4", f"runner.resume={checkpoint}",
               "algorithm.name=rloo", *exact)
    with pytest.raises(ConfigError, match=r"runner.resume: the checkpoint's prompts are not this run's \(state is for "
                                          r"512 items, this loader has 500\)"):
        _train(cluster, pool, tmp_path / "fewer", "runner.steps=4", f"runner.resume={checkpoint}",
               "data.train_size=500", *exact)


@pytest.mark.slow
def test_a_checkpoint_resumes_on_another_placement(cluster, pool, tmp_path):
    """A checkpoint of one rollout and one actor rank resumed with two of each: every actor
    rank holds the weights the checkpoint holds (``LMActorWorker.reshard``; the trainer's
    forms: tests/test_lm_training.py), and log.txt says what moved."""
    at_2 = _train(cluster, pool, tmp_path / "split", "runner.steps=2")[1]
    checkpoint = tmp_path / "split" / "checkpoints" / "step_000002.safetensors"
    cfg = load_config(PRESET, ["runner.steps=2", f"runner.resume={checkpoint}", f"runner.out_dir={tmp_path / 'moved'}",
                               "runner.progress=false", "placement.mode=custom", "placement.components.rollout=0-1",
                               "placement.components.reward=2", "placement.components.inference=3",
                               "placement.components.actor=2-3"])
    runner = ReasoningRunner(cfg, cluster=cluster, pool=pool)
    try:
        runner.train()
        moved = runner.groups["actor"].weights_hash().wait()
    finally:
        runner.close()
    assert moved == [at_2[0]] * 2
    assert "written on another placement (rollout 1 rank(s) then, 2 now; actor 1 rank(s) then, 2 now)" in (
        tmp_path / "moved" / "log.txt").read_text()


def test_a_plan_that_keeps_memory_in_place_moves_nothing_between_turns(cluster, pool, tmp_path):
    """``offload: false`` in a plan: the components still take turns on their shared devices
    but move nothing out between them (the rollout keeps its KV cache and, on a GPU, its
    weights; the actor its optimizer state), so the trace has no context switch; on CPU
    slots nothing else differs, and the run trains step for step as the plan that moves it
    (the same samples and rewards; losses within round-off: a KV cache kept from a longer
    call is read through other strides)."""
    runs = {}
    for offload in (True, False):
        plan = Plan.for_mode(WORKFLOW, "collocated", 2, "cpu", components=WORKFLOW.components[:4])
        plan.offload = offload
        out = tmp_path / f"offload-{offload}"
        history, _ = _train(cluster, pool, out, "runner.steps=3", f"placement=@{plan.save(tmp_path / f'{offload}.yaml')}")
        events = json.loads((out / "trace.json").read_text())["traceEvents"]
        switches = {e["name"] for e in events if e.get("cat") == "switch"}
        turns = [e for e in events if e.get("cat") == "lock" and e["name"].startswith("hold devices")]
        runs[offload] = history, switches, turns
    (moving, switches, turns), (kept, none, kept_turns) = runs[True], runs[False]
    assert {"offload", "onload", "onload_optimizer", "offload_optimizer"} <= switches and none == set()
    assert turns and kept_turns  # both took turns on the devices
    steps = [[r for r in history if r["step"] > 0] for history in (kept, moving)]
    assert [r["reward"] for r in steps[0]] == [r["reward"] for r in steps[1]] and len(steps[0]) == 3
    assert [r["loss"] for r in steps[0]] == pytest.approx([r["loss"] for r in steps[1]], rel=1e-4)
