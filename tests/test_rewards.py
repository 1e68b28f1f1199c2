"""Rewards: final-answer extraction, math-verify equivalences, the format and last-number
rewards, custom rewards by import path, and the scorer's worker process (errors, hangs)."""

import os
import sys
import time

import numpy as np
import pytest

from m2flow.rewards import (
    RewardError,
    RewardScorer,
    final_answer,
    format_reward,
    last_boxed,
    last_number,
    last_number_reward,
    math_reward,
    resolve_reward,
)

HERE = sys.modules[__name__].__name__  # importable by the worker: tests/ is on sys.path under pytest


def constant_reward(completion: str, answer: str) -> float:
    return 0.25 * len(answer)


def raising_reward(completion: str, answer: str) -> float:
    if "boom" in completion:
        raise ZeroDivisionError("bad completion")
    return 1.0


def dying_reward(completion: str, answer: str) -> float:
    if "die" in completion:
        os._exit(3)
    return 1.0


def hanging_reward(completion: str, answer: str) -> float:
    if "hang" in completion:
        time.sleep(3600)
    return 1.0


def test_extraction():
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{1}{2}} end") == "\\frac{1}{2}"
    assert last_boxed("open \\boxed{12") is None and last_boxed("none") is None
    assert last_number("I had 3 apples, then 1,234.5 and -7 left.") == "-7"
    assert last_number("total 1,234.") == "1234"
    assert last_number("x = 2,3") == "3" and last_number("so 1,2345") == "2345"
    assert last_number("12,345,678 in all") == "12345678"
    assert final_answer("so 3 + 4 = \\boxed{7}, or 8") == "7"
    assert final_answer("the answer is 42.") == "42"
    assert final_answer("so 7. The answer is \\boxed{}.") == "7"
    assert final_answer("no digits") is None


@pytest.mark.parametrize("completion, answer, expected", [
    ("The answer is \\boxed{1/2}.", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{2}{4}}", "1/2", 1.0),
    ("So x = \\boxed{\\sqrt{4}}", "2", 1.0),
    ("\\boxed{50\\%}", "0.5", 1.0),
    ("\\boxed{1/3}", "0.5", 0.0),
    ("She has 31 marbles now.", "31", 1.0),  # last-number fallback
    ("31 at first, 30 at last", "31", 0.0),
    ("\\boxed{12} and later 13", "12", 1.0),  # \boxed{} wins over the last number
    ("Mia has 22 now. The answer is \\boxed{}.", "22", 1.0),  # an empty \boxed{} is no answer
    ("The answer is \\boxed{1,234}", "1234", 1.0),
    ("\\boxed{1{,}000}", "1000", 1.0),
    ("\\boxed{1\\,000}", "1,000", 1.0),
    ("\\boxed{2,3}", "23", 0.0),  # two numbers, not twenty-three
    ("\\boxed{23}", "2,3", 0.0),
    ("The two solutions are x=2,3", "23", 0.0),
    ("no answer", "3", 0.0),
    ("\\boxed{2}", "Thus the answer is $\\boxed{2}$.", 1.0),  # a MATH solution as reference
])
def test_math_reward(completion, answer, expected):
    assert math_reward(completion, answer) == expected


def test_last_number_and_format_rewards():
    assert last_number_reward("3 + 4 = 7", "7") == 1.0
    assert last_number_reward("7.0", "7") == 1.0
    assert last_number_reward("7 apples, 8 pears", "7") == 0.0
    assert last_number_reward("none", "7") == 0.0
    assert last_number_reward("so x = 1,2,3", "123") == 0.0 and last_number_reward("1,000 apples", "1000") == 1.0
    assert format_reward("so \\boxed{7}", "1") == 1.0
    assert format_reward("so \\boxed{}", "1") == 0.0
    assert format_reward("so 7", "7") == 0.0


def test_resolve_reward():
    assert resolve_reward("math") is math_reward
    assert resolve_reward("m2flow.rewards.math:format_reward") is format_reward
    assert resolve_reward(f"{HERE}:constant_reward")("x", "ab") == 0.5
    with pytest.raises(RewardError, match="cannot import reward 'nope.module:f'"):
        resolve_reward("nope.module:f")
    with pytest.raises(ValueError, match="package.module:function"):
        resolve_reward("not_a_path")


def test_scorer_weights_math_and_format():
    completions = ["\\boxed{1/2}", "it is 0.5", "\\boxed{3}", "nothing"]
    answers = ["0.5", "0.5", "0.5", "0.5"]
    with RewardScorer({"math": 1.0, "format": 0.1, f"{HERE}:constant_reward": 2.0}) as scorer:
        assert scorer.local == ["format"] and scorer.remote == ["math", f"{HERE}:constant_reward"]
        scores = scorer.score(completions, answers)
        np.testing.assert_array_equal(scores.parts["math"], [1, 1, 0, 0])
        np.testing.assert_array_equal(scores.parts["format"], [1, 0, 1, 0])
        np.testing.assert_allclose(scores.total, [1.1 + 1.5, 1 + 1.5, 0.1 + 1.5, 1.5], rtol=1e-6)
        assert not scores.timed_out.any()
        np.testing.assert_allclose(scorer.score(["\\boxed{0.5}"], ["1/2"]).total, [1 + 0.1 + 2 * 0.75], rtol=1e-6)


def test_last_number_scorer_runs_in_process():
    scorer = RewardScorer("last_number")
    scores = scorer.score(["so 7", "so 8", "x"], ["7", "7", "7"])
    np.testing.assert_array_equal(scores.total, [1, 0, 0])
    assert scorer._proc is None  # the fast path started no worker


def test_raising_custom_reward_is_a_clear_error():
    with RewardScorer(f"{HERE}:raising_reward") as scorer:
        with pytest.raises(RewardError, match=r"(?s)raising_reward.*item 1.*ZeroDivisionError: bad completion"):
            scorer.score(["fine", "boom", "fine"], ["1", "1", "1"])
        np.testing.assert_array_equal(scorer.score(["fine"], ["1"]).total, [1])  # the worker lives on


def nan_reward(completion: str, answer: str) -> float:
    return float("nan") if completion == "nan" else 1.0


@pytest.mark.parametrize("where", ["worker", "in_process"])
def test_non_finite_reward_is_a_clear_error(where, monkeypatch):
    if where == "in_process":
        monkeypatch.setattr(nan_reward, "in_process", True, raising=False)
    with RewardScorer(f"{HERE}:nan_reward") as scorer:
        assert scorer.local == ([f"{HERE}:nan_reward"] if where == "in_process" else [])
        with pytest.raises(RewardError, match=r"nan_reward gave nan on item 2 \(completion 'nan'\): a reward must be a "
                                              r"finite number"):
            scorer.score(["ok", "ok", "nan"], ["1", "1", "1"])
        np.testing.assert_array_equal(scorer.score(["ok"], ["1"]).total, [1])


def test_hanging_custom_reward_times_out():
    with RewardScorer(f"{HERE}:hanging_reward", timeout_s=1.0, timeout_score=-1.0) as scorer:
        scores = scorer.score(["ok", "hang", "ok"], ["1", "1", "1"])  # without the timeout: hangs
        np.testing.assert_array_equal(scores.total, [1, -1, 1])
        np.testing.assert_array_equal(scores.timed_out, [False, True, False])


def test_dying_custom_reward_is_a_clear_error():
    with RewardScorer(f"{HERE}:dying_reward") as scorer:
        with pytest.raises(RewardError, match=r"died \(exit code 3\) on item 1"):
            scorer.score(["ok", "die"], ["1", "1"])
        np.testing.assert_array_equal(scorer.score(["ok"], ["1"]).total, [1])  # a fresh worker


def test_unimportable_reward_is_reported():
    with pytest.raises(RewardError, match="cannot import"):
        RewardScorer("m2flow.rewards.math:no_such_reward")


def test_start_spawns_the_worker_before_the_first_score():
    with RewardScorer({"math": 1.0, "format": 0.1}) as scorer:
        assert scorer._proc is None  # lazily by default: the first score would spawn it
        assert scorer.start() is scorer and scorer._proc.is_alive()
        proc = scorer._proc
        np.testing.assert_allclose(scorer.score(["\\boxed{2}"], ["2"]).total, [1.1], rtol=1e-6)
        assert scorer._proc is proc  # the started one scored
    assert RewardScorer("last_number").start()._proc is None  # every reward in the caller: no process


def test_reward_worker_starts_its_scorer_when_built():
    """A worker's first scored batch (a profile's probe times it) does not pay the spawn."""
    from m2flow.workers.reward import RewardWorker

    cfg = {"reward": {"functions": {"math": 1.0}, "timeout_s": 10.0, "overlong_buffer": 0, "overlong_factor": 1.0},
           "rollout": {"max_new_tokens": 16}, "algorithm": {"dynamic_sampling": False}}
    worker = RewardWorker(cfg)
    try:
        assert worker.scorer._proc is not None and worker.scorer._proc.is_alive()
    finally:
        worker.close()
    assert worker.scorer._proc is None


def test_a_steps_completions_whose_scoring_timed_out_are_counted():
    """``reward_timeouts``: a reward function that hangs scores the timeout score, and the step
    says how often (else a reward that hangs on every completion looks like one that scores 0)."""
    from types import SimpleNamespace

    from m2flow.workers.reward import END, RewardWorker

    class Channel:
        def __init__(self, batches=()):
            self.batches, self.put_items = list(batches), []

        def get(self, key):
            return self.batches.pop(0)

        def put(self, item, key, weight=None):
            self.put_items.append(item)

        def flush(self):
            pass

    cfg = {"reward": {"functions": {f"{HERE}:hanging_reward": 1.0}, "timeout_s": 1.0, "overlong_buffer": 0,
                      "overlong_factor": 1.0},
           "rollout": {"max_new_tokens": 16}, "algorithm": {"dynamic_sampling": False}}
    worker = RewardWorker(cfg)
    try:
        batch = SimpleNamespace(extras={"groups": 2, "group_size": 2, "text": ["ok", "hang", "ok", "ok"],
                                        "answer": ["1"] * 4})
        out = Channel()
        report = worker.score(Channel([batch]), out, num_groups=2)
    finally:
        worker.close()
    assert report.reward_timeouts == 1 and report.reward == 0.75
    assert out.put_items[0].extras["reward"].tolist() == [1.0, 0.0, 1.0, 1.0] and out.put_items[-1] is END


def test_closing_a_scorer_whose_process_never_started_is_quiet():
    """A start that raised (the caller's own module, re-imported by spawn, starting another) leaves
    a process object never started: closing the scorer then must not hide the first error."""
    import multiprocessing as mp

    scorer = RewardScorer({"math": 1.0})
    scorer._proc = mp.get_context("spawn").Process(target=print)
    scorer.close()
    assert scorer._proc is None
