"""Prompt datasets: problems (question, reference answer) from JSONL or Parquet files, and
chat-formatted prompts built from them with the model's own chat template."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_INSTRUCTION = "Put the final answer in \\boxed{}."


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str  # the reference final answer (or a solution containing \boxed{...})
    id: str = ""
    level: int | None = None


@dataclass(frozen=True)
class Prompt:
    """A problem as the policy sees it: ``text`` is the chat-formatted prompt ending with
    the assistant turn's opening, ``token_ids`` its tokens."""

    problem: Problem
    text: str
    token_ids: tuple[int, ...]


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a .jsonl (blank lines skipped) or .parquet file; one that is not a JSON
    object is an error naming its line."""
    if path.suffix not in (".parquet", ".jsonl", ".json"):
        raise ValueError(f"{path}: expected a .jsonl or .parquet file")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except pa.ArrowInvalid as e:
            raise ValueError(f"{path}: not a Parquet file ({e})") from None
    rows = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {n}: not JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path} line {n}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def load_problems(
    path: str | Path, question_key: str = "question", answer_key: str = "answer", id_key: str | None = None
) -> list[Problem]:
    """Problems from a JSONL or Parquet file of GSM8K/MATH-style rows. A GSM8K answer
    ("...reasoning #### 72") is cut to what follows the last ``####``; a MATH solution may
    be kept whole, since the rewards take the last ``\\boxed{}`` of a reference."""
    path = Path(path)
    problems = []
    for i, row in enumerate(read_rows(path)):
        missing = [k for k in (question_key, answer_key) if k not in row]
        if missing:
            raise KeyError(f"{path} row {i}: no field {missing[0]!r} (fields: {sorted(row)})")
        empty = [k for k in (question_key, answer_key) if row[k] is None or not str(row[k]).strip()]
        if empty:
            raise ValueError(f"{path} row {i}: field {empty[0]!r} is empty ({row[empty[0]]!r})")
        answer = str(row[answer_key])
        if "####" in answer:
            answer = answer.rsplit("####", 1)[1].strip()
        pid = str(row[id_key]) if id_key else f"{path.stem}-{i}"
        problems.append(Problem(str(row[question_key]), answer, id=pid))
    seen: dict[str, int] = {}
    for i, p in enumerate(problems):  # a sample's id names its problem: two problems may not share one
        if seen.setdefault(p.id, i) != i:
            raise ValueError(f"{path} rows {seen[p.id]} and {i}: the same id {p.id!r} in field {id_key!r}")
    return problems


def format_prompt(tokenizer: Any, question: str, instruction: str | None = DEFAULT_INSTRUCTION,
                  system: str | None = None, tools: list[dict] | None = None) -> str:
    """The chat-formatted prompt text: one user turn (question, then the instruction), and
    the generation prompt. ``system=None`` keeps the template's default system turn. ``tools``
    (their schemas): given to a template that renders them (``tools=``), else offered in a
    system turn in the hermes format (``m2flow.tools.calls.tools_prompt``)."""
    return _render(tokenizer, question, instruction, *offer_tools(tokenizer, system, tools))


def offer_tools(tokenizer: Any, system: str | None, tools: list[dict] | None) -> tuple[str | None, list[dict] | None]:
    """``(system, tools)`` as the template takes them: the tools as they are where it renders
    them, else offered in the system turn (hermes) and no ``tools=``."""
    if tools and not takes_tools(tokenizer):
        from m2flow.tools.calls import tools_prompt

        return tools_prompt(tools) + (f"\n\n{system}" if system else ""), None
    return system, tools


def _render(tokenizer: Any, question: str, instruction: str | None, system: str | None,
            tools: list[dict] | None) -> str:
    content = f"{question}\n{instruction}" if instruction else question
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": content}
    ]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **({"tools": tools} if tools else {}))


def takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders the tools it is given."""
    probe = [{"type": "function", "function": {"name": "m2flow_probe", "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": "?"}]
    try:
        return "m2flow_probe" in tokenizer.apply_chat_template(messages, tokenize=False, tools=probe)
    except Exception:  # noqa: BLE001 - a template that refuses tools=
        return False


def build_prompts(problems: Iterable[Problem], tokenizer: Any, instruction: str | None = DEFAULT_INSTRUCTION,
                  system: str | None = None, tools: list[dict] | None = None) -> list[Prompt]:
    prompts = []
    system, tools = offer_tools(tokenizer, system, tools)  # once: it probes the template
    for p in problems:
        text = _render(tokenizer, p.question, instruction, system, tools)
        # The template already wrote any BOS token into the text.
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        prompts.append(Prompt(p, text, tuple(ids)))
    return prompts
