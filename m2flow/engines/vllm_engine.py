"""VLLMEngine: the GenerationEngine contract on vLLM (GPU only, optional dependency).

Written against vLLM's documented API (``vllm.LLM``, ``LLMEngine.add_request``/``step``,
``LLM.apply_model``, ``LLM.sleep``/``wake_up``, ``SamplingParams``) and UNVERIFIED: the machine
this project is developed on has no GPU and no vllm. Differences from ``TorchEngine``:

- Log-probs: vLLM is built with ``logprobs_mode="processed_logprobs"``, i.e. the log-softmax of
  the logits after temperature *and* top-k/top-p. Without truncation (top_k=0, top_p=1, the
  usual RL setting) that is exactly the interface's log_softmax(logits / T); with truncation
  vLLM renormalises over the kept tokens, so values differ from TorchEngine's.
- Weights: vLLM loads its own copy from a checkpoint directory (the model's ``name_or_path``,
  or a temporary ``save_pretrained`` copy); ``load_weights`` updates vLLM's copy through
  ``model.load_weights`` in each worker and the local ``model`` (kept for weight hashes).
- Seeds: prompt i gets ``seed + i * n``; vLLM derives its n samples' streams from it.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence

import torch

from m2flow.engines.generation import Completion, GenerationEngine, SamplingParams, validate_prompts


class VLLMEngine(GenerationEngine):
    def __init__(self, model, tokenizer, **llm_options):
        try:
            import vllm
        except ImportError as e:
            raise ImportError("the 'vllm' generation backend needs vLLM and a CUDA GPU: pip install vllm "
                              "(or use backend 'torch')") from e
        self.vllm, self.model, self.tokenizer = vllm, model, tokenizer
        path = getattr(model, "name_or_path", "")
        if not os.path.isdir(path):  # a model built in memory (e.g. a tiny test model): give vLLM a checkpoint
            self._checkpoint = tempfile.TemporaryDirectory(prefix="m2flow-vllm-")
            path = self._checkpoint.name
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
        options = {"dtype": str(model.dtype).removeprefix("torch."), "enable_sleep_mode": True,
                   "logprobs_mode": "processed_logprobs", **llm_options}
        self.llm = vllm.LLM(model=path, **options)
        self.asleep = self.weights_awake = False
        self.request_ids = itertools.count()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Iterator[list[Completion]]:
        if self.asleep:
            raise RuntimeError("the engine is offloaded: call onload() before generate()")
        checked = validate_prompts(prompts, self.model.config.vocab_size,
                                   getattr(self.model.config, "max_position_embeddings", None))
        return self._generate(checked, params)

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> Iterator[list[Completion]]:
        engine = self.llm.llm_engine
        by_request = {}
        for i, prompt in enumerate(prompts):
            request_id = f"m2flow-{next(self.request_ids)}"
            by_request[request_id] = i
            engine.add_request(request_id, {"prompt_token_ids": prompt}, self.vllm.SamplingParams(
                n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                max_tokens=params.max_new_tokens, stop=list(params.stop), include_stop_str_in_output=True,
                seed=None if params.seed is None else params.seed + i * params.n, logprobs=0,
                skip_special_tokens=True, output_kind=self.vllm.sampling_params.RequestOutputKind.FINAL_ONLY))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id in by_request:
                    yield sorted((self._completion(by_request[out.request_id], o) for o in out.outputs),
                                 key=lambda c: c.sample_index)

    @staticmethod
    def _completion(prompt_index: int, out) -> Completion:
        # logprobs=0: each step's dict holds just the sampled token.
        logprobs = [step[token].logprob for token, step in zip(out.token_ids, out.logprobs)]
        return Completion(prompt_index, out.index, list(out.token_ids), torch.tensor(logprobs, dtype=torch.float32),
                          "length" if out.finish_reason == "length" else "stop", out.text)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        weights = list(named_tensors)
        if self.asleep and not self.weights_awake:  # wake the weights alone: the KV cache stays freed
            self.llm.wake_up(tags=["weights"])
            self.weights_awake = True
        self.llm.apply_model(lambda model: model.load_weights(weights))  # vLLM maps HF names (fused qkv, ...)
        state = self.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in weights:
                if name in state:
                    state[name].copy_(tensor)

    def offload(self) -> None:
        if not self.asleep:
            self.llm.sleep(level=1)  # weights to CPU, KV cache discarded
            self.asleep, self.weights_awake = True, False

    def onload(self) -> None:
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"] if self.weights_awake else None)
            self.asleep = False
