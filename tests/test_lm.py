"""Causal LMs: tiny test models (load, forward, seeding, chat template), checkpoint
directories, the atomic SmolLM2 cache, and (slow) the GGUF -> safetensors round trip."""

import math
import time

import pytest
import torch

from m2flow.models import lm
from m2flow.models.lm import TINY_CONFIGS, byte_tokenizer, load_lm, materialize_smollm2, smollm2_gguf

TINY_NAMES = sorted(TINY_CONFIGS)


@pytest.mark.parametrize("name", TINY_NAMES)
def test_tiny_model_forward(name):
    model, tok = load_lm(name)
    assert model.config.vocab_size == len(tok) == 259
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    assert not model.training and model.dtype == torch.float32
    ids = tok("What is 2+3? 5", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (1, ids.shape[1], 259)
    # Freshly initialised (std 0.02) logits are nearly uniform: the loss is about log(V).
    assert abs(out.loss.item() - math.log(259)) < 0.05


def test_tiny_model_seed_and_dtype():
    a, _ = load_lm("tiny-llama", seed=1)
    b, _ = load_lm("tiny-llama", seed=1)
    c, _ = load_lm("tiny-llama", seed=2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    load_lm("tiny-qwen2")
    assert torch.equal(torch.rand(3), expected)  # the caller's RNG stream is untouched
    assert load_lm("tiny-gemma", dtype=torch.bfloat16)[0].dtype == torch.bfloat16


def test_byte_tokenizer_chat_template():
    tok = byte_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "héllo, 2+3?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nhéllo, 2+3?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 3 + len("user\nhéllo, 2+3?\nassistant\n".encode())  # 3 special tokens; é is two bytes
    assert tok.decode(ids) == text
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == ("<|im_end|>", 2, 0)


def test_checkpoint_directory_round_trip(tmp_path):
    model, tok = load_lm("tiny-qwen2", seed=3)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, loaded_tok = load_lm(tmp_path)
    assert type(loaded).__name__ == "Qwen2ForCausalLM"
    text = "<|im_start|>user\n1+1<|im_end|>\n"
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert loaded_tok(text, return_tensors="pt")["input_ids"].tolist() == ids.tolist()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        load_lm("no-such-model")


def test_smollm2_cache_is_written_atomically(tmp_path, monkeypatch):
    """Two processes racing to build the cache: the loser's copy is dropped, no temporary
    directory is left, and later loads don't convert again."""
    final = tmp_path / "models" / "smollm2"
    conversions = []

    def fake_convert(gguf, out):
        conversions.append(out)
        model, tok = load_lm("tiny-llama")
        if len(conversions) == 1:  # a concurrent process finishes first
            final.mkdir(parents=True)
            model.save_pretrained(final)
            tok.save_pretrained(final)
        model.save_pretrained(out)
        tok.save_pretrained(out)

    monkeypatch.setattr(lm, "_convert_gguf", fake_convert)
    monkeypatch.setattr(lm, "smollm2_gguf", lambda: tmp_path / "fake.gguf")
    assert materialize_smollm2(tmp_path) == final
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["smollm2"]
    assert not conversions[0].exists()
    model, tok = load_lm("smollm2", cache_dir=tmp_path)
    assert len(conversions) == 1 and model.config.vocab_size == len(tok) == 259


def test_smollm2_gguf_is_installed():
    path = smollm2_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90e6


@pytest.mark.slow
def test_smollm2_gguf_round_trip(tmp_path):
    """Dequantising the GGUF, caching it as safetensors and reloading gives the same model
    (about a minute on 2 cores, most of it reading the GGUF twice)."""
    from transformers import AutoModelForCausalLM

    model, tok = load_lm("smollm2", cache_dir=tmp_path)
    start = time.perf_counter()
    cached, cached_tok = load_lm("smollm2", cache_dir=tmp_path)
    assert time.perf_counter() - start < 10
    assert sorted(p.name for p in (tmp_path / "models" / "smollm2").iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]
    assert sum(p.numel() for p in cached.parameters()) == 134_515_008
    assert cached.config.tie_word_embeddings and not hasattr(cached.config, "quantization_config")

    gguf = smollm2_gguf()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    prompt = cached_tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], tokenize=False,
                                            add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    ids = cached_tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    assert ids.tolist() == tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].tolist()
    with torch.no_grad():
        logits = cached(ids).logits
        assert torch.equal(logits, reference(ids).logits)
        assert torch.equal(logits, model(ids).logits)
        out = cached.generate(ids, max_new_tokens=12, do_sample=False)
    assert "5" in cached_tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
