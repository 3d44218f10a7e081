"""What a finished run leaves in its directory: ``final/``, ``adapter/``, ``loss.png``.

:func:`write_final` exports the trained model in Hugging Face format with the run's
tokenizer and chat template beside the weights (so the next command can start from it), a
LoRA run's adapter in PEFT's format next to the merged model, the loss plot and the run's
settings (``train_options.json``). A model that spans processes is written by all of them.
"""

from __future__ import annotations

import math
import os
import shutil

from maxnnx import paths


def plot_loss(history: list[dict], path: str) -> None:
  """``loss.png``: the training (and held-out) loss; RL runs add the mean reward beside it."""
  import matplotlib  # noqa: PLC0415
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # noqa: PLC0415
  rl = any('reward' in m for m in history)
  fig, axes = plt.subplots(1, 2 if rl else 1, figsize=(11 if rl else 6, 3.5), squeeze=False)
  ax = axes[0, 0]
  ax.plot([m['step'] for m in history], [m['loss'] for m in history], label='train')
  evals = [m for m in history if 'eval_loss' in m]
  if evals:
    ax.plot([m['step'] for m in evals], [m['eval_loss'] for m in evals], 'o-', label='held-out')
  ax.set_xlabel('step')
  ax.set_ylabel('policy loss' if rl else 'cross-entropy (nats/token)')
  ax.grid(alpha=0.3)
  ax.legend()
  if evals:  # perplexity = exp(loss): a second scale on the same curves
    bottom, top = ax.get_ylim()
    scale = ax.twinx()
    scale.set_ylim(math.exp(min(bottom, 700.0)), math.exp(min(top, 700.0)))
    scale.set_yscale('log')
    scale.set_ylabel('held-out perplexity')
  if rl:
    rewarded = [m for m in history if 'reward' in m]
    axes[0, 1].plot([m['step'] for m in rewarded], [m['reward'] for m in rewarded])
    axes[0, 1].set_xlabel('step')
    axes[0, 1].set_ylabel('mean reward')
    axes[0, 1].grid(alpha=0.3)
  fig.tight_layout()
  with paths.open_file(path, 'wb') as f:
    fig.savefig(f, format='png', dpi=120)
  plt.close(fig)


def write_final(model, run_dir, options: dict, history: list[dict], *, only_missing=False,
            tokenizer=None, template=None) -> list[str]:
  """Write ``final/``, ``loss.png`` and ``train_options.json`` (with ``only_missing``: those
  that are not there yet); returns the names written. ``final/`` appears whole or not at all
  (at a URL: its ``config.json`` is uploaded last), with the run's tokenizer and chat template
  beside the weights. A LoRA run also writes ``adapter/`` (PEFT's format), and ``final/`` holds
  the merged model. Every process calls it with ``model`` from :func:`export_view`; a model
  that spans processes is written to ``final/`` by all of them (each its layers), the rest by
  process 0 alone."""
  import maxnnx  # noqa: PLC0415
  from maxnnx.processes import barrier  # noqa: PLC0415
  from maxnnx.train import distributed  # noqa: PLC0415
  from maxnnx.train.lora import has_adapters, merge_adapters, save_adapter  # noqa: PLC0415
  from maxnnx.train.run_dir import write_json  # noqa: PLC0415
  out, written = run_dir.directory, []
  final = paths.join(out, 'final')
  adapters = None  # a LoRA model that spans processes: its adapters on every host, then merged
  if has_adapters(model) and _spans_processes(model):
    from flax import nnx  # noqa: PLC0415
    adapters = distributed.host_local_model(model, nnx.LoRAParam)
    model = merge_adapters(model)  # every process, one gathered kernel at a time
  if _spans_processes(model):
    wanted = not (only_missing and paths.exists(paths.join(final, 'config.json')))
    if distributed.broadcast_bytes(b'1' if wanted else b'0') == b'1':  # process 0 decides
      _write_final_together(model, final, tokenizer, template)
      written.append('final/')
  if not distributed.is_primary():
    barrier('run-written')  # stay until process 0 has written everything
    return written
  if adapters is not None or has_adapters(model):  # LoRA: the PEFT adapter, final/ merged
    adapter = paths.join(out, 'adapter')
    source = model if adapters is None else adapters
    if not (only_missing and paths.exists(paths.join(adapter, 'adapter_config.json'))):
      paths.write_dir(adapter, lambda directory: save_adapter(source, directory),
                      last=('adapter_config.json',))
      written.append('adapter/')
    if adapters is None:
      model = merge_adapters(model)
  if not _spans_processes(model) and not (
      only_missing and paths.exists(paths.join(final, 'config.json'))):
    def export(directory):
      maxnnx.save_pretrained(model, directory)
      save_tokenizer(tokenizer, template, directory)
    paths.write_dir(final, export, last=('config.json',))
    written.append('final/')
  plot = paths.join(out, 'loss.png')
  if history and not (only_missing and paths.exists(plot)):
    plot_loss(history, plot)
    written.append('loss.png')
  options_path = paths.join(out, 'train_options.json')
  if not (only_missing and paths.exists(options_path)):
    write_json(options_path, options)
    written.append('train_options.json')
  barrier('run-written')
  return written


def _spans_processes(model) -> bool:
  import jax  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415
  return any(isinstance(x, jax.Array) and not x.is_fully_addressable
             for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def export_view(model, out: str):
  """The trained model as :func:`write_final` exports it: the model itself with one process, or
  when the processes can write ``final/`` together (a local directory they share; a LoRA
  model is merged there one kernel at a time); else a copy gathered whole onto every process
  (:func:`~maxnnx.train.distributed.host_local_model`)."""
  import jax  # noqa: PLC0415

  from maxnnx.train import distributed  # noqa: PLC0415
  if jax.process_count() == 1 or not paths.is_remote(out):
    return model
  return distributed.host_local_model(model)


def _write_final_together(model, final: str, tokenizer, template) -> None:
  """Every process writes its layers of ``final/`` (``save_pretrained`` of a model that spans
  them) into ``final.tmp``, which process 0 completes with the tokenizer and renames."""
  import maxnnx  # noqa: PLC0415
  from maxnnx.processes import barrier, is_primary  # noqa: PLC0415
  staged = final + '.tmp'
  if is_primary():
    shutil.rmtree(staged, ignore_errors=True)
    os.makedirs(staged)
  barrier('final-staged')
  maxnnx.save_pretrained(model, staged)  # returns once every process has written
  if is_primary():
    save_tokenizer(tokenizer, template, staged)
    if os.path.exists(final):
      shutil.rmtree(final)
    os.rename(staged, final)


def save_tokenizer(tokenizer, template, directory: str) -> None:
  """Copy the tokenizer file (and a ``tokenizer.json``'s config files) into ``directory``
  and write ``template`` (a :class:`~maxnnx.data.ChatTemplate`) as ``chat_template.jinja``."""
  path = getattr(tokenizer, 'path', None)
  if path and os.path.isfile(path):
    if path.endswith('.json'):
      shutil.copyfile(path, os.path.join(directory, 'tokenizer.json'))
      for name in ('tokenizer_config.json', 'special_tokens_map.json'):
        beside = os.path.join(os.path.dirname(path), name)
        if os.path.isfile(beside):
          shutil.copyfile(beside, os.path.join(directory, name))
    else:
      shutil.copyfile(path, os.path.join(directory, 'tokenizer.model'))
  if template is not None:
    with open(os.path.join(directory, 'chat_template.jinja'), 'w', encoding='utf-8') as f:
      f.write(template.source)
