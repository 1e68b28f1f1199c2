"""Chats for supervised fine-tuning: conversations in the OpenAI message format, tokenized as
the agentic rollout makes a trajectory, with the loss on the assistant's tokens, and packed.

A chat file is JSON lines, one conversation each: ``{"messages": [...], "tools": [...]}``
(``tools``: the OpenAI function schemas offered, optional). A message has a ``role``
(``system``, ``user``, ``assistant``, ``tool``) and ``content``; an assistant message may carry
``tool_calls`` (``[{"function": {"name": ..., "arguments": {...} or "<json>"}}]``).

The tokens are those the model would see in an agentic run (``m2flow.tools.episodes``): the
messages before the first assistant one are the prompt (the tools offered as
``data.problems.offer_tools`` offers them); each assistant message is the text the model writes
(its content, then its calls in the hermes form that ``tools.calls.parse_calls`` reads) and its
end-of-turn token, in the loss; what follows it until the next assistant message (the tools'
results, or a user's turn) is the template's own rendering, out of the loss. So the model learns
to write exactly what the rollout later parses, and its trajectory after training is the same
token sequence.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m2flow.tools.base import ToolResult
from m2flow.tools.calls import CLOSE, OPEN, render_results


@dataclass(frozen=True)
class Chat:
    token_ids: tuple[int, ...]
    mask: tuple[bool, ...]  # True on the tokens the assistant wrote: the loss


def load_chats(path: str | Path) -> list[dict[str, Any]]:
    """The conversations of a .jsonl (or .parquet) file; a row that is no conversation is an
    error naming it."""
    from m2flow.data.problems import read_rows

    chats = read_rows(Path(path))
    for n, row in enumerate(chats, 1):
        messages = row.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError(f'{path} row {n}: a row is {{"messages": [{{"role": ..., "content": ...}}, ...]}}')
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{path} row {n}: no assistant message: nothing to learn")
    if not chats:
        raise ValueError(f"{path}: no conversation")
    return chats


def assistant_text(message: dict[str, Any]) -> str:
    """What the model writes for an assistant message: its content, then each call in hermes form."""
    blocks = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call)
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        blocks.append(f"{OPEN}\n{json.dumps({'name': function['name'], 'arguments': arguments})}\n{CLOSE}")
    content = message.get("content") or ""
    return "\n".join(filter(None, [content, *blocks]))


def tokenize_chat(chat: dict[str, Any], tokenizer: Any, after: str) -> Chat:
    """``chat``'s tokens and loss mask. ``after``: what the template puts after the end-of-turn
    token of an assistant turn (``tools.episodes.turn_separator``)."""
    from m2flow.data.problems import offer_tools

    messages = chat["messages"]
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    head = messages[:first]
    system = next((m["content"] for m in head if m["role"] == "system"), None)
    system, tools = offer_tools(tokenizer, system, chat.get("tools"))
    head = ([{"role": "system", "content": system}] if system is not None else []) + [
        m for m in head if m["role"] != "system"]
    if not any(m["role"] != "system" for m in head):
        raise ValueError("a conversation needs a user message before the first assistant one")
    text = tokenizer.apply_chat_template(head, tokenize=False, add_generation_prompt=True,
                                         **({"tools": tools} if tools else {}))
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    mask = [False] * len(ids)

    def add(piece: str, learned: bool) -> None:
        tokens = tokenizer.encode(piece, add_special_tokens=False)
        ids.extend(tokens)
        mask.extend([learned] * len(tokens))

    i = first
    while i < len(messages):
        m = messages[i]
        if m["role"] != "assistant":
            raise ValueError(f"message {i}: expected an assistant message, got {m['role']!r}")
        add(assistant_text(m), True)
        add(tokenizer.eos_token, True)  # the end-of-turn token, which ends a turn in the rollout: learned
        i += 1
        between = []
        while i < len(messages) and messages[i]["role"] != "assistant":
            between.append(messages[i])
            i += 1
        if i == len(messages):  # the conversation's end: what follows its last answer is not learned
            break
        add(after + _between(between, tokenizer), False)
    return Chat(tuple(ids), tuple(mask))


def _between(messages: list[dict[str, Any]], tokenizer: Any) -> str:
    """The text between two assistant turns, up to the second one's opening: tool results as
    the rollout renders them, other turns as the template does."""
    if messages and all(m["role"] == "tool" for m in messages):
        return render_results([ToolResult(m.get("tool_call_id", f"call_{k}"), m.get("name", ""), str(m["content"]))
                               for k, m in enumerate(messages)], tokenizer)
    if any(m["role"] == "tool" for m in messages) or not messages:
        raise ValueError("between two assistant messages: tool results alone, or other turns alone")
    before = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]
    head = tokenizer.apply_chat_template(before, tokenize=False)
    full = tokenizer.apply_chat_template(before + messages, tokenize=False, add_generation_prompt=True)
    if not full.startswith(head):
        raise ValueError("the chat template does not render a conversation as the text of its first turns and then "
                         "the rest")
    return full[len(head):]


def pack(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Rows of at most ``capacity`` tokens, each a list of chat indices (first fit, longest first;
    a chat longer than ``capacity`` fills a row alone, cut by the caller)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        n = min(lengths[i], capacity)
        at = next((r for r, left in enumerate(room) if left >= n), None)
        if at is None:
            rows.append([i])
            room.append(capacity - n)
        else:
            rows[at].append(i)
            room[at] -= n
    return rows


def packed_rows(chats: Sequence[dict[str, Any]], tokenizer: Any, capacity: int) -> Any:
    """``chats`` tokenized and packed into a ``SequenceBatch`` of rows of at most ``capacity``
    tokens: ``completion_mask`` on the learned tokens, ``position_ids`` from 0 in each chat (a
    chat longer than ``capacity`` is cut to it)."""
    import torch

    from m2flow.engines.batch import SequenceBatch
    from m2flow.tools.episodes import turn_separator

    _, after = turn_separator(tokenizer)
    tokenized = [tokenize_chat(c, tokenizer, after) for c in chats]
    rows = pack([len(c.token_ids) for c in tokenized], capacity)
    width = max(sum(min(len(tokenized[i].token_ids), capacity) for i in row) for row in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention, learned = torch.zeros_like(ids), torch.zeros_like(ids)
    positions = torch.arange(width).repeat(len(rows), 1)  # the padding: a sequence of its own
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            chat = tokenized[i]
            n = min(len(chat.token_ids), capacity)
            ids[r, at:at + n] = torch.tensor(chat.token_ids[:n])
            learned[r, at:at + n] = torch.tensor(chat.mask[:n], dtype=torch.long)
            attention[r, at:at + n] = 1
            positions[r, at:at + n] = torch.arange(n)
            at += n
        positions[r, at:] = torch.arange(width - at)
    return SequenceBatch(ids, attention, learned, position_ids=positions)


def calculation_chats(n: int, split: str, seed: int, instruction: str | None) -> list[dict[str, Any]]:
    """Demonstrations for the built-in calculations (``data.calculation``): the question, a call
    of the calculator with its expression, the calculator's own result, and the answer in
    ``\\boxed{}``."""
    from m2flow.data.calculation import calculation_problems, expression_of
    from m2flow.tools import load

    calculator = load("calculator")
    chats = []
    for p in calculation_problems(n, split, seed=seed):
        expression = expression_of(p)
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
        chats.append({"tools": [calculator.schema], "messages": [
            {"role": "user", "content": f"{p.question}\n{instruction}" if instruction else p.question},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": calculator.call({"expression": expression})},
            {"role": "assistant", "content": f"The answer is \\boxed{{{p.answer}}}."}]})
    return chats


def invented_chats(n: int, split: str, seed: int, instruction: str | None) -> list[dict[str, Any]]:
    """Demonstrations for the built-in questions about invented entities (``data.invented``):
    the question, one search a turn for each entity the answer is found through (the
    question's, then each that the passage found names), the search tool's own passages on
    the built-in corpus (``invented.SEARCH``: as the presets offer it), and the answer in ``\\boxed{}``."""
    from m2flow.data.invented import SEARCH, hops, invented_problems
    from m2flow.tools import load

    options = dict(SEARCH)
    search = load(options.pop("path"), **options)
    chats = []
    for p in invented_problems(n, split, seed=seed):
        messages = [{"role": "user", "content": f"{p.question}\n{instruction}" if instruction else p.question}]
        for entity in hops(p):
            call = {"type": "function", "function": {"name": "search", "arguments": {"query": entity}}}
            messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "name": "search", "content": search.call({"query": entity})}]
        messages.append({"role": "assistant", "content": f"The answer is \\boxed{{{p.answer}}}."})
        chats.append({"tools": [search.schema], "messages": messages})
    return chats


# demonstrations of the built-in tasks, by data.source: (n, split, seed, instruction) -> chats
DEMONSTRATIONS = {"calculation": calculation_chats, "invented": invented_chats}
