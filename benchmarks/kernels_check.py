"""Check every kernel strategy against the reference on this machine, and time it.

Run on a GPU (or TPU) machine to exercise the paths CPU tests cannot reach::

  python benchmarks/kernels_check.py            # attention, ragged dot, paged attention
  python benchmarks/kernels_check.py --quick    # small shapes

Each attention strategy runs every scenario with ``on_unsupported='error'``, so
a row shows what the strategy itself computed: ``ok`` with the largest error of
the output and of the gradients against ``xla`` (relative to the largest
reference value; inputs rounded to the dtype, reference in float32), ``refused``
with the declared reason, or ``FAIL``/``error``. Notes list what tokamax's
implementation order skipped. On CPU the GPU-only strategies simply show as
refused. Ragged-dot strategies are checked against ``dense`` the same way, and
paged-attention strategies (forward only) against the ``xla`` paged reference on one
engine step of decode rows and prefill chunks.
"""

import argparse
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from maxnnx.kernels import (
  ATTENTION_IMPLEMENTATIONS,
  PAGED_ATTENTION_IMPLEMENTATIONS,
  RAGGED_DOT_IMPLEMENTATIONS,
  AttentionMask,
  AttentionOptions,
  DenseRaggedDot,
  KernelUnsupportedError,
  PagedBatch,
  XlaAttention,
  XlaPagedAttention,
  get_attention_kernel,
  get_paged_attention_kernel,
  get_ragged_dot_kernel,
)
from maxnnx.kernels.capabilities import reset_warnings

# name -> (q_len, kv_len, options)
SCENARIOS = {
    'causal': (None, None, {}),
    'packed': (None, None, {'packed': True}),
    'window': (None, None, {'window': 64}),
    'traced_window': (None, None, {'window': 64, 'traced': True}),
    'softcap': (None, None, {'softcap': 30.0}),
    'sinks': (None, None, {'sinks': True}),
    'decode': (1, None, {}),
}


class _Notes(logging.Handler):
  """Collects the ``maxnnx.kernels`` messages logged during one case."""

  def __init__(self):
    super().__init__(logging.INFO)
    self.messages = []

  def emit(self, record):
    self.messages.append(record.getMessage())


def _attention_case(scenario, dtype, batch, length, heads, kv_heads, head_dim, rng):
  """Inputs, mask, keyword arguments and loss weights of one scenario."""
  q_len, kv_len, opts = SCENARIOS[scenario]
  t, s = q_len or length, kv_len or length
  q = rng.normal(size=(batch, t, heads, head_dim))
  k = rng.normal(size=(batch, s, kv_heads, head_dim))
  v = rng.normal(size=(batch, s, kv_heads, head_dim))
  kv_pos = np.broadcast_to(np.arange(s), (batch, s))
  kv_seg = np.ones((batch, s), np.int32)
  if opts.get('packed'):
    cut = s // 3
    kv_seg = np.broadcast_to(np.where(np.arange(s) < cut, 1, 2), (batch, s))
    kv_pos = np.where(np.arange(s) < cut, np.arange(s), np.arange(s) - cut)
    kv_pos = np.broadcast_to(kv_pos, (batch, s))
  if t == s:
    mask = AttentionMask.causal(jnp.asarray(kv_seg, jnp.int32), jnp.asarray(kv_pos, jnp.int32))
  else:  # decoding the last slot of the cache
    mask = AttentionMask(jnp.ones((batch, t), jnp.int32),
                         jnp.full((batch, t), s - 1, jnp.int32),
                         jnp.asarray(kv_seg, jnp.int32), jnp.asarray(kv_pos, jnp.int32))
  window = opts.get('window')
  kwargs = dict(scale=head_dim ** -0.5, softcap=opts.get('softcap'),
                sliding_window=jnp.int32(window) if opts.get('traced') else window,
                sinks_N=jnp.asarray(rng.normal(size=heads), dtype) if opts.get('sinks') else None)
  qkv = tuple(jnp.asarray(x, dtype) for x in (q, k, v))
  weights = jnp.asarray(rng.normal(size=(batch, t, heads, head_dim)), jnp.float32)
  return qkv, mask, kwargs, weights


def _attention_fn(kernel, mask, kwargs, weights):
  options = AttentionOptions(**kwargs)

  def loss(q, k, v):
    out = kernel(q, k, v, mask, options)
    return jnp.sum(out.astype(jnp.float32) * weights), out

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _rel_err(actual, expected):
  actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30))


def float32_limit() -> float:
  """Largest relative error accepted in float32: 1e-4, but 3e-3 on a GPU, whose float32 matmuls
  run in TF32 at jax's default precision (seen on an H100: 2e-4 on outputs, 8e-4 on gradients,
  2e-3 for the tokamax 'xla' decode path)."""
  return 3e-3 if jax.default_backend() == 'gpu' else 1e-4


def _time(fn, *args, repeats=5):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * float(np.median(times))


def _run(fn, reference, args, ref_args):
  """Status, output error, gradient error, milliseconds and notes of one case."""
  reset_warnings()  # so each row shows its own notes
  notes = _Notes()
  logger = logging.getLogger('maxnnx.kernels')
  logger.addHandler(notes)
  logger.setLevel(logging.INFO)
  try:
    (_, out), grads = fn(*args)
  except KernelUnsupportedError as e:
    return 'refused', '', '', '', str(e).split(': ', 1)[1].split('. Choose')[0]
  except Exception as e:  # noqa: BLE001 - report every failure in the table
    return 'error', '', '', '', f'{type(e).__name__}: {str(e)[:120]}'
  finally:
    logger.removeHandler(notes)
  (_, ref_out), ref_grads = reference(*ref_args)
  out_err = _rel_err(out, ref_out)
  grad_err = max(_rel_err(g, r) for g, r in zip(grads, ref_grads))
  limit = float32_limit() if args[0].dtype == jnp.float32 else 3e-2
  status = 'ok' if out_err < limit and grad_err < 10 * limit else 'FAIL'
  note = '; '.join(m for m in notes.messages if 'could not run' in m)
  return status, f'{out_err:.1e}', f'{grad_err:.1e}', f'{_time(fn, *args):.2f}', note


def check_attention(quick: bool) -> list[tuple]:
  """One row per (strategy, scenario, dtype)."""
  shape = (2, 128, 4, 2, 64) if quick else (4, 1024, 16, 4, 128)
  rows = []
  for dtype in (jnp.float32, jnp.bfloat16):
    for scenario in SCENARIOS:
      rng = np.random.default_rng(0)
      (q, k, v), mask, kwargs, weights = _attention_case(scenario, dtype, *shape, rng)
      ref_kwargs = dict(kwargs, sinks_N=None if kwargs['sinks_N'] is None
                        else kwargs['sinks_N'].astype(jnp.float32))
      ref_args = tuple(x.astype(jnp.float32) for x in (q, k, v))
      reference = _attention_fn(XlaAttention(), mask, ref_kwargs, weights)
      for name in ATTENTION_IMPLEMENTATIONS:
        kernel = get_attention_kernel(name, on_unsupported='error')
        fn = _attention_fn(kernel, mask, kwargs, weights)
        rows.append((name, scenario, jnp.dtype(dtype).name,
                     *_run(fn, reference, (q, k, v), ref_args)))
  return rows


def _ragged_fn(kernel, group_sizes, weights):
  def loss(lhs, rhs):
    out = kernel(lhs, rhs, group_sizes)
    return jnp.sum(out.astype(jnp.float32) * weights), out

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def check_ragged_dot(quick: bool) -> list[tuple]:
  """One row per (strategy, dtype)."""
  m, k, n, groups = (256, 128, 64, 4) if quick else (8192, 2048, 1024, 16)
  rows = []
  for dtype in (jnp.float32, jnp.bfloat16):
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.normal(size=(m, k)), dtype)
    rhs = jnp.asarray(rng.normal(size=(groups, k, n)) / np.sqrt(k), dtype)
    sizes = rng.multinomial(m - m // 16, np.ones(groups) / groups)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    weights = jnp.asarray(rng.normal(size=(m, n)), jnp.float32)

    reference = _ragged_fn(DenseRaggedDot(), group_sizes, weights)
    ref_args = (lhs.astype(jnp.float32), rhs.astype(jnp.float32))
    for name in RAGGED_DOT_IMPLEMENTATIONS:
      fn = _ragged_fn(get_ragged_dot_kernel(name, on_unsupported='error'), group_sizes, weights)
      rows.append((name, 'grouped', jnp.dtype(dtype).name,
                   *_run(fn, reference, (lhs, rhs), ref_args)))
  return rows


def _paged_step(rng, dtype, decode_rows, context, chunk_rows, chunk, heads, kv_heads,
                head_dim, page=16):
  """Pools, flat queries and the PagedBatch of one engine step: ``decode_rows`` rows of one
  new token after up to ``context`` cached ones, ``chunk_rows`` prefill chunks of ``chunk``."""
  rows = ([(int(rng.integers(1, context)), 1) for _ in range(decode_rows)]
          + [(int(rng.integers(0, context)), chunk) for _ in range(chunk_rows)])
  pages_per_row = [-(-(c + n) // page) for c, n in rows]
  order = rng.permutation(np.arange(1, 1 + sum(pages_per_row)))
  table = np.zeros((len(rows), max(pages_per_row)), np.int32)
  kv_lens, q_starts, q_lens, slots, used = [], [], [], [], 0
  for b, ((cached, new), count) in enumerate(zip(rows, pages_per_row)):
    pages = order[used:used + count]
    used += count
    table[b, :count] = pages
    pos = np.arange(cached, cached + new)
    q_starts.append(len(slots))
    slots.extend(pages[pos // page] * page + pos % page)
    kv_lens.append(cached + new)
    q_lens.append(new)
  batch = PagedBatch(jnp.asarray(table), jnp.asarray(kv_lens, jnp.int32),
                     jnp.asarray(q_starts, jnp.int32), jnp.asarray(q_lens, jnp.int32),
                     jnp.asarray(slots, jnp.int32), max(q_lens))
  pool = (1 + used, page, kv_heads, head_dim)
  q = jnp.asarray(rng.normal(size=(len(slots), heads, head_dim)), dtype)
  k = jnp.asarray(rng.normal(size=pool), dtype)
  v = jnp.asarray(rng.normal(size=pool), dtype)
  return (q, k, v, batch), len(slots)


def check_paged_attention(quick: bool) -> list[tuple]:
  """One row per (strategy, scenario, dtype): forward error against ``xla`` and time."""
  shape = (8, 256, 1, 16, 8, 2, 64) if quick else (32, 4096, 2, 256, 32, 8, 128)
  scenarios = {'decode+chunks': {}, 'window': {'sliding_window': 1024},
               'softcap': {'softcap': 30.0}}
  rows = []
  for dtype in (jnp.float32, jnp.bfloat16):
    for scenario, extra in scenarios.items():
      args, real = _paged_step(np.random.default_rng(0), dtype, *shape)
      options = AttentionOptions(scale=shape[-1] ** -0.5, **extra)
      reference = jax.jit(lambda *a, o=options: XlaPagedAttention()(*a, o))
      want = reference(*(x.astype(jnp.float32) if i < 3 else x for i, x in enumerate(args)))
      for name in PAGED_ATTENTION_IMPLEMENTATIONS:
        kernel = get_paged_attention_kernel(name, on_unsupported='error')
        fn = jax.jit(lambda *a, kernel=kernel, o=options: kernel(*a, o))
        try:
          out = fn(*args)
        except KernelUnsupportedError as e:
          rows.append((name, scenario, jnp.dtype(dtype).name, 'refused', '', '', '',
                       str(e).split(': ', 1)[1].split('. Choose')[0]))
          continue
        except Exception as e:  # noqa: BLE001 - report every failure in the table
          rows.append((name, scenario, jnp.dtype(dtype).name, 'error', '', '', '',
                       f'{type(e).__name__}: {str(e)[:120]}'))
          continue
        err = _rel_err(out[:real], want[:real])
        limit = float32_limit() if dtype == jnp.float32 else 3e-2
        rows.append((name, scenario, jnp.dtype(dtype).name, 'ok' if err < limit else 'FAIL',
                     f'{err:.1e}', '-', f'{_time(fn, *args):.2f}', ''))
  return rows


def print_table(title: str, rows: list[tuple]) -> None:
  """A Markdown table of the rows."""
  header = ('strategy', 'scenario', 'dtype', 'status', 'out err', 'grad err',
            'fwd+bwd ms (paged: fwd)', 'notes')
  print(f'\n### {title} ({jax.default_backend()}: {jax.devices()[0].device_kind})\n')
  print('| ' + ' | '.join(header) + ' |')
  print('|' + '---|' * len(header))
  for row in rows:
    print('| ' + ' | '.join(str(c) for c in row) + ' |')


def main(argv=None) -> None:
  """Check and print the three tables."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--quick', action='store_true', help='small shapes')
  args = parser.parse_args(argv)
  print_table('attention vs xla', check_attention(args.quick))
  print_table('ragged dot vs dense', check_ragged_dot(args.quick))
  print_table('paged attention vs xla (one engine step)', check_paged_attention(args.quick))


if __name__ == '__main__':
  main()
