"""Per-call options of the kernels, one frozen object per kernel kind.

A kernel takes its tensors positionally and everything else as one options
object, so a new feature is a new field here (with a default) rather than a new
keyword on every strategy. The capability check reads the same object (see
:class:`~maxnnx.kernels.capabilities.AttentionRequest`).
"""

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
  """What an attention call asks for besides ``q``, ``k``, ``v`` and the mask.

  Attributes:
    scale: softmax scale applied to the ``q . k`` scores.
    softcap: logit soft-cap ``c`` (scores become ``c * tanh(s / c)``), or ``None``.
    sliding_window: keys fewer than this many positions back are visible; a
      Python int, an int array (traced, as in scanned layers of mixed types) or
      ``None`` (no window).
    sinks_N: ``[heads]`` attention-sink logits (GPT-OSS): one value-less key per
      query head that joins every softmax; ``None`` for none.
    chunk_size: chunked (local) attention: a query sees only keys whose position
      is in its own chunk (``position // chunk_size`` equal; Llama 4). A Python
      int, an int array (traced) or ``None`` (no chunks).
    key_mask_BTS: a boolean ``[B, T, S]`` that must also allow a key (sparse
      attention: the keys DeepSeek V3.2's indexer selected), or ``None``.
  """

  scale: float
  softcap: float | None = None
  sliding_window: int | jax.Array | None = None
  sinks_N: jax.Array | None = None
  chunk_size: int | jax.Array | None = None
  key_mask_BTS: jax.Array | None = None

  def visible(self, mask) -> jax.Array:
    """``[B, T, S]`` bool: the keys each query may see under ``mask`` (an
    :class:`~maxnnx.kernels.masks.AttentionMask`) and these options."""
    allowed_BTS = mask.dense(self.sliding_window, self.chunk_size)
    return allowed_BTS if self.key_mask_BTS is None else allowed_BTS & self.key_mask_BTS


@dataclasses.dataclass(frozen=True)
class RaggedDotOptions:
  """What a ragged-dot call asks for besides ``lhs``, ``rhs`` and the group sizes.

  Attributes:
    preferred_element_type: dtype of the result (and of the accumulation where
      the backend honours it), or ``None`` for the input dtype.
  """

  preferred_element_type: object = None
