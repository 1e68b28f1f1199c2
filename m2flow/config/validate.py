"""Config checks that need no cluster: each key's range and choices (declared in ``schema``),
files that must exist, and the rules between keys. Each failure is a ``ConfigError``: one
line, ``key.path: what is wrong and what is allowed``.

The checks read the resolved config as plain containers (what the workers receive), so
they work on a ``DictConfig`` and on ``OmegaConf.to_container``'s dict alike.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import os
import sys
import typing
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from m2flow.config.flows import UnknownFlow, declared
from m2flow.config.schema import BUILTIN_MODELS, BUILTIN_REWARDS, Range

GROUP_FREE = ("reinforce_pp", "ppo")  # reasoning algorithms that need no group of samples per prompt


class ConfigError(ValueError):
    """A config mistake: ``key`` (the full key path) and what is wrong with it, on one line."""

    def __init__(self, key: str, problem: str):
        self.key, self.problem = key, problem
        super().__init__(f"{key}: {problem}")


def validate(cfg: DictConfig | Mapping, training: bool = True) -> None:
    """Raises the first ``ConfigError`` of ``cfg`` (a loaded config, DictConfig or dict).
    ``training=False``: for scoring a checkpoint on the data (``m2flow eval``), which trains
    on none of it: the data need not hold a training set beside the held-out one."""
    d = resolved(cfg)
    try:
        flow = declared(d.get("flow"))  # its config's root and rules
    except UnknownFlow as e:
        raise ConfigError("flow", str(e)) from None
    check_values(d, flow.config)
    check_runner_files(d)
    flow.check(d, training)


def resolved(cfg: DictConfig | Mapping) -> dict:
    """``cfg`` as plain containers with its interpolations resolved."""
    if not isinstance(cfg, DictConfig):
        return dict(cfg)
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        raise ConfigError(e.full_key or "config", str(e.msg).splitlines()[0]) from None


# -------------------------------------------------------------------- per key


def check_values(d: Mapping, cls: type, prefix: str = "") -> None:
    """Every key of section class ``cls`` in ``d`` against its declared range and choices."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, value = f"{prefix}{f.name}", d[f.name]
        if dataclasses.is_dataclass(hints[f.name]):
            check_values(value, hints[f.name], key + ".")
        else:
            check_value(key, value, f.metadata.get("within"), f.metadata.get("choices"), _optional(hints[f.name]))


def check_value(key: str, value: Any, within: Range | None, choices: tuple | None, optional: bool) -> None:
    if value is None:
        return
    items = value if isinstance(value, list) else [value]
    each = "each item " if isinstance(value, list) else ""
    null = " or null" if optional else ""
    if choices is not None and any(v not in choices for v in items):
        raise ConfigError(key, f"{each}must be one of {' | '.join(map(str, choices))}{null}, got {value!r}")
    if within is not None and any(v not in within for v in items):
        raise ConfigError(key, f"{each}must be {within}{null}, got {value!r}")


def _optional(hint: Any) -> bool:
    return type(None) in typing.get_args(hint)


def check_runner_files(d: Mapping) -> None:
    resume = d["runner"]["resume"]
    if resume not in (None, "auto") and not Path(resume).is_file():
        raise ConfigError("runner.resume", f"no such checkpoint file {resume!r}")
    plan = d["placement"]["plan"]
    if plan is not None and not Path(plan).is_file():
        raise ConfigError("placement.plan", f"no such plan file {plan!r} (placement=@FILE names a plan file)")


def check_custom_placement(placement: Mapping, components: tuple[str, ...]) -> None:
    """``placement.mode=custom`` names the devices of every component itself; any other mode
    lays them out itself, so a component's devices set beside it would be ignored."""
    given = placement["components"]
    if placement["mode"] != "custom":
        named = [c for c, devices in given.items() if devices is not None]
        if named:
            raise ConfigError(f"placement.components.{named[0]}",
                              f"takes effect only with placement.mode=custom, not {placement['mode']} (which lays the "
                              "devices out itself): set placement.mode=custom, or drop the key")
        return
    missing = [c for c in components if given.get(c) is None]
    if missing:
        raise ConfigError(f"placement.components.{missing[0]}",
                          f"placement.mode=custom needs device ranges for {', '.join(components)}; "
                          f"missing: {', '.join(missing)}")


# -------------------------------------------------------------------- embodied


def check_embodied(d: Mapping, training: bool = True) -> None:
    env, runner = d["env"], d["runner"]
    check_custom_placement(d["placement"], ("env", "rollout", "actor"))
    if env["num_envs"] % runner["stages"]:
        raise ConfigError("runner.stages", f"env.num_envs={env['num_envs']} cannot be split into "
                                           f"{runner['stages']} env batches (stages)")
    if d["algorithm"]["name"] == "grpo":
        check_grpo(d)


def check_grpo(d: Mapping) -> None:
    """GRPO compares the episodes of a group of ``env.group_size`` envs that start from the same
    seed, one episode per env and rollout window: a group must sit whole in one env batch."""
    env, k = d["env"], d["env"]["group_size"]
    if k < 2:
        raise ConfigError("env.group_size", f"algorithm.name=grpo compares envs started from the same seed: "
                                            f"it must be > 1, got {k}")
    if env["num_envs"] % k:
        raise ConfigError("env.num_envs", f"algorithm.name=grpo: {env['num_envs']} is not a multiple of "
                                          f"env.group_size={k}")
    per_batch = env["num_envs"] // d["runner"]["stages"]
    if per_batch % k:
        raise ConfigError("runner.stages", f"algorithm.name=grpo: a group of env.group_size={k} envs must sit in one "
                                           f"env batch, but {d['runner']['stages']} stages leave {per_batch} envs "
                                           "per batch")
    if d["algorithm"]["norm_adv"]:
        raise ConfigError("algorithm.norm_adv", "must be false for algorithm.name=grpo: its advantages are already "
                                                "normalised within each group")


def check_grpo_layout(d: Mapping, layout: Any) -> None:
    """The GRPO rules that depend on the ranks (``m2flow.workers.layout.EnvLayout``): known once
    the cluster's devices are."""
    k = d["env"]["group_size"]
    if layout.envs_per_stage % k:
        raise ConfigError("env.group_size", f"algorithm.name=grpo: a group of env.group_size={k} envs must sit in one "
                                            f"env batch, but each has {layout.envs_per_stage} (env.num_envs / "
                                            f"{layout.env_ranks} env rank(s) / runner.stages={layout.stages})")
    share = layout.envs_per_rank // layout.actor_ranks
    if share % k:
        raise ConfigError("env.group_size", f"algorithm.name=grpo: each of the {layout.actor_ranks} actor ranks "
                                            f"trains on {share} envs of every env rank, not a multiple of {k}")


# -------------------------------------------------------------------- reasoning


def check_reasoning(d: Mapping, training: bool = True) -> None:
    a, r = d["algorithm"], d["rollout"]
    check_model(d["model"]["path"])
    check_rewards(d["reward"]["functions"])
    check_data(d["data"], training)
    if r["n"] < 2 and a["name"] not in GROUP_FREE:
        raise ConfigError("rollout.n", f"algorithm.name={a['name']} compares the samples of a prompt: it must be >= 2, "
                                       f"got {r['n']}")
    if r["n"] < 2 and a["dynamic_sampling"]:
        raise ConfigError("algorithm.dynamic_sampling", "true drops groups whose rewards are all equal: with "
                                                        f"rollout.n={r['n']} that is every group")
    if a["kl_in_reward"] and a["name"] not in GROUP_FREE:
        raise ConfigError("algorithm.kl_in_reward", f"true needs algorithm.name={' | '.join(GROUP_FREE)}, not "
                                                    f"{a['name']} (group-relative advantages take the KL term in the "
                                                    "loss)")
    if a["off_policy"] == "decoupled" and a["old_logprobs"] != "recompute":
        raise ConfigError("algorithm.off_policy", "decoupled takes its trust region around the newest weights' "
                                                  "log-probs: it needs algorithm.old_logprobs=recompute")
    if d["runner"]["max_staleness"] and r["partial"]:
        if r["backend"] != "torch":
            raise ConfigError("rollout.partial", f"true takes weights while sequences are in flight: rollout.backend="
                                                 f"{r['backend']} does not (set rollout.partial=false)")
        if a["old_logprobs"] == "recompute" and a["off_policy"] != "decoupled":
            raise ConfigError("rollout.partial", "true samples a sequence's tokens with several weight versions: "
                                                 "algorithm.old_logprobs=recompute cannot redo that (use "
                                                 "algorithm.off_policy=decoupled, or old_logprobs=rollout, or "
                                                 "rollout.partial=false)")
    if a["off_policy"] == "tis" and a["dual_clip"] is not None:
        raise ConfigError("algorithm.dual_clip", "bounds a clipped surrogate; algorithm.off_policy=tis has none "
                                                 "(set dual_clip=null)")
    buffer = d["reward"]["overlong_buffer"]
    if buffer > r["max_new_tokens"]:
        raise ConfigError("reward.overlong_buffer", f"must be <= rollout.max_new_tokens={r['max_new_tokens']}, "
                                                    f"got {buffer}")
    components = ("rollout", "reward", "inference", "actor") + (("critic",) if a["name"] == "ppo" else ())
    check_custom_placement(d["placement"], components)


def check_model(path: str) -> None:
    """``model.path``: what ``m2flow.models.lm.load_lm`` takes."""
    if path not in BUILTIN_MODELS and not Path(path).is_dir():
        raise ConfigError("model.path", f"{path!r} is neither a built-in model ({' | '.join(BUILTIN_MODELS)}) nor "
                                        "an existing directory")
    if path not in BUILTIN_MODELS and not (Path(path) / "config.json").is_file():
        raise ConfigError("model.path", f"{path!r} has no config.json: expected a checkpoint directory as "
                                        "transformers' save_pretrained writes it")
    if path not in BUILTIN_MODELS:
        check_weights(Path(path))


def check_weights(path: Path) -> None:
    """A checkpoint directory's weight files: there, and each safetensors file whole (its
    header read, which names every byte the file must hold), so that a truncated download
    or copy is one line here, not every worker's error as it loads."""
    from safetensors import SafetensorError, safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files and not any(path.glob("*.bin")):
        raise ConfigError("model.path", f"{str(path)!r} holds no weights (*.safetensors, or pytorch_model*.bin)")
    for f in files:
        try:
            with safe_open(f, "np"):
                pass
        except (SafetensorError, OSError) as e:
            raise ConfigError("model.path", f"{f.name} in {str(path)!r} is incomplete or no safetensors file "
                                            f"({e}): copy or download it again") from None


def check_rewards(functions: Mapping[str, float]) -> None:
    """``reward.functions``: what ``m2flow.rewards.scorer.resolve_reward`` takes."""
    if not functions:
        raise ConfigError("reward.functions", "empty: name at least one reward, e.g. reward.functions.math=1.0")
    for name in functions:
        module, sep, fn = name.partition(":")
        if name not in BUILTIN_REWARDS and not (sep and module and fn):
            raise ConfigError(f"reward.functions.{name}", f"expected a built-in reward ({' | '.join(BUILTIN_REWARDS)})"
                                                          " or package.module:function")


def check_importable(cfg: DictConfig | Mapping) -> None:
    """For a run on an embedded Ray, whose workers import what this process can (and from its
    working directory, as Ray adds it to theirs): the modules of ``reward.functions`` and the
    vLLM backend, each a config error here if it is not there, before any worker starts. On an
    existing cluster the workers' environment is the cluster's: nothing is checked."""
    d = resolved(cfg)
    if d["cluster"]["address"] is not None:
        return
    for name in d["reward"]["functions"]:
        module, sep, function = name.partition(":")
        if sep and not _importable(module):
            raise ConfigError(f"reward.functions.{name}", f"no module {module!r} can be imported here (nor from "
                                                          f"the working directory)")
        if sep and (source := _source(module)) is not None and not _may_define(source, function):
            raise ConfigError(f"reward.functions.{name}", f"{source} defines no {function!r}")
    if d["rollout"]["backend"] == "vllm" and not _importable("vllm"):
        raise ConfigError("rollout.backend", "vllm: vLLM is not installed here (pip install vllm; it needs a CUDA GPU)")


def _source(module: str) -> Path | None:
    """The .py file ``module`` would be imported from (None: none, or not plain source)."""
    try:
        spec = _find_spec(module)
    except (ImportError, ValueError):
        return None
    origin = spec.origin if spec is not None else None
    return Path(origin) if origin and origin.endswith(".py") else None


def _may_define(source: Path, name: str) -> bool:
    """Whether the module's top level may bind ``name``, read without running it (importing a
    user's module here would run its side effects in the driver): False only where no def,
    class, assignment or import there binds it and none could (no ``*`` import or ``__getattr__``)."""
    try:
        text = source.read_text()
        tree = ast.parse(text, str(source))
    except (OSError, SyntaxError, ValueError):
        return True  # the worker's import reports it with its own traceback
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, ast.Global):
            bound.update(node.names)
    return bool(bound & {name, "*", "__getattr__"}) or "globals()" in text


def _find_spec(module: str) -> importlib.machinery.ModuleSpec | None:
    """``importlib.util.find_spec`` as the workers of an embedded Ray would find it: with the
    working directory on the path, as Ray adds it to theirs."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        return importlib.util.find_spec(module)
    finally:
        if added:
            sys.path.remove(cwd)


def _importable(module: str) -> bool:
    try:
        return _find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False
    except ValueError:  # in sys.modules without a spec: it is there
        return True


def check_data(data: Mapping, training: bool = True) -> None:
    """The prompt source exists and (``training``) holds enough problems for a step and the
    held-out set."""
    source, test = data["source"], data["test_size"]
    if source == "arithmetic":
        if not data["levels"]:
            raise ConfigError("data.levels", "empty: the arithmetic problems need at least one level (1-5)")
        train = data["train_size"]
        where = "data.train_size"
    elif source in ("calculation", "invented"):
        train, where = data["train_size"], "data.train_size"
    else:
        path = Path(source)
        if path.suffix not in (".jsonl", ".json", ".parquet"):
            raise ConfigError("data.source", f"expected arithmetic | calculation | invented or a .jsonl / .parquet "
                                             f"file, got {source!r}")
        if not path.is_file():
            raise ConfigError("data.source", f"no such file {source!r} (expected arithmetic | calculation | invented "
                                             "or a .jsonl / .parquet file)")
        rows = count_rows(path)
        if rows is None or not training:
            return  # unreadable here: loading the problems names the problem
        if rows <= test:
            raise ConfigError("data.test_size", f"data.source={source} has {rows} problems, not enough to hold out "
                                                f"{test} and train on the rest")
        train, where = rows - test, f"data.source={source} less data.test_size"
    if data["prompts_per_step"] > train:
        raise ConfigError("data.prompts_per_step", f"must be <= the {train} train prompts ({where}), "
                                                   f"got {data['prompts_per_step']}")


def count_rows(path: Path) -> int | None:
    """Rows in a .jsonl (non-empty lines, each JSON) or .parquet file (from its metadata); None
    if the file is malformed: loading the problems names the line or the cause."""
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(path).metadata.num_rows
        rows = 0
        with path.open() as f:
            for line in f:
                if line.strip():
                    json.loads(line)
                    rows += 1
        return rows
    except Exception:  # noqa: BLE001
        return None
