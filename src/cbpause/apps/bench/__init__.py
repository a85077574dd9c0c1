"""``python -m cbpause.apps.bench``: cbpause against transformers 5.23.0's own pause, side by side.

Every case runs for upstream (transformers' ``ContinuousBatchingManager`` with its
``BackgroundThreadStatus``) and for cbpause (``cbpause.integrations.transformers``), interleaved, on the
same model in the same process, for several repetitions.  On a shared machine absolute times are noisy;
the ratio within one run is the figure that counts.  ``ratio`` is always cbpause's cost over upstream's
(a time over a time, or upstream's rate over cbpause's): below 1.00 cbpause is cheaper.

Prints one table, writes it as JSON (``bench.json``) and Markdown (``bench.md``) and draws the latency
distributions (``bench.png``) and case 10's scaling (``scaling.png``, with matplotlib if installed) into
``--out``.  ``--quick`` finishes in under three minutes on two cores.

The package: :mod:`~cbpause.apps.bench.harness` (rows, table, the model and managers), :mod:`~cbpause.apps.bench.cases`
(cases 1-6 and 8), :mod:`~cbpause.apps.bench.tp` (case 7, TP worker processes and the entry's split),
:mod:`~cbpause.apps.bench.mode_cases` (case 9), :mod:`~cbpause.apps.bench.scaling` (case 10),
:mod:`~cbpause.apps.bench.plot`,
:mod:`~cbpause.apps.bench.run` (the command line), :mod:`~cbpause.apps.bench.gpu` (the GPU check).
"""

from .harness import IMPLS, Bench, Row, format_table
from .run import CASES, main, parse_args

__all__ = ["CASES", "IMPLS", "Bench", "Row", "format_table", "main", "parse_args"]
