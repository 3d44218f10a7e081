"""A small, single-device ``Trainer``: one jitted step, a history, evaluation.

This is the first brick of the training stack: it drives any maxnnx model
with an optax optimizer through ``nnx.Optimizer`` and keeps per-step metrics in
``history`` for plotting. Call :meth:`Trainer.fit` or step it by hand with
:meth:`Trainer.step` and look at ``trainer.model`` in between.
"""

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


def cross_entropy_loss(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy, computed in float32."""
  losses = optax.softmax_cross_entropy_with_integer_labels(logits_BTV.astype(jnp.float32),
                                                           targets_BT)
  return losses.mean()


def _decay_mask(params):
  """Weight decay on matmul kernels only: not on norms, biases or embeddings."""
  # Paths end in the Variable's value attribute, so look for 'kernel' anywhere in them.
  return jax.tree.map_with_path(
      lambda path, _: any(getattr(k, 'key', None) == 'kernel' for k in path), params)


def default_optimizer(learning_rate: float, steps: int, *, warmup_steps: int | None = None,
                      weight_decay: float = 0.1, clip_norm: float = 1.0
                      ) -> optax.GradientTransformation:
  """AdamW (decoupled decay on kernels only) with linear warmup + cosine decay and
  global-norm clipping."""
  warmup = warmup_steps if warmup_steps is not None else max(1, steps // 20)
  schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup, max(steps, warmup + 1),
                                                end_value=learning_rate / 10)
  return optax.chain(optax.clip_by_global_norm(clip_norm),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay,
                                 mask=_decay_mask))


@nnx.jit
def _train_step(model, optimizer, batch_BT1):
  def loss_fn(model):
    return cross_entropy_loss(model(batch_BT1[:, :-1]), batch_BT1[:, 1:])

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss, optax.global_norm(grads)


@nnx.jit
def _eval_step(model, batch_BT1):
  return cross_entropy_loss(model(batch_BT1[:, :-1]), batch_BT1[:, 1:])


class Trainer:
  """Owns a model, its optimizer and a batch source.

  Args:
    model: any maxnnx model (``Transformer``).
    optimizer: an optax transformation (see :func:`default_optimizer`).
    data: an object with ``next() -> [batch, seq_len + 1]`` token windows and
      ``eval_batches(n)`` (e.g. :class:`~maxnnx.data.TokenWindows`).
    eval_batches: held-out batches per :meth:`evaluate`.
    callbacks: functions called as ``callback(trainer, metrics)`` after every step.

  Attributes:
    history: one dict of metrics per step (``step``, ``loss``, ``grad_norm``,
      ``tokens_per_s``, and ``eval_loss`` where evaluated).
  """

  def __init__(self, model, optimizer: optax.GradientTransformation, data, *,
               eval_batches: int = 4, callbacks: tuple[Callable, ...] = ()):
    self.model = model
    self.optimizer = nnx.Optimizer(model, optimizer, wrt=nnx.Param)
    self.data = data
    self.eval_batch_count = eval_batches
    self.callbacks = list(callbacks)
    self.history: list[dict] = []

  @property
  def step_count(self) -> int:
    return len(self.history)

  def step(self, batch_BT1=None) -> dict:
    """One optimizer step on ``batch`` (default: the next batch of ``data``)."""
    batch = np.asarray(self.data.next() if batch_BT1 is None else batch_BT1)
    start = time.perf_counter()
    loss, grad_norm = _train_step(self.model, self.optimizer, batch)
    loss = float(loss)  # the one host sync per step: the metrics are logged every step
    elapsed = time.perf_counter() - start
    if not np.isfinite(loss):
      raise FloatingPointError(f'Loss became {loss} at step {self.step_count + 1}.')
    metrics = {'step': self.step_count + 1, 'loss': loss, 'grad_norm': float(grad_norm),
               'tokens_per_s': batch[:, :-1].size / elapsed}
    self.history.append(metrics)
    for callback in self.callbacks:
      callback(self, metrics)
    return metrics

  def evaluate(self) -> float:
    """Mean loss over the held-out batches."""
    losses = [float(_eval_step(self.model, b))
              for b in self.data.eval_batches(self.eval_batch_count)]
    return float(np.mean(losses))

  def fit(self, steps: int, *, eval_every: int = 0, log_every: int = 0,
          log: Callable[[str], None] = print) -> list[dict]:
    """Run ``steps`` steps; evaluate every ``eval_every`` and print every ``log_every``."""
    for i in range(1, steps + 1):
      metrics = self.step()
      if eval_every and (i % eval_every == 0 or i == steps):
        metrics['eval_loss'] = self.evaluate()
      if log_every and (i % log_every == 0 or i == 1 or i == steps):
        extra = f"  eval {metrics['eval_loss']:.3f}" if 'eval_loss' in metrics else ''
        log(f"step {metrics['step']:>5}/{steps}  loss {metrics['loss']:.3f}{extra}  "
            f"grad_norm {metrics['grad_norm']:.2f}  {metrics['tokens_per_s']:,.0f} tok/s")
    return self.history
