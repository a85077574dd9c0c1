"""Hypothesis drives the pure transitions through random interleavings of the TLA+ actions.

One rule per TLA+ action of ``Next`` (its enabling condition as the precondition), one invariant per
TLA+ invariant; Hypothesis picks the interleaving and shrinks a failure to a minimal one.
``test_machine_mirrors_the_tla`` checks those two lists against ``tla/PauseProtocol.tla``.
"""

import os
import random
import re
import time

import pytest
from hypothesis import HealthCheck, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from cbpause import transitions
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


STEPS = [0]  # steps taken by every machine of this process, for the fuzz report


def action_name(label: str) -> str:
    return label.split("(", 1)[0]


class PauseProtocolMachine(RuleBasedStateMachine):
    """The TLA+ spec, executed: ``self.g`` is the TLA+ state."""

    def __init__(self):
        super().__init__()
        self.g = None
        self.steps_taken = 0

    @initialize(
        shape=st.sampled_from(SHAPES),
        max_restarts=st.integers(0, 2),
        faults=st.sets(st.sampled_from(sorted(FAULTS))),
        timeouts=st.booleans(),
    )
    def init(self, shape, max_restarts, faults, timeouts):
        n_ranks, rank_of, n_requests = shape
        self.g = initial_group(n_ranks, rank_of, n_requests)
        self.max_restarts = max_restarts
        # Each run explores the behaviours with a subset of the faults (all of them in some runs): with every
        # fault on, a crash or a collective timeout ends most runs before a pause window opens.
        self.faults = frozenset(faults)
        self.timeouts = timeouts
        self._cache = None

    def steps(self):
        if self._cache is None or self._cache[0] is not self.g:
            steps = group_actions(self.g, self.faults, self.max_restarts)
            if not self.timeouts:
                timeouts = ("CollectiveTimeout", "PeerParkTimeout")
                calm = [(lbl, g) for lbl, g in steps if action_name(lbl) not in timeouts]
                steps = calm or steps  # a timeout is the only way on: take it
            self._cache = (self.g, steps)
        return self._cache[1]

    def enabled(self, action: str):
        if action == "Terminated":
            # The stuttering step TLA+ allows once every loop has ended for good.
            done = all(s.phase in ("stopped", "dead") for s in self.g.ranks)
            return [("Terminated", self.g)] if done else []
        return [(label, succ) for label, succ in self.steps() if action_name(label) == action]

    def take(self, action: str, data) -> None:
        choices = self.enabled(action)
        label, succ = data.draw(st.sampled_from(choices), label=action)
        assert monotone_stop_inv(self.g, succ), f"MonotoneStopInv broken by {label}"
        self.g = succ
        if action != "Terminated":  # a stutter, not a step
            self.steps_taken += 1
            STEPS[0] += 1

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


def run_campaign(min_steps: int, master_seed: int, examples_per_round: int = 200) -> tuple[int, int]:
    """Run the machine with seeds drawn from ``master_seed`` until ``min_steps`` steps were taken."""
    rng = random.Random(master_seed)
    start, rounds = STEPS[0], 0
    while STEPS[0] - start < min_steps:
        factory = seed(rng.randrange(2**32))(PauseProtocolMachine)
        run_state_machine_as_test(
            factory,
            settings=settings(
                max_examples=examples_per_round,
                stateful_step_count=100,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            ),
        )
        rounds += 1
    return STEPS[0] - start, rounds


def test_fuzz_campaign():
    """A campaign of at least CBPAUSE_FUZZ_STEPS steps (``nox -s fuzz`` runs 100,000); prints its seed."""
    min_steps = int(os.environ.get("CBPAUSE_FUZZ_STEPS", "3000"))
    master_seed = int(os.environ.get("CBPAUSE_FUZZ_SEED", str(random.randrange(2**32))))
    began = time.monotonic()
    print(f"fuzz: seed={master_seed} (CBPAUSE_FUZZ_SEED={master_seed} reproduces this campaign)")
    steps, rounds = run_campaign(min_steps, master_seed)
    print(f"fuzz: seed={master_seed} steps={steps} rounds={rounds} seconds={time.monotonic() - began:.1f}")
    assert steps >= min_steps


def test_fuzzing_finds_a_planted_bug(monkeypatch):
    """LeavePause that forgets to close the window: the machine must find CountsInv broken."""

    def leave_pause_keeps_window_open(s):
        return s._replace(inside=s.inside - 1, count=s.count - 1)

    monkeypatch.setattr(transitions, "leave_pause", leave_pause_keeps_window_open)
    with pytest.raises(AssertionError, match="RankState"):
        run_campaign(20_000, master_seed=1)
