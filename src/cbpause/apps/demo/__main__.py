"""``python -m cbpause.apps.demo [--rl | --trl]``."""

import sys

from . import main

sys.exit(main())
