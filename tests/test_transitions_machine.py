"""Hypothesis drives the pure transitions through random interleavings of the TLA+ actions.

One rule per TLA+ action of ``Next`` (its enabling condition as the precondition), one invariant per
TLA+ invariant; Hypothesis picks the interleaving and shrinks a failure to a minimal one.
``test_machine_mirrors_the_tla`` checks those two lists against ``tla/PauseProtocol.tla``.
"""

import os
import re

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cbpause.transitions import GROUP_INVARIANTS, group_actions, initial_group, monotone_stop_inv

from .conftest import TLA_DIR

ACTIONS = [
    "Observe", "AllReduce", "OpenWindow", "SkipWindow", "ParkForPeer", "JoinPeerPause", "PeerParkTimeout",
    "CollectiveTimeout", "CloseWindow", "Barrier", "NoPause", "StartStep", "EndStep", "Idle", "ExitLoop",
    "RequestPause", "EnterPause", "LeavePause", "PauseFails", "Interrupt", "PauseTimeout", "RequestStop",
    "FatalError", "Crash", "Restart", "Submit", "Deliver", "Terminated",
]  # fmt: skip

SHAPES = [
    # (ranks, rank of each holder, requests)
    (1, (0, 0), 1),
    (2, (0, 1), 1),
    (2, (0,), 2),
    (2, (0, 0, 1), 1),
    (3, (0, 1, 2), 1),
]
FAULTS = frozenset({"interrupt", "timeout", "error", "crash", "stop"})


def action_name(label: str) -> str:
    return label.split("(", 1)[0]


class PauseProtocolMachine(RuleBasedStateMachine):
    """The TLA+ spec, executed: ``self.g`` is the TLA+ state."""

    def __init__(self):
        super().__init__()
        self.g = None
        self.steps_taken = 0

    @initialize(shape=st.sampled_from(SHAPES), max_restarts=st.integers(0, 2))
    def init(self, shape, max_restarts):
        n_ranks, rank_of, n_requests = shape
        self.g = initial_group(n_ranks, rank_of, n_requests)
        self.max_restarts = max_restarts

    def enabled(self, action: str):
        if action == "Terminated":
            # The stuttering step TLA+ allows once every loop has ended for good.
            done = all(s.phase in ("stopped", "dead") for s in self.g.ranks)
            return [("Terminated", self.g)] if done else []
        return [(label, succ) for label, succ in group_actions(self.g, FAULTS, self.max_restarts)
                if action_name(label) == action]

    def take(self, action: str, data) -> None:
        choices = self.enabled(action)
        label, succ = data.draw(st.sampled_from(choices), label=action)
        assert monotone_stop_inv(self.g, succ), f"MonotoneStopInv broken by {label}"
        self.g = succ
        self.steps_taken += 1

    # One rule per TLA+ action, with its enabling condition as precondition.
    for _name in ACTIONS:

        def _make(name):
            def _rule(self, data):
                self.take(name, data)

            _rule.__name__ = _rule.__qualname__ = name
            enabled = precondition(lambda self: self.g is not None and bool(self.enabled(name)))
            return enabled(rule(data=st.data())(_rule))

        locals()[_name] = _make(_name)
    del _name, _make

    # One invariant per TLA+ invariant.
    @invariant()
    def TypeOK(self):
        assert self.g is None or GROUP_INVARIANTS["TypeOK"](self.g), self.g

    @invariant()
    def ExclusionInv(self):
        assert self.g is None or GROUP_INVARIANTS["ExclusionInv"](self.g), self.g

    @invariant()
    def SameWindowInv(self):
        assert self.g is None or GROUP_INVARIANTS["SameWindowInv"](self.g), self.g

    @invariant()
    def CountsInv(self):
        assert self.g is None or GROUP_INVARIANTS["CountsInv"](self.g), self.g

    @invariant()
    def NothingLostInv(self):
        assert self.g is None or GROUP_INVARIANTS["NothingLostInv"](self.g), self.g


FUZZ_EXAMPLES = int(os.environ.get("CBPAUSE_FUZZ_EXAMPLES", "150"))

TestPauseProtocolMachine = PauseProtocolMachine.TestCase
TestPauseProtocolMachine.settings = settings(
    max_examples=FUZZ_EXAMPLES,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_machine_mirrors_the_tla():
    """A rule for every action of Next, an invariant for every TLA+ invariant (and nothing else)."""
    tla = (TLA_DIR / "PauseProtocol.tla").read_text()
    body = tla[tla.index("LoopAction(r) =="): tla.index("Spec ==")]
    in_next = set(re.findall(r"\b([A-Z]\w+)\(", body)) | {"AllReduce", "Barrier", "Restart", "Terminated"}
    in_next -= {"LoopAction", "HolderWakes", "WF_vars", "SF_vars"}
    members = [getattr(PauseProtocolMachine, n) for n in dir(PauseProtocolMachine)]
    rules = {f.__name__ for f in members if getattr(f, "hypothesis_stateful_rule", None)}
    assert rules == in_next, (rules ^ in_next)
    state_invariants = {d for d in re.findall(r"^(\w+Inv|TypeOK) ==", tla, re.MULTILINE)} - {"MonotoneStopInv"}
    machine_invariants = {f.__name__ for f in members if getattr(f, "hypothesis_stateful_invariant", None)}
    assert machine_invariants == state_invariants
    assert set(GROUP_INVARIANTS) == state_invariants
