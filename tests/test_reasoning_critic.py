"""PPO with a critic for LMs: the value model's alignment, the critic's trainer, GAE and
whitening over the step, config checks, and a short PPO run of the tiny preset that raises
the reward and resumes the critic from a checkpoint."""

import math

import pytest
import torch

from m2flow.algorithms import kl_penalty, kl_shaped_rewards, masked_whiten, token_gae, value_loss_tokens
from m2flow.config import load_config
from m2flow.engines.critic import CriticTrainer, ValueModel
from m2flow.engines.batch import SequenceBatch, concat_batches
from m2flow.models.lm import tiny_lm
from m2flow.config.validate import validate as check_config
from m2flow.runners.reasoning import ReasoningRunner
from m2flow.workers.lm_critic import add_gae, whiten_advantages

PRESET = "reasoning/ppo_arith_tiny"


def _batch(prompts, completions):
    return SequenceBatch.from_completions(prompts, completions, pad_id=0)


def test_value_at_t_is_read_before_token_t():
    lm, _ = tiny_lm("tiny-llama")
    critic = ValueModel(lm)
    torch.nn.init.normal_(critic.head.weight)  # a zero head would make every value 0
    batch = _batch([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]])  # row 1 padded by 1
    with torch.no_grad():
        values = critic(batch.input_ids, batch.attention_mask)
        hidden = lm.base_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        expected = critic.head(hidden).squeeze(-1)
    # values[:, t] comes from the hidden state at t - 1, whose logits predict token t.
    torch.testing.assert_close(values[0, 1:5], expected[0, 0:4])
    torch.testing.assert_close(values[1, 1:4], expected[1, 0:3])
    assert values[:, 0].eq(0).all() and values[1, 4] == 0  # position 0 and padding
    # Changing token 3 leaves the values up to position 3 as they were and changes position 4's.
    changed = batch.input_ids.clone()
    changed[0, 3] = 42
    with torch.no_grad():
        after = critic(changed, batch.attention_mask)
    torch.testing.assert_close(after[0, :4], values[0, :4])
    assert not torch.allclose(after[0, 4], values[0, 4])
    # The trainer's micro-batched, no-grad values are the same numbers.
    trainer = CriticTrainer(critic, 1e-3, max_tokens_per_micro_batch=4)
    torch.testing.assert_close(trainer.values(batch), values)


def test_critic_trainer_fits_returns():
    lm, _ = tiny_lm("tiny-qwen2")
    trainer = CriticTrainer(ValueModel(lm), 1e-2, max_tokens_per_micro_batch=16)
    batch = _batch([[3, 4], [5, 6, 7], [8]], [[9, 10, 11], [12], [13, 14]])
    batch.values = trainer.values(batch)
    batch.returns = batch.completion_mask * torch.tensor([[1.0], [-0.5], [0.25]])

    def loss_fn(values, _entropy, mb, scale):
        return value_loss_tokens(values, mb.values, mb.returns, mb.completion_mask, None, total_tokens=scale.tokens)

    first = trainer.train_step(batch, loss_fn, with_entropy=False)["loss"]
    for _ in range(30):
        last = trainer.train_step(batch, loss_fn, with_entropy=False)["loss"]
    assert first == pytest.approx(float((batch.returns[batch.completion_mask.bool()] ** 2).mean()))  # V = 0 at first
    assert last < 0.05 * first


def test_gae_whitened_over_the_step_not_per_batch():
    algo = {"kl_coef": 0.1, "kl_in_reward": True, "kl_kind": "k1", "gae_gamma": 1.0, "gae_lambda": 0.9}
    parts = [_batch([[1, 2]], [[3, 4, 5]]), _batch([[1], [2, 3]], [[6], [7, 8]])]
    for i, b in enumerate(parts):
        b.extras["reward"] = torch.arange(len(b), dtype=torch.float32) + i
        b.old_logprobs = -0.5 * b.completion_mask
        b.ref_logprobs = -0.25 * b.completion_mask
        add_gae(b, 0.1 * b.completion_mask.float().cumsum(1), algo)
    whole = concat_batches(parts, pad_id=0)
    whiten_advantages(parts)
    mask = whole.completion_mask
    rewards = kl_shaped_rewards(whole.extras["reward"], mask, kl_penalty(whole.old_logprobs, whole.ref_logprobs, "k1"),
                                0.1)
    advantages, returns = token_gae(rewards, whole.values, mask, 1.0, 0.9)
    joined = concat_batches(parts, pad_id=0)
    torch.testing.assert_close(joined.advantages, masked_whiten(advantages, mask))
    torch.testing.assert_close(joined.returns, returns)  # targets: raw advantages + values


def test_gae_whitened_over_the_step_by_hand():
    """No KL, gamma = lambda = 1, values 0: each token's advantage is its completion's reward,
    0, 0 in one batch and 2, 2 in the other. Over the step (mean 1, unbiased variance 4/3) they
    whiten to -sqrt(3)/2 and +sqrt(3)/2, where each batch alone would whiten to 0."""
    algo = {"kl_coef": 0.0, "kl_in_reward": True, "kl_kind": "k1", "gae_gamma": 1.0, "gae_lambda": 1.0}
    parts = [_batch([[1, 2]], [[3, 4]]), _batch([[1]], [[6, 7]])]
    for b, reward in zip(parts, (0.0, 2.0)):
        b.extras["reward"] = torch.tensor([reward])
        add_gae(b, torch.zeros(b.completion_mask.shape), algo)
    whiten_advantages(parts)
    half_root3 = 3 ** 0.5 / 2
    for b, sign, reward in zip(parts, (-1.0, 1.0), (0.0, 2.0)):
        m = b.completion_mask.bool()
        torch.testing.assert_close(b.advantages[m], torch.full((2,), sign * half_root3))
        torch.testing.assert_close(b.returns[m], torch.full((2,), reward))  # raw advantages + values 0


def test_ppo_configs_and_placement():
    cfg = load_config(PRESET)
    check_config(cfg)  # rollout.n = 1: no groups needed
    cases = [
        ("algorithm.gae_lambda=1.5", "algorithm.gae_lambda: must be in \\[0, 1\\], got 1.5"),
        ("algorithm.critic_lr=0", "algorithm.critic_lr: must be > 0, got 0"),
        ("algorithm.value_clip=0", "algorithm.value_clip: must be > 0 or null, got 0"),
        ("algorithm.critic_epochs=0", "algorithm.critic_epochs: must be >= 1, got 0"),
        ("algorithm.dynamic_sampling=true", "with rollout.n=1 that is every group"),
    ]
    for override, message in cases:
        with pytest.raises(ValueError, match=message):
            load_config(PRESET, [override])
    cfg.algorithm.critic_epochs = 0
    with pytest.raises(ValueError, match="algorithm.critic_epochs: must be >= 1, got 0"):
        check_config(cfg)
    overrides = ["placement.mode=custom", *(f"placement.components.{c}=0-0" for c in
                                            ("rollout", "reward", "inference", "actor"))]
    with pytest.raises(ValueError, match="placement.components.critic: placement.mode=custom needs .* missing: critic"):
        load_config(PRESET, overrides)


def test_ppo_raises_the_reward_and_resumes_the_critic(cluster, pool, tmp_path):
    """25 steps at the preset's learning rate (the critic's value loss reported, the reward
    rising from about 0.05: seed 0's last 5 steps average 0.27), then step 25 again from the
    checkpoint of step 24: the same actor and critic weights."""
    cfg = load_config(PRESET, [f"runner.out_dir={tmp_path}", "runner.progress=false", "runner.steps=25",
                               "runner.checkpoint_every=24"])
    runner = ReasoningRunner(cfg, cluster=cluster, pool=pool)
    try:
        history = runner.train()
        straight = [runner.groups["actor"].weights_hash().wait()[0], runner.groups["critic"].weights_hash().wait()[0]]
        runner.cfg.runner.resume = str(tmp_path / "checkpoints" / "step_000024.safetensors")
        runner.train()
        resumed = [runner.groups["actor"].weights_hash().wait()[0], runner.groups["critic"].weights_hash().wait()[0]]
    finally:
        runner.close()
    steps = [row for row in history if row["step"] > 0]
    assert len(steps) == 25 and all(math.isfinite(row["value_loss"]) for row in steps)
    # The critic's time is measured, within the step it trained in.
    assert all(0 < row["critic_busy_s"] and row["critic_busy_s"] + row["critic_idle_s"] <= row["step_s"] for row in steps)
    rewards = [row["reward"] for row in steps]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.15, [round(r, 3) for r in rewards]
    assert history[-1]["eval_reward"] > history[0]["eval_reward"] + 0.5
    assert resumed == straight
