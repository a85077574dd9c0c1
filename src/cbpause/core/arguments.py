"""The checks of the protocol's arguments: a pause mode, a timeout.  Bad input raises ``ValueError`` and changes
nothing (R-BAD-INPUT)."""

from __future__ import annotations

import decimal
import math
import numbers
import threading

from . import transitions as t

__all__ = ["check_mode", "check_timeout"]

_MODE_NUMBERS = {name: number for number, name in t.MODE_NAMES.items()}


def check_mode(mode: str | int) -> int:
    """A pause mode as the protocol's number: ``"keep"``, ``"retract"``, ``"drain"`` or ``"abort"`` (or the number,
    ``transitions.KEEP`` ... ``ABORT``); ``ValueError`` for anything else."""
    if isinstance(mode, str):
        number = _MODE_NUMBERS.get(mode)
        if number is not None:
            return number
    elif isinstance(mode, int) and not isinstance(mode, bool) and mode in t.MODES:
        return mode
    raise ValueError(f"mode must be one of {', '.join(map(repr, t.MODE_NAMES.values()))}, not {mode!r}")


def check_timeout(timeout: float | None, name: str = "timeout") -> float | None:
    """A timeout in seconds as a float, or ``None`` for none.

    Any real number is accepted (``int``, ``float``, numpy scalars, ``Fraction``, ``Decimal``); infinity and
    anything above ``threading.TIMEOUT_MAX`` mean no timeout (a ``Condition.wait`` would raise
    ``OverflowError`` on them).  ``bool``, NaN, negative numbers and non-numbers raise ``ValueError``.
    """
    if timeout is None:
        return None
    # The common case first, without the checks below (the holder's fast path): NaN fails both comparisons.
    if (type(timeout) is float or type(timeout) is int) and 0 <= timeout <= threading.TIMEOUT_MAX:
        return float(timeout)
    if isinstance(timeout, bool) or not isinstance(timeout, (numbers.Real, decimal.Decimal)):
        raise ValueError(f"{name} must be a number of seconds or None, not {timeout!r}")
    try:
        seconds = float(timeout)
    except (TypeError, ValueError, OverflowError):  # a Decimal NaN that signals, an exotic Real
        raise ValueError(f"{name} must be a number of seconds or None, not {timeout!r}") from None
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"{name} must be >= 0 seconds or None, not {timeout!r}")
    if seconds > threading.TIMEOUT_MAX:
        return None
    return seconds
