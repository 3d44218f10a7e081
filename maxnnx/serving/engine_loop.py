"""``EngineLoop``: an :class:`~maxnnx.serving.Engine` driven from a thread of its own.

The engine is driven from one thread only: the loop owns it on a thread of its own, takes
commands (add, cancel, and :meth:`EngineLoop.call`, e.g. loading a LoRA adapter) from a
thread-safe queue, and runs ``step()`` while any request is
unfinished (it sleeps on the queue otherwise). It first warms the engine up (every program
compiled, :meth:`Engine.warmup <maxnnx.serving.Engine.warmup>`). The HTTP server
(:mod:`maxnnx.serving.server`) submits each choice with a *sink*, a callable the engine
thread calls with every output; in a multi-process run the loop drives the leader's engine
(:mod:`maxnnx.serving.lockstep`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from maxnnx.serving.engine import Engine
from maxnnx.serving.lora import UnknownAdapterError
from maxnnx.serving.openai_api import ApiError
from maxnnx.serving.params import SamplingParams

logger = logging.getLogger(__name__)

ACCEPTED = 'accepted'  # what a sink receives once the engine has taken its request


class Ticket:
  """A submitted request; ``request_id`` is the engine's id once the engine thread added it."""

  __slots__ = ('request_id',)

  def __init__(self):
    self.request_id: int | None = None


class EngineLoop:
  """Owns an :class:`~maxnnx.serving.Engine` and drives it from a thread of its own.

  Every method may be called from any thread. A sink (given to :meth:`submit`) is
  called on the engine thread with :data:`ACCEPTED` once the request is in the
  engine, then with each :class:`~maxnnx.serving.RequestOutput` of it, or once with
  an :class:`~maxnnx.serving.openai_api.ApiError` if the engine refused it (400) or
  failed (500). Sinks must not block.

  Attributes:
    engine: the engine (touch it only through this loop while it runs).
    warming: what the warm-up is doing, ``None`` once it ended (``/health`` answers 503
      until then; requests submitted meanwhile wait in the queue).
    stats: a snapshot published after warm-up and each step: ``running``, ``waiting``,
      ``pages_used``, ``pages_total``, ``preemptions``, ``steps``, ``compiles``,
      ``compile_cache_hits``, ``compiles_after_ready``, the speculative decoding counts
      ``spec_drafts``, ``spec_draft_tokens``, ``spec_accepted_tokens`` and
      ``spec_accepted_per_position`` (and
      ``sliding_pages_used`` / ``sliding_pages_total`` when the sliding layers have a
      pool of their own).
  """

  def __init__(self, engine: Engine):
    self.engine = engine
    self._commands: queue.SimpleQueue = queue.SimpleQueue()
    self._sinks: dict[int, Callable] = {}
    self._stopping = threading.Event()
    self._thread: threading.Thread | None = None
    self._lock = threading.Lock()
    self._steps = 0
    self._failures = 0
    self.broken: str | None = None
    self.warming: str | None = 'waiting for the engine thread'
    self.stats: dict = {}
    self._publish()

  def start(self) -> None:
    """Start the engine thread (once; later calls do nothing)."""
    with self._lock:
      if self._thread is None:
        self._thread = threading.Thread(target=self._run, name='maxnnx-engine', daemon=True)
        self._thread.start()

  @property
  def healthy(self) -> bool:
    """Whether the engine thread runs, has warmed up and takes requests."""
    return (self._thread is not None and self._thread.is_alive() and self.broken is None
            and self.warming is None and not self._stopping.is_set())

  def submit(self, prompt: Sequence[int], params: SamplingParams, sink: Callable,
             images=None, lora: str | None = None) -> Ticket:
    """Queue a request for the engine thread; its events go to ``sink``. ``images``:
    its pixels, ``lora``: its adapter (``Engine.add_request``).

    Raises:
      ApiError: (503) when the loop is stopping or its engine failed.
    """
    self._check_open()
    self.start()
    ticket = Ticket()
    self._commands.put(('add', ticket, prompt, params, sink, images, lora))
    return ticket

  def call(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future:
    """Run ``fn(engine)`` on the engine thread, between two steps and after the commands
    queued before it; returns a future of its result (or of the exception it raised).

    Raises:
      ApiError: (503) when the loop is stopping or its engine failed.
    """
    self._check_open()
    self.start()
    future = concurrent.futures.Future()
    self._commands.put(('call', future, fn, None, None, None, None))
    return future

  def _check_open(self) -> None:
    """Refuse (503) new work once the loop is stopping or its engine failed."""
    if self._stopping.is_set() or self.broken is not None:
      raise ApiError('The server is shutting down.' if self.broken is None else
                     f'The engine failed: {self.broken}', status=503, type='server_error',
                     code='unavailable')

  def cancel(self, ticket: Ticket) -> None:
    """Cancel a submitted request (nothing happens if it already finished)."""
    self._commands.put(('cancel', ticket, None, None, None, None, None))

  def stop(self, timeout: float | None = None) -> None:
    """Stop taking requests, let the engine finish the ones it has, and end the thread."""
    self._stopping.set()
    self._commands.put(None)  # wakes the thread if it sleeps on the queue
    if self._thread is not None:
      self._thread.join(timeout)

  # -- the engine thread ----------------------------------------------------------

  def _run(self) -> None:
    self._warm_up()
    while True:
      busy = self.engine.has_unfinished()
      if not busy and self._stopping.is_set() and self._commands.empty():
        break
      self._take_commands(wait=not busy)
      if self.engine.has_unfinished():
        self._step()
    for sink in self._sinks.values():  # only left if the engine failed
      _deliver(sink, ApiError('The server stopped.', status=503, type='server_error'))

  def _warm_up(self) -> None:
    """Compile every program the engine can need (:meth:`~maxnnx.serving.Engine.warmup`)
    before the loop takes requests (they queue meanwhile); ``/health`` answers 503 until it
    ends, and its time is printed."""
    def progress(done: int, total: int) -> None:
      self.warming = f'warming up: {done} of {total} programs compiled'

    try:
      seconds = self.engine.warmup(progress)
    except Exception as e:
      logger.exception('Warm-up failed; the server answers 503.')
      self.broken = f'warm-up failed: {type(e).__name__}: {e}'
    else:
      counts = self.engine.compiles
      print(f'Warm: {counts.programs} programs in {seconds:.1f} s ({counts.cache_hits} read '
            f'from compile_cache); ready.', flush=True)
    self.warming = None
    self._publish()

  def _take_commands(self, wait: bool) -> None:
    try:
      command = self._commands.get(timeout=0.5) if wait else self._commands.get_nowait()
    except queue.Empty:
      return
    while True:
      if command is not None:
        self._apply(*command)
      try:
        command = self._commands.get_nowait()
      except queue.Empty:
        return

  def _apply(self, kind: str, ticket: Ticket, prompt, params, sink, images, lora) -> None:
    if kind == 'call':  # ticket: the future, prompt: the function
      self._call(ticket, prompt)
      return
    if kind == 'cancel':
      if ticket.request_id in self._sinks:
        self.engine.cancel(ticket.request_id)
      return
    if self.broken is not None:
      _deliver(sink, ApiError(f'The engine failed: {self.broken}', status=503,
                              type='server_error', code='unavailable'))
      return
    try:
      request_id = self.engine.add_request(list(prompt), params, images, lora)
    except UnknownAdapterError as e:  # unloaded since the request was checked
      _deliver(sink, ApiError(str(e), status=404, type='not_found_error', param='model',
                              code='model_not_found'))
      return
    except ValueError as e:
      _deliver(sink, ApiError(str(e), code='invalid_value'))
      return
    ticket.request_id = request_id
    self._sinks[request_id] = sink
    _deliver(sink, ACCEPTED)

  def _call(self, future: concurrent.futures.Future, fn: Callable) -> None:
    if not future.set_running_or_notify_cancel():
      return
    if self.broken is not None:
      future.set_exception(ApiError(f'The engine failed: {self.broken}', status=503,
                                    type='server_error', code='unavailable'))
      return
    try:
      result = fn(self.engine)
    except Exception as e:  # the caller's to answer
      future.set_exception(e)
    else:
      future.set_result(result)
    self._publish()

  def _step(self) -> None:
    try:
      outputs = self.engine.step()
    except Exception as e:  # keep serving: fail this step's requests, not the server
      logger.exception('An engine step failed; its requests are answered with an error.')
      self._fail(e)
      return
    self._failures = 0
    self._steps += 1
    for out in outputs:
      sink = (self._sinks.pop(out.request_id, None) if out.finished else
              self._sinks.get(out.request_id))
      if sink is not None:
        _deliver(sink, out)
    self._publish()

  def _fail(self, error: Exception) -> None:
    self._failures += 1
    for request_id, sink in self._sinks.items():
      _deliver(sink, ApiError(f'The engine failed: {error}', status=500, type='server_error',
                              code='engine_error'))
      with contextlib.suppress(Exception):
        self.engine.cancel(request_id)
    self._sinks.clear()
    try:
      self.engine.step()  # reports the cancellations; runs nothing (no request is left)
    except Exception:
      self._failures += 1
    if self._failures > 1:  # the engine cannot recover: refuse new requests with 503
      self.broken = f'{type(error).__name__}: {error}'
      self._stopping.set()

  def _publish(self) -> None:
    engine = self.engine
    self.stats = {
        'running': len(engine.scheduler.running), 'waiting': len(engine.scheduler.waiting),
        'pages_used': engine.max_pages - engine.allocator.num_available,
        'pages_total': engine.max_pages, 'preemptions': engine.scheduler.num_preemptions,
        'steps': self._steps, 'compiles': engine.compiles.compiled,
        'compile_cache_hits': engine.compiles.cache_hits,
        'compiles_after_ready': engine.compiles.after_warmup,
        'spec_drafts': engine.spec.drafts, 'spec_draft_tokens': engine.spec.draft_tokens,
        'spec_accepted_tokens': engine.spec.accepted_tokens,
        'spec_accepted_per_position': tuple(engine.spec.accepted_per_position)}
    if engine.window_allocator is not None:
      self.stats['sliding_pages_used'] = (engine.max_window_pages
                                          - engine.window_allocator.num_available)
      self.stats['sliding_pages_total'] = engine.max_window_pages


def _deliver(sink: Callable, event) -> None:
  try:
    sink(event)
  except Exception:  # e.g. the handler's event loop has closed
    logger.debug('Dropped an engine event for a closed handler.', exc_info=True)
