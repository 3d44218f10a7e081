"""Ahead-of-time compilation for a TPU slice that is not attached (``maxnnx compile
topology=...``): slice names, the errors, the datasheet memory of abstract devices, and (where
libtpu is installed) a compile for 8 v5p devices and for two v5e slices."""

import importlib.util
import os
import subprocess
import sys

import pytest

from maxnnx import cli
from maxnnx.parallel.topology import slice_shape, topology_name
from maxnnx.train.memory import device_memory_limit

HAS_LIBTPU = importlib.util.find_spec('libtpu') is not None
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize('name,grid', [
    # Cloud TPU's documented slice topologies.
    ('v5p-8', 'v5p:2x2x1'), ('v5p-16', 'v5p:2x2x2'), ('v5p-32', 'v5p:2x2x4'),
    ('v5p-128', 'v5p:4x4x4'), ('v5p-256', 'v5p:4x4x8'), ('v5p-1024', 'v5p:8x8x8'),
    ('v4-32', 'v4:2x2x4'), ('v5e-16', 'v5e:4x4'), ('v5litepod-8', 'v5e:2x4'),
    ('v6e-64', 'v6e:8x8'), ('v6e-256', 'v6e:16x16'), ('V5P:4x4x8', 'v5p:4x4x8')])
def test_slice_names_give_cloud_tpu_grids(name, grid):
  assert topology_name(name) == grid


def test_every_power_of_two_slice_has_that_many_chips():
  for dims in (2, 3):
    for chips in (4, 8, 16, 32, 64, 128, 256, 512, 1024):
      shape = slice_shape(chips, dims)
      assert len(shape) == dims
      product = 1
      for side in shape:
        product *= side
      assert product == chips and max(shape) <= 2 * min(shape)


@pytest.mark.parametrize('name,match', [
    ('8xh100', 'GPU targets'), ('v7-4', 'Cloud TPU slice name'), ('v5p-12', '6 chips'),
    ('v5p-7', 'must be even')])
def test_bad_topologies_are_named(name, match):
  with pytest.raises(ValueError, match=match):
    topology_name(name)


class _AbstractDevice:
  """A device that reports no memory stats, as a described (not attached) TPU."""

  platform = 'tpu'

  def __init__(self, kind):
    self.device_kind = kind

  def memory_stats(self):
    raise RuntimeError('no stats for an abstract device')


def test_abstract_tpus_get_their_datasheet_memory():
  assert device_memory_limit(_AbstractDevice('TPU v5')) == (95 * 10**9,
                                                             'TPU v5 HBM (95 GB, datasheet)')
  assert device_memory_limit(_AbstractDevice('TPU v5 lite'))[0] == 16 * 10**9
  assert device_memory_limit(_AbstractDevice('TPU v6 lite'))[0] == 32 * 10**9
  assert device_memory_limit(_AbstractDevice('Some accelerator')) == (None, 'unknown')


@pytest.mark.skipif(HAS_LIBTPU, reason='libtpu is installed here')
def test_without_libtpu_the_cli_says_how_to_get_it(capsys):
  assert cli.main(['compile', 'topology=v5p-16', 'model=tiny']) == 2
  err = capsys.readouterr().err
  assert "topology=v5p-16 (v5p:2x2x2)" in err and "pip install 'jax[tpu]==" in err


def _compile(*args):
  env = {**os.environ, 'PYTHONPATH': os.pathsep.join(
      [ROOT, *filter(None, [os.environ.get('PYTHONPATH')])])}
  return subprocess.run([sys.executable, '-m', 'maxnnx', 'compile', 'model=tiny',
                         'global_batch_size=8', 'seq_len=128', *args],
                        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu (pip install 'jax[tpu]')")
@pytest.mark.parametrize('args,devices,kind,hbm', [
    (('topology=v5p-16',), 8, 'TPU v5', '95 GB'),
    (('topology=v5e-4', 'topology_slices=2', 'mesh.dcn_data=2', 'mesh.data=1',
      'mesh.fsdp=-1'), 8, 'TPU v5 lite', '16 GB')], ids=['v5p-16', 'two_v5e-4_slices'])
def test_the_train_step_compiles_for_a_slice_that_is_not_here(args, devices, kind, hbm):
  """The tiny preset's train step for 8 TPU devices, from this machine."""
  done = _compile(*args)
  assert done.returncode == 0, done.stderr[-2000:]
  assert f'{devices} {kind} devices' in done.stdout
  assert f'({kind} HBM ({hbm}, datasheet))' in done.stdout


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu (pip install 'jax[tpu]')")
def test_kernels_are_chosen_for_the_slice_not_for_the_host_that_compiles():
  """Compiled from a CPU host, a step for TPUs picks kernels as a TPU would: tokamax skips its
  GPU-only Triton implementation for being made for GPUs, not for running on a CPU (its own
  Mosaic kernel still refuses the CPU host, and the step falls back to tokamax's XLA one)."""
  done = _compile('topology=v5p-8', 'attention_impl=tokamax')
  assert done.returncode == 0, done.stderr[-2000:]
  assert 'triton: not made for tpu' in done.stderr, done.stderr[-2000:]
