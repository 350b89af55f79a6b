"""``python -m hpo``: the same as the ``hpo`` command."""
from __future__ import annotations

import sys

from hpo.cli import main

sys.exit(main())
