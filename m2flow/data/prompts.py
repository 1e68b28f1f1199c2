"""A run's prompts: the train and held-out cut of its data source, chat-formatted."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from m2flow.config import ConfigError
from m2flow.data.arithmetic import arithmetic_problems
from m2flow.data.calculation import calculation_problems
from m2flow.data.invented import invented_problems
from m2flow.data.problems import Problem, build_prompts, load_problems
from m2flow.tools import Toolbox

# the built-in tasks for tools, by data.source: (n, split, seed) -> problems
GENERATED = {"calculation": calculation_problems, "invented": invented_problems}


def load_prompts(cfg: DictConfig) -> tuple[list[dict], list[dict]]:
    """(train, test) prompts as ``{"index", "token_ids", "answer"}``, chat-formatted with
    the model's own tokenizer."""
    d = cfg.data
    if d.source == "arithmetic":
        levels = list(d.levels)
        train = arithmetic_problems(d.train_size, levels, "train", seed=cfg.seed)
        test = arithmetic_problems(d.test_size, levels, "test", seed=cfg.seed)
    elif d.source in GENERATED:
        train, test = _generated(cfg, "train", d.train_size), _generated(cfg, "test", d.test_size)
    else:
        problems = _file_problems(cfg)
        if len(problems) <= d.test_size:
            raise ConfigError("data.test_size", f"data.source={d.source} has {len(problems)} problems, not enough "
                                                f"to hold out {d.test_size} and train on the rest")
        cut = len(problems) - d.test_size  # the last test_size rows are held out
        train, test = problems[:cut], problems[cut:]
    return _rows(cfg, train), _rows(cfg, test)


def eval_prompts(cfg: DictConfig) -> list[dict]:
    """The prompts ``m2flow eval`` scores: every row of ``data.source`` when it is a file, else
    the generated held-out problems."""
    d = cfg.data
    if d.source == "arithmetic":
        return _rows(cfg, arithmetic_problems(d.test_size, list(d.levels), "test", seed=cfg.seed))
    if d.source in GENERATED:
        return _rows(cfg, _generated(cfg, "test", d.test_size))
    return _rows(cfg, _file_problems(cfg))


def _generated(cfg: DictConfig, split: str, n: int) -> list[Problem]:
    """``n`` problems of a built-in task's ``split``; more than it has is a config error."""
    try:
        return GENERATED[cfg.data.source](n, split, seed=cfg.seed)
    except ValueError as e:
        raise ConfigError(f"data.{split}_size", str(e)) from None


def _file_problems(cfg: DictConfig) -> list[Problem]:
    """The problems of the file ``data.source``; a row that is not JSON or lacks a field is a
    config error naming the file and the row."""
    d = cfg.data
    try:
        return load_problems(d.source, d.question_key, d.answer_key)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise ConfigError("data.source", e.args[0]) from None


def _rows(cfg: DictConfig, problems) -> list[dict]:
    """The problems as prompts; one the model has no room to answer (its positions all taken by
    the prompt), or a completion's budget past the model's positions after the longest prompt,
    is a config error here, not the rollout's whenever its batch comes."""
    from m2flow.models.lm import load_tokenizer, max_positions  # transformers: only when prompts are made

    try:
        tokenizer = load_tokenizer(cfg.model.path)
    except (OSError, ValueError) as e:  # transformers' own messages name what the directory lacks
        said = " ".join(str(e).split()) or type(e).__name__
        raise ConfigError("model.path", f"no tokenizer loads from {cfg.model.path!r}: {said}") from None
    if not getattr(tokenizer, "chat_template", None):  # a base model's, often
        raise ConfigError("model.path", f"the tokenizer of {cfg.model.path!r} has no chat template, and the prompts "
                                        "are chat-formatted: use an instruct model, or add a chat_template to its "
                                        "tokenizer_config.json")
    names = OmegaConf.select(cfg, "tools.names")  # an agentic task's: the prompt offers them
    tools = Toolbox.load(list(names)).schemas if names else None
    prompts = build_prompts(problems, tokenizer, cfg.data.instruction, tools=tools)
    room = max_positions(cfg.model.path)
    for p in prompts:
        if room is not None and len(p.token_ids) >= room:
            key = "data.source" if cfg.data.source not in ("arithmetic", *GENERATED) else "data.instruction"
            raise ConfigError(key, f"problem {p.problem.id!r}: its prompt has {len(p.token_ids)} tokens "
                                   f"(chat-formatted): no room to generate within the {room} positions of "
                                   f"{cfg.model.path}")
    longest = max((len(p.token_ids) for p in prompts), default=0)
    if room is not None and longest + cfg.rollout.max_new_tokens > room:
        raise ConfigError("rollout.max_new_tokens", f"{cfg.rollout.max_new_tokens} new tokens after the longest prompt "
                                                    f"({longest} tokens) pass the {room} positions of {cfg.model.path}: "
                                                    f"at most {room - longest}")
    bound = OmegaConf.select(cfg, "rollout.max_total_tokens")  # a multi-turn trajectory's
    if bound is not None and longest + cfg.rollout.max_new_tokens > bound:
        raise ConfigError("rollout.max_total_tokens", f"{bound} leaves no room for a turn of rollout.max_new_tokens="
                                                      f"{cfg.rollout.max_new_tokens} after the longest prompt "
                                                      f"({longest} tokens): at least {longest + cfg.rollout.max_new_tokens}")
    return [{"index": i, "token_ids": list(p.token_ids), "answer": p.problem.answer} for i, p in enumerate(prompts)]
