"""Typed specs of what the lab builds and runs, validated once; the one import place for them.

`specs`: the model (`TableSpec`, `ModelSpec`); `hstu`: the HSTU ranker family (`HSTUSpec`);
`presets`: TOML model presets read into specs; `train`: the options of a training run
(`TrainConfig`); `rules`: the value checks they share.
"""

from dlrm_lab.config.hstu import HSTUSpec
from dlrm_lab.config.presets import available_presets, load_any_preset, load_preset, preset_family, preset_path
from dlrm_lab.config.specs import BYTES_PER_FP32, INTERACTIONS, ModelSpec, TableSpec
from dlrm_lab.config.train import (
    DENSE_OPTIMIZERS,
    EMBEDDING_OPTIMIZERS,
    PRECISIONS,
    SHARDING_CHOICES,
    SHARDING_TYPES,
    TABLE_PRECISIONS,
    TrainConfig,
)

__all__ = [
    "BYTES_PER_FP32",
    "DENSE_OPTIMIZERS",
    "EMBEDDING_OPTIMIZERS",
    "HSTUSpec",
    "INTERACTIONS",
    "PRECISIONS",
    "SHARDING_CHOICES",
    "SHARDING_TYPES",
    "TABLE_PRECISIONS",
    "ModelSpec",
    "TableSpec",
    "TrainConfig",
    "available_presets",
    "load_any_preset",
    "load_preset",
    "preset_family",
    "preset_path",
]
