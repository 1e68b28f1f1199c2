"""Multi-turn generation in the torch engine: a sequence whose turn is over waits outside the
batch while its tools run (the others go on), then rejoins with the tools' tokens appended to
its own; its KV parked ("park") or made again ("prefill"). Checked: the sampled tokens' log-probs
equal a plain forward over the whole trajectory, the mask and versions mark exactly the
appended tokens, a seeded call samples the same whatever the tools' timing, and the bounds."""

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from m2flow.engines import SamplingParams, TorchEngine
from m2flow.engines.generation import TurnEnd

from test_engine import lively_lm, make_prompts, reference_logprobs

STOPS = tuple("abcdefghij")  # likely characters: turns end at different steps


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def lm(request):
    """The tiny model on the CPU, and on a GPU where there is one (there, batch-invariant steps
    replay CUDA graphs)."""
    model, tok = lively_lm("tiny-llama")
    return model.to(request.param), tok


def graphs(model) -> bool:
    return model.device.type == "cuda"


class ScriptedTools:
    """The ``turn_ended`` hook of a fake tool: after each of the first ``turns - 1`` turns of a
    sequence it answers, from a thread and after ``delay(turn)`` seconds, with the tokens of
    ``observation``; after the last, the sequence is done."""

    def __init__(self, tok, turns=3, delay=lambda end: 0.0):
        self.tok, self.turns, self.delay = tok, turns, delay
        self.pool = ThreadPoolExecutor(4)
        self.seen: list[TurnEnd] = []
        self.lock = threading.Lock()

    def observation(self, end: TurnEnd) -> list[int]:
        text = f"<|im_end|>\n<|im_start|>tool\nresult {end.prompt_index}.{end.sample_index}.{end.turns}<|im_end|>\n" \
               "<|im_start|>assistant\n"
        return self.tok.encode(text, add_special_tokens=False)

    def __call__(self, end: TurnEnd):
        with self.lock:
            self.seen.append(end)
        if end.turns >= self.turns:
            return None

        def answer():
            time.sleep(self.delay(end))
            return self.observation(end)
        return self.pool.submit(answer)


def run(engine, prompts, params, hook):
    return {(c.prompt_index, c.sample_index): c for group in engine.generate(prompts, params, turn_ended=hook)
            for c in group}


@pytest.mark.parametrize("resume", ["park", "prefill"])
def test_sampled_tokens_are_exact_and_appended_ones_are_marked(lm, resume):
    model, tok = lm
    engine = TorchEngine(model, tok, max_batch_size=3, resume=resume)  # 6 sequences: slots refill
    prompts = make_prompts([5, 19, 11])
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=12, stop=STOPS, seed=3, max_total_tokens=200)
    hook = ScriptedTools(tok, turns=3, delay=lambda end: random.random() * 0.02)
    out = run(engine, prompts, params, hook)
    assert len(out) == 6 and engine.stats["tool_waits"] == sum(c.turns - 1 for c in out.values()) > 0
    assert engine.stats["extend_forwards"] == engine.stats["tool_waits"]
    for (p, s), c in out.items():
        assert c.turns == 3 and c.mask is not None and len(c.mask) == len(c.token_ids) == len(c.versions)
        # what was appended, in order: each turn's observation, exactly where the turn ended
        ends = [e for e in hook.seen if (e.prompt_index, e.sample_index) == (p, s)]
        assert [e.turns for e in ends] == [1, 2, 3]
        expected_mask = []
        for e in ends[:-1]:
            turn = e.token_ids[e.turn_start:]
            expected_mask += [True] * len(turn) + [False] * len(hook.observation(e))
            assert c.token_ids[:len(e.token_ids)] == e.token_ids
            appended = c.token_ids[len(e.token_ids):len(e.token_ids) + len(hook.observation(e))]
            assert appended == hook.observation(e)
        expected_mask += [True] * (len(c.token_ids) - len(expected_mask))
        assert c.mask == expected_mask
        sampled = torch.tensor(c.mask)
        assert (c.logprobs[~sampled] == 0).all() and all((v == -1) != m for v, m in zip(c.versions, c.mask))
        # the log-probs of the sampled tokens are those of one plain forward over the trajectory
        ref, ids = reference_logprobs(model, prompts[p], c.token_ids, 0.9)
        expected = ref.gather(1, ids[:, None]).squeeze(1).cpu()
        torch.testing.assert_close(c.logprobs[sampled], expected[sampled], atol=2e-5, rtol=0)


@pytest.mark.parametrize("resume", ["park", "prefill"])
def test_a_seeded_call_samples_the_same_whatever_the_tools_timing(lm, resume):
    """Batch-invariant steps: every run of the same seed, whatever its tools' delays (so
    whichever sequences share a decode step), makes the same trajectories to the last bit."""
    model, tok = lm
    prompts = make_prompts([7, 13, 4, 9])
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, stop=STOPS, seed=11, max_total_tokens=160)
    runs = []
    for delays in ((0.0,), (0.0, 0.03, 0.001), (0.02, 0.0)):
        engine = TorchEngine(model, tok, max_batch_size=3, resume=resume, batch_invariant=True,
                             cuda_graphs=graphs(model))
        rng = random.Random(len(runs))
        out = run(engine, prompts, params, ScriptedTools(tok, turns=3, delay=lambda end: rng.choice(delays)))
        runs.append({k: (c.token_ids, c.logprobs.tolist()) for k, c in out.items()})
    assert runs[0] == runs[1] == runs[2]
    assert len({tuple(v[0]) for v in runs[0].values()}) == 8  # the sequences differ from each other


def test_batch_invariant_steps_are_exact(lm):
    """At one shape, the log-probs are still those of a plain forward."""
    model, tok = lm
    engine = TorchEngine(model, tok, max_batch_size=4, batch_invariant=True, cuda_graphs=graphs(model))
    prompts = make_prompts([5, 19, 11])
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=12, stop=STOPS, seed=3, max_total_tokens=200)
    out = run(engine, prompts, params, ScriptedTools(tok, turns=2))
    assert engine.stats["prefill_forwards"] == 3  # each prompt alone
    for (p, _), c in out.items():
        sampled = torch.tensor(c.mask if c.mask else [True] * len(c.token_ids))
        ref, ids = reference_logprobs(model, prompts[p], c.token_ids, 0.9)
        torch.testing.assert_close(c.logprobs[sampled], ref.gather(1, ids[:, None]).squeeze(1).cpu()[sampled], atol=2e-5,
                                   rtol=0)


def test_other_sequences_go_on_while_a_tool_runs(lm):
    """Prompt 0's tool takes 1 s; prompt 1's sequences are done at their first turn: they come
    out while prompt 0's tool still runs."""
    model, tok = lm
    engine = TorchEngine(model, tok, max_batch_size=4)
    answered = {}

    def slow(end):
        if end.prompt_index == 1 or end.turns > 1:
            return None
        pool = ThreadPoolExecutor(1)

        def answer():
            time.sleep(1.0)
            answered[end.sample_index] = time.monotonic()
            return tok.encode("<|im_end|>\nok\n", add_special_tokens=False)
        return pool.submit(answer)

    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=30, seed=0, max_total_tokens=120)
    order = []
    for group in engine.generate(make_prompts([6, 8]), params, turn_ended=slow):
        order.append((group[0].prompt_index, time.monotonic()))
    assert [p for p, _ in order] == [1, 0]
    assert order[0][1] < min(answered.values())


def test_bounds_end_a_trajectory_at_length(lm):
    model, tok = lm
    engine = TorchEngine(model, tok, max_batch_size=2)
    long_answer = list(tok.encode("x" * 50, add_special_tokens=False))

    def hook(end):
        done = ThreadPoolExecutor(1).submit(lambda: long_answer)
        return done

    prompt = make_prompts([10])
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=5, seed=0, max_total_tokens=40)
    (c,) = [c for g in engine.generate(prompt, params, turn_ended=hook) for c in g]
    # 10 + 5 tokens, then 50 would cross 40: not appended, the trajectory ends at "length"
    assert c.finish_reason == "length" and len(c.token_ids) <= 5 and c.mask is None and c.turns == 1
    # room enough for one answer, not for the next: the second is refused
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=5, seed=0, max_total_tokens=10 + 5 + 50 + 5 + 20)
    (c,) = [c for g in engine.generate(prompt, params, turn_ended=hook) for c in g]
    assert c.finish_reason == "length" and c.turns == 2 and c.mask.count(False) == 50
    assert 10 + len(c.token_ids) <= params.max_total_tokens
    # a turn that fills the trajectory to its limit ends it without asking the hook
    asked = []
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=50, seed=0, max_total_tokens=14)
    (c,) = [c for g in engine.generate(prompt, params, turn_ended=lambda e: asked.append(e)) for c in g]
    assert len(c.token_ids) == 4 and c.finish_reason == "length" and asked == []


def test_a_call_that_takes_turns_needs_a_bound(lm):
    model, tok = lm
    engine = TorchEngine(model, tok)
    engine.max_positions = None
    with pytest.raises(ValueError, match="max_total_tokens"):
        engine.generate(make_prompts([4]), SamplingParams(), turn_ended=lambda end: None)
    with pytest.raises(ValueError, match="resume"):
        TorchEngine(model, tok, resume="keep")


def test_benchmark_smoke():
    """benchmarks/turns.py on the tiny model: every side makes the same trajectories."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "turns.py"
    done = subprocess.run([sys.executable, str(script), "--model", "tiny-llama", "--prompts", "2", "--samples", "2",
                           "--batch", "3", "--repeats", "1", "--tool-ms", "20", "--max-new-tokens", "8"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["same_trajectories"] is True
    assert set(result["ratios"]) == {"sleep / no_sleep", "park / prefill", "invariant / variable"}
    assert all(run["tool_waits"] > 0 for runs in result["runs"].values() for run in runs)
