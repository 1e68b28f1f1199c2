"""Reasoning runs as users start them beyond the built-in task: prompts from a JSONL or a
Parquet file (train on all rows but the held-out last ``data.test_size``, evaluate on those),
TensorBoard scalars equal to metrics.csv, and training under ``model.autocast=bfloat16``.

Two short runs of the tiny preset serve every check: the JSONL file in fp32 and the Parquet
file under bf16 autocast, both recomputing the old log-probs in the inference worker (fp32).
"""

import csv
import json
import math
import re

import pytest

from m2flow.config import ConfigError, load_config
from m2flow.runners.reasoning import ReasoningRunner

PRESET = "reasoning/grpo_arith_tiny"
ROWS, TEST_SIZE = 12, 4  # rows 0-7 train, rows 8-11 are held out
TRAIN_ROWS, TEST_ROWS = list(range(ROWS - TEST_SIZE)), list(range(ROWS - TEST_SIZE, ROWS))
# 2 steps of 4 prompts: one epoch of the 8 training rows, each row once.
COMMON = ["runner.progress=false", "runner.steps=2", "data.prompts_per_step=4", f"data.test_size={TEST_SIZE}",
          "data.question_key=problem", "data.answer_key=solution", "rollout.n=2", "rollout.max_new_tokens=8",
          "algorithm.old_logprobs=recompute"]


def problem_rows():
    return [{"problem": f"Problem {i}: add {i} and {i}.", "solution": str(2 * i)} for i in range(ROWS)]


def write_prompts(path):
    rows = problem_rows()
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(cluster, pool, out_dir, source, *overrides):
    """Trains the tiny preset on ``source``; returns the history, the prompts the runner sent
    to the rollout for training and for evaluation, the answers it scored evaluations
    against, its prompt split, and the actor's weight hashes before and after."""
    cfg = load_config(PRESET, [f"runner.out_dir={out_dir}", f"data.source={source}", *COMMON, *overrides])
    runner = ReasoningRunner(cfg, cluster=cluster, pool=pool)
    sent = {"generate": [], "complete": [], "score_texts": []}

    def recording(group):
        call = group.call

        def record(method, *args, **kwargs):
            if method in sent:
                sent[method].append(args[1] if method == "score_texts" else args[0])
            return call(method, *args, **kwargs)
        return record

    runner.groups["rollout"].call, runner.groups["reward"].call = recording(runner.groups["rollout"]), recording(runner.groups["reward"])
    try:
        before = runner.groups["actor"].weights_hash().wait()
        history = runner.train()
        after = runner.groups["actor"].weights_hash().wait()
        split = runner.train_prompts, runner.test_prompts
    finally:
        runner.close()
    return {"history": history, "sent": sent, "split": split, "hashes": (before, after)}


@pytest.fixture(scope="module")
def runs(cluster, pool, tmp_path_factory):
    """The JSONL file in fp32, the Parquet file under bf16 autocast."""
    tmp = tmp_path_factory.mktemp("prompts")
    jsonl, parquet = write_prompts(tmp / "problems.jsonl"), write_prompts(tmp / "problems.parquet")
    return {"jsonl": run(cluster, pool, tmp / "out-jsonl", jsonl) | {"out_dir": tmp / "out-jsonl"},
            "parquet": run(cluster, pool, tmp / "out-parquet", parquet, "model.autocast=bfloat16")}


def row_of(prompt):
    """The file row a prompt was built from, read back from its tokens; its answer must be
    that row's."""
    from m2flow.models.lm import byte_tokenizer

    text = byte_tokenizer().decode(prompt["token_ids"])
    (i,) = re.findall(r"Problem (\d+): add", text)
    assert prompt["answer"] == str(2 * int(i)), (prompt["answer"], text)
    return int(i)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_prompt_file_trains_on_its_train_rows_and_evaluates_on_the_held_out_rows(runs, fmt):
    r = runs[fmt]
    train, test = r["split"]
    assert [row_of(p) for p in train] == TRAIN_ROWS and [row_of(p) for p in test] == TEST_ROWS
    generated, completed = r["sent"]["generate"], r["sent"]["complete"]
    # Each step's batch is data.prompts_per_step training prompts; over the epoch every
    # training row once, never a held-out one.
    assert [len(batch) for batch in generated] == [4, 4]
    assert sorted(row_of(p) for batch in generated for p in batch) == TRAIN_ROWS
    # Evaluated before step 1 and after step 2, each time on exactly the held-out rows, and
    # scored against their answers.
    assert [[row_of(p) for p in batch] for batch in completed] == [TEST_ROWS, TEST_ROWS]
    assert r["sent"]["score_texts"] == [[str(2 * i) for i in TEST_ROWS]] * 2
    history = r["history"]
    assert [row["step"] for row in history] == [0, 1, 2]
    assert all(0.0 <= history[s]["eval_reward"] <= 1.0 for s in (0, 2))


def test_bad_prompt_files_are_clear_errors(cluster, tmp_path):
    def load(source, *overrides):
        return load_config(PRESET, [f"runner.out_dir={tmp_path / 'out'}", f"data.source={source}", *COMMON, *overrides])

    def error(source, *overrides):  # found as the prompts are read, before any worker starts
        with pytest.raises(ConfigError) as info:
            ReasoningRunner(load(source, *overrides), cluster=cluster)
        return str(info.value)

    def config_error(source, *overrides):  # found as the config loads, before any worker starts
        with pytest.raises(ConfigError) as info:
            load(source, *overrides)
        return str(info.value)

    for missing in (tmp_path / "missing.jsonl", tmp_path / "missing.parquet"):
        assert config_error(missing) == (f"data.source: no such file '{missing}' (expected arithmetic | calculation "
                                         "| invented or a .jsonl / .parquet file)")
    assert config_error(tmp_path / "problems.csv") == ("data.source: expected arithmetic | calculation | invented or a "
                                                       f".jsonl / .parquet file, got '{tmp_path / 'problems.csv'}'")
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(problem_rows()[0]) + "\n\n{'problem': 1}\n")
    assert error(broken) == f"data.source: {broken} line 3: not JSON (Expecting property name enclosed in double quotes)"
    not_parquet = tmp_path / "broken.parquet"
    not_parquet.write_text("not parquet")
    assert error(not_parquet).startswith(f"data.source: {not_parquet}: not a Parquet file")
    small = write_prompts(tmp_path / "small.jsonl")
    assert config_error(small, f"data.test_size={ROWS}") == (
        f"data.test_size: data.source={small} has {ROWS} problems, not enough to hold out {ROWS} and train on the rest")
    assert config_error(small, f"data.prompts_per_step={ROWS - TEST_SIZE + 1}") == (
        f"data.prompts_per_step: must be <= the {ROWS - TEST_SIZE} train prompts (data.source={small} less "
        f"data.test_size), got {ROWS - TEST_SIZE + 1}")
    assert error(small, "data.question_key=question").startswith(f"data.source: {small} row 0: no field 'question'")
    long = tmp_path / "long.jsonl"  # the rollout would fail on it whenever its batch came
    long.write_text("".join(json.dumps(row | ({"problem": "add " * 600} if i == 2 else {})) + "\n"
                            for i, row in enumerate(problem_rows())))
    assert re.fullmatch(r"data.source: problem 'long-2': its prompt has \d{4} tokens \(chat-formatted\): no room to "
                        r"generate within the 2048 positions of tiny-llama", error(long))


def test_tensorboard_scalars_equal_metrics_csv(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = runs["jsonl"]["out_dir"]
    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [float(row["step"]) for row in rows] == [0, 1, 2]
    # Every non-empty cell but the x axis, keyed (column, step).
    expected = {(k, float(row["step"])): float(v) for row in rows for k, v in row.items() if k != "step" and v}
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    got = {(tag, float(e.step)): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    assert {"reward", "eval_reward", "loss", "grad_norm", "actor_busy_s"} <= {k for k, _ in expected}
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key  # TensorBoard stores float32


def test_a_steps_training_statistics_are_over_every_actor_rank():
    """Two actor ranks: the one whose rows were all inert (it forwarded nothing, so reports no
    entropy and a loss share of 0) counts for nothing in the means; the others are weighted by
    the completion tokens each forwarded. Rank 0's alone would have given no entropy at all.
    The loss is each rank's share of the step's (LMTrainer.train_step): their plain mean. A
    ``*_max`` is the largest any rank reports."""
    from m2flow.runners.metrics import across_ranks
    from m2flow.runners.reasoning import ReasoningMetrics
    from m2flow.workers.reports import GenerateReport, InferenceReport, LMTrainReport, RewardReport, WeightSync

    def actor(forwarded, **stats):
        return {"busy_s": 1.0, "idle_s": 0.0, "version": 1, "update_end": 0.0, "inert_rows": 8 if not forwarded else 0,
                "optimizer_steps": 1, "completion_tokens": 80, "token_lags": {0: 80}, "forwarded_tokens": forwarded,
                "update_busy_s": 0.1, "grad_norm": 2.0} | stats

    def typed(ranks):  # the ranks above as LMActorWorker.train reports them
        fields = {"busy_s", "idle_s", "version", "update_end", "inert_rows", "optimizer_steps", "forwarded_tokens",
                  "update_busy_s", "policy_lag"}
        return [LMTrainReport(**{k: v for k, v in r.items() if k in fields}, lags=r["token_lags"],
                              stats={k: v for k, v in r.items() if k not in fields | {"token_lags", "completion_tokens"}})
                for r in ranks]

    idle = actor(0, loss=0.0)
    report = {"rollout": [GenerateReport(completions=16, completion_tokens=160, truncated=0, busy_s=1.0, idle_s=0.0)],
              "reward": [RewardReport(reward=0.25, busy_s=0.1, idle_s=0.0)],
              "inference": [InferenceReport(busy_s=0.1, idle_s=0.0)], "sync": WeightSync()}
    row = ReasoningMetrics(4).row(0, report | {"actor": typed([idle, actor(30, loss=0.5, entropy=0.6, approx_kl=0.01)])},
                                  1.0, 1.0)
    assert (row["entropy"], row["loss"], row["approx_kl"], row["grad_norm"]) == (0.6, 0.25, 0.01, 2.0)
    assert row["inert_rows"] == 8 and "forwarded_tokens" not in row
    lagged = [actor(10, policy_lag=2), actor(30, policy_lag=1)]  # the oldest of any rank, not a mean
    assert ReasoningMetrics(4).row(0, report | {"actor": typed(lagged)}, 1.0, 1.0)["policy_lag"] == 2
    both = across_ranks([actor(10, entropy=0.2, loss=1.0, ratio_max=5.0),
                         actor(30, entropy=0.6, loss=0.0, ratio_max=1.5)], ("busy_s",))
    assert both["entropy"] == pytest.approx(0.5) and both["loss"] == pytest.approx(0.5) and "busy_s" not in both
    assert both["ratio_max"] == 5.0
    assert across_ranks([idle, actor(30, ratio_max=1.5)])["ratio_max"] == 1.5  # the idle rank has none
    assert across_ranks([{"epochs": 2, "kl": 0.1}, {"epochs": 4, "kl": 0.3}]) == pytest.approx({"epochs": 3, "kl": 0.2})
    nothing = across_ranks([idle, idle])  # no rank forwarded anything: a loss of 0, no entropy
    assert nothing["loss"] == 0.0 and "entropy" not in nothing
    one = across_ranks([{"epochs": 4, "loss": 0.5}])  # one rank: its values as they are
    assert one == {"epochs": 4, "loss": 0.5} and isinstance(one["epochs"], int)


def test_bf16_autocast_takes_effect_and_trains(runs):
    """The actor's forward under bf16 autocast gives log-probs that differ from the inference
    worker's fp32 ones by bf16 round-off (ratios off 1 at the first pass of a step); in fp32
    they agree exactly. The update stays finite and changes the weights."""
    for fmt, autocast in (("jsonl", False), ("parquet", True)):
        r = runs[fmt]
        steps = [row for row in r["history"] if row["step"] > 0]
        # Both runs sample in fp32 and recompute in fp32: the same log-probs.
        assert all(row["logprob_diff_max"] <= 1e-4 for row in steps)
        off = [max(row["ratio_max"] - 1, 1 - row["ratio_mean"], row["ratio_mean"] - 1) for row in steps]
        if autocast:
            assert all(2e-4 < d < 0.05 for d in off), (fmt, off)
        else:
            assert all(d <= 1e-5 for d in off), (fmt, off)
        assert all(math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0
                   and row["optimizer_steps"] == 1 for row in steps), steps
        before, after = r["hashes"]
        assert before != after

