"""``python -m specattn``: the same command as ``specattn``."""

import sys

from .cli import main

sys.exit(main())
