"""What the TLA+ modules of ``tla/`` define, read from their text (for the tests that tie the layers).

One reader, so that the tests that compare the TLA+ with ``spec/PROTOCOL.md``, with the Python transitions
and with the Hypothesis state machine all agree on what "an action of Next" is.
"""

from __future__ import annotations

import re

__all__ = ["checked_definitions", "definitions", "next_actions", "variables"]

# Operators of Next that group actions rather than being one.
_GROUPS = {"LoopAction", "HolderWakes", "SystemNext", "SystemNextWithoutRecovery", "EnvironmentNext"}
# Actions of Next that take no argument.
_NULLARY = {"AllReduce", "Barrier", "Broadcast", "Restart", "Terminated"}


def definitions(text: str) -> set[str]:
    """Every operator defined at the start of a line (``Name ==`` or ``Name(args) ==``)."""
    return set(re.findall(r"^(\w+)(?:\([^)]*\))?\s*==", text, re.MULTILINE))


def next_actions(text: str) -> set[str]:
    """The actions of ``Next`` in ``tla/PauseProtocol.tla`` (the system's and the environment's)."""
    body = text[text.index("LoopAction(r) ==") : text.index("\nFairnessWithoutRecovery ==")]
    called = set(re.findall(r"\b([A-Z]\w+)\(", body)) | (_NULLARY & set(re.findall(r"\b(\w+)\b", body)))
    return called - _GROUPS


def checked_definitions(text: str) -> set[str]:
    """The invariants and properties of the spec: names ending in Inv or Prop, and TypeOK."""
    return {d for d in definitions(text) if d.endswith(("Inv", "Prop")) or d == "TypeOK"}


def variables(text: str) -> set[str]:
    """The variables a module declares (``VARIABLES a, b`` up to the next blank line; comments skipped)."""
    declared: set[str] = set()
    for block in re.findall(r"^VARIABLES?\b(.*?)(?:\n\s*\n)", text, re.MULTILINE | re.DOTALL):
        declared |= set(re.findall(r"^\s*(\w+)\s*,?", re.sub(r"\\\*.*", "", block), re.MULTILINE))
    return declared - {""}
