"""``Engine``: continuous batching over a paged KV cache, one jitted step at a time.

The caller drives it from one thread::

  engine = Engine(model, max_batch=8, token_budget=256)
  rid = engine.add_request(prompt_ids, SamplingParams(max_tokens=64, temperature=0.7))
  while engine.has_unfinished():
    for out in engine.step():          # new tokens of each request that produced one
      ...
  engine.cancel(rid)                   # any time; its pages are released at once

Each :meth:`Engine.step` asks the :class:`~maxnnx.serving.scheduler.Scheduler`
for the next batch (decoding requests first, then prefill chunks, within the
token budget), lays the tokens of every scheduled request out as one flat
sequence, runs the model once over it, samples one token for every request whose
tokens are all computed, and applies the stop rules on the host.

**The parts.** As in vLLM's v1 engine, :class:`Engine` is glue over four parts, each
usable and tested on its own:

* the :class:`~maxnnx.serving.scheduler.Scheduler` decides which requests run and how many of
  their tokens; it owns the :class:`~maxnnx.serving.kv_cache.CacheManager`, one manager per
  kind of layer (full pages, sliding pages, recurrent state slots);
* the :class:`~maxnnx.serving.model_runner.ModelRunner` lays the scheduled tokens out as one
  flat, bucketed batch and runs the jitted model step over the paged cache (where the pools
  live, and image embeddings);
* the :class:`~maxnnx.serving.batch_sampler.BatchSampler` samples each row with its controls
  (logit bias, penalties, grammar masks);
* the :class:`~maxnnx.serving.output_processor.OutputProcessor` detokenizes incrementally and
  holds every stop rule.

**Compiled shapes, and warm-up.** A step is two jitted calls, the model and the sampler. The
model's shapes are bucketed (flat tokens, widest row, pages per row, wide rows), the buckets
are a small set known when the engine is built (:meth:`Engine.step_buckets`,
:meth:`Engine.sampler_variants`), and :meth:`Engine.warmup` compiles every one before any
request, so a warm engine never compiles while it serves (``docs/architecture.md``, Serving,
lists the buckets and their number). :attr:`Engine.compiles` counts the programs built.

**Sampling controls and structured outputs** are the sampler's
(:mod:`maxnnx.serving.batch_sampler`): ``logit_bias``, ``min_tokens`` and the penalties travel
in every step in fixed shapes, and a request with ``SamplingParams.structured`` gets a grammar
matcher whose allowed tokens mask its row, so one program serves every mix of rows and warm-up
compiles nothing more. A finished grammar ends the request (reason ``stop``).

Page 0 of the pool is a scratch page: padding tokens write there and empty
block-table entries point there (masked by the row lengths).

**Sliding windows.** When every attention layer slides, a request's pages behind the
window of its next token go back to the pool as it advances. When sliding and full layers
mix (unscanned), the sliding layers have a smaller pool of their own
(:attr:`Engine.window_allocator`, ``PagedBatch.window_page_table_BM``) whose pages go back
the same way, while the full layers keep every page.

**Recurrent layers.** A model with Gated DeltaNet layers (Qwen3-Next, Qwen3.5) keeps,
in those layers, a fixed-size state per request instead of pages: the engine gives each
running request one of ``max_batch`` state slots (``PagedBatch.state_slots_B``; slot 0
is scratch) and takes it back when the request finishes, is cancelled or is preempted.
A request that starts (or restarts after preemption) at position 0 starts from a zero
state, and chunked prefill carries the state from chunk to chunk. Its attention layers
are paged as usual. Prefix caching is off for such a model: pages could be shared, but
the state after a shared prefix is not kept.

**Speculative decoding.** A drafter (:mod:`maxnnx.serving.drafters`) gives each decoding
request up to ``num_speculative_tokens`` drafts per step: prompt lookup on the host
(``speculative_method='ngram'``), or a smaller model of the same vocabulary
(``'draft_model'``, ``Engine(model, draft_model=small)`` or ``speculative_model=<dir>``) that
drafts greedily in a page pool of its own indexed by the target's page tables, so that the
scheduler's pages and prefix cache serve both models, or DeepSeek V3's MTP module (``'mtp'``,
:mod:`maxnnx.serving.mtp_runner`) fed the model's hidden states. The step verifies the drafts
with the request's last token (``k + 1`` query tokens through the paged cache), and the
request gains the drafts the model keeps plus one token of the model's, each put through the
stop rules in order (see :mod:`maxnnx.serving.speculation`; :attr:`Engine.spec` counts drafted
and accepted tokens). Greedy output is plain decoding's; sampled rows keep the model's
distribution (the drafts are deterministic, so the verifier's rejection sampling is exact).
The verification steps add one bucket per page bucket, the verifier one program per sampler
variant, and a draft model its own programs of each bucket, all compiled by
:meth:`Engine.warmup`. Models with recurrent layers are refused (their state cannot roll back
a rejected draft), as target or as draft.

**LoRA adapters.** With ``lora_modules`` (PEFT adapter directories by name) every adapted
projection holds all the adapters stacked, slot 0 the base (zeros), and each token of a step
carries its request's slot (``add_request(..., lora=name)``), so requests for different
adapters and for the base share every step and every compiled program
(:mod:`maxnnx.serving.lora`). An adapter's requests share cached prefix pages only with
requests of the same adapter. :meth:`Engine.load_lora` and :meth:`Engine.unload_lora` change
the adapters while the engine serves (a free slot of the stacks is written or zeroed: nothing
is compiled); ``lora_target_modules`` gives projections slots that no adapter of the start
adapts.

**Images.** A vision-language model's requests may bring images
(``add_request(ids, params, images=pixel_values)``, the prompt holding each image's
placeholders). Their embeddings are computed once, when the request is added; a step
whose tokens include image placeholders passes the embeddings of those tokens
(``[T, d_model]``) and their image-block ids (``PagedBatch.blocks_T``) to the model,
so each image's tokens attend to each other in both directions. The scheduler never
cuts an image between prefill chunks, and such requests share cached pages only with
requests of the same images. Steps with image tokens are a second variant of each
bucket (two compiles at most per bucket).
"""

import logging
import math
import time
from collections.abc import Sequence

import jax
import numpy as np

from maxnnx.config.engine import EngineConfig
from maxnnx.inference.stops import eos_token_ids
from maxnnx.serving.batch_sampler import BatchSampler
from maxnnx.serving.drafters import make_drafter
from maxnnx.serving.engine_lora import AdapterLoading
from maxnnx.serving.engine_sizing import EngineSizing
from maxnnx.serving.lora import ServedAdapters
from maxnnx.serving.model_runner import (
  MIN_TOKEN_BUCKET,
  CompileCounts,
  ModelRunner,
  bucket_set,
  counting_compiles,
  listen_to_compiles,
)
from maxnnx.serving.output_processor import OutputProcessor
from maxnnx.serving.params import (
  MAX_SEED,
  Completion,
  RequestOutput,
  SamplingParams,
  TokenLogprobs,
)
from maxnnx.serving.scheduler import Request, Scheduler
from maxnnx.serving.speculation import SpecCounts, verify_rows, warm_verify

logger = logging.getLogger(__name__)


class Engine(AdapterLoading, EngineSizing):
  """Serves many requests at once from one model, with a paged KV cache.

  Args:
    model: a :class:`~maxnnx.Transformer` (not modified; its parameters are
      shared, not copied). Its token-mixing layers must have a paged path
      (``init_paged_cache``): multi-head / GQA attention, MLA and Gated DeltaNet do.
    tokenizer: optional; with one, prompts may be strings (encoded as they are,
      no BOS added), outputs carry ``text`` and stop strings work. Anything with
      ``encode(str) -> ids``, ``decode(ids) -> str`` and ``eos_id``.
    config: the :class:`~maxnnx.config.EngineConfig` (batch, pages, buckets, seed...);
      default ``EngineConfig()``.
    rules: logical-axis rules for the page pools of a sharded model (default
      :data:`maxnnx.sharding.DEFAULT_RULES`).
    draft_model: the draft model of ``speculative_method='draft_model'`` (a smaller
      :class:`~maxnnx.Transformer` of the same vocabulary, not modified); ``None``: the one
      ``speculative_model`` names.
    **settings: fields of :class:`~maxnnx.config.EngineConfig` that replace ``config``'s
      (``Engine(model, max_batch=4)``); an unknown name or a bad value is one
      ``ConfigError`` naming it.

  A model placed on a mesh (``from_pretrained(dir, mesh=MeshConfig(tensor=4))``)
  is served on it: every step runs over the model's devices, and the page pools
  split over the kv heads the way the projections do.

  Attributes:
    config: the :class:`~maxnnx.config.EngineConfig` in use.
    scheduler: the :class:`~maxnnx.serving.scheduler.Scheduler` (queues, preemption count,
      and its ``kv_cache``, what each request holds of the cache).
    runner: the :class:`~maxnnx.serving.model_runner.ModelRunner` (batch layout, buckets, the
      jitted step, the page pools in ``runner.cache``).
    sampler: the :class:`~maxnnx.serving.batch_sampler.BatchSampler`.
    outputs: the :class:`~maxnnx.serving.output_processor.OutputProcessor` (text, stop rules).
    allocator: the :class:`~maxnnx.serving.pages.PageAllocator` of the pool.
    window_allocator: the sliding layers' own pool when sliding and full layers mix
      (unscanned), else ``None``.
    window_pages_per_request: pages a request's sliding layers hold at most (its
      window, a step's tokens and a page's edge; all its pages without sliding layers).
    max_window_pages: pages of the sliding layers' own pool (0 without one).
    eos_ids: ids that end a request unless ``ignore_eos``: ``model.config.eos_token_id``
      and the tokenizer's ``eos_id`` (:func:`~maxnnx.inference.stops.eos_token_ids`).
    prefix_caching: whether prompt pages are shared (off for recurrent models).
    token_buckets, page_buckets: the sorted bucket sizes in use.
    compiles: the :class:`CompileCounts` of the programs built in the engine's calls.
    num_speculative_tokens: drafts a request verifies per step at most (0: no speculative
      decoding).
    spec: the :class:`~maxnnx.serving.speculation.SpecCounts` of speculative decoding.
    drafter: the :class:`~maxnnx.serving.drafters.Drafter` that proposes the drafts
      (``None`` without speculative decoding).
    adapters: the :class:`~maxnnx.serving.lora.ServedAdapters` (LoRA adapters by name, their
      slots and directories; none without ``lora_modules``).
  """

  def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, *,
               rules: dict | None = None, draft_model=None, **settings):
    config = EngineConfig() if config is None else EngineConfig.from_dict(config)
    self.config = config.replace(**settings) if settings else config
    page_size, max_batch = self.config.page_size, self.config.max_batch
    token_budget, max_pages = self.config.token_budget, self.config.max_pages
    max_logprobs, prefix_caching = self.config.max_logprobs, self.config.prefix_caching
    cfg = model.config
    self.model_config = cfg
    self.page_size = page_size
    self.max_batch = max_batch
    self.token_budget = token_budget
    self.max_model_len = self.config.max_model_len or cfg.max_position_embeddings
    self.max_logprobs = min(max_logprobs, cfg.vocab_size)
    self.seed = self.config.seed
    self.pages_per_request = math.ceil(self.max_model_len / page_size)
    self.max_pages = (max_batch * self.pages_per_request if max_pages is None else max_pages)
    self.token_buckets = bucket_set('token_buckets', self.config.token_buckets, token_budget,
                                    MIN_TOKEN_BUCKET)
    self.page_buckets = bucket_set('page_buckets', self.config.page_buckets,
                                   self.pages_per_request, 1)
    self._check_positions(model)
    window = self._plan_pools(self.config.max_window_pages)
    recurrent = 'linear' in cfg.resolved_layer_types
    speculative = self.config.speculative_method != 'none'
    if speculative and recurrent:
      raise ValueError(f'Engine speculative_method={self.config.speculative_method!r}: this '
                       f"model's Gated DeltaNet layers keep a state that cannot roll back "
                       "rejected drafts; serve it with speculative_method='none'.")
    self.num_speculative_tokens = self.config.num_speculative_tokens if speculative else 0
    self.spec = SpecCounts()
    if recurrent and prefix_caching:
      logger.warning('prefix_caching is off: this model\'s Gated DeltaNet layers keep a state '
                     'per request, which is not kept for shared prefixes.')
    self.prefix_caching = prefix_caching and not recurrent
    num_slots = max_batch if recurrent else 0
    self.scheduler = Scheduler(self.allocator, page_size=page_size, max_batch=max_batch,
                               token_budget=token_budget, prefix_caching=self.prefix_caching,
                               window=window, window_allocator=self.window_allocator,
                               num_state_slots=num_slots)
    self.adapters, lora = ServedAdapters.load(model, self.config)
    self._model = model  # adapters loaded later are read against it
    self.runner = ModelRunner(
        model, num_pages=self.max_pages + 1, page_size=page_size, max_batch=max_batch,
        token_buckets=self.token_buckets, page_buckets=self.page_buckets,
        num_state_slots=num_slots + 1 if recurrent else 0,
        window_pages=self.max_window_pages + 1 if self.max_window_pages else None, rules=rules,
        kv_cache_dtype=self.config.kv_cache_dtype,
        num_verify=self.num_speculative_tokens, lora=lora,
        return_hidden=self.config.speculative_method == 'mtp')
    self.drafter = make_drafter(
        self.config, model, draft_model, max_model_len=self.max_model_len, runner=self.runner,
        frees_pages=window is not None and self.window_allocator is None,
        num_pages=self.max_pages + 1, rules=rules)
    self.eos_ids = frozenset(eos_token_ids(cfg, tokenizer))
    self.outputs = OutputProcessor(tokenizer, self.eos_ids, self.max_model_len)
    self.sampler = BatchSampler(max_batch, cfg.vocab_size, self.max_logprobs,
                                self.outputs.stop_ids, self._running_ids)
    self._requests: dict[int, Request] = {}
    self._image_embeddings: dict[int, np.ndarray] = {}  # request id -> [prompt, d_model]
    self._cancelled: list[RequestOutput] = []
    self._next_id = 0
    self.compiles = CompileCounts()
    listen_to_compiles()

  @property
  def tokenizer(self):
    """The tokenizer (``None``: token ids only); setting it also sets the output processor's."""
    return self.outputs.tokenizer

  @tokenizer.setter
  def tokenizer(self, tokenizer) -> None:
    self.outputs.tokenizer = tokenizer

  def _running_ids(self) -> set[int]:
    return {request.request_id for request in self.scheduler.running}

  @property
  def mesh(self) -> jax.sharding.Mesh | None:
    """The mesh of a sharded model, else ``None``."""
    return self.runner.mesh

  @property
  def step_shapes(self) -> set[tuple]:
    """The ``(tokens, max_q, pages per row, wide rows)`` buckets run so far."""
    return self.runner.step_shapes

  @property
  def last_step_shape(self) -> tuple | None:
    """The bucket of the latest step that ran the model (``None`` before one)."""
    return self.runner.last_step_shape

  # -- requests ---------------------------------------------------------------

  def prompt_ids(self, prompt: Sequence[int] | str) -> Sequence[int]:
    """``prompt``'s token ids: a string encoded by the tokenizer as it is (no BOS added)."""
    if not isinstance(prompt, str):
      return prompt
    if self.tokenizer is None:
      raise ValueError('A text prompt needs an Engine with a tokenizer.')
    return self.tokenizer.encode(prompt)

  def add_request(self, prompt: Sequence[int] | str, params: SamplingParams | None = None,
                  images: np.ndarray | None = None, lora: str | None = None) -> int:
    """Queue a request; returns its id. It starts at the next :meth:`step` with room.

    ``lora``: the name of the LoRA adapter it runs with (one of :attr:`lora_names`);
    ``None``: the base model. Requests of different adapters share every step.

    ``images``: ``[num_images, channels, H, W]`` pixels (a vision-language model;
    :class:`~maxnnx.data.ImageProcessor`), one per run of ``tokens_per_image``
    placeholders in the prompt, in order.

    Raises:
      ValueError: for an unknown adapter, an empty prompt, ids outside the vocabulary, a
        prompt that leaves no room under ``max_model_len``, a request that could never fit in
        the page pool, parameters the engine cannot honour, images that do not
        match the prompt's placeholders, or a structured output whose grammar does not
        compile.
    """
    params = SamplingParams() if params is None else params
    lora_slot = self.adapters.slot(lora)
    ids = [int(i) for i in np.asarray(self.prompt_ids(prompt)).reshape(-1)]
    self._check_request(ids, params)
    matcher = (None if params.structured is None else
               self.sampler.matcher_for(params.structured, self.tokenizer, self.eos_ids))
    with counting_compiles(self.compiles):
      spans, salt, embeddings = self.runner.embed_images(ids, images, self.token_budget)
    request_id = self._next_id
    self._next_id += 1
    seed = params.seed
    if seed is None:
      seed = (self.seed * 1_000_003 + request_id * 7_919) % (MAX_SEED + 1)
    request = Request(request_id=request_id, token_ids=ids, num_prompt=len(ids), params=params,
                      seed=seed, image_spans=spans, lora_slot=lora_slot,
                      # an adapter's keys and values are its own: no pages shared with others
                      cache_salt=salt + self.adapters.cache_salt(lora))
    if embeddings is not None:
      self._image_embeddings[request_id] = embeddings
    if matcher is not None:
      self.sampler.attach(request_id, matcher)
    self._requests[request_id] = request
    self.scheduler.add(request)
    return request_id

  def cancel(self, request_id: int) -> bool:
    """Stop a request now and release its pages; ``False`` if it is unknown or finished.

    The next :meth:`step` reports it as finished with reason ``cancelled``.
    """
    request = self._requests.get(request_id)
    if request is None:
      return False
    self._retire(request, 'cancelled')
    self._cancelled.append(self.outputs.output(request, (), None))
    return True

  def _retire(self, request: Request, reason: str) -> None:
    """Finish ``request``: the scheduler takes back its pages and slot, and every part drops
    what it kept for it."""
    self.scheduler.finish(request, reason)
    del self._requests[request.request_id]
    self._image_embeddings.pop(request.request_id, None)
    self.sampler.forget(request.request_id)
    self.outputs.forget(request.request_id)

  def has_unfinished(self) -> bool:
    """Whether any request waits or runs (or a cancellation is still to be reported)."""
    return self.scheduler.has_unfinished() or bool(self._cancelled)

  @property
  def compile_count(self) -> int:
    """How many times the model step was traced (one compile per bucket run).

    Equals ``len(step_shapes)``, the ``(tokens, max_q, pages per row, wide rows)`` buckets
    run so far (warm-up included).
    """
    return self.runner.traces[0]

  def step_buckets(self) -> list[tuple]:
    """Every bucket a model step can take (see the module docstring), smallest first."""
    return self.runner.step_buckets()

  def max_compiles(self) -> int:
    """How many model step buckets exist, hence its compiles at most."""
    return len(self.step_buckets())

  def sampler_variants(self) -> list[tuple[int, int]]:
    """Every ``(log-probabilities, logit-bias width)`` the sampler is called with (see the
    module docstring)."""
    return self.sampler.variants()

  def warmup(self, progress=None) -> float:
    """Compile every model bucket and sampler variant (and the image tower and the penalty
    counts' writer) before serving, so that no request meets a cold program, and wrap the
    tokenizer for structured outputs; returns the seconds it took. ``progress(done, total)``
    is called after each program. Idle engine only.

    A step of each bucket runs with every row empty: it writes the scratch page and state
    slot 0 only, and samples nothing that is kept. With JAX's persistent cache on
    (``compile_cache``) a restart reads the programs back instead of compiling them.
    """
    if self.has_unfinished():
      raise RuntimeError('warmup() needs an idle engine.')
    start = time.monotonic()
    variants = self.sampler_variants()
    verifies = bool(self.num_speculative_tokens)
    drafts = 0 if self.drafter is None else self.drafter.num_warm()
    total, done = self.max_compiles() + len(variants) * (1 + verifies) + drafts, [0]

    def one_more():
      done[0] += 1
      if progress is not None:
        progress(done[0], total)

    with counting_compiles(self.compiles):
      logits_BV, logits_BSV = self.runner.warm(one_more)
      if self.drafter is not None:
        self.drafter.warm(one_more)
      for num_logprobs, width in variants:
        self.sampler.warm(logits_BV, num_logprobs, width)
        one_more()
      for _ in range(warm_verify(logits_BSV, self.sampler) if verifies else 0):
        one_more()
      jax.block_until_ready(logits_BV)
    if self.tokenizer is not None:
      # Wrapping a large vocabulary for llguidance takes a second: not on the first request.
      self.sampler.wrap_tokenizer(self.tokenizer, self.eos_ids, quiet=True)
    self.compiles.warm = True
    return time.monotonic() - start

  def score_prompt(self, prompt: Sequence[int], num_top: int = 0) -> tuple[TokenLogprobs, ...]:
    """The log-probability of each token of ``prompt`` after the first, given the tokens
    before it, and the ``num_top`` most likely tokens there (one plain forward pass, float32
    log-softmax of the model's logits; the OpenAI API's ``echo``).

    It touches neither the page pools nor the requests, so any thread may call it while
    another drives :meth:`step`. The prompt is padded to a power of two (at least
    ``MIN_TOKEN_BUCKET``, at most ``max_model_len``), so it compiles once per bucket and
    ``num_top``.

    Returns:
      ``len(prompt) - 1`` :class:`TokenLogprobs`, for ``prompt[1:]``.

    Raises:
      ValueError: an empty prompt or one longer than ``max_model_len``, a token id outside
        the vocabulary, or ``num_top`` beyond ``max_logprobs``.
    """
    ids = [int(i) for i in prompt]
    vocab = self.model_config.vocab_size
    if not 1 <= len(ids) <= self.max_model_len:
      raise ValueError(f'A scored prompt has 1 to max_model_len={self.max_model_len} tokens, '
                       f'not {len(ids)}.')
    if min(ids) < 0 or max(ids) >= vocab:
      raise ValueError(f'The prompt holds token ids outside [0, {vocab}).')
    if not 0 <= num_top <= self.max_logprobs:
      raise ValueError(f'num_top={num_top} is outside [0, max_logprobs={self.max_logprobs}].')
    return self.runner.score(ids, num_top, self.max_model_len)

  # -- stepping ---------------------------------------------------------------

  def step(self) -> list[RequestOutput]:
    """Run one batch; returns an output for every request that got a token or ended."""
    with counting_compiles(self.compiles):
      return self._step()

  def _step(self) -> list[RequestOutput]:
    outputs, self._cancelled = self._cancelled, []
    drafter = self.drafter
    if drafter is not None:
      drafter.before_schedule(self.scheduler.running)
    # Rows with prefill chunks first: only those are gathered max_q wide (PagedBatch.wide_rows).
    scheduled = sorted(self.scheduler.schedule(), key=lambda rc: rc[1] == 1)
    if drafter is not None:
      drafter.after_schedule(scheduled)
    if not scheduled:
      return outputs
    inputs = self.runner.layout(scheduled, self.scheduler.kv_cache.state_slot,
                                self._image_embeddings)
    logits_BV, logits_BSV = self.runner.run(inputs)
    if drafter is not None:
      drafter.after_step(scheduled, inputs, (logits_BV, logits_BSV))
    # The sampler serves the rows that end their tokens without drafts (all rows, without
    # speculation); a step whose every such row verifies drafts skips it.
    sampled = (self.sampler.sample(logits_BV, scheduled) if any(
        not r.draft_ids and r.num_computed + n >= r.num_tokens for r, n in scheduled) else None)
    verified = verify_rows(logits_BSV, [r for r, _ in scheduled], self.sampler,
                           self.num_speculative_tokens)
    for row, (request, count) in enumerate(scheduled):
      num_drafts = len(request.draft_ids)
      if request.num_computed + count - num_drafts < request.num_tokens:
        self.scheduler.advance(request, count)
        continue  # a prefill chunk: no token yet
      if num_drafts:
        tokens = verified.tokens(row)
        self.spec.record(num_drafts, len(tokens) - 1)
      else:
        tokens = [int(sampled.tokens_B[row])]
      new, new_logprobs, reason = [], [], None
      for position, token in enumerate(tokens):  # the stop rules see each kept token in order
        self.scheduler.append_token(request, token)
        new.append(token)
        grammar_done = self.sampler.advance_grammar(request, token)
        logprobs = (verified.logprobs(row, position, request.params.logprobs) if num_drafts
                    else sampled.logprobs(row, request.params.logprobs))
        if logprobs is not None:
          request.logprobs.extend(logprobs)
          new_logprobs.extend(logprobs)
        reason = self.outputs.finish_reason(request, token, grammar_done)
        if reason is not None:
          break
      # Computed now: the last token before the step, and the kept drafts before the newest.
      self.scheduler.advance(request, count - num_drafts + len(new) - 1)
      if num_drafts:
        self.scheduler.release_rejected(request)
      if reason is not None:
        self._retire(request, reason)
      outputs.append(self.outputs.output(
          request, tuple(new), None if request.params.logprobs is None else tuple(new_logprobs)))
    return outputs

  def generate(self, prompts: Sequence[Sequence[int] | str],
               params: SamplingParams | Sequence[SamplingParams] | None = None,
               images: Sequence[np.ndarray | None] | None = None,
               lora: str | Sequence[str | None] | None = None) -> list[Completion]:
    """Run ``prompts`` to completion; one :class:`Completion` per prompt, in order.

    ``params`` is one :class:`SamplingParams` for all prompts or one per prompt;
    ``images`` one pixel array (or ``None``) per prompt, as for :meth:`add_request`;
    ``lora`` one adapter name (or ``None``, the base) for all prompts or one per prompt.
    The engine must be idle (no request of its own would be reported otherwise).
    """
    if self.has_unfinished():
      raise RuntimeError('generate() needs an idle engine; step() until has_unfinished() is '
                         'False, or cancel the running requests.')
    if params is None or isinstance(params, SamplingParams):
      params = [params] * len(prompts)
    if len(params) != len(prompts):
      raise ValueError(f'{len(prompts)} prompts but {len(params)} SamplingParams.')
    images = [None] * len(prompts) if images is None else list(images)
    if len(images) != len(prompts):
      raise ValueError(f'{len(prompts)} prompts but {len(images)} image entries.')
    loras = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
    if len(loras) != len(prompts):
      raise ValueError(f'{len(prompts)} prompts but {len(loras)} lora entries.')
    requests = [self._requests[self.add_request(p, sp, im, lo)]
                for p, sp, im, lo in zip(prompts, params, images, loras)]
    while self.has_unfinished():
      self.step()
    return [Completion(request_id=r.request_id, prompt_ids=tuple(r.token_ids[:r.num_prompt]),
                       token_ids=tuple(r.output_ids), finish_reason=r.finish_reason,
                       logprobs=None if r.params.logprobs is None else tuple(r.logprobs),
                       text=r.text, num_cached_tokens=r.num_cached_tokens) for r in requests]

  def load_weights(self, model) -> None:
    """Serve ``model``'s current parameters from now on (same architecture and shapes).

    For a policy being trained between rollouts. The prefix cache is emptied
    (its keys and values came from the old weights); no request may be unfinished.
    """
    if self.has_unfinished():
      raise RuntimeError('load_weights() needs an idle engine.')
    self.runner.load_weights(model)
    self.allocator.clear_cache()
    if self.window_allocator is not None:
      self.window_allocator.clear_cache()
