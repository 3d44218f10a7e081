"""dtype='auto': the compute dtype chosen from the device, the CPU's flags or a matmul probe;
and the MFU ceiling of the fastest dtype."""

import jax
import numpy as np
import pytest
from flax import nnx

import maxnnx
from maxnnx import hardware
from maxnnx.config import ConfigError
from maxnnx.train import flops

X86_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse2 avx avx2 fma {extra}
bogomips\t: 4890.81

processor\t: 1
flags\t\t: fpu sse2 avx avx2 fma {extra}
"""
ARM_CPUINFO = """processor\t: 0
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics bf16 i8mm
CPU implementer\t: 0x41
"""


def _rates(**rates):
  calls = []

  def probe(name):
    calls.append(name)
    return rates[name]
  return probe, calls


def test_flags_are_read_from_cpuinfo(tmp_path):
  path = tmp_path / 'cpuinfo'
  path.write_text(X86_CPUINFO.format(extra='avx512f avx512_bf16'))
  flags = hardware.cpu_flags(str(path))
  assert {'avx2', 'fma', 'avx512_bf16'} <= flags and 'bogomips' not in flags
  path.write_text(ARM_CPUINFO)
  assert {'asimd', 'bf16'} <= hardware.cpu_flags(str(path))
  assert hardware.cpu_flags(str(tmp_path / 'missing')) is None


@pytest.mark.parametrize('extra, expected', [
    ('', 'float32'), ('avx512f avx512_bf16', 'bfloat16'), ('amx_tile amx_bf16', 'bfloat16'),
    ('avx512f avx512bw', 'float32')])
def test_x86_flags_decide_without_a_probe(tmp_path, extra, expected):
  path = tmp_path / 'cpuinfo'
  path.write_text(X86_CPUINFO.format(extra=extra))
  probe, calls = _rates(float32=1.0, bfloat16=9.0)
  dtype, why = hardware.choose_compute_dtype('cpu', hardware.cpu_flags(str(path)), 'x86_64',
                                             probe)
  assert dtype == expected and calls == []
  assert why.startswith('this CPU has native') == (expected == 'bfloat16')


def test_accelerators_compute_in_bfloat16():
  probe, calls = _rates(float32=9.0, bfloat16=1.0)
  for platform in ('gpu', 'tpu'):
    assert hardware.choose_compute_dtype(platform, None, 'x86_64', probe)[0] == 'bfloat16'
  assert calls == []


@pytest.mark.parametrize('rates, expected', [((3e9, 1e9), 'float32'), ((1e9, 4e9), 'bfloat16')])
def test_other_cpus_take_the_faster_of_a_probe(rates, expected):
  probe, calls = _rates(float32=rates[0], bfloat16=rates[1])
  flags = frozenset({'asimd', 'bf16'})
  dtype, why = hardware.choose_compute_dtype('cpu', flags, 'aarch64', probe)
  assert dtype == expected and sorted(calls) == ['bfloat16', 'float32']
  assert 'GFLOP/s' in why
  probe, calls = _rates(float32=rates[0], bfloat16=rates[1])
  assert hardware.choose_compute_dtype('cpu', None, 'x86_64', probe)[0] == expected


def test_auto_computes_like_the_dtype_it_resolves_to():
  dtype, _ = hardware.auto_compute_dtype()
  tokens = np.random.default_rng(0).integers(0, 64, (2, 9))
  logits = {}
  for name in ('auto', dtype):
    cfg = maxnnx.get_preset('tiny', vocab_size=64, num_layers=1, **{'runtime.dtype': name})
    assert cfg.jnp_dtype('dtype') == jax.numpy.dtype(dtype)
    logits[name] = np.asarray(maxnnx.Transformer(cfg, rngs=nnx.Rngs(0))(tokens))
  np.testing.assert_array_equal(logits['auto'], logits[dtype])
  with pytest.raises(ConfigError, match='param_dtype'):
    maxnnx.get_preset('tiny', **{'runtime.param_dtype': 'auto'})


def test_the_cpu_ceiling_is_the_faster_dtypes(monkeypatch):
  monkeypatch.setattr(flops, 'measured_matmul_flops',
                      lambda name: {'float32': 2e9, 'bfloat16': 1.5e9}[name])
  device = jax.devices()[0]
  assert flops.peak_flops_per_device(device) == (
      2e9, f'measured float32 matmul on {device.device_kind} (faster than bfloat16)')
  assert flops.peak_flops_per_device(device, 'bfloat16')[0] == 1.5e9
