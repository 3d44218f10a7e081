"""maxnnx: pre-train, fine-tune and serve open LLM families in JAX with flax.nnx.

Quick tour::

  import maxnnx
  from flax import nnx

  cfg = maxnnx.get_preset('tiny')
  model = maxnnx.Transformer(cfg, rngs=nnx.Rngs(0))       # a plain nnx.Module
  model = maxnnx.from_pretrained('path/to/hf_checkpoint')  # or load Hugging Face weights
  out = maxnnx.generate(model, [[1, 2, 3]], max_new_tokens=20)
  maxnnx.save_pretrained(model, 'exported/')               # loadable by transformers

  trainer = maxnnx.Trainer(model, maxnnx.TrainConfig(steps=100, mesh=maxnnx.MeshConfig(fsdp=-1)))

Importing maxnnx also tunes the host allocator for the CPU backend before JAX starts
(:mod:`maxnnx.host_memory`; ``MAXNNX_KEEP_HOST_MEMORY=0`` turns that off).
"""

# First of all: tunes the host allocator before anything can start a JAX backend.
from maxnnx import host_memory  # noqa: F401
from maxnnx.checkpoint.safetensors import SafetensorsError
from maxnnx.config import (
    ConfigError,
    MeshConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    MTPConfig,
    RopeConfig,
    RuntimeConfig,
)
from maxnnx.inference.chat import chat
from maxnnx.inference.generate import GenerationResult, generate
from maxnnx.models.counting import num_active_params, num_params, num_vision_params
from maxnnx.models.hf import PretrainedError
from maxnnx.models.pretrained import (
  config_from_pretrained,
  from_maxtext,
  from_pretrained,
  save_pretrained,
)
from maxnnx.models.transformer import Transformer
from maxnnx.presets import get_preset, list_presets

__version__ = '0.1.0'

# Training and data pull in optax, orbax and grain: imported on first use, so that
# `import maxnnx` stays light for inference.
_LAZY = {
    'Trainer': 'maxnnx.train',
    'TrainConfig': 'maxnnx.train',
    'DataConfig': 'maxnnx.data',
    'make_pipeline': 'maxnnx.data',
}


def __getattr__(name: str):
  if name in _LAZY:
    import importlib  # noqa: PLC0415
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'maxnnx' has no attribute '{name}'")


def __dir__():
  return sorted(set(globals()) | set(_LAZY))

__all__ = [
    'ConfigError', 'DataConfig', 'GenerationResult', 'MLAConfig', 'MTPConfig', 'MeshConfig',
    'ModelConfig', 'MoEConfig', 'PretrainedError', 'RopeConfig', 'RuntimeConfig',
    'SafetensorsError', 'TrainConfig', 'Trainer', 'Transformer', 'config_from_pretrained',
    'chat', 'from_maxtext', 'from_pretrained', 'generate', 'get_preset', 'list_presets',
    'make_pipeline',
    'num_active_params', 'num_params', 'num_vision_params', 'save_pretrained',
]
