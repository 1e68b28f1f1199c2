"""Prompt data: the arithmetic generator (determinism, disjoint splits, graded difficulty),
JSONL/Parquet loading, chat-formatted prompts, and the loader's resumable position."""

import json

import pytest

from m2flow.data import LEVELS, Problem, PromptLoader, arithmetic_problems, build_prompts, load_problems
from m2flow.data.arithmetic import skeleton_split


def evaluate(problem: Problem) -> int:
    """Recomputes the answer from the problem's id, which spells its skeleton ("7+5-3")."""
    skeleton = problem.id.split("-", 2)[2]
    value, op, num = None, None, ""
    for ch in skeleton + "$":
        if ch.isdigit():
            num += ch
            continue
        n = int(num)
        value = n if value is None else {"+": value + n, "-": value - n, "*": value * n, "/": value // n}[op]
        op, num = ch, ""
    return value


def test_generator_is_deterministic_and_seeded():
    a = arithmetic_problems(50, levels=[1, 2, 3], seed=7)
    assert a == arithmetic_problems(50, levels=[1, 2, 3], seed=7)
    assert a != arithmetic_problems(50, levels=[1, 2, 3], seed=8)
    assert len({p.question for p in a}) == 50


def test_held_out_split_never_overlaps_train():
    for level in LEVELS:
        train = arithmetic_problems(300, level, "train", seed=0) + arithmetic_problems(300, level, "train", seed=1)
        test = arithmetic_problems(100, level, "test", seed=0)
        train_skeletons = {p.id for p in train}
        assert not train_skeletons & {p.id for p in test}
        assert not {p.question for p in train} & {p.question for p in test}
        assert all(skeleton_split(p.id.split("-", 2)[2]) == "test" for p in test)
    with pytest.raises(ValueError, match="split"):
        arithmetic_problems(1, split="val")


def test_difficulty_grades_with_level():
    for level, spec in LEVELS.items():
        problems = arithmetic_problems(100, level, seed=0)
        for p in problems:
            assert p.level == level
            assert int(p.answer) == evaluate(p) >= 0
            ops = [c for c in p.id.split("-", 2)[2] if c in "+-*/"]
            assert len(ops) == spec.steps and set(ops) <= set(spec.ops)
            assert p.question.count(".") == spec.steps + 1  # start sentence + one per operation
    mean_answer = {lv: sum(int(p.answer) for p in arithmetic_problems(200, lv)) / 200 for lv in LEVELS}
    assert mean_answer[1] < 25 < mean_answer[2] < mean_answer[3] < mean_answer[5]
    assert set(LEVELS[1].ops) == {"+", "-"} and LEVELS[5].steps == 4


def test_load_jsonl_gsm8k_style(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    rows = [{"question": "What is 2+3?", "answer": "2+3=5\n#### 5"},
            {"question": "Half of 1?", "answer": "\\frac{1}{2}"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    problems = load_problems(path)
    assert [(p.question, p.answer, p.id) for p in problems] == [
        ("What is 2+3?", "5", "gsm8k-0"), ("Half of 1?", "\\frac{1}{2}", "gsm8k-1")]
    other = tmp_path / "math.jsonl"
    other.write_text(json.dumps({"problem": "1+1", "solution": "It is \\boxed{2}.", "uid": "a"}) + "\n")
    assert load_problems(other, "problem", "solution", id_key="uid") == [Problem("1+1", "It is \\boxed{2}.", "a")]
    with pytest.raises(KeyError, match="question"):
        load_problems(other)
    empty = tmp_path / "empty.jsonl"  # a null or blank field would train against the text "None" or nothing
    for row, field in (({"question": "q", "answer": None}, "answer"), ({"question": " ", "answer": "1"}, "question")):
        empty.write_text(json.dumps({"question": "q0", "answer": "0"}) + "\n" + json.dumps(row) + "\n")
        with pytest.raises(ValueError, match=f"empty.jsonl row 1: field '{field}' is empty"):
            load_problems(empty)
    twice = tmp_path / "twice.jsonl"
    twice.write_text("".join(json.dumps({"question": f"q{i}", "answer": "1", "uid": u}) + "\n"
                             for i, u in enumerate("aba")))
    with pytest.raises(ValueError, match="twice.jsonl rows 0 and 2: the same id 'a' in field 'uid'"):
        load_problems(twice, id_key="uid")


def test_load_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"question": ["q1", "q2"], "answer": ["1", "#### 2"]}), path)
    assert [(p.question, p.answer) for p in load_problems(path)] == [("q1", "1"), ("q2", "2")]


def test_build_prompts_applies_chat_template():
    from m2flow.models.lm import byte_tokenizer

    tok = byte_tokenizer()
    [prompt] = build_prompts([Problem("What is 2+3?", "5")], tok, instruction="Box it.", system="Be brief.")
    assert prompt.text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                           "<|im_start|>user\nWhat is 2+3?\nBox it.<|im_end|>\n"
                           "<|im_start|>assistant\n")
    assert tok.decode(prompt.token_ids) == prompt.text
    assert prompt.token_ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_loader_resume_gives_same_batches():
    items = list(range(23))
    loader = PromptLoader(items, batch_size=5, seed=3)
    assert len(loader) == 4
    first_epoch = [next(loader) for _ in range(4)]
    assert all(len(b) == 5 for b in first_epoch)
    assert len({x for b in first_epoch for x in b}) == 20  # no repeats within an epoch
    for _ in range(3):
        next(loader)
    state = loader.state_dict()
    expected = [next(loader) for _ in range(6)]  # crosses two epoch boundaries

    resumed = PromptLoader(items, batch_size=5, seed=3)
    resumed.load_state_dict(state)
    assert [next(resumed) for _ in range(6)] == expected
    assert resumed.epoch == loader.epoch == 3

    # Epochs reshuffle, deterministically.
    a, b = PromptLoader(items, 23, seed=3), PromptLoader(items, 23, seed=3)
    e0, e1 = next(a), next(a)
    assert e0 != e1 and sorted(e0) == sorted(e1) == items
    assert [next(b), next(b)] == [e0, e1]
    assert next(PromptLoader(items, 23, shuffle=False)) == items
    with pytest.raises(ValueError, match="items"):
        resumed.load_state_dict({**state, "num_items": 10})


def test_a_tokenizer_without_a_chat_template_is_a_config_error(monkeypatch):
    """Prompts are chat-formatted: a base model's tokenizer, with no chat template, is one
    line naming model.path, not transformers' traceback when the first prompts are made."""
    from m2flow.config import ConfigError, load_config
    from m2flow.data.prompts import load_prompts
    from m2flow.models import lm

    def plain(spec, cache_dir=None):
        tok = lm.byte_tokenizer()
        tok.chat_template = None
        return tok

    monkeypatch.setattr(lm, "load_tokenizer", plain)
    with pytest.raises(ConfigError, match="model.path: the tokenizer of 'tiny-llama' has no chat template, and the "
                                          "prompts are chat-formatted"):
        load_prompts(load_config("reasoning/grpo_arith_tiny"))
