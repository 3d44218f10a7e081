"""The lifecycle of a run directory: one run at a time, and a resume that is checked.

A run directory (``output_dir``) holds the checkpoints, metrics, tokenizer and exported model
of one training run. :class:`RunDir` keeps that run whole across restarts:

* :meth:`RunDir.open` checks the directory is a writable directory (one error line naming the
  path otherwise) and takes its :class:`~maxnnx.checkpoint.run_lock.RunLock` on process 0, so
  a second run on it is refused with the holder named;
* ``resume='never'`` moves an earlier run aside to ``<output_dir>/previous/<time>/`` (never
  deleting it) before starting fresh;
* :meth:`RunDir.check_config` stores the run's config (:func:`run_config`: the model, the
  optimizer-relevant training fields and the tokenizer's fingerprint, not ``steps``, logging or
  the mesh) in ``run_config.json``, and refuses a restart whose config differs, with a short
  diff and the two ways out, once the run has written something to resume or keep (a
  checkpoint or ``final/``): the config of a start that failed before that is replaced;
* :meth:`RunDir.trim_metrics` cuts ``metrics.jsonl`` back to the restored step, so a resumed
  run lists every step once.

The directory may be a URL (``gs://bucket/run``): every file goes through :mod:`maxnnx.paths`,
and the lock is an object the holder renews (see :mod:`maxnnx.checkpoint.run_lock`).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from typing import Any

import jax

from maxnnx import paths
from maxnnx.checkpoint.run_lock import LOCK_NAME, RunLock, RunLockedError

RUN_CONFIG = 'run_config.json'
PREVIOUS = 'previous'
RESUME_MODES = ('auto', 'never')
# TrainConfig fields a checkpoint's optimizer state and data position depend on.
TRAIN_FIELDS = ('global_batch_size', 'seq_len', 'grad_accum_steps', 'seed', 'optimizer',
                'learning_rate', 'schedule', 'warmup_steps', 'decay_fraction', 'decay_shape',
                'final_lr_fraction', 'weight_decay', 'decay_all', 'b1', 'b2', 'eps', 'momentum',
                'clip_norm', 'z_loss', 'router_aux_loss_coef', 'router_z_loss_coef',
                'mtp_loss_scaling_factor', 'skip_spike_factor', 'quantization')
# Fields added later, with their defaults: recorded only when set, so older runs stay resumable.
LATER_MODEL_FIELDS = {('moe', 'router_bias_update_rate'): 0.0}
LATER_TRAIN_FIELDS = {'learning_rate_schedule_steps': None, 'weight_decay_exclude': (),
                      'adam_eps_root': 0.0, 'mu_dtype': None}
# RuntimeConfig fields that change what a checkpoint holds (the others are how it is computed).
RUNTIME_FIELDS = ('param_dtype', 'scan_layers')


class RunDirError(ValueError):
  """The run directory cannot be used as asked (the message says why and what to do)."""


def run_config(model_config, train_config, tokenizer: dict | None = None, *,
               objective: dict | None = None) -> dict:
  """The part of a run's config a resume must match, as JSON-ready data.

  ``model_config`` is a :class:`~maxnnx.config.ModelConfig` (its runtime fields other than
  :data:`RUNTIME_FIELDS` are left out), ``train_config`` a ``TrainConfig`` (only
  :data:`TRAIN_FIELDS`), ``tokenizer`` a fingerprint such as :func:`file_fingerprint` gives,
  ``objective`` the settings of a fine-tuning objective (DPO's ``beta``…).
  """
  model = model_config.to_dict()
  runtime = model.pop('runtime', {})
  model.update({k: runtime[k] for k in RUNTIME_FIELDS if k in runtime})
  for (group, name), default in LATER_MODEL_FIELDS.items():
    if model.get(group, {}).get(name, default) == default:
      model.get(group, {}).pop(name, None)
  record = {'model': model, 'train': {k: getattr(train_config, k) for k in TRAIN_FIELDS}}
  record['train'].update({k: getattr(train_config, k) for k, default in
                          LATER_TRAIN_FIELDS.items()
                          if getattr(train_config, k, default) != default})
  lora = getattr(train_config, 'lora', None)
  if lora is not None and lora.enabled:  # recorded only when on: older runs stay resumable
    record['train']['lora'] = lora.to_dict()
  if tokenizer:
    record['tokenizer'] = tokenizer
  if objective:
    record['objective'] = objective
  return json.loads(json.dumps(record))  # tuples become lists, as they are read back


def file_fingerprint(path: str) -> str:
  """SHA-256 of a file, or of the files of a directory (names and bytes, sorted); local or a
  URL."""
  digest = hashlib.sha256()
  files = [path] if paths.isfile(path) else sorted(
      paths.join(path, name) for name in paths.listdir(path)
      if paths.isfile(paths.join(path, name)))
  for name in files:
    digest.update(paths.basename(name).encode())
    with paths.open_file(name, 'rb') as f:
      for block in iter(lambda: f.read(1 << 20), b''):
        digest.update(block)
  return digest.hexdigest()[:16]


def _flatten(tree: Any, prefix: str = '') -> dict[str, Any]:
  if not isinstance(tree, dict):
    return {prefix: tree}
  flat = {}
  for key, value in tree.items():
    flat.update(_flatten(value, f'{prefix}.{key}' if prefix else str(key)))
  return flat


def config_diff(old: dict, new: dict) -> list[str]:
  """``['model.num_layers: 2 -> 3', ...]``: the fields of two :func:`run_config` records that
  differ (training fields are named as their ``maxnnx train`` keys)."""
  before, after = _flatten(old), _flatten(new)
  lines = []
  for key in sorted(set(before) | set(after)):
    if key.startswith('tokenizer.') and key != 'tokenizer.sha256':
      continue
    if before.get(key, '(unset)') == after.get(key, '(unset)'):
      continue
    if key == 'tokenizer.sha256':
      lines.append(f"tokenizer: {old.get('tokenizer', {}).get('source', '?')} -> "
                   f"{new.get('tokenizer', {}).get('source', '?')} (a different vocabulary)")
      continue
    name = key[len('train.'):] if key.startswith('train.') else key
    lines.append(f"{name}: {before.get(key, '(unset)')} -> {after.get(key, '(unset)')}")
  return lines


def check_writable(directory: str) -> None:
  """Create ``directory`` if needed and make sure a file can be written in it.

  Raises:
    RunDirError: it is a file, or it cannot be created or written (naming the path), or it
      is a URL whose filesystem is not installed.
  """
  try:
    if paths.exists(directory) and not paths.isdir(directory):
      raise RunDirError(f'output_dir {directory} is a file, not a directory.')
    probe = paths.join(directory, f'.write-test-{os.getpid()}')
    paths.makedirs(directory)
    with paths.open_file(probe, 'w'):
      pass
    paths.remove(probe)
  except OSError as e:
    raise RunDirError(f'cannot write to {e.filename or directory}: '
                      f'{e.strerror or e}.') from None
  except ImportError as e:  # fsspec's gs:// needs gcsfs
    hint = ' (the maxnnx[gcs] extra installs it)' if str(directory).startswith('gs://') else ''
    raise RunDirError(f'cannot open {directory}: {e}{hint}.') from None


def write_json(path: str, data: Any) -> None:
  """Write ``data`` as JSON to ``path`` atomically (a reader sees the old or the new file)."""
  paths.write_text(path, json.dumps(data, indent=2, default=str))


class RunDir:
  """One training run's output directory.

  Args:
    directory: the output directory, local or a URL (``gs://bucket/run``).
    resume: ``'auto'`` continues an earlier run whose config matches (and refuses one that
      does not); ``'never'`` moves an earlier run aside and starts fresh.
    command: what this run is, written into the lock for a refused second run to show.
  """

  def __init__(self, directory: str, *, resume: str = 'auto', command: str | None = None):
    if resume not in RESUME_MODES:
      raise RunDirError(f"resume={resume!r}: expected one of {', '.join(RESUME_MODES)}.")
    self.directory = paths.normalize(directory)
    self.resume = resume
    self.lock = RunLock(self.directory, command=command)
    self.moved_to: str | None = None

  @property
  def config_path(self) -> str:
    """Where the run's config is stored."""
    return paths.join(self.directory, RUN_CONFIG)

  def open(self) -> RunDir:
    """Check the directory, take its lock (process 0) and, with ``resume='never'``, move an
    earlier run aside.

    Raises:
      RunDirError: the directory is unusable, or another live run holds it.
    """
    check_writable(self.directory)
    if jax.process_index() == 0:
      try:
        self.lock.acquire()
      except RunLockedError as e:
        raise RunDirError(str(e)) from None
    if self.resume == 'never' and jax.process_index() == 0:
      self.moved_to = self._move_aside()
    return self

  def close(self) -> None:
    """Release the lock."""
    self.lock.release()

  def __enter__(self) -> RunDir:
    return self.open()

  def __exit__(self, *exc) -> None:
    self.close()

  def _move_aside(self) -> str | None:
    entries = [n for n in paths.listdir(self.directory) if n not in (LOCK_NAME, PREVIOUS)]
    if not entries:
      return None
    stamp = datetime.datetime.now().strftime('%Y%m%d-%H%M%S')
    target = paths.join(self.directory, PREVIOUS, stamp)
    suffix = 0
    while paths.exists(target):
      suffix += 1
      target = paths.join(self.directory, PREVIOUS, f'{stamp}.{suffix}')
    paths.makedirs(target)
    for name in entries:
      paths.rename(paths.join(self.directory, name), paths.join(target, name))
    return target

  def stored_config(self) -> dict | None:
    """The config stored by an earlier run, or ``None``."""
    try:
      return json.loads(paths.read_text(self.config_path))
    except FileNotFoundError:
      return None
    except ValueError as e:
      raise RunDirError(f'{self.config_path} is not valid JSON ({e}); move it away to start '
                        'over, or fix it.') from None

  def check_config(self, record: dict, checkpoint_dir: str | None = None) -> None:
    """Store ``record`` (a :func:`run_config`) for a new run, or check it against the stored one
    when the earlier run wrote a checkpoint (in ``checkpoint_dir`` or ``checkpoints/``) or
    ``final/``; the stored config of a run that wrote neither (a start that failed) is replaced.

    Raises:
      RunDirError: the stored config differs: a short diff and the two ways out.
    """
    stored = self.stored_config()
    if stored is not None and not self.has_written(checkpoint_dir):
      if config_diff(stored, record) and jax.process_index() == 0:
        print(f'Note: {self.config_path} is of a run that wrote no checkpoint; this run '
              'replaces it.')
      stored = None
    if stored is not None:
      diff = config_diff(stored, record)
      if diff:
        raise RunDirError(
            f'{self.directory} holds a run with another config, so it is not resumed:\n  '
            + '\n  '.join(diff) + '\nUse a new output_dir, or resume=never to move that run to '
            f'{paths.join(self.directory, PREVIOUS)}/ and start fresh.')
    if jax.process_index() == 0 and stored != record:
      write_json(self.config_path, record)

  def has_written(self, checkpoint_dir: str | None = None) -> bool:
    """Whether a run here wrote something a restart resumes or keeps: a checkpoint step (in
    ``checkpoint_dir`` or the default ``checkpoints/``) or ``final/``."""
    return bool(paths.exists(paths.join(self.directory, 'final'))
                or checkpoint_steps(checkpoint_dir)
                or checkpoint_steps(paths.join(self.directory, 'checkpoints')))

  def trim_metrics(self, path: str, step: int | None) -> None:
    """Keep the lines of ``metrics.jsonl`` up to ``step`` (all of them go for a fresh run)."""
    if jax.process_index() != 0 or not paths.exists(path):
      return
    if step is None:
      paths.remove(path)
      return
    kept = []
    for line in paths.read_text(path).splitlines(keepends=True):
      try:
        if json.loads(line)['step'] <= step:
          kept.append(line if line.endswith('\n') else line + '\n')
      except (ValueError, KeyError, TypeError):
        continue  # a line cut short by a crash
    paths.write_text(path, ''.join(kept))

  def read_metrics(self, path: str) -> list[dict]:
    """The records of ``metrics.jsonl`` (none when it is missing)."""
    if not paths.exists(path):
      return []
    records = []
    for line in paths.read_text(path).splitlines():
      try:
        records.append(json.loads(line))
      except ValueError:
        continue
    return records


def checkpoint_steps(directory: str | None) -> list[int]:
  """The complete steps in a checkpoint directory, without opening it (oldest first)."""
  if not directory or not paths.isdir(directory):
    return []
  return sorted(int(n) for n in paths.listdir(directory) if n.isdigit())


def replace_dir(tmp: str, target: str) -> None:
  """Move directory ``tmp`` to ``target``, replacing what is there."""
  paths.rmtree(target, missing_ok=True)
  paths.rename(tmp, target)


__all__ = ['RESUME_MODES', 'RUN_CONFIG', 'RunDir', 'RunDirError', 'check_writable',
           'checkpoint_steps', 'config_diff', 'file_fingerprint', 'replace_dir', 'run_config',
           'write_json']
