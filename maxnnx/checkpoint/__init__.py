"""Checkpoint formats: safetensors (Hugging Face interop)."""

from maxnnx.checkpoint.safetensors import SafetensorsError, read_safetensors_dir, write_safetensors

__all__ = ['SafetensorsError', 'read_safetensors_dir', 'write_safetensors']
