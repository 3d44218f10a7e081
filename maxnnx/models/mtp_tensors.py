"""A checkpoint's multi-token-prediction (MTP) layers: which of the stored ones load, and the
embedding/head copies they store, which the model shares with the main stack (DeepSeek V3)."""

from __future__ import annotations

import logging
import re

import numpy as np

from maxnnx.config import ModelConfig
from maxnnx.models.hf import MTP_SHARED_COPIES, Family, PretrainedError

logger = logging.getLogger(__name__)


def choose_mtp_layers(cfg: ModelConfig, family: Family, tensors, explicit: bool, directory: str
                       ) -> tuple[ModelConfig, re.Pattern]:
  """``cfg`` with the MTP layers to load, and a pattern of stored layers to skip."""
  pattern = re.compile(r'model\.layers\.(\d+)\.')
  stored = len({int(m.group(1)) for n in tensors if (m := pattern.match(n))
                and int(m.group(1)) >= cfg.num_layers}) if family.mtp else 0
  wanted = cfg.mtp.num_layers
  if wanted > stored:
    if explicit:
      holds = (f'holds multi-token-prediction tensors for {stored} layer(s)' if family.mtp
               else f'is a {cfg.family} checkpoint, which has no multi-token-prediction layers')
      raise PretrainedError(f'{directory}: mtp.num_layers={wanted} but the checkpoint {holds}; '
                            f"pass mtp={{'num_layers': {stored}}} or fewer.")
    logger.info('%s: config.json declares %d multi-token-prediction layer(s) but the '
                'checkpoint holds tensors for %d; loading those.', directory, wanted, stored)
    cfg = cfg.replace(mtp={'num_layers': stored})
  elif wanted < stored:
    logger.info('%s: skipping %d of the checkpoint\'s %d multi-token-prediction layer(s) '
                '(mtp.num_layers=%d).', directory, stored - wanted, stored, wanted)
  first_skipped = cfg.num_layers + cfg.mtp.num_layers
  skipped = '|'.join(str(i) for i in range(first_skipped, cfg.num_layers + stored)) or '(?!)'
  return cfg, re.compile(rf'model\.layers\.({skipped})\.')


def check_mtp_copies(tensors, cfg: ModelConfig) -> set[str]:
  """Names of the embedding/head copies in loaded MTP layers; the model shares the
  main ones, so a copy that differs is reported."""
  names = set()
  for k in range(cfg.mtp.num_layers):
    for suffix, main in MTP_SHARED_COPIES.items():
      main = 'model.embed_tokens.weight' if cfg.tie_word_embeddings else main
      name = f'model.layers.{cfg.num_layers + k}.{suffix}'
      if name in tensors:
        names.add(name)
        if not np.array_equal(np.asarray(tensors[name][1]), np.asarray(tensors[main][1])):
          logger.warning('%s: %s differs from %s; the MTP module uses the main model\'s '
                         '(shared, as DeepSeek V3 trains it).', tensors[name][0], name, main)
  return names
