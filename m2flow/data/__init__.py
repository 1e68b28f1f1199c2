"""Prompt datasets for reasoning RL: files (JSONL/Parquet), the built-in arithmetic task,
chat-formatted prompts and a resumable loader."""

from m2flow.data.arithmetic import LEVELS, arithmetic_problems
from m2flow.data.loader import PromptLoader
from m2flow.data.problems import DEFAULT_INSTRUCTION, Problem, Prompt, build_prompts, format_prompt, load_problems

__all__ = ["DEFAULT_INSTRUCTION", "LEVELS", "Problem", "Prompt", "PromptLoader", "arithmetic_problems", "build_prompts",
           "format_prompt", "load_problems"]
