"""A run's prompts: the train and held-out cut of its data source, chat-formatted."""

from __future__ import annotations

from omegaconf import DictConfig

from m2flow.data.arithmetic import arithmetic_problems
from m2flow.data.problems import build_prompts, load_problems


def load_prompts(cfg: DictConfig) -> tuple[list[dict], list[dict]]:
    """(train, test) prompts as ``{"index", "token_ids", "answer"}``, chat-formatted with
    the model's own tokenizer."""
    d = cfg.data
    if d.source == "arithmetic":
        levels = list(d.levels)
        train = arithmetic_problems(d.train_size, levels, "train", seed=cfg.seed)
        test = arithmetic_problems(d.test_size, levels, "test", seed=cfg.seed)
    else:
        problems = load_problems(d.source, d.question_key, d.answer_key)
        if len(problems) <= d.test_size:
            raise ValueError(f"data.source={d.source}: {len(problems)} problems, not enough to hold out "
                             f"data.test_size={d.test_size} and train on the rest")
        cut = len(problems) - d.test_size  # the last test_size rows are held out
        train, test = problems[:cut], problems[cut:]
    return _rows(cfg, train), _rows(cfg, test)


def eval_prompts(cfg: DictConfig) -> list[dict]:
    """The prompts ``m2flow eval`` scores: every row of ``data.source`` when it is a file, else
    the generated held-out problems."""
    d = cfg.data
    if d.source == "arithmetic":
        return _rows(cfg, arithmetic_problems(d.test_size, list(d.levels), "test", seed=cfg.seed))
    return _rows(cfg, load_problems(d.source, d.question_key, d.answer_key))


def _rows(cfg: DictConfig, problems) -> list[dict]:
    from m2flow.models.lm import load_tokenizer  # transformers: imported only when prompts are made

    tokenizer = load_tokenizer(cfg.model.path)
    return [{"index": i, "token_ids": list(p.token_ids), "answer": p.problem.answer}
            for i, p in enumerate(build_prompts(problems, tokenizer, cfg.data.instruction))]
