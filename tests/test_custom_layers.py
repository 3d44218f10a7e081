"""Custom layers through BlockParts: a gated attention subclass in both layer layouts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx.config import MeshConfig
from maxnnx.data import TokenWindows
from maxnnx.kernels.masks import AttentionMask
from maxnnx.layers import (
  MLP,
  Attention,
  BlockParts,
  DecoderBlock,
  LayerCall,
  RMSNorm,
  logical_param,
)
from maxnnx.layers.norm_factory import make_norm
from maxnnx.layers.rope import RotaryEmbedding
from maxnnx.train import TrainConfig, Trainer


class HeadGate(nnx.Module):
  """The output projection with a learned sigmoid gate on each head's output."""

  def __init__(self, proj: nnx.Module, num_heads: int, param_dtype, *, rngs: nnx.Rngs):
    self.proj = proj
    self.gate = logical_param(nnx.initializers.zeros, rngs.params(), (num_heads,), param_dtype,
                              ('heads',))

  def __call__(self, out_BTNH: jax.Array) -> jax.Array:
    gate_N = jax.nn.sigmoid(self.gate[...]).astype(out_BTNH.dtype)
    return self.proj(out_BTNH * gate_N[:, None])


class GatedAttention(Attention):
  """Attention whose heads are each scaled by ``sigmoid(gate)`` (0.5 at init)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    super().__init__(cfg, rngs=rngs)
    self.o_proj = HeadGate(self.o_proj, cfg.num_heads, cfg.jnp_dtype('param_dtype'), rngs=rngs)


GATED = BlockParts(attention=GatedAttention)
IDS = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 16)), jnp.int32)


def _cfg(scan: bool, **changes):
  return maxnnx.get_preset('tiny', **{'runtime.scan_layers': scan}, **changes)


def _first_attn(model):
  return model.layers.attn if model.config.runtime.scan_layers else model.layers[0].attn


def test_gated_attention_is_half_of_plain_attention_at_init():
  cfg = _cfg(False)
  plain, gated = Attention(cfg, rngs=nnx.Rngs(3)), GatedAttention(cfg, rngs=nnx.Rngs(3))
  x_BTD = jax.random.normal(jax.random.key(1), (2, 16, cfg.d_model))
  positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
  cos_sin = RotaryEmbedding.from_config(cfg.rope, cfg.rope_head_dim, 512).cos_sin(positions)
  mask = AttentionMask.causal(jnp.ones((2, 16), jnp.int32), positions)
  call = LayerCall(cos_sin=cos_sin, mask=mask)
  np.testing.assert_allclose(gated(x_BTD, call), 0.5 * plain(x_BTD, call), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('scan', [False, True])
def test_default_classes_as_parts_give_the_default_model(scan):
  cfg = _cfg(scan)
  default = maxnnx.Transformer(cfg, rngs=nnx.Rngs(0))
  explicit = maxnnx.Transformer(cfg, rngs=nnx.Rngs(0),
                                parts=BlockParts(attention=Attention, mlp=MLP.from_config,
                                                 norm=make_norm))
  np.testing.assert_array_equal(explicit(IDS), default(IDS))


@pytest.mark.parametrize('scan', [False, True])
def test_gated_attention_plugs_into_both_layouts(scan):
  cfg = _cfg(scan)
  gated = maxnnx.Transformer(cfg, rngs=nnx.Rngs(0), parts=GATED)
  assert type(_first_attn(gated)) is GatedAttention
  assert gated.parts == GATED

  # The gate is a parameter with logical names (plus the stack's leading `layers` axis).
  gates = [(path, var) for path, var in nnx.to_flat_state(nnx.state(gated, nnx.Param))
           if path[-1] == 'gate']
  assert len(gates) == (1 if scan else cfg.num_layers)
  for _, var in gates:
    assert tuple(var.get_metadata()['out_sharding']) == (('layers', 'heads') if scan
                                                         else ('heads',))

  # With the default model's weights and open gates (sigmoid = 1) it is the default model.
  plain = maxnnx.Transformer(cfg, rngs=nnx.Rngs(1))
  plain_params = dict(nnx.to_flat_state(nnx.state(plain, nnx.Param)))
  state = nnx.state(gated, nnx.Param)
  for path, var in nnx.to_flat_state(state):
    if path[-1] == 'gate':
      var.set_value(jnp.full(var.shape, 40.0))
    else:
      source = tuple(p for i, p in enumerate(path) if not (p == 'proj' and path[i - 1] == 'o_proj'))
      var.set_value(plain_params[source].get_value())
  nnx.update(gated, state)
  np.testing.assert_allclose(gated(IDS), plain(IDS), rtol=1e-5, atol=1e-5)

  # It decodes with the KV cache it inherits from Attention.
  gated.init_cache(2, 20)
  np.testing.assert_allclose(gated(IDS, decode=True), plain(IDS), rtol=1e-4, atol=1e-4)


def test_parts_reach_mtp_blocks_norms_and_block_subclasses():
  class MyNorm(RMSNorm):
    """An RMSNorm subclass, to see where norms come from."""

  class MyBlock(DecoderBlock):
    """A DecoderBlock subclass."""

  def my_norm(cfg, *, rngs):
    return MyNorm(cfg.d_model, axes=('norm',), eps=cfg.norm_eps, rngs=rngs)

  parts = BlockParts(attention=GatedAttention, norm=my_norm, block=MyBlock)
  for scan in (False, True):
    model = maxnnx.Transformer(_cfg(scan, **{'mtp.num_layers': 1}), rngs=nnx.Rngs(0), parts=parts)
    block = model.layers if scan else model.layers[0]
    assert type(block) is MyBlock and type(block.attn) is GatedAttention
    assert type(block.attn_pre_norm) is MyNorm and type(model.final_norm) is MyNorm
    mtp = model.mtp[0]
    assert type(mtp.block) is MyBlock and type(mtp.block.attn) is GatedAttention
    assert type(mtp.embed_norm) is MyNorm
    logits, (mtp_logits,) = model(IDS, mtp=True)
    assert logits.shape == mtp_logits.shape == (2, 16, 512)


class PaddingMutedMLP(MLP):
  """The model's MLP, silent on padding tokens (it reads the mask of the layer's call)."""

  def __call__(self, x_BTD, call):
    keep_BT = call.mask.q_segment_ids != 0
    return super().__call__(x_BTD, call) * keep_BT[..., None].astype(x_BTD.dtype)


@pytest.mark.parametrize('scan', [False, True])
def test_an_mlp_part_reads_the_layer_call(scan):
  cfg = _cfg(scan)
  segments = jnp.asarray([[1] * 16, [1] * 11 + [0] * 5], jnp.int32)  # row 1 ends in padding
  plain = maxnnx.Transformer(cfg, rngs=nnx.Rngs(0))(IDS, segment_ids=segments)
  muted = maxnnx.Transformer(cfg, rngs=nnx.Rngs(0),
                             parts=BlockParts(mlp=PaddingMutedMLP.from_config))
  muted = muted(IDS, segment_ids=segments)
  real = np.asarray(segments != 0)
  np.testing.assert_allclose(muted[real], plain[real], rtol=1e-5, atol=1e-5)
  assert np.abs(np.asarray(muted - plain))[~real].min() > 0  # the padding saw no MLP


def test_layer_call_keeps_python_scalars_static_and_arrays_traced():
  seen = {}

  @jax.jit
  def window_of(call):
    seen['window'], seen['cos'] = call.sliding_window, call.cos_sin[0]
    return call.cos_sin[0] * 2

  cos_sin = (jnp.ones((1, 4, 2)), jnp.zeros((1, 4, 2)))
  window_of(LayerCall(cos_sin=cos_sin, sliding_window=8, return_kv=True))
  assert seen['window'] == 8 and isinstance(seen['cos'], jax.core.Tracer)
  window_of(LayerCall(cos_sin=cos_sin, sliding_window=jnp.int32(8)))
  assert isinstance(seen['window'], jax.core.Tracer)
  call = LayerCall(cos_sin=cos_sin, sliding_window=8, return_kv=True)
  leaves, treedef = jax.tree.flatten(call)
  assert len(leaves) == 2 and jax.tree.unflatten(treedef, leaves) == call


def test_a_part_refuses_a_field_it_cannot_honour_by_name():
  LayerCall(sliding_window=None, return_kv=False).refuse('MyAttention', 'sliding_window',
                                                         'return_kv')
  with pytest.raises(ValueError, match=r'MyAttention does not support LayerCall\.chunk_size'):
    LayerCall(chunk_size=8).refuse('MyAttention', 'sliding_window', 'chunk_size')


def test_a_parameter_without_logical_names_is_refused():
  class Unnamed(Attention):
    def __init__(self, cfg, *, rngs):
      super().__init__(cfg, rngs=rngs)
      self.gate = nnx.Param(jnp.zeros((cfg.num_heads,)))

  with pytest.raises(ValueError, match='gate of shape'):
    maxnnx.Transformer(_cfg(False), rngs=nnx.Rngs(0), parts=BlockParts(attention=Unnamed))


def _losses(mesh: MeshConfig, steps: int = 4):
  cfg = _cfg(True)
  model = maxnnx.Transformer(cfg, rngs=nnx.Rngs(0), parts=GATED)
  config = TrainConfig(steps=steps, global_batch_size=8, seq_len=32, learning_rate=1e-2,
                       warmup_steps=0, log_every=steps, mesh=mesh)
  data = TokenWindows(np.tile(np.arange(48), 100), 32, 8, seed=1)  # learnable
  trainer = Trainer(model, config, data=data)
  history = trainer.fit(log=lambda line: None)
  return trainer, np.array([m['loss'] for m in history])


@pytest.mark.slow
def test_gated_model_trains_and_a_mesh_gives_the_losses_of_one_device():
  _, reference = _losses(MeshConfig(data=1))
  assert reference[-1] < reference[0] - 0.5
  trainer, losses = _losses(MeshConfig(data=2, fsdp=2, tensor=2))
  np.testing.assert_allclose(losses, reference, rtol=1e-4)
  gate = trainer.model.layers.attn.o_proj.gate[...]  # [layers, heads]: heads over tensor
  assert gate.sharding.spec == jax.sharding.PartitionSpec(None, 'tensor')
  assert not np.allclose(np.asarray(gate), 0.0)  # the gates learned
