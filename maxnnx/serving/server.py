"""An OpenAI-compatible HTTP server over the :class:`~maxnnx.serving.Engine`.

::

  python -m maxnnx serve model=runs/sft/final port=8000

or from Python, ``uvicorn.run(make_app('runs/sft/final'))``. Endpoints:
``POST /v1/completions`` and ``POST /v1/chat/completions`` (with ``"stream": true``:
server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text), vLLM's tokenizer
endpoints ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``
(:mod:`~maxnnx.serving.openai_tokenize`), and with ``allow_runtime_lora_updating`` vLLM's
``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``
(:mod:`~maxnnx.serving.openai_lora`).

**Threads.** The engine is driven from one thread only: :class:`EngineLoop` owns
it on a thread of its own, takes commands (add, cancel) from a thread-safe queue,
and runs ``step()`` while any request is unfinished (it sleeps on the queue
otherwise). The HTTP handlers run on uvicorn's asyncio loop: a request's body is read
there (at most ``max_request_bytes``; a longer one is answered 413), then parsed,
tokenized and validated in a worker thread, so a long prompt never holds up the other
clients (:mod:`~maxnnx.serving.openai_api`; a bad request is answered 4xx before the
engine sees it). Each of its choices is submitted with a *sink*, a
callable the engine thread calls with every output, which hands the output to the
handler's ``asyncio.Queue`` through ``loop.call_soon_threadsafe``. A handler that
sees its client disconnect (a task waiting on the ASGI ``receive``) cancels its
choices in the engine, which releases their pages at once.

**Warm-up.** The engine thread first compiles every program the engine can need
(:meth:`Engine.warmup <maxnnx.serving.Engine.warmup>`; with ``compile_cache`` a restart reads
them back), printing how long it took; ``GET /health`` answers 503 (``"status": "warming
up"``) until then, and ``/metrics`` counts the compiles (``maxnnx_compiles_total``) and any
after ready (``maxnnx_compiles_after_ready_total``: 0 while every request meets a warm
bucket).

**Admission.** The server holds at most ``max_batch + max_queue`` requests
(choices) at a time, running or queued; beyond that it answers 429. After SIGTERM
(or Ctrl-C) uvicorn stops accepting connections and waits for the requests in
flight to finish; the lifespan shutdown then stops the engine thread, and the
process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from maxnnx.data.chat import ChatTemplate
from maxnnx.serving import openai_lora, openai_tokenize
from maxnnx.serving.engine import Engine
from maxnnx.serving.engine_loop import ACCEPTED, EngineLoop
from maxnnx.serving.loading import load_engine, served_model
from maxnnx.serving.metrics import ServerMetrics
from maxnnx.serving.openai_api import ApiError, ParsedRequest, ServedModel, parse_completion
from maxnnx.serving.openai_chat import parse_chat
from maxnnx.serving.openai_responses import (
  ChoiceStream,
  best_choices,
  chunk,
  new_id,
  response_body,
)
from maxnnx.serving.reasoning import check_reasoning_parser
from maxnnx.serving.request_body import parse_json, read_body

logger = logging.getLogger(__name__)

_DISCONNECTED = 'disconnected'
MAX_REQUEST_BYTES = 8 << 20  # the default longest request body (8 MiB)


def _post(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, index: int, event) -> None:
  """A sink: hand ``event`` of choice ``index`` to a handler's queue on its event loop."""
  loop.call_soon_threadsafe(events.put_nowait, (index, event))


class _Job:
  """One HTTP request's choices in the engine: submitted together, followed output by output,
  and cancelled by :meth:`close` if the handler leaves before they finish."""

  def __init__(self, api: _Api, parsed: ParsedRequest, arrival: float):
    self.api, self.parsed, self.arrival = api, parsed, arrival
    self.events: asyncio.Queue = asyncio.Queue()
    tokenizer, eos = api.loop.engine.tokenizer, api.loop.engine.eos_ids
    self.choices = [ChoiceStream(i, tokenizer, p, eos, parsed.tool_format,
                                 parsed.reasoning_parser, parsed.read_calls, parsed.stream)
                    for i, p in enumerate(parsed.params)]
    self.open = set(range(len(self.choices)))
    self.disconnected = False
    self._early: list = []
    self._started: set[int] = set()
    self._watcher: asyncio.Task | None = None
    loop = asyncio.get_running_loop()
    self.tickets = []
    api.in_flight += len(self.choices)
    try:
      for i, params in enumerate(parsed.params):
        sink = functools.partial(_post, loop, self.events, i)
        self.tickets.append(api.loop.submit(parsed.prompt_of(i), params, sink,
                                            parsed.images, parsed.lora))
    except ApiError:
      self.close()
      raise

  async def accepted(self) -> None:
    """Wait until the engine took every choice.

    Raises:
      ApiError: the engine refused one (the others are cancelled by :meth:`close`).
    """
    waiting = len(self.choices)
    while waiting:
      index, event = await self.events.get()
      if isinstance(event, ApiError):
        self._release(index, None)  # refused: never ran
        raise event
      if event is ACCEPTED:
        waiting -= 1
      else:
        self._early.append((index, event))  # an output of a choice accepted earlier

  def watch(self, receive) -> None:
    """Watch the ASGI ``receive`` channel; a client disconnect ends :meth:`next`."""
    async def wait_for_disconnect():
      while (await receive())['type'] != 'http.disconnect':
        pass
      self.events.put_nowait((None, _DISCONNECTED))

    self._watcher = asyncio.ensure_future(wait_for_disconnect())

  async def next(self) -> tuple[ChoiceStream, str, list] | None:
    """The next ``(choice, new text, new log-probabilities)``; ``None`` once every choice
    finished or the client left (:attr:`disconnected`).

    Raises:
      ApiError: the engine failed (500).
    """
    while self.open:
      index, event = self._early.pop(0) if self._early else await self.events.get()
      if event is _DISCONNECTED:
        self.disconnected = True
        return None
      if isinstance(event, ApiError):
        raise event
      if event is ACCEPTED or index not in self.open:
        continue
      choice = self.choices[index]
      if index not in self._started and event.new_token_ids:
        self._started.add(index)
        self.api.metrics.first_token(time.monotonic() - self.arrival)
      text, logprobs = choice.update(event)
      if event.finished:
        self._release(index, event.finish_reason)
      return choice, text, logprobs
    return None

  def close(self) -> None:
    """Cancel the unfinished choices and stop watching the client."""
    for index in sorted(self.open):
      submitted = index < len(self.tickets)
      if submitted:
        self.api.loop.cancel(self.tickets[index])
      self._release(index, 'cancelled' if submitted else None)
    if self._watcher is not None:
      self._watcher.cancel()

  def _release(self, index: int, reason: str | None) -> None:
    """Give back the choice's place in the server; count it in the metrics if it ran."""
    if index not in self.open:
      return
    self.open.discard(index)
    self.api.in_flight -= 1
    if reason is None:
      return
    choice = self.choices[index]
    self.api.metrics.choice_done(reason, len(self.parsed.prompt_of(index)),
                                 len(choice.token_ids), choice.num_cached_tokens,
                                 time.monotonic() - self.arrival)


class _EventStream:
  """An ASGI response streaming a job's chunks as server-sent events."""

  def __init__(self, api: _Api, job: _Job, endpoint: str):
    self.api, self.job, self.endpoint = api, job, endpoint

  async def __call__(self, scope, receive, send) -> None:
    job, parsed = self.job, self.job.parsed
    response_id, name = new_id(parsed.kind), parsed.lora or self.api.served.name
    job.watch(receive)
    self.api.metrics.answered(self.endpoint, 200)

    async def event(data) -> None:
      text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
      await send({'type': 'http.response.body', 'body': f'data: {text}\n\n'.encode(),
                  'more_body': True})

    try:
      await send({'type': 'http.response.start', 'status': 200,
                  'headers': [(b'content-type', b'text/event-stream; charset=utf-8'),
                              (b'cache-control', b'no-cache')]})
      if parsed.kind == 'chat':
        for choice in job.choices:
          await event(chunk(parsed, response_id, name, choice, first=True))
      try:
        while (update := await job.next()) is not None:
          choice, text, logprobs = update
          if text or logprobs or choice.finished or choice.has_deltas:
            await event(chunk(parsed, response_id, name, choice, text, logprobs))
        if job.disconnected:
          return
        if parsed.include_usage:
          await event(chunk(parsed, response_id, name, None, usage_of=job.choices))
      except ApiError as e:
        await event(e.body())
      await event('[DONE]')
      await send({'type': 'http.response.body', 'body': b'', 'more_body': False})
    except OSError:  # the client went away while we wrote
      pass
    finally:
      job.close()


class _Api:
  """The endpoints, sharing the engine loop, the served model and the metrics."""

  def __init__(self, loop: EngineLoop, served: ServedModel, metrics: ServerMetrics,
               max_queue: int, max_request_bytes: int, scorer: Callable | None = None):
    self.loop, self.served, self.metrics = loop, served, metrics
    self.scorer = scorer  # Engine.score_prompt, or None where echo cannot score prompts
    self._scoring = threading.Lock()  # one prompt scored at a time
    self.max_request_bytes = max_request_bytes
    self.capacity = loop.engine.max_batch + max_queue
    self.in_flight = 0  # choices submitted and not finished (touched on the event loop only)
    self.lora_updates = asyncio.Lock()  # one adapter load or unload at a time

  async def completions(self, request: Request) -> Response:
    return await self._generate(request, parse_completion, 'completions')

  async def chat_completions(self, request: Request) -> Response:
    return await self._generate(request, parse_chat, 'chat_completions')

  async def _generate(self, request: Request, parse, endpoint: str):
    arrival = time.monotonic()
    job = None
    try:
      body = await read_body(request, self.max_request_bytes)
      parsed = await run_in_threadpool(parse_json, parse, body, self.served)
      scores = None
      if parsed.echo and parsed.logprobs is not None:
        scores = await run_in_threadpool(self._score, parsed)
      if parsed.score_only:
        return self._scored(endpoint, parsed, scores)
      if self.in_flight + len(parsed.params) > self.capacity:
        raise ApiError(f'The server is full ({self.in_flight} requests in flight, at most '
                       f'{self.capacity}); retry later.', status=429, type='rate_limit_error',
                       code='queue_full')
      job = _Job(self, parsed, arrival)
      await job.accepted()
    except ApiError as e:
      if job is not None:
        job.close()
      return self.error(endpoint, e)
    if parsed.stream:
      return _EventStream(self, job, endpoint)
    job.watch(request.receive)
    try:
      while await job.next() is not None:
        pass
    except ApiError as e:
      return self.error(endpoint, e)
    finally:
      job.close()
    if job.disconnected:
      return Response(status_code=499)  # nobody reads it; the choices were cancelled
    self.metrics.answered(endpoint, 200)
    return JSONResponse(response_body(parsed, new_id(parsed.kind),
                                      parsed.lora or self.served.name,
                                      best_choices(parsed, job.choices), sampled=job.choices,
                                      prompt_scores=scores))

  def _score(self, parsed: ParsedRequest) -> list:
    """Each prompt's log-probabilities (``echo``): what a worker thread runs."""
    if self.scorer is None:
      raise ApiError('echo with logprobs is not supported by a multi-process server.',
                     param='echo', code='unsupported_parameter')
    if parsed.lora is not None:
      raise ApiError('echo with logprobs scores prompts with the base model only; ask the base '
                     f'model ({self.served.name!r}) or leave out echo.', param='echo',
                     code='unsupported_parameter')
    with self._scoring:
      try:
        return [self.scorer(prompt, parsed.logprobs) for prompt in parsed.prompts]
      except ValueError as e:
        raise ApiError(str(e), param='prompt', code='invalid_value') from None

  def _scored(self, endpoint: str, parsed: ParsedRequest, scores) -> Response:
    """The answer of ``max_tokens=0`` with ``echo``: the prompts, nothing generated."""
    engine = self.loop.engine
    choices = [ChoiceStream(i, engine.tokenizer, p, engine.eos_ids)
               for i, p in enumerate(parsed.params)]
    for choice in choices:
      choice.finish_reason = 'length'
    self.metrics.answered(endpoint, 200)
    return JSONResponse(response_body(parsed, new_id(parsed.kind),
                                      parsed.lora or self.served.name, choices,
                                      prompt_scores=scores))

  def error(self, endpoint: str, error: ApiError) -> JSONResponse:
    self.metrics.answered(endpoint, error.status)
    return JSONResponse(error.body(), status_code=error.status)

  def _model_card(self, name: str) -> dict:
    """The base model's card, or a LoRA adapter's (its ``parent`` the base, as vLLM's)."""
    base = name == self.served.name
    return {'id': name, 'object': 'model', 'created': 0, 'owned_by': 'maxnnx',
            'root': name if base else self.loop.engine.adapters.paths.get(name, name),
            'parent': None if base else self.served.name,
            'max_model_len': self.served.max_model_len}

  async def models(self, request: Request) -> Response:
    return JSONResponse({'object': 'list',
                         'data': [self._model_card(n) for n in self.served.model_names]})

  async def model(self, request: Request) -> Response:
    name = request.path_params['name']
    if name not in self.served.model_names:
      return self.error('models', ApiError(
          f"The model {name!r} does not exist; this server serves "
          f"{', '.join(repr(n) for n in self.served.model_names)}.", status=404,
          type='not_found_error', param='model', code='model_not_found'))
    return JSONResponse(self._model_card(name))

  async def load_lora_adapter(self, request: Request) -> Response:
    return await openai_lora.load_lora_adapter(self, request)

  async def unload_lora_adapter(self, request: Request) -> Response:
    return await openai_lora.unload_lora_adapter(self, request)

  async def health(self, request: Request) -> Response:
    if self.loop.healthy:
      return JSONResponse({'status': 'ok'})
    if self.loop.broken is None and self.loop.warming is not None:
      return JSONResponse({'status': 'warming up', 'reason': self.loop.warming},
                          status_code=503)
    return JSONResponse({'status': 'unavailable', 'reason': self.loop.broken or 'stopping'},
                        status_code=503)

  async def tokenize(self, request: Request) -> Response:
    return await self._tokenizer_call(request, 'tokenize', openai_tokenize.tokenize)

  async def detokenize(self, request: Request) -> Response:
    return await self._tokenizer_call(request, 'detokenize', openai_tokenize.detokenize)

  async def _tokenizer_call(self, request: Request, endpoint: str, answer) -> Response:
    try:
      body = await read_body(request, self.max_request_bytes)
      out = await run_in_threadpool(parse_json, answer, body, self.served)
    except ApiError as e:
      return self.error(endpoint, e)
    self.metrics.answered(endpoint, 200)
    return JSONResponse(out)

  async def tokenizer_info(self, request: Request) -> Response:
    return JSONResponse(openai_tokenize.tokenizer_info(self.served))

  async def metrics_text(self, request: Request) -> Response:
    return PlainTextResponse(self.metrics.render(self.in_flight, self.loop.stats),
                             media_type='text/plain; version=0.0.4')


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
  kind = 'not_found_error' if exc.status_code == 404 else 'invalid_request_error'
  return JSONResponse(ApiError(str(exc.detail), status=exc.status_code, type=kind).body(),
                      status_code=exc.status_code, headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> JSONResponse:
  return JSONResponse(ApiError(f'Internal server error: {type(exc).__name__}', status=500,
                               type='server_error').body(), status_code=500)


def make_app(engine_or_model_dir: Engine | str | os.PathLike, *, model_name: str | None = None,
             max_queue: int = 64, max_request_bytes: int = MAX_REQUEST_BYTES,
             chat_template: ChatTemplate | str | None = None, add_bos: bool = True,
             dtype: str | None = None, tensor_parallel: int = 1,
             image_processor=None, reasoning_parser: str | None = None,
             **engine_kwargs) -> Starlette:
  """The server as an ASGI app (run it with uvicorn); nothing starts until the app does.

  Args:
    engine_or_model_dir: an :class:`~maxnnx.serving.Engine` with a tokenizer, or a
      Hugging Face checkpoint directory holding the tokenizer (and chat template),
      such as the ``final/`` of ``maxnnx train`` / ``maxnnx sft``, or its URL (``s3://``,
      ``hf://org/name``: downloaded once, :func:`maxnnx.paths.local_model_dir`).
    model_name: the name clients send as ``model``; default the directory as given,
      or ``'maxnnx'`` for an engine.
    max_queue: requests (choices) held beyond the ``max_batch`` running ones; more
      are answered 429.
    max_request_bytes: the longest request body taken; a longer one is answered 413
      (images in chat messages travel inline, base64: leave room for them).
    chat_template: a :class:`~maxnnx.data.ChatTemplate`, built-in name or Jinja text;
      default the template stored beside the tokenizer (none: the chat endpoint
      answers 400).
    add_bos: start text prompts of ``/v1/completions`` with the tokenizer's BOS id
      (as ``maxnnx generate`` does); token-id prompts are taken as they are.
    dtype: compute dtype of a model loaded from a directory (default the checkpoint's).
    tensor_parallel: devices a model loaded from a directory is sharded over (its
      heads and MLP width; see :func:`load_engine`).
    image_processor: a vision-language model's :class:`~maxnnx.data.ImageProcessor`;
      default the directory's ``preprocessor_config.json`` (or the tower's image size).
      Chat messages may then hold ``{"type": "image_url", "image_url": {"url":
      "data:image/...;base64,..."}}`` parts.
    reasoning_parser: ``deepseek_r1`` or ``qwen3`` (:mod:`~maxnnx.serving.reasoning`): a chat
      reply's ``<think>`` block comes back as ``reasoning_content``; ``None``: all content.
    **engine_kwargs: :class:`~maxnnx.config.EngineConfig` fields (``max_batch``,
      ``token_budget``, ``page_size``, ``max_pages``, ``max_model_len``, ...) and
      ``quantization`` for a model loaded from a directory (:func:`load_engine`).

  In a multi-process run (``jax.distributed``, a model sharded over every process's
  devices) this is process 0's app: its engine calls are replayed by the other processes,
  which run :func:`follow_engine` instead of a server.

  The app's ``state.engine_loop`` is the :class:`EngineLoop` and ``state.metrics`` the
  :class:`~maxnnx.serving.metrics.ServerMetrics`.
  """
  if max_queue < 0:
    raise ValueError(f'max_queue={max_queue} must be >= 0.')
  if max_request_bytes < 1:
    raise ValueError(f'max_request_bytes={max_request_bytes} must be at least 1.')
  engine, served = served_model(engine_or_model_dir, model_name, chat_template, add_bos,
                                 image_processor, dtype=dtype, tensor_parallel=tensor_parallel,
                                 reasoning_parser=check_reasoning_parser(reasoning_parser),
                                 **engine_kwargs)
  leader = _leader(engine)
  loop, metrics = EngineLoop(leader or engine), ServerMetrics()
  api = _Api(loop, served, metrics, max_queue, max_request_bytes,
             scorer=engine.score_prompt if leader is None else None)

  app = Starlette(routes=_routes(api), lifespan=_lifespan(loop, leader),
                  exception_handlers={HTTPException: _http_error, 500: _server_error})
  app.state.engine_loop, app.state.metrics, app.state.leader = loop, metrics, leader
  return app


def _routes(api: _Api) -> list[Route]:
  """The app's endpoints, each to its :class:`_Api` method."""
  return [
      Route('/v1/completions', api.completions, methods=['POST']),
      Route('/v1/chat/completions', api.chat_completions, methods=['POST']),
      Route('/v1/models', api.models, methods=['GET']),
      Route('/v1/models/{name:path}', api.model, methods=['GET']),
      Route('/health', api.health, methods=['GET']),
      Route('/metrics', api.metrics_text, methods=['GET']),
      Route('/tokenize', api.tokenize, methods=['POST']),
      Route('/detokenize', api.detokenize, methods=['POST']),
      Route('/tokenizer_info', api.tokenizer_info, methods=['GET']),
      Route('/v1/load_lora_adapter', api.load_lora_adapter, methods=['POST']),
      Route('/v1/unload_lora_adapter', api.unload_lora_adapter, methods=['POST']),
  ]


def _lifespan(loop: EngineLoop, leader):
  """The app's lifespan: the engine loop runs while the app does; in a multi-process run
  the leader then releases the other processes and all leave together."""

  @contextlib.asynccontextmanager
  async def lifespan(app):
    loop.start()
    try:
      yield
    finally:
      await asyncio.to_thread(loop.stop)
      if leader is not None:  # the other processes' engines return, and all leave together
        leader.close()
        _leave_processes()

  return lifespan


def _leader(engine: Engine):
  """A :class:`~maxnnx.serving.lockstep.LeaderEngine` over ``engine`` in a multi-process
  run, else ``None``."""
  import jax  # noqa: PLC0415
  if jax.process_count() == 1:
    return None
  from maxnnx.serving.lockstep import Channel, LeaderEngine  # noqa: PLC0415
  return LeaderEngine(engine, Channel())


def follow_engine(model_dir: str, *, dtype: str | None = None, tensor_parallel: int = 1,
                  **engine_kwargs) -> int:
  """What every process but 0 of a multi-process server runs: load the same engine as
  process 0 (:func:`load_engine`), then replay its calls until its server stops. Returns
  the number of engine steps taken."""
  import signal  # noqa: PLC0415

  from maxnnx.serving.lockstep import Channel, follow  # noqa: PLC0415
  if threading.current_thread() is threading.main_thread():  # a cluster signals every process
    signal.signal(signal.SIGTERM, lambda *_: logger.info(
        'SIGTERM: this process leaves when process 0 has finished its requests.'))
  engine = load_engine(model_dir, dtype=dtype, tensor_parallel=tensor_parallel, **engine_kwargs)
  steps = follow(engine, Channel())
  _leave_processes()
  return steps


def _leave_processes() -> None:
  """Leave ``jax.distributed`` with the other processes (a barrier): process 0 hosts the
  coordination service, so it must not exit (uvicorn re-raises SIGTERM once it has shut
  down) while another process still talks to it."""
  import jax  # noqa: PLC0415
  jax.distributed.shutdown()


_APP_ONLY = ('model_name', 'max_queue', 'max_request_bytes', 'chat_template', 'add_bos',
             'image_processor', 'reasoning_parser')


@contextlib.contextmanager
def serve_in_thread(app, *, host: str = '127.0.0.1', port: int = 0, log_level: str = 'warning',
                    start_timeout: float = 60.0):
  """Serve the ASGI ``app`` (from :func:`make_app`) with uvicorn in a background thread.

  For a notebook, a test or a benchmark that talks to the server from the same process::

    with serve_in_thread(make_app('runs/sft/final')) as (url, server):
      openai.OpenAI(base_url=f'{url}/v1', api_key='none').completions.create(...)

  ``port=0`` takes a free port. Yields ``(base URL, uvicorn.Server)`` once the server listens
  (``/health`` answers 503 until the engine's warm-up is done); leaving the block stops it and
  lets the requests in flight finish.
  """
  import socket  # noqa: PLC0415

  import uvicorn  # noqa: PLC0415
  sock = socket.socket()
  sock.bind((host, port))
  server = uvicorn.Server(uvicorn.Config(app, log_level=log_level))
  thread = threading.Thread(target=server.run, kwargs={'sockets': [sock]}, daemon=True,
                            name='maxnnx-server')
  thread.start()
  deadline = time.monotonic() + start_timeout
  try:
    while not server.started:
      if not thread.is_alive() or time.monotonic() > deadline:
        raise RuntimeError(f'The server on {host}:{sock.getsockname()[1]} did not start.')
      time.sleep(0.01)
    yield f'http://{host}:{sock.getsockname()[1]}', server
  finally:
    server.should_exit = True
    thread.join(60)
    sock.close()


def serve(model_dir: str, *, host: str = '127.0.0.1', port: int = 8000,
          log_level: str = 'info', **app_kwargs) -> None:
  """Serve the checkpoint in ``model_dir`` over HTTP until SIGTERM or Ctrl-C.

  Either signal stops accepting connections and lets the requests in flight
  finish before the process exits. ``app_kwargs`` go to :func:`make_app`.

  In a multi-process run process 0 serves and the others follow its engine
  (:func:`follow_engine`) until it stops.
  """
  import jax  # noqa: PLC0415
  if jax.process_index() > 0:
    follow_engine(model_dir, **{k: v for k, v in app_kwargs.items() if k not in _APP_ONLY})
    return
  import uvicorn  # noqa: PLC0415
  try:
    app = make_app(model_dir, **app_kwargs)
  except BaseException:
    if jax.process_count() > 1:  # the others loaded their engines and wait: release them
      from maxnnx.serving.lockstep import STOP, Channel, encode_call  # noqa: PLC0415
      Channel().publish(encode_call(STOP))
      _leave_processes()
    raise
  try:
    uvicorn.run(app, host=host, port=port, log_level=log_level, lifespan='on')
  finally:  # also when the server never started (a port in use): release the followers
    if app.state.leader is not None:
      app.state.leader.close()
