"""GPT-3 as MaxText builds it, which is GPT-2's architecture; loads and saves GPT-2 checkpoints.

Architecture choices, all expressed as :class:`ModelConfig` fields:

* positions enter as a learned table added to the token embeddings
  (``position_embedding='learned'``); nothing is rotated;
* pre-norm blocks with LayerNorm (``norm_type='layer'``, scale and bias, eps 1e-5);
* multi-head attention with biases on q, k, v and the output projection;
* a plain two-layer MLP with biases and tanh-approximated GELU (``mlp_gated=False``);
* the output head is the token embedding (tied).

The GPT-3 paper alternates dense and locally banded sparse attention; MaxText's
``gpt3`` decoder block, and these presets, use dense causal attention in every
layer. MaxText parametrises its LayerNorm scale as ``1 + w``; here it is ``w``, the
same function (and GPT-2's layout).

No transformers class is GPT-3, so the Hugging Face mapping is GPT-2's
(``GPT2LMHeadModel``), whose architecture is the same: ``transformer.wte`` /
``wpe`` / ``h.{i}`` / ``ln_f``, with ``Conv1D`` weights stored ``[in, out]`` and
q, k, v fused into ``attn.c_attn`` (columns q, then k, then v). Checkpoints saved
from a bare ``GPT2Model`` (no ``transformer.`` prefix, as on the Hub) load too.
"""

import numpy as np

from maxnnx.config import ModelConfig
from maxnnx.models.hf import Family, HFConfig, PretrainedError, TensorDict
from maxnnx.models.registry import FamilySpec

# -- Hugging Face mapping ----------------------------------------------------------------------

_ACTIVATION_NAMES = {'gelu_tanh': 'gelu_new', 'gelu': 'gelu', 'relu': 'relu', 'silu': 'silu'}


def config_from_hf(hf: HFConfig) -> ModelConfig:
  for key in ('scale_attn_by_inverse_layer_idx', 'add_cross_attention'):
    if hf.get(key):
      raise PretrainedError(f'{hf.path}: {key}=true is not supported (maxnnx loads '
                            'decoder-only GPT-2 models with one attention scale for all layers).')
  d_model, num_heads = hf.require('n_embd'), hf.require('n_head')
  eos = hf.data.get('eos_token_id')
  return ModelConfig.from_dict({
      **DIFFERENCES, 'family': 'gpt3', 'vocab_size': hf.require('vocab_size'),
      'd_model': d_model, 'num_layers': hf.require('n_layer'), 'num_heads': num_heads,
      'num_kv_heads': num_heads, 'mlp_dim': hf.get('n_inner') or 4 * d_model,
      'max_position_embeddings': hf.require('n_positions'),
      'norm_eps': float(hf.require('layer_norm_epsilon')),
      'tie_word_embeddings': bool(hf.get('tie_word_embeddings', True)),
      'mlp_activation': hf.activation('activation_function'),
      'attention.query_scale': None if hf.get('scale_attn_weights', True) else 1.0,
      'bos_token_id': hf.data.get('bos_token_id'),
      'eos_token_id': tuple(eos) if isinstance(eos, list) else eos,
      'pad_token_id': hf.data.get('pad_token_id')})


def config_to_hf(cfg: ModelConfig) -> dict:
  unscaled = cfg.attention.query_scale is not None and cfg.attention.query_scale == 1.0
  out = {
      'architectures': ['GPT2LMHeadModel'],
      'model_type': 'gpt2',
      'vocab_size': cfg.vocab_size,
      'n_embd': cfg.d_model,
      'n_layer': cfg.num_layers,
      'n_head': cfg.num_heads,
      'n_inner': cfg.mlp_dim,
      'n_positions': cfg.max_position_embeddings,
      'layer_norm_epsilon': cfg.norm_eps,
      'activation_function': _ACTIVATION_NAMES[cfg.mlp_activation],
      'scale_attn_weights': not unscaled,
      'tie_word_embeddings': cfg.tie_word_embeddings,
      # maxnnx models have no dropout; say so rather than inherit GPT-2's 0.1.
      'resid_pdrop': 0.0, 'embd_pdrop': 0.0, 'attn_pdrop': 0.0,
      'dtype': cfg.runtime.param_dtype,
      'bos_token_id': cfg.bos_token_id,
      'eos_token_id': list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple)
                      else cfg.eos_token_id,
      'pad_token_id': cfg.pad_token_id,
  }
  _refuse_what_gpt2_cannot_hold(cfg, out)
  return out


def _refuse_what_gpt2_cannot_hold(cfg: ModelConfig, out: dict) -> None:
  """GPT-2's config has no key for most :class:`ModelConfig` fields: export refuses a
  model that its ``config.json`` would describe differently."""
  back = config_from_hf(HFConfig(out, 'config.json', SPEC.hf.defaults))

  def described(c: ModelConfig) -> dict:
    c = c.replace(head_dim=c.resolved_head_dim,
                  **{'attention.query_scale': c.resolved_query_scale})
    flat = c.to_dict()
    for key in ('runtime', 'rope', 'initializer_range', 'family'):  # not architecture, or unused
      flat.pop(key)
    return flat

  ours, theirs = described(cfg), described(back)
  differ = sorted(k for k in ours if ours[k] != theirs[k])
  if differ:
    shown = ', '.join(f'{k}={ours[k]!r} (GPT-2: {theirs[k]!r})' for k in differ)
    raise PretrainedError(f'A GPT-2 checkpoint cannot hold this model: {shown}.')


_CONV1D = ('attn.c_proj', 'mlp.c_fc', 'mlp.c_proj')  # besides the fused attn.c_attn


def unfuse(tensors: TensorDict, cfg: ModelConfig) -> TensorDict:
  """GPT-2 tensors in the ``Linear`` layout the loader expects: every ``Conv1D`` weight
  ``[in, out]`` transposed, and ``attn.c_attn`` split into ``attn.{q,k,v}_proj``."""
  if not any(name.startswith('transformer.') for name in tensors):  # saved from GPT2Model
    tensors = {name if name == 'lm_head.weight' else f'transformer.{name}': value
               for name, value in tensors.items()}
  out = dict(tensors)
  for i in range(cfg.num_layers):
    prefix = f'transformer.h.{i}.'
    for module in _CONV1D:
      if (name := f'{prefix}{module}.weight') in out:
        source, weight = out[name]
        out[name] = (source, np.asarray(weight).T)
    for leaf, axis in (('weight', 1), ('bias', 0)):
      name = f'{prefix}attn.c_attn.{leaf}'
      if name not in out:
        continue
      source, fused = out.pop(name)
      fused = np.asarray(fused)
      if fused.shape[axis] != 3 * cfg.d_model:
        raise PretrainedError(f"{source}: tensor '{name}' has shape {fused.shape}; n_embd "
                              f'{cfg.d_model} implies {3 * cfg.d_model} q, k, v columns.')
      for part, piece in zip('qkv', np.split(fused, 3, axis=axis)):
        out[f'{prefix}attn.{part}_proj.{leaf}'] = (source, piece.T if leaf == 'weight' else piece)
  return out


def fused_modules(cfg: ModelConfig) -> dict[str, tuple[tuple[str, int], ...]]:
  """``attn.c_attn`` holds the outputs of q, k and v (``d_model`` each)."""
  return {'attn.c_attn': tuple((f'attn.{part}_proj', cfg.d_model) for part in 'qkv')}


def fuse(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
  """Inverse of :func:`unfuse`, for export (of the layers present: a process of a
  multi-process save holds some)."""
  out = dict(tensors)
  for i in range(cfg.num_layers):
    prefix = f'transformer.h.{i}.'
    if f'{prefix}attn.q_proj.weight' not in out:
      continue
    weights = [out.pop(f'{prefix}attn.{part}_proj.weight') for part in 'qkv']
    out[f'{prefix}attn.c_attn.weight'] = np.ascontiguousarray(np.concatenate(weights).T)
    out[f'{prefix}attn.c_attn.bias'] = np.concatenate(
        [out.pop(f'{prefix}attn.{part}_proj.bias') for part in 'qkv'])
    for module in _CONV1D:
      name = f'{prefix}{module}.weight'
      out[name] = np.ascontiguousarray(out[name].T)
  return out


# -- Presets (MaxText's gpt3-*.yml) ------------------------------------------------------------


def _gpt3(vocab_size: int, d_model: int, num_layers: int, num_heads: int, mlp_dim: int,
          max_position_embeddings: int) -> ModelConfig:
  return SPEC.config(vocab_size=vocab_size, d_model=d_model, num_layers=num_layers,
                     num_heads=num_heads, num_kv_heads=num_heads, mlp_dim=mlp_dim,
                     max_position_embeddings=max_position_embeddings)


def gpt3_52k() -> ModelConfig:
  """MaxText's gpt3-52k test model (52,464 parameters; 2,048 positions)."""
  return _gpt3(1024, 16, 1, 2, 64, 2048)


def gpt3_6b() -> ModelConfig:
  """MaxText's gpt3-6b (5.59B parameters; d_model 3072, 48 layers, 16,384 positions)."""
  return _gpt3(32_768, 3072, 48, 12, 12_288, 16_384)


def gpt3_22b() -> ModelConfig:
  """MaxText's gpt3-22b (22.0B parameters; d_model 6144, 48 layers, 16,384 positions)."""
  return _gpt3(32_768, 6144, 48, 24, 24_576, 16_384)


def gpt3_175b() -> ModelConfig:
  """GPT-3 175B as MaxText configures it (174.8B parameters; the paper's 175.0B counts
  its 50,257-token vocabulary and 2,048 positions, MaxText pads to 50,304 and 16,384)."""
  return _gpt3(50_304, 12_288, 96, 96, 49_152, 16_384)


DIFFERENCES = {'position_embedding': 'learned', 'norm_type': 'layer', 'norm_eps': 1e-5,
               'attention': {'qkv_bias': True, 'out_bias': True}, 'mlp_gated': False,
               'mlp_activation': 'gelu_tanh', 'mlp_bias': True, 'tie_word_embeddings': True}

SPEC = FamilySpec(
    name='gpt3',
    description='GPT-2/GPT-3: learned absolute positions instead of rotary, LayerNorm with '
                'biases, biases on every projection, a plain tanh-GELU MLP and tied output; '
                'Hugging Face checkpoints are GPT-2\'s (Conv1D weights, fused q/k/v).',
    hf=Family('gpt3', ('gpt2',), 'GPT2LMHeadModel', config_from_hf, config_to_hf,
              defaults={'layer_norm_epsilon': 1e-5, 'n_positions': 1024,
                        'activation_function': 'gelu_new'},
              module_names={'embed': 'transformer.wte', 'pos_embed': 'transformer.wpe',
                            'layers': 'transformer.h', 'final_norm': 'transformer.ln_f',
                            'attn': 'attn', 'attn_pre_norm': 'ln_1', 'mlp_pre_norm': 'ln_2',
                            'o_proj': 'c_proj', 'up_proj': 'c_fc', 'down_proj': 'c_proj'},
              unfuse=unfuse, fuse=fuse, fused_modules=fused_modules, conv1d=True),
    differences=DIFFERENCES,
    presets={'gpt3-52k': gpt3_52k, 'gpt3-6b': gpt3_6b, 'gpt3-22b': gpt3_22b,
             'gpt3-175b': gpt3_175b})
