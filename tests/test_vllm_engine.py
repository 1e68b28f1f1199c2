"""VLLMEngine against fakes of vLLM 0.33.0's interfaces: vLLM is not installed here (it needs
a GPU), so nothing in this file runs real vLLM.

The fakes copy from vLLM 0.33.0's source the signatures the backend calls and the rules it
depends on: ``LLM.__init__``'s keywords (``vllm/entrypoints/llm.py``); ``collective_rpc`` /
``apply_model``, whose arguments reach the engine-core process as msgpack
(``vllm/v1/serial_utils.py``: a function is refused unless
VLLM_ALLOW_INSECURE_SERIALIZATION=1, and utility-call arguments are decoded untyped, so a
tensor would arrive as a list); the worker extension's mix-in, which refuses a name the worker
class already has (``vllm/v1/worker/worker_base.py``); ``sleep(level)`` / ``wake_up(tags)``
(``vllm/v1/executor/abstract.py``); the ``LLMEngine`` calls of ``add_request`` / ``step``;
and a model laid out as vLLM lays it out (fused ``qkv_proj`` / ``gate_up_proj`` with
``output_sizes``, the vocabulary padded to a multiple of 64, a tied head sharing the
embedding's parameter) with a ``load_weights`` that maps the transformers names onto it."""

from __future__ import annotations

import dataclasses
import enum
import importlib
import os
import pickle
import sys
import types
from contextlib import nullcontext

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file
from torch import nn

from m2flow.config import load_config
from m2flow.engines import build_engine
from m2flow.engines.weights import named_weights, weights_hash
from m2flow.engines.vllm_engine import WORKER_EXTENSION, VLLMEngine, WorkerExtension, hf_named_weights
from m2flow.models.lm import load_lm
from m2flow.config.validate import validate as check_config
from m2flow.workers.lm_rollout import LMRolloutWorker, engine_options

PRESET = "reasoning/grpo_arith_tiny"

# -- a vLLM-shaped model ----------------------------------------------------------------------

VOCAB_PADDING = 64  # vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE
STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class FusedLinear(nn.Module):
    """QKVParallelLinear / MergedColumnParallelLinear at tensor parallel 1: one weight (and
    bias) holding the parts along dim 0, ``output_sizes`` their sizes."""

    def __init__(self, output_sizes, in_features, bias):
        super().__init__()
        self.output_sizes = list(output_sizes)
        self.weight = nn.Parameter(torch.zeros(sum(output_sizes), in_features))
        self.bias = nn.Parameter(torch.zeros(sum(output_sizes))) if bias else None


class PaddedEmbedding(nn.Module):
    """VocabParallelEmbedding / ParallelLMHead at tensor parallel 1: rows padded to a multiple of 64."""

    def __init__(self, vocab, dim):
        super().__init__()
        self.org_vocab_size = vocab
        self.weight = nn.Parameter(torch.zeros(-(-vocab // VOCAB_PADDING) * VOCAB_PADDING, dim))


class Plain(nn.Module):
    def __init__(self, tensors):
        super().__init__()
        for attr, t in tensors.items():
            setattr(self, attr, nn.Parameter(torch.zeros_like(t)))


def _put(root, path, module):
    *parents, leaf = path.split(".")
    node = root
    for part in parents:
        if not hasattr(node, part):
            node.add_module(part, nn.Module())
        node = getattr(node, part)
    node.add_module(leaf, module)


class FakeVllmModel(nn.Module):
    """Built from a transformers state dict the way vLLM lays those models out; ``skip``:
    names its ``load_weights`` silently drops (a load that does not take)."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, hf_state, tied, skip=None):
        super().__init__()
        self.tied, self.skip, self.loaded_calls = tied, skip, []
        modules, fused = {}, {}
        for name, t in hf_state.items():
            path, attr = name.rsplit(".", 1)
            parent, leaf = path.rsplit(".", 1) if "." in path else ("", path)
            if leaf in STACKED:
                target, index = STACKED[leaf]
                fused.setdefault(f"{parent}.{target}", {}).setdefault(attr, {})[index] = t
            else:
                modules.setdefault(path, {})[attr] = t
        for path, tensors in modules.items():  # state-dict order: the embedding before the head
            if path == "lm_head" and tied:
                head = PaddedEmbedding(*tensors["weight"].shape)
                head.weight = self.get_submodule("model.embed_tokens").weight  # vLLM's tie_weights
                _put(self, path, head)
            elif path.endswith("embed_tokens") or path == "lm_head":
                _put(self, path, PaddedEmbedding(*tensors["weight"].shape))
            else:
                _put(self, path, Plain(tensors))
        for path, parts in fused.items():
            weights = [parts["weight"][i] for i in sorted(parts["weight"])]
            _put(self, path, FusedLinear([w.shape[0] for w in weights], weights[0].shape[1], "bias" in parts))

    def load_weights(self, weights):
        """As vLLM's ``load_weights(weights: Iterable[tuple[str, Tensor]]) -> set[str]``."""
        weights = list(weights)
        self.loaded_calls.append(weights)
        params, loaded = dict(self.named_parameters()), set()
        with torch.no_grad():
            for name, w in weights:
                if self.skip and self.skip in name:
                    continue
                path, attr = name.rsplit(".", 1)
                parent, leaf = path.rsplit(".", 1) if "." in path else ("", path)
                if leaf in STACKED:
                    target, index = STACKED[leaf]
                    module = self.get_submodule(f"{parent}.{target}")
                    start = sum(module.output_sizes[:index])
                    getattr(module, attr)[start:start + module.output_sizes[index]].copy_(w)
                    loaded.add(f"{parent}.{target}.{attr}")
                elif name == "lm_head.weight" and self.tied:
                    continue  # the tied head is the embedding
                elif name not in params:
                    raise ValueError(f"There is no module or parameter named {name!r}")
                elif hasattr(self.get_submodule(path), "org_vocab_size"):
                    params[name][:w.shape[0]].copy_(w)
                    params[name][w.shape[0]:].zero_()
                    loaded.add(name)
                else:
                    params[name].copy_(w)
                    loaded.add(name)
        return loaded


# -- the fake vllm package ------------------------------------------------------------------


def check_msgpack(obj) -> None:
    """Raises unless ``obj`` reaches vLLM's engine core as itself: msgpack's own types. Any
    other object is refused as vLLM's encoder refuses it (a function, a closure, ...); a
    tensor vLLM encodes, but a utility call's arguments are decoded untyped, so it would
    arrive as a [dtype, shape, buffer] list."""
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return
    if isinstance(obj, (list, tuple)):
        for x in obj:
            check_msgpack(x)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            check_msgpack(k)
            check_msgpack(v)
    elif isinstance(obj, torch.Tensor):
        raise TypeError("a tensor among collective_rpc's arguments arrives undecoded")
    else:  # MsgpackEncoder.enc_hook without VLLM_ALLOW_INSECURE_SERIALIZATION
        raise TypeError(f"Object of type {type(obj)} is not serializable. Set VLLM_ALLOW_INSECURE_SERIALIZATION=1 "
                        "to allow fallback to pickle-based serialization.")


class RequestOutputKind(enum.Enum):  # vllm.sampling_params.RequestOutputKind
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclasses.dataclass(kw_only=True)
class FakeSamplingParams:
    """vllm.SamplingParams: the fields the backend sets, with 0.33.0's defaults; any other
    keyword is a TypeError."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE


class FakeWorkerBase:
    """Public methods of vLLM 0.33.0's GPU ``Worker`` (``vllm/v1/worker/gpu_worker.py``) that a
    worker extension could collide with."""

    def sleep(self, level=1): ...
    def wake_up(self, tags=None): ...
    def update_weights(self, update_info): ...
    def reload_weights(self, *args, **kwargs): ...
    def compute_weight_checksums(self): ...
    def get_model(self): ...
    def load_model(self, *, load_dummy_weights=False): ...
    def apply_model(self, fn): ...
    def init_weight_transfer_engine(self, init_info): ...


class FakeModelRunner:
    def __init__(self, model, llm):
        self.model, self.llm = model, llm

    def get_model(self):
        if "weights" in self.llm.sleeping:  # vLLM unmaps them: touching them would fault
            raise RuntimeError("the weights are asleep: wake them before using them")
        return self.model


class FakeLLMEngine:
    """The ``vllm.v1.engine.llm_engine.LLMEngine`` calls the backend makes (0.33.0 signatures).
    Each step finishes one request: its n samples are [last prompt token, 3 + sample index]."""

    def __init__(self, llm):
        self.llm, self.requests, self.params = llm, {}, []

    def add_request(self, request_id, prompt, params, arrival_time=None, lora_request=None,
                    tokenization_kwargs=None, trace_headers=None, priority=0, session_id=None,
                    prompt_text=None, kv_hints=None):
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id)}")
        self.requests[request_id] = (list(prompt["prompt_token_ids"]), params)
        self.params.append(params)
        return f"{request_id}-internal"

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        if self.llm.sleeping:
            raise RuntimeError("stepping a sleeping engine")
        request_id, (prompt, params) = next(iter(self.requests.items()))
        del self.requests[request_id]
        samples = [types.SimpleNamespace(index=j, token_ids=[prompt[-1], 3 + j], text=f"s{j}", finish_reason="length",
                                         logprobs=[{prompt[-1]: types.SimpleNamespace(logprob=-0.25)},
                                                   {3 + j: types.SimpleNamespace(logprob=-0.5 - j)}])
                   for j in reversed(range(params.n))]  # out of order: the engine sorts them
        return [types.SimpleNamespace(request_id=request_id, finished=True, outputs=samples)]

    def abort_request(self, request_ids, internal=False):
        for r in request_ids:
            self.requests.pop(r)


class FakeLLM:
    skip = None  # FaultyLLM: weight names its model's load_weights drops

    # The keywords of vllm.LLM.__init__ (0.33.0) that the backend uses; the rest go to
    # EngineArgs through **kwargs, checked against the EngineArgs fields it passes.
    def __init__(self, model: str, *, tokenizer=None, tensor_parallel_size: int = 1, dtype="auto", seed: int = 0,
                 gpu_memory_utilization: float = 0.92, enforce_eager: bool = False, **kwargs):
        from transformers import AutoModelForCausalLM

        engine_args = {"enable_sleep_mode", "logprobs_mode", "worker_extension_cls"}
        if set(kwargs) - engine_args:
            raise TypeError(f"unexpected EngineArgs {sorted(set(kwargs) - engine_args)}")
        if not 0 < gpu_memory_utilization <= 1:  # CacheConfig: Field(gt=0, le=1)
            raise ValueError(f"gpu_memory_utilization {gpu_memory_utilization}")
        if kwargs.get("logprobs_mode", "raw_logprobs") not in ("raw_logits", "raw_logprobs", "processed_logits",
                                                                 "processed_logprobs"):
            raise ValueError(kwargs["logprobs_mode"])
        self.kwargs = {"model": model, "tensor_parallel_size": tensor_parallel_size, "dtype": dtype,
                       "gpu_memory_utilization": gpu_memory_utilization, **kwargs}
        self.sleeping, self.calls, self.rpc_calls = set(), [], []
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))  # vLLM reads the checkpoint
        self.model = FakeVllmModel(hf.state_dict(), hf.config.tie_word_embeddings, self.skip)
        self.model.load_weights(hf.state_dict().items())
        self.model.loaded_calls.clear()
        self.worker = self._make_worker(kwargs.get("worker_extension_cls"))
        self.worker.model_runner = FakeModelRunner(self.model, self)
        self.llm_engine = FakeLLMEngine(self)

    @staticmethod
    def _make_worker(extension):
        """WorkerWrapperBase.init_worker: the extension, named by import path, joins the
        worker class's bases; a name the worker class already has is refused."""
        worker_class = type("Worker", (FakeWorkerBase,), {})
        if extension:
            module, _, name = extension.rpartition(".")
            extension_class = getattr(importlib.import_module(module), name)
            for attr in dir(extension_class):
                if not attr.startswith("__"):
                    assert not hasattr(worker_class, attr), f"worker class already has {attr}"
            worker_class.__bases__ = worker_class.__bases__ + (extension_class,)
        return worker_class()

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        check_msgpack((method, args, kwargs or {}))
        args, kwargs = pickle.loads(pickle.dumps((args, kwargs or {})))  # across the process boundary
        self.rpc_calls.append((method, args, kwargs))
        result = getattr(self.worker, method)(*args, **kwargs)
        check_msgpack(result)  # a UtilityResult goes back natively without insecure serialization
        return [result]

    def apply_model(self, func):
        return self.collective_rpc("apply_model", args=(func,))  # LLMEngine.apply_model in 0.33.0

    def sleep(self, level: int = 1, mode: str = "abort"):
        if not self.kwargs.get("enable_sleep_mode"):
            raise RuntimeError("sleep mode is not enabled")
        self.calls.append(("sleep", level))
        if "weights" not in self.sleeping:  # Executor.sleep: a no-op while the weights sleep
            self.sleeping |= {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(("wake_up", tags))
        self.sleeping -= set(tags) if tags is not None else self.sleeping
        return not self.sleeping


class FaultyLLM(FakeLLM):
    skip = "mlp.up_proj"  # a mapping bug: these names are silently not loaded


@pytest.fixture
def fake_vllm(monkeypatch):
    """Installs a fake ``vllm`` package whose LLM is ``llm_class``."""

    def install(llm_class=FakeLLM):
        package = types.ModuleType("vllm")
        sampling = types.ModuleType("vllm.sampling_params")
        sampling.RequestOutputKind, sampling.SamplingParams = RequestOutputKind, FakeSamplingParams
        package.LLM, package.SamplingParams, package.sampling_params = llm_class, FakeSamplingParams, sampling
        monkeypatch.setitem(sys.modules, "vllm", package)
        monkeypatch.setitem(sys.modules, "vllm.sampling_params", sampling)

    install()
    return install


def perturbed(model, seed):
    """A copy of ``model``'s weights, every one changed: the actor after an update."""
    g = torch.Generator().manual_seed(seed)
    return {name: (t + 0.01 * torch.randn(t.shape, generator=g)).to(t.dtype) for name, t in named_weights(model)}


# -- tests ----------------------------------------------------------------------------------


def test_the_package_imports_without_vllm(monkeypatch):
    assert "vllm" not in sys.modules  # the modules above imported the backend without it
    model, tok = load_lm("tiny-llama")
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm now raises ImportError
    with pytest.raises(ImportError, match="needs vLLM and a CUDA GPU"):
        build_engine("vllm", model, tok)


def test_the_configured_memory_fraction_and_sleep_mode_reach_the_constructor(fake_vllm):
    cfg = load_config(PRESET, ["rollout.backend=vllm", "rollout.gpu_memory_utilization=0.37"])
    check_config(cfg)
    options = engine_options(OmegaConf.to_container(cfg.rollout, resolve=True), shared=True)
    model, tok = load_lm("tiny-llama")
    engine = build_engine("vllm", model, tok, **options)
    kwargs = engine.llm.kwargs
    assert kwargs["gpu_memory_utilization"] == 0.37 and kwargs["enable_sleep_mode"] is True
    assert kwargs["worker_extension_cls"] == WORKER_EXTENSION == "m2flow.engines.vllm_engine.WorkerExtension"
    assert kwargs["logprobs_mode"] == "processed_logprobs" and kwargs["dtype"] == "float32"
    assert isinstance(engine.llm.worker, WorkerExtension)  # mixed into the worker class, no name clash
    assert not hasattr(engine, "model")  # no transformers copy is kept
    unshared = build_engine("vllm", model, tok, **engine_options(cfg.rollout, shared=False))
    assert unshared.llm.kwargs["enable_sleep_mode"] is False
    assert engine_options({"backend": "torch", "max_batch_size": 8, "cuda_graphs": True}, shared=True) == {
        "max_batch_size": 8, "cuda_graphs": True}


@pytest.mark.parametrize("value", [0, -0.1, 1.5, float("nan"), "0.5", True])
def test_a_memory_fraction_outside_0_1_is_a_one_line_error(fake_vllm, value):
    model, tok = load_lm("tiny-llama")
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be a number in \(0, 1\]") as e:
        VLLMEngine(model, tok, gpu_memory_utilization=value)
    assert "\n" not in str(e.value)
    if isinstance(value, float):
        with pytest.raises(ValueError, match=r"rollout.gpu_memory_utilization: must be in \(0, 1\], got"):
            load_config(PRESET, [f"rollout.gpu_memory_utilization={value}"])


def test_other_bad_options_are_named(fake_vllm):
    model, tok = load_lm("tiny-llama")
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1"):
        VLLMEngine(model, tok, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="sets vLLM's worker_extension_cls itself"):
        VLLMEngine(model, tok, worker_extension_cls="elsewhere.Extension")
    with pytest.raises(ValueError, match=r"rollout.backend: must be one of torch \| vllm, got 'tgi'"):
        load_config(PRESET, ["rollout.backend=tgi"])
    engine = VLLMEngine(model, tok)
    bucket = dict(named_weights(model))
    with pytest.raises(ValueError, match="no weight named 'model.nope.weight'"):
        engine.load_weights([("model.nope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="model.norm.weight has shape"):
        engine.load_weights([("model.norm.weight", bucket["model.norm.weight"][:3])])


def test_the_fake_refuses_what_vllm_cannot_carry_to_its_worker(fake_vllm):
    model, tok = load_lm("tiny-llama")
    llm = VLLMEngine(model, tok).llm
    with pytest.raises(TypeError, match="not serializable"):
        llm.apply_model(lambda m: m.load_weights([]))
    with pytest.raises(TypeError, match="not serializable"):
        llm.collective_rpc(perturbed)  # a module-level function is refused as well
    with pytest.raises(TypeError, match="arrives undecoded"):
        llm.collective_rpc("m2flow_load_weights", args=(torch.zeros(2),))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-gemma"])
def test_weight_sync_goes_by_method_name_and_the_hash_is_the_engines(fake_vllm, name):
    model, tok = load_lm(name)
    engine = VLLMEngine(model, tok)
    llm = engine.llm
    # The checkpoint vLLM read holds the model's weights, and the worker-side hash sees them.
    assert engine.weights_hash() == weights_hash(model)
    new = perturbed(model, 1)
    names = list(new)
    engine.load_weights((n, new[n]) for n in names[:7])  # two buckets, as the actor sends them
    engine.load_weights((n, new[n]) for n in names[7:])
    loads = [call for call in llm.rpc_calls if call[0] == "m2flow_load_weights"]
    assert len(loads) == 2
    for _, args, kwargs in loads:
        assert len(args) == 1 and isinstance(args[0], str) and kwargs == {}
        assert not os.path.exists(args[0])  # the bucket file is gone
    assert {n for batch in llm.model.loaded_calls for n, _ in batch} == set(names)
    assert all(isinstance(n, str) and isinstance(t, torch.Tensor) for batch in llm.model.loaded_calls for n, t in batch)
    assert engine.weights_hash() == weights_hash(new.items()) != weights_hash(model)


def test_a_load_that_does_not_take_shows_in_the_hash(fake_vllm):
    fake_vllm(FaultyLLM)
    model, tok = load_lm("tiny-llama")
    engine = VLLMEngine(model, tok)
    new = perturbed(model, 2)
    engine.load_weights(new.items())  # no error: the engine dropped the up projections silently
    assert engine.weights_hash() not in (weights_hash(new.items()), weights_hash(model))


def test_the_extension_loads_and_hashes_a_vllm_shaped_module(tmp_path):
    hf, _ = load_lm("tiny-qwen2")  # biases in q, k, v; tied head; 259 tokens padded to 320
    state = hf.state_dict()
    vllm_model = FakeVllmModel(state, tied=True)
    worker = WorkerExtension()
    worker.model_runner = types.SimpleNamespace(get_model=lambda: vllm_model)
    path = tmp_path / "bucket.safetensors"
    save_file({n: t.contiguous() for n, t in named_weights(hf)}, str(path))
    assert worker.m2flow_load_weights(str(path)) == len(list(named_weights(hf)))
    layer = vllm_model.get_submodule("model.layers.0")
    q, k, v = (state[f"model.layers.0.self_attn.{p}_proj.bias"] for p in "qkv")
    assert torch.equal(layer.self_attn.qkv_proj.bias, torch.cat([q, k, v]))
    embed = vllm_model.model.embed_tokens.weight
    assert embed.shape[0] == 320 and torch.equal(embed[:259], state["model.embed_tokens.weight"])
    assert not embed[259:].any()
    assert vllm_model.lm_head.weight is embed
    assert [(n, tuple(t.shape)) for n, t in sorted(hf_named_weights(vllm_model))] == \
        [(n, tuple(t.shape)) for n, t in sorted(named_weights(hf))]
    assert worker.m2flow_weights_hash() == weights_hash(hf)
    layer.mlp.gate_up_proj.output_sizes = [128, 64]  # a shard's sizes (tensor parallel): not splittable
    with pytest.raises(RuntimeError, match="is not the fusion of"):
        worker.m2flow_weights_hash()


class FakeChannel:
    def __init__(self):
        self.items = []

    def put(self, item, key, weight=1):
        self.items.append((item, key, weight))

    def flush(self):
        pass


def rollout_worker(shared):
    """An LMRolloutWorker built outside Ray on the fake vLLM; ``shared``: whether the
    placement gives its device to another component too."""
    cfg = OmegaConf.to_container(load_config(PRESET, ["rollout.backend=vllm", "rollout.n=2"]), resolve=True)
    worker = LMRolloutWorker.__new__(LMRolloutWorker)
    worker.rank, worker.device, worker.group = 0, "cpu", "rollout"
    worker.device_turns = lambda take_turns, all_ranks=False: nullcontext()
    LMRolloutWorker.__init__(worker, cfg, take_turns=shared)
    return worker


def sync(worker, tensors, version):
    messages = iter([{"tensors": tensors, "last": True, "version": version}])
    worker.broadcast = lambda obj, src, group: next(messages)
    return worker.pull_weights("actor")


def test_the_rollout_sleeps_only_when_its_device_is_shared(fake_vllm):
    prompts = [{"index": i, "token_ids": [5, 6, 7 + i], "answer": "1"} for i in range(3)]
    alone = rollout_worker(False)
    assert sync(alone, perturbed(load_lm("tiny-llama")[0], 3), 1) == 1
    stats = alone.generate(prompts, FakeChannel(), 1)
    assert stats.groups == 3 and stats.completions == 6
    assert alone.complete(prompts, 0.0) == ["s0"] * 3
    assert alone.engine.llm.calls == []  # a GPU of its own: never asleep
    with pytest.raises(RuntimeError, match="enable_sleep_mode=False"):
        alone.engine.offload()

    shared = rollout_worker(True)
    llm = shared.engine.llm
    assert llm.calls == [("sleep", 1)]  # asleep until its first turn
    new = perturbed(load_lm("tiny-llama")[0], 3)
    sync(shared, new, 1)  # the load wakes the weights alone; after the sync they go back out
    assert llm.calls[1:] == [("wake_up", ["weights"]), ("sleep", 1)] and llm.sleeping == {"weights", "kv_cache"}
    out = FakeChannel()
    stats = shared.generate(prompts, out, 2)
    assert llm.calls[3:] == [("wake_up", None), ("sleep", 1)]  # awake for its turn only
    assert [w for _, _, w in out.items] == [2, 1] and stats.truncated == 6
    batch = out.items[0][0]
    assert batch.extras["version"] == 1 and batch.old_logprobs[0, 3:5].tolist() == [-0.25, -0.5]
    assert shared.complete(prompts, 0.0) == ["s0"] * 3
    assert llm.calls[5:] == [("wake_up", None), ("sleep", 1)]
    assert shared.weights_hash() == weights_hash(new.items())  # wakes the weights to read them
    assert llm.calls[7:] == [("wake_up", ["weights"])]
    seeds = [p.seed for p in llm.llm_engine.params]
    assert len(set(seeds)) == len(seeds)  # one seed per prompt, n apart


def test_turns_are_requests_of_their_own_the_trajectory_so_far_their_prompt(fake_vllm):
    """Multi-turn: each sample a request per turn (n=1, its own seed per turn); a turn's end asks
    the hook, whose answer is appended (mask False, log-prob 0) and the next turn's request is
    the whole trajectory so far; a sample with no answer is done; the bounds hold."""
    from concurrent.futures import Future

    from m2flow.engines import SamplingParams

    model, tok = load_lm("tiny-llama")
    engine = build_engine("vllm", model, tok)
    asked = []

    def hook(end):
        asked.append(end)
        if end.turns == 2 or end.sample_index == 1:
            return None
        answer = Future()
        answer.set_result([7, 8])
        return answer

    params = SamplingParams(n=2, max_new_tokens=5, seed=4, max_total_tokens=40)
    groups = list(engine.generate([[10, 11], [20]], params, turn_ended=hook))
    out = {(c.prompt_index, c.sample_index): c for g in groups for c in g}
    assert sorted(out) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # the fake's turn is [last context token, 3]: sample 0 took two turns, sample 1 one
    assert out[0, 0].token_ids == [11, 3, 7, 8, 8, 3] and out[0, 0].turns == 2
    assert out[0, 0].mask == [True, True, False, False, True, True]
    assert out[0, 0].logprobs.tolist() == [-0.25, -0.5, 0.0, 0.0, -0.25, -0.5]
    assert out[0, 1].token_ids == [11, 3] and out[0, 1].mask is None and out[0, 1].turns == 1
    sent = engine.llm.llm_engine.params
    assert all(p.n == 1 for p in sent) and len(sent) == 6  # 4 samples' first turns, 2 second turns
    assert len({p.seed for p in sent}) == 6  # a seed per sample and turn
    assert [e.turn_ids for e in asked if e.turns == 2] == [[8, 3], [8, 3]]
    # a bound: the answer would not fit, the sample ends at "length" without it
    (group,) = engine.generate([[10, 11]], SamplingParams(n=1, max_new_tokens=5, max_total_tokens=6), turn_ended=hook)
    assert group[0].token_ids == [11, 3] and group[0].finish_reason == "length" and group[0].mask is None
