"""``maxnnx sft``: supervised fine-tuning on chats, the loss on the assistant's tokens.

Records are ``{"messages": [...]}`` or ``{"prompt", "completion"}``
(:func:`maxnnx.data.make_sft_pipeline`), rendered with the checkpoint's chat template (or
``template=``); overlong records are truncated. ``images_per_row > 0`` adds the images of
each record, prepared by the checkpoint's image processor (the model needs a vision tower).
"""

from __future__ import annotations

from types import MappingProxyType

from maxnnx.cli_keys import UsageError
from maxnnx.recipes.base import RecordsRecipe


class SFT(RecordsRecipe):
  """Supervised fine-tuning on chat or prompt/completion records."""

  name = 'sft'
  run_defaults = MappingProxyType({'output_dir': 'runs/sft', 'sample_tokens': 0})
  train_defaults = MappingProxyType({'steps': 200, 'learning_rate': 1e-4, 'eval_every': 0,
                                     'checkpoint_every': 100})

  def data(self, options, spec, data_fields, tokenizer, model_config, train_config,
           local_batch):
    """The chat pipeline (:func:`maxnnx.data.make_sft_pipeline`) of ``data=``."""
    from maxnnx.data import make_sft_pipeline  # noqa: PLC0415
    config = self.records_config(spec, {'overlong': 'truncate', **data_fields})
    images = {}
    if train_config.images_per_row:
      images = image_sft_options(options.get('model', ''), tokenizer, model_config,
                                 train_config.images_per_row)
    return make_sft_pipeline(config, tokenizer,
                             self.template(options, tokenizer, model_config.family),
                             batch_size=local_batch, seq_len=train_config.seq_len,
                             seed=train_config.seed, vocab_size=model_config.vocab_size,
                             **images)


def image_sft_options(checkpoint: str, tokenizer, model_config, images_per_row: int) -> dict:
  """``make_sft_pipeline`` keywords of image+text SFT (``images_per_row=`` > 0): the image
  processor of the checkpoint's ``preprocessor_config.json`` and the family's image prompt
  (:func:`maxnnx.models.image_inputs_for`)."""
  from maxnnx.models import image_inputs_for  # noqa: PLC0415
  if not model_config.vision.num_layers:
    raise UsageError('images_per_row > 0 trains on images: the model needs a vision tower '
                     '(a multimodal checkpoint, e.g. Gemma 3 4B, or a preset with one).')
  try:
    processor, prompt = image_inputs_for(model_config, tokenizer, checkpoint or None)
  except ValueError as e:
    raise UsageError(f'images_per_row: {e}') from None
  return {'image_processor': processor, 'image_prompt': prompt,
          'images_per_row': images_per_row}


RECIPE = SFT()
