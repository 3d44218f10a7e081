"""Typed, validated configuration for maxnnx models.

Configs are frozen dataclasses. Every field is type-checked on construction, and
``from_dict`` rejects unknown keys with the nearest valid name, so a typo in a
YAML file or a ``key=value`` override fails at once instead of being ignored.

Two classes matter to users:

* :class:`RopeConfig`: how rotary position embeddings are computed.
* :class:`ModelConfig`: the architecture of a decoder-only transformer, with
  nested groups for attention (:class:`AttentionConfig`), Mixture-of-Experts
  (:class:`MoEConfig`), latent attention (:class:`MLAConfig`), Gated DeltaNet layers
  (:class:`LinearAttentionConfig`), multi-token prediction (:class:`MTPConfig`) and the
  runtime settings: dtypes, layer-stack layout, kernels (:class:`RuntimeConfig`).
"""

from maxnnx.config.attention import AttentionConfig
from maxnnx.config.base import ConfigError, ValidatedConfig, dotted_fields, resolve_dtype, subtree
from maxnnx.config.engine import EngineConfig
from maxnnx.config.groups import (
    GlobalAttentionConfig,
    LayerType,
    LinearAttentionConfig,
    MLAConfig,
    MoEConfig,
    MTPConfig,
    RematPolicy,
    RopeConfig,
    RopeScaling,
    RuntimeConfig,
    VisionConfig,
)
from maxnnx.config.mesh import MESH_AXES, MeshConfig, check_expert_split, check_ring_split
from maxnnx.config.model import ATTENTION_KEYS, FLAT_GROUP_KEYS, TRAINING_KEYS, ModelConfig

__all__ = [
    'ATTENTION_KEYS', 'FLAT_GROUP_KEYS', 'MESH_AXES', 'TRAINING_KEYS', 'AttentionConfig',
    'ConfigError', 'EngineConfig',
    'GlobalAttentionConfig',
    'LayerType', 'MLAConfig',
    'LinearAttentionConfig', 'MTPConfig', 'MeshConfig', 'ModelConfig', 'MoEConfig', 'RematPolicy',
    'RopeConfig', 'RopeScaling', 'RuntimeConfig', 'ValidatedConfig', 'VisionConfig',
    'check_expert_split', 'check_ring_split', 'dotted_fields', 'resolve_dtype', 'subtree',
]
