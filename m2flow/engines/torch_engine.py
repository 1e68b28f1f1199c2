"""TorchEngine: continuous-batching generation with any transformers causal LM, on CPU or GPU.

How it works. The engine keeps ``max_batch_size`` slots. A slot holds one sequence's keys and
values in a preallocated buffer row (``SlotKVCache``), at columns 0..length-1, so rows of
different lengths sit side by side, right-ragged, and each decode step writes every row's new
token at that row's own column, in place. When a sequence finishes, its slot is refilled at
once with the next waiting sequence (or, when none waits, the last row moves into the hole, so
the batch stays dense and finished rows cost nothing). A prompt is prefilled once, whatever
``n``: its KV is copied into each of its samples' slots, and their first tokens are sampled
from the same last-position logits. Every forward gets explicit per-row position ids and a 4D
additive mask, so padding never shifts a position and log-probs equal a plain forward's.
A ``between`` hook runs before each forward (e.g. loading newer weights: the sequences in
flight keep their KV cache, and each token records the ``version`` of the weights that
sampled it). A ``more`` hook, asked whenever a slot is free and no prompt waits, adds prompts
to a call in progress: the generator then never drains between batches of prompts, and a
caller may stop iterating once the groups it wants are out and resume it later, the other
sequences still in their slots.

Why this and not the alternatives (SmolLM2-135M fp32, 2 CPU threads, 32 sequences in flight;
figures from benchmarks/rollout_engine.py and a side run of ``generate_batch``):
- ``model.generate()`` runs a batch until its longest row ends, re-concatenates the whole
  ``DynamicCache`` at every step (a copy of all keys and values per token) and prefills each
  prompt n times: this loop generates about 1.8x its tokens/s (16 prompts x 8 samples, up to
  128 tokens).
- transformers' own continuous batching (``generate_batch``, paged attention) works on CPU,
  but reports log-probs of the top-k/top-p processed distribution (as ``log(prob)``), has no
  stop strings, runs in a background thread, and gave 95-110 tokens/s on 8 prompts x 8
  samples, less than half of this loop's rate.
- A ``DynamicCache`` refilled by left-padding and concatenation copies the whole cache at
  every refill, which with completions of mixed lengths is every few steps.
A decode step is then mostly the model's own matmuls (about 60%); attention over the KV cache,
sampling and bookkeeping share the rest.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicCache

from m2flow.engines.decode_graphs import DecodeGraphs
from m2flow.engines.generation import Completion, GenerationEngine, SamplingParams, validate_prompts
from m2flow.engines.scoring import kv_cache_of, with_kv_cache
from m2flow.engines.weights import weights_hash


class SlotKVCache(Cache):
    """Keys and values of up to ``slots`` sequences, one preallocated row per slot; a sequence
    of length L occupies columns 0..L-1 of its row. Before a decode forward, ``begin_step``
    says how many rows take part and where each writes its new token; the model's attention
    layers then call ``update``, which writes in place and returns views (no copies)."""

    def __init__(self, slots: int, capacity: int):
        super().__init__(layers=[])
        self.slots, self.capacity = slots, capacity
        self.key_rows: list[torch.Tensor] = []    # per layer [slots, kv_heads, capacity, head_dim]
        self.value_rows: list[torch.Tensor] = []
        self.rows, self.width = 0, 0
        self.row_index = self.write_at = None

    def put(self, slot: int, layer_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Writes a prompt's per-layer (keys, values), each [kv_heads, length, head_dim], into a
        slot; the first write sizes the buffers from them."""
        if not self.key_rows:  # zeros, not empty: masked columns must still be finite (0 * NaN = NaN)
            for k, v in layer_kv:
                self.key_rows.append(k.new_zeros(self.slots, k.shape[0], self.capacity, k.shape[2]))
                self.value_rows.append(v.new_zeros(self.slots, v.shape[0], self.capacity, v.shape[2]))
        for (k, v), key_row, value_row in zip(layer_kv, self.key_rows, self.value_rows):
            key_row[slot, :, :k.shape[1]] = k
            value_row[slot, :, :v.shape[1]] = v

    def grow(self, capacity: int) -> None:
        """Makes room for sequences up to ``capacity`` tokens, keeping what every row holds
        (a longer prompt joining sequences in flight)."""
        if capacity <= self.capacity:
            return
        for rows in (self.key_rows, self.value_rows):
            for i, old in enumerate(rows):
                rows[i] = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
                rows[i][:, :, :self.capacity] = old
        self.capacity = capacity

    def move(self, src: int, dst: int, length: int) -> None:
        for buffer in (*self.key_rows, *self.value_rows):
            buffer[dst, :, :length] = buffer[src, :, :length]

    def begin_step(self, lengths: torch.Tensor, width: int) -> None:
        """The next forward feeds one token to each of rows 0..len(lengths)-1, written at column
        lengths[r]; attention then spans columns 0..width-1 (the mask hides each row's tail)."""
        self.rows, self.width = len(lengths), width
        self.row_index, self.write_at = torch.arange(len(lengths), device=lengths.device), lengths

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = self.key_rows[layer_idx], self.value_rows[layer_idx]
        keys[self.row_index, :, self.write_at] = key_states[:, :, 0]
        values[self.row_index, :, self.write_at] = value_states[:, :, 0]
        return keys[:self.rows, :, :self.width], values[:self.rows, :, :self.width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width


@dataclass
class _Sequence:
    prompt_index: int
    sample_index: int
    prompt_length: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class _PrefilledPrompt:
    layer_kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [kv_heads, prompt_length, head_dim]
    logits: torch.Tensor                               # [vocab] at the last prompt token, float32
    version: int                                       # of the weights that made the logits
    admitted: int = 0                                  # samples that have taken a slot so far


def sample_tokens(logits: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens for a [rows, vocab] float32 batch of logits, and their log-probs under the
    full temperature-scaled distribution (top-k/top-p only narrow what can be drawn)."""
    if params.greedy:
        tokens = logits.argmax(-1)
        logprobs = torch.log_softmax(logits, -1)
    else:
        scaled = logits / params.temperature
        logprobs = torch.log_softmax(scaled, -1)
        if params.top_k and params.top_k < scaled.shape[-1]:
            kth = scaled.topk(params.top_k, -1).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if params.top_p < 1:
            sorted_logits, order = scaled.sort(-1, descending=True)
            sorted_probs = sorted_logits.softmax(-1)
            drop_sorted = sorted_probs.cumsum(-1) - sorted_probs > params.top_p  # mass above it already enough
            scaled = scaled.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
        tokens = draw(scaled.softmax(-1), generator)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of [rows, vocab] probabilities, by inverting the cumulative
    distribution: on CPU, torch.multinomial took a quarter of a SmolLM2 decode step at 32 rows
    (a 49k vocabulary), this takes a few percent. Float64 keeps the cumulative sums exact
    enough; ``right=True`` never lands on a zero-probability token."""
    cdf = probs.double().cumsum(-1)
    u = torch.rand(len(probs), 1, generator=generator, dtype=torch.float64, device=probs.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


class TorchEngine(GenerationEngine):
    """Continuous batching over a transformers causal LM (see the module docstring).

    ``max_batch_size``: sequences decoded together; ``max_prefill_tokens``: padded prompt
    tokens per prefill forward (bounds its memory); ``cuda_graphs``: decode steps at fixed
    shapes, replayed as CUDA graphs on a GPU and run eagerly elsewhere
    (``m2flow.engines.decode_graphs``). ``stats`` counts the last call's work."""

    def __init__(self, model, tokenizer, max_batch_size: int = 32, max_prefill_tokens: int = 4096,
                 cuda_graphs: bool = False):
        if max_batch_size < 1 or max_prefill_tokens < 1:
            raise ValueError(f"max_batch_size and max_prefill_tokens must be >= 1, got {max_batch_size}, "
                             f"{max_prefill_tokens}")
        attn = getattr(model.config, "_attn_implementation", "sdpa")
        if attn not in ("sdpa", "eager"):  # the engine passes its own 4D masks, which these two take as is
            raise ValueError(f"TorchEngine needs attn_implementation 'sdpa' or 'eager', the model uses {attn!r}")
        self.model, self.tokenizer = model, tokenizer
        self.max_batch_size, self.max_prefill_tokens = max_batch_size, max_prefill_tokens
        eos = model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.eos_ids = set(eos) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.cache: SlotKVCache | None = None
        self.cuda_graphs = cuda_graphs
        self.graphs: DecodeGraphs | None = None  # of the current cache, on the current weights' memory
        self.offloaded, self.offloaded_from = False, None  # offloaded_from: the device the weights left
        self.stats: dict[str, int] = {}
        self.version = 0  # of the weights: set by load_weights, recorded with every token sampled

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- the GenerationEngine contract -------------------------------------------------

    takes_more = True

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 between: Callable[[], None] | None = None,
                 more: Callable[[], Sequence[Sequence[int]]] | None = None) -> Iterator[list[Completion]]:
        """``more`` (this engine's own): called whenever a slot is free and no prompt waits, it
        returns prompts to add (none: nothing to add now); they are numbered on from the last
        (``Completion.prompt_index``). The generator ends once nothing is in flight or waiting
        and ``more`` adds nothing."""
        if self.offloaded:
            raise RuntimeError("the engine is offloaded: call onload() before generate()")
        checked = validate_prompts(prompts, self.model.config.vocab_size, self.max_positions)
        return self._generate(checked, params, between, more)  # validated now, not at the first next()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        state = self.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in state:
                    raise ValueError(f"load_weights: the model has no weight named {name!r}")
                if state[name].shape != tensor.shape:
                    raise ValueError(f"load_weights: {name} has shape {tuple(state[name].shape)}, "
                                     f"got {tuple(tensor.shape)}")
                state[name].copy_(tensor)  # in place: tied weights stay tied
        if version is not None:
            self.version = version

    def weights_hash(self) -> str:
        return weights_hash(self.model)

    def offload(self) -> None:
        self.cache, self.graphs, self.offloaded = None, None, True  # the graphs would hold the memory
        if self.offloaded_from is None and self.device.type != "cpu":
            self.offloaded_from = self.device
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def onload(self) -> None:
        self.offloaded = False
        if self.offloaded_from is not None:
            self.model.to(self.offloaded_from)
            self.offloaded_from = None

    # -- the loop -------------------------------------------------------------------------

    def _capacity(self, prompts: list[list[int]], params: SamplingParams) -> int:
        capacity = max(map(len, prompts)) + params.max_new_tokens
        return min(capacity, self.max_positions) if self.max_positions else capacity

    @torch.inference_mode()  # torch re-enters it around each resumption, so callers never run in it
    def _generate(self, prompts: list[list[int]], params: SamplingParams, between: Callable[[], None] | None,
                  more: Callable[[], Sequence[Sequence[int]]] | None) -> Iterator[list[Completion]]:
        device = self.device
        generator = torch.Generator(device=device)
        generator.manual_seed(params.seed if params.seed is not None else int(torch.randint(2**62, ()).item()))
        self.stats = {"prefill_forwards": 0, "prefill_tokens": 0, "decode_steps": 0, "decoded_rows": 0, "refills": 0,
                      "graph_replays": 0, "graph_captures": 0}
        if not prompts and more is None:
            return
        prompts = list(prompts)  # ``more`` adds to it
        capacity = self._capacity(prompts, params) if prompts else 1
        if self.cache is None or self.cache.capacity < capacity or self.cache.slots != self.max_batch_size:
            self.cache = SlotKVCache(self.max_batch_size, capacity)  # else reuse the buffers of the last call
            self.graphs = None  # captured over the buffers just dropped
        waiting = deque((p, s) for p in range(len(prompts)) for s in range(params.n))
        prefilled: dict[int, _PrefilledPrompt] = {}
        rows: list[_Sequence | None] = []  # row r of the decode batch is slot r
        lengths: list[int] = []            # tokens in each slot's KV
        groups: dict[int, list[Completion]] = {}

        while True:
            if more is None and not (waiting or rows):
                return
            if between is not None:  # e.g. new weights: the sequences in flight keep their KV cache
                between()
            if more is not None and not waiting and (None in rows or len(rows) < self.max_batch_size):
                added = validate_prompts(more(), self.model.config.vocab_size, self.max_positions)
                if added:
                    if self.cache.capacity < (capacity := self._capacity(added, params)):
                        self.cache.grow(capacity)
                        self.graphs = None  # captured over the buffers just replaced
                    waiting.extend((p, s) for p in range(len(prompts), len(prompts) + len(added))
                                   for s in range(params.n))
                    prompts.extend(added)
            if not (waiting or rows):
                return
            # Fill every free slot, holes first; sequences done at their first token never take one.
            while waiting and (free := rows.count(None) + self.max_batch_size - len(rows)):
                take = [waiting.popleft() for _ in range(min(len(waiting), free))]
                self._prefill([p for p in dict.fromkeys(p for p, _ in take) if p not in prefilled], prompts, prefilled)
                tokens, logprobs = sample_tokens(torch.stack([prefilled[p].logits for p, _ in take]), params, generator)
                for (p, s), token, logprob in zip(take, tokens.tolist(), logprobs.tolist()):
                    seq, entry = _Sequence(p, s, len(prompts[p])), prefilled[p]
                    entry.admitted += 1
                    # sampled from the prefill's logits: a later sample of the prompt may take
                    # a slot after new weights came in, its first token still the old ones'
                    if not self._append(seq, token, logprob, params, entry.version):
                        slot = rows.index(None) if None in rows else len(rows)
                        if slot == len(rows):
                            rows.append(None), lengths.append(0)
                        self.cache.put(slot, entry.layer_kv)
                        rows[slot], lengths[slot] = seq, seq.prompt_length
                        if self.stats["decode_steps"]:  # joins rows already mid-generation
                            self.stats["refills"] += 1
                    if entry.admitted == params.n:
                        del prefilled[p]
                    if seq.finish_reason:
                        yield from self._collect(seq, groups, params)
            # Close the remaining holes by moving the last rows into them.
            while None in rows:
                if rows[-1] is None:
                    rows.pop(), lengths.pop()
                    continue
                hole = rows.index(None)
                self.cache.move(len(rows) - 1, hole, lengths[-1])
                rows[hole], lengths[hole] = rows.pop(), lengths.pop()
            if not rows:
                continue

            logits = self._decode([seq.tokens[-1] for seq in rows], lengths)
            tokens, logprobs = sample_tokens(logits, params, generator)
            for r, (token, logprob) in enumerate(zip(tokens.tolist(), logprobs.tolist())):
                lengths[r] += 1
                if self._append(rows[r], token, logprob, params):
                    yield from self._collect(rows[r], groups, params)
                    rows[r] = None

    def _prefill(self, wanted: list[int], prompts: list[list[int]], prefilled: dict[int, _PrefilledPrompt]) -> None:
        """One forward per chunk of prompts, left-padded so that every row's last token is the
        batch's last position. Each padding query attends only to itself: no row of the mask
        is empty (an empty row gives NaN, which would leak into the real rows through 0 * NaN)."""
        device = self.device
        for chunk in self._prefill_chunks(wanted, prompts):
            width = max(len(prompts[p]) for p in chunk)
            pad = torch.tensor([width - len(prompts[p]) for p in chunk], device=device)
            input_ids = torch.tensor([[0] * (width - len(prompts[p])) + prompts[p] for p in chunk], device=device)
            columns = torch.arange(width, device=device)
            positions = (columns[None, :] - pad[:, None]).clamp(min=0)
            query, key = columns[:, None], columns[None, :]
            allowed = (key <= query) & ((key >= pad[:, None, None]) | (key == query))
            out = self.model(input_ids=input_ids, position_ids=positions, attention_mask=self._additive(allowed),
                             **with_kv_cache(self.model, DynamicCache()), use_cache=True, logits_to_keep=1)
            layer_kv = [(layer.keys, layer.values) for layer in kv_cache_of(out).layers]
            for i, p in enumerate(chunk):
                kv = [(k[i, :, width - len(prompts[p]):], v[i, :, width - len(prompts[p]):]) for k, v in layer_kv]
                prefilled[p] = _PrefilledPrompt(kv, out.logits[i, -1].float(), self.version)
            self.stats["prefill_forwards"] += 1
            self.stats["prefill_tokens"] += len(chunk) * width

    def _prefill_chunks(self, wanted: list[int], prompts: list[list[int]]) -> Iterator[list[int]]:
        """Consecutive prompts, as many per forward as fit in max_prefill_tokens once padded."""
        chunk: list[int] = []
        for p in wanted:
            if chunk and (len(chunk) + 1) * max(len(prompts[q]) for q in (*chunk, p)) > self.max_prefill_tokens:
                yield chunk
                chunk = []
            chunk.append(p)
        if chunk:
            yield chunk

    def _decode(self, last_tokens: list[int], lengths: list[int]) -> torch.Tensor:
        """One token for every row: row r feeds its last token at position lengths[r] and
        attends to its own columns 0..lengths[r]."""
        self.stats["decode_steps"] += 1
        self.stats["decoded_rows"] += len(lengths)
        if self.cuda_graphs:
            return self._decode_fixed(last_tokens, lengths)
        device = self.device
        length = torch.tensor(lengths, device=device)
        width = max(lengths) + 1
        self.cache.begin_step(length, width)
        allowed = torch.arange(width, device=device)[None, :] <= length[:, None]
        out = self.model(input_ids=torch.tensor(last_tokens, device=device)[:, None], position_ids=length[:, None],
                         attention_mask=self._additive(allowed[:, None, :]), **with_kv_cache(self.model, self.cache),
                         use_cache=True)
        return out.logits[:, -1].float()

    def _decode_fixed(self, last_tokens: list[int], lengths: list[int]) -> torch.Tensor:
        """``_decode`` at fixed shapes: replayed CUDA graphs on a GPU, eager elsewhere. The KV
        buffers are sized at the first prompt's put, so the graphs are made at the first decode."""
        if self.graphs is None:
            self.graphs = DecodeGraphs(self.model, self.cache, capture=self.device.type == "cuda")
        replays, captures = self.graphs.replays, self.graphs.captures
        logits = self.graphs(last_tokens, lengths)
        self.stats["graph_replays"] += self.graphs.replays - replays
        self.stats["graph_captures"] += self.graphs.captures - captures
        return logits

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """[rows, q, k] bool -> the [rows, 1, q, k] additive mask that both sdpa and eager take."""
        dtype = self.model.dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
            ~allowed, torch.finfo(dtype).min)[:, None]

    def _append(self, seq: _Sequence, token: int, logprob: float, params: SamplingParams,
                version: int | None = None) -> bool:
        """Adds a token, sampled by the weights of ``version`` (None: the current ones); True
        (and a finish_reason) when the sequence is done."""
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        seq.versions.append(self.version if version is None else version)
        if token in self.eos_ids or (params.stop and self._ends_with_stop(seq.tokens, params.stop)):
            seq.finish_reason = "stop"
        elif len(seq.tokens) >= params.max_new_tokens or (
                self.max_positions and seq.prompt_length + len(seq.tokens) >= self.max_positions):
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def _ends_with_stop(self, tokens: list[int], stop: tuple[str, ...]) -> bool:
        """Decodes only a tail long enough to hold any stop string (a token is at least one
        byte) plus two tokens of context, so a check costs the same at any length. A stop
        string completed earlier would have stopped the sequence then."""
        window = max(len(s.encode()) for s in stop) + 2
        text = self.tokenizer.decode(tokens[-window:], skip_special_tokens=False)
        return any(s in text for s in stop)

    def _collect(self, seq: _Sequence, groups: dict[int, list[Completion]], params: SamplingParams):
        group = groups.setdefault(seq.prompt_index, [])
        group.append(Completion(seq.prompt_index, seq.sample_index, seq.tokens,
                                torch.tensor(seq.logprobs, dtype=torch.float32), seq.finish_reason,
                                self.tokenizer.decode(seq.tokens, skip_special_tokens=True), seq.versions))
        if len(group) == params.n:
            del groups[seq.prompt_index]
            yield sorted(group, key=lambda c: c.sample_index)
