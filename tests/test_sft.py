"""Supervised fine-tuning (``m2flow/runners/sft.py``, ``m2flow/data/chats.py``): a chat's tokens
are those of its conversation as the agentic rollout renders it, the loss is on the assistant's
tokens only, packed rows score each chat as if alone, and a run lowers the held-out loss, writes
a model that an agentic run starts from, and resumes from its checkpoints."""

import json
import math
from pathlib import Path

import pytest
import torch

from m2flow.config import ConfigError, load_config
from m2flow.data.chats import calculation_chats, load_chats, pack, packed_rows, tokenize_chat
from m2flow.engines.scoring import compute_logprobs
from m2flow.models.lm import byte_tokenizer, load_lm
from m2flow.runners.flow import flow_named
from m2flow.runners.sft import FLOW
from m2flow.tools import load
from m2flow.tools.calls import tools_prompt
from m2flow.tools.episodes import turn_separator

PRESET = "sft/calc_tiny"
ROOT = Path(__file__).resolve().parents[1]
CHAT = {"tools": [load("calculator").schema], "messages": [
    {"role": "user", "content": "What is 12*34?"},
    {"role": "assistant", "content": "Let me compute.", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "12*34"}'}}]},
    {"role": "tool", "tool_call_id": "call_0", "name": "calculator", "content": "408"},
    {"role": "assistant", "content": "It is 408."},
    {"role": "user", "content": "And doubled?"},
    {"role": "assistant", "content": "816."}]}


def test_a_chat_is_its_conversation_as_the_rollout_renders_it_and_only_the_assistant_is_learned():
    tok = byte_tokenizer()
    _, after = turn_separator(tok)
    chat = tokenize_chat(CHAT, tok, after)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
    # the conversation in the form the rollout writes: tools offered in the system turn (the
    # template takes no tools=), the call in the assistant's own text
    conversation = [{"role": "system", "content": tools_prompt(CHAT["tools"])},
                    {"role": "user", "content": "What is 12*34?"},
                    {"role": "assistant", "content": f"Let me compute.\n{call}"},
                    {"role": "tool", "content": "408"}, {"role": "assistant", "content": "It is 408."},
                    {"role": "user", "content": "And doubled?"}, {"role": "assistant", "content": "816."}]
    expected = tok.apply_chat_template(conversation, tokenize=True, return_dict=False)
    assert list(chat.token_ids) + tok.encode(after, add_special_tokens=False) == expected
    learned = tok.decode([t for t, m in zip(chat.token_ids, chat.mask) if m])
    assert learned == f"Let me compute.\n{call}<|im_end|>It is 408.<|im_end|>816.<|im_end|>"


def test_packing_fills_rows_and_a_packed_row_scores_each_chat_as_if_alone():
    assert pack([5, 3, 4, 2], 7) == [[0, 3], [2, 1]]
    assert pack([9, 2], 4) == [[0], [1]]  # one too long fills a row alone (cut by the caller)
    model, tok = load_lm("tiny-llama")
    chats = calculation_chats(3, "train", 0, None)
    alone = [packed_rows([c], tok, 4096) for c in chats]
    packed = packed_rows(chats, tok, 4096)
    assert len(packed) == 1 and (packed.position_ids[0] == 0).sum() == 3  # three chats in one row
    with torch.no_grad():
        lp = compute_logprobs(model, packed, 10**6, share_prompts=False)
        ref = [compute_logprobs(model, a, 10**6, share_prompts=False) for a in alone]
    got = lp[packed.completion_mask.bool()]
    # the same tokens learned, in the row's order of the chats (longest first)
    order = sorted(range(3), key=lambda i: -len(alone[i].input_ids[0]))
    want = torch.cat([ref[i][alone[i].completion_mask.bool()] for i in order])
    assert got.shape == want.shape and got.numel() > 0
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_a_chat_file_is_read_and_its_mistakes_are_named(tmp_path):
    good = tmp_path / "chats.jsonl"
    good.write_text(json.dumps(CHAT) + "\n\n" + json.dumps(CHAT) + "\n")
    assert len(load_chats(good)) == 2
    for text, says in (("{not json", "line 2: not JSON"), ('{"messages": "hi"}', "row 2: a row is"),
                       ('{"messages": [{"role": "user", "content": "hi"}]}', "row 2: no assistant message")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps(CHAT) + "\n" + text + "\n")
        with pytest.raises(ValueError, match=f"bad.jsonl {says}"):
            load_chats(bad)
    with pytest.raises(ConfigError, match="data.source"):
        load_config(PRESET, [f"data.source={tmp_path / 'missing.jsonl'}"])
    with pytest.raises(ConfigError, match="algorithm.kl_coef"):
        load_config(PRESET, ["algorithm.kl_coef=0.1"])
    assert flow_named("sft") is FLOW


def test_sft_runs_supervised_presets_and_train_the_others(capsys):
    from m2flow.cli import main

    for argv, says in ((["sft", "agentic/tool_arith_tiny"], "m2flow train runs it"),
                       (["train", PRESET], "runs with m2flow sft")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err


def _run(cfg, cluster, pool):
    runner = FLOW.runner(cfg, cluster=cluster, pool=pool)
    try:
        return runner.train(trace=False), runner
    finally:
        runner.close()


def test_it_lowers_the_held_out_loss_writes_a_model_an_agentic_run_starts_from_and_resumes(cluster, pool,
                                                                                           tmp_path):
    """Four steps on calculator demonstrations (a file the demonstrations script wrote) lower the
    held-out loss (with no learning, it would stay as it was, to the last bit: the held-out rows and
    weights are the same at each evaluation); a run resumed from its step-2 checkpoint ends with
    the same weights; the model it writes is where an agentic run starts."""
    import runpy
    import shutil

    from m2flow.runners.agentic import FLOW as AGENTIC
    from m2flow.engines.weights import weights_hash

    demos = tmp_path / "demos.jsonl"
    with pytest.MonkeyPatch.context() as m:  # the script as its command line runs it, in this process
        m.setattr("sys.argv", ["demonstrations.py", "calculation", "--n", "40", "--out", str(demos)])
        runpy.run_path(str(ROOT / "scripts" / "demonstrations.py"), run_name="__main__")
    out = tmp_path / "sft"
    base = ["runner.progress=false", "runner.steps=4", "runner.eval_every=2", "runner.checkpoint_every=2",
            f"data.source={demos}"]
    rows, runner = _run(load_config(PRESET, [*base, f"runner.out_dir={out}"]), cluster, pool)
    losses = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert len(losses) == 3 and losses[0] - 0.5 > losses[1] > losses[2], losses
    steps = [r for r in rows if not math.isnan(r.get("step_s", math.nan))]
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and all(0 < r["learned_share"] < 1 for r in steps)
    assert all(len(ids) == 2 for ids in runner.metrics.ledger.trained.values())  # two rows a step, each once
    model, _ = load_lm(out / "model")
    from m2flow.cli import main

    main(["eval", PRESET, "checkpoint=auto", *base, f"runner.out_dir={out}"])  # the held-out loss, per chat
    result = json.loads((out / "checkpoints" / "step_000004.eval.json").read_text())
    assert result["chats"] == 16 and result["eval_loss"] == pytest.approx(losses[-1], abs=1e-4)

    resumed_out = tmp_path / "resumed"
    shutil.copytree(out, resumed_out)
    shutil.rmtree(resumed_out / "model")
    (ckpt,) = (resumed_out / "checkpoints").glob("step_000002*.safetensors")
    again, _ = _run(load_config(PRESET, [*base, f"runner.out_dir={resumed_out}", f"runner.resume={ckpt}"]),
                    cluster, pool)
    assert [r["step"] for r in again if not math.isnan(r.get("step_s", math.nan))] == [1, 2, 3, 4]  # 2 + 2
    assert weights_hash(load_lm(resumed_out / "model")[0]) == weights_hash(model)

    cfg = load_config("agentic/tool_arith_tiny", ["runner.steps=1", "runner.eval_every=0", "runner.progress=false",
                                                  f"model.path={out / 'model'}", f"runner.out_dir={tmp_path / 'rl'}"])
    runner = AGENTIC.runner(cfg, cluster=cluster, pool=pool)
    try:
        assert runner.trainer.weights_hash().wait()[0] == weights_hash(model)
        assert runner.train(trace=False)[-1]["step"] == 1
    finally:
        runner.close()
