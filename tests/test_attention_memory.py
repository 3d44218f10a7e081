"""A DeepSeek-shaped training step (one dense MLA layer) with ``xla_flash`` holds no
float32 score buffer with a row per query and a column per key for every head
(``[B, H, T, S]``).

``xla`` forms the whole score matrix and autodiff keeps the softmax for the backward
pass; ``xla_flash`` scores query blocks and, where its run-time causality check fails,
used to fall back to one block over all rows and keys, which is that same matrix (8 GiB
a layer at 128 heads and 4,096 tokens). Its fallback now keeps the query blocks.
"""

import re

import numpy as np
import pytest

import maxnnx
from maxnnx.config import MeshConfig
from maxnnx.train import TrainConfig, Trainer

HEADS, SEQ = 4, 512
TINY_MLA = dict(d_model=32, num_layers=1, num_heads=HEADS, num_kv_heads=HEADS, mlp_dim=64,
                vocab_size=128, mtp={'num_layers': 0},
                mla={'q_lora_rank': 16, 'kv_lora_rank': 16, 'qk_nope_head_dim': 16,
                     'qk_rope_head_dim': 8, 'v_head_dim': 16},
                moe={'num_experts': 0})


def _compiled_step_text(impl: str) -> str:
  """HLO text of the compiled training step (batch of one)."""
  model = maxnnx.get_preset('deepseek-v3', runtime={'attention_impl': impl}, **TINY_MLA)
  trainer = Trainer(model, TrainConfig(global_batch_size=1, seq_len=SEQ,
                                       mesh=MeshConfig(data=1, fsdp=1)))
  trainer.compile(verbose=False)
  return trainer._compiled.as_text()


def _largest_float32_buffer(impl: str) -> int:
  """Elements of the largest float32 array in the compiled training step (batch of one)."""
  shapes = re.findall(r'\bf32\[([0-9,]+)\]', _compiled_step_text(impl))
  return max(int(np.prod([int(d) for d in s.split(',')])) for s in shapes)


@pytest.mark.parametrize('impl, holds_scores', [('xla', True), ('xla_flash', False)])
def test_training_step_float32_buffers_stay_below_one_score_per_head_and_pair(impl,
                                                                              holds_scores):
  """Every float32 buffer is smaller than ``HEADS x SEQ x SEQ`` with ``xla_flash`` (its
  largest is one query block's ``[H, T / 8, S]``); ``xla``'s scores reach it."""
  largest, scores = _largest_float32_buffer(impl), HEADS * SEQ * SEQ
  assert (largest >= scores) == holds_scores, (impl, largest, scores)
  if not holds_scores:
    assert largest <= scores // 4


@pytest.mark.parametrize('impl, holds_mask', [('xla', True), ('xla_flash', False)])
def test_training_step_has_no_query_by_key_buffer(impl, holds_mask):
  """``xla_flash`` builds the causal mask per query block from the segment ids and
  positions and checks index order in O(B T): no array of any type has a query axis
  and a key axis both whole (``[B, T, S]``, 16 MiB a row at 4,096 tokens); ``xla``'s
  dense mask and scores do."""
  shapes = re.findall(r'\b[a-z]+[0-9]*\[([0-9,]+)\]', _compiled_step_text(impl))
  whole = [s for s in shapes if f',{SEQ},{SEQ},' in f',{s},']
  assert bool(whole) == holds_mask, (impl, sorted(set(whole)))
