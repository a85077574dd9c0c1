"""``python -m cbpause.tlc``: model-check the models of ``tla/models.toml`` (see :mod:`cbpause.tlc.models`)."""

import sys

from .models import main

sys.exit(main())
