"""``python -m specattn.demo``: same as ``specattn demo``."""

import sys

from .cli import cli_main

sys.exit(cli_main())
