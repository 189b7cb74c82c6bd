"""``python -m hiso``: the ``hiso`` command."""

import sys

from .cli import main

sys.exit(main())
