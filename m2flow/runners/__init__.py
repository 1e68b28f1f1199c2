"""Macro flows: the short loops a user reads."""

from __future__ import annotations

from omegaconf import DictConfig


def run(cfg: DictConfig) -> list[dict[str, float]]:
    """Runs the flow a config names and returns its per-update metrics. With
    ``placement.mode=auto`` the plan is chosen first (``runners.auto``)."""
    if cfg.placement.mode == "auto":
        from m2flow.runners.auto import auto_plan

        cfg = auto_plan(cfg)
    if cfg.flow == "embodied":
        from m2flow.runners.embodied import EmbodiedRunner

        runner = EmbodiedRunner(cfg)
    elif cfg.flow == "reasoning":
        from m2flow.runners.reasoning import ReasoningRunner

        runner = ReasoningRunner(cfg)
    else:
        raise ValueError(f"unknown flow {cfg.flow!r} (known: embodied, reasoning)")
    try:
        return runner.train()
    finally:
        runner.close()
