"""``python -m maxnnx``: see :mod:`maxnnx.cli`."""

import sys

from maxnnx.cli import main

sys.exit(main())
