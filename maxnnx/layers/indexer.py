"""The lightning indexer of DeepSeek Sparse Attention (DeepSeek V3.2).

For every query it scores every visible key cheaply and keeps the ``index_topk`` best;
the latent attention (:class:`~maxnnx.layers.mla.MLA`) then attends to those keys only.
With ``H`` indexer heads of width ``D``::

    q_h = wq_b(q_lora)_h                 # from MLA's normalised low-rank query
    k   = LayerNorm(wk(x))               # one key per token, shared by the heads
    (the first qk_rope_head_dim dims of q_h and k are rotated, halves convention)
    score(t, s) = sum_h w_h(x_t) * relu(q_h(t) . k(s) / sqrt(D)),   w = weights_proj(x) / sqrt(H)

Keys the attention mask hides score ``-inf``; the top ``index_topk`` of each row are
selected (all visible keys when there are fewer). The selection is a discrete choice:
no gradient flows through it, as in the reference implementation (the indexer is
trained by its own distillation loss there, which maxnnx does not implement).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from maxnnx.config import ModelConfig
from maxnnx.layers.linear import DenseGeneral
from maxnnx.layers.norms import LayerNorm
from maxnnx.layers.rope import apply_rope

INDEXER_NORM_EPS = 1e-6


class LightningIndexer(nnx.Module):
  """Scores keys per query and selects the top ``index_topk`` (see the module docstring).

  Attributes:
    wq_b: ``[q_lora_rank] -> [index_heads, index_head_dim]``.
    wk: ``[d_model] -> [index_head_dim]``.
    k_norm: LayerNorm (with bias) over ``index_head_dim``.
    weights_proj: ``[d_model] -> [index_heads]``.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    mla = cfg.mla
    self.heads, self.head_dim, self.topk = mla.index_num_heads, mla.index_head_dim, mla.index_topk
    self.rope_dim = mla.qk_rope_head_dim
    dense = dict(dtype=cfg.jnp_dtype(), param_dtype=cfg.jnp_dtype('param_dtype'), rngs=rngs)
    self.wq_b = DenseGeneral((mla.q_lora_rank,), (self.heads, self.head_dim),
                             axes=('q_lora', None, None), **dense)
    self.wk = DenseGeneral((cfg.d_model,), (self.head_dim,), axes=('embed', None), **dense)
    self.k_norm = LayerNorm(self.head_dim, axes=(None,), eps=INDEXER_NORM_EPS,
                            dtype=cfg.jnp_dtype(), param_dtype=cfg.jnp_dtype('param_dtype'),
                            rngs=rngs)
    self.weights_proj = DenseGeneral((cfg.d_model,), (self.heads,), axes=('embed', None),
                                     **dense)

  def _rotate(self, x, cos_sin):
    """Rotate the first ``qk_rope_head_dim`` dims (halves convention), keep the rest."""
    rot, rest = x[..., :self.rope_dim], x[..., self.rope_dim:]
    return jnp.concatenate([apply_rope(rot, *cos_sin).astype(x.dtype), rest], axis=-1)

  def keys(self, x_BTD: jax.Array, cos_sin) -> jax.Array:
    """This step's indexer keys ``[B, T, index_head_dim]`` (what a decoding cache stores)."""
    k_BT1D = self.k_norm(self.wk(x_BTD))[:, :, None]
    return self._rotate(k_BT1D, cos_sin)[:, :, 0]

  def queries(self, x_BTD: jax.Array, q_lora_BTR: jax.Array, cos_sin
              ) -> tuple[jax.Array, jax.Array]:
    """``(rotated queries [B, T, heads, head_dim], head weights [B, T, heads])`` of this
    step's tokens, for :meth:`choose`."""
    q_BTHD = self._rotate(self.wq_b(q_lora_BTR), cos_sin)
    weights_BTH = self.weights_proj(x_BTD).astype(jnp.float32) * self.heads**-0.5
    return q_BTHD, weights_BTH

  def select(self, x_BTD: jax.Array, q_lora_BTR: jax.Array, cos_sin, keys_BSD: jax.Array,
             visible_BTS: jax.Array) -> jax.Array:
    """``[B, T, S]`` bool: the ``index_topk`` keys of ``keys_BSD`` each query keeps
    (among ``visible_BTS``)."""
    return self.choose(*self.queries(x_BTD, q_lora_BTR, cos_sin), keys_BSD, visible_BTS)

  def choose(self, q_BTHD: jax.Array, weights_BTH: jax.Array, keys_BSD: jax.Array,
             visible_BTS: jax.Array) -> jax.Array:
    """:meth:`select` from the queries and weights of :meth:`queries` (the serving
    engine gathers them per request first)."""
    scores_BTHS = jnp.einsum('bthd,bsd->bths', q_BTHD.astype(jnp.float32),
                             keys_BSD.astype(jnp.float32)) * self.head_dim**-0.5
    index_BTS = jnp.einsum('bth,bths->bts', weights_BTH, jax.nn.relu(scores_BTHS))
    index_BTS = jax.lax.stop_gradient(jnp.where(visible_BTS, index_BTS, -jnp.inf))
    k = min(self.topk, index_BTS.shape[-1])
    _, chosen_BTK = jax.lax.top_k(index_BTS, k)
    selected_BTS = jnp.zeros(index_BTS.shape, bool)
    batch, length = index_BTS.shape[:2]
    selected_BTS = selected_BTS.at[jnp.arange(batch)[:, None, None],
                                   jnp.arange(length)[None, :, None], chosen_BTK].set(True)
    return selected_BTS & visible_BTS
