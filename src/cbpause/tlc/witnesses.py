"""A model's witnesses, observed in the model's own run: one exploration of its state space, not one per witness.

A witness is a property that must fail on a model's constants (``NeverInsideWitness``: a holder does get inside),
to show that the model is not vacuous.  Checking each as the only invariant of a run of its own explores the state
space once per witness (41 runs for the fast models).  Instead, the run of the model itself carries an *observer*
per witness: a wrapper module (:func:`observer_module`) that EXTENDS the model's module and adds a state
``CONSTRAINT`` and an ``ACTION_CONSTRAINT`` that are always ``TRUE`` (so TLC explores exactly the same graph:
the counts stay the manifest's) and that print one line the first time a state, or a step, breaks a witness::

    <<"cbpause-witness", "NeverInsideWitness">>

Each worker remembers what it printed in a TLC register (``TLCSet``/``TLCGet``: per worker, all set to 0 by an
``ASSUME``, which runs before the workers start), so a witness prints once per worker, not once per state.  A
witness of a state is the negation of an invariant (``NeverXWitness``: observed where it is ``FALSE``); a witness of
a step is written ``NeverXWitness == [][~XStep]_vars`` (observed on a step where ``XStep`` holds and ``vars``
changes: ``[][~XStep]_vars`` allows a stuttering ``XStep`` step, and TLC does generate such steps, an action like
``Terminated`` that leaves every variable as it is).  :func:`found` reads the lines back.
"""

from __future__ import annotations

import re

from .launcher import TLCError

__all__ = ["MARKER", "OBSERVER", "found", "observer_cfg", "observer_module", "step_of"]

OBSERVER = "CbpauseObserved"  # the wrapper module's name, written into the run's own copy of tla/
MARKER = "cbpause-witness"
_FOUND = re.compile(r'^<<"' + MARKER + r'", "(\w+)">>$', re.MULTILINE)


def step_of(witness: str, module_text: str) -> str:
    """The step an action witness must see: ``XStep`` for ``NeverXWitness == [][~XStep]_vars`` (``TLCError`` when
    the definition has another form, which an observer could not read)."""
    m = re.search(rf"^{witness}\s*==\s*\[\]\[~(\w+)\]_vars\s*$", module_text, re.MULTILINE)
    if m is None:
        raise TLCError(f"the action witness {witness} must be written `{witness} == [][~XStep]_vars`")
    return m.group(1)


def observer_module(module: str, witnesses: list[tuple[str, str]], module_text: str) -> str:
    """The wrapper module: ``module`` with one observer per witness, each ``(kind, name)`` with ``kind``
    ``"invariant"`` or ``"action-property"`` (``module_text`` is the text that defines the action witnesses)."""
    lines = [
        f"---- MODULE {OBSERVER} ----",
        f"EXTENDS {module}, TLC",
        "\\* Written by cbpause.tlc.witnesses for one run: each conjunct is TRUE; it prints once per worker.",
        f'CbpauseSeen(i, name) == IF TLCGet(i) = 0 THEN TLCSet(i, 1) /\\ PrintT(<<"{MARKER}", name>>) ELSE TRUE',
        "ASSUME " + " /\\ ".join(f"TLCSet({i}, 0)" for i in range(1, len(witnesses) + 1)),
    ]
    states, steps = [], []
    for i, (kind, name) in enumerate(witnesses, start=1):
        if kind == "invariant":
            states.append(f'(~{name} => CbpauseSeen({i}, "{name}"))')
        elif kind == "action-property":
            # [][~XStep]_vars fails only on a step that changes vars: a stuttering XStep step breaks nothing.
            steps.append(f'(({step_of(name, module_text)} /\\ vars\' # vars) => CbpauseSeen({i}, "{name}"))')
        else:
            raise TLCError(f"a witness is an invariant or an action property, not {kind!r}")
    lines.append("CbpauseObserveState == " + " /\\ ".join(states or ["TRUE"]))
    lines.append("CbpauseObserveStep == " + " /\\ ".join(steps or ["TRUE"]))
    lines.append("====")
    return "\n".join(lines) + "\n"


def observer_cfg(cfg_text: str) -> str:
    """The model's cfg with the observers as its constraints."""
    return cfg_text.rstrip("\n") + "\nCONSTRAINT\n    CbpauseObserveState\nACTION_CONSTRAINT\n    CbpauseObserveStep\n"


def found(output: str) -> set[str]:
    """The witnesses a run with observers saw broken."""
    return set(_FOUND.findall(output))
