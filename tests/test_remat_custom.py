"""remat_policy='custom': per tagged tensor, kept on the device, offloaded to host, or recomputed.

The CPU backend lowers host offload to plain copies, so the memory it frees shows only on an
accelerator target (``docs/status.md`` records a TPU compile); here the tests pin down that the
numbers are those of no remat and that exactly the chosen tensors go to host memory and back.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx import cli
from maxnnx.config import ConfigError

OFFLOAD = ('query_proj', 'mlp_hidden')
SAVE = ('out_proj',)


def _model(**runtime):
  config = maxnnx.get_preset('tiny', num_layers=2, **{'runtime.dtype': 'float32'}, **runtime)
  return maxnnx.Transformer(config, rngs=nnx.Rngs(0))


def _loss(model, ids_BT):
  return jnp.mean(model(ids_BT).astype(jnp.float32) ** 2)


def _ids():
  return jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)), jnp.int32)


def test_custom_policy_gradients_equal_no_remat():
  ids = _ids()
  grad = nnx.jit(nnx.grad(_loss))
  reference = grad(_model(), ids)
  custom = grad(_model(**{'runtime.remat_policy': 'custom', 'runtime.remat_save': SAVE,
                          'runtime.remat_offload': OFFLOAD}), ids)
  for want, got in zip(jax.tree.leaves(reference), jax.tree.leaves(custom), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def _memory_moves(jaxpr) -> list[str]:
  """The memory spaces of every ``device_put`` in ``jaxpr`` and its sub-jaxprs."""
  moves = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'device_put':
      moves += [str(d) for d in eqn.params['devices']]
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, 'jaxpr', sub)
        if hasattr(inner, 'eqns'):
          moves += _memory_moves(inner)
  return moves


@pytest.mark.parametrize('offload', [OFFLOAD, ()])
def test_only_the_offloaded_tensors_go_to_host_and_back(offload):
  model = _model(**{'runtime.remat_policy': 'custom', 'runtime.remat_save': SAVE,
                    'runtime.remat_offload': offload})
  graphdef, state = nnx.split(model)
  jaxpr = jax.make_jaxpr(jax.grad(lambda s, ids: _loss(nnx.merge(graphdef, s), ids)))(
      state, _ids())
  moves = _memory_moves(jaxpr.jaxpr)
  # One copy out in the forward pass and one back in the backward pass, per tensor per layer.
  expected = 2 * len(offload)
  assert sum('Host' in m for m in moves) == expected
  assert sum('Device' in m for m in moves) == expected


@pytest.mark.parametrize('runtime,match', [
    ({'runtime.remat_offload': ('query_proj',)}, "remat_policy='none': set remat_policy='custom'"),
    ({'runtime.remat_policy': 'custom', 'runtime.remat_save': ('out_proj',),
      'runtime.remat_offload': ('out_proj',)},
     'out_proj is in both remat_save and remat_offload'),
    ({'runtime.remat_policy': 'custom', 'runtime.remat_offload': ('qkv',)}, 'remat_offload'),
])
def test_bad_custom_choices_name_the_field(runtime, match):
  with pytest.raises(ConfigError, match=match):
    maxnnx.get_preset('tiny', **runtime)


def _model_config(*args):
  options = cli.parse_overrides(list(args), cli.train_keys())
  run, _, changes, _ = cli._split_options(options)
  return cli._model_config(run, changes)[0]


def test_maxtext_remat_locations_become_the_custom_lists():
  model = _model_config('base_config=base.yml', 'per_device_batch_size=1',
                        'remat_policy=custom', 'qkv_proj=offload', 'out_proj=device',
                        'mlpwo=remat')
  runtime = model.runtime
  assert runtime.remat_policy == 'custom'
  assert runtime.remat_offload == ('query_proj', 'key_proj', 'value_proj')
  assert runtime.remat_save == ('out_proj',)


@pytest.mark.parametrize('args,match', [
    (('qkv_proj=offload',), "apply with remat_policy=custom, but remat_policy='full'"),
    (('remat_policy=custom', 'mlpwi_0=offload'), 'mlp_hidden'),
    (('remat_policy=custom', 'out_proj=host'), "out_proj='host': expected one of remat"),
])
def test_maxtext_remat_locations_refused_with_the_fix(args, match):
  with pytest.raises(cli.UsageError, match=match):
    _model_config('base_config=base.yml', 'per_device_batch_size=1', *args)
