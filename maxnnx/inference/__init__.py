"""Text generation with a KV cache."""

from maxnnx.inference.generate import GenerationResult, generate
from maxnnx.inference.sampling import sample_next_token

__all__ = ['GenerationResult', 'generate', 'sample_next_token']
