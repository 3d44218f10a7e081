"""Kernels as the layers use them: one lookup with the configured policy for attention, MLA and
MoE, and the checkpoint names that let remat policies reach MLA and MoE activations."""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

import maxnnx
from maxnnx.config import ModelConfig
from maxnnx.kernels import (
  ATTENTION_IMPLEMENTATIONS,
  RAGGED_DOT_IMPLEMENTATIONS,
  KernelUnsupportedError,
  LaxRaggedDot,
  XlaAttention,
  kernel_for,
)
from maxnnx.kernels.capabilities import reset_warnings
from maxnnx.layers.mla import MLA
from maxnnx.layers.moe import MoE

DENSE = dict(vocab_size=64, d_model=24, num_layers=2, num_heads=2, num_kv_heads=2, mlp_dim=40,
             head_dim=8, **{'runtime.attention_impl': 'xla'})
MLA_DIMS = {'attention.type': 'mla', 'head_dim': None, 'mla.kv_lora_rank': 8,
            'mla.qk_nope_head_dim': 8, 'mla.qk_rope_head_dim': 4, 'mla.v_head_dim': 8}
MOE_DIMS = {'moe.num_experts': 4, 'moe.num_experts_per_tok': 2, 'moe.mlp_dim': 16}
REFUSAL = 'declines every call in this test'


@dataclasses.dataclass(frozen=True)
class RefusingAttention(XlaAttention):
  """``xla``, declaring that it cannot serve any call."""

  name: str = 'refusing'

  def unsupported_reasons(self, request):
    """Every call is refused."""
    return [REFUSAL]


@dataclasses.dataclass(frozen=True)
class RefusingRaggedDot(LaxRaggedDot):
  """``lax``, declaring that it cannot serve any call."""

  name: str = 'refusing'

  def unsupported_reasons(self, request):
    """Every call is refused."""
    return [REFUSAL]


# layer -> (config, config field naming the refusing strategy, reference strategy, layer type)
LAYERS = {
    'mha': (DENSE, 'attention_impl', 'xla', maxnnx.layers.Attention),
    'mla': ({**DENSE, **MLA_DIMS}, 'attention_impl', 'xla', MLA),
    'moe': ({**DENSE, **MOE_DIMS}, 'ragged_dot_impl', 'lax', MoE),
}


@pytest.fixture
def refusing_strategies(monkeypatch):
  monkeypatch.setitem(ATTENTION_IMPLEMENTATIONS, 'refusing', RefusingAttention)
  monkeypatch.setitem(RAGGED_DOT_IMPLEMENTATIONS, 'refusing', RefusingRaggedDot)
  reset_warnings()


def _model(fields, **overrides):
  return maxnnx.Transformer(ModelConfig.from_dict({**fields, **overrides}), rngs=nnx.Rngs(0))


def _logits(model):
  ids = jnp.asarray(np.arange(16).reshape(2, 8) % 64, jnp.int32)
  return nnx.jit(lambda m, i: m(i))(model, ids)


def _layer_of(model, layer_type):
  return [node for _, node in nnx.iter_graph(model) if isinstance(node, layer_type)]


@pytest.mark.parametrize('layer', list(LAYERS))
def test_policy_reaches_every_layer(layer, refusing_strategies, caplog):
  """A strategy that declares it cannot serve the layer's call raises under 'error' and is
  replaced by the reference (one warning) under 'fallback', through the real layer."""
  fields, impl_field, reference, layer_type = LAYERS[layer]
  kind = impl_field.removesuffix('_impl')
  impl_key = f'runtime.{impl_field}'
  strict = _model(fields, **{impl_key: 'refusing', 'runtime.kernel_on_unsupported': 'error'})
  assert _layer_of(strict, layer_type), f'the config builds no {layer_type.__name__}'
  with pytest.raises(KernelUnsupportedError, match=f"{kind}_impl 'refusing'.*{REFUSAL}"):
    _logits(strict)
  lenient = _model(fields,
                   **{impl_key: 'refusing', 'runtime.kernel_on_unsupported': 'fallback'})
  with caplog.at_level(logging.WARNING, logger='maxnnx.kernels'):
    got = _logits(lenient)
  expected = _logits(_model(fields, **{impl_key: reference}))
  np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
  messages = [r.getMessage() for r in caplog.records]
  assert len(messages) == 1, messages
  assert f"{kind}_impl 'refusing' cannot serve" in messages[0]
  assert f"with '{reference}' instead" in messages[0]


def test_kernel_for_reads_the_config():
  """The helper picks the named strategy and the config's policy, for each kind."""
  cfg = ModelConfig.from_dict({**DENSE, 'runtime.ragged_dot_impl': 'tiled',
                              'runtime.kernel_on_unsupported': 'error'})
  attention, ragged = kernel_for(cfg, 'attention'), kernel_for(cfg, 'ragged_dot')
  assert (attention.name, attention.on_unsupported) == ('xla', 'error')
  assert (ragged.name, ragged.on_unsupported) == ('tiled', 'error')
  with pytest.raises(ValueError, match="Unknown kernel kind 'conv'"):
    kernel_for(cfg, 'conv')


def _saved_names(capsys, fn, *args) -> set[str]:
  """The checkpoint names among the residuals ``fn``'s backward pass keeps."""
  capsys.readouterr()
  print_saved_residuals(fn, *args)
  lines = capsys.readouterr().out.splitlines()
  return {line.split("named '")[1].split("'")[0] for line in lines if "named '" in line}


def _loss_fn(model, policy=None):
  """``params, rest -> scalar``; wrapped in ``jax.checkpoint`` under ``policy`` when given."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  ids = jnp.zeros((1, 8), jnp.int32)

  def loss(params, rest):
    return nnx.merge(graphdef, params, rest)(ids).astype(jnp.float32).sum()

  return (loss if policy is None else jax.checkpoint(loss, policy=policy)), params, rest


MLA_NAMES = {'query_proj', 'key_proj', 'value_proj', 'attention_out', 'out_proj'}


@pytest.mark.parametrize('policy,names', [
    ('save_dot_except_mlp', MLA_NAMES),
    ('save_qkv_proj', {'query_proj', 'key_proj', 'value_proj'}),
    ('save_out_proj', {'out_proj'}),
])
def test_remat_policies_reach_mla(policy, names, capsys, monkeypatch):
  """The block's remat policy saves MLA's named projections; untagged, nothing named is."""
  model = _model({**DENSE, **MLA_DIMS}, num_layers=1, **{'runtime.remat_policy': policy})
  assert _saved_names(capsys, *_loss_fn(model)) == names
  monkeypatch.setattr(maxnnx.layers.mla, 'checkpoint_name', lambda x, name: x)
  assert not _saved_names(capsys, *_loss_fn(model))


@pytest.mark.parametrize('dispatch', ['dropless', 'capacity'])
def test_moe_activations_carry_the_mlp_names(dispatch, capsys, monkeypatch):
  """A policy naming ``mlp_hidden``/``mlp_out`` saves the experts' activations (as for the
  dense MLP); untagged, it saves nothing named."""
  model = _model({**DENSE, **MOE_DIMS}, num_layers=1, **{'moe.dispatch': dispatch},
                 **{'moe.first_k_dense_layers': 0})
  policy = jax.checkpoint_policies.save_only_these_names('mlp_hidden', 'mlp_out')
  assert _saved_names(capsys, *_loss_fn(model, policy)) == {'mlp_hidden', 'mlp_out'}
  monkeypatch.setattr(maxnnx.layers.moe, 'checkpoint_name', lambda x, name: x)
  assert not _saved_names(capsys, *_loss_fn(model, policy))
