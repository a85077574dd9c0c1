"""``python -m cbpause.bench`` (see :mod:`cbpause.bench`)."""

import sys

from .run import main

sys.exit(main())
