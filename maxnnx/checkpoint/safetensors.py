"""Reading and writing the safetensors format without pickle.

The format is an 8-byte little-endian header length, a JSON header mapping
tensor names to ``{dtype, shape, data_offsets}``, then raw little-endian bytes.
Reading memory-maps each file and validates every tensor's byte range against
the file size first, so a truncated or corrupt file is reported with the file
and tensor name before anything is loaded. Nothing is read until a tensor is
used; :func:`release_pages` hands the pages a used tensor brought in back to
the kernel, so a loader that converts tensor by tensor holds about one tensor
of the file in memory at a time, not the whole file.
"""

import json
import mmap
import os
import struct
from collections.abc import Mapping

import ml_dtypes
import numpy as np

_DTYPES = {
    'F64': np.dtype(np.float64), 'F32': np.dtype(np.float32), 'F16': np.dtype(np.float16),
    'BF16': np.dtype(ml_dtypes.bfloat16), 'I64': np.dtype(np.int64), 'I32': np.dtype(np.int32),
    'I16': np.dtype(np.int16), 'I8': np.dtype(np.int8), 'U8': np.dtype(np.uint8),
    'BOOL': np.dtype(np.bool_), 'F8_E4M3': np.dtype(ml_dtypes.float8_e4m3fn),
    'F8_E5M2': np.dtype(ml_dtypes.float8_e5m2),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsError(ValueError):
  """A safetensors file or directory is missing, truncated or inconsistent."""


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """Memory-mapped arrays of one ``.safetensors`` file, validated first."""
  size = os.path.getsize(path)
  with open(path, 'rb') as f:
    prefix = f.read(8)
    if len(prefix) < 8:
      raise SafetensorsError(f'{path}: file is {size} bytes, too short for a safetensors header.')
    (header_len,) = struct.unpack('<Q', prefix)
    if header_len > min(_MAX_HEADER, size - 8):
      raise SafetensorsError(f'{path}: header length {header_len} exceeds the file size '
                             f'({size} bytes); the file is truncated or not safetensors.')
    try:
      header = json.loads(f.read(header_len))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise SafetensorsError(f'{path}: header is not valid JSON ({e}).') from None
  header.pop('__metadata__', None)
  data_start = 8 + header_len
  mapped = None
  if size > data_start:
    with open(path, 'rb') as f:
      mapped = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), np.uint8)
  tensors = {}
  for name, info in header.items():
    dtype = _DTYPES.get(info.get('dtype'))
    if dtype is None:
      raise SafetensorsError(f"{path}: tensor '{name}' has unsupported dtype {info.get('dtype')}.")
    shape = tuple(info['shape'])
    begin, end = info['data_offsets']
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if end - begin != expected:
      raise SafetensorsError(f"{path}: tensor '{name}' {shape} {info['dtype']} needs {expected} "
                             f'bytes but its header gives {end - begin}.')
    if data_start + end > size:
      raise SafetensorsError(f"{path}: tensor '{name}' ends at byte {data_start + end} but the "
                             f'file has {size} bytes; the file is truncated.')
    if expected == 0:
      tensors[name] = np.zeros(shape, dtype)
    else:
      tensors[name] = mapped[data_start + begin:data_start + end].view(dtype).reshape(shape)
  return tensors


def release_pages(array: np.ndarray) -> None:
  """Drop the resident pages of the file mapping ``array`` views (no-op for other arrays).

  The mapping stays valid: a later read of any of its tensors reads the file again. Pages of a
  read-only file mapping are clean, so dropping them loses nothing.
  """
  base = array
  while isinstance(base, np.ndarray) and base.base is not None:
    base = base.base
  if isinstance(base, memoryview):
    base = base.obj
  if isinstance(base, mmap.mmap) and not base.closed and hasattr(mmap, 'MADV_DONTNEED'):
    base.madvise(mmap.MADV_DONTNEED)


def host_buffer(shape: tuple[int, ...], dtype) -> np.ndarray:
  """An uninitialised array of its own anonymous memory mapping, returned to the kernel whole
  when the last reference goes (arrays under 1 MiB come from ``np.empty``).

  A loader that fills one parameter-sized buffer after another needs this: through ``malloc``,
  glibc's dynamic mmap threshold (raised to the size of the first large buffer freed, up to
  32 MiB) puts later buffers of up to that size on the heap, where a freed one under a live
  allocation stays resident; a float32 load drifted by about 1 MB per tensor that way, 0.1x of
  the checkpoint over a load, more where threads interleave their allocations differently.
  """
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  if nbytes < 1 << 20:
    return np.empty(shape, dtype)
  return np.frombuffer(mmap.mmap(-1, nbytes), dtype).reshape(shape)


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> None:
  """Write ``tensors`` to ``path`` atomically (temporary file, then rename)."""
  header, offset, arrays = {}, 0, []
  for name in sorted(tensors):
    array = np.ascontiguousarray(tensors[name])
    if array.dtype not in _NAMES:
      raise SafetensorsError(f"Cannot write tensor '{name}' of dtype {array.dtype}.")
    nbytes = array.nbytes
    header[name] = {'dtype': _NAMES[array.dtype], 'shape': list(array.shape),
                    'data_offsets': [offset, offset + nbytes]}
    offset += nbytes
    arrays.append(array)
  if metadata:
    header['__metadata__'] = dict(metadata)
  blob = json.dumps(header, separators=(',', ':')).encode()
  blob += b' ' * (-len(blob) % 8)  # align the data section to 8 bytes
  tmp = f'{path}.tmp'
  with open(tmp, 'wb') as f:
    f.write(struct.pack('<Q', len(blob)))
    f.write(blob)
    for array in arrays:
      f.write(array.tobytes())
  os.replace(tmp, path)


def safetensors_files(directory: str) -> list[str]:
  """The weight files of a Hugging Face directory (sharded index or single file)."""
  index = os.path.join(directory, 'model.safetensors.index.json')
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f).get('weight_map')
    if not isinstance(weight_map, dict):
      raise SafetensorsError(f'{index}: no "weight_map" object.')
    files = sorted(set(weight_map.values()))
    missing = [n for n in files if not os.path.exists(os.path.join(directory, n))]
    if missing:
      raise SafetensorsError(f'{index} lists shard(s) that are missing: {", ".join(missing)}.')
    return [os.path.join(directory, n) for n in files]
  files = sorted(n for n in os.listdir(directory) if n.endswith('.safetensors'))
  if not files:
    bins = [n for n in os.listdir(directory) if n.endswith(('.bin', '.pt', '.pth'))]
    hint = (f' Found {", ".join(bins)}: pickle checkpoints are not loaded; convert them to '
            'safetensors first.' if bins else '')
    raise SafetensorsError(f'{directory}: no *.safetensors weight files.{hint}')
  return [os.path.join(directory, n) for n in files]


def read_safetensors_dir(directory: str) -> dict[str, tuple[str, np.ndarray]]:
  """Every tensor of a directory, as ``name -> (file, memory-mapped array)``."""
  tensors = {}
  for path in safetensors_files(directory):
    for name, array in read_safetensors(path).items():
      if name in tensors:
        raise SafetensorsError(f"Tensor '{name}' appears in both {tensors[name][0]} and {path}.")
      tensors[name] = (path, array)
  return tensors


def plan_shards(tensors: Mapping[str, np.ndarray], max_shard_bytes: int
                ) -> list[dict[str, np.ndarray]]:
  """``tensors`` in name order, cut into files of at most ``max_shard_bytes`` (a larger
  tensor gets a file of its own); no files for no tensors."""
  shards: list[dict[str, np.ndarray]] = []
  size = 0
  for name in sorted(tensors):
    nbytes = tensors[name].nbytes
    if not shards or (shards[-1] and size + nbytes > max_shard_bytes):
      shards.append({})
      size = 0
    shards[-1][name] = tensors[name]
    size += nbytes
  return shards


def write_sharded(directory: str, tensors: Mapping[str, np.ndarray],
                  max_shard_bytes: int = 5 * 1024**3) -> list[str]:
  """Write ``tensors`` as one file or as shards plus ``model.safetensors.index.json``."""
  shards = plan_shards(tensors, max_shard_bytes) or [{}]
  metadata = {'format': 'pt'}
  if len(shards) == 1:
    write_safetensors(os.path.join(directory, 'model.safetensors'), shards[0], metadata)
    return ['model.safetensors']
  names = [f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors' for i in range(len(shards))]
  weight_map = {}
  for name, shard in zip(names, shards):
    write_safetensors(os.path.join(directory, name), shard, metadata)
    weight_map.update({t: name for t in shard})
  total = sum(t.nbytes for t in tensors.values())
  with open(os.path.join(directory, 'model.safetensors.index.json'), 'w') as f:
    json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, f, indent=2)
  return names


CHUNK_BYTES = 4 << 20  # of a file tensor read before its pages are released


def row_chunks(num_rows: int, row_bytes: int) -> list[slice]:
  """Slices of ``num_rows`` rows of about :data:`CHUNK_BYTES` each (a tensor copied a chunk at
  a time, releasing the file's pages behind it)."""
  step = max(1, CHUNK_BYTES // max(1, row_bytes))
  return [slice(start, start + step) for start in range(0, num_rows, step)]
