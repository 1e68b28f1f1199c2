"""VLLMEngine: the GenerationEngine contract on vLLM (GPU only, optional dependency).

Written against the source of vLLM 0.33.0 (``vllm/entrypoints/llm.py``,
``vllm/v1/engine/{llm_engine,core}.py``, ``vllm/v1/serial_utils.py``,
``vllm/v1/worker/{worker_base,gpu_worker}.py``). It has not run on a GPU: it is tested only
against fakes of those interfaces (``tests/test_vllm_engine.py``). How it uses vLLM:

- Weight sync. vLLM runs the model in a process of its own (the V1 engine core), and what
  reaches it is msgpack: a function given to ``LLM.apply_model`` or ``LLM.collective_rpc``
  (a lambda, a closure, a module-level function alike) is refused unless
  ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, and tensors among a ``collective_rpc``'s arguments
  arrive undecoded. So ``load_weights`` writes the bucket to a safetensors file (in /dev/shm
  where there is one) and calls ``collective_rpc("m2flow_load_weights", args=(path,))``:
  a method of ``WorkerExtension``, which vLLM mixes into its worker class (the engine
  argument ``worker_extension_cls``, an import path), called by name. It reads the file and
  calls the model's ``load_weights``, which maps the transformers names onto vLLM's fused
  layers.
- Weight hash. ``weights_hash`` is computed inside the worker, from vLLM's own weights
  (``m2flow_weights_hash``) put back under the transformers names, with the hash the rest of
  m2flow uses: a load that did not take shows as a hash unequal to the actor's.
- Memory. ``gpu_memory_utilization`` (``rollout.gpu_memory_utilization``) is the share of the
  whole GPU that vLLM takes for its weights, activations and KV cache; that much must be free
  when it starts. No transformers copy of the model stays: the engine keeps its config (for
  prompt checks) and the names and shapes of its weights (for ``load_weights``' checks).
- Sleep. With ``enable_sleep_mode`` (the rollout passes it when it shares its GPU),
  ``offload`` is ``LLM.sleep(level=1)``: the weights go to CPU memory, the KV cache is
  dropped; ``onload`` wakes both. A load or a hash while asleep wakes the weights alone.
  Without it (a GPU of its own) there is no sleeping, and ``offload`` is an error.
- Log-probs. vLLM is built with ``logprobs_mode="processed_logprobs"``, the log-softmax of the
  logits after temperature *and* top-k/top-p. Without truncation (top_k=0, top_p=1, the
  usual RL setting) that is exactly the interface's log_softmax(logits / T); with truncation
  vLLM renormalises over the kept tokens, so values differ from TorchEngine's.
- Seeds. Prompt i gets ``seed + i * n`` (vLLM gives its n samples ``seed + j``); with
  ``seed=None`` the base seed is drawn from torch's global RNG, as in TorchEngine.
- Turns (``turn_ended``, multi-turn with tools). Each sample is a request of its own (n=1), so
  that one can wait for its tools while the others go on; when its turn's request finishes,
  the hook is asked, and once its answer is in, the sample's next turn is a new request whose
  prompt is the whole trajectory so far (vLLM's prefix caching, on by default in its V1
  engine, finds the earlier turns' KV blocks, so only the appended tokens are computed). Each
  turn's request has its own seed, from the call's seed, the prompt, the sample and the turn:
  the sample draws the same whatever the tools' timing (as far as vLLM's batching leaves its
  logits alone).
"""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait

import torch

from m2flow.engines.generation import (Completion, GenerationEngine, SampleInFlight, SamplingParams, TurnEnd,
                                      sequence_seed, turn_limit, validate_prompts)
from m2flow.engines.weights import weights_hash

GPU_MEMORY_UTILIZATION = 0.5  # the default share of the GPU: room for a collocated actor
WORKER_EXTENSION = f"{__name__}.WorkerExtension"
SHM_DIR = "/dev/shm"


def check_memory_fraction(value: object) -> float:
    """``value`` as vLLM's ``gpu_memory_utilization``, or a ValueError: it must be in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"rollout.gpu_memory_utilization must be a number in (0, 1], got {value!r}")
    return float(value)


class VLLMEngine(GenerationEngine):
    """``model``: the transformers model, used here only for its config, its weights' names
    and shapes and, when it has no checkpoint directory (``name_or_path``), to write one for
    vLLM; the engine keeps no reference to it. ``llm_options`` go to ``vllm.LLM``."""

    def __init__(self, model, tokenizer, gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
                 enable_sleep_mode: bool = True, **llm_options):
        fraction = check_memory_fraction(gpu_memory_utilization)
        if llm_options.get("tensor_parallel_size", 1) != 1:
            raise ValueError("VLLMEngine runs one GPU per rollout rank: tensor_parallel_size must be 1, "
                             f"got {llm_options['tensor_parallel_size']}")
        for key in ("worker_extension_cls", "logprobs_mode"):
            if key in llm_options:
                raise ValueError(f"VLLMEngine sets vLLM's {key} itself: do not pass it")
        try:
            import vllm
        except ImportError as e:
            raise ImportError("the 'vllm' generation backend needs vLLM and a CUDA GPU: pip install vllm "
                              "(or use backend 'torch')") from e
        self.vllm, self.tokenizer, self.config = vllm, tokenizer, model.config
        self.weight_shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        path = getattr(model, "name_or_path", "")
        if not os.path.isdir(path):  # a model built in memory (e.g. a tiny test model): give vLLM a checkpoint
            self._checkpoint = tempfile.TemporaryDirectory(prefix="m2flow-vllm-")
            path = self._checkpoint.name
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
        options = {"dtype": str(model.dtype).removeprefix("torch."), "gpu_memory_utilization": fraction,
                   "enable_sleep_mode": bool(enable_sleep_mode), "logprobs_mode": "processed_logprobs",
                   "worker_extension_cls": WORKER_EXTENSION, **llm_options}
        self.llm = vllm.LLM(model=path, **options)
        self.sleep_mode = bool(enable_sleep_mode)
        self.asleep = self.weights_awake = False
        self.request_ids = itertools.count()
        self.bucket_dir = SHM_DIR if os.path.isdir(SHM_DIR) else tempfile.gettempdir()

    # -- the GenerationEngine contract -------------------------------------------------

    takes_turns = True

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 between: Callable[[], None] | None = None,
                 turn_ended: Callable[[TurnEnd], Future | None] | None = None) -> Iterator[list[Completion]]:
        if between is not None:
            raise NotImplementedError("weights updated while sequences are in flight (rollout.partial=true) need "
                                      "rollout.backend=torch")
        if self.asleep:
            raise RuntimeError("the engine is offloaded: call onload() before generate()")
        checked = validate_prompts(prompts, self.config.vocab_size,
                                   getattr(self.config, "max_position_embeddings", None))
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, ()).item())
        if turn_ended is not None:
            limit = turn_limit(params, getattr(self.config, "max_position_embeddings", None))
            return self._generate_turns(checked, params, seed, turn_ended, limit)
        return self._generate(checked, params, seed)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        bucket = {}
        for name, tensor in named_tensors:
            if name not in self.weight_shapes:
                raise ValueError(f"load_weights: the model has no weight named {name!r}")
            if tuple(tensor.shape) != self.weight_shapes[name]:
                raise ValueError(f"load_weights: {name} has shape {self.weight_shapes[name]}, "
                                 f"got {tuple(tensor.shape)}")
            bucket[name] = tensor.detach().to("cpu").contiguous()
        if not bucket:
            return
        from safetensors.torch import save_file

        self._wake_weights()
        fd, path = tempfile.mkstemp(prefix="m2flow-vllm-weights-", suffix=".safetensors", dir=self.bucket_dir)
        os.close(fd)
        try:
            save_file(bucket, path)
            loaded = self.llm.collective_rpc("m2flow_load_weights", args=(path,))
        finally:
            os.unlink(path)
        if any(n != len(bucket) for n in loaded):
            raise RuntimeError(f"vLLM's workers read {loaded} weights of a bucket of {len(bucket)}")

    def weights_hash(self) -> str:
        self._wake_weights()
        hashes = self.llm.collective_rpc("m2flow_weights_hash")
        if len(set(hashes)) != 1:
            raise RuntimeError(f"vLLM's workers hold different weights: hashes {hashes}")
        return hashes[0]

    def offload(self) -> None:
        if not self.sleep_mode:
            raise RuntimeError("this VLLMEngine was built with enable_sleep_mode=False (its GPU is its own): "
                               "it cannot offload")
        if not self.asleep or self.weights_awake:  # asleep with the weights woken by a load: they go back out
            self.llm.sleep(level=1)  # weights to CPU, KV cache discarded
            self.asleep, self.weights_awake = True, False

    def onload(self) -> None:
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"] if self.weights_awake else None)
            self.asleep = self.weights_awake = False

    # -- internals ------------------------------------------------------------------------

    def _wake_weights(self) -> None:
        if self.asleep and not self.weights_awake:  # the weights alone: the KV cache stays freed
            self.llm.wake_up(tags=["weights"])
            self.weights_awake = True

    def _generate(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> Iterator[list[Completion]]:
        engine = self.llm.llm_engine
        kind = self.vllm.sampling_params.RequestOutputKind.FINAL_ONLY
        pending = {}
        for i, prompt in enumerate(prompts):
            request_id = f"m2flow-{next(self.request_ids)}"
            pending[request_id] = i
            engine.add_request(request_id, {"prompt_token_ids": prompt}, self.vllm.SamplingParams(
                n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                max_tokens=params.max_new_tokens, stop=list(params.stop), include_stop_str_in_output=True,
                seed=seed + i * params.n, logprobs=0, skip_special_tokens=True, output_kind=kind))
        try:
            while pending and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        i = pending.pop(out.request_id)
                        yield sorted((self._completion(i, o) for o in out.outputs), key=lambda c: c.sample_index)
        finally:
            if pending:  # the caller stopped early: the rest must not run into the next call
                engine.abort_request(list(pending))

    def _generate_turns(self, prompts: list[list[int]], params: SamplingParams, seed: int,
                        turn_ended: Callable[[TurnEnd], Future | None], limit: int) -> Iterator[list[Completion]]:
        """Each sample a request per turn; between its turns it waits for its tools' answer (see
        the module docstring). Groups come out as in ``_generate``."""
        engine = self.llm.llm_engine
        pending: dict[str, SampleInFlight] = {}
        tools: dict[Future, SampleInFlight] = {}
        groups: dict[int, list[Completion]] = {}

        def submit(t: SampleInFlight) -> None:
            request_id = f"m2flow-{next(self.request_ids)}"
            pending[request_id] = t
            context = t.prompt + t.tokens
            engine.add_request(request_id, {"prompt_token_ids": context}, self.vllm.SamplingParams(
                n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                max_tokens=min(params.max_new_tokens, limit - len(context)), stop=list(params.stop),
                include_stop_str_in_output=True, seed=sequence_seed(seed, t.prompt_index, t.sample_index, t.turns),
                logprobs=0, skip_special_tokens=True, output_kind=self.vllm.sampling_params.RequestOutputKind.FINAL_ONLY))

        def done(t: SampleInFlight) -> Iterator[list[Completion]]:
            group = groups.setdefault(t.prompt_index, [])
            group.append(t.completion(self.tokenizer.decode(t.tokens, skip_special_tokens=True), with_versions=False))
            if len(group) == params.n:
                del groups[t.prompt_index]
                yield sorted(group, key=lambda c: c.sample_index)

        for i, prompt in enumerate(prompts):
            for j in range(params.n):
                submit(SampleInFlight(i, j, prompt))
        try:
            while pending or tools:
                if tools:  # waits only when no request is in flight
                    answered, _ = wait(list(tools), timeout=0 if pending else None, return_when=FIRST_COMPLETED)
                    for answer in answered:
                        t = tools.pop(answer)
                        if t.take_answer(answer.result(), limit):
                            submit(t)
                        else:
                            yield from done(t)
                if not pending:
                    continue
                if not engine.has_unfinished_requests():
                    raise RuntimeError(f"vLLM holds none of the {len(pending)} requests in flight")
                for out in engine.step():
                    if not (out.finished and out.request_id in pending):
                        continue
                    t, (o,) = pending.pop(out.request_id), out.outputs
                    t.add_sampled(list(o.token_ids), [step[token].logprob for token, step in zip(o.token_ids, o.logprobs)],
                                  version=0)  # dropped: done() leaves the versions out
                    t.finish_reason = "length" if o.finish_reason == "length" else "stop"
                    answer = turn_ended(t.turn_end(limit)) if t.room(limit) > 0 else None
                    if answer is None:
                        yield from done(t)
                    else:
                        tools[answer] = t
        finally:
            if pending:  # the caller stopped early: the rest must not run into the next call
                engine.abort_request(list(pending))

    @staticmethod
    def _completion(prompt_index: int, out) -> Completion:
        # logprobs=0: each step's dict holds just the sampled token.
        logprobs = [step[token].logprob for token, step in zip(out.token_ids, out.logprobs)]
        return Completion(prompt_index, out.index, list(out.token_ids), torch.tensor(logprobs, dtype=torch.float32),
                          "length" if out.finish_reason == "length" else "stop", out.text)


class WorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); its methods run in the
    worker process, called by name through ``LLM.collective_rpc``, their arguments and
    results plain msgpack types. vLLM refuses an extension attribute its worker class already
    has (the worker has ``update_weights``, ``sleep``, ...), hence the prefix; helpers live at
    module level. ``self.model_runner`` is the worker's."""

    def m2flow_load_weights(self, path: str) -> int:
        """Loads the safetensors file at ``path`` (transformers names) into the model; returns
        how many tensors it held."""
        from safetensors.torch import load_file

        weights = load_file(path)  # on the CPU: the model's weight loaders copy into its GPU tensors
        self.model_runner.get_model().load_weights(weights=list(weights.items()))
        return len(weights)

    def m2flow_weights_hash(self) -> str:
        return weights_hash(hf_named_weights(self.model_runner.get_model()))


def hf_named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A vLLM model's weights under the transformers names, as ``named_weights`` gives them
    for the transformers model: a fused layer (``packed_modules_mapping``, e.g. ``qkv_proj``
    from q, k, v, ``gate_up_proj``) is split back by its ``output_sizes``; a vocabulary
    embedding or LM head loses its padding rows (beyond ``org_vocab_size``); a tied weight
    comes once, under its first name. One GPU's model only (tensor_parallel_size 1)."""
    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():  # each parameter once: tied ones under their first name
        module_name, _, attr = name.rpartition(".")
        module = modules[module_name]
        tensor = param.detach()
        parent, _, leaf = module_name.rpartition(".")
        if leaf in packed:
            sizes = list(getattr(module, "output_sizes", ()))
            if len(sizes) != len(packed[leaf]) or sum(sizes) != tensor.shape[0]:
                raise RuntimeError(f"{name}: shape {tuple(tensor.shape)} is not the fusion of {packed[leaf]} "
                                   f"with output sizes {sizes} (tensor parallel?)")
            for part_name, part in zip(packed[leaf], tensor.split(sizes, dim=0)):
                yield f"{parent}.{part_name}.{attr}" if parent else f"{part_name}.{attr}", part
            continue
        vocab = getattr(module, "org_vocab_size", None)
        if vocab is not None and tensor.dim() >= 1 and tensor.shape[0] > vocab:
            tensor = tensor[:vocab]
        yield name, tensor
