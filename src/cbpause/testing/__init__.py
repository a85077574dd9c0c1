"""``cbpause.testing``: what the tests, the benchmark, the soak and the demo share (as ``trio.testing`` serves
trio's users).

Standard library only, importable without torch:

* :class:`Interrupter` and :func:`call_interrupted` -- real SIGINTs for a wait on the main thread;
* :func:`run_thread`, :func:`enter_and_leave`, ``HANG_S`` and ``JOIN_TIMEOUT`` -- threads joined with a bound that
  only catches a hang;
* :class:`FakeLoop` (transformers' loop reduced to its calls into the status object) and :class:`Group` (a TP
  group in one process, on the explicit loop API), :func:`end_leftover_loops`;
* :class:`StepGate`, :func:`wait_for_phase`, :func:`wait_for_queued`: hold the loop at one of its steps, or fail it
  there; wait for a phase, or for a holder queued at a closing window;
* :class:`Traffic` and its :class:`Ledger`: requests flowing through a manager, each output counted;
* :class:`Watchdog`: fails a long run (the soak) when an operation or the requests make no progress within a bound;
* :func:`percentile`, :func:`free_port`;
* :mod:`cbpause.testing.forks`: ``python -m module`` as a child of a fork server that imported torch, transformers
  and the server once (the TP ranks and the ``cbpause serve`` processes of the tests, the soak and the bench).

With the ``transformers`` extra (imported on first use): the tiny random Llama and its configs
(:func:`tiny_llama`, :func:`tiny_llama_config`, :func:`greedy_config`, :func:`greedy_reference`,
:func:`batching_config`, :func:`cache_blocks`, :func:`random_sampling`),
the :class:`ForwardProbe` forward pre-hook, :func:`probed` and
:func:`pending_pause`; and for tensor parallelism in worker processes :func:`join_tp_group`, :func:`load_tp_model`,
:func:`spawn_ranks`.
"""

from __future__ import annotations

import importlib
from typing import Any

from .gates import StepGate, wait_for_phase, wait_for_queued
from .loops import FakeLoop, Group, end_leftover_loops
from .signals import Interrupter, call_interrupted
from .stats import percentile
from .threads import HANG_S, JOIN_TIMEOUT, enter_and_leave, run_thread
from .tp import free_port
from .traffic import Ledger, Traffic
from .watchdog import Watchdog

_LAZY = {
    "ForwardProbe": "llama", "PAGE_SIZE": "llama", "batching_config": "llama", "cache_blocks": "llama",
    "greedy_config": "llama", "greedy_reference": "llama", "pending_pause": "llama", "probed": "llama",
    "random_sampling": "llama", "tiny_llama": "llama", "tiny_llama_config": "llama",
    "join_tp_group": "tp", "load_tp_model": "tp", "spawn_ranks": "tp",
}  # fmt: skip

__all__ = [
    "HANG_S", "JOIN_TIMEOUT", "FakeLoop", "Group", "Interrupter", "StepGate", "call_interrupted", "end_leftover_loops",
    "Ledger", "Traffic", "Watchdog", "enter_and_leave", "free_port", "percentile", "run_thread", "wait_for_phase",
    "wait_for_queued",
    *_LAZY,
]  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
