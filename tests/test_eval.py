"""``m2flow eval``: a trained checkpoint scored from the command line (tiny models)."""

import json

import pytest
import torch

import m2flow.runners.reasoning as reasoning
from m2flow.cli import main
from m2flow.config import load_config
from m2flow.runners.embodied import EmbodiedRunner
from m2flow.runners.reasoning import ReasoningRunner


def _train(runner_cls, cluster, pool, preset, overrides):
    runner = runner_cls(load_config(preset, overrides), cluster=cluster, pool=pool)
    try:
        return runner.train()
    finally:
        runner.close()


@pytest.mark.slow  # 18 s; m2flow eval runs by default on an embodied checkpoint (test_eval_runs_episodes_...)
def test_eval_scores_a_reasoning_checkpoint_as_the_run_did_and_a_file_of_the_users(cluster, pool, tmp_path, capsys,
                                                                                   monkeypatch):
    preset = "reasoning/grpo_arith_tiny"
    # one rollout rank, as the evaluation generates: the same batches, so the same greedy tokens;
    # bfloat16 rollouts: the evaluation rounds the trained weights as the run's rollout did
    overrides = [f"runner.out_dir={tmp_path / 'run'}", "runner.progress=false", "runner.steps=2", "rollout.dtype=bfloat16",
                 "placement.mode=custom", *(f"placement.components.{c}=0" for c in ("rollout", "reward", "inference", "actor"))]
    history = _train(ReasoningRunner, cluster, pool, preset, overrides)
    # the dtype it generates with, seen as the engine is built (a tiny model's greedy tokens may not show it)
    real, dtypes = reasoning.build_engine, []
    monkeypatch.setattr(reasoning, "build_engine",
                        lambda backend, model, *a, **k: dtypes.append(next(model.parameters()).dtype)
                        or real(backend, model, *a, **k))
    main(["eval", preset, "checkpoint=auto", *overrides])
    assert dtypes == [torch.bfloat16]  # the weights rounded to the rollout's dtype, as the run's rollout had them
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "run" / "checkpoints" / "step_000002.eval.json").read_text())
    # the held-out prompts, greedy, with the final weights: the score the run's last evaluation gave
    assert result["reward"] == pytest.approx(history[-1]["eval_reward"], abs=1e-6)
    assert result["prompts"] == load_config(preset).data.test_size and result["trained_for"] == 2
    assert "accuracy" in printed and f"{result['reward']:.4g}" in printed
    # a JSONL file of the user's: every row is scored, however few (none is trained on: the
    # preset's data.test_size and data.prompts_per_step do not apply)
    rows = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(3)]
    (tmp_path / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    main(["eval", preset, f"checkpoint={tmp_path / 'run' / 'checkpoints' / 'step_000002.safetensors'}",
          f"data.source={tmp_path / 'mine.jsonl'}", f"out={tmp_path / 'mine.json'}"])
    mine = json.loads((tmp_path / "mine.json").read_text())
    assert mine["prompts"] == 3 and 0.0 <= mine["accuracy"] <= 1.0 and "reward_digit_share" in mine
    # and each prompt as a line of JSON beside it: the question as the model saw it, its
    # completion, the answer and the scores, which the summary averages; the data file is
    # left as it was
    assert [json.loads(line) for line in (tmp_path / "mine.jsonl").read_text().splitlines()] == rows
    examples = [json.loads(line) for line in (tmp_path / "mine.examples.jsonl").read_text().splitlines()]
    assert [e["index"] for e in examples] == [0, 1, 2] and [e["answer"] for e in examples] == ["0", "2", "4"]
    assert all(rows[e["index"]]["question"] in e["prompt"] and isinstance(e["completion"], str) for e in examples)
    assert sum(e["reward"] for e in examples) / 3 == pytest.approx(mine["reward"])
    assert sum(e["solved"] for e in examples) / 3 == pytest.approx(mine["accuracy"])
    assert sum(e["reward_digit_share"] for e in examples) / 3 == pytest.approx(mine["reward_digit_share"])


def test_eval_runs_episodes_of_an_embodied_checkpoint(cluster, pool, tmp_path, capsys):
    preset = "embodied/ppo_cartpole"
    overrides = [f"runner.out_dir={tmp_path}", "runner.progress=false", "runner.total_env_steps=512",
                 "env.kwargs.max_episode_steps=25", "runner.eval_every=1", "runner.eval_episodes=7",
                 "placement.mode=custom",
                 *(f"placement.components.{c}=0-1" for c in ("env", "rollout", "actor"))]
    history = _train(EmbodiedRunner, cluster, pool, preset, overrides)
    # evaluated during the run (runner.eval_every): before the first update, then after each
    assert [row["env_steps"] for row in history if "eval_return" in row] == [0, 256, 512]
    # the run's trace, its last update drawn, and summed up per component
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    main(["trace", str(tmp_path)])
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:-1]}
    assert {"env", "actor"} <= set(rows) and rows["env"][1] == rows["actor"][1] == "2"  # ranks
    assert float(rows["env"][2]) > 0 and float(rows["actor"][2]) > 0  # seconds computing
    checkpoint = next((tmp_path / "checkpoints").glob("*.safetensors"))
    main(["eval", preset, f"checkpoint={checkpoint}", "episodes=7", f"out={tmp_path / 'eval.json'}", *overrides])
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["episodes"] == 7 and "mean_return" in printed and "success_rate" in printed
    # CartPole pays 1 a step: every return is its episode's length, at most the time limit
    assert result["mean_return"] == pytest.approx(result["mean_length"])
    assert 1 <= result["min_return"] <= result["max_return"] <= 25
    assert result["success_rate"] is None  # CartPole reports no success
    episodes = [json.loads(line) for line in (tmp_path / "eval.examples.jsonl").read_text().splitlines()]
    assert [e["episode"] for e in episodes] == list(range(7)) and all(e["success"] is None for e in episodes)
    assert sum(e["return"] for e in episodes) / 7 == pytest.approx(result["mean_return"])
    assert max(e["return"] for e in episodes) == result["max_return"]
    # the run's last evaluation played the same episodes with the same weights
    assert history[-1]["eval_return"] == pytest.approx(result["mean_return"])
    assert history[-1]["eval_length"] == pytest.approx(result["mean_length"])
    again = tmp_path / "again.json"
    main(["eval", preset, f"checkpoint={checkpoint}", "episodes=7", f"out={again}", *overrides])
    assert json.loads(again.read_text())["mean_return"] == result["mean_return"]  # deterministic
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # an env that cannot be made: one line, before any episode
        main(["eval", preset, f"checkpoint={checkpoint}", *overrides, "env.id=CartPole-v9"])
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("m2flow: error: env.id: cannot make 'CartPole-v9': ")
    with pytest.raises(SystemExit) as e:  # nowhere to write the result: said before the episodes
        main(["eval", preset, f"checkpoint={checkpoint}", *overrides, f"out={tmp_path / 'no' / 'e.json'}"])
    assert e.value.code == 2 and "m2flow: error: out: cannot write the result to" in capsys.readouterr().err
    for where in ("/proc/e.json", tmp_path):  # a directory that takes no files (even from root); a directory
        with pytest.raises(SystemExit) as e:
            main(["eval", preset, f"checkpoint={checkpoint}", *overrides, f"out={where}"])
        assert e.value.code == 2 and f"m2flow: error: out: cannot write the result to '{where}': " in (
            capsys.readouterr().err)
    assert list(tmp_path.glob(".*.probe")) == []
    with pytest.raises(SystemExit) as e:  # another flow's config
        main(["eval", "reasoning/grpo_arith_tiny", f"checkpoint={checkpoint}"])
    assert e.value.code == 2 and capsys.readouterr().err.strip() == (
        f"m2flow: error: checkpoint: {checkpoint} is a checkpoint of the embodied flow; the config is of the reasoning "
        "flow")


def test_eval_input_mistakes_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", "embodied/ppo_cartpole"])
    assert e.value.code == 2 and "checkpoint: m2flow eval needs checkpoint=FILE" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "embodied/ppo_cartpole", "checkpoint=x", "episodes=none"])
    assert "episodes: must be a whole number >= 1, got 'none'" in capsys.readouterr().err
    (tmp_path / "x.safetensors").write_bytes(b"not one")
    with pytest.raises(SystemExit):
        main(["eval", "embodied/ppo_cartpole", f"checkpoint={tmp_path / 'x.safetensors'}"])
    assert "incomplete or corrupt checkpoint" in capsys.readouterr().err
