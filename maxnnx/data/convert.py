"""Convert text / JSONL / Parquet documents into ArrayRecord files.

ArrayRecord gives grain random access to one record per document without
holding the corpus in memory, which is what large corpora need. Records are
UTF-8 text, or, with a tokenizer, the document's token ids as little-endian
int32 (read them back with ``DataConfig(pretokenized=True)``; BOS/EOS are not
stored: the pipeline adds them).

From the shell::

  python -m maxnnx.data.convert corpus.jsonl --output data/corpus.array_record
  python -m maxnnx.data.convert 'web/*.parquet' --output data/web.array_record \\
      --tokenizer tokenizer.json --shards 8
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import numpy as np

from maxnnx.data.sources import InMemorySource, resolve_source
from maxnnx.data.tokenizer import load_tokenizer


def shard_paths(output: str, num_shards: int) -> list[str]:
  """``output`` itself for one shard, else ``output-00000-of-0000N`` names."""
  if num_shards == 1:
    return [output]
  return [f'{output}-{i:05d}-of-{num_shards:05d}' for i in range(num_shards)]


def convert_to_array_record(sources: str | Sequence[str], output: str, *, kind: str = 'auto',
                            column: str = 'text', text_split: str = 'blank_lines',
                            pretokenized: bool = False, tokenizer=None,
                            num_shards: int = 1) -> dict:
  """Write the documents of ``sources`` to ArrayRecord file(s) at ``output``.

  Args:
    sources: source specs (files, directories, globs) of text, JSONL or Parquet data.
    output: the ArrayRecord path (with ``-0000i-of-0000N`` suffixes when sharded).
    kind, column, text_split, pretokenized: how to read the sources (as in
      :class:`~maxnnx.data.DataConfig`).
    tokenizer: a tokenizer or its path: store int32 token ids instead of text.
    num_shards: files to spread the documents over, round-robin.

  Returns:
    ``{'files': [...], 'documents': N, 'format': 'text' | 'int32'}``.
  """
  from array_record.python.array_record_module import ArrayRecordWriter
  if num_shards < 1:
    raise ValueError(f'num_shards must be >= 1, got {num_shards}.')
  if isinstance(tokenizer, str):
    tokenizer = load_tokenizer(tokenizer)
  specs = [sources] if isinstance(sources, str) else list(sources)
  docs = []
  for spec in specs:
    resolved = resolve_source(spec, kind)
    if resolved.kind not in ('text', 'jsonl', 'parquet'):
      raise ValueError(f'{spec!r} is {resolved.kind} data; convert reads text, JSONL or '
                       'Parquet files.')
    docs.append(InMemorySource(resolved.files, resolved.kind, column=column,
                               pretokenized=pretokenized, text_split=text_split))
  as_ids = pretokenized or tokenizer is not None
  paths = shard_paths(output, num_shards)
  os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
  writers = [ArrayRecordWriter(p, 'group_size:1') for p in paths]
  count = 0
  try:
    for source in docs:
      for i in range(len(source)):
        doc = source[i]
        if isinstance(doc, str) and tokenizer is not None:
          doc = tokenizer.encode(doc)
        record = (np.asarray(doc, '<i4').tobytes() if as_ids else doc.encode('utf-8'))
        writers[count % num_shards].write(record)
        count += 1
  finally:
    for writer in writers:
      writer.close()
  return {'files': paths, 'documents': count, 'format': 'int32' if as_ids else 'text'}


def main(argv: list[str] | None = None) -> int:
  """``python -m maxnnx.data.convert SOURCE... --output PATH [options]``."""
  parser = argparse.ArgumentParser(
      prog='python -m maxnnx.data.convert',
      description='Convert text / JSONL / Parquet documents into ArrayRecord files.')
  parser.add_argument('sources', nargs='+', help='files, directories or globs')
  parser.add_argument('--output', required=True, help='ArrayRecord path to write')
  parser.add_argument('--kind', default='auto', choices=['auto', 'text', 'jsonl', 'parquet'])
  parser.add_argument('--column', default='text', help='JSONL/Parquet field of the document')
  parser.add_argument('--text-split', default='blank_lines',
                      choices=['blank_lines', 'lines', 'file'],
                      help='what one document of a .txt file is')
  parser.add_argument('--pretokenized', action='store_true',
                      help='the column holds token ids; store them as int32')
  parser.add_argument('--tokenizer', default=None, help='store token ids of this tokenizer')
  parser.add_argument('--shards', type=int, default=1, help='number of output files')
  args = parser.parse_args(argv)
  try:
    result = convert_to_array_record(args.sources, args.output, kind=args.kind,
                                     column=args.column, text_split=args.text_split,
                                     pretokenized=args.pretokenized, tokenizer=args.tokenizer,
                                     num_shards=args.shards)
  except (ValueError, FileNotFoundError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  print(f"Wrote {result['documents']:,} documents ({result['format']}) to "
        f"{', '.join(result['files'])}.")
  return 0


if __name__ == '__main__':
  sys.exit(main())
