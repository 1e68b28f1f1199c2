"""Tool calls as text: parsed out of a finished turn, and the results rendered back.

A turn's calls are read in the model's own format when its tokenizer has a
``response_template`` (transformers' ``parse_response``), else in the hermes format that
Qwen's and many other chat templates use::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2 + 2"}}
    </tool_call>

A malformed call (bad JSON, no name, arguments that are not an object, no closing tag) is
not dropped: it becomes an error ToolResult, in its place among the turn's calls, so the
model reads what went wrong and the error is counted. The results go back as ``tool``
messages, rendered by the tokenizer's chat template when it renders them, else in the hermes
form (one user turn of ``<tool_response>`` blocks)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from m2flow.tools.base import MALFORMED, ToolCall, ToolResult, error_result

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _call(index: int, name: Any, arguments: Any) -> ToolCall | ToolResult:
    """One call from its parts (``arguments`` may be a JSON string of the object, as in the
    OpenAI format), or the malformed call's error result."""
    call_id = f"call_{index}"
    if not isinstance(name, str) or not name:
        return error_result(call_id, "", MALFORMED, 'a tool call needs a "name" (a string)')
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            return error_result(call_id, name, MALFORMED, f"the arguments are not valid JSON: {e}")
    if not isinstance(arguments, dict):
        return error_result(call_id, name, MALFORMED, '"arguments" must be a JSON object')
    return ToolCall(call_id, name, arguments)


def parse_hermes(text: str) -> list[ToolCall | ToolResult]:
    """The ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of ``text``, in
    order: each a ToolCall, or an error result where the block is malformed."""
    found: list[ToolCall | ToolResult] = []
    at = text.find(OPEN)
    while at >= 0:
        start = at + len(OPEN)
        end, reopen = text.find(CLOSE, start), text.find(OPEN, start)
        index = len(found)
        if end < 0 or 0 <= reopen < end:
            found.append(error_result(f"call_{index}", "", MALFORMED, f"a {OPEN} without its {CLOSE}"))
            at = reopen
            continue
        body, at = text[start:end].strip(), text.find(OPEN, end + len(CLOSE))
        try:
            data = json.loads(body)
        except json.JSONDecodeError as e:
            found.append(error_result(f"call_{index}", "", MALFORMED, f"the tool call is not valid JSON: {e}"))
            continue
        if not isinstance(data, dict):
            found.append(error_result(f"call_{index}", "", MALFORMED,
                                      'a tool call is a JSON object: {"name": ..., "arguments": {...}}'))
            continue
        found.append(_call(index, data.get("name"), data.get("arguments", data.get("parameters"))))
    return found


def parse_calls(text: str, tokenizer: Any = None, prefix: str = "") -> list[ToolCall | ToolResult]:
    """The calls of one finished turn ``text`` (the model's output only; ``prefix`` is the
    prompt before it, which some response templates need), in order. Read with the
    tokenizer's ``response_template`` when it has one, else in the hermes format."""
    if getattr(tokenizer, "response_template", None) is None:
        return parse_hermes(text)
    try:
        message = tokenizer.parse_response(text, prefix=prefix)
    except Exception as e:  # noqa: BLE001 - whatever the parser says becomes the model's observation
        return [error_result("call_0", "", MALFORMED, f"the turn could not be parsed: {e}")]
    found: list[ToolCall | ToolResult] = []
    for index, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function", call) if isinstance(call, dict) else {}
        found.append(_call(index, function.get("name"), function.get("arguments")))
    return found


# -- results back as text ---------------------------------------------------------------
def tool_messages(results: Iterable[ToolResult]) -> list[dict[str, str]]:
    """The results as chat messages of role ``tool``, as chat templates take them."""
    return [{"role": "tool", "tool_call_id": r.call_id, "name": r.name, "content": r.text} for r in results]


def render_hermes(results: Sequence[ToolResult]) -> str:
    """The hermes (ChatML) rendering of a turn's results and the next assistant prompt."""
    blocks = "\n".join(f"<tool_response>\n{r.text}\n</tool_response>" for r in results)
    return f"<|im_start|>user\n{blocks}<|im_end|>\n<|im_start|>assistant\n"


def render_results(results: Sequence[ToolResult], tokenizer: Any = None) -> str:
    """The text that follows a turn that made calls: the results, then the prompt of the
    model's next turn. The tokenizer's chat template renders them when it renders ``tool``
    messages (the text it adds for them after an assistant turn that made the calls);
    otherwise, or without a tokenizer, the hermes form."""
    template = getattr(tokenizer, "chat_template", None)
    if not results or not template:
        return render_hermes(results)
    asked = [{"id": r.call_id, "type": "function", "function": {"name": r.name, "arguments": {}}} for r in results]
    before = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!", "tool_calls": asked}]
    try:
        head = tokenizer.apply_chat_template(before, tokenize=False)
        full = tokenizer.apply_chat_template(before + tool_messages(results), tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that refuses the tool role
        return render_hermes(results)
    added = full[len(head):] if full.startswith(head) else ""
    if not added or not all(r.text in added for r in results):
        return render_hermes(results)  # the template drops or mangles tool messages
    return added


def tools_prompt(schemas: Sequence[dict[str, Any]]) -> str:
    """A system prompt that offers the tools in the hermes format, for a model whose chat
    template takes no ``tools=``."""
    listed = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    return ("# Tools\n\nYou may call one or more functions to help with the task. Their signatures are "
            f"within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n"
            "For each call, write a JSON object with the function's name and arguments within "
            f'{OPEN}{CLOSE} XML tags:\n{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}')
