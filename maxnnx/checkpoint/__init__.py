"""Checkpoint formats: safetensors (Hugging Face interop).

Training checkpoints (orbax: asynchronous, verified, with fallback to the
previous step) live in :mod:`maxnnx.checkpoint.manager`, imported on use.
"""

from maxnnx.checkpoint.safetensors import SafetensorsError, read_safetensors_dir, write_safetensors

__all__ = ['SafetensorsError', 'read_safetensors_dir', 'write_safetensors']
