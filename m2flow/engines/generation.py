"""The LM rollout engine's interface: sampling settings, completions, and the engine contract
that every backend (``TorchEngine``, ``VLLMEngine``) implements."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1                   # samples per prompt
    temperature: float = 1.0     # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0               # 0 = off
    max_new_tokens: int = 64     # per turn, where a call takes turns (``turn_ended``)
    stop: tuple[str, ...] = ()   # stop strings (besides EOS)
    seed: int | None = None      # None: drawn from torch's global RNG, so torch.manual_seed governs it
    max_total_tokens: int | None = None  # prompt and every turn together (None: the model's context)

    def __post_init__(self):
        if isinstance(self.stop, str):  # a bare string would be read as a tuple of characters
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        checks = [(self.n >= 1, f"n must be >= 1, got {self.n}"),
                  (math.isfinite(self.temperature) and self.temperature >= 0,
                   f"temperature must be finite and >= 0, got {self.temperature}"),
                  (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
                  (self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}"),
                  (self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}"),
                  (self.max_total_tokens is None or self.max_total_tokens >= 2,
                   f"max_total_tokens must be >= 2, got {self.max_total_tokens}"),
                  (all(isinstance(s, str) and s for s in self.stop),
                   f"stop strings must be non-empty strings, got {self.stop}")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Completion:
    prompt_index: int          # index into the prompts given to generate()
    sample_index: int          # 0..n-1
    token_ids: list[int]       # generated tokens, including the EOS / the token that completed a stop string
    logprobs: torch.Tensor     # [len(token_ids)] float32, on CPU: log_softmax(logits / T) at each token,
                               # T = temperature (1 when greedy), of the full distribution before top-k/top-p
    finish_reason: str         # "stop" (EOS or stop string) | "length"
    text: str                  # decoded token_ids, special tokens skipped; a stop string stays in it
    versions: list[int] | None = None  # the engine's weights version that sampled each token (-1: not sampled)
    mask: list[bool] | None = None     # per token, whether the model sampled it (False: a tool's result
                                       # or a turn's separator); None: every token sampled
    turns: int = 1                     # the model's turns in it

    @property
    def last_turn(self) -> list[int]:
        """The tokens of the model's last turn: after the last token it did not sample."""
        if not self.mask or all(self.mask):
            return self.token_ids
        return self.token_ids[len(self.mask) - self.mask[::-1].index(False):]


@dataclass(frozen=True)
class TurnEnd:
    """A sequence's turn is over (EOS, a stop string or the turn's token budget): what the
    ``turn_ended`` hook of a call that takes turns is told. ``token_ids`` are all the tokens
    after the prompt so far (earlier turns and what was appended to them included), the turn's
    own from ``turn_start``; ``room``: the tokens the sequence may still grow by."""

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    turn_start: int
    finish_reason: str  # of the turn: "stop" or "length"
    turns: int          # the model's turns so far, this one included
    room: int

    @property
    def turn_ids(self) -> list[int]:
        return self.token_ids[self.turn_start:]


def length_limit(params: SamplingParams, max_positions: int | None) -> int | None:
    """The most tokens a sequence may hold, prompt included: ``params.max_total_tokens`` or the
    model's context, the smaller (None: neither is known)."""
    bounds = [b for b in (params.max_total_tokens, max_positions) if b]
    return min(bounds) if bounds else None


def turn_limit(params: SamplingParams, max_positions: int | None) -> int:
    """``length_limit``, which a call that takes turns must have."""
    limit = length_limit(params, max_positions)
    if limit is None:
        raise ValueError("a call that takes turns needs params.max_total_tokens: the model's context length is not "
                         "known")
    return limit


def sequence_seed(seed: int, prompt_index: int, sample_index: int, turn: int = 0) -> int:
    """The seed of one sample's own random stream in a call that takes turns (``turn``: of one
    of its turns, for an engine that seeds each turn's request): the same for the same call
    seed, prompt and sample, whichever other sequences share its steps."""
    return (seed * 1_000_003 + prompt_index * 10_007 + sample_index * 101 + turn) % 2**63


@dataclass
class SampleInFlight:
    """A sample while it is generated, over its turns: the tokens after the prompt so far (the
    model's and its tools'), each one's log-prob (0: not sampled) and weights version (-1: not
    sampled), and, once a tool's answer was appended, whether the model sampled each."""

    prompt_index: int
    sample_index: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # of the last turn, once it is over
    mask: list[bool] | None = None    # made when a turn first appends tokens
    turn_start: int = 0               # where the current turn's tokens begin
    turns: int = 1

    def room(self, limit: int) -> int:
        """The tokens it may still grow by under ``limit`` (prompt and tokens together)."""
        return limit - len(self.prompt) - len(self.tokens)

    def add_sampled(self, tokens: list[int], logprobs: list[float], version: int) -> None:
        self.tokens += tokens
        self.logprobs += logprobs
        self.versions += [version] * len(tokens)
        if self.mask is not None:
            self.mask += [True] * len(tokens)

    def turn_end(self, limit: int) -> TurnEnd:
        return TurnEnd(self.prompt_index, self.sample_index, self.prompt, list(self.tokens), self.turn_start,
                       self.finish_reason, self.turns, self.room(limit))

    def take_answer(self, appended: list[int] | None, limit: int) -> bool:
        """Appends a tool's answer and starts the next turn: True. False when the answer ends
        the sample instead: none (done after all), or more tokens than leave room to sample one
        after them (it ends at "length")."""
        if not appended or len(appended) >= self.room(limit):
            self.finish_reason = "length" if appended else self.finish_reason
            return False
        if self.mask is None:
            self.mask = [True] * len(self.tokens)
        self.tokens += appended
        self.logprobs += [0.0] * len(appended)
        self.versions += [-1] * len(appended)
        self.mask += [False] * len(appended)
        self.turn_start, self.turns, self.finish_reason = len(self.tokens), self.turns + 1, None
        return True

    def completion(self, text: str, with_versions: bool = True) -> Completion:
        return Completion(self.prompt_index, self.sample_index, self.tokens,
                          torch.tensor(self.logprobs, dtype=torch.float32), self.finish_reason, text,
                          self.versions if with_versions else None, self.mask, self.turns)


class GenerationEngine(ABC):
    """Generates groups of completions from a causal LM whose weights the actor updates.
    One ``generate`` call runs at a time per engine.

    ``takes_more``: whether ``generate`` also takes ``more``, a hook that adds prompts to a
    call in progress (the torch engine's); ``takes_turns``: whether it takes ``turn_ended``
    (multi-turn generation: see ``generate``)."""

    takes_more = False
    takes_turns = False

    @abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 between: Callable[[], None] | None = None) -> Iterator[list[Completion]]:
        """Yields each prompt's group of n completions (sorted by sample_index) the moment the
        whole group is done. ``between`` runs before each forward: it may load newer weights,
        which the sequences in flight continue with (their cached keys and values stay).

        An engine that ``takes_turns`` also takes ``turn_ended``: called with a ``TurnEnd``
        whenever a sequence's turn is over, it returns None (the sequence is done) or a
        ``concurrent.futures.Future`` of the token ids to append (a tool's results and the
        next turn's prompt; None: done after all); meanwhile the sequence waits outside the
        batch, and the other sequences go on. Each sequence then samples from a random
        stream of its own (from ``params.seed``, its prompt and sample index), so that what
        it samples does not depend on when its tools answer."""

    @abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """Copies weights in place; names as in ``model.named_parameters()`` / ``model.state_dict()``.
        ``version``: the weights' version, recorded with each token sampled from then on."""

    @abstractmethod
    def weights_hash(self) -> str:
        """``m2flow.engines.weights.weights_hash`` of the weights the engine generates with,
        under the names of the model's state dict: equal to the actor's exactly when a sync
        took."""

    @abstractmethod
    def offload(self) -> None:
        """Frees the KV cache and moves the weights to CPU (on CPU: frees the caches), so that a
        collocated component can use the device."""

    @abstractmethod
    def onload(self) -> None:
        """Undoes ``offload``."""


def validate_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, max_positions: int | None) -> list[list[int]]:
    """The prompts as lists of ints, or a ValueError naming the first bad one."""
    checked = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {i} is empty: a prompt needs at least one token")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size})")
        if max_positions is not None and len(ids) >= max_positions:
            raise ValueError(f"prompt {i} has {len(ids)} tokens: no room to generate within the model's "
                             f"{max_positions} positions")
        checked.append(ids)
    return checked
