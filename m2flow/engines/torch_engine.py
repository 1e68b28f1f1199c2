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

Multi-turn (``turn_ended``): a sequence whose turn is over leaves its slot (the slot takes
the next sequence at once) while the hook's future, its tools' answer, is pending; its KV is
copied out ("park") or dropped ("prefill"). When the answer comes, its tokens are appended
(not sampled: mask False, log-prob 0, version -1) and the sequence takes the next free slot
ahead of new prompts, fed the tokens its KV lacks in one forward. The loop waits on the
futures only when nothing else can run. Each such sequence samples from its own generator,
so what it samples does not depend on which sequences share its decode steps.

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
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from m2flow.engines.decode_graphs import DecodeGraphs
from m2flow.engines.kv_slots import SlotKVCache
from m2flow.engines.sampling import sample_tokens
from m2flow.engines.generation import (Completion, GenerationEngine, SampleInFlight, SamplingParams, TurnEnd,
                                      length_limit, sequence_seed, turn_limit, validate_prompts)
from m2flow.engines.scoring import kv_cache_of, with_kv_cache
from m2flow.engines.weights import weights_hash


LayerKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [kv_heads, length, head_dim]
TurnEnded = Callable[[TurnEnd], "Future[list[int] | None] | None"]


@dataclass
class _Sequence(SampleInFlight):
    generator: torch.Generator | None = None  # its own random stream (a call that takes turns)
    parked: LayerKV | None = None             # its KV while its tools run (rollout.resume="park")

    @property
    def prompt_length(self) -> int:
        return len(self.prompt)


@dataclass
class _PrefilledPrompt:
    layer_kv: LayerKV                                  # per layer, [kv_heads, prompt_length, head_dim]
    logits: torch.Tensor                               # [vocab] at the last prompt token, float32
    version: int                                       # of the weights that made the logits
    admitted: int = 0                                  # samples that have taken a slot so far


class TorchEngine(GenerationEngine):
    """Continuous batching over a transformers causal LM (see the module docstring).

    ``max_batch_size``: sequences decoded together; ``max_prefill_tokens``: padded prompt
    tokens per prefill forward (bounds its memory); ``cuda_graphs``: decode steps at fixed
    shapes, replayed as CUDA graphs on a GPU and run eagerly elsewhere
    (``m2flow.engines.decode_graphs``); ``resume``: how a sequence whose tools ran rejoins the
    batch, its KV parked while they ran and only the appended tokens fed ("park"), or its
    whole sequence fed again ("prefill"); ``batch_invariant``: every decode step at one shape
    (all ``max_batch_size`` rows, the whole KV capacity) and every prompt prefilled alone, so
    that a sequence's logits do not depend on which others share its steps, to the last bit
    (at one shape a matmul's row is computed the same whatever the other rows hold; at
    another it may round otherwise), and the model's attention set to run eagerly (sdpa's CPU
    kernel rounds a row differently by its place in the batch): with per-sequence random
    streams, a seeded multi-turn call then samples the same whatever its tools' timing. ``stats`` counts the last call's
    work."""

    def __init__(self, model, tokenizer, max_batch_size: int = 32, max_prefill_tokens: int = 4096,
                 cuda_graphs: bool = False, resume: str = "park", batch_invariant: bool = False):
        if max_batch_size < 1 or max_prefill_tokens < 1:
            raise ValueError(f"max_batch_size and max_prefill_tokens must be >= 1, got {max_batch_size}, "
                             f"{max_prefill_tokens}")
        if resume not in ("park", "prefill"):
            raise ValueError(f"resume must be 'park' or 'prefill', got {resume!r}")
        self.resume = resume
        attn = getattr(model.config, "_attn_implementation", "sdpa")
        if attn not in ("sdpa", "eager"):  # the engine passes its own 4D masks, which these two take as is
            raise ValueError(f"TorchEngine needs attn_implementation 'sdpa' or 'eager', the model uses {attn!r}")
        if batch_invariant and attn == "sdpa":  # sdpa's CPU kernel rounds a row by its place in the batch
            model.set_attn_implementation("eager")
        self.model, self.tokenizer = model, tokenizer
        self.max_batch_size, self.max_prefill_tokens = max_batch_size, max_prefill_tokens
        eos = model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.eos_ids = set(eos) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.cache: SlotKVCache | None = None
        self.cuda_graphs, self.batch_invariant = cuda_graphs, batch_invariant
        self.graphs: DecodeGraphs | None = None  # of the current cache, on the current weights' memory
        self.offloaded, self.offloaded_from = False, None  # offloaded_from: the device the weights left
        self.stats: dict[str, int] = {}
        self.version = 0  # of the weights: set by load_weights, recorded with every token sampled

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- the GenerationEngine contract -------------------------------------------------

    takes_more = True
    takes_turns = True

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 between: Callable[[], None] | None = None,
                 more: Callable[[], Sequence[Sequence[int]]] | None = None,
                 turn_ended: TurnEnded | None = None) -> Iterator[list[Completion]]:
        """``more`` (this engine's own): called whenever a slot is free and no prompt waits, it
        returns prompts to add (none: nothing to add now); they are numbered on from the last
        (``Completion.prompt_index``). The generator ends once nothing is in flight or waiting
        and ``more`` adds nothing. ``turn_ended``: multi-turn generation (``GenerationEngine``);
        a sequence whose tools run keeps its KV parked, or has it made again when it comes
        back (``resume``: "park" or "prefill")."""
        if self.offloaded:
            raise RuntimeError("the engine is offloaded: call onload() before generate()")
        checked = validate_prompts(prompts, self.model.config.vocab_size, self.max_positions)
        if turn_ended is not None:
            turn_limit(params, self.max_positions)  # a bound, or a ValueError now
        return self._generate(checked, params, between, more, turn_ended)  # validated now, not at the first next()

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

    def _limit(self, params: SamplingParams) -> int | None:
        return length_limit(params, self.max_positions)

    @torch.inference_mode()  # torch re-enters it around each resumption, so callers never run in it
    def _generate(self, prompts: list[list[int]], params: SamplingParams, between: Callable[[], None] | None,
                  more: Callable[[], Sequence[Sequence[int]]] | None,
                  turn_ended: TurnEnded | None = None) -> Iterator[list[Completion]]:
        device = self.device
        generator = torch.Generator(device=device)
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, ()).item())
        generator.manual_seed(seed)
        self.stats = {"prefill_forwards": 0, "prefill_tokens": 0, "decode_steps": 0, "decoded_rows": 0, "refills": 0,
                      "graph_replays": 0, "graph_captures": 0, "tool_waits": 0, "extend_forwards": 0,
                      "extend_tokens": 0}
        if not prompts and more is None:
            return
        prompts = list(prompts)  # ``more`` adds to it
        # a sequence that takes turns may grow to the limit: its row holds that much from the start
        capacity = self._limit(params) if turn_ended else self._capacity(prompts, params) if prompts else 1
        if self.cache is None or self.cache.capacity < capacity or self.cache.slots != self.max_batch_size or (
                self.batch_invariant and self.cache.capacity != capacity):  # its steps' shape: the capacity's
            self.cache = SlotKVCache(self.max_batch_size, capacity)  # else reuse the buffers of the last call
            self.graphs = None  # captured over the buffers just dropped
        waiting = deque((p, s) for p in range(len(prompts)) for s in range(params.n))
        prefilled: dict[int, _PrefilledPrompt] = {}
        rows: list[_Sequence | None] = []  # row r of the decode batch is slot r
        lengths: list[int] = []            # tokens in each slot's KV
        groups: dict[int, list[Completion]] = {}
        tools: dict[Future, _Sequence] = {}  # sequences whose tools run
        resumed: deque[_Sequence] = deque()  # their tools answered: back in the batch at the next free slot

        while True:
            if more is None and not (waiting or rows or tools or resumed):
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
            if tools:  # waits only when nothing else can go on (with ``more``, briefly: it may add prompts)
                idle = not (waiting or rows or resumed)
                for seq in self._answered(tools, resumed, params, (None if more is None else 0.05) if idle else 0):
                    yield from self._collect(seq, groups, params)
            if not (waiting or rows or tools or resumed):
                return
            # Fill every free slot, holes first, sequences back from their tools before new prompts;
            # sequences done at their first token never take one.
            while (waiting or resumed) and (free := rows.count(None) + self.max_batch_size - len(rows)):
                if resumed:
                    admitted = [resumed.popleft() for _ in range(min(len(resumed), free))]
                    made = [self._extend(seq) for seq in admitted]
                    versions = [self.version] * len(admitted)
                else:
                    take = [waiting.popleft() for _ in range(min(len(waiting), free))]
                    self._prefill([p for p in dict.fromkeys(p for p, _ in take) if p not in prefilled], prompts,
                                  prefilled)
                    admitted, made, versions = [], [], []
                    for p, s in take:
                        entry = prefilled[p]
                        entry.admitted += 1
                        stream = self._stream(seed, p, s) if turn_ended else None
                        admitted.append(_Sequence(p, s, prompts[p], generator=stream))
                        # sampled from the prefill's logits: a later sample of the prompt may take
                        # a slot after new weights came in, its first token still the old ones'
                        made.append((entry.layer_kv, entry.logits))
                        versions.append(entry.version)
                        if entry.admitted == params.n:
                            del prefilled[p]
                streams = [seq.generator for seq in admitted] if turn_ended else generator
                tokens, logprobs = sample_tokens(torch.stack([logits for _, logits in made]), params, streams)
                for seq, (layer_kv, _), version, token, logprob in zip(admitted, made, versions, tokens.tolist(),
                                                                       logprobs.tolist()):
                    if not self._append(seq, token, logprob, params, version):
                        slot = rows.index(None) if None in rows else len(rows)
                        if slot == len(rows):
                            rows.append(None), lengths.append(0)
                        self.cache.put(slot, layer_kv)
                        rows[slot], lengths[slot] = seq, layer_kv[0][0].shape[1]
                        if self.stats["decode_steps"]:  # joins rows already mid-generation
                            self.stats["refills"] += 1
                    elif self._turn_over(seq, params, turn_ended, tools, layer_kv):
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
            tokens, logprobs = sample_tokens(logits, params, [seq.generator for seq in rows] if turn_ended else generator)
            for r, (token, logprob) in enumerate(zip(tokens.tolist(), logprobs.tolist())):
                lengths[r] += 1
                if self._append(rows[r], token, logprob, params):
                    if self._turn_over(rows[r], params, turn_ended, tools, self._row_kv(r, lengths[r])):
                        yield from self._collect(rows[r], groups, params)
                    rows[r] = None

    # -- multi-turn --------------------------------------------------------------------------

    def _stream(self, seed: int, prompt_index: int, sample_index: int) -> torch.Generator:
        """A sequence's own random stream: the same for the same seed, prompt and sample."""
        stream = torch.Generator(device=self.device)
        stream.manual_seed(sequence_seed(seed, prompt_index, sample_index))
        return stream

    def _row_kv(self, row: int, length: int) -> Callable[[], LayerKV]:
        """A copy of slot ``row``'s KV, columns 0..length-1, made only if asked for."""
        return lambda: [(k[row, :, :length].clone(), v[row, :, :length].clone())
                        for k, v in zip(self.cache.key_rows, self.cache.value_rows)]

    def _turn_over(self, seq: _Sequence, params: SamplingParams, turn_ended: TurnEnded | None,
                   tools: dict[Future, _Sequence], layer_kv: LayerKV | Callable[[], LayerKV]) -> bool:
        """True when the sequence is done; False when its tools run (it waits in ``tools``,
        its KV, ``layer_kv``, parked)."""
        if turn_ended is None:
            return True
        limit = self._limit(params)
        if seq.room(limit) <= 0:
            return True
        answer = turn_ended(seq.turn_end(limit))
        if answer is None:
            return True
        if self.resume == "park":
            seq.parked = layer_kv() if callable(layer_kv) else layer_kv
        tools[answer] = seq
        self.stats["tool_waits"] += 1
        return False

    def _answered(self, tools: dict[Future, _Sequence], resumed: deque[_Sequence], params: SamplingParams,
                  timeout: float | None) -> list[_Sequence]:
        """Takes the answers in (waiting up to ``timeout`` for the first; None: as long as it
        takes): each sequence's tokens appended, it goes to ``resumed``; returns those done (no
        tokens to append, or more than the room left: that ends the sequence, at "length")."""
        done, _ = wait(list(tools), timeout=timeout, return_when=FIRST_COMPLETED)
        finished = []
        for answer in sorted(done, key=lambda f: (tools[f].prompt_index, tools[f].sample_index)):
            seq = tools.pop(answer)
            if seq.take_answer(answer.result(), self._limit(params)):  # a hook's error (a bug) ends the call
                resumed.append(seq)
            else:
                seq.parked = None
                finished.append(seq)
        return finished

    def _extend(self, seq: _Sequence) -> tuple[LayerKV, torch.Tensor]:
        """The KV of a sequence back from its tools, all its tokens fed, and the logits after
        them: only the tokens after its parked KV fed ("park"), or all of them ("prefill")."""
        full = seq.prompt + seq.tokens
        device = self.device
        cache, start = DynamicCache(), 0
        if seq.parked is not None:
            for i, (k, v) in enumerate(seq.parked):
                cache.update(k[None], v[None], i)
            start, seq.parked = seq.parked[0][0].shape[1], None
        query = torch.arange(start, len(full), device=device)
        allowed = torch.arange(len(full), device=device)[None, :] <= query[:, None]
        out = self.model(input_ids=torch.tensor(full[start:], device=device)[None], position_ids=query[None],
                         attention_mask=self._additive(allowed[None]), **with_kv_cache(self.model, cache),
                         use_cache=True, logits_to_keep=1)
        self.stats["extend_forwards"] += 1
        self.stats["extend_tokens"] += len(full) - start
        return [(layer.keys[0], layer.values[0]) for layer in kv_cache_of(out).layers], out.logits[0, -1].float()

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
            if chunk and self.batch_invariant:  # alone: a prompt's KV and logits then never depend on the others'
                yield chunk
                chunk = []
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
        if self.cuda_graphs or self.batch_invariant:
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
            self.graphs = DecodeGraphs(self.model, self.cache, capture=self.cuda_graphs and self.device.type == "cuda",
                                       one_shape=self.batch_invariant)
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
        (and a finish_reason) when the sequence's turn is done."""
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        seq.versions.append(self.version if version is None else version)
        if seq.mask is not None:
            seq.mask.append(True)
        turn = seq.tokens[seq.turn_start:]
        limit = self._limit(params)
        if token in self.eos_ids or (params.stop and self._ends_with_stop(turn, params.stop)):
            seq.finish_reason = "stop"
        elif len(turn) >= params.max_new_tokens or (limit and seq.prompt_length + len(seq.tokens) >= limit):
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
        group.append(seq.completion(self.tokenizer.decode(seq.tokens, skip_special_tokens=True)))
        if len(group) == params.n:
            del groups[seq.prompt_index]
            yield sorted(group, key=lambda c: c.sample_index)
