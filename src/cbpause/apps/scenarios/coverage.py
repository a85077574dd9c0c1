"""What the validated traces exercised: the spec's actions, and its transitions of one rank.

A transition of one rank is ``(phase, action, next phase)``: the phase of the rank an action was taken on (or,
for a group step, each rank of the group), and the phase it left.  The spec's are those of the reachable state
graphs of the fast models (:mod:`cbpause.core.group` explores them; the state-graph comparison shows they are
TLC's); a trace's are read by replaying its records' phases as the spec sees them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from ...core import group as gr
from ...core.group import HOLDER_ACTIONS
from ...core.recorder import REQUEST_RECORDS, TraceEvent
from ...tlc.conformance import FAST_MODEL_SHAPES, explore

__all__ = ["Coverage", "spec_transitions", "trace_transitions"]

Transition = tuple[str, str, str]
GROUP_STEPS = {"AllReduce": ("reduce", "decided"), "Barrier": ("barrier", "body"), "Restart": ("stopped", "read")}
# A holder's death is recorded where the protocol learns it, before the release (the loop's window, or a clear() of
# a stopped loop; or a drain step, in the models with a drain mode, which the death models leave out): at another
# phase it is the same step, unobservable until then.
DEATH_LEARNED = ("window", "stopped", "body")
# A request's steps move no rank's phase: not transitions of one rank.  The real loop's traces carry them (the
# records of cbpause.core.recorder.REQUEST_RECORDS), and TLC checks them there.
REQUEST_ACTIONS = frozenset({"Submit", "Broadcast", "Deliver"})


def _label_rank(g: gr.GroupState, label: str) -> int:
    index = int(label.split("(", 1)[1].split(",", 1)[0].rstrip(")")) - 1
    return g.rank_of[index] if gr.action_name(label) in HOLDER_ACTIONS else index


@functools.cache
def spec_transitions() -> frozenset[Transition]:
    """Every transition of one rank in the reachable state graphs of the fast models."""
    found: set[Transition] = set()
    for shape in FAST_MODEL_SHAPES.values():
        for g, label, succ in explore(shape):
            action = gr.action_name(label)
            if action in GROUP_STEPS:
                found |= {(a.phase, action, b.phase) for a, b in zip(g.ranks, succ.ranks, strict=True)}
            elif action not in REQUEST_ACTIONS:
                r = _label_rank(g, label)
                if action == "HolderDies" and g.ranks[r].phase not in DEATH_LEARNED:
                    continue
                found.add((g.ranks[r].phase, action, succ.ranks[r].phase))
    return frozenset(found)


def trace_transitions(events: Iterable[TraceEvent], n_ranks: int) -> set[Transition]:
    """The transitions of one rank that a (validated) trace took."""
    phase = ["read"] * n_ranks
    found: set[Transition] = set()
    for e in events:
        if e.action in GROUP_STEPS:
            before, after = GROUP_STEPS[e.action]
            if phase[e.rank] == before:  # the first rank's record takes the group step
                for q in range(n_ranks):
                    if phase[q] == before:
                        found.add((before, e.action, after))
                        phase[q] = after
        elif e.action in REQUEST_RECORDS:
            continue
        elif e.action in HOLDER_ACTIONS or e.action == "RequestStop":
            found.add((phase[e.rank], e.action, phase[e.rank]))
        else:
            found.add((phase[e.rank], e.action, e.state.phase))
            phase[e.rank] = e.state.phase
    return found


class Coverage:
    """The transitions seen so far, against the spec's."""

    def __init__(self) -> None:
        self.spec = spec_transitions()
        self.seen: set[Transition] = set()

    def add(self, events: Iterable[TraceEvent], n_ranks: int) -> None:
        self.seen |= trace_transitions(events, n_ranks) & self.spec

    @property
    def missing(self) -> set[Transition]:
        return set(self.spec) - self.seen

    def actions(self) -> tuple[set[str], set[str]]:
        """(actions seen, actions of the spec not seen)."""
        spec = {a for _, a, _ in self.spec}
        seen = {a for _, a, _ in self.seen}
        return seen, spec - seen

    def fraction(self) -> float:
        return len(self.seen) / len(self.spec)

    def report(self) -> str:
        seen, unseen = self.actions()
        lines = [
            f"coverage: {len(seen)} of {len(seen) + len(unseen)} actions, {len(self.seen)} of {len(self.spec)} "
            f"transitions of one rank ({100 * self.fraction():.0f} %)"
        ]
        if unseen:
            lines.append("  actions never taken: " + ", ".join(sorted(unseen)))
        if self.missing:
            lines.append("  transitions not taken: " + ", ".join(f"{p}-{a}->{q}" for p, a, q in sorted(self.missing)))
        return "\n".join(lines)
