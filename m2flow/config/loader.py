"""Loading a config: a preset (a YAML delta over the schema's defaults, in m2flow/presets/ or
any YAML file), then ``key.path=value`` overrides, then the checks of ``validate``. Every
mistake is a one-line ``ConfigError`` naming the key."""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    InterpolationResolutionError,
    OmegaConfBaseException,
    ValidationError,
)

from m2flow.config.flows import UnknownFlow, root_of, shipped
from m2flow.config.schema import REMOVED, RENAMED
from m2flow.config.validate import ConfigError, resolved, validate

PRESET_DIR = Path(__file__).resolve().parents[1] / "presets"


def presets() -> list[str]:
    """The presets shipped with the package, as ``flow/name``."""
    return sorted(str(p.relative_to(PRESET_DIR).with_suffix("")).replace("\\", "/") for p in PRESET_DIR.rglob("*.yaml"))


def preset_path(preset: str) -> Path:
    """A preset name (``embodied/ppo_cartpole``) or the path of a YAML file."""
    path = Path(preset)
    if not path.is_file():
        path = PRESET_DIR / f"{preset}.yaml"
    if not path.is_file():
        raise ConfigError("preset", f"no preset or file {preset!r}; presets: {', '.join(presets())}")
    return path


def load_config(preset: str, overrides: list[str] | None = None, validate_config: bool = True,
                training: bool = True) -> DictConfig:
    """The config of ``preset`` with ``overrides`` (``key.path=value`` strings) applied:
    typed (each key has the schema's type), checked (``validate``), interpolations such as
    ``runs/${name}`` left to resolve on access (``training``: see ``validate``). Raises
    ``ConfigError``."""
    path = preset_path(preset)
    try:
        delta = OmegaConf.load(path)
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        raise ConfigError("preset", f"{path} is not a valid config file: {str(e).splitlines()[0]}") from None
    if not isinstance(delta, DictConfig):
        raise ConfigError("preset", f"{path} is not a mapping of sections")
    flow = delta.get("flow")
    try:
        root = root_of(flow)
    except UnknownFlow as e:
        raise ConfigError("flow", f"{e} (in {path})") from None
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(root), delta)
    except OmegaConfBaseException as e:
        raise translate(e, root, where=f" (in {path})") from None
    for item in overrides or []:
        apply_override(cfg, root, item)
    if cfg.flow != flow:
        raise ConfigError("flow", f"must stay {flow!r}, the flow of {preset} (for another flow, start from one of "
                                  f"its presets), got {cfg.flow!r}")
    try:
        missing = sorted(OmegaConf.missing_keys(cfg))
    except OmegaConfBaseException as e:  # an interpolation that does not resolve
        raise translate(e, root) from None
    if missing:
        also = f" (also unset: {', '.join(missing[1:])})" if len(missing) > 1 else ""
        raise ConfigError(missing[0], f"required and not set: the preset must set it, or add {missing[0]}=VALUE{also}")
    if validate_config:
        validate(cfg, training)
    return cfg


def apply_override(cfg: DictConfig, root: type, item: str) -> None:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(item, "an override is key.path=value")
    if key == "placement" and value.startswith("@"):  # placement=@plan.yaml: run a plan file as it is
        key, value = "placement.plan", value[1:]
        item = f"{key}={value}"
    elif key == "placement":  # placement=auto (or another mode)
        key = "placement.mode"
        item = f"{key}={value}"
    hint = hint_at(root, key)
    if _base(hint) is str:  # a text as typed, not read as YAML (a " #" is no comment, 0001 no number)
        text = None if value == "null" and hint is not str else _unquoted(value)
        try:
            OmegaConf.update(cfg, key, text, merge=False)
        except OmegaConfBaseException as e:
            raise translate(e, root, key=key, value=value) from None
        return
    try:
        cfg.merge_with_dotlist([item])
    except yaml.YAMLError as e:  # not YAML: a bracket left open, a value starting with @ or *
        problem = str(e).replace("\n", " ").split(" in \"<unicode string>\"")[0].strip()
        raise ConfigError(key, f"cannot read {value!r} ({problem}): quote it, or mend its brackets") from None
    except ValidationError as e:
        if _integral(value) and _base(hint) is int:  # 1e6 for an int key
            cfg.merge_with_dotlist([f"{key}={int(float(value))}"])
            return
        raise translate(e, root, key=key, value=value) from None
    except OmegaConfBaseException as e:
        raise translate(e, root, key=key, value=value) from None


def _unquoted(value: str) -> str:
    """``value`` without one pair of matching quotes around it, as a shell passes them on."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def _integral(value: str) -> bool:
    try:
        return float(value).is_integer()
    except ValueError:
        return False


# -------------------------------------------------------------------- messages


def translate(e: OmegaConfBaseException, root: type, key: str | None = None, value: str | None = None,
              where: str = "") -> ConfigError:
    """OmegaConf's error as a ``ConfigError`` on one line. ``key`` and ``value``: the override's."""
    full = e.full_key or key or "config"
    if isinstance(e, (ConfigAttributeError, ConfigKeyError)):
        return ConfigError(full, unknown_key(root, full) + where)
    hint = hint_at(root, full)
    if isinstance(e, ValidationError) and hint is not None:
        if dataclasses.is_dataclass(hint):
            first = dataclasses.fields(hint)[0].name
            return ConfigError(full, f"is a section: set its keys, e.g. {full}.{first}=VALUE{where}")
        if key is not None and key != full and key.startswith(full + "."):
            return ConfigError(key, f"no such key: {full} is {describe(hint)}, not a section{where}")
        return ConfigError(full, f"expected {describe(hint)}, got {_given(e, value if key == full else None)}{where}")
    problem = str(e.msg).splitlines()[0]
    if isinstance(e, InterpolationResolutionError):
        problem = f"cannot resolve its interpolation: {problem}"
    return ConfigError(full, problem + where)


def _given(e: OmegaConfBaseException, value: str | None) -> str:
    if "is not Optional" in str(e.msg) or value in ("null", "~", ""):
        return "null"
    if value is not None:
        return repr(value)
    m = re.match(r"Value '(.*)' (?:of type '(\w+)'|is not)", str(e.msg))
    if not m:
        return "another type"
    return repr(m.group(1)) if m.group(2) in (None, "str") else m.group(1)


def unknown_key(root: type, key: str) -> str:
    """'no such key', with the closest known key, or the keys there are."""
    if key in RENAMED:
        return f"renamed: use {RENAMED[key]}"
    if key in REMOVED:
        return f"removed: {REMOVED[key]}"
    parent, _, leaf = key.rpartition(".")
    hint = hint_at(root, parent) if parent else root
    if not dataclasses.is_dataclass(hint):
        return f"no such key: {parent} is {describe(hint)}, not a section"
    known = [f.name for f in dataclasses.fields(hint)]
    close = difflib.get_close_matches(leaf, known, n=1, cutoff=0.6)
    elsewhere = [p for p in leaf_paths(root) if p.rpartition(".")[2] == leaf]
    if close:
        return f"no such key; did you mean {parent + '.' if parent else ''}{close[0]}?"
    if elsewhere:
        return f"no such key; did you mean {elsewhere[0]}?"
    other = [f for f in shipped() if (cls := root_of(f)) is not root and hint_at(cls, key) is not None]
    flows = f" ({key} is a key of {other[0]} configs)" if other else ""
    return f"no such key{flows}; {parent or 'the config'} has: {', '.join(known)}"


def leaf_paths(cls: type, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        out += leaf_paths(hint, f"{prefix}{f.name}.") if dataclasses.is_dataclass(hint) else [prefix + f.name]
    return out


def hint_at(root: type, key: str) -> Any:
    """The schema's type at ``key`` (``a.b``, ``a.list[2]``, a key of an open mapping), or None."""
    hint: Any = root
    parts = [p for p in re.split(r"\.|\[(\d+)\]", key) if p]
    for part in parts:
        hint = _base(hint)
        if dataclasses.is_dataclass(hint):
            fields = typing.get_type_hints(hint)
            if part not in fields:
                return None
            hint = fields[part]
        elif typing.get_origin(hint) is dict:  # an open mapping: the rest of the path is its key
            return typing.get_args(hint)[1]
        elif typing.get_origin(hint) is list and part.isdigit():
            hint = typing.get_args(hint)[0]
        elif hint is Any:
            return Any
        else:
            return None
    return hint


def _base(hint: Any) -> Any:
    """``X`` of ``Optional[X]``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint


NAMES = {int: "an int", float: "a float", bool: "true or false", str: "a string"}


def describe(hint: Any) -> str:
    base = _base(hint)
    if base is not hint:
        return f"{describe(base)} or null"
    if typing.get_origin(hint) is list:
        return f"a list of {describe(typing.get_args(hint)[0]).split(' ', 1)[1]}s"
    if typing.get_origin(hint) is dict:
        return f"a mapping of names to {describe(typing.get_args(hint)[1]).split(' ', 1)[1]}s"
    if dataclasses.is_dataclass(hint):
        return "a section"
    return NAMES.get(hint, "any value")


# -------------------------------------------------------------------- printing


def to_yaml(cfg: DictConfig, docs: bool = False) -> str:
    """The resolved config as YAML; with ``docs``, each key's doc from the schema as a comment."""
    if not docs:
        return OmegaConf.to_yaml(cfg, resolve=True)
    plain = resolved(cfg)
    return "".join(_documented(plain, root_of(plain["flow"]), ""))


def _documented(d: dict, cls: type, indent: str) -> list[str]:
    lines, hints = [], typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        doc = f"  # {f.metadata['doc']}" if f.metadata.get("doc") else ""
        if dataclasses.is_dataclass(hints[f.name]):
            lines += [f"{indent}{f.name}:{doc}\n", *_documented(d[f.name], hints[f.name], indent + "  ")]
        else:
            item = yaml.safe_dump({f.name: d[f.name]}, default_flow_style=True, sort_keys=False, width=float("inf"))
            lines.append(f"{indent}{item.strip()[1:-1]}{doc}\n")  # {key: value} -> key: value
    return lines
