"""``python -m cbpause.apps.hostile``."""

import sys

from . import main

sys.exit(main())
