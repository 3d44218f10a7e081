"""Multi-head latent attention: the cache is compressed, and the YaRN softmax scale."""

import math
import os

from conftest import FIXTURES

import maxnnx
from maxnnx.layers.mla import MLA, mla_query_scale


def test_cache_holds_the_latent_and_rope_key_only():
  model = maxnnx.from_pretrained(os.path.join(FIXTURES, 'deepseek_v2'))
  cfg = model.config
  model.init_cache(2, 16)
  attn = model.layers[0].attn
  assert isinstance(attn, MLA)
  assert attn.cache_latent.shape == (2, 16, cfg.mla.kv_lora_rank)
  assert attn.cache_k_rope.shape == (2, 16, cfg.mla.qk_rope_head_dim)
  assert not hasattr(attn, 'cache_k')
  full = 2 * cfg.num_heads * (cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim)
  assert cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim < full


def test_yarn_mscale_scales_the_softmax():
  cfg = maxnnx.config_from_pretrained(os.path.join(FIXTURES, 'deepseek_v3'))
  mscale = 0.1 * 0.8 * math.log(4.0) + 1.0   # mscale_all_dim 0.8, factor 4
  assert math.isclose(mla_query_scale(cfg), 24**-0.5 * mscale**2)
  assert math.isclose(mla_query_scale(cfg.replace(query_scale=0.5)), 0.5)
