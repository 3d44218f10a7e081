"""From a checkpoint directory to what the server serves: the engine over the model and its
tokenizer (:func:`load_engine`), and the :class:`~maxnnx.serving.openai_api.ServedModel` the
API validates requests against (:func:`served_model`: name, chat template, limits, images).
"""

from __future__ import annotations

import logging
import os

from maxnnx import paths
from maxnnx.data.chat import ChatTemplate, load_chat_template, template_for
from maxnnx.inference.stops import eos_token_ids
from maxnnx.serving.engine import Engine
from maxnnx.serving.openai_api import ServedModel

logger = logging.getLogger(__name__)


def load_engine(model_dir: str, *, dtype: str | None = None, tensor_parallel: int = 1,
                quantization: str | None = None, **engine_kwargs) -> Engine:
  """An :class:`~maxnnx.serving.Engine` over the Hugging Face checkpoint in ``model_dir``
  and the tokenizer stored with it (``engine_kwargs`` go to the engine).

  ``quantization`` (``int8``, ``int4``, ``fp8``, ``w8a8``) quantizes the linear layers for
  inference once loaded (:func:`maxnnx.inference.quantize.quantize_for_inference`);
  ``checkpoint`` keeps a quantized release's own weights as stored
  (``from_pretrained(keep_quantized=True)``).

  ``tensor_parallel > 1`` loads the parameters straight into their shards over that many
  devices (``MeshConfig(data=1, tensor=tensor_parallel)``); the engine runs there.
  """
  from maxnnx.data import load_tokenizer  # noqa: PLC0415
  from maxnnx.models.pretrained import from_pretrained  # noqa: PLC0415
  from maxnnx.sharding import tensor_parallel_mesh  # noqa: PLC0415
  model = from_pretrained(model_dir, dtype=dtype, mesh=tensor_parallel_mesh(tensor_parallel),
                          keep_quantized=quantization == 'checkpoint')
  if quantization not in (None, 'none', 'checkpoint'):
    from maxnnx.inference.quantize import quantize_for_inference  # noqa: PLC0415
    quantize_for_inference(model, quantization)
  return Engine(model, load_tokenizer(model_dir), **engine_kwargs)


def _image_side(engine: Engine, directory: str | None, processor):
  """``(image processor, image prompt)`` of a vision-language model (images in chat
  messages), else ``(None, None)``."""
  if not engine.model_config.vision.num_layers:
    return None, None
  from maxnnx.models import image_inputs_for  # noqa: PLC0415
  try:
    default, prompt = image_inputs_for(engine.model_config, engine.tokenizer, directory)
  except ValueError as e:
    logger.warning('Serving without images: %s', e)
    return None, None
  return processor or default, prompt


def _template(tokenizer, chat_template: ChatTemplate | str | None) -> ChatTemplate | None:
  if chat_template is None:
    path = getattr(tokenizer, 'path', None)
    if not path:
      return None
    try:
      chat_template = load_chat_template(os.path.dirname(path) or '.')
    except FileNotFoundError:
      return None
  return template_for(tokenizer, chat_template)


def served_model(engine_or_model_dir, model_name: str | None, chat_template, add_bos: bool,
                  image_processor, *, dtype: str | None, tensor_parallel: int,
                  reasoning_parser: str | None = None,
                  **engine_kwargs) -> tuple[Engine, ServedModel]:
  """The engine (loaded from a directory, or the one given) and what the API serves of it
  (name, tokenizer, chat template, limits, images): see :func:`make_app`."""
  directory = None
  if isinstance(engine_or_model_dir, Engine):
    if engine_kwargs or dtype is not None:
      raise TypeError('Engine arguments and dtype apply to a model directory, not to an Engine.')
    engine, name = engine_or_model_dir, model_name or 'maxnnx'
  else:
    given = os.fspath(engine_or_model_dir)
    directory = paths.local_model_dir(given)  # a URL (s3://, hf://...) is downloaded once
    engine = load_engine(directory, dtype=dtype, tensor_parallel=tensor_parallel,
                         **engine_kwargs)
    name = model_name or given
  tokenizer = engine.tokenizer
  if tokenizer is None:
    raise ValueError('The server needs an Engine with a tokenizer.')
  if name in engine.lora_names:
    raise ValueError(f"The LoRA adapter {name!r} has the served model's name; rename it in "
                     'lora_modules or set served_model_name.')
  image_processor, image_prompt = _image_side(engine, directory, image_processor)
  return engine, ServedModel(
      name=name, tokenizer=tokenizer, template=_template(tokenizer, chat_template),
      max_model_len=engine.max_model_len, vocab_size=engine.model_config.vocab_size,
      max_logprobs=engine.max_logprobs,
      chat_stop_ids=eos_token_ids(tokenizer=tokenizer, end_of_turn=True),
      add_bos=add_bos, image_processor=image_processor, image_prompt=image_prompt,
      lora_names=engine.lora_names, reasoning_parser=reasoning_parser)
