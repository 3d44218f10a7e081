"""The protocol of a recipe, and the pieces the records recipes share.

A recipe is what one training command changes about ``maxnnx train``: its own keys, the
defaults it changes, the data it trains on, the objective and what it adds once the Trainer
exists. The run asks every recipe the same questions in the same order (see :class:`Recipe`),
so a new method is a new module, never a new branch in the run.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from maxnnx.cli_keys import UsageError
from maxnnx.config.base import attribute_docs

TEMPLATE_DOC = ("chat template: empty for the checkpoint's own (chat_template.jinja or "
                "tokenizer_config.json), a built-in name (chatml, llama3, gemma), or a .jinja file")
NO_CHANGES: Mapping[str, Any] = MappingProxyType({})


class Recipe:
  """What a training command changes about ``maxnnx train`` (the pre-training defaults).

  The run calls, in order: :meth:`prepare` on the run keys, :meth:`adjust_model` on the
  model config, :meth:`data` (records recipes only), :meth:`objective`, then
  :meth:`attach` once the Trainer is built; :meth:`record` joins the stored run config and
  :meth:`template` the ``final/`` export. Each method's default is what ``train`` does.

  Attributes:
    name: the command.
    run_defaults: run keys whose defaults differ (``output_dir``…).
    train_defaults: TrainConfig defaults that differ from ``train``'s.
    records: the data is records (chat, preference, prompts) read with the run's tokenizer,
      which must then come from ``tokenizer=`` or the checkpoint (none is trained), and
      :meth:`data` makes the pipeline.
    unrecorded: own keys that change how a run is watched, not what it trains: left out of
      the stored config, so changing them never refuses a resume.
  """

  name: str = 'train'
  run_defaults: Mapping[str, Any] = NO_CHANGES
  train_defaults: Mapping[str, Any] = NO_CHANGES
  records: bool = False
  unrecorded: tuple[str, ...] = ()

  @property
  def keys(self) -> dict[str, tuple[Any, str]]:
    """The command's own keys, ``name -> (default, doc)``."""
    return {}

  @property
  def label(self) -> str:
    """What the run's opening line starts with (``'SFT: '``)."""
    return f'{self.name.upper()}: '

  def prepare(self, run: dict, options: dict) -> None:
    """Adjust the run keys ``run`` in place before the model and tokenizer are made."""
    del run, options

  def adjust_model(self, cfg, options: dict, changes: dict):
    """The config of the model to train, given the ``model.*`` keys set (``changes``)."""
    del options, changes
    return cfg

  def template(self, options: dict, tokenizer, family: str | None = None):
    """The run's chat template (a :class:`~maxnnx.data.ChatTemplate`), or ``None``."""
    del options, tokenizer, family

  def data(self, options: dict, spec: str, data_fields: dict, tokenizer, model_config,
           train_config, local_batch: int):
    """This process's training batches, or ``None`` for the pre-training data of ``data=``.

    Args:
      options: the parsed keys.
      spec: the ``data=`` value.
      data_fields: the ``data.*`` keys, as :class:`~maxnnx.data.DataConfig` fields.
      tokenizer: the run's tokenizer.
      model_config: the ModelConfig of the model to train.
      train_config: the run's TrainConfig.
      local_batch: rows per step on this process.
    """
    del options, spec, data_fields, tokenizer, model_config, train_config, local_batch

  def objective(self, options: dict, model, train_config):
    """The objective to train (``None``: the pre-training one)."""
    del options, model, train_config

  def attach(self, trainer, data) -> None:
    """What the recipe adds once ``trainer`` exists (``data`` is what :meth:`data` made)."""
    del trainer, data

  def record(self, options: dict) -> dict:
    """The recipe's keys, for the run's stored config (a resume must match them)."""
    return {k: options[k] for k in self.keys if k not in self.unrecorded}


class RecordsRecipe(Recipe):
  """A recipe that reads records with the run's tokenizer and a chat template
  (``template=``)."""

  records = True

  @property
  def keys(self) -> dict[str, tuple[Any, str]]:
    """``template`` and the keys of :meth:`own_keys`."""
    return {'template': ('', TEMPLATE_DOC), **self.own_keys()}

  def own_keys(self) -> dict[str, tuple[Any, str]]:
    """The keys besides ``template``."""
    return {}

  def template(self, options: dict, tokenizer, family: str | None = None):
    """``template=`` (a built-in name, Jinja text or a ``.jinja`` file), else the one stored
    beside the tokenizer, else the built-in template of the model's ``family`` if it has one
    (``FamilySpec.chat_template``)."""
    from maxnnx.data import ChatTemplate  # noqa: PLC0415
    from maxnnx.data.sft import resolve_tokenizer_and_template  # noqa: PLC0415
    from maxnnx.models.registry import specs  # noqa: PLC0415
    value = options.get('template', '')
    if value.endswith('.jinja') or (value and os.path.isfile(value)):
      if not os.path.isfile(value):
        raise FileNotFoundError(f'template={value}: no such file.')
      with open(value, encoding='utf-8') as f:
        value = ChatTemplate(f.read(), origin=value)
    template = resolve_tokenizer_and_template(tokenizer, value or None)[1]
    spec = specs().get(family) if family else None
    if template is None and spec is not None and spec.chat_template is not None:
      template = resolve_tokenizer_and_template(tokenizer, spec.chat_template)[1]
    return template

  def records_config(self, spec: str, data_fields: dict):
    """The :class:`~maxnnx.data.DataConfig` of the records of ``data=`` (``spec``)."""
    from maxnnx.data import DataConfig  # noqa: PLC0415
    if not spec:
      raise UsageError(f'{self.name} needs data=<records file or directory> (JSONL, JSON or '
                       'Parquet).')
    return DataConfig.from_string(spec, **data_fields)


def signature_keys(cls, names: tuple[str, ...]) -> dict[str, tuple[Any, str]]:
  """``name -> (default, doc)`` of the keyword arguments ``names`` of ``cls``: the defaults
  of its signature, the docs of its docstring's ``Args:`` entries."""
  parameters = inspect.signature(cls).parameters
  docs = attribute_docs(cls)
  return {name: (parameters[name].default, docs[name]) for name in names}


def require_policy(model, message: str) -> None:
  """Refuse a ``model=`` preset (a config, not loaded weights) with ``message``, where the
  recipe starts from a trained policy."""
  from flax import nnx  # noqa: PLC0415
  if not isinstance(model, nnx.Module):
    raise UsageError(message)
