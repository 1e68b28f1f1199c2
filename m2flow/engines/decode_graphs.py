"""Decode steps at fixed shapes, replayed as CUDA graphs (``rollout.cuda_graphs``).

Why. A decode step of a small model on a GPU is bound by launching its kernels one by one
(several per layer, each with Python around it), not by its arithmetic: in the asynchronous GRPO
runs on one H200, SmolLM2-135M generated 165-997 tokens/s at 32 sequences in flight
(docs/benchmarks.md), about what two CPU cores do. A CUDA graph launches the whole forward at
once.

How the shapes are fixed. A graph replays the same kernels on the same memory, so every step
of a bucket must have one shape:
- rows are padded up to the next bucket (1, 2, 4, ... up to the engine's ``max_batch_size``);
  a padding row feeds token 0 at position 0 into a free slot (the engine keeps its live rows
  dense in slots 0..rows-1, and a refill overwrites a free slot before it is read) and attends
  only to that column, so no row of the mask is empty;
- attention spans the KV cache's whole capacity, each row's columns past its length masked;
  the mask is made inside the graph from the positions.
A step then copies in only the rows' last tokens and positions, replays, and reads the logits.

What a graph holds on to: the weights' and the KV buffers' memory. Loading weights copies into
the parameters in place, so the graphs stay valid through an in-flight update; offloading
moves the weights and drops the cache, so the engine drops its graphs then and captures them
again at its next decode (one capture per bucket used: a warm-up forward on a side stream and
the recorded one).

Off a GPU (``capture=False``) the same fixed-shape forward runs eagerly: no faster there (on
two CPU cores it measured about as fast as the variable-shape steps, docs/benchmarks.md), and
what the CPU tests check. Should a capture
fail, the steps go on eagerly at the same shapes, with a warning, and the engine's
``graph_replays`` stay 0.
"""

from __future__ import annotations

import warnings

import torch

from m2flow.engines.scoring import with_kv_cache


def buckets(slots: int) -> list[int]:
    """Batch sizes a graph is captured for: the powers of two below ``slots``, and ``slots``."""
    out, b = [], 1
    while b < slots:
        out.append(b)
        b *= 2
    return out + [slots]


class DecodeGraphs:
    """The decode forward of ``model`` over ``cache`` (a ``SlotKVCache``) at fixed shapes;
    ``capture``: as CUDA graphs (the model must be on a CUDA device); ``one_shape``: every step
    at all the cache's slots (the engine's ``batch_invariant``). ``replays`` and ``captures``
    count the graphs' use."""

    def __init__(self, model, cache, capture: bool, one_shape: bool = False):
        device = next(model.parameters()).device
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, it is on {device}")
        self.model, self.cache, self.capture = model, cache, capture
        slots, capacity = cache.slots, cache.capacity
        self.tokens = torch.zeros(slots, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(slots, 1, dtype=torch.long, device=device)
        self.columns = torch.arange(capacity, device=device)
        self.row_index = torch.arange(slots, device=device)
        self.buckets = [slots] if one_shape else buckets(slots)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None  # one memory pool shared by the buckets' graphs
        self.replays = self.captures = 0

    def __call__(self, last_tokens: list[int], lengths: list[int]) -> torch.Tensor:
        """[rows, vocab] float32 logits: row r feeds ``last_tokens[r]`` at position ``lengths[r]``
        and attends to its own columns 0..lengths[r] (as ``TorchEngine._decode``)."""
        rows = len(lengths)
        b = next(x for x in self.buckets if x >= rows)
        host = torch.zeros(2, b, dtype=torch.long)  # padding rows: token 0 at position 0
        host[0, :rows] = torch.tensor(last_tokens)
        host[1, :rows] = torch.tensor(lengths)
        self.tokens[:b, 0].copy_(host[0])
        self.positions[:b, 0].copy_(host[1])
        if self.capture and b not in self.graphs:
            try:
                self._capture(b)
            except RuntimeError as e:  # the steps go on eagerly, at the same shapes: slower, not wrong
                self.capture, self.graphs, self.pool = False, {}, None
                warnings.warn(f"decode steps run without CUDA graphs: capturing bucket {b} failed: {e}".splitlines()[0],
                              RuntimeWarning, stacklevel=2)
        if not self.capture:
            return self._forward(b)[:rows].float()
        graph, logits = self.graphs[b]
        graph.replay()
        self.replays += 1
        return logits[:rows].to(torch.float32, copy=True)  # the graph's output is overwritten at its next replay

    def _forward(self, b: int) -> torch.Tensor:
        """The step's forward for bucket ``b``, from the static buffers: [b, vocab] logits in
        the model's dtype. Nothing in it reads a value back to the host."""
        cache, dtype = self.cache, self.model.dtype
        cache.rows, cache.width = b, cache.capacity
        cache.row_index, cache.write_at = self.row_index[:b], self.positions[:b, 0]
        positions = self.positions[:b]
        hidden = self.columns[None, :] > positions  # [b, capacity]: past each row's own length
        mask = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(hidden, torch.finfo(dtype).min)
        out = self.model(input_ids=self.tokens[:b], position_ids=positions, attention_mask=mask[:, None, None, :],
                         **with_kv_cache(self.model, cache), use_cache=True)
        return out.logits[:, -1]

    def _capture(self, b: int) -> None:
        """Warm-up on a side stream, then the recorded forward (torch.cuda.graphs' recipe). Both
        compute the current step from the buffers, so what they write into the KV cache is
        what the replay writes."""
        side = torch.cuda.Stream(device=self.tokens.device)
        side.wait_stream(torch.cuda.current_stream(self.tokens.device))
        with torch.cuda.stream(side):
            self._forward(b)
        torch.cuda.current_stream(self.tokens.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread of the worker (a receive, a copy) may use the GPU meanwhile
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = self._forward(b)
        self.pool = graph.pool()
        self.graphs[b] = (graph, logits)
        self.captures += 1
