"""DeepSeek V3's multi-token-prediction module as a drafter for the serving engine.

MTP module 0 (:mod:`maxnnx.layers.mtp`) at position ``t`` takes the target's last block output
at ``t`` (before the final norm) and the embedding of token ``t + 1``, and predicts token
``t + 2``. :class:`MTPRunner` runs it as the engine runs the target:

* :meth:`MTPRunner.run` after a target step, over that step's flat token layout (the
  :class:`~maxnnx.kernels.paged_attention.PagedBatch` of :meth:`ModelRunner.layout`), with the
  step's hidden states (``ModelRunner(return_hidden=True)``, :attr:`ModelRunner.hidden_TD`) and
  the token after each flat token (:func:`next_token_ids`, once the step's tokens are
  verified). It writes the module's keys and values at the step's slots and returns its logits
  and outputs at the flat tokens asked for: each row's last kept token gives the first draft.
  Rejected positions get whatever token follows them; their entries are written over when the
  target computes those positions again.
* :meth:`MTPRunner.chain` then drafts 2..k: one-token paged steps of the module at positions
  ``p + 1 .. p + k - 1``, each fed its own previous output as the hidden state and the
  previous draft as the token (as :mod:`maxnnx.inference.mtp_draft` does).

**Pages.** The module has a page pool of its own, indexed by the same page ids as the target's
(same ``page_size``, pages ``0 .. num_pages - 1``), so the scheduler's pages serve both. The
chained positions lie past the request's computed tokens, where it may hold no page yet: each
row has ``chain_pages`` private pages past the shared ones (pool pages ``num_pages + row *
chain_pages ..``) that stand in for the request's missing pages during :meth:`chain`.

**In the engine** (``speculative_method='mtp'``), :class:`MTPDrafter` drives it through the
drafter hooks (:mod:`maxnnx.serving.drafters`): after the target's step it keeps the step's
inputs and hidden states; before the next schedule, when the requests show what the step kept,
it runs :meth:`MTPRunner.run` over that step (each decoding row's last kept token is its
position ``p``), keeps each row's output at ``p`` in a store of ``max_batch`` slots, runs
:meth:`MTPRunner.chain` from the stored outputs, and sets each decoding request's
``draft_ids``: a decoding request the step left out drafts from the output stored before.
With prefix caching, the module's entry at the last token of a request's last cached page
holds the first request's next token there (recomputing it on a hit would need a private
copy of that page and the target's hidden state at that token; see ``docs/architecture.md``):
only that request's drafts can differ, never its tokens.

**Buckets.** :meth:`run` compiles once per target bucket (:meth:`ModelRunner.step_buckets`,
gathering ``max_batch`` rows), :meth:`chain` once per page bucket; :meth:`warm` compiles both
sets.
"""

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from maxnnx.kernels.paged_attention import PagedBatch
from maxnnx.serving.drafters import Drafter
from maxnnx.serving.model_runner import ModelRunner, smallest_holding, working_copy
from maxnnx.sharding import state_shardings


def next_token_ids(rows: Sequence[tuple[Sequence[int], int, int]], width: int) -> np.ndarray:
  """The token after each flat token of a step ``[width]`` int32 (0 where none is known).

  Args:
    rows: per scheduled row, in the step's order, ``(token_ids, start, count)``: the request's
      tokens once the step's are verified and appended, the position of its first token in
      the step (``num_computed`` before the step), and its tokens in the step.
    width: the step's flat token count (its bucket).
  """
  next_T = np.zeros(width, np.int32)
  offset = 0
  for token_ids, start, count in rows:
    known = max(0, min(count, len(token_ids) - start - 1))
    next_T[offset:offset + known] = token_ids[start + 1:start + 1 + known]
    offset += count
  return next_T


class MTPRunner:
  """MTP module 0 over the engine's steps, on a page pool of its own (see the module docstring).

  Args:
    model: the served :class:`~maxnnx.Transformer`, with ``mtp.num_layers >= 1`` (not
      modified).
    runner: the target's :class:`ModelRunner` (page size, pool size, rows and buckets).
    num_draft_tokens: drafts per row, ``k >= 1`` (:meth:`chain` runs ``k - 1`` steps).
    rules: logical-axis rules for the pool of a sharded model.

  Attributes:
    params, cache: the parameters and the cache state (the module's pool) the steps run on.
    chain_pages: private pages per row for :meth:`chain`'s positions past a request's pages.
    traces: ``[run traces, chain traces]``.
  """

  def __init__(self, model, runner: ModelRunner, num_draft_tokens: int, rules=None):
    if model.mtp is None:
      raise ValueError('MTP drafting needs a model with MTP modules: mtp.num_layers=0; use a '
                       'checkpoint that has them (DeepSeek V3).')
    if num_draft_tokens < 1:
      raise ValueError(f'num_draft_tokens={num_draft_tokens}: expected at least 1.')
    self.runner = runner
    self.k = num_draft_tokens
    self.page_size, self.max_batch, self.num_pages = (runner.page_size, runner.max_batch,
                                                      runner.num_pages)
    self.chain_pages = max(1, -(-(num_draft_tokens - 1) // self.page_size))
    self.dtype = model.config.jnp_dtype()
    work = working_copy(model)  # the pool is not added to `model`
    work.mtp[0].block.attn.init_paged_cache(
        self.num_pages + self.max_batch * self.chain_pages, self.page_size, self.dtype)
    graphdef, self.params, self.cache = nnx.split(work, nnx.Param, ...)
    if runner.mesh is not None:
      self.cache = jax.device_put(self.cache, state_shardings(self.cache, runner.mesh, rules))
    self.traces = [0, 0]
    self._run_fn = _make_run(graphdef, self.traces)
    self._chain_fn = _make_chain(graphdef, self.traces, self.k, self.page_size)

  def run(self, inputs: tuple, hidden_TD, next_ids_T, at_N) -> tuple[jax.Array, jax.Array]:
    """The module over a target step's flat tokens; its logits and outputs at ``at_N``.

    Args:
      inputs: the target step's inputs (:meth:`ModelRunner.layout`).
      hidden_TD: the target step's hidden states before the final norm
        (:attr:`ModelRunner.hidden_TD`).
      next_ids_T: the token after each flat token (:func:`next_token_ids`).
      at_N: flat indices to return (``[max_batch]`` in the warm buckets: each row's last kept
        token; an empty row any index).

    Returns:
      ``(logits_NV, out_ND)``: float32 logits at ``at_N`` (predicting the token two after
      each) and the module's outputs there (before its final norm; :meth:`chain`'s input).
      On the device.
    """
    _, positions_T, batch, *_ = inputs
    logits_NV, out_ND, self.cache = self._run_fn(
        self.params, self.cache, jnp.asarray(hidden_TD, self.dtype),
        jnp.asarray(next_ids_T, jnp.int32), positions_T, batch, jnp.asarray(at_N, jnp.int32))
    return logits_NV, out_ND

  def chain(self, out_BD, logits_BV, rows: Sequence[tuple[Sequence[int], int] | None]
            ) -> tuple[jax.Array, jax.Array]:
    """``k`` greedy drafts per row: the argmax of :meth:`run`'s logits, then ``k - 1`` steps
    of the module on its own output and the previous draft.

    Args:
      out_BD, logits_BV: :meth:`run`'s outputs, ``max_batch`` rows.
      rows: per row (``max_batch`` at most; missing rows are empty), ``None`` for a row
        that drafts nothing, else ``(pages, position)``: the request's pages and the
        position ``p`` of the row's :meth:`run` output. Step ``j`` runs at ``p + j``; a
        position past the widest page bucket is not run (its drafts are meaningless).

    Returns:
      ``(drafts_BK, logits_BKV)``: int32 drafts and the float32 logits each was the argmax
      of, on the device.
    """
    ps, rows = self.page_size, list(rows) + [None] * (self.max_batch - len(rows))
    needed = max([(row[1] + self.k - 1) // ps + 1 for row in rows if row is not None] or [1])
    table_BM = np.zeros((self.max_batch, smallest_holding(self.runner.page_buckets, needed)),
                        np.int32)
    positions_B = np.zeros(self.max_batch, np.int32)
    active_B = np.zeros(self.max_batch, bool)
    for b, row in enumerate(rows):
      if row is None:
        continue
      pages, positions_B[b], active_B[b] = row[0][:table_BM.shape[1]], row[1], True
      private = self.num_pages + b * self.chain_pages + np.arange(self.chain_pages)
      table_BM[b] = np.concatenate([pages, private, np.zeros(table_BM.shape[1], np.int32)]
                                   )[:table_BM.shape[1]]
    drafts_BK, logits_BKV, self.cache = self._chain_fn(
        self.params, self.cache, out_BD, logits_BV, positions_B, table_BM, active_B)
    return drafts_BK, logits_BKV

  def num_warm(self) -> int:
    """The programs :meth:`warm` builds: one per target bucket and one per page bucket."""
    return len(self.runner.step_buckets()) + len(self.runner.page_buckets)

  def warm(self, progress=None, chain_inputs=None) -> tuple[jax.Array, jax.Array]:
    """Compile :meth:`run` for every target bucket and :meth:`chain` for every page bucket
    (empty rows: they write the scratch page only); ``progress()`` after each.

    Args:
      chain_inputs: a function of :meth:`run`'s ``(logits_BV, out_BD)`` giving the arrays
        :meth:`chain` is warmed on (``None``: those; a caller that feeds :meth:`chain` other
        arrays compiles it for theirs).

    Returns:
      The last :meth:`run`'s ``(logits_BV, out_BD)``.
    """
    runner, d = self.runner, self.runner.model_config.d_model
    out = None
    for shape in runner.step_buckets():
      inputs = runner._model_inputs(shape, runner._blank_inputs(shape))
      width = shape[0]
      out = self.run(inputs, jnp.zeros((width, d), self.dtype), np.zeros(width, np.int32),
                     np.zeros(self.max_batch, np.int32))
      if progress is not None:
        progress()
    logits_BV, out_BD = out if chain_inputs is None else chain_inputs(*out)
    for pages in runner.page_buckets:
      active_B = np.zeros(self.max_batch, bool)
      result = self._chain_fn(self.params, self.cache, out_BD, logits_BV,
                              np.zeros(self.max_batch, np.int32),
                              np.zeros((self.max_batch, pages), np.int32), active_B)
      self.cache = result[-1]
      if progress is not None:
        progress()
    jax.block_until_ready(self.cache)
    return out


class MTPDrafter(Drafter):
  """The engine's drafter for ``speculative_method='mtp'`` (see the module docstring).

  Each running request's last module output (at its last kept token ``p``, with the logits
  there) stays in a store of ``max_batch`` slots on the device, so that a decoding request a
  step left out (the token budget ran out) drafts from it at the next step.

  Args:
    model: the served model, with MTP modules.
    runner: the engine's :class:`ModelRunner`, built with ``return_hidden=True``.
    num_speculative_tokens, max_model_len: as :class:`~maxnnx.serving.drafters.Drafter`'s.
    rules: logical-axis rules for the module's pool of a sharded model.

  Attributes:
    mtp: the :class:`MTPRunner`.
  """

  def __init__(self, model, runner: ModelRunner, num_speculative_tokens: int,
               max_model_len: int, rules: dict | None = None):
    super().__init__(num_speculative_tokens, max_model_len)
    if not runner.return_hidden:
      raise ValueError('MTPDrafter needs ModelRunner(return_hidden=True).')
    self.mtp = MTPRunner(model, runner, num_speculative_tokens, rules)
    self._last = None  # the last step: (inputs, hidden_TD, [(request, start, count)])
    self._drafted: list = []  # the requests given drafts before this schedule
    rows, config = self.mtp.max_batch, model.config
    self._store = (np.zeros((rows, config.d_model), self.mtp.dtype),
                   np.zeros((rows, config.vocab_size), np.float32))
    if runner.mesh is not None:  # replicated over the model's devices
      self._store = jax.device_put(self._store, NamedSharding(runner.mesh, PartitionSpec()))
    else:
      self._store = jax.device_put(self._store)
    self._slots: dict[int, tuple] = {}  # id(request): (request, slot, its position p)

  def after_step(self, scheduled, inputs: tuple, outputs: tuple) -> None:
    """Keep the step's inputs, hidden states and rows (their first positions before it)."""
    self._last = (inputs, self.mtp.runner.hidden_TD,
                  [(request, request.num_computed, count) for request, count in scheduled])

  def before_schedule(self, running) -> None:
    """The module over the last step (its tokens now verified), its output at each row's
    last kept token ``p`` stored; then each decoding request's drafts from its stored
    output at ``p``: the module's argmax there and ``k - 1`` chained ones, cut to
    :meth:`room`."""
    for request in running:
      request.draft_ids = []
    self._drafted = []
    live = {id(request) for request in running}
    self._slots = {key: entry for key, entry in self._slots.items() if key in live}
    if self._last is not None:
      self._run_last(live)
    chain_rows, slot_B, rooms = [], np.zeros(self.mtp.max_batch, np.int32), []
    for request in running:
      room, entry = self.room(request), self._slots.get(id(request))
      if room and entry is not None and entry[2] == request.num_tokens - 2:
        slot_B[len(chain_rows)] = entry[1]
        chain_rows.append((request.pages, entry[2]))
        rooms.append((request, room))
    if not rooms:
      return
    out_BD, logits_BV = _gather(*self._store, slot_B)
    drafts_BK = np.asarray(jax.device_get(self.mtp.chain(out_BD, logits_BV, chain_rows)[0]))
    for row, (request, room) in enumerate(rooms):
      request.draft_ids = drafts_BK[row, :room].tolist()
      self._drafted.append(request)

  def _run_last(self, live: set[int]) -> None:
    """:meth:`MTPRunner.run` over the last step; each live row's output at its last kept
    token into the request's slot of the store."""
    (inputs, hidden_TD, rows), self._last = self._last, None
    free = sorted(set(range(self.mtp.max_batch)) - {e[1] for e in self._slots.values()})
    at_B = np.zeros(self.mtp.max_batch, np.int32)
    into_B = np.full(self.mtp.max_batch, self.mtp.max_batch, np.int32)  # past the end: drop
    offset = 0
    for row, (request, start, count) in enumerate(rows):
      p = request.num_tokens - 2
      if id(request) in live and start <= p < start + count:
        entry = self._slots.get(id(request))
        slot = entry[1] if entry is not None else free.pop(0)
        self._slots[id(request)] = (request, slot, p)
        at_B[row], into_B[row] = offset + p - start, slot
      offset += count
    next_T = next_token_ids([(r.token_ids, start, n) for r, start, n in rows], len(inputs[0]))
    logits_BV, out_BD = self.mtp.run(inputs, hidden_TD, next_T, at_B)
    self._store = _scatter(*self._store, out_BD, logits_BV, into_B)

  def after_schedule(self, scheduled) -> None:
    """Drop the drafts of running requests the schedule left out (they are not verified)."""
    chosen = {id(request) for request, _ in scheduled}
    for request in self._drafted:
      if id(request) not in chosen:
        request.draft_ids = []

  def num_warm(self) -> int:
    """:meth:`MTPRunner.num_warm`."""
    return self.mtp.num_warm()

  def warm(self, progress=None) -> None:
    """:meth:`MTPRunner.warm` (its chains on the store's reads), and the store's writes."""
    rows = self.mtp.max_batch

    def through_store(logits_BV, out_BD):
      self._store = _scatter(*self._store, out_BD, logits_BV, np.full(rows, rows, np.int32))
      out_BD, logits_BV = _gather(*self._store, np.zeros(rows, np.int32))
      return logits_BV, out_BD

    self.mtp.warm(progress, through_store)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _scatter(store_SD, store_SV, out_BD, logits_BV, into_B):
  """The store with row ``b`` of the outputs written at slot ``into_B[b]`` (past the end:
  not written)."""
  return (store_SD.at[into_B].set(out_BD.astype(store_SD.dtype), mode='drop'),
          store_SV.at[into_B].set(logits_BV.astype(store_SV.dtype), mode='drop'))


@jax.jit
def _gather(store_SD, store_SV, slot_B):
  """The stored outputs and logits of slots ``slot_B``."""
  return store_SD[slot_B], store_SV[slot_B]


def _mtp_logits(model, out_ND):
  """Float32 logits ``[N, V]`` of the module's outputs (its final norm, the shared head)."""
  return model.logits(model.mtp[0].final_norm(out_ND[None]))[0].astype(jnp.float32)


def _make_run(graphdef, traces: list[int]):
  """The jitted :meth:`MTPRunner.run` step over ``graphdef``'s model."""

  @functools.partial(jax.jit, donate_argnums=(1,))
  def run(params, cache, hidden_TD, next_ids_T, positions_T, batch, at_N):
    traces[0] += 1
    model = nnx.merge(graphdef, params, cache)
    out_TD = model.mtp_paged(0, hidden_TD[None], next_ids_T[None], positions_T[None], batch)[0]
    out_ND = out_TD[at_N]
    return _mtp_logits(model, out_ND), out_ND, nnx.state(model, nnx.Not(nnx.Param))

  return run


def _make_chain(graphdef, traces: list[int], k: int, page_size: int):
  """The jitted :meth:`MTPRunner.chain` (``k - 1`` one-token paged steps, unrolled)."""

  @functools.partial(jax.jit, donate_argnums=(1,))
  def chain(params, cache, out_BD, logits_BV, positions_B, table_BM, active_B):
    traces[1] += 1
    model = nnx.merge(graphdef, params, cache)
    rows_B = jnp.arange(positions_B.shape[0], dtype=jnp.int32)
    drafts, logits = [jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)], [logits_BV]
    for j in range(1, k):
      pos_B = positions_B + j
      block_B = pos_B // page_size
      live_B = (active_B & (block_B < table_BM.shape[1])).astype(jnp.int32)
      slots_B = live_B * (table_BM[rows_B, jnp.minimum(block_B, table_BM.shape[1] - 1)]
                          * page_size + pos_B % page_size)
      batch = PagedBatch(table_BM, (pos_B + 1) * live_B, rows_B, live_B, slots_B, 1)
      out_BD = model.mtp_paged(0, out_BD[None], drafts[-1][None], pos_B[None], batch)[0]
      logits_BV = _mtp_logits(model, out_BD)
      drafts.append(jnp.argmax(logits_BV, axis=-1).astype(jnp.int32))
      logits.append(logits_BV)
    return (jnp.stack(drafts, axis=1), jnp.stack(logits, axis=1),
            nnx.state(model, nnx.Not(nnx.Param)))

  return chain
