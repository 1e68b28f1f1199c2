"""``m2flow eval``: scores a checkpoint, in this process (no cluster), as its flow says
(``Flow.score``: the reasoning flow's held-out accuracy, the embodied flow's deterministic
episodes), and writes the result beside it as JSON."""

from __future__ import annotations

import errno
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from m2flow.config import ConfigError
from m2flow.runners import checkpoint as checkpoints
from m2flow.runners.flow import flow_named
from m2flow.runtime.files import write_text


def evaluate(cfg: DictConfig, checkpoint: str | Path, episodes: int = 10, out: str | Path | None = None) -> dict:
    """Scores ``checkpoint`` under ``cfg``; writes the result as JSON to ``out`` (default: beside
    the checkpoint, ``<name>.eval.json``), and each example scored (a prompt with its completion,
    an episode) as a line of JSON beside it (``examples_of(out)``); returns the result."""
    checkpoint = Path(checkpoint)
    try:
        ckpt = checkpoints.load(checkpoint)
    except checkpoints.CheckpointError as e:
        raise ConfigError("checkpoint", str(e)) from None
    written = ckpt["config"]
    if written["flow"] != cfg.flow:
        raise ConfigError("checkpoint", f"{checkpoint} is a checkpoint of the {written['flow']} flow; the config is "
                                        f"of the {cfg.flow} flow")
    out = Path(out) if out else checkpoint.with_name(checkpoint.name.removesuffix(checkpoints.SUFFIX) + ".eval.json")
    lines = examples_of(out)
    source = OmegaConf.select(cfg, "data.source")
    if source and Path(source).resolve() == lines.resolve():
        raise ConfigError("out", f"the examples would go to {str(lines)!r}, the data file itself: choose another out")
    try:  # a file written and removed where the result will go: the result is not lost after the evaluation
        if out.is_dir():
            raise IsADirectoryError(errno.EISDIR, "a directory")
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.name}.", suffix=".probe"):
            pass
    except OSError as e:
        raise ConfigError("out", f"cannot write the result to {str(out)!r}: {e.strerror}") from None
    start = time.perf_counter()
    result, examples = flow_named(cfg.flow).score(cfg, ckpt, episodes)
    result = {"checkpoint": str(checkpoint), "flow": cfg.flow, "trained_for": ckpt["done"], **result,
              "eval_s": round(time.perf_counter() - start, 2)}
    write_text(lines, "".join(json.dumps(e) + "\n" for e in examples))
    write_text(out, json.dumps(result, indent=2) + "\n")
    result["written_to"], result["examples_written_to"] = str(out), str(lines)
    return result


def examples_of(out: Path) -> Path:
    """Where the examples of a result written to ``out`` go: ``x.json`` -> ``x.examples.jsonl``."""
    return out.with_name(out.name.removesuffix(".json") + ".examples.jsonl")


def table(result: dict) -> str:
    """The result as two columns of text."""
    rows = [(k, f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in result.items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def checkpoint_lm(cfg: DictConfig, ckpt: dict) -> tuple[dict, Any, Any]:
    """A language-model flow's ``(plain config, model with the checkpoint's weights, tokenizer)``,
    as the run's own evaluations see them: rounded to ``rollout.dtype`` (a flow without a rollout:
    in ``model.dtype``), on a GPU where there is one."""
    import torch

    from m2flow.workers.lm_common import load_model

    plain = OmegaConf.to_container(cfg, resolve=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_model(plain, device, plain.get("rollout", {}).get("dtype"))
    try:
        model.load_state_dict(checkpoints.trainer_weights(ckpt, "trainer"))  # rounded to the rollout's dtype
    except RuntimeError as e:
        raise ConfigError("model.path", f"the checkpoint's weights do not fit {cfg.model.path}: "
                          f"{str(e).splitlines()[0]}") from None
    model.requires_grad_(False)
    return plain, model, tokenizer
