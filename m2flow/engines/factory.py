"""The generation backends by name: ``build_engine`` and the names it takes (``BACKENDS``).
The vLLM backend's module imports without vLLM; vLLM itself is imported only when a
``VLLMEngine`` is built."""

from __future__ import annotations

from m2flow.engines.generation import GenerationEngine
from m2flow.engines.torch_engine import TorchEngine
from m2flow.engines.vllm_engine import VLLMEngine

BACKENDS = ("torch", "vllm")  # the names build_engine takes


def build_engine(backend: str, model, tokenizer, **options) -> GenerationEngine:
    """A generation engine: ``"torch"`` (any device, the default) or ``"vllm"`` (GPU, optional).
    ``options`` go to the backend's constructor (e.g. ``max_batch_size``)."""
    if backend == "torch":
        return TorchEngine(model, tokenizer, **options)
    if backend == "vllm":
        return VLLMEngine(model, tokenizer, **options)
    raise ValueError(f"unknown generation backend {backend!r}: expected 'torch' or 'vllm'")
