"""Text generation with a KV cache."""

from maxnnx.inference.chat import chat
from maxnnx.inference.generate import GenerationResult, generate
from maxnnx.inference.sampling import sample_next_token
from maxnnx.inference.speculative import DraftModel, MTPDraft, PromptLookup
from maxnnx.inference.stops import end_of_turn_ids, eos_token_ids

__all__ = ['DraftModel', 'GenerationResult', 'MTPDraft', 'PromptLookup', 'chat',
           'end_of_turn_ids', 'eos_token_ids', 'generate', 'sample_next_token']
