"""What a kernel strategy can do, what a call asks of it, and what happens when they differ.

Every strategy declares its abilities once (:class:`AttentionCapabilities`,
:class:`PagedAttentionCapabilities`, :class:`RaggedDotCapabilities`). Each call
is summarised, at trace time and from static facts only (shapes, dtypes,
platform, which options are set), as a
request; the strategy compares the two before it runs. When it cannot serve the
request, its ``on_unsupported`` policy decides:

* ``'fallback'`` (the default): compute with the reference strategy (``xla``
  for attention, ``lax`` for ragged dot) and log a ``logging`` warning on the
  ``maxnnx.kernels`` logger, once per strategy and reason;
* ``'error'``: raise :class:`KernelUnsupportedError`, naming every reason.

A backend that raises ``NotImplementedError`` while tracing (cuDNN refusing a
shape, a Triton kernel on CPU) is treated the same way. Errors that appear only
when XLA compiles cannot be caught here and surface as they are.
"""

import abc
import dataclasses
import logging
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import jax
import numpy as np

from maxnnx.kernels.kv_quant import QuantizedPages
from maxnnx.kernels.options import AttentionOptions, RaggedDotOptions

logger = logging.getLogger('maxnnx.kernels')

ON_UNSUPPORTED = ('fallback', 'error')
ALL_PLATFORMS = ('cpu', 'gpu', 'tpu')
FLOAT_DTYPES = ('float32', 'bfloat16', 'float16')

_warned: set[tuple] = set()


class KernelUnsupportedError(ValueError):
  """A kernel strategy was asked for something it declares it cannot do."""


def warn_once(key: tuple, message: str) -> None:
  """Log ``message`` as a warning on ``maxnnx.kernels`` the first time ``key`` is seen."""
  if key not in _warned:
    _warned.add(key)
    logger.warning(message)


def log_once(key: tuple, message: str) -> None:
  """Log ``message`` at INFO level on ``maxnnx.kernels`` the first time ``key`` is seen."""
  if key not in _warned:
    _warned.add(key)
    logger.info(message)


def reset_warnings() -> None:
  """Forget which messages were logged, so they are logged again (for tests)."""
  _warned.clear()


def check_policy(on_unsupported: str) -> None:
  """Raise a clear error unless ``on_unsupported`` is a known policy."""
  if on_unsupported not in ON_UNSUPPORTED:
    raise ValueError(f"on_unsupported must be one of {ON_UNSUPPORTED}, got '{on_unsupported}'.")


def current_platform() -> str:
  """``cpu``, ``gpu`` or ``tpu``: where the computation being traced will run.

  That is the current mesh's platform when a mesh is set (``jax.set_mesh``, also inside
  ``jit``), so a step compiled ahead of time for a TPU slice from a CPU host picks the TPU's
  kernels, as it would on the slice; otherwise JAX's default backend.
  """
  device = getattr(jax.sharding.get_abstract_mesh(), 'abstract_device', None)
  platform = getattr(device, 'platform', None) or jax.default_backend()
  return 'gpu' if platform in ('cuda', 'rocm') else platform


def tokamax_missing() -> str | None:
  """Why tokamax cannot be imported, or ``None`` when it can."""
  try:
    import tokamax  # noqa: F401
  except ImportError as e:
    return f'tokamax is not importable ({e}); pip install tokamax'
  return None


def import_tokamax():
  """Import tokamax, first marking absl flags parsed (at their defaults) if nobody parsed them.

  tokamax reads its options through absl flags and, when they are unparsed,
  parses ``sys.argv``, which fails under any program with its own arguments
  (pytest, the maxnnx CLI). An absl app has parsed them already.
  """
  from absl import flags

  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  import tokamax

  return tokamax


def run_first_tokamax(kind: str, name: str, implementations, call, platforms: dict):
  """``call(impl)`` for the first tokamax implementation that runs; log which ran.

  Implementations not made for this platform (``platforms[impl]``: tokamax 0.0.17 no longer
  refuses them itself, its Mosaic TPU kernels ask a CPU for TPU chip facts), and those that
  refuse (``NotImplementedError``, or a build without them), are skipped and named in a warning
  (once), so a drop to XLA is visible. Raises ``NotImplementedError`` when none can run.
  """
  errors = []
  platform = current_platform()
  for impl in implementations:
    if platform not in platforms[impl]:
      errors.append(f'{impl}: not made for {platform} (only {", ".join(platforms[impl])})')
      continue
    try:
      out = call(impl)
    except NotImplementedError as e:
      errors.append(f'{impl}: {e}')
      continue
    except ValueError as e:  # tokamax was built without this implementation
      if 'Unknown implementation' not in str(e):
        raise
      errors.append(f'{impl}: {e}')
      continue
    if errors:
      warn_once((kind, name, impl, tuple(errors)),
                f"{kind}_impl '{name}': tokamax implementation(s) could not run "
                f"({'; '.join(errors)}); using tokamax '{impl}'.")
    else:
      log_once((kind, name, impl), f"{kind}_impl '{name}' runs tokamax implementation '{impl}'.")
    return out
  raise NotImplementedError(f"no tokamax implementation could run ({'; '.join(errors)})")


def lookup_kernel(registry: dict, kind: str, name: str, on_unsupported: str | None):
  """Instantiate ``registry[name]``; ``on_unsupported`` overrides its policy.

  Raises:
    ValueError: for an unknown name (listing the known ones) or policy.
  """
  if name not in registry:
    known = ', '.join(sorted(registry))
    raise ValueError(f"Unknown {kind}_impl '{name}'. Known implementations: {known}.")
  kernel = registry[name]()
  if on_unsupported is not None:
    check_policy(on_unsupported)
    kernel = dataclasses.replace(kernel, on_unsupported=on_unsupported)
  return kernel


def _window_kind(sliding_window) -> Literal['none', 'static', 'traced']:
  if sliding_window is None:
    return 'none'
  if isinstance(sliding_window, int | np.integer):
    return 'static'
  return 'traced'


@dataclasses.dataclass(frozen=True)
class AttentionRequest:
  """The static facts of one attention call that decide which strategy can serve it.

  Attributes:
    platform: ``cpu``, ``gpu`` or ``tpu``.
    dtype: dtype name of ``q``.
    q_length, kv_length: ``T`` and ``S``; they differ when decoding against a cache.
    num_heads, num_kv_heads: query heads and key/value heads (GQA when different).
    head_dim, v_head_dim: head size of ``q``/``k`` and of ``v`` (different in MLA).
    window: ``none``, ``static`` (a Python int) or ``traced`` (an array, as in
      scanned layers of mixed types).
    softcap: a logit soft-cap is set.
    sinks: attention-sink logits are given.
    chunked: chunked (local) attention is asked for (``options.chunk_size``).
    key_mask: an extra dense key mask is given (``options.key_mask_BTS``).
    blocks: the mask has image blocks (``AttentionMask.q_blocks``: bidirectional runs).
  """

  platform: str
  dtype: str
  q_length: int
  kv_length: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  v_head_dim: int
  window: Literal['none', 'static', 'traced']
  softcap: bool
  sinks: bool
  chunked: bool = False
  key_mask: bool = False
  blocks: bool = False

  @classmethod
  def of(cls, q_BTNH, k_BSKH, v_BSKH, options: AttentionOptions,
         mask=None) -> 'AttentionRequest':
    """Summarise a call's arguments."""
    return cls(platform=current_platform(), dtype=np.dtype(q_BTNH.dtype).name,
               q_length=q_BTNH.shape[1], kv_length=k_BSKH.shape[1],
               num_heads=q_BTNH.shape[2], num_kv_heads=k_BSKH.shape[2],
               head_dim=q_BTNH.shape[3], v_head_dim=v_BSKH.shape[3],
               window=_window_kind(options.sliding_window),
               softcap=options.softcap is not None, sinks=options.sinks_N is not None,
               chunked=options.chunk_size is not None,
               key_mask=options.key_mask_BTS is not None,
               blocks=getattr(mask, 'q_blocks', None) is not None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadCapabilities:
  """What plain and paged attention strategies both declare; every field must be declared.

  Attributes:
    platforms: platforms it runs on.
    dtypes: dtype names of ``q``/``k``/``v`` (or ``q`` and the pages) it accepts.
    gqa: fewer key/value heads than query heads (GQA/MQA).
    sliding_window: a sliding window given as a Python int.
    traced_window: a sliding window given as an array (scanned mixed layers).
    softcap: logit soft-capping.
    sinks: attention-sink logits (GPT-OSS).
    distinct_v_head_dim: ``v`` head size different from the ``q``/``k`` one (MLA).
    chunked: chunked (local) attention, static or traced chunk size (Llama 4).
    blocks: image blocks (bidirectional attention within each image, Gemma 3).
  """

  platforms: tuple[str, ...]
  dtypes: tuple[str, ...]
  gqa: bool
  sliding_window: bool
  traced_window: bool
  softcap: bool
  sinks: bool
  distinct_v_head_dim: bool
  chunked: bool
  blocks: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionCapabilities(HeadCapabilities):
  """What an attention strategy supports: :class:`HeadCapabilities` and these.

  Attributes:
    masking: ``positions``: honours :class:`~maxnnx.kernels.masks.AttentionMask`
      exactly (segment ids, and causality by position, any layout);
      ``index_causal``: segment ids, and causality by index within the row,
      which equals the mask's rule only while positions increase with the index
      inside each segment (the strategy must check that itself).
    decode: queries and keys of different lengths (decoding against a KV cache).
    key_mask: an extra dense ``[B, T, S]`` key mask (sparse attention).
  """

  masking: Literal['positions', 'index_causal']
  decode: bool
  key_mask: bool

  def missing(self, request: AttentionRequest) -> list[str]:
    """Why ``request`` cannot be served; empty when it can."""
    reasons = attention_reasons(self, request)
    if request.q_length != request.kv_length and not self.decode:
      reasons.append(f'query length {request.q_length} != key length {request.kv_length} '
                     '(decoding) is not supported')
    if request.key_mask and not self.key_mask:
      reasons.append('an extra dense key mask (sparse attention) is not supported')
    return reasons


def attention_reasons(capabilities, request) -> list[str]:
  """What ``capabilities`` lacks of ``request``, for the facts plain and paged attention
  share (platform, dtype, GQA, windows, soft-cap, sinks, ``v`` head size, chunks, image
  blocks)."""
  reasons = []
  if request.platform not in capabilities.platforms:
    reasons.append(f"platform '{request.platform}' is not one of {capabilities.platforms}")
  if request.dtype not in capabilities.dtypes:
    reasons.append(f"dtype {request.dtype} is not one of {capabilities.dtypes}")
  checks = (
      (request.num_heads != request.num_kv_heads, 'gqa',
       'grouped key/value heads (GQA/MQA) are not supported'),
      (request.window == 'static', 'sliding_window', 'sliding windows are not supported'),
      (request.window == 'traced', 'traced_window',
       'traced (per-layer array) sliding windows are not supported'),
      (request.softcap, 'softcap', 'logit soft-capping is not supported'),
      (request.sinks, 'sinks', 'attention sinks are not supported'),
      (request.head_dim != request.v_head_dim, 'distinct_v_head_dim',
       f'v head size {request.v_head_dim} != q/k head size {request.head_dim} is not '
       'supported'),
      (request.chunked, 'chunked', 'chunked attention is not supported'),
      (request.blocks, 'blocks',
       'image blocks (bidirectional attention within an image) are not supported'),
  )
  reasons += [reason for asked, supported, reason in checks
              if asked and not getattr(capabilities, supported)]
  return reasons


@dataclasses.dataclass(frozen=True)
class PagedAttentionRequest:
  """The static facts of one paged-attention call (attention over a page pool).

  Attributes:
    platform: ``cpu``, ``gpu`` or ``tpu``.
    dtype: dtype name of ``q``.
    num_heads, num_kv_heads: query heads and key/value heads (GQA when different).
    head_dim, v_head_dim: head size of ``q``/``k`` and of ``v``.
    page_size: tokens per page.
    window: ``none``, ``static`` or ``traced`` (see :class:`AttentionRequest`).
    softcap: a logit soft-cap is set.
    sinks: attention-sink logits are given.
    chunked: chunked (local) attention is asked for (``options.chunk_size``).
    blocks: the step has image blocks (``PagedBatch.blocks_T``: bidirectional runs).
    kv_dtype: dtype name of quantized pages (``int8``, ``float8_e4m3fn``: a
      :class:`~maxnnx.kernels.kv_quant.QuantizedPages` pool), ``None`` for float pages.
  """

  platform: str
  dtype: str
  num_heads: int
  num_kv_heads: int
  head_dim: int
  v_head_dim: int
  page_size: int
  window: Literal['none', 'static', 'traced']
  softcap: bool
  sinks: bool
  chunked: bool = False
  blocks: bool = False
  kv_dtype: str | None = None

  @classmethod
  def of(cls, q_TNH, k_pages_PSKH, v_pages_PSKH, options: AttentionOptions,
         blocks: bool = False) -> 'PagedAttentionRequest':
    """Summarise a call's arguments."""
    return cls(platform=current_platform(), dtype=np.dtype(q_TNH.dtype).name,
               num_heads=q_TNH.shape[1], num_kv_heads=k_pages_PSKH.shape[2],
               head_dim=q_TNH.shape[2], v_head_dim=v_pages_PSKH.shape[3],
               page_size=k_pages_PSKH.shape[1], window=_window_kind(options.sliding_window),
               softcap=options.softcap is not None, sinks=options.sinks_N is not None,
               chunked=options.chunk_size is not None, blocks=blocks,
               kv_dtype=(np.dtype(k_pages_PSKH.dtype).name
                         if isinstance(k_pages_PSKH, QuantizedPages) else None))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedAttentionCapabilities(HeadCapabilities):
  """What a paged-attention strategy supports: :class:`HeadCapabilities` and the quantized
  pages it reads. Limits on page sizes or shapes go in the strategy's
  ``unsupported_reasons``.

  Attributes:
    kv_dtypes: dtype names of quantized pages it dequantizes on read (``kv_cache_dtype``
      ``int8``: ``int8``, ``fp8``: ``float8_e4m3fn``); ``()``: float pages only.
  """

  kv_dtypes: tuple[str, ...] = ()

  def missing(self, request: PagedAttentionRequest) -> list[str]:
    """Why ``request`` cannot be served; empty when it can."""
    reasons = attention_reasons(self, request)
    if request.kv_dtype is not None and request.kv_dtype not in self.kv_dtypes:
      reasons.append(f'quantized {request.kv_dtype} pages (kv_cache_dtype) are not supported')
    return reasons


@dataclasses.dataclass(frozen=True)
class RaggedDotRequest:
  """The static facts of one ragged-dot call.

  Attributes:
    platform: ``cpu``, ``gpu`` or ``tpu``.
    dtype: dtype name of ``lhs``.
    rhs_dtype: dtype name of ``rhs``.
    preferred_element_type: dtype name of the requested result, or ``None``.
  """

  platform: str
  dtype: str
  rhs_dtype: str
  preferred_element_type: str | None

  @classmethod
  def of(cls, lhs_MK, rhs_GKN, options: RaggedDotOptions) -> 'RaggedDotRequest':
    """Summarise a call's arguments."""
    pet = options.preferred_element_type
    pet = None if pet is None else np.dtype(pet).name
    return cls(platform=current_platform(), dtype=np.dtype(lhs_MK.dtype).name,
               rhs_dtype=np.dtype(rhs_GKN.dtype).name, preferred_element_type=pet)


@dataclasses.dataclass(frozen=True)
class RaggedDotCapabilities:
  """What a ragged-dot strategy supports; every field must be declared.

  Every strategy computes rows past the last group as zeros.

  Attributes:
    platforms: platforms it runs on.
    dtypes: dtype names of ``lhs``/``rhs`` it accepts.
    mixed_dtypes: ``lhs`` and ``rhs`` of different dtypes.
  """

  platforms: tuple[str, ...]
  dtypes: tuple[str, ...]
  mixed_dtypes: bool

  def missing(self, request: RaggedDotRequest) -> list[str]:
    """Why ``request`` cannot be served; empty when it can."""
    reasons = []
    if request.platform not in self.platforms:
      reasons.append(f"platform '{request.platform}' is not one of {self.platforms}")
    for dtype in {request.dtype, request.rhs_dtype}:
      if dtype not in self.dtypes:
        reasons.append(f'dtype {dtype} is not one of {self.dtypes}')
    if request.dtype != request.rhs_dtype and not self.mixed_dtypes:
      reasons.append(f'lhs dtype {request.dtype} != rhs dtype {request.rhs_dtype} is not '
                     'supported')
    return reasons


def refuse(kind: str, name: str, reasons: list[str], on_unsupported: str, reference: str):
  """Apply the policy to an unservable call: raise, or warn once before the fallback.

  Args:
    kind: ``attention`` or ``ragged_dot`` (the config field is ``{kind}_impl``).
    name: the strategy's registered name.
    reasons: why it cannot serve the call.
    on_unsupported: ``fallback`` or ``error``.
    reference: name of the strategy that serves the call instead.
  """
  why = '; '.join(reasons)
  if on_unsupported == 'error':
    raise KernelUnsupportedError(
        f"{kind}_impl '{name}' cannot serve this call: {why}. Choose another {kind}_impl "
        f"(for example '{reference}'), or set on_unsupported='fallback' "
        f"(ModelConfig.kernel_on_unsupported) to use '{reference}' for such calls.")
  warn_once((kind, name, why),
            f"{kind}_impl '{name}' cannot serve this call ({why}); computing it with "
            f"'{reference}' instead.")


@dataclasses.dataclass(frozen=True)
class KernelStrategy(abc.ABC):
  """Base of every kernel strategy (attention, paged attention, ragged dot): stateless and
  hashable, it declares :attr:`capabilities`, and each call it cannot serve goes through
  the ``on_unsupported`` policy (:func:`refuse`) to the reference strategy.

  Attributes:
    name: the registered name.
    on_unsupported: ``fallback`` or ``error``.
  """

  name: str = 'base'
  on_unsupported: str = 'fallback'
  kind: ClassVar[str] = 'kernel'  # the config field is ``{kind}_impl``
  reference: ClassVar[str] = 'xla'  # the strategy that serves what others cannot

  def __post_init__(self):
    check_policy(self.on_unsupported)

  @property
  @abc.abstractmethod
  def capabilities(self):
    """What this strategy supports."""

  def unsupported_reasons(self, request) -> list[str]:
    """Why this strategy cannot serve ``request`` (empty when it can).

    Strategies with extra limits (shapes, optional packages) extend this.
    """
    return self.capabilities.missing(request)

  def run_checked(self, request, run: Callable[..., Any], fallback: Callable[..., Any],
                  *args):
    """``run(*args)`` when this strategy can serve ``request`` (and its backend does not raise
    ``NotImplementedError``), else ``fallback(*args)`` (the reference's) after the policy."""
    reasons = self.unsupported_reasons(request)
    if not reasons:
      try:
        return run(*args)
      except NotImplementedError as e:
        reasons = [f'the backend raised NotImplementedError: {e}']
    refuse(self.kind, self.name, reasons, self.on_unsupported, self.reference)
    return fallback(*args)


#: The order a ``tokamax`` strategy tries tokamax's implementations in (tokamax's own default).
TOKAMAX_DEFAULT_ORDER = ('mosaic', 'triton', 'xla')


@dataclasses.dataclass(frozen=True)
class TokamaxStrategy(KernelStrategy):
  """What the strategies over a tokamax op share (``TokamaxAttention``, ``TokamaxRaggedDot``,
  each listing it before its kind's base class): ``implementations`` checked against
  :attr:`PLATFORMS` (each implementation's platforms), the platforms those cover, tokamax
  being importable as one more limit, and running the first implementation that can
  (:func:`run_first_tokamax`).

  Attributes:
    implementations: tokamax implementation names, tried in order.
  """

  name: str = 'tokamax'
  implementations: tuple[str, ...] = TOKAMAX_DEFAULT_ORDER
  PLATFORMS: ClassVar[dict[str, tuple[str, ...]]] = {}

  def __post_init__(self):
    super().__post_init__()
    unknown = [i for i in self.implementations if i not in self.PLATFORMS]
    if unknown or not self.implementations:
      raise ValueError(f'{type(self).__name__}.implementations must be a non-empty tuple of '
                       f'{tuple(self.PLATFORMS)}, got {self.implementations}.')

  @property
  def platforms(self) -> tuple[str, ...]:
    """The platforms at least one of ``implementations`` is made for."""
    return tuple(p for p in ALL_PLATFORMS
                 if any(p in self.PLATFORMS[i] for i in self.implementations))

  def unsupported_reasons(self, request) -> list[str]:
    """The declared limits, and tokamax being importable."""
    missing = tokamax_missing()
    return self.capabilities.missing(request) + ([missing] if missing else [])

  def run_first(self, call):
    """``call(impl)`` for the first of ``implementations`` that runs (see
    :func:`run_first_tokamax`)."""
    return run_first_tokamax(self.kind, self.name, self.implementations, call, self.PLATFORMS)
