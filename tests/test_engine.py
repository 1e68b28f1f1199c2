"""The LM rollout engine: log-probs exact against a plain forward (different prompt lengths,
slots refilled), greedy equal to model.generate(), top-k/top-p, stop strings and EOS,
streaming, seeding, weight sync, offload, bad input, and the benchmark script."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from m2flow.engines import SamplingParams, TorchEngine, build_engine
from m2flow.engines.decode_graphs import DecodeGraphs, buckets
from m2flow.engines.kv_slots import SlotKVCache
from m2flow.engines.sampling import sample_tokens
from m2flow.models.lm import load_lm

ROOT = Path(__file__).resolve().parents[1]


def lively_lm(name):
    """A tiny model re-initialised with larger weights: freshly initialised ones give nearly
    uniform logits whose greedy path repeats one token, which would make greedy tests weak."""
    model, tok = load_lm(name)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * (0.03 if "embed" in param_name else 0.3))
    return model, tok


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2", "tiny-gemma"])
def lm(request):
    return lively_lm(request.param)


def two_lms():
    """Two lively tiny-llama models of other weights (an update's before and after), and the tokenizer."""
    model, tok = lively_lm("tiny-llama")
    other, _ = lively_lm("tiny-llama")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in other.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * p.std())
    return model, other, tok


def make_prompts(lengths, seed=0, vocab=259):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]  # 0-2 are special tokens


def reference_logprobs(model, prompt, completion, temperature):
    """log_softmax(logits / T) at each completion token, from one unpadded forward of prompt + completion."""
    ids = torch.tensor([prompt + completion], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1), torch.tensor(completion, device=model.device)


def greedy_ids(engine, prompts, max_new_tokens):
    groups = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=max_new_tokens))
    return {g[0].prompt_index: g[0].token_ids for g in groups}


def test_logprobs_match_full_forward_with_refills(lm):
    model, tok = lm
    engine = TorchEngine(model, tok, max_batch_size=4)
    prompts = make_prompts([3, 17, 41, 9, 26])
    # Ten likely stop characters end sequences at different steps, so slots are refilled mid-batch.
    params = SamplingParams(n=3, temperature=0.8, top_k=40, top_p=0.9, max_new_tokens=24,
                            stop=tuple("abcdefghij"), seed=1)
    groups = list(engine.generate(prompts, params))
    assert engine.stats["refills"] > 0
    assert sorted(g[0].prompt_index for g in groups) == list(range(len(prompts)))
    completions = [c for g in groups for c in g]
    assert {c.finish_reason for c in completions} == {"stop", "length"}
    assert len({len(c.token_ids) for c in completions}) > 3
    for c in completions:
        assert c.logprobs.dtype == torch.float32 and c.logprobs.shape == (len(c.token_ids),)
        ref, tokens = reference_logprobs(model, prompts[c.prompt_index], c.token_ids, params.temperature)
        assert (ref.gather(1, tokens[:, None]).squeeze(1) - c.logprobs).abs().max().item() <= 1e-3
        # Every drawn token lies within the top-k of the exact distribution.
        assert (ref.topk(params.top_k, -1).indices == tokens[:, None]).any(-1).all()


def test_greedy_equals_model_generate(lm):
    model, tok = lm
    engine = TorchEngine(model, tok, max_batch_size=2)  # 4 prompts through 2 slots
    prompts = make_prompts([5, 30, 12, 2], seed=1)
    ours = greedy_ids(engine, prompts, 20)
    for i, prompt in enumerate(prompts):
        ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20)[0, len(prompt):].tolist()
        assert ours[i] == ref, f"prompt {i}"


def test_greedy_logprobs_are_temperature_one(lm):
    model, tok = lm
    prompt = make_prompts([10], seed=2)[0]
    [[c]] = TorchEngine(model, tok).generate([prompt], SamplingParams(temperature=0, max_new_tokens=8))
    ref, tokens = reference_logprobs(model, prompt, c.token_ids, 1.0)
    assert torch.allclose(ref.gather(1, tokens[:, None]).squeeze(1), c.logprobs, atol=1e-3)


def test_top_k_one_and_tiny_top_p_are_greedy():
    model, tok = lively_lm("tiny-llama")
    engine = TorchEngine(model, tok)
    prompts = make_prompts([4, 11, 7], seed=3)
    greedy = list(engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12)))
    for narrow in (SamplingParams(n=2, top_k=1, max_new_tokens=12, seed=5),
                   SamplingParams(n=2, top_p=1e-6, max_new_tokens=12, seed=5)):
        for group, ref in zip(engine.generate(prompts, narrow), greedy):
            for c in group:  # same tokens; log-probs of the full distribution at T=1, as greedy reports
                assert c.token_ids == ref[0].token_ids
                assert torch.allclose(c.logprobs, ref[0].logprobs, atol=1e-5)


def test_n_samples_groups_and_text():
    model, tok = load_lm("tiny-qwen2")
    engine = TorchEngine(model, tok, max_batch_size=5)
    prompts = make_prompts([6, 9, 3, 14], seed=4)
    groups = list(engine.generate(prompts, SamplingParams(n=3, max_new_tokens=10, seed=0)))
    assert sorted(g[0].prompt_index for g in groups) == [0, 1, 2, 3]
    for g in groups:
        assert [c.sample_index for c in g] == [0, 1, 2] and len({c.prompt_index for c in g}) == 1
        assert len({tuple(c.token_ids) for c in g}) == 3  # independent samples (random model, 259 tokens)
        for c in g:
            assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
            ended_by_eos = c.token_ids[-1] == tok.eos_token_id
            assert c.finish_reason == ("stop" if ended_by_eos else "length")
            assert (len(c.token_ids) <= 10) if ended_by_eos else (len(c.token_ids) == 10)
            assert tok.eos_token_id not in c.token_ids[:-1]


def test_seeded_sampling_is_reproducible():
    model, tok = load_lm("tiny-llama")
    engine = TorchEngine(model, tok, max_batch_size=3)
    prompts = make_prompts([5, 8], seed=5)
    run = lambda seed: [c.token_ids for g in engine.generate(prompts, SamplingParams(n=2, max_new_tokens=16,
                                                                                       seed=seed)) for c in g]
    assert run(7) == run(7)
    assert run(7) != run(8)


def test_eos_stop_string_and_streaming():
    model, tok = lively_lm("tiny-llama")
    prompts = make_prompts([5, 12, 8, 20], seed=6)
    ref = greedy_ids(TorchEngine(model, tok), prompts, 40)
    # Stop string: the first printable ASCII pair in prompt 0's greedy completion.
    chars = [tok.decode([t]) for t in ref[0]]
    j = next(j for j in range(39) if all(len(c) == 1 and c.isascii() and c.isprintable() for c in chars[j:j + 2]))
    stop = chars[j] + chars[j + 1]
    first = next(i for i in range(40) if stop in tok.decode(ref[0][:i + 1]))
    params = SamplingParams(temperature=0, max_new_tokens=40, stop=(stop,))
    [[c]] = TorchEngine(model, tok).generate(prompts[:1], params)
    assert c.token_ids == ref[0][:first + 1] and c.finish_reason == "stop" and c.text.endswith(stop)

    # EOS: declare prompt 0's third token an end-of-sequence token (one the others never emit).
    others = {t for i in (1, 2, 3) for t in ref[i]}
    k = next(k for k in range(2, 40) if ref[0][k] not in others)
    eos = ref[0][k]
    model.generation_config.eos_token_id = [tok.eos_token_id, eos]
    try:
        engine = TorchEngine(model, tok, max_batch_size=4)
    finally:
        model.generation_config.eos_token_id = tok.eos_token_id
    stream = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=40))
    group = next(stream)
    steps_at_first_group = engine.stats["decode_steps"]
    rest = list(stream)
    (c,) = group
    assert c.prompt_index == 0 and c.finish_reason == "stop" and c.token_ids == ref[0][:ref[0].index(eos) + 1]
    # Yielded while the other rows, all in the same batch, were still decoding.
    assert steps_at_first_group < 39 == engine.stats["decode_steps"]
    assert all(g[0].finish_reason == "length" and g[0].token_ids == ref[g[0].prompt_index] for g in rest)


def test_length_limits():
    model, tok = load_lm("tiny-gemma")
    engine = TorchEngine(model, tok)
    [[c]] = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=1, seed=0))
    assert len(c.token_ids) == 1 and c.finish_reason in ("length", "stop")
    max_positions = model.config.max_position_embeddings
    [[c]] = engine.generate(make_prompts([max_positions - 3]), SamplingParams(max_new_tokens=10, seed=0))
    assert len(c.token_ids) == 3 and c.finish_reason == "length"  # prompt + completion fill every position


def test_load_weights_then_generate_uses_them():
    model, tok = load_lm("tiny-llama")
    other, _ = lively_lm("tiny-llama")
    prompts = make_prompts([7, 15], seed=7)
    engine = TorchEngine(model, tok)
    before = greedy_ids(engine, prompts, 16)
    expected = greedy_ids(TorchEngine(other, tok), prompts, 16)
    assert before != expected
    engine.load_weights(other.state_dict().items())
    assert greedy_ids(engine, prompts, 16) == expected
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight  # tied weights stay tied
    with pytest.raises(ValueError, match="no weight named"):
        engine.load_weights([("model.nope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights([("model.norm.weight", torch.zeros(3))])


def test_a_bfloat16_rollout_samples_with_the_weights_rounded():
    """``rollout.dtype=bfloat16``: the rollout loads the run's initial weights rounded, takes
    the actor's float32 pushes rounded as they arrive, and records the log-probs of the
    rounded weights (which the loss's ratio then sees against the actor's)."""
    from m2flow.workers.lm_common import load_model

    cfg = {"model": {"path": "tiny-llama", "dtype": "float32"}, "seed": 3}
    full, tok = load_model(cfg, "cpu")
    half, _ = load_model(cfg, "cpu", "bfloat16")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert all(torch.equal(h, f.to(torch.bfloat16)) for h, f in zip(half.state_dict().values(),
                                                                      full.state_dict().values()))
    assert half.lm_head.weight is half.model.embed_tokens.weight  # tied weights stay tied
    pushed, _ = lively_lm("tiny-llama")  # float32: what the actor sends
    engine = TorchEngine(half, tok)
    engine.load_weights(pushed.state_dict().items(), version=1)
    assert all(torch.equal(engine.model.state_dict()[k], v.to(torch.bfloat16)) for k, v in pushed.state_dict().items())
    prompts = make_prompts([5, 12], seed=4)
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=12, seed=2)
    completions = [c for g in engine.generate(prompts, params) for c in g]
    gap_to_full = []
    for c in completions:
        assert set(c.versions) == {1}
        rounded, tokens = reference_logprobs(engine.model, prompts[c.prompt_index], c.token_ids, params.temperature)
        assert (rounded.gather(1, tokens[:, None]).squeeze(1) - c.logprobs).abs().max().item() <= 0.05
        exact, _ = reference_logprobs(pushed, prompts[c.prompt_index], c.token_ids, params.temperature)
        gap_to_full.append((exact.gather(1, tokens[:, None]).squeeze(1) - c.logprobs).abs().max().item())
    assert 0 < max(gap_to_full) < 0.5  # the rounding shows, a little


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "fixed-shapes"])
def test_weights_loaded_between_steps_continue_the_sequences_in_flight(cuda_graphs):
    """New weights mid-generation (an in-flight update): the sequences in flight keep their
    cached keys and values and go on with the new weights; each token records the version
    that sampled it; sequences admitted later are the new weights' own. With fixed-shape
    decode steps too (on a GPU their graphs read the weights where the load copies them)."""
    model, other, tok = two_lms()
    prompts = make_prompts([6, 11, 4, 9], seed=8)
    old = greedy_ids(TorchEngine(model, tok, max_batch_size=2), prompts, 12)
    new = greedy_ids(TorchEngine(other, tok, max_batch_size=2), prompts, 12)
    engine = TorchEngine(model, tok, max_batch_size=2, cuda_graphs=cuda_graphs)  # prompts 0, 1 first, then 2, 3
    calls = []

    def between():
        calls.append(1)
        if len(calls) == 4:  # after the first token and three decode steps
            engine.load_weights(other.state_dict().items(), version=1)

    got = {g[0].prompt_index: g[0] for g in engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12),
                                                           between=between)}
    for i in (0, 1):
        assert got[i].versions == [0] * 4 + [1] * 8
        assert got[i].token_ids[:4] == old[i][:4]
    assert any(got[i].token_ids != old[i] for i in (0, 1))  # the new weights took over mid-sequence
    for i in (2, 3):
        assert got[i].versions == [1] * 12 and got[i].token_ids == new[i] != old[i]


def test_a_sample_admitted_after_new_weights_records_its_first_token_as_the_prefills():
    """A prompt is prefilled once for all its samples: one that takes a slot only after new
    weights came in draws its first token from the prefill's logits, so that token records
    the prefill's version (and its log-prob is the old weights'), the rest the new one."""
    model, other, tok = two_lms()
    before, _ = lively_lm("tiny-llama")  # the engine's weights before the load (it loads into model)
    prompt = make_prompts([7], seed=9)
    engine = TorchEngine(model, tok, max_batch_size=2)  # samples 0, 1 first; 2, 3 once those end
    calls = []

    def between():
        calls.append(1)
        if len(calls) == 2:
            engine.load_weights(other.state_dict().items(), version=1)

    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=5, seed=3)
    (group,) = engine.generate(prompt, params, between=between)
    later = [c for c in group if c.sample_index >= 2]
    assert len(later) == 2 and all(len(c.versions) > 1 for c in later)
    for c in later:
        assert c.versions == [0] + [1] * (len(c.versions) - 1)
        old, tokens = reference_logprobs(before, prompt[0], c.token_ids[:1], params.temperature)
        new, _ = reference_logprobs(other, prompt[0], c.token_ids[:1], params.temperature)
        assert old.gather(1, tokens[:, None]).item() == pytest.approx(float(c.logprobs[0]), abs=1e-4)
        assert new.gather(1, tokens[:, None]).item() != pytest.approx(float(c.logprobs[0]), abs=1e-2)


@pytest.mark.parametrize("cuda_graphs, device", [
    (False, "cpu"), (True, "cpu"),
    pytest.param(True, "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
], ids=["eager", "fixed-shapes", "cuda-graphs"])
def test_more_prompts_join_a_call_in_progress(cuda_graphs, device):
    """``more`` (continuous generation across batches of prompts): prompts added while others
    are in flight join as slots free up, numbered on; a longer one grows the KV cache under
    the sequences in flight; a caller may stop iterating and resume later. Every completion
    equals the one a call of its own gives (greedy) and its log-probs a plain forward's. On a
    GPU the graphs captured over the cache before it grew are dropped and captured again."""
    model, tok = lively_lm("tiny-llama")
    model.to(device)
    first, second = make_prompts([5, 9, 7], seed=3), make_prompts([44, 3], seed=4)
    params = SamplingParams(temperature=0, max_new_tokens=14, stop=tuple("abcdefghij"))
    alone = {g[0].prompt_index: g[0].token_ids for g in TorchEngine(model, tok, max_batch_size=2).generate(
        first + second, params)}
    assert len({len(t) for t in alone.values()}) > 2  # the stop strings end sequences at other steps
    engine = TorchEngine(model, tok, max_batch_size=2, cuda_graphs=cuda_graphs)
    asked = []

    def more():
        asked.append(len(asked))
        return second if len(asked) == 1 else []

    session = engine.generate(first, params, more=more)
    got = {}
    while len(got) < len(first):  # the caller's own prompts out, then it stops iterating
        (c,) = next(session)
        got[c.prompt_index] = c
    assert asked and engine.cache.capacity >= 44 + 14  # the second batch joined: the cache grew under the first
    got |= {g[0].prompt_index: g[0] for g in session}  # resumed later: the rest
    assert sorted(got) == list(range(5))
    assert engine.stats["refills"] > 0
    for i, c in got.items():
        assert c.token_ids == alone[i], f"prompt {i}"
        ref, tokens = reference_logprobs(model, (first + second)[i], c.token_ids, 1.0)
        assert (ref.gather(1, tokens[:, None]).squeeze(1).cpu() - c.logprobs).abs().max().item() <= (
            1e-4 if device == "cpu" else 1e-3)
    assert not TorchEngine.__mro__[1].takes_more and engine.takes_more
    if device == "cuda":  # every decode step a replay; a capture before the cache grew and after
        assert engine.stats["graph_replays"] == engine.stats["decode_steps"] > 0
        assert engine.stats["graph_captures"] >= 2


def test_offload_onload_round_trip():
    model, tok = lively_lm("tiny-qwen2")
    engine = build_engine("torch", model, tok)
    prompts = make_prompts([9, 4], seed=8)
    before = greedy_ids(engine, prompts, 12)
    assert engine.cache is not None
    engine.offload()
    assert engine.cache is None
    with pytest.raises(RuntimeError, match="onload"):
        engine.generate(prompts, SamplingParams())
    engine.onload()
    assert greedy_ids(engine, prompts, 12) == before


def test_bad_input_is_a_clear_value_error():
    model, tok = load_lm("tiny-llama")
    engine = TorchEngine(model, tok)
    for kwargs, message in [({"n": 0}, "n must be"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                            ({"top_k": -1}, "top_k"), ({"max_new_tokens": 0}, "max_new_tokens"),
                            ({"stop": ("",)}, "stop")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[5], []], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[5, 259]], SamplingParams())
    with pytest.raises(ValueError, match="2048 positions"):
        engine.generate(make_prompts([2048]), SamplingParams())
    with pytest.raises(ValueError, match="max_batch_size"):
        TorchEngine(model, tok, max_batch_size=0)
    with pytest.raises(ValueError, match="unknown generation backend"):
        build_engine("jax", model, tok)
    assert list(engine.generate([], SamplingParams())) == []
    assert SamplingParams(stop="ab").stop == ("ab",)


def test_vllm_backend_missing_is_a_clear_import_error():
    pytest.importorskip("transformers")
    try:
        import vllm  # noqa: F401
        pytest.skip("vllm is installed")
    except ImportError:
        pass
    model, tok = load_lm("tiny-llama")
    with pytest.raises(ImportError, match="pip install vllm"):
        build_engine("vllm", model, tok)


def test_fixed_shape_decode_steps_are_exact(lm):
    """``cuda_graphs``: decode steps at fixed shapes (rows padded to a bucket, attention over
    the whole KV capacity), eager off a GPU: log-probs those of a plain forward through
    refills and every bucket size, greedy paths those of the variable-shape steps."""
    model, tok = lm
    prompts = make_prompts([3, 17, 41, 9, 26])
    engine = TorchEngine(model, tok, max_batch_size=5, cuda_graphs=True)  # buckets 1, 2, 4, 5
    params = SamplingParams(n=3, temperature=0.8, top_k=40, top_p=0.9, max_new_tokens=24,
                            stop=tuple("abcdefghij"), seed=1)
    completions = [c for g in engine.generate(prompts, params) for c in g]
    assert engine.stats["refills"] > 0 and engine.stats["graph_replays"] == 0  # no graphs on a CPU
    assert engine.graphs is not None and not engine.graphs.capture
    assert len({len(c.token_ids) for c in completions}) > 3  # rows end at different steps: buckets shrink
    for c in completions:
        ref, tokens = reference_logprobs(model, prompts[c.prompt_index], c.token_ids, params.temperature)
        assert (ref.gather(1, tokens[:, None]).squeeze(1) - c.logprobs).abs().max().item() <= 1e-4
    assert greedy_ids(engine, prompts, 20) == greedy_ids(TorchEngine(model, tok, max_batch_size=5), prompts, 20)


def test_fixed_shape_forward_reads_nothing_back(lm):
    """What capturing a CUDA graph needs, checked off a GPU: the fixed-shape decode forward
    traces as one graph (``torch.compile(fullgraph=True)``), so nothing in it reads a value
    back to the host or branches on one; and the traced forward computes the same logits."""
    model, tok = lm
    engine = TorchEngine(model, tok, max_batch_size=4, cuda_graphs=True)
    greedy_ids(engine, make_prompts([5, 9]), 4)  # makes the KV buffers and the decoder over them
    forward = engine.graphs._forward
    with torch.inference_mode():
        torch.testing.assert_close(torch.compile(forward, fullgraph=True, backend="eager", dynamic=False)(4),
                                   forward(4))
    with pytest.raises(Exception, match="(?i)data-dependent|graph break"):  # the check can fail: a read-back breaks it
        torch.compile(lambda: forward(4).sum().item() > 0 and forward(4), fullgraph=True, backend="eager")()


def test_decode_graph_buckets():
    assert buckets(1) == [1] and buckets(5) == [1, 2, 4, 5] and buckets(32) == [1, 2, 4, 8, 16, 32]
    model, tok = lively_lm("tiny-llama")
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphs(model, SlotKVCache(2, 8), capture=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_replay_the_eager_steps():
    """On a GPU the fixed-shape steps are captured once per bucket and replayed: the same
    greedy paths as the eager steps, log-probs of a plain forward, the graphs kept across
    calls, dropped at an offload and captured again after it, and weights loaded in flight
    (copied into the parameters the graphs read) taking over as in the eager steps."""
    model, other, tok = two_lms()
    model.to("cuda")
    prompts = make_prompts([4, 19, 11, 7, 30], seed=9)
    eager = TorchEngine(model, tok, max_batch_size=5)
    graphs = TorchEngine(model, tok, max_batch_size=5, cuda_graphs=True)
    expected = greedy_ids(eager, prompts, 16)
    assert greedy_ids(graphs, prompts, 16) == expected
    assert graphs.stats["graph_replays"] == graphs.stats["decode_steps"] > 0
    assert 1 <= graphs.stats["graph_captures"] <= 4
    assert greedy_ids(graphs, prompts, 16) == expected and graphs.stats["graph_captures"] == 0  # kept
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=16, stop=tuple("abcdefghij"), seed=0)
    for group in graphs.generate(prompts, params):
        for c in group:
            ref, tokens = reference_logprobs(model, prompts[c.prompt_index], c.token_ids, 1.0)
            assert (ref.gather(1, tokens[:, None]).squeeze(1).cpu() - c.logprobs).abs().max().item() <= 1e-3
    assert graphs.stats["refills"] > 0
    graphs.offload()
    assert graphs.graphs is None and graphs.cache is None
    graphs.onload()
    assert greedy_ids(graphs, prompts, 16) == expected and graphs.stats["graph_captures"] >= 1

    def in_flight(engine):
        calls = []

        def between():
            calls.append(1)
            if len(calls) == 4:
                engine.load_weights(other.to("cuda").state_dict().items(), version=1)
        done = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12), between=between)
        result = {g[0].prompt_index: (g[0].token_ids, g[0].versions) for g in done}
        engine.load_weights(original.items(), version=0)
        return result
    original = {k: v.clone() for k, v in model.state_dict().items()}
    assert in_flight(graphs) == in_flight(eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_logprobs_and_offload():
    model, tok = lively_lm("tiny-llama")
    model.to("cuda")
    engine = TorchEngine(model, tok, max_batch_size=3)
    prompts = make_prompts([4, 19, 11], seed=9)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=16, stop=tuple("abcdefghij"), seed=0)
    for g in engine.generate(prompts, params):
        for c in g:
            ref, tokens = reference_logprobs(model, prompts[c.prompt_index], c.token_ids, 1.0)
            assert (ref.gather(1, tokens[:, None]).squeeze(1).cpu() - c.logprobs).abs().max().item() <= 1e-3
    before = greedy_ids(engine, prompts, 10)
    engine.offload()
    assert engine.cache is None and next(model.parameters()).device.type == "cpu"
    engine.onload()
    assert next(model.parameters()).device.type == "cuda"
    assert greedy_ids(engine, prompts, 10) == before


def test_benchmark_script_smoke():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "rollout_engine.py"), "--model", "tiny-llama",
                          "--prompts", "2", "--samples", "2", "--batch", "4", "--max-new-tokens", "8",
                          "--repeats", "1", "--sides", "generate", "engine", "engine_graphs", "engine_steps",
                          "engine_continuous", "--prompts-per-step", "1"],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    for side in ("generate", "engine", "engine_graphs", "engine_steps", "engine_continuous"):
        (run,) = result[side]["runs"]
        # 2 prompts x 2 samples, 1-8 tokens each (through the EOS)
        assert 4 <= run["tokens"] <= 32 and 1 <= result[side]["max_length"] <= 8, result[side]
        assert result[side]["tokens_per_s_best"] == run["tokens_per_s"]
    assert result["ratio"] == round(result["engine"]["tokens_per_s_best"] / result["generate"]["tokens_per_s_best"], 2)
    assert result["ratio_graphs"] == round(result["engine_graphs"]["tokens_per_s_best"]
                                           / result["engine"]["tokens_per_s_best"], 2)
    assert result["ratio_continuous"] == round(result["engine_continuous"]["tokens_per_s_best"]
                                               / result["engine_steps"]["tokens_per_s_best"], 2)
    steps = {side: result[side]["runs"][0]["decode_steps"] for side in ("engine_steps", "engine_continuous")}
    assert result["decode_steps_ratio_continuous"] == round(steps["engine_steps"] / steps["engine_continuous"], 3)
    # one call for both steps, the second step's prompt added while the first's were in flight
    assert result["engine_continuous_stats_last_run"]["prefill_forwards"] == 2
    assert result["engine_steps_stats_last_run"]["prefill_forwards"] == 1  # the last of two calls
    # the same seeds, the same per-step draws: the fixed-shape steps generate the same lengths
    assert result["engine_graphs"]["runs"][0]["tokens"] == result["engine"]["runs"][0]["tokens"]


def test_sampling_follows_the_truncated_distribution():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0]))[None].expand(200_000, -1).clone()
    generator = torch.Generator().manual_seed(0)
    for params, expected in [(SamplingParams(), [0.4, 0.3, 0.2, 0.1, 0]),
                             (SamplingParams(top_k=2), [4 / 7, 3 / 7, 0, 0, 0]),
                             (SamplingParams(top_p=0.75), [4 / 9, 3 / 9, 2 / 9, 0, 0]),
                             (SamplingParams(temperature=0.5), [16 / 30, 9 / 30, 4 / 30, 1 / 30, 0])]:
        tokens, logprobs = sample_tokens(logits, params, generator)
        freq = torch.bincount(tokens, minlength=5).double() / len(tokens)
        assert torch.allclose(freq, torch.tensor(expected, dtype=torch.float64), atol=0.005), (params, freq)
        # Log-probs stay those of the full tempered distribution, truncation or not.
        full = torch.log_softmax(logits[0] / params.temperature, -1)
        assert torch.allclose(logprobs, full[tokens])


def test_prefill_in_chunks_is_exact():
    model, tok = lively_lm("tiny-qwen2")
    prompts = make_prompts([30, 5, 22, 14, 9], seed=10)
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=6, seed=3)
    whole = list(TorchEngine(model, tok, max_batch_size=10).generate(prompts, params))
    engine = TorchEngine(model, tok, max_batch_size=10, max_prefill_tokens=40)  # at most 40 padded tokens a forward
    chunked = list(engine.generate(prompts, params))
    assert engine.stats["prefill_forwards"] == 4 and engine.stats["prefill_tokens"] <= 4 * 40
    for a, b in zip(whole, chunked):
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids and torch.allclose(x.logprobs, y.logprobs, atol=1e-4)


def test_the_kv_cache_goes_under_the_name_the_forward_takes():
    # transformers 5.24 renamed forward's past_key_values (deprecated there, removed in 5.40) to cache
    from m2flow.engines.scoring import kv_cache_of, with_kv_cache

    class Renamed(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=None):
            return {"cache": cache}

    class Before(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            return {"past_key_values": past_key_values}

    kv = object()
    for model, name in ((Renamed(), "cache"), (Before(), "past_key_values")):
        assert with_kv_cache(model, kv) == {name: kv}
        assert kv_cache_of(model(**with_kv_cache(model, kv))) is kv
    model, _ = load_lm("tiny-llama")  # the installed release's own model takes it, returns it
    from transformers.cache_utils import DynamicCache

    out = model(input_ids=torch.tensor([[5, 6, 7]]), **with_kv_cache(model, DynamicCache()), use_cache=True)
    assert kv_cache_of(out).get_seq_length() == 3
