"""Serving: many requests at once from one model, with a paged KV cache.

:class:`Engine` is the entry point: ``add_request`` / ``step`` / ``cancel`` for a
driver loop (a server, RL rollouts), ``generate`` to run a list of prompts to
completion. :class:`SamplingParams` sets each request's sampling and stopping (and
:class:`StructuredOutput`, a grammar its output follows);
:class:`RequestOutput` and :class:`Completion` are what comes back. The page
bookkeeping (:class:`PageAllocator`) and the batching policy (:class:`Scheduler`)
run no model and can be used or tested on their own.

:mod:`maxnnx.serving.server` puts an OpenAI-compatible HTTP server on top
(``python -m maxnnx serve model=DIR``, or ``make_app`` for an ASGI app); it is not
imported here, so using the engine does not load the web stack.
"""

from maxnnx.inference.structured import StructuredOutput
from maxnnx.serving.engine import Engine
from maxnnx.serving.pages import PageAllocator, page_hashes
from maxnnx.serving.params import Completion, RequestOutput, SamplingParams, TokenLogprobs
from maxnnx.serving.scheduler import Request, Scheduler

__all__ = ['Completion', 'Engine', 'PageAllocator', 'Request', 'RequestOutput', 'SamplingParams',
           'Scheduler', 'StructuredOutput', 'TokenLogprobs', 'page_hashes']
