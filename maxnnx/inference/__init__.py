"""Text generation with a KV cache."""

from maxnnx.inference.chat import chat, end_of_turn_ids
from maxnnx.inference.generate import GenerationResult, generate
from maxnnx.inference.sampling import sample_next_token

__all__ = ['GenerationResult', 'chat', 'end_of_turn_ids', 'generate', 'sample_next_token']
