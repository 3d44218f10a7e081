"""The README and docs stay scannable and their references resolve.

The README's tables hold one short line per cell (the evidence lives in ``docs/status.md``),
and every relative link, and every repository path written in backticks, in ``README.md`` and
``docs/*.md`` names a file that exists, down to the heading a ``#fragment`` points at.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_CELL_CHARS = 250
DOCS = [ROOT / 'README.md', *sorted((ROOT / 'docs').glob('*.md'))]
# Top-level folders whose files the docs cite by path in backticks.
CITED_ROOTS = ('tests/', 'notebooks/', 'tutorials/', 'benchmarks/', 'docs/', 'maxnnx/', '.ci/')

_FENCE = re.compile(r'^(```|~~~).*?^\1', re.M | re.S)
_LINK = re.compile(r'!?\[[^\]]*\]\(([^)\s]+)\)')
_CODE_PATH = re.compile(r'`([\w./*-]+\.\w+)`')


def _prose(text: str) -> str:
  """``text`` without its fenced code blocks (their brackets are code, not links)."""
  return _FENCE.sub('', text)


def table_cells(text: str) -> list[str]:
  """Every cell of every Markdown table in ``text``, header rows included.

  Args:
    text: Markdown source.

  Returns:
    The stripped cell texts; ``\\|`` inside a cell does not split it.
  """
  cells = []
  for line in _prose(text).splitlines():
    line = line.strip()
    if not line.startswith('|'):
      continue
    row = [c.strip() for c in re.split(r'(?<!\\)\|', line.strip('|'))]
    if all(re.fullmatch(r':?-+:?', c) for c in row):  # the |---|---| separator
      continue
    cells.extend(row)
  return cells


def heading_anchors(text: str) -> set[str]:
  """The anchors GitHub gives the headings of ``text`` (``## Two words`` -> ``two-words``).

  Args:
    text: Markdown source.

  Returns:
    The anchor of each heading; a repeated heading gets ``-1``, ``-2``… as on GitHub.
  """
  anchors, seen = set(), {}
  for line in _prose(text).splitlines():
    match = re.match(r'#{1,6}\s+(.*?)\s*#*\s*$', line)
    if not match:
      continue
    slug = re.sub(r'[^\w\- ]', '', match.group(1).lower()).replace(' ', '-')
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    anchors.add(slug if count == 0 else f'{slug}-{count}')
  return anchors


def broken_links(path: pathlib.Path) -> list[str]:
  """The relative links of the Markdown file ``path`` whose file or heading does not exist.

  Args:
    path: a Markdown file in the repository.

  Returns:
    One ``'target (why)'`` string per broken link.
  """
  text = path.read_text(encoding='utf-8')
  broken = []
  for target in _LINK.findall(_prose(text)):
    if re.match(r'[a-z][a-z0-9+.-]*:', target):  # http:, https:, mailto:
      continue
    file_part, _, fragment = target.partition('#')
    linked = (path.parent / file_part).resolve() if file_part else path
    if not linked.exists():
      broken.append(f'{target} (no such file)')
    elif fragment and linked.suffix == '.md' and fragment not in heading_anchors(
        linked.read_text(encoding='utf-8')):
      broken.append(f'{target} (no heading #{fragment} in {linked.name})')
  return broken


def missing_cited_paths(path: pathlib.Path) -> list[str]:
  """Repository paths written in backticks in ``path`` (``tests/test_x.py``) that match no file.

  Args:
    path: a Markdown file in the repository.

  Returns:
    The cited paths (globs allowed) under :data:`CITED_ROOTS` that name nothing.
  """
  text = path.read_text(encoding='utf-8')
  cited = {p for p in _CODE_PATH.findall(text) if p.startswith(CITED_ROOTS)}
  return sorted(p for p in cited if not any(ROOT.glob(p)))


def test_table_cells_are_found_and_measured():
  text = '| a | b |\n|---|:-:|\n| one | `x \\| y` |\n\n```\n| in | code |\n```\n'
  assert table_cells(text) == ['a', 'b', 'one', '`x \\| y`']


def test_readme_table_cells_are_short():
  cells = table_cells((ROOT / 'README.md').read_text(encoding='utf-8'))
  assert cells, 'README.md has no table'
  long_cells = [f'{len(c)} chars: {c[:80]}...' for c in cells if len(c) > MAX_CELL_CHARS]
  assert not long_cells, (f'README table cells over {MAX_CELL_CHARS} characters; move the detail '
                          'to docs/status.md:\n' + '\n'.join(long_cells))


def test_anchors_follow_github():
  anchors = heading_anchors('# Top\n## Multi-token prediction\n## Runs: `x` & y\n## Top\n')
  assert anchors == {'top', 'multi-token-prediction', 'runs-x--y', 'top-1'}


def test_a_broken_link_is_reported(tmp_path):
  (tmp_path / 'there.md').write_text('# Here\n')
  doc = tmp_path / 'doc.md'
  doc.write_text('[a](there.md#here) [b](gone.md) [c](there.md#nowhere) [d](https://x.org/y)\n')
  assert broken_links(doc) == ['gone.md (no such file)',
                               'there.md#nowhere (no heading #nowhere in there.md)']


@pytest.mark.parametrize('doc', DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc):
  assert not broken_links(doc), f'{doc.relative_to(ROOT)}: broken links {broken_links(doc)}'


@pytest.mark.parametrize('doc', DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_cited_paths_exist(doc):
  missing = missing_cited_paths(doc)
  assert not missing, f'{doc.relative_to(ROOT)} cites files that do not exist: {missing}'
