"""``python -m cbpause.apps.bench`` (see :mod:`cbpause.apps.bench`)."""

import sys

from .run import main

sys.exit(main())
