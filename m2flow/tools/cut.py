"""A tool's observation cut to ``max_tool_response_tokens``: by the rollout's tokenizer when
it passes one, else by characters at CHARS_PER_TOKEN."""

from __future__ import annotations

from typing import Any

CHARS_PER_TOKEN = 4  # without a tokenizer: a token is taken to be 4 characters (English text, code)
_SLACK = 16  # a text longer than max_tokens * _SLACK characters is cut by characters before tokenizing


def cut(text: str, max_tokens: int, tokenizer: Any = None) -> tuple[str, bool]:
    """``(text, False)`` when it fits in ``max_tokens``, else its head and a note saying what
    was cut, within ``max_tokens`` in all, and True."""
    if tokenizer is None:
        limit = max_tokens * CHARS_PER_TOKEN
        if len(text) <= limit:
            return text, False
        note = f"\n[cut: {len(text) - limit} more characters]"
        return text[:max(0, limit - len(note))] + note, True
    head = text[:max_tokens * _SLACK]  # never tokenize megabytes
    ids = tokenizer.encode(head, add_special_tokens=False)
    if len(ids) <= max_tokens and len(head) == len(text):
        return text, False
    note = f"\n[cut at {max_tokens} tokens]"
    keep = max(0, max_tokens - len(tokenizer.encode(note, add_special_tokens=False)))
    return tokenizer.decode(ids[:keep]) + note, True
