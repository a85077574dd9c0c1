"""``python -m cbpause.apps.demo [--rl]``."""

import sys

from . import main

sys.exit(main())
