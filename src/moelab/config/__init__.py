"""Run configuration: one small frozen dataclass per component, YAML files and dotted overrides.

A run config is ``RunConfig(model=..., data=..., optim=..., train=...)``. Each component receives
only its own config. ``load_config`` reads a preset name or a YAML path (on top of its
``base:``, a preset or another file, field by field), applies ``a.b=value`` overrides (each
field once) and validates everything, raising ``ConfigError`` that names the field and the fix.

Modules: ``errors`` (ConfigError), ``model`` (ModelConfig), ``data`` (DataConfig and its
operations), ``run`` (OptimConfig, TrainConfig, ParallelConfig, RunConfig) and ``io`` (building
from dicts, YAML, presets and overrides; saving). Import the names from ``moelab.config``.
"""

from moelab.config.data import ContextStage, DataConfig, DataSegment, Fallback, MixtureChange
from moelab.config.errors import ConfigError
from moelab.config.io import (
    OPERATION_FIELDS,
    apply_overrides,
    config_from_dict,
    flatten_config,
    load_config,
    load_run_config,
    load_yaml,
    migrate,
    preset_names,
    save_config,
    split_overrides,
)
from moelab.config.model import CONV_SITES, ModelConfig
from moelab.config.run import Decay, OptimConfig, ParallelConfig, RunConfig, TrainConfig

__all__ = [
    "ConfigError", "CONV_SITES", "ModelConfig", "MixtureChange", "ContextStage", "DataSegment",
    "Fallback",
    "DataConfig", "Decay", "OptimConfig", "TrainConfig", "ParallelConfig", "RunConfig",
    "config_from_dict", "preset_names", "apply_overrides", "load_config", "load_run_config",
    "load_yaml", "migrate", "save_config", "OPERATION_FIELDS", "flatten_config", "split_overrides",
]
