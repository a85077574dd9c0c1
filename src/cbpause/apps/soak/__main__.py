"""``python -m cbpause.apps.soak``."""

import sys

from .run import main

sys.exit(main())
