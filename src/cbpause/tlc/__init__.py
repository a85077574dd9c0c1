"""Everything that runs TLC: model checking, the state-graph comparison and trace validation.

* :mod:`~cbpause.tlc.launcher` -- the one TLC launcher (``run_tlc``, modes ``check``, ``graph``, ``trace``)
  and the reading of TLC's output;
* :mod:`~cbpause.tlc.manifest` -- ``tla/models.toml`` and the one reader of ``.cfg`` files;
* :mod:`~cbpause.tlc.models` -- checking the models of the manifest (``python -m cbpause.tlc``);
* :mod:`~cbpause.tlc.conformance` -- the pure transitions and the TLA+ spec have the same state graph;
* :mod:`~cbpause.tlc.traces` -- traces recorded from ``PauseProtocol`` are behaviours of the spec;
* :mod:`~cbpause.tlc.tla` -- what the TLA+ modules define, read from their text.

This package reads the core (:mod:`cbpause.core.transitions`, :mod:`cbpause.core.group`,
:mod:`cbpause.core.recorder`) and ``tla/``; the core never imports it.  (The docs' pictures drawn from TLC's output
are an application: :mod:`cbpause.apps.diagrams`.)
"""

from .launcher import RUN_MODES, TLCError, TLCRun, classify, find_jar, find_java, format_trace, parse_trace, run_tlc
from .manifest import SUITES, Cfg, Model, default_tla_dir, load_manifest, select
from .models import Result, format_table, main, run_model

__all__ = [
    "RUN_MODES", "SUITES", "Cfg", "Model", "Result", "TLCError", "TLCRun", "classify", "default_tla_dir", "find_jar",
    "find_java", "format_table", "format_trace", "load_manifest", "main", "parse_trace", "run_model", "run_tlc",
    "select",
]  # fmt: skip
