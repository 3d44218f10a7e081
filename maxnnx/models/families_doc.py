"""``docs/families.md``, generated from the family specs so that it cannot drift.

Regenerate it after adding or changing a family::

  python -m maxnnx.models.families_doc > docs/families.md

``tests/test_families.py`` fails while the committed file differs from
:func:`families_markdown`.
"""

from __future__ import annotations

from maxnnx.models.registry import FamilySpec, specs
from maxnnx.presets import MAXTEXT_ALIASES

REGENERATE = 'python -m maxnnx.models.families_doc > docs/families.md'


def _code(items) -> str:
  return ', '.join(f'`{item}`' for item in items)


def _differences(spec: FamilySpec) -> str:
  flat = spec.flat_differences()
  if not flat:
    return '(the baseline)' if spec.name == 'llama' else 'none in `ModelConfig`'
  return _code(f'{key}={value!r}' for key, value in flat.items())


def families_markdown() -> str:
  """The text of ``docs/families.md``: per family, its Hugging Face ``model_type``
  values, the :class:`~maxnnx.config.ModelConfig` fields it sets away from the Llama
  baseline (the defaults), and its presets; then MaxText's names for presets."""
  found = specs()
  order = sorted(found, key=lambda name: (name != 'llama', name))
  lines = [
      '# Model families',
      '',
      f'<!-- Generated from the family specs by `{REGENERATE}`; do not edit. -->',
      '',
      "Every family is Llama (the `ModelConfig` defaults) plus a few fields. Each family "
      'module `maxnnx/models/<family>.py` declares them in its `SPEC`, together with its '
      'Hugging Face mapping and its presets; see [adding_a_family.md](adding_a_family.md). '
      'A preset sets the sizes (widths, depths, vocabulary, context, rotary base) on top of '
      'these fields.',
      '',
      '| Family | Hugging Face `model_type` | Differs from Llama | Presets |',
      '|---|---|---|---|',
  ]
  for name in order:
    spec = found[name]
    lines.append(f'| `{name}` | {_code(spec.hf.model_types)} | {_differences(spec)} | '
                 f'{_code(spec.presets)} |')
  lines += ['', '## Notes', '']
  for name in order:
    spec = found[name]
    lines.append(f'- `{name}` (`{spec.hf.architecture}`, `maxnnx/models/{name}.py`): '
                 f'{spec.description}')
  lines += ['', "## MaxText's model names", '',
            "`maxnnx.get_preset` also takes MaxText's name for a preset of the same "
            'architecture (`maxnnx.presets.MAXTEXT_ALIASES`):', '',
            '| MaxText name | Preset |', '|---|---|']
  lines += [f'| `{alias}` | `{target}` |' for alias, target in sorted(MAXTEXT_ALIASES.items())]
  return '\n'.join(lines) + '\n'


if __name__ == '__main__':
  print(families_markdown(), end='')
