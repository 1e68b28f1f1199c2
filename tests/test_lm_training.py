"""LM training/scoring backend: SequenceBatch, token-budget micro-batching, log-probs against
plain unpadded forwards, gradient accumulation, learning, data parallel (2 gloo processes),
offload and checkpoint round trips, weight hashing, and bad input."""

import io
import math
import random
import socket
import time
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from m2flow.engines import scoring
from m2flow.engines.batch import PromptLayout, SequenceBatch, concat_batches, split_by_token_budget
from m2flow.engines.scoring import compute_logprobs, token_logprobs
from m2flow.engines.trainer import LMTrainer, LossScale
from m2flow.engines.weights import named_weights, weights_hash
from m2flow.models.lm import TINY_CONFIGS, load_lm

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def random_batch(rows: int, seed: int = 0) -> SequenceBatch:
    """Prompts of 2-7 tokens and completions of 1-9 tokens: rows of many different lengths."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 259) for _ in range(rng.randint(2, 7))] for _ in range(rows)]
    completions = [[rng.randrange(3, 259) for _ in range(rng.randint(1, 9))] for _ in range(rows)]
    return SequenceBatch.from_completions(prompts, completions, pad_id=0)


def token_mean_nll(logprobs, entropy, mb, scale):
    """Mean negative log-likelihood over the mini-batch's completion tokens."""
    loss = scale.token_mean(-logprobs, mb.completion_mask)
    return loss, {"nll": (-logprobs * mb.completion_mask).sum() / mb.completion_mask.sum().clamp(min=1)}


def snapshot(model) -> dict[str, torch.Tensor]:
    return {name: t.detach().cpu().clone() for name, t in named_weights(model)}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def reference_logprobs(model, ids: torch.Tensor, temperature: float = 1.0):
    """log p(ids[t] | ids[:t]) and the entropy of that distribution, t >= 1, one unpadded row."""
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0, :-1].double() / temperature
    logp = logits.log_softmax(-1)
    return logp.gather(-1, ids[1:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def test_sequence_batch_layout_and_select():
    b = SequenceBatch.from_completions([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]], pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 9, 10], [8, 11, 12, 13, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert b.completion_mask.tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 1, 0]]
    assert len(b) == 2 and b.lengths.tolist() == [5, 4]
    b.advantages = torch.arange(10.0).reshape(2, 5)
    b.extras = {"reward": torch.tensor([1.0, 2.0]), "answers": ["a", "b"], "tag": "run-1"}
    s = b.select([1])
    assert s.input_ids.tolist() == [[8, 11, 12, 13, 0]] and s.advantages.tolist() == [[5, 6, 7, 8, 9]]
    assert s.extras["reward"].tolist() == [2.0] and s.extras["answers"] == ["b"] and s.extras["tag"] == "run-1"
    assert s.old_logprobs is None
    t = s.truncate(4)
    assert t.input_ids.shape == (1, 4) and t.advantages.shape == (1, 4)
    assert b.to("cpu").input_ids.equal(b.input_ids)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_compute_logprobs_matches_unpadded_forward(name, device):
    model, _ = load_lm(name)
    model.to(device)
    batch = random_batch(6, seed=1)
    assert len(set(batch.lengths.tolist())) > 2  # really ragged
    for temperature in (1.0, 0.7):
        # Every token scored (share_prompts off); the shared-prompt path scores completions only.
        whole, ent = compute_logprobs(model, batch, max_tokens=10_000, temperature=temperature, with_entropy=True,
                                      share_prompts=False)
        assert whole.dtype == torch.float32 and whole.device.type == "cpu" and not model.training
        # A budget of 16 tokens forces several micro-batches of 1-2 rows.
        assert len(split_by_token_budget(batch, 16)) >= 4
        small = compute_logprobs(model, batch, max_tokens=16, temperature=temperature, share_prompts=False)
        assert (small - whole).abs().max().item() <= 1e-6
        for i in range(len(batch)):
            n = int(batch.lengths[i])
            ref_lp, ref_ent = reference_logprobs(model, batch.input_ids[i, :n].to(device), temperature)
            assert (whole[i, 1:n].double() - ref_lp.cpu()).abs().max().item() <= 1e-5
            assert (ent[i, 1:n].double() - ref_ent.cpu()).abs().max().item() <= 1e-5
            assert whole[i, 0] == 0 and (whole[i, n:] == 0).all() and (ent[i, n:] == 0).all()
        shared, shared_ent = compute_logprobs(model, batch, max_tokens=16, temperature=temperature,
                                              with_entropy=True)
        mask = batch.completion_mask.bool()
        assert (shared - whole)[mask].abs().max().item() <= 1e-5
        assert (shared_ent - ent)[mask].abs().max().item() <= 1e-5
        assert (shared[~mask] == 0).all() and (shared_ent[~mask] == 0).all()


def test_compute_logprobs_bf16_autocast_returns_fp32():
    model, _ = load_lm("tiny-llama")
    batch = random_batch(4, seed=2)
    fp32 = compute_logprobs(model, batch, max_tokens=64)
    bf16 = compute_logprobs(model, batch, max_tokens=64, autocast_dtype=torch.bfloat16)
    assert bf16.dtype == torch.float32
    mask = batch.completion_mask.bool()
    assert 0 < (bf16 - fp32)[mask].abs().max().item() < 0.1  # bf16 rounding, not a different function


class Bigram(torch.nn.Module):
    """A causal LM whose logits at a position are ``table[token at that position]``: log-probs
    and entropies can be worked out by hand."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = torch.nn.Parameter(table)

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        return types.SimpleNamespace(logits=self.table[input_ids])


def test_compute_logprobs_and_entropy_by_hand():
    # After token 0 the logits are [0, ln 3]: probabilities 1/4, 3/4; at T = 2, [0, ln 3 / 2]:
    # 1 / (1 + sqrt 3), sqrt 3 / (1 + sqrt 3). After token 1 they are uniform at any T.
    model = Bigram(torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]]))
    batch = SequenceBatch.from_completions([[0], [1]], [[1, 0], [0, 0, 1]], pad_id=0)  # row 0 padded
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    r3 = math.sqrt(3.0)
    ln2 = math.log(2.0)
    for max_tokens in (100, 4):  # one micro-batch, then one per row
        logprobs, entropy = compute_logprobs(model, batch, max_tokens=max_tokens, with_entropy=True,
                                             share_prompts=False)
        torch.testing.assert_close(logprobs, torch.tensor([[0.0, math.log(0.75), -ln2, 0.0],
                                                           [0.0, -ln2, math.log(0.25), math.log(0.75)]]))
        torch.testing.assert_close(entropy, torch.tensor([[0.0, h, ln2, 0.0], [0.0, ln2, h, h]]))
    at_t2 = compute_logprobs(model, batch, max_tokens=100, temperature=2.0, share_prompts=False)
    torch.testing.assert_close(at_t2, torch.tensor([[0.0, math.log(r3 / (1 + r3)), -ln2, 0.0],
                                                    [0.0, -ln2, math.log(1 / (1 + r3)), math.log(r3 / (1 + r3))]]))


def test_training_logprobs_of_bf16_logits_are_fp32_log_softmax_with_gradients(monkeypatch):
    """The training forward (chunked and checkpointed) against ``torch.log_softmax`` of the
    upcast logits: the same log-probs and entropies in fp32, and the same gradients."""
    monkeypatch.setattr(scoring, "LOGIT_CHUNK_TOKENS", 6)  # two rows of 3 positions per chunk: 2 chunks
    torch.manual_seed(0)
    model = Bigram(torch.randn(11, 11).to(torch.bfloat16))
    ids = torch.randint(0, 11, (2, 7))
    ones = torch.ones_like(ids)
    batch = SequenceBatch(ids, ones, torch.cat([torch.zeros_like(ids[:, :1]), ones[:, 1:]], dim=1))
    logprobs, entropy = token_logprobs(model, batch, 0.7, True)
    assert logprobs.dtype == entropy.dtype == torch.float32
    (logprobs.sum() + entropy.sum()).backward()
    grad, model.table.grad = model.table.grad, None
    assert grad.dtype == torch.bfloat16

    reference = torch.log_softmax(model.table[ids[:, :-1]].float() / 0.7, dim=-1)
    ref_logprobs = reference.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ref_entropy = -(reference.exp() * reference).sum(-1)
    torch.testing.assert_close(logprobs[:, 1:], ref_logprobs)
    torch.testing.assert_close(entropy[:, 1:], ref_entropy)
    assert (logprobs[:, 0] == 0).all() and (entropy[:, 0] == 0).all()
    # The gradient in fp64, against bf16 accumulation (per chunk, per term): to bf16's precision.
    table = model.table.detach().double().requires_grad_()
    exact = torch.log_softmax(table[ids[:, :-1]] / 0.7, dim=-1)
    (exact.gather(-1, ids[:, 1:, None]).sum() - (exact.exp() * exact).sum()).backward()
    scale = float(table.grad.abs().max())
    torch.testing.assert_close(grad.double(), table.grad, rtol=2**-7, atol=2**-7 * scale)


def test_split_by_token_budget_respects_budget_and_covers_rows():
    batch = random_batch(40, seed=3)
    lengths = batch.lengths
    for budget in (1, 7, 16, 33, 100, 10_000):
        groups = split_by_token_budget(batch, budget)
        flat = torch.cat(groups).tolist()
        assert sorted(flat) == list(range(len(batch)))  # every row exactly once
        for g in groups:
            padded = len(g) * int(lengths[g].max())
            assert padded <= budget or len(g) == 1  # a lone row may exceed the budget
        # Longest rows first: the micro-batches' longest rows never grow.
        longest = [int(lengths[g].max()) for g in groups]
        assert longest == sorted(longest, reverse=True)
    assert len(split_by_token_budget(batch, 10_000)) == 1
    assert all(len(g) == 1 for g in split_by_token_budget(batch, 1))


def grouped_batch(prompts: int, n: int, seed: int = 0) -> SequenceBatch:
    """``prompts`` prompts of 1-7 tokens with ``n`` completions of 0-9 tokens each (GRPO groups)."""
    rng = random.Random(seed)
    rows, completions = [], []
    for _ in range(prompts):
        prompt = [rng.randrange(3, 259) for _ in range(rng.randint(1, 7))]
        for _ in range(n):
            rows.append(prompt)
            completions.append([rng.randrange(3, 259) for _ in range(rng.randint(0, 9))])
    return SequenceBatch.from_completions(rows, completions, pad_id=0)


def test_prompt_layout_finds_shared_prompts_and_refuses_other_layouts():
    batch = SequenceBatch.from_completions([[5, 6], [5, 6], [7], [5, 6]], [[1], [2, 3], [], [4]], pad_id=0)
    layout = PromptLayout.of(batch)
    assert layout.prompt_lengths.tolist() == [2, 2, 1, 2] and layout.completion_lengths.tolist() == [1, 2, 0, 1]
    assert layout.prompts.tolist() == [0, 0, 1, 0]
    # A prompt's rows come together, longest first, when the budget allows.
    assert [g.tolist() for g in split_by_token_budget(batch, 100, layout.prompts)] == [[1, 0, 3, 2]]
    assert [g.tolist() for g in split_by_token_budget(batch, 8, layout.prompts)] == [[1, 0], [3, 2]]
    left_padded = SequenceBatch(torch.tensor([[0, 5, 6]]), torch.tensor([[0, 1, 1]]), torch.tensor([[0, 0, 1]]))
    assert PromptLayout.of(left_padded) is None
    interleaved = SequenceBatch(torch.tensor([[5, 6, 7]]), torch.tensor([[1, 1, 1]]), torch.tensor([[0, 1, 0]]))
    assert PromptLayout.of(interleaved) is None


def test_a_prompts_rows_join_a_micro_batch_all_together():
    """Sharing prompts, a micro-batch takes a prompt's rows all or none: a prompt is forwarded
    in one micro-batch unless its rows alone exceed the budget (then in parts, by the budget)."""
    cut = 0
    for seed in range(6):
        batch = grouped_batch(prompts=7, n=5, seed=seed)
        lengths, prompts = batch.lengths, PromptLayout.of(batch).prompts
        for budget in (12, 30, 45, 64, 90, 200):
            groups = split_by_token_budget(batch, budget, prompts)
            assert sorted(torch.cat(groups).tolist()) == list(range(len(batch)))
            for g in groups:
                assert len(g) * int(lengths[g].max()) <= budget or len(g) == 1
            where: dict[int, set[int]] = {}
            for k, g in enumerate(groups):
                for p in prompts[g].tolist():
                    where.setdefault(p, set()).add(k)
            for p, ks in where.items():
                rows = prompts == p
                if len(ks) > 1:  # only a prompt whose rows alone do not fit is cut
                    assert int(rows.sum()) * int(lengths[rows].max()) > budget, (seed, budget, p)
                    cut += 1
    assert cut  # some prompts were over the budget and were cut


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_shared_prompts_give_the_same_logprobs_and_gradients(name):
    """Groups of rows with one prompt: each prompt forwarded once, the same log-probs, entropies
    and gradients (the prompt's gradient summed over its rows) as full forwards of every row."""
    model, _ = load_lm(name)
    batch = grouped_batch(prompts=3, n=4, seed=5)
    mask = batch.completion_mask.bool()
    layout = PromptLayout.of(batch)
    assert layout is not None and len(set(layout.prompts.tolist())) == 3
    grads = []
    for shared in (None, layout):
        model.zero_grad()
        logprobs, entropy = token_logprobs(model, batch, 0.7, True, shared)
        (logprobs[mask].sum() + 0.1 * entropy[mask].sum()).backward()  # the full path also scores prompts
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        if shared is None:
            full = logprobs.detach(), entropy.detach()
    assert (logprobs - full[0])[mask].abs().max().item() <= 1e-5
    assert (entropy - full[1])[mask].abs().max().item() <= 1e-5
    assert (logprobs[~mask] == 0).all()
    assert max((grads[0][k] - grads[1][k]).abs().max().item() for k in grads[0]) <= 1e-4


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_accumulation_matches_one_micro_batch(device):
    batch = random_batch(10, seed=4)
    results = {}
    for budget in (10_000, 20):
        model, _ = load_lm("tiny-qwen2")
        # eps=1e-5 (as the embodied actor uses): with Adam's default 1e-8, a gradient of
        # ~1e-9 (attention to a near-uniform context) is rescaled to a step of ~lr/10, so
        # its float rounding in a different summation order would move weights by ~1e-5.
        trainer = LMTrainer(model, lr=1e-3, eps=1e-5, weight_decay=0.01, max_tokens_per_micro_batch=budget,
                            device=device)

        def loss_fn(logprobs, entropy, mb, scale):
            # The callback sees its own rows only, trimmed to their longest row.
            assert mb.input_ids.shape[1] == int(mb.lengths.max())
            assert len(mb) == 1 or mb.input_ids.numel() <= budget
            assert logprobs.shape == entropy.shape == mb.input_ids.shape and logprobs.requires_grad
            return token_mean_nll(logprobs, entropy, mb, scale)

        stats = trainer.train_step(batch, loss_fn, mini_batches=2, epochs=2)
        results[budget] = (snapshot(model), stats)
    (big_w, big), (small_w, small) = results[10_000], results[20]
    assert big["micro_batches"] == 4 and small["micro_batches"] > 12
    assert big["optimizer_steps"] == small["optimizer_steps"] == 4
    assert big["completion_tokens"] == small["completion_tokens"] == 2 * int(batch.completion_mask.sum())
    assert abs(big["loss"] - small["loss"]) < 1e-5 and abs(big["nll"] - small["nll"]) < 1e-5
    assert abs(big["grad_norm"] - small["grad_norm"]) < 1e-5
    assert max_diff(big_w, small_w) <= 1e-6
    assert max_diff(big_w, snapshot(load_lm("tiny-qwen2")[0])) > 1e-3  # the weights did move


def test_logit_chunking_changes_nothing(monkeypatch):
    """Log-softmax and entropy run over chunks of tokens (checkpointed in training): tiny
    chunks give the same log-probs, entropies and updated weights as one chunk."""
    batch = random_batch(6, seed=10)
    results = []
    for chunk_tokens in (4096, 5):
        monkeypatch.setattr(scoring, "LOGIT_CHUNK_TOKENS", chunk_tokens)
        model, _ = load_lm("tiny-llama")
        scored = compute_logprobs(model, batch, max_tokens=200, with_entropy=True)
        trainer = LMTrainer(model, lr=1e-3, eps=1e-5, max_tokens_per_micro_batch=200)
        stats = trainer.train_step(batch, lambda lp, ent, mb, scale: (
            scale.token_mean(-lp - 0.1 * ent, mb.completion_mask), {}))
        results.append((scored, stats["grad_norm"], snapshot(model)))
    (lp_a, ent_a), norm_a, w_a = results[0]
    (lp_b, ent_b), norm_b, w_b = results[1]
    assert (lp_a - lp_b).abs().max() <= 1e-6 and (ent_a - ent_b).abs().max() <= 1e-6
    assert abs(norm_a - norm_b) <= 1e-6 * norm_a and max_diff(w_a, w_b) <= 1e-6


def test_training_raises_completion_logprob():
    model, tok = load_lm("tiny-llama")
    prompt = tok("What is 2+3? ", add_special_tokens=False)["input_ids"]
    batch = SequenceBatch.from_completions([prompt], [tok("5", add_special_tokens=False)["input_ids"]
                                                      + [tok.eos_token_id]], pad_id=tok.pad_token_id)

    def completion_logprob():
        return (compute_logprobs(model, batch, max_tokens=64) * batch.completion_mask).sum().item()

    trainer = LMTrainer(model, lr=1e-2, max_tokens_per_micro_batch=64)
    before = completion_logprob()
    history = [trainer.train_step(batch, token_mean_nll)["nll"] for _ in range(15)]
    after = completion_logprob()
    assert before < -10 and after > before + 8, (before, after)  # near-uniform start (2 x log 259), then learnt
    assert history[-1] < history[0] / 3
    assert trainer.step == 15


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_autocast_training(device):
    model, _ = load_lm("tiny-qwen2")
    batch = random_batch(4, seed=8)
    trainer = LMTrainer(model, lr=1e-2, max_tokens_per_micro_batch=32, autocast_dtype=torch.bfloat16, device=device)
    dtypes = set()

    def loss_fn(logprobs, entropy, mb, scale):
        dtypes.update({logprobs.dtype, entropy.dtype})
        return token_mean_nll(logprobs, entropy, mb, scale)

    history = [trainer.train_step(batch, loss_fn) for _ in range(4)]
    start = time.perf_counter()
    history.append(trainer.train_step(batch, loss_fn))
    elapsed = time.perf_counter() - start
    assert dtypes == {torch.float32}
    assert history[-1]["nll"] < history[0]["nll"] - 0.5
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    # The peak (CUDA allocated, or the process's RSS) holds at least the weights and their
    # Adam moments, in MiB; the step's time lies within the call.
    state_mb = 3 * sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    assert state_mb < history[-1]["peak_memory_mb"], (state_mb, history[-1]["peak_memory_mb"])
    assert 0 < history[-1]["time_s"] <= elapsed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def copy_of(state: dict) -> dict:
    """A trainer's state as a file holds it: none of its tensors the live ones."""
    saved = io.BytesIO()
    torch.save(state, saved)
    return torch.load(io.BytesIO(saved.getvalue()), weights_only=False)


def _dp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Both forms, replicated then sharded, in one pair of processes (starting a pair takes
    seconds on 2 cores): each writes ``rank{rank}-{form}.pt``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for shard in (False, True):
            _dp_train(rank, out_dir, shard)
    finally:
        dist.destroy_process_group()


def _dp_train(rank: int, out_dir: str, shard: bool) -> None:
    batch = random_batch(8, seed=5)
    results = {}

    def trainer() -> LMTrainer:
        return LMTrainer(load_lm("tiny-llama")[0], lr=1e-3, eps=1e-5, max_tokens_per_micro_batch=16, shard=shard)

    def weights(t: LMTrainer) -> dict[str, torch.Tensor]:
        return {name: w.detach().cpu().clone() for name, w in t.named_weights()}

    # Even shares: 4 rows each, 2 mini-batches x 2 epochs; the rows' lengths differ, so
    # the ranks run different numbers of micro-batches.
    even = trainer()
    assert even.sharded == shard
    stats = even.train_step(batch.select(range(4 * rank, 4 * rank + 4)), token_mean_nll, mini_batches=2, epochs=2)
    results["even"] = (weights(even), even.weights_hash(), stats)
    # Uneven shares: rank 0 holds 1 row, rank 1 three, in 2 mini-batches: rank 0's
    # second mini-batch is empty, yet it takes part in both steps.
    uneven = trainer()
    rows = [0] if rank == 0 else [1, 2, 3]
    stats = uneven.train_step(batch.select(rows), token_mean_nll, mini_batches=2)
    results["uneven"] = (weights(uneven), uneven.weights_hash(), stats)
    if shard:
        # The other form's state (a run resumed on another placement): rank 0's full state
        # goes to the test's single process; a replicated trainer's loads into a sharded one
        # and trains on as the replicated one does.
        results["full"] = even.state_dict()
        replicated = LMTrainer(load_lm("tiny-llama")[0], lr=1e-3, eps=1e-5, max_tokens_per_micro_batch=16)
        replicated.train_step(batch.select([0, 1, 2, 3]), token_mean_nll)
        converted = trainer()
        converted.load_state_dict(copy_of(replicated.state_dict()))  # not the live tensors
        for t in (replicated, converted):
            t.train_step(batch.select([rank, rank + 4]), token_mean_nll)
        results["converted"] = (weights(replicated), weights(converted), converted.step)
    # A saved state loaded into a fresh trainer continues the same (sharded: rank 0's, broadcast),
    # also one saved before any step (no optimizer state yet), and saving changes nothing.
    resumed, fresh, untouched = [], trainer(), trainer()
    untouched.train_step(batch.select([rank, rank + 4]), token_mean_nll)
    results["untouched"] = untouched.weights_hash()
    for original in (even, fresh):
        copy = trainer()
        copy.load_state_dict(copy_of(original.state_dict()))
        for t in (original, copy):
            t.train_step(batch.select([rank, rank + 4]), token_mean_nll)
        resumed.append((original.weights_hash(), copy.weights_hash()))
    results["resumed"] = resumed
    torch.save(results, f"{out_dir}/rank{rank}-{'fsdp' if shard else 'replicated'}.pt")


@pytest.fixture(scope="module")
def data_parallel(tmp_path_factory):
    """The two gloo ranks' results, replicated and sharded: ``{form: {rank: results}}``."""
    out = tmp_path_factory.mktemp("data-parallel")
    mp.spawn(_dp_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    return {form: {r: torch.load(out / f"rank{r}-{form}.pt") for r in (0, 1)} for form in ("replicated", "fsdp")}


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "fsdp"])
def test_data_parallel_matches_one_process(data_parallel, shard):
    """Two gloo ranks, each on its own rows, end with identical weights, equal to one process
    training on all rows, whether each rank holds all weights or a shard of them (FSDP). The
    callback normalises by the *global* completion-token count (LossScale.tokens) times
    world_size, because gradients are averaged over ranks."""
    ranks = data_parallel["fsdp" if shard else "replicated"]
    batch = random_batch(8, seed=5)

    # One process: the same global mini-batches (rank 0's k-th share + rank 1's k-th share).
    model, _ = load_lm("tiny-llama")
    trainer = LMTrainer(model, lr=1e-3, eps=1e-5, max_tokens_per_micro_batch=16)
    stats = trainer.train_step(batch.select([0, 1, 4, 5, 2, 3, 6, 7]), token_mean_nll, mini_batches=2, epochs=2)
    even = (snapshot(model), stats["grad_norm"], stats["loss"])
    model, _ = load_lm("tiny-llama")
    trainer = LMTrainer(model, lr=1e-3, eps=1e-5, max_tokens_per_micro_batch=16)
    first = trainer.train_step(batch.select([0, 1, 2]), token_mean_nll)  # global mini-batch 1
    second = trainer.train_step(batch.select([3]), token_mean_nll)  # global mini-batch 2 (rank 1's row 3 alone)
    uneven = (snapshot(model), (first["grad_norm"] + second["grad_norm"]) / 2, (first["loss"] + second["loss"]) / 2)

    for key, (weights, grad_norm, loss) in (("even", even), ("uneven", uneven)):
        (w0, h0, s0), (_, h1, s1) = ranks[0][key], ranks[1][key]
        assert h0 == h1  # bit-identical replicas
        assert s0["optimizer_steps"] == s1["optimizer_steps"] == (4 if key == "even" else 2)
        # Adam hides a constant gradient scale in the weights; the norm does not.
        assert abs(s0["grad_norm"] - grad_norm) < 1e-6 * grad_norm and s0["grad_norm"] == s1["grad_norm"]
        assert abs((s0["loss"] + s1["loss"]) / 2 - loss) < 1e-6, key  # ranks' losses average to the global one
        assert max_diff(w0, weights) <= 1e-6, key
    assert ranks[0]["even"][2]["micro_batches"] != ranks[1]["even"][2]["micro_batches"]
    assert ranks[0]["uneven"][2]["micro_batches"] == 1 and ranks[1]["uneven"][2]["micro_batches"] >= 2
    for (original, copy), (_, copy_1) in zip(ranks[0]["resumed"], ranks[1]["resumed"]):
        assert original == copy == copy_1
    assert ranks[0]["resumed"][1][0] == ranks[0]["untouched"]
    if not shard:
        return
    # The sharded trainer's full state loads into a replicated one: the same weights, and
    # Adam's moments by parameter name
    full = ranks[0]["full"]
    trainer = LMTrainer(load_lm("tiny-llama")[0], lr=1e-3, eps=1e-5, max_tokens_per_micro_batch=16)
    trainer.load_state_dict(full)
    assert max_diff(snapshot(trainer.model), ranks[0]["even"][0]) == 0 and trainer.step == 4
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    moments = {names[id(p)]: s["exp_avg"] for p, s in trainer.optimizer.state.items()}
    assert moments.keys() == full["optimizer"]["state"].keys()
    assert all(torch.equal(moments[n], full["optimizer"]["state"][n]["exp_avg"]) for n in moments)
    assert ranks[1]["full"]["model"] == {}  # rank 1 holds none of it
    # A replicated trainer's state loaded into the sharded one trains on alike
    for r in (0, 1):
        replicated, converted, step = ranks[r]["converted"]
        assert step == 2 and max_diff(replicated, converted) <= 1e-6


def test_an_actors_states_spread_over_another_number_of_ranks():
    """``LMActorWorker.reshard`` (a run resumed on another placement): every new rank takes
    the trainer state rank 0 saved wherever the ranks hold it otherwise (sharded, rank 0 holds
    it in full; replicated, every rank the same), its own generator state round the old
    ranks, and the states as they are where nothing changed."""
    from m2flow.workers.lm_actor import LMActorWorker

    full = {"model": {"w": torch.ones(2)}, "optimizer": {"state": {}}, "step": 3, "sharded": True}
    none = {"model": {}, "optimizer": {}, "step": 3, "sharded": True}
    sharded = [{"trainer": full, "version": 3, "shuffle": 0}, {"trainer": none, "version": 3, "shuffle": 1}]
    fsdp, replicate = ({"algorithm": {"data_parallel": kind}} for kind in ("fsdp", "replicate"))
    assert LMActorWorker.reshard(sharded, 2, fsdp) is sharded
    for ranks, cfg in ((3, fsdp), (1, fsdp), (2, replicate)):  # other ranks, or not sharded now
        spread = LMActorWorker.reshard(sharded, ranks, cfg)
        assert [s["trainer"] for s in spread] == [full] * ranks
        assert [s["shuffle"] for s in spread] == [0, 1, 0][:ranks]
    plain = {"model": {"w": torch.ones(2)}, "optimizer": {"state": {}}, "step": 3}
    replicated = [{"trainer": plain, "version": 3, "shuffle": s} for s in (0, 1)]
    assert LMActorWorker.reshard(replicated, 2, replicate) is replicated
    assert [s["trainer"] for s in LMActorWorker.reshard(replicated, 2, fsdp)] == [plain] * 2


@pytest.mark.parametrize("device", DEVICES)
def test_optimizer_offload_round_trip_keeps_training_identical(device):
    batch = random_batch(6, seed=6)
    plain_model, _ = load_lm("tiny-gemma")
    plain = LMTrainer(plain_model, lr=1e-3, max_tokens_per_micro_batch=40, device=device)
    switched_model, _ = load_lm("tiny-gemma")
    switched = LMTrainer(switched_model, lr=1e-3, max_tokens_per_micro_batch=40, device=device)
    for t in (plain, switched):
        t.train_step(batch, token_mean_nll)
    on_gpu = device != "cpu"
    assert switched.offload_optimizer() is on_gpu
    if on_gpu:
        assert all(v.device.type == "cpu" for s in switched.optimizer.state.values() for v in s.values())
        with pytest.raises(RuntimeError, match="offloaded"):
            switched.train_step(batch, token_mean_nll)
    assert switched.onload_optimizer() is on_gpu
    for t in (plain, switched):
        t.train_step(batch, token_mean_nll)
    assert plain.weights_hash() == switched.weights_hash()


def test_optimizer_state_made_at_once_trains_as_one_made_in_the_first_step(monkeypatch):
    batch = random_batch(6, seed=8)
    model, _ = load_lm("tiny-llama")
    model_hash = weights_hash(model)
    eager = LMTrainer(model, lr=1e-3, weight_decay=0.1, max_tokens_per_micro_batch=40)
    assert eager.weights_hash() == model_hash  # the step that made the state moved no weight
    states = [eager.optimizer.state[p] for p in eager.params]
    assert all(s["step"].item() == 0 and not s["exp_avg"].any() and not s["exp_avg_sq"].any() for s in states)
    monkeypatch.setattr(LMTrainer, "_make_optimizer_state", lambda self: None)
    lazy = LMTrainer(load_lm("tiny-llama")[0], lr=1e-3, weight_decay=0.1, max_tokens_per_micro_batch=40)
    assert not lazy.optimizer.state and lazy.weights_hash() == model_hash
    for _ in range(2):
        for t in (eager, lazy):
            t.train_step(batch, token_mean_nll)
    assert eager.weights_hash() == lazy.weights_hash() != model_hash
    assert all(s["step"].item() == 2 for s in states)


def test_state_dict_round_trip():
    batch = random_batch(6, seed=7)
    model, _ = load_lm("tiny-llama")
    trainer = LMTrainer(model, lr=1e-3, weight_decay=0.1, max_tokens_per_micro_batch=40)
    trainer.train_step(batch, token_mean_nll, mini_batches=2)
    buffer = io.BytesIO()
    torch.save(trainer.state_dict(), buffer)
    trainer.train_step(batch, token_mean_nll)

    other_model, _ = load_lm("tiny-llama", seed=9)  # different weights until the checkpoint is loaded
    resumed = LMTrainer(other_model, lr=1e-3, weight_decay=0.1, max_tokens_per_micro_batch=40)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer))
    assert resumed.step == 2
    resumed.train_step(batch, token_mean_nll)
    assert resumed.step == trainer.step == 3
    assert resumed.weights_hash() == trainer.weights_hash()


def test_named_weights_and_hash():
    a, _ = load_lm("tiny-qwen2")
    b, _ = load_lm("tiny-qwen2")
    names = [n for n, _ in named_weights(a)]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # tied: sent once
    assert len(names) == len(set(names))
    assert weights_hash(a) == weights_hash(b) == weights_hash(list(named_weights(b)))
    with torch.no_grad():
        b.model.norm.weight[0] += 1e-3
    assert weights_hash(a) != weights_hash(b)
    assert weights_hash(a) != weights_hash(load_lm("tiny-qwen2", dtype=torch.bfloat16)[0])


def test_bad_input_raises_value_error():
    model, _ = load_lm("tiny-llama")
    batch = random_batch(3)
    empty = SequenceBatch(torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 4, dtype=torch.long),
                          torch.zeros(0, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="max_tokens"):
        split_by_token_budget(batch, 0)
    with pytest.raises(ValueError, match="max_tokens"):
        compute_logprobs(model, batch, max_tokens=0)
    with pytest.raises(ValueError, match="empty batch"):
        compute_logprobs(model, empty, max_tokens=64)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        LMTrainer(model, lr=1e-3, max_tokens_per_micro_batch=0)
    trainer = LMTrainer(model, lr=1e-3, max_tokens_per_micro_batch=64)
    with pytest.raises(ValueError, match="empty batch"):
        trainer.train_step(empty, token_mean_nll)
    with pytest.raises(ValueError, match="fewer rows"):
        trainer.train_step(batch, token_mean_nll, mini_batches=4)
    with pytest.raises(ValueError, match="at least 1"):
        trainer.train_step(batch, token_mean_nll, epochs=0)
    assert trainer.step == 0
    with pytest.raises(ValueError, match="no sequences"):
        SequenceBatch.from_completions([], [], pad_id=0)
    with pytest.raises(ValueError, match="at least one token"):
        SequenceBatch.from_completions([[]], [[5]], pad_id=0)
    with pytest.raises(ValueError, match="shape"):
        SequenceBatch(batch.input_ids, batch.attention_mask, batch.completion_mask[:, :-1])


def test_loss_scale_shares_add_up():
    g = torch.Generator().manual_seed(0)
    values, mask = torch.randn(4, 6, generator=g), (torch.rand(4, 6, generator=g) > 0.4).long()
    full = LossScale(tokens=int(mask.sum()), sequences=4, world_size=2)
    # Two ranks holding two rows each: the mean over ranks of their summed shares is the mean.
    shares = [full.token_mean(values[r * 2:(r + 1) * 2], mask[r * 2:(r + 1) * 2]) for r in (0, 1)]
    assert torch.allclose(sum(shares) / 2, values[mask.bool()].mean(), atol=1e-6)
    per_seq = values.sum(1)
    assert torch.allclose((full.sequence_mean(per_seq[:2]) + full.sequence_mean(per_seq[2:])) / 2, per_seq.mean(),
                          atol=1e-6)


# -- streaming: accumulate parts, then one step ---------------------------------------


def test_accumulating_parts_then_finish_step_equals_one_train_step():
    """A mini-batch streamed in parts, each accumulated as a plain sum and divided by the
    token count at the end, takes the same step as train_step over the whole batch."""
    model, _ = load_lm("tiny-llama", seed=3)
    twin, _ = load_lm("tiny-llama", seed=3)
    batch = random_batch(6, seed=5)
    advantages = torch.linspace(-1.0, 1.0, len(batch))

    def loss_fn(logp, entropy, mb, scale):
        adv = mb.extras["adv"][:, None].expand_as(logp)
        return scale.token_mean(-adv * logp, mb.completion_mask), {}

    batch.extras["adv"] = advantages
    whole = LMTrainer(model, 1e-2, max_tokens_per_micro_batch=64, eps=1e-5)
    expected_norm = whole.train_step(batch, loss_fn)["grad_norm"]
    parts = [batch.select(torch.arange(0, 2)), batch.select(torch.arange(2, 6))]
    streamed = LMTrainer(twin, 1e-2, max_tokens_per_micro_batch=64, eps=1e-5)
    for part in parts:
        streamed.accumulate(part, loss_fn, LossScale(tokens=1, sequences=1))
    norm = streamed.finish_step(grad_scale=1.0 / int(batch.completion_mask.sum()))
    # Adam is blind to the gradient's scale: the norm checks it, the weights the direction
    # (the first Adam step turns round-off in tiny gradients into ~1e-6 differences).
    assert norm == pytest.approx(expected_norm, rel=1e-6)
    for (name, a), (_, b) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)
    joined = concat_batches(parts, pad_id=0)
    width = batch.input_ids.shape[1]
    assert torch.equal(joined.input_ids[:, :width], batch.input_ids) and torch.equal(joined.extras["adv"], advantages)


def test_inert_rows_are_not_forwarded_and_change_nothing():
    """Rows of zero advantage under a loss that is only the advantage-weighted term: skipped
    (``inert``), they still count in the token mean, and the update is the same."""
    batch = random_batch(8, seed=6)
    batch.extras["adv"] = torch.tensor([0.0, 1.0, 0.0, 0.0, -1.0, 0.5, 0.0, 0.0])
    inert = batch.extras["adv"] == 0
    forwarded = []

    def loss_fn(logp, entropy, mb, scale):
        forwarded.append(len(mb))
        adv = mb.extras["adv"][:, None].expand_as(logp)
        return scale.token_mean(-adv * logp, mb.completion_mask), {}

    results = {}
    for skip in (False, True):
        model, _ = load_lm("tiny-llama", seed=3)
        trainer = LMTrainer(model, 1e-2, max_tokens_per_micro_batch=10_000, eps=1e-5)
        forwarded.clear()
        stats = trainer.train_step(batch, loss_fn, mini_batches=2, epochs=2, generator=torch.Generator().manual_seed(0),
                                   inert=inert if skip else None)
        results[skip] = (snapshot(model), stats, sum(forwarded))
    (full_w, full, full_rows), (skip_w, skipped, skip_rows) = results[False], results[True]
    assert full_rows == 2 * len(batch) and skip_rows == 2 * int((~inert).sum())
    assert skipped["inert_rows"] == int(inert.sum()) and full["inert_rows"] == 0
    assert skipped["grad_norm"] == pytest.approx(full["grad_norm"], rel=1e-6)
    assert max_diff(full_w, skip_w) <= 1e-5  # rounding: the micro-batches are padded differently
    assert max_diff(full_w, snapshot(load_lm("tiny-llama", seed=3)[0])) > 1e-4  # the weights did move


def test_the_actors_loss_is_the_steps_whether_streamed_or_gathered():
    """The LM actor, made here without Ray on one rank, trains one GRPO step on two batches
    of a channel: streamed (forward and backward on each batch as it arrives) it reports the
    same loss as gathering them for one pass, the step's token-mean loss; and its
    ``ratio_max`` is the largest of the step's, not a mean of the batches'."""
    from omegaconf import OmegaConf

    from m2flow.config import load_config
    from m2flow.workers.lm_actor import LMActorWorker
    from m2flow.workers.lm_common import END

    cfg = OmegaConf.to_container(load_config("reasoning/grpo_arith_tiny", ["algorithm.max_tokens_per_micro_batch=64",
                                                                            "rollout.temperature=1.0"]), resolve=True)
    batch = random_batch(8, seed=5)
    g = torch.Generator().manual_seed(2)
    batch.old_logprobs = torch.where(batch.completion_mask.bool(), -torch.rand(batch.input_ids.shape, generator=g) * 3,
                                     0.0)
    batch.extras = {"reward": torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]), "group_size": 4, "version": 0,
                    "prompt_index": list(range(8))}

    class Items:  # a channel's get, for one step: the items, then the end
        def __init__(self, items):
            self.items = list(items)

        def get(self, key=None):
            return self.items.pop(0)

    def actor(streaming: bool):
        worker = LMActorWorker.__new__(LMActorWorker)
        worker.group, worker.rank, worker.world_size, worker.device = "actor", 0, 1, "cpu"
        LMActorWorker.__init__(worker, cfg)
        worker.streaming = streaming
        return worker.train(Items([batch.select(torch.arange(4)), batch.select(torch.arange(4, 8)), END]))

    streamed, gathered = actor(True), actor(False)
    assert streamed.optimizer_steps == gathered.optimizer_steps == 1
    assert streamed.stats["loss"] == pytest.approx(gathered.stats["loss"], rel=1e-5)
    assert streamed.stats["ratio_max"] == pytest.approx(gathered.stats["ratio_max"], rel=1e-5)
    assert streamed.stats["grad_norm"] == pytest.approx(gathered.stats["grad_norm"], rel=1e-4)


def test_a_max_statistic_is_the_largest_over_micro_batches():
    """The trainer's sums over micro-batches: a statistic is weighted by completion tokens,
    one named ``*_max`` is the largest (ratios of 5 and 1: 5, not their mean)."""
    from m2flow.engines.trainer import Accumulated

    acc = Accumulated()
    acc.add({"ratio_max": torch.tensor(5.0), "clip_fraction": 0.5}, 10, 12)
    acc.add({"ratio_max": 1.0, "clip_fraction": 0.0}, 30, 35)
    out = acc.result()
    assert out["ratio_max"] == 5.0 and out["clip_fraction"] == pytest.approx(0.125) and out["completion_tokens"] == 40
