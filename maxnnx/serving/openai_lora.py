"""vLLM's runtime LoRA endpoints: ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``
and ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``.

They answer as vLLM's do: ``200`` with a one-line text (``Success: LoRA adapter 'sql' added
successfully.``), or an OpenAI-style error: ``400`` for a refused load (a name in use, no free
slot, a rank above ``max_lora_rank``, a projection without slots, files that do not load) or
an unload of an adapter with unfinished requests, ``404`` for unloading an adapter that is
not served. Both are off unless the engine's ``allow_runtime_lora_updating`` is on (then
``400`` naming the key). The change runs on the engine thread, between two steps
(:meth:`~maxnnx.serving.engine_loop.EngineLoop.call`), never on the event loop; once it is
done ``/v1/models`` lists the adapters served, and a request naming an unloaded adapter is
answered ``404`` as for any unknown model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from maxnnx.serving.lora import UnknownAdapterError
from maxnnx.serving.openai_api import ApiError, ServedModel, _field, _object
from maxnnx.serving.request_body import parse_json, read_body

OFF = ('Loading and unloading LoRA adapters at runtime is off; start the server with '
       'allow_runtime_lora_updating=true (and lora_target_modules naming the projections '
       'adapters may adapt).')


def _name(body, served: ServedModel) -> str:
  name = _field(body, 'lora_name', (str,), '')
  if not name:
    raise ApiError('lora_name is required.', param='lora_name',
                   code='missing_required_parameter')
  if name == served.name:
    raise ApiError(f"lora_name {name!r} is the base model's name; give the adapter its own.",
                   param='lora_name', code='invalid_value')
  return name


def parse_load(body: Any, served: ServedModel) -> tuple[str, str]:
  """``(lora_name, lora_path)`` of a load request's JSON body (``ApiError`` 400 otherwise)."""
  body = _object(body)
  name = _name(body, served)
  path = _field(body, 'lora_path', (str,), '')
  if not path:
    raise ApiError('lora_path is required: the PEFT adapter directory to load.',
                   param='lora_path', code='missing_required_parameter')
  return name, path


def parse_unload(body: Any, served: ServedModel) -> tuple[str]:
  """``(lora_name,)`` of an unload request's JSON body (``ApiError`` 400 otherwise)."""
  return (_name(_object(body), served),)


def _load(name: str, path: str, engine) -> tuple[str, ...]:
  """On the engine thread: load the adapter; the names served after."""
  try:
    engine.load_lora(name, path)
  except ValueError as e:
    raise ApiError(str(e), param='lora_path', code='invalid_value') from None
  return engine.lora_names


def _unload(name: str, engine) -> tuple[str, ...]:
  """On the engine thread: unload the adapter; the names served after."""
  try:
    engine.unload_lora(name)
  except UnknownAdapterError as e:
    raise ApiError(f'The LoRA adapter {name!r} cannot be found: {e}', status=404,
                   type='not_found_error', param='lora_name', code='lora_not_found') from None
  except ValueError as e:
    raise ApiError(str(e), param='lora_name', code='invalid_value') from None
  return engine.lora_names


async def _update(api, request: Request, endpoint: str, parse, change, done: str) -> Response:
  """Parse the body, run ``change(*fields, engine)`` on the engine thread, then serve the
  adapters it leaves (``api.served``)."""
  try:
    if not api.loop.engine.config.allow_runtime_lora_updating:
      raise ApiError(OFF, code='runtime_lora_updating_disabled')
    body = await read_body(request, api.max_request_bytes)
    fields = parse_json(parse, body, api.served)
    async with api.lora_updates:  # the names served follow the changes in their order
      names = await asyncio.wrap_future(api.loop.call(functools.partial(change, *fields)))
      api.served = dataclasses.replace(api.served, lora_names=tuple(names))
  except ApiError as e:
    return api.error(endpoint, e)
  api.metrics.answered(endpoint, 200)
  return PlainTextResponse(f'Success: LoRA adapter {fields[0]!r} {done} successfully.')


async def load_lora_adapter(api, request: Request) -> Response:
  """``POST /v1/load_lora_adapter`` over the server's ``api`` (see the module docstring)."""
  return await _update(api, request, 'load_lora_adapter', parse_load, _load, 'added')


async def unload_lora_adapter(api, request: Request) -> Response:
  """``POST /v1/unload_lora_adapter`` over the server's ``api`` (see the module docstring)."""
  return await _update(api, request, 'unload_lora_adapter', parse_unload, _unload, 'removed')
