"""One engine over several processes: process 0 leads, the others replay its calls.

A model sharded over the devices of several processes (``jax.distributed``) runs each
engine step as one SPMD program, so every process must call the engine's methods in the
same order with the same arguments. In a server only process 0 hears the requests. Process
0 therefore drives a :class:`LeaderEngine`, which publishes every call
(``add_request``, ``cancel``, ``warmup``, ``step``) on a :class:`Channel` *before* making it, and
every other process runs :func:`follow`, which makes the same calls on its own engine
in the same order, until the leader publishes ``stop``.

The engine itself is deterministic given its calls: request ids count up, a request
without a seed gets one derived from the engine's seed and its id, and the scheduler
decides on host data alone. So the followers' engines stay equal to the leader's, and
their device work meets the leader's in every collective. Their outputs are dropped.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import logging
from collections.abc import Sequence

import numpy as np

from maxnnx.inference.structured import StructuredOutput
from maxnnx.serving.engine import Engine
from maxnnx.serving.params import RequestOutput, SamplingParams

STOP = 'stop'
logger = logging.getLogger(__name__)


class Channel:
  """Numbered messages from process 0 to the others, through ``jax.distributed``'s
  key-value store (its coordination service; no device is involved, so a follower can
  wait on it for as long as the server sits idle).

  Messages every follower has read are deleted: each follower records how far it has
  read every ``ack_every`` messages, and process 0 deletes up to the slowest one's mark.

  Args:
    name: key prefix; the processes of one run use the same one.
    ack_every: how often a follower records its progress (and process 0 cleans up).
    poll_ms: how long one wait of a follower lasts before it asks again.
  """

  def __init__(self, name: str = 'maxnnx/lockstep', *, ack_every: int = 64,
               poll_ms: int = 60_000):
    import jax  # noqa: PLC0415
    from jax._src import distributed  # noqa: PLC0415  (the client jax.distributed started)
    self._client = distributed.global_state.client
    if self._client is None:
      raise RuntimeError('A lockstep channel needs a multi-process run: call '
                         'maxnnx.train.distributed.initialize (or jax.distributed.initialize) '
                         'first.')
    self._name, self._ack_every, self._poll_ms = name, ack_every, poll_ms
    self._followers = range(1, jax.process_count())
    self._rank = jax.process_index()
    self._sent = self._received = self._deleted = 0

  def publish(self, message: bytes) -> None:
    """Send the next message (process 0)."""
    self._client.key_value_set_bytes(f'{self._name}/{self._sent}', message)
    self._sent += 1
    if self._sent % self._ack_every == 0:
      read = min((self._read_by(rank) for rank in self._followers), default=self._sent)
      for index in range(self._deleted, read):
        self._client.key_value_delete(f'{self._name}/{index}')
      self._deleted = max(self._deleted, read)

  def _read_by(self, rank: int) -> int:
    try:
      return int(self._client.key_value_try_get(f'{self._name}/read/{rank}'))
    except Exception:  # noqa: BLE001 (not recorded yet: NOT_FOUND)
      return 0

  def receive(self) -> bytes:
    """The next message (the other processes); waits for it as long as it takes."""
    key = f'{self._name}/{self._received}'
    while True:
      try:
        message = self._client.blocking_key_value_get_bytes(key, self._poll_ms)
        break
      except Exception as e:  # noqa: BLE001 (the client raises XlaRuntimeError on a timeout)
        if 'DEADLINE_EXCEEDED' not in str(e) and 'timed out' not in str(e).lower():
          raise
    self._received += 1
    if self._received % self._ack_every == 0:
      self._client.key_value_set(f'{self._name}/read/{self._rank}', str(self._received),
                                 allow_overwrite=True)
    return message


def encode_call(op: str, *args) -> bytes:
  """One engine call as JSON bytes: ``('add', prompt, params, images[, lora])``,
  ``('cancel', request_id)``, ``('load_lora', name, path)``, ``('unload_lora', name)``,
  ``('warmup',)``, ``('step',)`` or ``('stop',)``. Images travel
  as ``.npy`` bytes (never pickle)."""
  if op == 'add':
    prompt, params, images, *lora = args
    lora = lora[0] if lora else None
    body = {'prompt': [int(i) for i in np.asarray(prompt).reshape(-1)],
            'params': dataclasses.asdict(params),
            'images': None if images is None else _npy(images),
            **({} if lora is None else {'lora': lora})}
  elif op == 'cancel':
    body = {'request_id': int(args[0])}
  elif op in ('load_lora', 'unload_lora'):
    body = {'args': [str(a) for a in args]}
  else:
    body = {}
  return json.dumps({'op': op, **body}).encode()


def decode_call(message: bytes) -> tuple:
  """The inverse of :func:`encode_call`."""
  body = json.loads(message)
  op = body['op']
  if op == 'add':
    images = body['images']
    params = body['params']
    if params.get('structured') is not None:  # asdict() flattened it to {kind, spec}
      params = {**params, 'structured': StructuredOutput(**params['structured'])}
    lora = body.get('lora')
    return (op, body['prompt'], SamplingParams(**params),
            None if images is None else np.load(io.BytesIO(base64.b64decode(images))),
            *(() if lora is None else (lora,)))
  if op == 'cancel':
    return op, body['request_id']
  if op in ('load_lora', 'unload_lora'):
    return (op, *body['args'])
  return (op,)


def _npy(array) -> str:
  buffer = io.BytesIO()
  np.save(buffer, np.asarray(array), allow_pickle=False)
  return base64.b64encode(buffer.getvalue()).decode()


class LeaderEngine:
  """Process 0's view of an engine shared with other processes: the engine's own
  interface, where ``add_request``, ``cancel``, ``load_lora``, ``unload_lora`` and ``step``
  are first published on ``channel`` for the followers (:func:`follow`). Everything else is
  the engine's.

  Args:
    engine: this process's :class:`~maxnnx.serving.Engine`.
    channel: a :class:`Channel` (or anything with ``publish(bytes)``).
  """

  def __init__(self, engine: Engine, channel):
    self.engine = engine
    self.channel = channel
    self._closed = False

  def __getattr__(self, name):
    return getattr(self.engine, name)

  def add_request(self, prompt: Sequence[int] | str, params: SamplingParams | None = None,
                  images: np.ndarray | None = None, lora: str | None = None) -> int:
    """:meth:`Engine.add_request`, made on every process (a text prompt is encoded here)."""
    params = SamplingParams() if params is None else params
    prompt = self.engine.prompt_ids(prompt)
    self.channel.publish(encode_call('add', prompt, params, images, lora))
    return self.engine.add_request(prompt, params, images, lora)

  def cancel(self, request_id: int) -> bool:
    """:meth:`Engine.cancel`, made on every process."""
    self.channel.publish(encode_call('cancel', request_id))
    return self.engine.cancel(request_id)

  def load_lora(self, name: str, path: str) -> int:
    """:meth:`Engine.load_lora`, made on every process (each reads ``path``)."""
    self.channel.publish(encode_call('load_lora', name, path))
    return self.engine.load_lora(name, path)

  def unload_lora(self, name: str) -> int:
    """:meth:`Engine.unload_lora`, made on every process."""
    self.channel.publish(encode_call('unload_lora', name))
    return self.engine.unload_lora(name)

  def warmup(self, progress=None) -> float:
    """:meth:`Engine.warmup`, made on every process."""
    self.channel.publish(encode_call('warmup'))
    return self.engine.warmup(progress)

  def step(self) -> list[RequestOutput]:
    """:meth:`Engine.step`, made on every process."""
    self.channel.publish(encode_call('step'))
    return self.engine.step()

  def close(self) -> None:
    """Tell the followers to return (once; later calls do nothing)."""
    if not self._closed:
      self._closed = True
      self.channel.publish(encode_call(STOP))


def follow(engine: Engine, channel) -> int:
  """Replay the leader's engine calls on ``engine`` until it publishes ``stop``; returns
  how many steps ran. A call the leader's engine refused (``ValueError``) is refused here
  too, and skipped alike; a step that fails is logged and passed over, as the leader's
  :class:`~maxnnx.serving.server.EngineLoop` does (it then cancels its requests, and those
  cancellations arrive here too)."""
  steps = 0
  while True:
    op, *args = decode_call(channel.receive())
    if op == STOP:
      return steps
    if op == 'add':
      try:
        engine.add_request(*args)
      except ValueError:
        pass
    elif op == 'cancel':
      engine.cancel(*args)
    elif op in ('load_lora', 'unload_lora'):
      try:
        getattr(engine, op)(*args)
      except ValueError:  # refused on the leader too
        pass
    elif op == 'warmup':
      engine.warmup()
    elif op == 'step':
      steps += 1
      try:
        engine.step()
      except Exception:  # the leader's loop answers its requests with an error and goes on
        logger.exception('An engine step failed; following the leader on.')
    else:
      raise ValueError(f'Unknown lockstep call {op!r}: do the processes run the same maxnnx?')


__all__ = ['Channel', 'LeaderEngine', 'decode_call', 'encode_call', 'follow']
