"""Configs: typed sections with defaults (``schema``), presets shipped in m2flow/presets/ as
deltas over those defaults, ``key.path=value`` overrides (``loader``) and the checks a config
passes before anything starts (``validate``)."""

from m2flow.config.loader import PRESET_DIR, load_config, presets, to_yaml
from m2flow.config.flows import root_of, shipped
from m2flow.config.schema import EmbodiedConfig, ReasoningConfig
from m2flow.config.validate import ConfigError, validate

__all__ = ["PRESET_DIR", "ConfigError", "EmbodiedConfig", "ReasoningConfig", "load_config", "presets",
           "root_of", "shipped", "to_yaml", "validate"]
