"""Drafters: what proposes the draft tokens the engine's step verifies.

The engine's :meth:`~maxnnx.serving.Engine.step` calls its drafter at three points
(:class:`Drafter`, the protocol; every hook but the first may do nothing):

1. :meth:`Drafter.before_schedule` (``running``): set each running request's
   ``Request.draft_ids`` for the next step, at most :meth:`Drafter.room` of them (0 unless
   it decodes). A drafter that needs a device pass to know its tokens sets placeholders
   here: the scheduler only counts them.
2. :meth:`Drafter.after_schedule` (``scheduled``): the scheduler has cut each scheduled row's
   drafts to the token budget (or dropped them rather than preempt) and reserved the pages
   of its last token and the drafts it kept, so ``len(request.draft_ids)`` is final; a
   device drafter writes its tokens into ``draft_ids`` now, before the target's layout is
   built from them. A running request that was not scheduled has its placeholders dropped.
3. :meth:`Drafter.after_step` (``scheduled``, ``inputs``, ``outputs``): the target's step was
   dispatched with ``inputs`` (:meth:`~maxnnx.serving.model_runner.ModelRunner.layout`'s:
   the flat tokens, their positions, write slots and page tables) and returned ``outputs``
   (:meth:`~maxnnx.serving.model_runner.ModelRunner.run`'s logits, still on the device);
   the verification has not run yet. What the step kept shows in the requests
   (``token_ids``, ``num_computed``) at the next :meth:`Drafter.before_schedule`.

:meth:`Drafter.warm` compiles the drafter's programs in :meth:`Engine.warmup` (reporting
:meth:`Drafter.num_warm` steps), so that a warm engine compiles nothing while it drafts.

Two drafters:

* :class:`NgramDrafter` (``speculative_method='ngram'``): prompt lookup on the host,
  :func:`~maxnnx.serving.speculation.propose_drafts`.
* :class:`DraftModelDrafter` (``speculative_method='draft_model'``): a smaller model of the
  same vocabulary with its own :class:`~maxnnx.serving.model_runner.ModelRunner`, whose page
  pool is indexed by the target's page tables (same ``page_size`` and number of pages), so
  the scheduler's pages, reservations and prefix cache serve both models: a page holds both
  models' keys and values of the same tokens. Before the schedule each decoding request asks
  for ``room`` placeholder drafts; after it, the draft runner runs one-token steps over the
  scheduled decoding rows (the first on the row's last token, at position ``num_tokens - 1``,
  each on the argmax of the previous one's logits), writing its keys and values into the
  pages the scheduler reserved; after the target's step it runs the target's own layout, so
  that prefill chunks, and the last draft, are in its pool too. Greedy drafts make ``q`` a
  point mass, so the engine's verifier (:func:`~maxnnx.serving.speculation.verify`, which
  takes drafts as deterministic: a draft ``x`` is kept with probability ``p(x)``, a rejection
  samples ``p`` without ``x``) stays exact rejection sampling for sampled rows, and greedy
  rows keep the tokens of plain decoding.

A device drafter that reads the target's hidden states (DeepSeek's MTP module) fits the same
three hooks: placeholders before the schedule, its tokens after it, and its catch-up on the
step's tokens after the step.
"""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

from maxnnx.config.engine import EngineConfig
from maxnnx.serving.model_runner import ModelRunner, smallest_holding
from maxnnx.serving.scheduler import Request
from maxnnx.serving.speculation import propose_drafts

logger = logging.getLogger(__name__)


class Drafter:
  """The drafter protocol (see the module docstring); this base drafts nothing.

  Args:
    num_speculative_tokens: ``k``, the drafts a request carries per step at most.
    max_model_len: a request's tokens at most (drafts never run past it).

  Attributes:
    num_speculative_tokens, max_model_len: as given.
  """

  def __init__(self, num_speculative_tokens: int, max_model_len: int):
    self.num_speculative_tokens = num_speculative_tokens
    self.max_model_len = max_model_len

  def room(self, request: Request) -> int:
    """The drafts ``request`` may carry in the next step: up to ``k``, as many as its
    ``max_tokens`` and ``max_model_len`` leave after the model's own token; 0 unless it
    decodes (its tokens all computed but the last)."""
    if request.num_computed != request.num_tokens - 1:
      return 0
    return max(0, min(self.num_speculative_tokens,
                      request.params.max_tokens - len(request.output_ids) - 1,
                      self.max_model_len - request.num_tokens))

  def before_schedule(self, running: list[Request]) -> None:
    """Set the ``draft_ids`` of every running request (hook 1)."""
    for request in running:
      request.draft_ids = []

  def after_schedule(self, scheduled: list[tuple[Request, int]]) -> None:
    """Fill the scheduled rows' ``draft_ids`` (hook 2)."""

  def after_step(self, scheduled: list[tuple[Request, int]], inputs: tuple,
                 outputs: tuple) -> None:
    """See the target's step (hook 3)."""

  def num_warm(self) -> int:
    """How many times :meth:`warm` calls ``progress`` (one per bucket it runs)."""
    return 0

  def warm(self, progress=None) -> None:
    """Build the drafter's programs; ``progress()`` after each."""


class NgramDrafter(Drafter):
  """Prompt lookup (:func:`~maxnnx.serving.speculation.propose_drafts`), on the host before
  the schedule.

  Args:
    num_speculative_tokens, max_model_len: as :class:`Drafter`'s.
    lookup_max, lookup_min: the longest and shortest n-gram looked up.
  """

  def __init__(self, num_speculative_tokens: int, max_model_len: int, lookup_max: int,
               lookup_min: int):
    super().__init__(num_speculative_tokens, max_model_len)
    self.lookup = (lookup_max, lookup_min)

  def before_schedule(self, running: list[Request]) -> None:
    """Each decoding request's n-gram drafts."""
    propose_drafts(running, self.num_speculative_tokens, self.max_model_len, *self.lookup)


@jax.jit
def _next_ids(ids_T, logits_BV):
  """Each row's argmax ``[B]``, and ``ids_T`` with it as row ``r``'s token ``r``."""
  tokens_B = jnp.argmax(logits_BV.astype(jnp.float32), axis=-1).astype(jnp.int32)
  return ids_T.at[:tokens_B.shape[0]].set(tokens_B), tokens_B


def draft_inputs(inputs: tuple) -> tuple:
  """The target's step inputs as the draft model runs them: its own pool only (no sliding
  layers' pool, state slots, image embeddings or adapters), logits at each row's last token."""
  ids_T, positions_T, batch, last_BS, _, _ = inputs
  batch = dataclasses.replace(batch, blocks_T=None, state_slots_B=None,
                              window_page_table_BM=None, window_slots_T=None)
  return ids_T, positions_T, batch, last_BS[:, -1:], None, None


class DraftModelDrafter(Drafter):
  """Drafts with a smaller model over the target's page tables (see the module docstring).

  Args:
    draft_model: a :class:`~maxnnx.Transformer` with the target's vocabulary (not modified).
    num_speculative_tokens, max_model_len: as :class:`Drafter`'s.
    num_pages, page_size, max_batch, token_buckets, page_buckets, kv_cache_dtype, rules: the
      target runner's (the draft's pool has as many pages, indexed the same way).
    target_buckets: the target's step buckets (:meth:`ModelRunner.step_buckets`), which the
      draft model runs after each step.

  Attributes:
    runner: the draft model's :class:`~maxnnx.serving.model_runner.ModelRunner`.
  """

  def __init__(self, draft_model, num_speculative_tokens: int, max_model_len: int, *,
               num_pages: int, page_size: int, max_batch: int, token_buckets: tuple[int, ...],
               page_buckets: tuple[int, ...], target_buckets: list[tuple],
               kv_cache_dtype: str = 'auto', rules: dict | None = None):
    super().__init__(num_speculative_tokens, max_model_len)
    self.runner = ModelRunner(draft_model, num_pages=num_pages, page_size=page_size,
                              max_batch=max_batch, token_buckets=token_buckets,
                              page_buckets=page_buckets, kv_cache_dtype=kv_cache_dtype,
                              rules=rules)
    # Images run as their placeholder ids: the draft's buckets are the text ones.
    self._layout_buckets = list(dict.fromkeys(tuple(shape[:4]) for shape in target_buckets))
    self._asked: list[Request] = []

  def before_schedule(self, running: list[Request]) -> None:
    """Placeholders: ``room`` zeros per decoding request."""
    self._asked = []
    for request in running:
      request.draft_ids = [0] * self.room(request)
      if request.draft_ids:
        self._asked.append(request)

  def after_schedule(self, scheduled: list[tuple[Request, int]]) -> None:
    """The draft model's greedy tokens for the scheduled rows' placeholders."""
    rows = [request for request, _ in scheduled if request.draft_ids]
    chosen = {id(request) for request in rows}
    for request in self._asked:
      if id(request) not in chosen:
        request.draft_ids = []  # not scheduled this step
    self._asked = []
    if not rows:
      return
    counts = [len(request.draft_ids) for request in rows]
    steps = [[(request.num_tokens - 1 + j, request.pages) if j < count else None
              for request, count in zip(rows, counts)] for j in range(max(counts))]
    num_pages = smallest_holding(self.runner.page_buckets,
                                 max(len(request.pages) for request in rows))
    tokens_KB = self._chain(steps, [request.token_ids[-1] for request in rows], num_pages)
    for row, (request, count) in enumerate(zip(rows, counts)):
      request.draft_ids = tokens_KB[:count, row].tolist()

  def _chain(self, steps: list[list], first: list[int], num_pages: int) -> np.ndarray:
    """Run one one-token step per entry of ``steps`` (:meth:`ModelRunner.decode_inputs`'
    rows), the first on the tokens ``first``, each next on the argmax of the one before;
    the argmaxes ``[len(steps), max_batch]`` (one fetch at the end)."""
    ids_T, tokens = None, []
    for rows in steps:
      ids_T_, *rest = self.runner.decode_inputs(rows, num_pages)
      if ids_T is None:
        ids_T = ids_T_
        ids_T[:len(first)] = first
      logits_BV, _ = self.runner.run((ids_T, *rest))
      ids_T, tokens_B = _next_ids(ids_T, logits_BV)
      tokens.append(tokens_B)
    return np.stack(jax.device_get(tokens))

  def after_step(self, scheduled: list[tuple[Request, int]], inputs: tuple,
                 outputs: tuple) -> None:
    """Run the target's layout through the draft model (its keys and values of every token
    the step computed: prefill chunks, the last token and every draft)."""
    self.runner.run(draft_inputs(inputs))

  def num_warm(self) -> int:
    """The target's text buckets, and one chain of one-token steps per page bucket."""
    return len(self._layout_buckets) + len(self.runner.page_buckets)

  def warm(self, progress=None) -> None:
    """Run every bucket :meth:`after_step` and :meth:`after_schedule` can take on empty rows
    (the chains two steps long: the first from host ids, the next from device ones)."""
    self.runner.warm(progress, self._layout_buckets)
    for num_pages in self.runner.page_buckets:
      self._chain([[], []], [], num_pages)
      if progress is not None:
        progress()


def make_drafter(config: EngineConfig, model, draft_model, *, max_model_len: int,
                 frees_pages: bool, runner: ModelRunner, num_pages: int,
                 rules: dict | None) -> Drafter | None:
  """The drafter ``config.speculative_method`` names (``None`` for ``'none'``), the draft
  model loaded from ``config.speculative_model`` when none is given.

  ``frees_pages``: the engine gives pages behind a sliding window back (every attention
  layer slides), which a draft model would still read.

  Raises:
    ValueError: one line naming the setting and the fix: a draft model without
      ``speculative_method='draft_model'`` or none with it, a draft model whose vocabulary
      differs from the model's, whose layers keep a recurrent state, or that would read pages
      the engine gives back.
  """
  method, k = config.speculative_method, config.num_speculative_tokens
  if draft_model is not None and method != 'draft_model':
    raise ValueError(f"Engine draft_model is given but speculative_method={method!r}: set "
                     "speculative_method='draft_model' to draft with it, or drop draft_model.")
  if method == 'none':
    return None
  if method == 'ngram':
    return NgramDrafter(k, max_model_len, config.prompt_lookup_max, config.prompt_lookup_min)
  if method == 'mtp':
    from maxnnx.serving.mtp_runner import MTPDrafter  # noqa: PLC0415 (it imports Drafter)
    return MTPDrafter(model, runner, k, max_model_len, rules=rules)
  if draft_model is None and config.speculative_model:
    draft_model = load_draft_model(config.speculative_model, model.config, runner.mesh)
  if draft_model is None:
    raise ValueError("Engine speculative_method='draft_model' needs a draft model: pass "
                     'Engine(model, draft_model=<a smaller Transformer>) or '
                     'speculative_model=<its Hugging Face directory>.')
  check_draft_model(draft_model.config, model.config, frees_pages)
  return DraftModelDrafter(
      draft_model, k, max_model_len, num_pages=num_pages, page_size=runner.page_size,
      max_batch=runner.max_batch, token_buckets=runner.token_buckets,
      page_buckets=runner.page_buckets, target_buckets=runner.step_buckets(),
      kv_cache_dtype=config.kv_cache_dtype, rules=rules)


def check_draft_model(draft_cfg, target_cfg, frees_pages: bool) -> None:
  """Refuse (``ValueError``, one line naming the setting and the fix) a draft model the
  engine cannot run beside the model (see :func:`make_drafter`)."""
  if draft_cfg.vocab_size != target_cfg.vocab_size:
    raise ValueError(f"Engine draft_model: its vocab_size={draft_cfg.vocab_size} differs from "
                     f"the model's {target_cfg.vocab_size}; draft with a model of the same "
                     'tokenizer and vocabulary.')
  if 'linear' in draft_cfg.resolved_layer_types:
    raise ValueError("Engine draft_model: its Gated DeltaNet layers keep a state that cannot "
                     'roll back rejected drafts; draft with a model of attention layers only.')
  if frees_pages:
    raise ValueError("Engine speculative_method='draft_model': every attention layer of the "
                     'model slides, so the engine gives pages behind the window back, which '
                     "the draft model still reads; use speculative_method='ngram'.")


def load_draft_model(path: str, target_cfg, mesh):
  """The draft model in the Hugging Face directory ``path`` (``from_pretrained``), computing
  in the model's dtype, on the model's mesh."""
  from maxnnx.models.pretrained import from_pretrained  # noqa: PLC0415
  logger.info('Loading the draft model from %s', path)
  return from_pretrained(path, dtype=target_cfg.runtime.dtype, mesh=mesh)
