"""Where per-step metrics go: JSONL files, TensorBoard event files, the terminal.

The TensorBoard writer is self-contained (event files are TFRecord-framed
``Event`` protocol buffers; we encode the few fields scalars need), so logging
to TensorBoard needs neither TensorFlow nor an extra package.

Both files may be at a URL (``gs://``): they are written through
:class:`maxnnx.paths.AppendFile`, which rewrites the object every few seconds and at close.
"""

from __future__ import annotations

import json
import math
import socket
import struct
import sys
import time

from maxnnx import paths

# -- CRC32C (Castagnoli), as TFRecord framing needs -----------------------------

_CRC_TABLE = []
for _i in range(256):
  _c = _i
  for _ in range(8):
    _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
  _CRC_TABLE.append(_c)


def crc32c(data: bytes) -> int:
  """CRC-32C of ``data``."""
  crc = 0xFFFFFFFF
  for byte in data:
    crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# -- protobuf wire format, just enough for Event{wall_time, step, summary} ------

def _varint(n: int) -> bytes:
  out = bytearray()
  n &= (1 << 64) - 1
  while True:
    byte = n & 0x7F
    n >>= 7
    if n:
      out.append(byte | 0x80)
    else:
      out.append(byte)
      return bytes(out)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
  return _varint(number << 3 | wire_type) + payload


def _length_delimited(number: int, data: bytes) -> bytes:
  return _field(number, 2, _varint(len(data)) + data)


def encode_scalar_event(step: int, values: dict[str, float], wall_time: float) -> bytes:
  """An ``Event`` proto with one ``Summary.Value(tag, simple_value)`` per metric."""
  summary = b''
  for tag, value in values.items():
    val = _length_delimited(1, tag.encode()) + _field(2, 5, struct.pack('<f', value))
    summary += _length_delimited(1, val)
  return (_field(1, 1, struct.pack('<d', wall_time)) + _field(2, 0, _varint(step))
          + _length_delimited(5, summary))


def _record(data: bytes) -> bytes:
  header = struct.pack('<Q', len(data))
  return (header + struct.pack('<I', _masked_crc(header)) + data
          + struct.pack('<I', _masked_crc(data)))


class TensorBoardWriter:
  """Appends scalar summaries to a TensorBoard event file in ``logdir`` (local or a URL)."""

  def __init__(self, logdir: str):
    paths.makedirs(logdir)
    name = f'events.out.tfevents.{int(time.time())}.{socket.gethostname()}.maxnnx'
    self.path = paths.join(logdir, name)
    self._file = paths.AppendFile(self.path, binary=True)
    version = _field(1, 1, struct.pack('<d', time.time())) + _length_delimited(
        3, b'brain.Event:2')
    self._file.write(_record(version))

  def scalars(self, step: int, values: dict[str, float]) -> None:
    """Write finite float ``values`` for ``step``."""
    finite = {k: float(v) for k, v in values.items()
              if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    self._file.write(_record(encode_scalar_event(step, finite, time.time())))

  def flush(self) -> None:
    """Push written events to disk."""
    self._file.flush()

  def close(self) -> None:
    """Flush and close the file."""
    self._file.close()


def read_tensorboard_scalars(path: str) -> list[tuple[int, dict[str, float]]]:
  """Decode an event file written by :class:`TensorBoardWriter` (checks CRCs)."""
  events = []
  data = paths.read_bytes(path)
  offset = 0
  while offset < len(data):
    header = data[offset:offset + 8]
    (length,) = struct.unpack('<Q', header)
    (crc,) = struct.unpack('<I', data[offset + 8:offset + 12])
    if crc != _masked_crc(header):
      raise ValueError(f'{path}: corrupt record header at byte {offset}.')
    body = data[offset + 12:offset + 12 + length]
    (crc,) = struct.unpack('<I', data[offset + 12 + length:offset + 16 + length])
    if crc != _masked_crc(body):
      raise ValueError(f'{path}: corrupt record at byte {offset}.')
    offset += 16 + length
    event = _parse(body)
    if 5 in event:
      values = {}
      for value in _parse_repeated(event[5][0], 1):
        fields = _parse(value)
        values[fields[1][0].decode()] = struct.unpack('<f', fields[2][0])[0]
      events.append((event.get(2, [0])[0], values))
  return events


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
  shift = result = 0
  while True:
    byte = data[i]
    i += 1
    result |= (byte & 0x7F) << shift
    shift += 7
    if not byte & 0x80:
      return result, i


def _parse(data: bytes) -> dict[int, list]:
  fields: dict[int, list] = {}
  i = 0
  while i < len(data):
    key, i = _read_varint(data, i)
    number, wire = key >> 3, key & 7
    if wire == 0:
      value, i = _read_varint(data, i)
    elif wire == 1:
      value, i = data[i:i + 8], i + 8
    elif wire == 5:
      value, i = data[i:i + 4], i + 4
    else:
      length, i = _read_varint(data, i)
      value, i = data[i:i + length], i + length
    fields.setdefault(number, []).append(value)
  return fields


def _parse_repeated(data: bytes, number: int) -> list[bytes]:
  return _parse(data).get(number, [])


class JsonlWriter:
  """One JSON object per line, flushed at every write (survives a crash; at a URL, the object
  is rewritten at most every few seconds: :class:`maxnnx.paths.AppendFile`)."""

  def __init__(self, path: str):
    paths.makedirs(paths.parent(path))
    self.path = path
    self._file = paths.AppendFile(path)

  def write(self, record: dict) -> None:
    """Append ``record`` as one line."""
    self._file.write(json.dumps(record) + '\n')
    self._file.flush()

  def close(self) -> None:
    """Close the file."""
    self._file.close()


def format_metrics(m: dict, total_steps: int | None = None) -> str:
  """One progress line: step, loss, (RL: reward, KL,) lr, grad norm, tokens/s, MFU."""
  step = f"{m['step']:>6}" + (f'/{total_steps}' if total_steps else '')
  parts = [f'step {step}', f"loss {m['loss']:.4f}"]
  if 'eval_loss' in m:
    parts.append(f"eval {m['eval_loss']:.4f}" + (f" (ppl {m['eval_perplexity']:.4g})"
                                                 if 'eval_perplexity' in m else ''))
  if 'reward' in m:
    parts.append(f"reward {m['reward']:.3f}" + (f"  kl {m['kl']:.4f}" if 'kl' in m else ''))
  parts += [f"lr {m['lr']:.2e}", f"grad_norm {m['grad_norm']:.3f}"]
  if m.get('tokens_per_s'):
    parts.append(f"{m['tokens_per_s']:,.0f} tok/s")
  if m.get('mfu'):
    parts.append(f"{m['tflops_per_device']:.3g} TFLOP/s/dev  MFU {100 * m['mfu']:.1f}%")
  return '  '.join(parts)


class ProgressBar:
  """A one-line progress bar on a terminal; plain lines elsewhere (logs, notebooks)."""

  def __init__(self, total: int, stream=None, width: int = 24):
    self.total, self.width = total, width
    self.stream = stream or sys.stdout
    self.interactive = hasattr(self.stream, 'isatty') and self.stream.isatty()

  def update(self, metrics: dict) -> None:
    """Show the latest metrics."""
    line = format_metrics(metrics, self.total)
    if self.interactive:
      done = int(self.width * metrics['step'] / max(self.total, 1))
      bar = '#' * done + '.' * (self.width - done)
      self.stream.write(f'\r[{bar}] {line}\x1b[K')
      if metrics['step'] >= self.total:
        self.stream.write('\n')
    else:
      self.stream.write(line + '\n')
    self.stream.flush()
