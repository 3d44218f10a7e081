"""Local paths and URLs (``gs://bucket/run``) behind one small set of file operations.

A run's output directory, its checkpoint directory and the files a run writes (metrics, the
stored config, the goodput high-water mark, profiles, HLO dumps) may live in a local directory
or at a URL that ``etils.epath`` understands: ``gs://`` (through fsspec; install ``gcsfs``, the
``maxnnx[gcs]`` extra, or TensorFlow), ``s3://`` and ``az://``. ``file:///tmp/run`` is read as the
local path ``/tmp/run``. Every writer of a run goes through these helpers:

* local paths keep the operating system's semantics exactly: :func:`write_text` writes a
  temporary file and renames it over the old one, :class:`AppendFile` appends;
* a URL is written through ``epath``. An object store replaces an object atomically, so
  :func:`write_text` writes it directly; there is no append, so :class:`AppendFile` keeps the
  file's content in memory and rewrites the object (at most every ``upload_every`` seconds,
  and at close);
* what a library can only write to a local file (a sentencepiece model, the safetensors of an
  export, a profiler trace) is written into a local directory and copied up with
  :func:`copy_tree_to` (or :func:`write_dir`); :func:`local_copy` brings a file or directory
  down for a library that only reads local files.

Checkpoint arrays are written by orbax and tensorstore, which take the URL as it is.

Data is only read, so it takes any URL fsspec knows (``gs://``, ``s3://``, ``http(s)://``,
``hf://``, ``memory://``...): :func:`data_filesystem` finds the filesystem of such a URL and
:func:`read_data_bytes` reads one of its files, tried again after transient failures
(:func:`retrying`), each failure one line naming the URL.
:func:`os_error_in` finds the file system's refusal behind a library's exception.
"""

from __future__ import annotations

import atexit
import os
import posixpath
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable

from etils import epath

# URL schemes handed to epath (`hf://` is read-only there, so it is not a place to write runs).
REMOTE_SCHEMES = ('gs', 's3', 'az')
_SCHEME = re.compile(r'([A-Za-z][A-Za-z0-9+.-]*)://')


def _scheme(path) -> str | None:
  match = _SCHEME.match(os.fspath(path))
  return match.group(1).lower() if match else None


def is_remote(path) -> bool:
  """True for URLs such as ``gs://bucket/run`` (anything with a scheme but ``file://``)."""
  scheme = _scheme(path)
  return scheme is not None and scheme != 'file'


def normalize(path) -> str:
  """``path`` as a string: ``file://`` URLs become the local path they name, other URLs and
  local paths are returned as given.

  Raises:
    ValueError: a URL whose scheme is not one of :data:`REMOTE_SCHEMES`.
  """
  text = os.fspath(path)
  scheme = _scheme(text)
  if scheme == 'file':
    return text[len('file://'):]
  if scheme is not None and scheme not in REMOTE_SCHEMES:
    raise ValueError(f'{text}: unsupported URL scheme {scheme}://; use a local path or one of '
                     + ', '.join(f'{s}://' for s in REMOTE_SCHEMES) + '.')
  return text


def as_path(path) -> epath.Path:
  """An ``epath.Path`` for a local path or a URL (see :func:`normalize`)."""
  return epath.Path(normalize(path))


def join(path, *names: str) -> str:
  """``path/name/...`` for a local path (``os.path.join``) or a URL (``/``-joined)."""
  text = normalize(path)
  if is_remote(text):
    return posixpath.join(text, *names)
  return os.path.join(text, *names)


def absolute(path) -> str:
  """A local path made absolute; a URL as it is."""
  text = normalize(path)
  return text if is_remote(text) else os.path.abspath(text)


def parent(path) -> str:
  """The directory holding ``path`` (absolute for a local path; a bucket root is its own)."""
  text = normalize(path)
  if not is_remote(text):
    return os.path.dirname(os.path.abspath(text))
  text = text.rstrip('/')
  head = posixpath.dirname(text)
  return head if '/' in text.split('://', 1)[1] else text


def basename(path) -> str:
  """The last component of a local path or a URL."""
  text = normalize(path)
  if is_remote(text):
    return posixpath.basename(text.rstrip('/'))
  return os.path.basename(text)


# -- queries ------------------------------------------------------------------------------------

def exists(path) -> bool:
  """Whether a file or directory is there."""
  return as_path(path).exists() if is_remote(path) else os.path.exists(normalize(path))


def isdir(path) -> bool:
  """Whether ``path`` is a directory (on an object store: a prefix holding objects)."""
  return as_path(path).is_dir() if is_remote(path) else os.path.isdir(normalize(path))


def isfile(path) -> bool:
  """Whether ``path`` is a file (an object)."""
  return as_path(path).is_file() if is_remote(path) else os.path.isfile(normalize(path))


def listdir(path) -> list[str]:
  """The names in directory ``path`` (unsorted, like ``os.listdir``)."""
  if is_remote(path):
    return [p.name for p in as_path(path).iterdir()]
  return os.listdir(normalize(path))


# -- changes ------------------------------------------------------------------------------------

def makedirs(path) -> None:
  """Create directory ``path`` and its parents if missing (on an object store: nothing to do
  but what the backend records)."""
  if is_remote(path):
    as_path(path).mkdir(parents=True, exist_ok=True)
  else:
    os.makedirs(normalize(path), exist_ok=True)


def remove(path) -> None:
  """Delete file ``path``."""
  if is_remote(path):
    as_path(path).unlink()
  else:
    os.remove(normalize(path))


def rmtree(path, *, missing_ok: bool = False) -> None:
  """Delete directory ``path`` and everything in it."""
  if missing_ok and not exists(path):
    return
  if is_remote(path):
    as_path(path).rmtree()
  else:
    shutil.rmtree(normalize(path))


def rename(source, target) -> None:
  """Move ``source`` to ``target`` (which must not exist). Local: one atomic ``os.rename``;
  on an object store a directory moves object by object."""
  if is_remote(source) or is_remote(target):
    as_path(source).rename(as_path(target))
  else:
    os.rename(normalize(source), normalize(target))


def read_bytes(path) -> bytes:
  """The content of file ``path``."""
  if is_remote(path):
    return as_path(path).read_bytes()
  with open(normalize(path), 'rb') as f:
    return f.read()


def read_text(path) -> str:
  """The UTF-8 text of file ``path``."""
  if is_remote(path):
    return as_path(path).read_bytes().decode()
  with open(normalize(path), encoding='utf-8') as f:
    return f.read()


def write_bytes(path, data: bytes) -> None:
  """Write ``data`` to ``path`` so that a reader sees the old or the new file, never a part:
  a local file is written beside it and renamed over it; an object is replaced whole."""
  if is_remote(path):
    as_path(path).write_bytes(data)
    return
  path = normalize(path)
  temporary = f'{path}.tmp-{os.getpid()}'
  with open(temporary, 'wb') as f:
    f.write(data)
  os.replace(temporary, path)


def write_text(path, text: str) -> None:
  """Write ``text`` (UTF-8) to ``path`` whole (see :func:`write_bytes`)."""
  write_bytes(path, text.encode())


def append_bytes(path, data: bytes) -> None:
  """Add ``data`` at the end of file ``path`` (created if missing; on an object store the
  object is read and written again)."""
  if is_remote(path):
    old = read_bytes(path) if exists(path) else b''
    as_path(path).write_bytes(old + data)
    return
  with open(normalize(path), 'ab') as f:
    f.write(data)


def open_file(path, mode: str = 'r'):
  """``open(path, mode)`` for a local path or a URL (no append modes on a URL: see
  :class:`AppendFile`)."""
  if is_remote(path):
    if 'a' in mode or '+' in mode:
      raise ValueError(f'{path}: an object store cannot append or update in place '
                       f'(mode {mode!r}).')
    return as_path(path).open(mode)
  return open(normalize(path), mode)


class AppendFile:
  """A file written by appending, flushed as it goes.

  A local file is the operating system's file opened for appending, flushed at every
  :meth:`flush`. An object store has no append: the file's content (what was there plus what
  was written) is kept in memory and the object is rewritten by :meth:`flush` at most every
  ``upload_every`` seconds, and by :meth:`close`, so a crash loses at most that much.

  Args:
    path: a local path or a URL.
    binary: write ``bytes`` (else ``str``).
    upload_every: seconds between two uploads of a remote file.
  """

  def __init__(self, path, *, binary: bool = False, upload_every: float = 10.0):
    self.path = normalize(path)
    self.binary = binary
    self.upload_every = upload_every
    self.remote = is_remote(self.path)
    self._file = None
    if self.remote:
      self._content = bytearray(read_bytes(self.path) if exists(self.path) else b'')
      self._pending, self._uploaded = False, -float('inf')
    else:
      self._file = open(self.path, 'ab' if binary else 'a')  # noqa: SIM115 (closed in close())

  def write(self, data) -> None:
    """Append ``data`` (``bytes`` when binary, else ``str``)."""
    if not self.remote:
      self._file.write(data)
      return
    self._content += data if self.binary else data.encode()
    self._pending = True

  def flush(self, force: bool = False) -> None:
    """Push what was written: a local file at once; a remote one when ``upload_every``
    seconds have passed since its last upload (or ``force``)."""
    if not self.remote:
      self._file.flush()
      return
    if self._pending and (force or time.monotonic() - self._uploaded >= self.upload_every):
      as_path(self.path).write_bytes(bytes(self._content))
      self._pending, self._uploaded = False, time.monotonic()

  def close(self) -> None:
    """Flush everything and close."""
    if self.remote:
      self.flush(force=True)
    elif self._file is not None:
      self._file.close()
      self._file = None


# -- local <-> remote ------------------------------------------------------------------------------

def copy_tree_to(local_dir: str, target, *, last: Iterable[str] = ()) -> None:
  """Copy the files under local directory ``local_dir`` into ``target`` (a local path or a
  URL), sub-directories included; files whose name is in ``last`` are copied after the others
  (a reader that waits for ``config.json`` then finds the rest)."""
  last = set(last)
  files = []
  for root, _, names in os.walk(local_dir):
    for name in names:
      files.append(os.path.relpath(os.path.join(root, name), local_dir))
  files.sort(key=lambda rel: (os.path.basename(rel) in last, rel))
  for rel in files:
    destination = join(target, *rel.split(os.sep))
    makedirs(parent(destination))
    if is_remote(destination):
      as_path(destination).write_bytes(read_bytes(os.path.join(local_dir, rel)))
    else:
      shutil.copyfile(os.path.join(local_dir, rel), destination)


def write_dir(target, write: Callable[[str], object], *, last: Iterable[str] = ()) -> None:
  """Have ``write(directory)`` create and fill a local directory, then put it at ``target``,
  replacing what is there.

  Local: ``write`` fills ``<target>.tmp``, which is renamed to ``target``, so the directory
  appears whole or not at all. A URL: ``write`` fills a local scratch directory whose files are
  uploaded to ``target`` after the old one is deleted, the files named in ``last`` at the end.
  """
  target = normalize(target)
  if is_remote(target):
    with tempfile.TemporaryDirectory() as scratch:
      staged = os.path.join(scratch, basename(target) or 'dir')
      write(staged)
      rmtree(target, missing_ok=True)
      copy_tree_to(staged, target, last=last)
    return
  staged = target + '.tmp'
  shutil.rmtree(staged, ignore_errors=True)
  write(staged)
  if os.path.exists(target):
    shutil.rmtree(target)
  os.rename(staged, target)


_SCRATCH: list[str] = []


def scratch_dir() -> str:
  """A local directory of this process for downloaded and staged files, deleted at exit."""
  if not _SCRATCH:
    _SCRATCH.append(tempfile.mkdtemp(prefix='maxnnx-'))
    atexit.register(shutil.rmtree, _SCRATCH[0], ignore_errors=True)
  return _SCRATCH[0]


def local_copy(path) -> str:
  """A local path holding file or directory ``path``: ``path`` itself when it is local, else
  a copy downloaded into :func:`scratch_dir` (a fresh one at every call)."""
  if not is_remote(path):
    return normalize(path)
  target = tempfile.mkdtemp(dir=scratch_dir())
  target = os.path.join(target, basename(path) or 'download')
  _download(normalize(path), target)
  return target


def _download(source: str, target: str) -> None:
  if not isdir(source):
    with open(target, 'wb') as f:
      f.write(read_bytes(source))
    return
  os.makedirs(target, exist_ok=True)
  for name in listdir(source):
    _download(join(source, name), os.path.join(target, name))


# -- model directories at any fsspec URL ----------------------------------------------------------

#: What a model directory's download keeps: configs, safetensors, tokenizers and templates.
#: Pickle weights (``*.bin``, ``*.pt``), GGUF and other formats are never read, so never fetched.
MODEL_FILE_SUFFIXES = ('.json', '.safetensors', '.model', '.jinja', '.txt', '.tiktoken')

_MODEL_COPIES: dict[str, str] = {}


def local_model_dir(path) -> str:
  """A local directory holding the model directory ``path``: ``path`` itself when local, else
  (``s3://``, ``gs://``, ``hf://org/name``, ``https://``, any fsspec URL) a copy of its files
  that a checkpoint uses (:data:`MODEL_FILE_SUFFIXES`, top level only), downloaded once per
  process into :func:`scratch_dir` and reused by later calls.

  Raises:
    FileNotFoundError: nothing at ``path``, or no file a checkpoint uses (one line naming it).
    PermissionError, ValueError: a denied read or a missing fsspec backend (naming the URL).
  """
  if not is_remote(path):
    return normalize(path)
  url = str(path).rstrip('/')
  if url in _MODEL_COPIES:
    return _MODEL_COPIES[url]
  fs, inner = data_filesystem(url)
  entries = retrying(lambda: fs.ls(inner, detail=True), url)
  names = sorted(posixpath.basename(e['name'].rstrip('/')) for e in entries
                 if e.get('type') != 'directory')
  wanted = [n for n in names if n.endswith(MODEL_FILE_SUFFIXES)]
  if not wanted:
    raise FileNotFoundError(f'{url}: no model files there (config.json, *.safetensors, '
                            'tokenizer files).')
  target = os.path.join(tempfile.mkdtemp(dir=scratch_dir()), posixpath.basename(inner) or 'model')
  os.makedirs(target)
  for name in wanted:
    retrying(lambda name=name: fs.get_file(posixpath.join(inner, name),
                                           os.path.join(target, name)), f'{url}/{name}')
  _MODEL_COPIES[url] = target
  return target


# -- data at any fsspec URL -----------------------------------------------------------------------

# The package that serves a URL scheme through fsspec, and the maxnnx extra that installs it.
_BACKENDS = {'gs': ('gcsfs', 'gcs'), 'gcs': ('gcsfs', 'gcs'), 's3': ('s3fs', 's3'),
             's3a': ('s3fs', 's3'), 'az': ('adlfs', 'azure'), 'abfs': ('adlfs', 'azure'),
             'http': ('aiohttp', 'http'), 'https': ('aiohttp', 'http'),
             'hf': ('huggingface_hub', 'hf')}


def data_filesystem(url: str):
  """``(fsspec filesystem, path within it)`` for a data URL such as ``s3://bucket/shards``.

  ``s3://`` honours the standard AWS variables (``AWS_ENDPOINT_URL`` for S3-compatible
  stores, credentials), which s3fs reads itself.

  Raises:
    ValueError: the URL's backend is not installed (naming the package and maxnnx extra), or
      fsspec knows no such scheme.
  """
  import fsspec  # noqa: PLC0415
  scheme = _scheme(url) or 'file'
  try:
    return fsspec.core.url_to_fs(url)
  except ImportError:
    package, extra = _BACKENDS.get(scheme, (None, None))
    how = (f"pip install {package} (the maxnnx[{extra}] extra)" if package
           else 'install the fsspec backend for it')
    raise ValueError(f'{url}: reading {scheme}:// URLs needs {package or "a backend"}; '
                     f'{how}.') from None
  except ValueError as e:  # fsspec: "Protocol not known"
    raise ValueError(f'{url}: fsspec knows no {scheme}:// filesystem ({e}).') from None


# Tries of a remote data read, and the seconds slept before each retry (doubling).
DATA_READ_TRIES = 4
DATA_RETRY_DELAY_S = 0.5
_TRANSIENT_NAMES = re.compile(r'Timeout|Connection|Disconnect|Throttl|SlowDown|ServiceUnavailable'
                              r'|TooManyRequests|ServerError|IncompleteRead|ResponsePayload')


def is_transient(error: BaseException) -> bool:
  """Whether a failed read of an object store may succeed if tried again: a timeout, a lost
  or refused connection, throttling or a server error (by type, or by the class names the
  backends give them), but never a missing object, a denied one or a bad argument."""
  for e in exception_chain(error):
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError,
                      NotADirectoryError, ValueError, TypeError)):
      return False
    if isinstance(e, (TimeoutError, ConnectionError)) or _TRANSIENT_NAMES.search(
        type(e).__name__):
      return True
  return False


def retrying(read: Callable[[], object], url: str, *, tries: int | None = None):
  """``read()``, tried again after a transient failure (:func:`is_transient`) up to ``tries``
  times in all (default :data:`DATA_READ_TRIES`), sleeping :data:`DATA_RETRY_DELAY_S`, then
  twice that, between tries; a last or lasting failure is :func:`data_error`'s one line
  naming ``url``. A ``ValueError`` (what a reader raises for bad content) passes unchanged."""
  tries = tries or DATA_READ_TRIES
  for attempt in range(tries):
    try:
      return read()
    except ValueError:  # a content error of the caller's own, already naming the file
      raise
    except Exception as e:  # each backend raises its own errors
      if attempt + 1 == tries or not is_transient(e):
        error = data_error(url, e)
        if attempt:
          error = type(error)(f'{error} (after {attempt + 1} tries)')
        raise error from None
      time.sleep(DATA_RETRY_DELAY_S * 2**attempt)
  raise AssertionError('unreachable')


def exception_chain(error: BaseException | None) -> list[BaseException]:
  """``error`` and the exceptions it was raised from or while handling, outermost first."""
  chain: list[BaseException] = []
  while error is not None and all(error is not e for e in chain):
    chain.append(error)
    error = error.__cause__ or error.__context__
  return chain


def os_error_in(error: BaseException) -> OSError | None:
  """The ``OSError`` that ``error`` is or was raised from, if any: what a library's own
  exception hides when the file system refused a read or a write."""
  return next((e for e in exception_chain(error) if isinstance(e, OSError)), None)


def data_error(url: str, error: Exception) -> Exception:
  """The one-line error for a failed read of ``url``: a ``FileNotFoundError`` for a missing
  object, a ``PermissionError`` for a denied one, else a ``ValueError`` naming the cause."""
  if isinstance(error, FileNotFoundError):
    return FileNotFoundError(f'{url}: no such object.')
  if isinstance(error, PermissionError):
    return PermissionError(f'{url}: access denied ({error}); check the credentials this '
                           'process reads (environment, instance role).')
  return ValueError(f'{url}: cannot read it ({type(error).__name__}: '
                    f'{str(error).splitlines()[0] if str(error) else "no detail"}).')


def read_data_bytes(path: str) -> bytes:
  """The bytes of data file ``path``: a local path, a ``file://`` URL, or any fsspec URL.

  Raises:
    FileNotFoundError, PermissionError, ValueError: one line naming ``path``.
  """
  if not is_remote(path):
    with open(normalize(path), 'rb') as f:
      return f.read()
  fs, inner = data_filesystem(path)
  return retrying(lambda: fs.cat_file(inner), path)


def download_data_file(url: str) -> str:
  """A local copy of data file ``url`` in :func:`scratch_dir` (for readers of local files only,
  such as ArrayRecord's); the local path."""
  fs, inner = data_filesystem(url)
  target = os.path.join(tempfile.mkdtemp(dir=scratch_dir()), posixpath.basename(inner))
  retrying(lambda: fs.get_file(inner, target), url)
  return target


__all__ = ['REMOTE_SCHEMES', 'AppendFile', 'absolute', 'append_bytes', 'as_path', 'basename',
           'copy_tree_to', 'data_error', 'data_filesystem', 'download_data_file', 'exists',
           'is_transient', 'retrying',
           'is_remote', 'isdir', 'isfile', 'join', 'listdir', 'local_copy', 'makedirs',
           'normalize', 'open_file', 'parent', 'read_bytes', 'read_data_bytes', 'read_text',
           'remove', 'rename', 'rmtree', 'scratch_dir', 'write_bytes', 'write_dir', 'write_text']
