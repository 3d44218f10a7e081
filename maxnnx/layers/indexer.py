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
no gradient flows through it, as in the reference implementation.

The indexer is trained by its own loss (``ModelConfig.mla.indexer_training``): the KL
divergence from the main attention's distribution, summed over heads and L1-normalised
(:func:`attention_target`), to the softmax of its scores (:func:`indexer_kl_loss`), over every
visible key while attention is dense (the warm-up stage) or over the selected keys (the
sparse stage), averaged over the queries that see a key.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from maxnnx.config import ModelConfig
from maxnnx.layers.linear import DenseGeneral
from maxnnx.layers.norms import LayerNorm
from maxnnx.layers.params import ForwardStat
from maxnnx.layers.rope import apply_rope

INDEXER_NORM_EPS = 1e-6


class IndexerLoss(ForwardStat):
  """The indexer's KL loss (:func:`indexer_kl_loss`) in the last training forward pass of an
  MLA layer whose ``mla.indexer_training`` is on (float32 scalar)."""


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

  def scores(self, q_BTHD: jax.Array, weights_BTH: jax.Array, keys_BSD: jax.Array,
             visible_BTS: jax.Array) -> jax.Array:
    """``[B, T, S]`` float32 index scores ``sum_h w_h relu(q_h . k / sqrt(D))``, ``-inf`` where
    ``visible_BTS`` hides the key (differentiable: what the indexer loss trains)."""
    scores_BTHS = jnp.einsum('bthd,bsd->bths', q_BTHD.astype(jnp.float32),
                             keys_BSD.astype(jnp.float32)) * self.head_dim**-0.5
    index_BTS = jnp.einsum('bth,bths->bts', weights_BTH, jax.nn.relu(scores_BTHS))
    return jnp.where(visible_BTS, index_BTS, -jnp.inf)

  def choose(self, q_BTHD: jax.Array, weights_BTH: jax.Array, keys_BSD: jax.Array,
             visible_BTS: jax.Array) -> jax.Array:
    """:meth:`select` from the queries and weights of :meth:`queries` (the serving
    engine gathers them per request first)."""
    return self.top_keys(self.scores(q_BTHD, weights_BTH, keys_BSD, visible_BTS), visible_BTS)

  def top_keys(self, index_BTS: jax.Array, visible_BTS: jax.Array) -> jax.Array:
    """``[B, T, S]`` bool: the ``index_topk`` best-scored visible keys of each query (no
    gradient flows through the choice)."""
    index_BTS = jax.lax.stop_gradient(index_BTS)
    k = min(self.topk, index_BTS.shape[-1])
    _, chosen_BTK = jax.lax.top_k(index_BTS, k)
    selected_BTS = jnp.zeros(index_BTS.shape, bool)
    batch, length = index_BTS.shape[:2]
    selected_BTS = selected_BTS.at[jnp.arange(batch)[:, None, None],
                                   jnp.arange(length)[None, :, None], chosen_BTK].set(True)
    return selected_BTS & visible_BTS


def attention_target(q_BTNQ: jax.Array, k_BSNQ: jax.Array, over_BTS: jax.Array,
                     scale: float) -> jax.Array:
  """The indexer's target ``[B, T, S]``: the attention distribution of each head over the keys
  of ``over_BTS`` (softmax of ``scale * q . k``), summed over heads and L1-normalised; zero
  elsewhere and in rows without a key; float32, outside the gradient."""
  scores_BNTS = jnp.einsum('btnq,bsnq->bnts', jax.lax.stop_gradient(q_BTNQ),
                           jax.lax.stop_gradient(k_BSNQ),
                           preferred_element_type=jnp.float32) * scale
  over_B1TS = over_BTS[:, None]
  scores_BNTS = jnp.where(over_B1TS, scores_BNTS, -jnp.inf)
  peak = jnp.max(scores_BNTS, axis=-1, keepdims=True)
  exp_BNTS = jnp.where(over_B1TS, jnp.exp(scores_BNTS - jnp.where(jnp.isfinite(peak), peak, 0.0)),
                       0.0)
  probs_BNTS = exp_BNTS / jnp.maximum(exp_BNTS.sum(-1, keepdims=True), 1e-30)
  summed_BTS = probs_BNTS.sum(axis=1)
  return summed_BTS / jnp.maximum(summed_BTS.sum(-1, keepdims=True), 1e-30)


def indexer_kl_loss(index_BTS: jax.Array, target_BTS: jax.Array, over_BTS: jax.Array
                    ) -> jax.Array:
  """``mean over queries with a key of KL(target || softmax(index))``, both over the keys of
  ``over_BTS`` (float32 scalar; 0 when no query sees a key). Its gradient reaches the index
  scores only (``target`` is held constant)."""
  index_BTS = jnp.where(over_BTS, index_BTS.astype(jnp.float32), -jnp.inf)
  peak = jax.lax.stop_gradient(jnp.max(index_BTS, axis=-1, keepdims=True))
  shifted = jnp.where(over_BTS, index_BTS - jnp.where(jnp.isfinite(peak), peak, 0.0), 0.0)
  log_norm = jnp.log(jnp.maximum(jnp.sum(jnp.where(over_BTS, jnp.exp(shifted), 0.0), axis=-1,
                                         keepdims=True), 1e-30))
  log_q = shifted - log_norm
  p = jax.lax.stop_gradient(target_BTS).astype(jnp.float32)
  kept = over_BTS & (p > 0)
  per_key = jnp.where(kept, p * (jnp.log(jnp.where(kept, p, 1.0)) - log_q), 0.0)
  rows = jnp.any(over_BTS, axis=-1)
  return jnp.sum(per_key) / jnp.maximum(jnp.sum(rows), 1).astype(jnp.float32)
