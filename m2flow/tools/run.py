"""A task's tools, and one turn's calls run on them: in parallel, each under a timeout, every
failure (an unknown tool, arguments that do not fit, an exception, a timeout) turned into an
error observation of a counted kind, and every observation cut to the response limit.

Calls run on threads here: the rollout's own (``episodes.ToolTurns``), or a tool worker's
(``workers.tool``), a process of its own. A
call to a stateful tool waits for the calls before it to the same tool (they share one
trajectory's state, in the order the model wrote them); calls to other tools do not wait. A
function that hangs keeps its (daemon) thread until it returns, its call answered as timed
out: a tool that can hang, such as the python sandbox, stops itself within its own limit."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from m2flow.runtime.trace import get_tracer
from m2flow.tools.base import (RAISED, TIMEOUT, TOO_MANY_CALLS, UNKNOWN_TOOL, Tool, ToolCall, ToolError,
                               ToolResult, error_result, load)
from m2flow.tools.cut import cut


class Toolbox:
    """The tools of one trajectory, by name. ``copy()`` makes the toolbox of another
    trajectory; ``reset()`` starts this one's next."""

    def __init__(self, tools: Iterable[Tool]):
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}")
            self.tools[tool.name] = tool

    @classmethod
    def load(cls, specs: Sequence[str | Mapping[str, Any]]) -> Toolbox:
        """The tools a config names: each an import path or built-in name, or a mapping of
        ``path`` and the options its class is made with."""
        tools = []
        for spec in specs:
            if isinstance(spec, str):
                tools.append(load(spec))
            else:
                options = dict(spec)
                tools.append(load(options.pop("path"), **options))
        return cls(tools)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools' schemas, as ``apply_chat_template(..., tools=)`` takes them."""
        return [tool.schema for tool in self.tools.values()]

    def copy(self) -> Toolbox:
        return Toolbox(tool.copy() for tool in self.tools.values())

    def reset(self) -> None:
        for tool in self.tools.values():
            tool.reset()

    def run(self, calls: Sequence[ToolCall | ToolResult], *, timeout: float = 30.0, max_calls: int = 8,
            max_response_tokens: int = 1024, tokenizer: Any = None) -> list[ToolResult]:
        """The results of one turn's ``calls`` (as ``parse_calls`` gives them: a malformed
        call's error result passes through), in the same order. Past ``max_calls`` a call is
        not run. Each text is cut to ``max_response_tokens`` (by ``tokenizer`` when given)."""
        results: list[ToolResult | None] = [None] * len(calls)
        lanes: dict[Any, list[int]] = {}  # each lane runs on a thread of its own, its calls in order
        for i, call in enumerate(calls):
            if isinstance(call, ToolResult):
                results[i] = call
            elif i >= max_calls:
                results[i] = error_result(call.id, call.name, TOO_MANY_CALLS,
                                          f"at most {max_calls} tool calls a turn: this one was not run")
            elif call.name not in self.tools:
                results[i] = error_result(call.id, call.name, UNKNOWN_TOOL,
                                          f"no tool named {call.name!r} (the tools: {', '.join(self.tools)})")
            else:
                tool = self.tools[call.name]
                lanes.setdefault(tool.name if tool.stateful else i, []).append(i)
        threads = []
        for lane in lanes.values():
            thread = threading.Thread(target=self._run_lane, args=([calls[i] for i in lane], lane, results),
                                      daemon=True, name="tool-call")
            thread.start()
            threads.append((thread, lane, time.monotonic()))
        for thread, lane, started in threads:
            thread.join(max(0.0, started + timeout * len(lane) - time.monotonic()))
            for i in lane:  # what has not answered by its lane's deadline timed out
                if results[i] is None:
                    results[i] = error_result(calls[i].id, calls[i].name, TIMEOUT,
                                              f"the call did not finish within its {timeout:g} s",
                                              seconds=time.monotonic() - started)
        return [cut_result(r, max_response_tokens, tokenizer) for r in results]

    def _run_lane(self, calls: list[ToolCall], places: list[int], results: list[ToolResult | None]) -> None:
        for call, place in zip(calls, places):
            result = self.call(call)
            if results[place] is None:  # not already answered as timed out
                results[place] = result

    def call(self, call: ToolCall) -> ToolResult:
        """One call's result, whatever the tool does (short of hanging); a span of the run's
        trace (category ``tool``), so that the timeline shows tool work."""
        started = time.monotonic()
        try:
            with get_tracer().span(f"tool {call.name}", cat="tool"):
                text = self.tools[call.name].call(call.arguments)
        except ToolError as e:
            return error_result(call.id, call.name, e.kind, str(e), time.monotonic() - started)
        except Exception as e:  # noqa: BLE001 -- a tool's exception is the model's observation
            return error_result(call.id, call.name, RAISED, f"{type(e).__name__}: {e}", time.monotonic() - started)
        return ToolResult(call.id, call.name, text, seconds=time.monotonic() - started)


def cut_result(result: ToolResult, max_tokens: int, tokenizer: Any) -> ToolResult:
    """``result`` with its text cut to ``max_tokens`` (``cut``), marked when it was."""
    text, was_cut = cut(result.text, max_tokens, tokenizer)
    return ToolResult(result.call_id, result.name, text, result.error, result.seconds, cut=True) if was_cut else result


def error_counts(results: Iterable[ToolResult]) -> Counter[str]:
    """How many of ``results`` ended in each kind of error."""
    return Counter(r.error for r in results if r.error is not None)
