"""An opt-in recorder of the transitions a :class:`~cbpause.PauseProtocol` takes, for trace validation.

``PauseProtocol(trace=TraceRecorder())`` records every transition under the protocol's lock: the TLA+
action, the rank, the holder (each holder gets an index), the stop status a ``RequestStop`` asked for,
and the rank's state after the step, so each record is consistent.  Several ``PauseProtocol`` objects (the
ranks of a group simulated in one process) may share one recorder; its own lock orders their records
consistently with each rank's order.  Off by default; when off, a transition pays one ``is not None`` test.

This module only records: :mod:`cbpause.tlc.traces` writes a trace as a TLA+ module and has TLC validate
it against ``tla/PauseProtocol.tla``.  Ranks and holders are numbered from 0 here, as everywhere in Python
(:func:`cbpause.core.group.tla_number` converts).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Hashable

from .group import HOLDER_ACTIONS
from .transitions import RankState

__all__ = ["LABEL_RECORDS", "REQUEST_RECORDS", "LabelEvent", "TraceEvent", "TraceRecorder", "action_of"]


# The records of a request's steps (PauseProtocol.submit, .record_request): "Submit" carries the acceptance as its
# status (1 accepted, 0 refused).
REQUEST_RECORDS = frozenset({"Submit", "Drain", "Broadcast", "Deliver", "FirstStep", "StaleRestart", "PeerDrop"})


def action_of(function_name: str) -> str:
    """The TLA+ action of a transition function: ``open_window`` -> ``OpenWindow``."""
    return "".join(part[:1].upper() + part[1:] for part in function_name.split("_"))


@dataclasses.dataclass(frozen=True)
class TraceEvent:
    action: str  # the TLA+ action, e.g. "OpenWindow"
    rank: int  # the rank's index (0-based)
    holder: int | None  # the holder's index (0-based) for holder actions, else None
    argument: int  # RequestStop's stop status, RequestPause's and QueuePause's mode, Submit's acceptance (1, 0), else 0
    state: RankState  # the rank's state after the step
    holder_state: str = ""  # the holder's state after a holder action ("waiting", "inside", "idle")
    time_ns: int = 0  # time.monotonic_ns() under the protocol's lock: orders the records of several processes
    request: str = ""  # the request's id, for a request's record (REQUEST_RECORDS)


# The records of RequestVersions' steps that the integration writes (``PauseProtocol.record_labels``; the Submit
# records come from ``events``): a forward step launched with its requests, its tokens read back with their labels,
# a window opened in a mode (or a drain that steps first), a weight version set inside it, the window closed (the
# spec computes what the staleness bound then restarts or ends), a terminal output with its labels.
LABEL_RECORDS = frozenset({"Launch", "Land", "OpenWindow", "DrainFirst", "Update", "CloseWindow", "Output"})


@dataclasses.dataclass(frozen=True)
class LabelEvent:
    action: str  # one of LABEL_RECORDS
    rank: int
    time_ns: int  # as TraceEvent's, from the same clock under the same lock
    fields: dict  # the record's values: request ids, modes, weight versions (as the holders set them)


class TraceRecorder:
    """Collects the transitions of one or more ``PauseProtocol`` objects (ranks) in one order.

    ``first_rank`` numbers the ranks attached to it from there: a rank of a TP group in a process of its own
    records under its own rank, so that the traces of the group's processes can be merged
    (:func:`cbpause.tlc.traces.merge`).
    """

    def __init__(self, first_rank: int = 0) -> None:
        self._lock = threading.Lock()
        self.events: list[TraceEvent] = []
        self.first_rank = first_rank
        self.n_ranks = 0
        self._holders: dict[tuple[int, Hashable], int] = {}
        self.holder_rank: list[int] = []  # holder index -> its rank's index
        # What the loop did to the requests' tokens (RequestVersions' steps: LABEL_RECORDS), in order with ``events``
        # by ``time_ns``: :mod:`cbpause.tlc.label_traces` replays them with the Submit records against
        # tla/RequestVersions.tla.
        self.labels: list[LabelEvent] = []

    def attach(self) -> int:
        """A new rank: its index."""
        with self._lock:
            self.n_ranks += 1
            return self.first_rank + self.n_ranks - 1

    def record(self, rank: int, function_name: str, args: tuple, before: RankState, after: RankState,
               holder: Hashable = None, holder_state: str = "", request: str = "") -> None:  # fmt: skip
        """One transition of rank ``rank``; ``holder`` identifies the holder of a holder action, ``holder_state``
        is its state after the step; ``request`` the request of a request's record (named by its action)."""
        action = action_of(function_name)  # a request's record is named by its action already: unchanged
        index = None
        with self._lock:
            if action in HOLDER_ACTIONS:
                key = (rank, holder)
                index = self._holders.get(key)
                if index is None:
                    self.holder_rank.append(rank)
                    index = self._holders[key] = len(self.holder_rank) - 1
            # The argument a record carries: the stop status of RequestStop, the mode of RequestPause, whether Submit
            # accepted.
            argument = int(args[0]) if action in ("RequestStop", "RequestPause", "QueuePause", "Submit") and args else 0
            event = TraceEvent(action, rank, index, argument, after, holder_state, time.monotonic_ns(), request)
            self.events.append(event)

    def record_labels(self, rank: int, action: str, fields: dict) -> None:
        """One of RequestVersions' steps (``LABEL_RECORDS``) on rank ``rank``'s loop."""
        if action not in LABEL_RECORDS:
            raise ValueError(f"not a label record: {action!r}")
        with self._lock:
            self.labels.append(LabelEvent(action, rank, time.monotonic_ns(), fields))
