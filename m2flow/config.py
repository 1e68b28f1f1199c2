"""Configs: YAML presets under m2flow/presets/, with command-line overrides (OmegaConf)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

PRESET_DIR = Path(__file__).resolve().parent / "presets"


def presets() -> list[str]:
    return sorted(str(p.relative_to(PRESET_DIR).with_suffix("")) for p in PRESET_DIR.rglob("*.yaml"))


def load_config(preset: str, overrides: list[str] | None = None) -> DictConfig:
    """``preset`` is a name under m2flow/presets/ (``embodied/ppo_cartpole``) or a YAML path;
    ``overrides`` are ``key.path=value`` strings. Unknown keys are errors, not typos
    silently ignored."""
    path = Path(preset)
    if not path.is_file():
        path = PRESET_DIR / f"{preset}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no preset {preset!r}; known presets: {', '.join(presets())}")
    cfg = OmegaConf.load(path)
    OmegaConf.set_struct(cfg, True)
    _open_empty_mappings(cfg)
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not key=value")
        try:
            cfg.merge_with_dotlist([item])
        except (ConfigAttributeError, ConfigKeyError) as e:
            raise ValueError(f"override {item!r}: no such key in preset {preset!r} ({e.msg.splitlines()[0]})") from None
    return cfg


def _open_empty_mappings(node: DictConfig) -> None:
    """An empty mapping in a preset (e.g. ``env.kwargs: {}``) takes any keys."""
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            if len(child) == 0:
                OmegaConf.set_struct(child, False)
            else:
                _open_empty_mappings(child)
