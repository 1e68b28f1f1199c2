"""What the reasoning components share: loading the model a config names, memory readings,
the marker that ends a step's stream, and reading a stream up to it; context switches as
trace spans."""

from __future__ import annotations

import resource
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from m2flow.runtime.trace import get_tracer

if TYPE_CHECKING:
    from m2flow.runtime import Channel, Clock

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
END = "end-of-step"  # sent down a channel after a step's last batch


def until_end(channel: Channel, key: int, clock: Clock) -> Iterator[Any]:
    """The items of a step's stream under ``key``, up to its end marker; the waits for them
    are ``clock``'s idle time."""
    while True:
        with clock.idle():
            item = channel.get(key)
        if item == END:
            return
        yield item


def dtype_of(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: one of {sorted(DTYPES)}")
    return DTYPES[name]


def logprob_temperature(cfg: dict) -> float:
    """The temperature the trainers and the inference worker take log-probs at: the
    rollout's, or 1 for greedy sampling (whose log-probs are reported at T=1)."""
    return cfg["rollout"]["temperature"] or 1.0


def load_model(cfg: dict, device: str, dtype: str | None = None) -> tuple[torch.nn.Module, object]:
    """``(model, tokenizer)`` of ``model.path`` on ``device``: every component loads the same
    initial weights (tiny models from the run's seed), in ``model.dtype``; ``dtype`` (e.g.
    ``rollout.dtype``), when given, then casts them: the same weights, rounded."""
    from m2flow.models.lm import load_lm

    m = cfg["model"]
    model, tokenizer = load_lm(m["path"], dtype=dtype_of(m["dtype"]), seed=cfg["seed"])
    return model.to(device=device, dtype=dtype_of(dtype)), tokenizer


def memory_mb(device: str) -> float:
    """Peak memory of this process: CUDA's max allocated on a GPU, else peak RSS."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def switch(move: Callable[[], Any], when: bool = True) -> Any:
    """``move`` (a trainer's ``onload_optimizer`` / ``offload_optimizer``) as a "switch" span
    of the trace: the cost of a context switch, drawn in the run's timeline. Not made unless
    ``when`` (a worker that moves nothing between turns)."""
    if not when:
        return None
    with get_tracer().span(move.__name__, cat="switch"):
        return move()
