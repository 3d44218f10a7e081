"""Text generation with a KV cache."""

from maxnnx.inference.chat import chat, end_of_turn_ids
from maxnnx.inference.generate import GenerationResult, generate
from maxnnx.inference.sampling import sample_next_token
from maxnnx.inference.speculative import DraftModel, PromptLookup

__all__ = ['DraftModel', 'GenerationResult', 'PromptLookup', 'chat', 'end_of_turn_ids', 'generate',
           'sample_next_token']
