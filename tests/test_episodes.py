"""Tool use over several turns (m2flow.tools.episodes): a turn's calls run and the engine is
answered with the template's own tokens; a trajectory ends when the model answers, at
max_turns, when its turn was cut, or when the results would cross its bound. End to end on a
tiny model taught one tool-using conversation: the trajectory's tokens are exactly those of
``apply_chat_template`` of its conversation, and the log-probs those of a plain forward."""

import dataclasses
import functools
import json
import threading
from concurrent.futures import Future

import pytest
import torch

from m2flow.engines import SamplingParams, TorchEngine
from m2flow.engines.generation import TurnEnd
from m2flow.models.lm import byte_tokenizer, load_lm
from m2flow.tools import Toolbox, load
from m2flow.tools.base import MALFORMED, UNKNOWN_TOOL
from m2flow.tools.episodes import ANSWERED, MAX_TURNS, NO_ROOM, TURN_CUT, ToolTurns, turn_separator

from test_engine import reference_logprobs


def calls_text(*calls) -> str:
    return "".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)


@pytest.fixture
def turns():
    tok = byte_tokenizer()
    hook = ToolTurns(Toolbox([load("calculator")]), tok, {tok.eos_token_id}, max_turns=3)
    yield hook, tok
    hook.close()


def end_of(tok, text, turns=1, finish="stop", room=1000, prompt=(5, 6), before=()):
    ids = list(tok.encode(text, add_special_tokens=False)) + [tok.eos_token_id]
    return TurnEnd(0, 0, list(prompt), [*before, *ids], len(before), finish, turns, room)


def test_the_turn_separator_is_the_templates_own():
    assert turn_separator(byte_tokenizer()) == ("<|im_end|>", "\n")


def test_calls_run_and_the_answer_is_the_templates_tool_turn(turns):
    hook, tok = turns
    answer = hook(end_of(tok, "Let me compute. " + calls_text(("calculator", {"expression": "12*34"}),
                                                                  ("calculator", {"expression": "1/0"}))))
    text = tok.decode(answer.result(timeout=30))
    assert text.startswith("\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>tool\nError:")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    # no call: the model answered, the trajectory is done
    assert hook(end_of(tok, "The answer is 408.", turns=2)) is None
    episode = hook.take(0, 0)
    assert episode.ended == ANSWERED and episode.tool_calls == 2 and len(episode.results) == 1
    assert episode.results[0][0].text == "408" and sum(episode.errors.values()) == 1
    assert hook.episodes == {}


def test_a_bad_call_is_an_observation_and_counted(turns):
    hook, tok = turns
    answer = hook(end_of(tok, "<tool_call>{not json}</tool_call>" + calls_text(("weather", {"city": "x"}))))
    text = tok.decode(answer.result(timeout=30))
    assert text.count("Error:") == 2 and "no tool named 'weather'" in text
    hook(end_of(tok, "done", turns=2))
    assert hook.take(0, 0).errors == {MALFORMED: 1, UNKNOWN_TOOL: 1}


def test_where_a_trajectory_ends(turns):
    hook, tok = turns
    call = calls_text(("calculator", {"expression": "2+2"}))
    assert hook(end_of(tok, call, turns=3)) is None and hook.take(0, 0).ended == MAX_TURNS
    cut = TurnEnd(0, 0, [5], list(tok.encode(call[:-3], add_special_tokens=False)), 0, "length", 1, 100)
    assert hook(cut) is None and hook.take(0, 0).ended == TURN_CUT
    answer = hook(end_of(tok, call, room=10))  # the results would not fit
    assert len(answer.result(timeout=30)) >= 10 and hook.take(0, 0).ended == NO_ROOM
    assert hook.take(3, 1).ended == NO_ROOM  # the engine ended it at its bound without asking
    with pytest.raises(ValueError, match="max_turns"):
        ToolTurns(Toolbox([]), tok, set(), max_turns=0)


def shout(text: str) -> str:
    """Says it back, louder.

    Args:
        text: what to say.
    """
    return text.upper()


def test_calls_may_run_elsewhere(turns):
    """``run``: a turn's calls go where the caller says (tool workers), by the trajectory's key,
    answered through a future; its results are cut to the response limit by the rollout's
    tokenizer; ``forget`` hears of each trajectory that made calls once it is out."""
    _, tok = turns
    sent, forgotten = [], []
    toolbox = Toolbox([load("calculator"), load(f"{__name__}:shout")])

    def run(key, calls):
        sent.append((key, [c.name for c in calls]))
        done = Future()
        done.set_result(toolbox.run(calls, max_response_tokens=10**6))
        return done

    hook = ToolTurns(Toolbox([]), tok, {tok.eos_token_id}, run=run, forget=forgotten.append, max_response_tokens=8)
    answer = hook(end_of(tok, calls_text(("calculator", {"expression": "3**4"}))))
    assert "81" in tok.decode(answer.result(timeout=30)) and sent == [((0, 0), ["calculator"])]
    long = hook(dataclasses.replace(end_of(tok, calls_text(("shout", {"text": "a" * 500}))), prompt_index=1))
    long = long.result(timeout=30)
    assert "[cut at 8 tokens]" in tok.decode(long) and len(tok.decode(long)) < 200
    assert hook.take(0, 0).tool_calls == 1 and forgotten == [(0, 0)]


def test_the_time_a_trajectory_waits_on_its_tools_is_kept(turns):
    """``Episode.waited_s``: from a turn's end until its results' tokens are ready, summed over
    its turns; each result keeps the time its call took."""
    _, tok = turns

    toolbox = Toolbox([load("calculator")])

    def slow(key, calls):
        done = Future()
        threading.Timer(0.2, lambda: done.set_result(toolbox.run(calls))).start()
        return done

    hook = ToolTurns(Toolbox([]), tok, {tok.eos_token_id}, run=slow, max_turns=3)
    call = calls_text(("calculator", {"expression": "2+2"}))
    for turn in (1, 2):
        hook(end_of(tok, call, turns=turn)).result(timeout=30)
    assert hook(end_of(tok, "4", turns=3)) is None
    episode = hook.take(0, 0)
    assert 0.4 <= episode.waited_s < 5 and len(episode.results) == 2
    assert all(0 <= r.seconds < 0.2 for turn in episode.results for r in turn)  # the calls, not the wait before them


# -- end to end: a tiny model taught one conversation -------------------------------------
QUESTION = "What is 12*34?"
CALL = calls_text(("calculator", {"expression": "12*34"}))


@functools.lru_cache(maxsize=1)  # tests/test_tool_workers.py uses it too; generating leaves it as it is
def taught_model():
    """tiny-llama trained until it says, greedily, the conversation's two assistant turns."""
    model, tok = load_lm("tiny-llama")
    conversation = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": CALL},
                    {"role": "tool", "content": "408"}, {"role": "assistant", "content": "It is 408."}]
    ids = torch.tensor([tok.apply_chat_template(conversation, tokenize=True, return_dict=False)])
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(800):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 1e-3:
            break
    return model.eval(), tok, conversation


def test_a_trajectory_is_the_template_of_its_conversation():
    model, tok, conversation = taught_model()
    prompt = tok.apply_chat_template(conversation[:1], tokenize=True, add_generation_prompt=True, return_dict=False)
    hook = ToolTurns(Toolbox([load("calculator")]), tok, {tok.eos_token_id})
    engine = TorchEngine(model, tok, max_batch_size=2)
    params = SamplingParams(n=1, temperature=0, max_new_tokens=120, max_total_tokens=400)
    (c,) = [c for g in engine.generate([prompt], params, turn_ended=hook) for c in g]
    hook.close()
    episode = hook.take(0, 0)
    assert c.turns == 2 and episode.ended == ANSWERED and episode.results[0][0].text == "408"
    expected = tok.apply_chat_template(conversation, tokenize=True, return_dict=False)
    end, after = turn_separator(tok)
    tail = tok.encode(after, add_special_tokens=False)  # the template's newline after the last turn
    assert prompt + c.token_ids + tail == expected
    sampled = torch.tensor(c.mask)
    assert sampled.sum() == len(tok.encode(CALL)) + 1 + len(tok.encode("It is 408.")) + 1
    ref, ids = reference_logprobs(model, prompt, c.token_ids, 1.0)
    torch.testing.assert_close(c.logprobs[sampled], ref.gather(1, ids[:, None]).squeeze(1)[sampled], atol=2e-5, rtol=0)
