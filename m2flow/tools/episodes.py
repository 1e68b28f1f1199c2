"""Tool use over several turns: the generation engine's ``turn_ended`` hook.

When a sequence's turn is over, ``ToolTurns`` reads the turn's calls; if there are none (the
model answered), the turn was cut by its token budget, or the trajectory has had its
``max_turns``, the trajectory is done. Otherwise the calls run (on the trajectory's own
toolbox, in parallel, off the engine's thread) and the engine is answered with the tokens
that follow the turn: the chat template's end of the assistant turn, the results as ``tool``
messages and the prompt of the model's next turn, so that a trajectory's tokens are those
``apply_chat_template`` gives its conversation. Each trajectory's calls, results and the
reason it ended are kept in an ``Episode``, taken once the trajectory is out.

Bounds, and what happens at them: a result longer than ``max_response_tokens`` is cut to it
(and marked, ``ToolResult.cut``); results that would cross the trajectory's total bound are
not appended, and the trajectory ends there, its ``finish_reason`` "length" (the engine's
policy, ``TurnEnd.room``)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from m2flow.tools.base import ToolCall, ToolResult
from m2flow.tools.calls import parse_calls, render_results
from m2flow.tools.run import Toolbox, cut_result

# why a trajectory ended
ANSWERED, MAX_TURNS, TURN_CUT, NO_ROOM = "answered", "max_turns", "turn_cut", "no_room"


@dataclasses.dataclass
class Episode:
    """One trajectory's tool use: the calls of each turn that made some, their results, and
    why the trajectory ended (None while it goes on; ``NO_ROOM``: its last results would have
    crossed the total bound), and ``waited_s``: the seconds it spent out of the batch, from the
    end of each turn that made calls until the tokens of their results were ready."""

    calls: list[list[ToolCall | ToolResult]] = dataclasses.field(default_factory=list)
    results: list[list[ToolResult]] = dataclasses.field(default_factory=list)
    ended: str | None = None
    waited_s: float = 0.0
    toolbox: Toolbox | None = dataclasses.field(default=None, repr=False)

    @property
    def errors(self) -> Counter[str]:
        return Counter(r.error for turn in self.results for r in turn if r.error is not None)

    @property
    def tool_calls(self) -> int:
        return sum(map(len, self.calls))


def turn_separator(tokenizer: Any) -> tuple[str, str]:
    """``(end, after)``: the text the chat template puts at the end of an assistant turn (its
    end-of-turn token, e.g. ``<|im_end|>``) and after it, before the next message (e.g. a
    newline). A turn the model ended with its end-of-turn token needs only ``after``."""
    end = tokenizer.eos_token or ""
    marker = "\x00m2flow-turn\x00"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "?"},
                                              {"role": "assistant", "content": marker}], tokenize=False)
    except Exception:  # noqa: BLE001 - no chat template: ChatML's
        return end, "\n"
    tail = text[text.index(marker) + len(marker):]
    if end and tail.startswith(end):
        return end, tail[len(end):]
    return "", tail


class ToolTurns:
    """The ``turn_ended`` hook of a generate call whose sequences use ``toolbox``'s tools
    (each trajectory a copy of it: stateful tools start fresh). ``run``: where a turn's
    calls run, ``run(key, calls) -> Future[list[ToolResult]]``, ``key`` the trajectory's
    (prompt index, sample index), and ``forget(key)`` once the trajectory is out (the tool
    workers keep each trajectory's state); default: this process's threads, ``threads`` of
    them. Results are cut to ``max_response_tokens`` by ``tokenizer`` here, wherever they ran.
    ``eos_ids``: the tokens that end a turn."""

    def __init__(self, toolbox: Toolbox, tokenizer: Any, eos_ids: set[int], *, max_turns: int = 4,
                 max_calls: int = 8, timeout: float = 30.0, max_response_tokens: int = 512, threads: int = 8,
                 run: Callable[[tuple[int, int], list], Future] | None = None,
                 forget: Callable[[tuple[int, int]], object] | None = None):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.toolbox, self.tokenizer, self.eos_ids = toolbox, tokenizer, set(eos_ids)
        self.max_turns, self.max_calls, self.timeout = max_turns, max_calls, timeout
        self.max_response_tokens = max_response_tokens
        self.end, self.after = turn_separator(tokenizer)
        self.pool = None if run is not None else ThreadPoolExecutor(threads, thread_name_prefix="tool-turn")
        self.run_calls = run or self._run_here
        self.forget = forget
        self.episodes: dict[tuple[int, int], Episode] = {}
        self.lock = threading.Lock()

    def __call__(self, end) -> Future | None:
        """``end``: the engine's ``TurnEnd``. None when the trajectory is done, else the future
        of the tokens that follow the turn."""
        key = (end.prompt_index, end.sample_index)
        with self.lock:
            episode = self.episodes.setdefault(key, Episode())
        turn = end.turn_ids
        ended_by_eos = bool(turn) and turn[-1] in self.eos_ids
        text = self.tokenizer.decode(turn[:-1] if ended_by_eos else turn, skip_special_tokens=False)
        calls = parse_calls(text, self.tokenizer)
        if not calls:
            episode.ended = ANSWERED
        elif end.finish_reason == "length":
            episode.ended = TURN_CUT  # a turn cut mid-way: its calls may be cut too
        elif end.turns >= self.max_turns:
            episode.ended = MAX_TURNS
        if episode.ended:
            return None
        if episode.toolbox is None and self.pool is not None:
            episode.toolbox = self.toolbox.copy()
        episode.calls.append(calls)
        head = self.after if ended_by_eos else self.end + self.after
        answer: Future = Future()
        asked = time.monotonic()

        def answered(results: Future) -> None:
            try:
                done = [cut_result(r, self.max_response_tokens, self.tokenizer) for r in results.result()]
                episode.results.append(done)
                tokens = self.tokenizer.encode(head + render_results(done, self.tokenizer), add_special_tokens=False)
                if len(tokens) >= end.room:
                    episode.ended = NO_ROOM
                episode.waited_s += time.monotonic() - asked
                answer.set_result(tokens)
            except BaseException as e:  # noqa: BLE001 - the engine raises it
                answer.set_exception(e)

        self.run_calls(key, calls).add_done_callback(answered)
        return answer

    def _run_here(self, key: tuple[int, int], calls: list) -> Future:
        return self.pool.submit(self.episodes[key].toolbox.run, calls, timeout=self.timeout, max_calls=self.max_calls,
                                max_response_tokens=self.max_response_tokens, tokenizer=self.tokenizer)

    def take(self, prompt_index: int, sample_index: int) -> Episode:
        """The episode of a trajectory that is out, forgotten here. One the hook never saw end
        (the engine ends a trajectory at its total bound without asking) ended ``NO_ROOM``."""
        with self.lock:
            episode = self.episodes.pop((prompt_index, sample_index), None) or Episode()
        if self.forget is not None and episode.calls:
            self.forget((prompt_index, sample_index))
        episode.toolbox, episode.ended = None, episode.ended or NO_ROOM
        return episode

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
