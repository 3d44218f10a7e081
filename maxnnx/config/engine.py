"""``EngineConfig``: the serving engine's settings (``maxnnx serve``'s engine keys)."""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from maxnnx.config.base import ConfigError, ValidatedConfig

_LOWEST = {'page_size': 1, 'max_batch': 1, 'token_budget': 1, 'max_pages': 1,
           'max_model_len': 1, 'max_logprobs': 0, 'seed': 0, 'max_window_pages': 1,
           'num_speculative_tokens': 1, 'prompt_lookup_max': 1, 'prompt_lookup_min': 1,
           'max_loras': 1, 'max_lora_rank': 1}
_OPTIONAL = ('max_pages', 'max_model_len', 'max_window_pages', 'max_loras')
#: The values of kv_cache_dtype (``maxnnx.kernels.kv_quant.KV_CACHE_DTYPES``: config imports no
#: kernels, a test keeps both equal).
KV_CACHE_DTYPES = ('auto', 'int8', 'fp8')


@dataclasses.dataclass(frozen=True)
class EngineConfig(ValidatedConfig):
  """How a serving :class:`~maxnnx.serving.Engine` batches, caches and samples.

  Attributes:
    max_batch: requests computed in one engine step at most.
    token_budget: tokens computed in one engine step at most (decode tokens plus prompt
      chunks); at least max_batch.
    page_size: tokens per KV-cache page.
    max_pages: KV-cache pages in the pool, per layer (None: enough for max_batch requests of
      max_model_len tokens); one more is allocated as scratch.
    max_window_pages: pages in the sliding layers' own pool, for models mixing sliding and
      full layers (None: twice what max_batch requests hold within the window). A prefix hit
      needs the sliding pages of the prefix's last window, which a small pool evicts first.
    max_model_len: prompt plus output tokens of one request (None: the model's
      max_position_embeddings).
    prefix_caching: reuse the KV-cache pages of prompt prefixes already computed (off, with a
      warning, for models with recurrent layers).
    max_logprobs: the most log-probabilities per token a request may ask for.
    seed: seed of requests that give none.
    token_buckets: the flat token counts a step is padded to (token_budget is always one;
      None: the powers of two from 8 below it).
    page_buckets: the pages per row a step gathers (ceil(max_model_len / page_size) is always
      one; None: the powers of two below it).
    kv_cache_dtype: how KV-cache pages store keys and values: auto (the compute dtype), int8 or
      fp8 (e4m3), each with a float32 scale per token and KV head (about half a bf16 page's
      bytes); recurrent states stay in the compute dtype.
    speculative_method: speculative decoding: none; ngram (prompt lookup: draft the tokens
      that followed the latest earlier occurrence of a request's last n tokens in its prompt
      and output, and verify them in one step); or draft_model (a smaller model of the same
      vocabulary drafts greedily: speculative_model, or Engine(..., draft_model=) from Python);
      or mtp (DeepSeek V3's multi-token-prediction module drafts greedily from the model's
      hidden states).
    num_speculative_tokens: draft tokens verified per request and step.
    speculative_model: the draft model of speculative_method=draft_model: a Hugging Face
      checkpoint directory (loaded with from_pretrained, in the model's dtype and on its mesh).
    prompt_lookup_max: the longest n-gram looked up (tried first).
    prompt_lookup_min: the shortest n-gram looked up.
    lora_modules: LoRA adapters served beside the base model, as name=path entries (PEFT
      directories, e.g. lora_modules=sql=out/sql/adapter,chat=out/chat/adapter; a dict
      {name: path} from Python); a request selects one by its name (the OpenAI API's model).
    max_loras: adapter slots held at once (None: one per lora_modules entry, at least one); at
      least the number of lora_modules; slots beyond them take adapters loaded later.
    max_lora_rank: the largest adapter rank served; smaller ranks are padded with zeros.
    lora_target_modules: projections (e.g. q_proj,v_proj) given adapter slots from the start
      beside those the lora_modules adapt, so that adapters of them can be loaded later
      (Engine.load_lora); only these projections can take an adapter loaded later.
    allow_runtime_lora_updating: the server takes POST /v1/load_lora_adapter and
      /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING); needs adapter slots
      (lora_modules or lora_target_modules).
  """

  _PATH = 'Engine'

  max_batch: int = 8
  token_budget: int = 256
  page_size: int = 16
  max_pages: int | None = None
  max_window_pages: int | None = None
  max_model_len: int | None = None
  prefix_caching: bool = True
  max_logprobs: int = 5
  seed: int = 0
  token_buckets: tuple[int, ...] | None = None
  page_buckets: tuple[int, ...] | None = None
  kv_cache_dtype: str = 'auto'
  # Speculative decoding (vLLM's names).
  speculative_method: Literal['none', 'ngram', 'draft_model', 'mtp'] = 'none'
  num_speculative_tokens: int = 3
  speculative_model: str = ''
  prompt_lookup_max: int = 3
  prompt_lookup_min: int = 1
  # Multi-LoRA serving (vLLM's names).
  lora_modules: tuple[str, ...] = ()
  max_loras: int | None = None
  max_lora_rank: int = 16
  lora_target_modules: tuple[str, ...] = ()
  allow_runtime_lora_updating: bool = False

  def __post_init__(self):
    for name, lowest in _LOWEST.items():
      value = getattr(self, name)
      if value is None and name in _OPTIONAL:
        continue  # the default size
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f'Engine {name}={value!r}: expected an integer >= {lowest}.')
      if value < lowest:
        raise ConfigError(f'Engine {name}={value}: must be >= {lowest}.')
      object.__setattr__(self, name, int(value))
    if self.kv_cache_dtype not in KV_CACHE_DTYPES:
      raise ConfigError(f'Engine kv_cache_dtype={self.kv_cache_dtype!r}: expected one of '
                        f"{', '.join(KV_CACHE_DTYPES)}.")
    if not isinstance(self.prefix_caching, bool):
      raise ConfigError(f'Engine prefix_caching={self.prefix_caching!r}: expected True or False.')
    for name in ('token_buckets', 'page_buckets'):  # one size, or a list from YAML
      value = getattr(self, name)
      if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = (value,)
      if isinstance(value, (list, tuple, np.ndarray)):
        value = tuple(int(v) if isinstance(v, np.integer) else v for v in value)
      object.__setattr__(self, name, value)
    if self.speculative_method not in ('none', 'ngram', 'draft_model', 'mtp'):
      raise ConfigError(f'Engine speculative_method={self.speculative_method!r}: expected '
                        "'none', 'ngram', 'draft_model' or 'mtp'.")
    if self.speculative_model and self.speculative_method != 'draft_model':
      raise ConfigError(f'Engine speculative_model={self.speculative_model!r} drafts only with '
                        "speculative_method='draft_model'; set it, or drop speculative_model.")
    if self.prompt_lookup_min > self.prompt_lookup_max:
      raise ConfigError(f'Engine prompt_lookup_min={self.prompt_lookup_min} is more than '
                        f'prompt_lookup_max={self.prompt_lookup_max}: lower it.')
    self._check_lora_modules()
    self._check_runtime_lora()
    super().__post_init__()

  def _check_lora_modules(self) -> None:
    """``lora_modules`` as ``('name=path', ...)`` (from a dict too), names unique and not
    empty, no more than ``max_loras``."""
    value = self.lora_modules
    if isinstance(value, dict):
      value = tuple(f'{name}={path}' for name, path in value.items())
    elif isinstance(value, str):
      value = tuple(v.strip() for v in value.split(',') if v.strip())
    value = tuple(value)
    names = []
    for entry in value:
      name, sep, path = entry.partition('=') if isinstance(entry, str) else ('', '', '')
      if not (sep and name.strip() and path.strip()):
        raise ConfigError(f'Engine lora_modules: {entry!r} is not name=path; give each adapter '
                          'as name=path (e.g. lora_modules=sql=out/sql/adapter).')
      names.append(name.strip())
    if len(set(names)) != len(names):
      raise ConfigError(f'Engine lora_modules: the names {names} repeat; give each adapter its '
                        'own name.')
    object.__setattr__(self, 'lora_modules', tuple(
        f'{n}={e.partition("=")[2].strip()}' for n, e in zip(names, value)))
    if self.max_loras is not None and self.max_loras < len(value):
      raise ConfigError(f'Engine max_loras={self.max_loras} holds fewer adapters than the '
                        f'{len(value)} of lora_modules; raise max_loras to {len(value)} (every '
                        'adapter stays loaded).')

  def _check_runtime_lora(self) -> None:
    """``lora_target_modules`` as a tuple of names; runtime updating only with slots."""
    value = self.lora_target_modules
    if isinstance(value, str):
      value = tuple(v.strip() for v in value.split(',') if v.strip())
    value = tuple(value)
    if not all(isinstance(v, str) and v for v in value):
      raise ConfigError(f'Engine lora_target_modules={value!r}: expected projection names '
                        '(e.g. lora_target_modules=q_proj,v_proj).')
    object.__setattr__(self, 'lora_target_modules', value)
    if not isinstance(self.allow_runtime_lora_updating, bool):
      raise ConfigError(f'Engine allow_runtime_lora_updating={self.allow_runtime_lora_updating!r}'
                        ': expected True or False.')
    if self.allow_runtime_lora_updating and not (value or self.lora_modules):
      raise ConfigError('Engine allow_runtime_lora_updating=True: no projection has adapter '
                        'slots to load into; name them with lora_target_modules (e.g. '
                        'q_proj,v_proj) or serve lora_modules from the start.')
