"""``maxnnx dpo``: direct preference optimisation on ``{"prompt", "chosen", "rejected"}``.

The records go through :func:`maxnnx.data.make_preference_pipeline` and the objective is
:class:`~maxnnx.train.preference.DPOObjective`, whose signature gives the keys ``beta``,
``loss_type`` and ``label_smoothing`` their defaults. The reference is the starting policy,
frozen; with ``lora.rank > 0`` it is the same weights with the adapters off, so no copy is
held.
"""

from __future__ import annotations

import functools
from types import MappingProxyType

from maxnnx.recipes.base import RecordsRecipe, require_policy, signature_keys

OBJECTIVE_KEYS = ('beta', 'loss_type', 'label_smoothing')


@functools.cache
def _objective_keys() -> dict:
  from maxnnx.train.preference import DPOObjective  # noqa: PLC0415
  return signature_keys(DPOObjective, OBJECTIVE_KEYS)


class DPO(RecordsRecipe):
  """Preference optimisation against the frozen starting policy."""

  name = 'dpo'
  run_defaults = MappingProxyType({'output_dir': 'runs/dpo', 'sample_tokens': 0})
  train_defaults = MappingProxyType({'steps': 100, 'learning_rate': 1e-5, 'eval_every': 0,
                                     'checkpoint_every': 50})

  def own_keys(self):
    """The DPOObjective's settings (``beta``, ``loss_type``, ``label_smoothing``)."""
    return dict(_objective_keys())

  def data(self, options, spec, data_fields, tokenizer, model_config, train_config,
           local_batch):
    """The preference pipeline (:func:`maxnnx.data.make_preference_pipeline`) of ``data=``."""
    from maxnnx.data import make_preference_pipeline  # noqa: PLC0415
    config = self.records_config(spec, data_fields)
    return make_preference_pipeline(config, tokenizer,
                                    self.template(options, tokenizer, model_config.family),
                                    batch_size=local_batch, seq_len=train_config.seq_len,
                                    seed=train_config.seed, vocab_size=model_config.vocab_size)

  def objective(self, options, model, train_config):
    """:class:`~maxnnx.train.preference.DPOObjective` against the starting policy."""
    from flax import nnx  # noqa: PLC0415

    from maxnnx.train.preference import DPOObjective  # noqa: PLC0415
    require_policy(model, 'dpo starts from a trained policy: model=<Hugging Face dir> (a '
                   'preset would be a random policy and reference).')
    settings = {k: options[k] for k in OBJECTIVE_KEYS}
    if train_config.lora.enabled:  # the reference: the same weights with the adapters off
      from maxnnx.train.lora import without_adapters_logps  # noqa: PLC0415
      return DPOObjective(**settings, reference_fn=without_adapters_logps)
    return DPOObjective(**settings, reference=nnx.clone(model))


RECIPE = DPO()
