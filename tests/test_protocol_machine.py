"""One Hypothesis state machine: ``PauseProtocol`` and the pure model of the spec, side by side.

As in Hypothesis' ``DatabaseComparison`` example, every step is taken twice: by the model
(:func:`cbpause.core.group.next_steps`, TLA+'s ``Next`` in Python, within the bounds of ``MCSpec``) and by the
system (one ``PauseProtocol`` per rank, driven through its drop-in and its explicit API), and after every
step the two must hold the same state, rank by rank and holder by holder.  The model's invariants (one per
TLA+ invariant) must hold too, and ``MonotoneStopInv`` on every step.

Hypothesis picks the step among those the model enables (the action and its rank, holder or status), and
for the steps both APIs can take, which API takes it.  The system never blocks, so one thread acts at a
time: the loop's calls run on one loop thread (so that ``PauseProtocol`` sees a loop thread distinct from
its holders', as in production), the holders' on the test's thread.  A holder of the drop-in API
(``acquire_pause`` with ``timeout=0``) requests and settles in one call, so it takes two model steps at
once.  A second rule misuses the explicit loop API: a step the model does not enable for a rank must raise
and change nothing.

``nox -s fuzz`` runs a long campaign (``test_fuzz_campaign``); a planted bug must be found.
"""

from __future__ import annotations

import functools
import os
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from cbpause import PauseProtocol, PeerParkTimeout
from cbpause.core import group as gr
from cbpause.core import transitions
from cbpause.testing import HANG_S, run_thread, wait_for_queued
from cbpause.tlc.tla import checked_definitions, next_actions

from .conftest import TLA_DIR

pytestmark = pytest.mark.layer("core")

SHAPES = [
    # (ranks, rank of each holder, requests)
    (1, (0, 0), 1),
    (2, (0, 1), 1),
    (2, (0,), 2),
    (2, (0, 0, 1), 1),
    (3, (0, 1, 2), 1),
]
STEPS = [0]  # steps taken by every machine of this process, for the fuzz report
LOOP = ThreadPoolExecutor(max_workers=1, thread_name_prefix="machine-loop")  # the loops' own thread
CALL_TIMEOUT = HANG_S  # a loop call never blocks: only a hang runs out


def _finished_thread():
    thread = threading.Thread(target=lambda: None, name="holder-that-died")
    thread.start()
    thread.join()
    return thread


# HolderDies: the system's holders all act on the test's thread, so a holder "dies" by its hold being moved to a
# thread that has ended (tests/test_reliability.py kills real threads inside real pauses).
FINISHED_THREAD = _finished_thread()

# Loop steps whose guard is the rank's own: where the model does not enable one for a rank, the
# system must refuse it.  (The others also depend on the peers or on the requests, which a rank cannot see.)
RANK_LOCAL_STEPS = (
    "Observe", "OpenWindow", "DrainFirst", "SkipWindow", "ParkForPeer", "JoinPeerPause", "PeerParkTimeout",
    "CloseWindow", "NoPause", "EndStep",
)  # fmt: skip


# Loop steps the system takes with the one explicit call of the same name, in snake case.
PLAIN_LOOP_STEPS = {
    "OpenWindow", "ParkForPeer", "JoinPeerPause", "CloseWindow", "NoPause", "StartStep", "EndStep",
    "Idle",
}  # fmt: skip


def snake(action: str) -> str:
    """``"OpenWindow"`` -> ``"open_window"``: the Python name of a TLA+ action."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", action).lower()


class Interrupting:
    """A ``wake_up_loop`` whose ``set()`` raises, as a SIGINT landing just after the request went in."""

    def set(self) -> None:
        raise KeyboardInterrupt


def on_loop(fn, *args):
    """Run a loop call on the loops' own thread and return its result (or raise its exception)."""
    return LOOP.submit(fn, *args).result(timeout=CALL_TIMEOUT)


def index(label: str) -> int:
    """The Python index of the rank or holder a step names: ``"OpenWindow(2)"`` -> 1."""
    return int(label.split("(", 1)[1].split(",", 1)[0].rstrip(")")) - 1


class ProtocolComparison(RuleBasedStateMachine):
    """The model ``self.g`` and the system ``self.ranks``, side by side."""

    def __init__(self):
        super().__init__()
        self.g: gr.GroupState | None = None

    @initialize(
        shape=st.sampled_from(SHAPES),
        max_restarts=st.integers(0, 2),
        faults=st.sets(st.sampled_from(sorted(gr.FAULTS))),
        timeouts=st.booleans(),
        apis=st.lists(st.sampled_from(["explicit", "drop-in"]), min_size=3, max_size=3),
        modes=st.sets(st.sampled_from(transitions.MODES), min_size=1),
    )
    def init(self, shape, max_restarts, faults, timeouts, apis, modes):
        n_ranks, rank_of, n_requests = shape
        self.g = gr.initial_group(n_ranks, rank_of, n_requests)
        # Each run explores the behaviours with a subset of the faults (all of them in some runs): with every
        # fault on, a crash or a collective timeout ends most runs before a pause window opens.
        self.bounds = gr.Bounds(frozenset(faults), max_restarts, frozenset(modes))
        self.timeouts = timeouts
        self.ranks = [PauseProtocol(peer_park_timeout=None) for _ in range(n_ranks)]
        for p in self.ranks:
            p.clear()
        self.dead: set[int] = set()
        self.api = apis[: len(rank_of)]  # each holder uses one API throughout
        self.holds: dict[int, object] = {}  # explicit holders' PauseHold objects
        self.queued: dict[int, tuple] = {}  # holders queued at a closing window: their thread and its box
        self._steps: tuple[gr.GroupState | None, list] = (None, [])

    def steps(self) -> list[tuple[str, gr.GroupState]]:
        if self._steps[0] is not self.g:
            steps = gr.next_steps(self.g, self.bounds)
            if not self.timeouts:
                timeouts = ("CollectiveTimeout", "PeerParkTimeout")
                calm = [(lbl, g) for lbl, g in steps if gr.action_name(lbl) not in timeouts]
                steps = calm or steps  # a timeout is the only way on: take it
            # A holder queued on a thread of its own waits there until the window closes: nothing withdraws it
            # from outside (its LeaveQueue is taken by the calls that give up at once, do_QueuePause).
            steps = [(lbl, g) for lbl, g in steps if not (gr.action_name(lbl) == "LeaveQueue"
                                                          and index(lbl) in self.queued)]  # fmt: skip
            self._steps = (self.g, steps)
        return self._steps[1]

    # ----------------------------------------------------------------------------------------- the rules

    @precondition(lambda self: self.g is not None and bool(self.steps()))
    @rule(data=st.data())
    def step(self, data):
        if len(self.dead) < len(self.ranks) and data.draw(st.sampled_from([False] * 7 + [True]), label="misuse"):
            self.misuse_a_loop_step(data)
        label, succ = data.draw(st.sampled_from(self.steps()), label="step")
        action = gr.action_name(label)
        before = self.before = self.g
        self.g = succ
        if action in PLAIN_LOOP_STEPS:
            on_loop(getattr(self.rank(label), snake(action)))
        else:
            getattr(self, "do_" + action)(label, data)
        self.collect_admitted()
        assert gr.monotone_stop_inv(before, self.g), f"MonotoneStopInv broken by {label}"
        STEPS[0] += 1

    @precondition(lambda self: self.g is not None and gr.terminated(self.g))
    @rule()
    def terminated(self):
        """TLA+'s ``Terminated``: every loop has ended for good; the behaviour may stutter."""

    def misuse_a_loop_step(self, data):
        """A loop step the model does not enable for this rank raises RuntimeError and changes nothing (one step
        in eight is preceded by one)."""
        # A rank whose drop-in AllReduce is pending takes the decision from the step it is given: no misuse there.
        ranks = [r for r, p in enumerate(self.ranks) if r not in self.dead and p._deferred is None]
        if not ranks:
            return
        r = data.draw(st.sampled_from(ranks), label="rank")
        enabled = {gr.action_name(lbl) for lbl, _ in gr.next_steps(self.g) if "(" in lbl and index(lbl) == r}
        refused = sorted(set(RANK_LOCAL_STEPS) - enabled)
        action = data.draw(st.sampled_from(refused), label="refused step")
        p = self.ranks[r]
        before = p.state
        with pytest.raises(RuntimeError, match="is not enabled"):
            on_loop(getattr(p, snake(action)))
        assert p.state == before

    # ------------------------------------------------------------------ the system's side of each action

    def rank(self, label: str) -> PauseProtocol:
        return self.ranks[index(label)]

    def do_Observe(self, label, data):
        p = self.rank(label)
        if data.draw(st.booleans(), label="drop-in"):
            assert on_loop(p.is_pause_requested) == self.g.ranks[index(label)].obs_pause
        else:
            assert on_loop(p.observe) == (self.g.ranks[index(label)].obs_status, self.g.ranks[index(label)].obs_pause)

    def do_AllReduce(self, label, data):
        s = self.g.ranks[0]
        drop_in = not s.tp_pause and data.draw(st.booleans(), label="drop-in")
        for p in self.ranks:
            if drop_in:
                on_loop(p.update_with_tp_status, s.tp_status)
            else:
                on_loop(p.all_reduce, s.tp_status, s.tp_pause, s.draining)

    def do_DrainFirst(self, label, data):
        """``drain_first()`` also releases the holds of its rank's dead holders (a drain never parks, so each drain
        step is where the loop looks: issue 26): the model takes their ReleaseDeadHolder steps too.  (Found by a
        100,000-step campaign, seed 2027: a DRAIN holder that died before the decision.)"""
        r = index(label)
        on_loop(self.ranks[r].drain_first)
        for other in [x for x, state in enumerate(self.g.hs) if state.startswith("dead:") and self.g.rank_of[x] == r]:
            self.settle(other, "ReleaseDeadHolder")

    def do_SkipWindow(self, label, data):
        p = self.rank(label)
        on_loop(p.pause_and_wait if data.draw(st.booleans(), label="drop-in") else p.skip_window)

    def do_PeerParkTimeout(self, label, data):
        p = self.rank(label)
        error = on_loop(p.peer_park_timeout)
        assert isinstance(error, PeerParkTimeout) and p.fatal_error is error

    def do_CollectiveTimeout(self, label, data):
        on_loop(self.rank(label).collective_timeout, RuntimeError("a peer never came"))

    def do_ExitLoop(self, label, data):
        p = self.rank(label)
        on_loop(p.mark_as_stopped if data.draw(st.booleans(), label="drop-in") else p.exit_loop)

    def do_Barrier(self, label, data):
        for p in self.ranks:
            on_loop(p.barrier)

    def do_FailLoop(self, label, data):
        p = self.rank(label)
        s = self.before.ranks[index(label)]
        exits = s.phase in ("read", "body", "step") and s.local_status == transitions.DONT_STOP
        if exits and data.draw(st.booleans(), label="drop-in"):
            on_loop(p.mark_as_stopped)  # the loop's thread ended without a stop
        else:
            on_loop(p.fail_loop, RuntimeError("the loop failed around its window"))

    def do_RecordFatalError(self, label, data):
        on_loop(self.rank(label).record_fatal_error, RuntimeError("a fatal error in the forward step"))

    def do_Crash(self, label, data):
        self.dead.add(index(label))  # the process is gone: nothing of it is called again

    def do_Restart(self, label, data):
        for p in self.ranks:
            p.clear()

    def do_RequestStop(self, label, data):
        status = int(label.rsplit(",", 1)[1].rstrip(")"))
        self.rank(label).request_stop(status, index(label))

    def do_Submit(self, label, data):
        pass  # requests are the loop's; PauseProtocol does not see them

    do_Deliver = do_Broadcast = do_Submit

    # Holders: an explicit holder takes each step by itself; a drop-in holder requests and settles at once.

    def holder(self, label: str) -> tuple[int, PauseProtocol]:
        h = index(label)
        return h, self.ranks[self.g.rank_of[h]]

    def do_RequestPause(self, label, data):
        h, p = self.holder(label)
        mode = self.g.hmode[h]  # the mode the model's step asked for
        name = transitions.MODE_NAMES[mode] if data.draw(st.booleans(), label="mode by name") else mode
        if self.api[h] == "explicit":
            self.holds[h] = p.request_pause(mode=name)
            assert self.holds[h].mode == mode
            return
        s = self.g.ranks[self.g.rank_of[h]]
        # The interrupt lands where the call wakes the loop; a window that covers the mode is entered at once,
        # with no wake-up (acquire_pause's fast path), so there is nowhere for it to land.
        if not (s.paused and mode <= s.tp_pause) and data.draw(st.booleans(), label="interrupted"):
            with pytest.raises(KeyboardInterrupt):
                p.acquire_pause(Interrupting(), timeout=0, mode=name)
            self.settle(h, "Interrupt")
            return
        if s.paused and mode <= s.tp_pause:
            self.holds[h] = p.acquire_pause(None, timeout=0, mode=name)
            self.settle(h, "EnterPause")
        elif (s.local_status == transitions.STOPPED or s.fatal) and not s.paused:
            with pytest.raises(RuntimeError, match="stopped before it could pause"):
                p.acquire_pause(None, timeout=0, mode=name)
            self.settle(h, "PauseFails")
        else:
            with pytest.raises(TimeoutError):
                p.acquire_pause(None, timeout=0, mode=name)
            self.settle(h, "PauseTimeout")

    def do_QueuePause(self, label, data):
        """A holder asks at a closing window.  Either it gives up at once (``timeout=0``: QueuePause, then
        LeaveQueue with its TimeoutError), or it waits on a thread of its own until the Drop that closes the window
        makes it waiting (:meth:`collect_admitted` then takes its hold)."""
        h, p = self.holder(label)
        mode = self.g.hmode[h]
        # On a thread of its own: the model's holders are threads, and a thread with a hold inside the window (the
        # machine's, for its holders) asks at once, its pause nesting in the one it holds (outside the model).
        gives_up = self.bounds.faults & {"interrupt", "timeout"} and data.draw(st.booleans(), label="gives up")
        if gives_up:
            call = p.request_pause if self.api[h] == "explicit" else functools.partial(p.acquire_pause, None)
            thread, box = run_thread(lambda: call(mode=mode, timeout=0), name=f"gives-up-{h}")
            thread.join(HANG_S)
            assert not thread.is_alive() and isinstance(box.get("error"), TimeoutError), box
            assert "closing" in str(box["error"])
            self.settle(h, "LeaveQueue")
            return
        self.holds.pop(h, None)
        with p._lock:
            queued = p._queued_now()
        self.queued[h] = run_thread(lambda: p.request_pause(mode=mode), name=f"queued-{h}")
        assert wait_for_queued(p, HANG_S, queued + 1), "the holder was not queued"

    def do_LeaveQueue(self, label, data):
        raise AssertionError("a queued holder's LeaveQueue is taken at once, by do_QueuePause")

    def collect_admitted(self) -> None:
        """The holders the model made waiting out of the queue (the Drop that closed their window): their threads
        return their holds, as explicit holders.  Those of a rank that a stop asked since (RequestStop) leave the
        queue, their call raising, as the model's LeaveQueue."""
        for h in list(self.queued):
            r = self.g.rank_of[h]
            if r in self.dead or self.g.hs[h] != "queued" or transitions.can_request_pause(self.g.ranks[r]):
                continue
            thread, box = self.queued.pop(h)
            thread.join(HANG_S)
            assert not thread.is_alive() and isinstance(box.get("error"), RuntimeError), (h, box)
            self.settle(h, "LeaveQueue")
        for h in [h for h in self.queued if self.g.hs[h] != "queued"]:
            thread, box = self.queued.pop(h)
            thread.join(HANG_S)
            assert not thread.is_alive() and "error" not in box, (h, box)
            hold = self.holds[h] = box["result"]
            hold.thread = threading.current_thread()  # its thread ended: the hold lives on with the machine's
            self.api[h] = "explicit"  # a hold of request_pause from now on

    def settle(self, h: int, action: str) -> None:
        """The model's second step of a drop-in holder's call."""
        want = f"{action}({gr.tla_number(h)})"
        (self.g,) = [succ for lbl, succ in gr.next_steps(self.g) if lbl == want]

    def do_EnterPause(self, label, data):
        h, p = self.holder(label)
        p.enter_pause(self.holds[h], timeout=0)

    def do_PauseFails(self, label, data):
        h, p = self.holder(label)
        with pytest.raises(RuntimeError, match="stopped before it could pause"):
            p.enter_pause(self.holds[h], timeout=0)

    def do_PauseTimeout(self, label, data):
        h, p = self.holder(label)
        s = self.before.ranks[self.g.rank_of[h]]
        if s.paused or s.local_status == transitions.STOPPED or s.fatal:
            p.interrupt(self.holds[h])  # the wait would not time out here; withdrawing is the same step
        else:
            with pytest.raises(TimeoutError):
                p.enter_pause(self.holds[h], timeout=0)

    def do_Interrupt(self, label, data):
        h, p = self.holder(label)
        p.interrupt(self.holds[h])

    def do_LeavePause(self, label, data):
        h, p = self.holder(label)
        # Drop-in holders share the test's thread: release_pause() leaves the thread's last pause, which must be
        # this holder's; otherwise its hold leaves from "another thread".
        mine = [x for x in p._thread_holds() if x.state == "inside"]
        if self.api[h] == "explicit" or not mine or mine[-1] is not self.holds[h]:
            p.leave_pause(self.holds[h])
        else:
            p.release_pause()

    def do_HolderDies(self, label, data):
        h, _ = self.holder(label)
        self.holds[h].thread = FINISHED_THREAD

    def do_ReleaseDeadHolder(self, label, data):
        """One call releases every dead holder of the rank: the model takes the others' steps too."""
        h, p = self.holder(label)
        released = on_loop(p.release_dead_holders)
        rank = self.g.rank_of[h]
        others = [x for x, state in enumerate(self.g.hs) if state.startswith("dead:") and self.g.rank_of[x] == rank]
        for other in others:
            self.settle(other, "ReleaseDeadHolder")
        assert released == 1 + len(others)

    # ------------------------------------------------------------------------------------ what must hold

    def teardown(self):
        """A holder still queued (its rank crashed, or the run ended first) leaves through a stop of its rank."""
        for h, (thread, _) in list(self.queued.items()):
            self.ranks[self.g.rank_of[h]].request_stop(transitions.HARD_STOP, 0)
            thread.join(HANG_S)
            assert not thread.is_alive(), h

    @invariant()
    def same_state(self):
        if self.g is None:
            return
        for r, p in enumerate(self.ranks):
            if r in self.dead:
                continue
            state = p.state
            if p._deferred is not None:  # a drop-in update_with_tp_status(): its AllReduce waits for the decision
                state = transitions.all_reduce(state, p._deferred, 0)
            assert state == self.g.ranks[r], (r, state, self.g.ranks[r])
            assert (p.fatal_error is not None) == state.fatal, (r, p.fatal_error, state)
            m = p.metrics()
            assert (m.holders_waiting, m.holders_inside) == (state.waiting, state.inside)
            queued = sum(x == "queued" and self.g.rank_of[h] == r for h, x in enumerate(self.g.hs))
            assert m.holders_queued == queued, (r, m.holders_queued, queued)
        for h, hold in self.holds.items():
            if self.g.rank_of[h] not in self.dead:
                assert hold.state == self.g.hs[h].removeprefix("dead:"), (h, hold, self.g.hs[h])

    @invariant()
    def model_invariants(self):
        if self.g is not None:
            for name, inv in gr.GROUP_INVARIANTS.items():
                assert inv(self.g), f"{name}: {self.g}"


FUZZ_EXAMPLES = int(os.environ.get("CBPAUSE_FUZZ_EXAMPLES", "150"))

TestProtocolComparison = ProtocolComparison.TestCase
TestProtocolComparison.settings = settings(
    max_examples=FUZZ_EXAMPLES,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_machine_mirrors_the_tla():
    """A system side for every action of Next, an invariant for every TLA+ invariant (and nothing else)."""
    tla = (TLA_DIR / "PauseProtocol.tla").read_text()
    handled = {name[3:] for name in dir(ProtocolComparison) if name.startswith("do_")} | PLAIN_LOOP_STEPS
    assert handled == next_actions(tla) - {"Terminated"}, handled ^ next_actions(tla)
    assert all(hasattr(PauseProtocol, snake(action)) for action in PLAIN_LOOP_STEPS | set(RANK_LOCAL_STEPS))
    state_invariants = {d for d in checked_definitions(tla) if not d.endswith("Prop")} - {"MonotoneStopInv"}
    assert set(gr.GROUP_INVARIANTS) == state_invariants


def run_campaign(min_steps: int, master_seed: int, rounds_of: int = 200, shrink: bool = True) -> tuple[int, int]:
    """Run the machine, ``rounds_of`` examples at a time, with seeds drawn from ``master_seed`` until
    ``min_steps`` steps were taken (with ``shrink``, a failure is shrunk to a minimal one before it is raised)."""
    rng = random.Random(master_seed)
    start, rounds = STEPS[0], 0
    while STEPS[0] - start < min_steps:
        factory = seed(rng.randrange(2**32))(ProtocolComparison)
        run_state_machine_as_test(
            factory,
            settings=settings(
                max_examples=rounds_of,
                stateful_step_count=100,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
                phases=list(Phase) if shrink else [Phase.explicit, Phase.reuse, Phase.generate],
            ),
        )
        rounds += 1
    return STEPS[0] - start, rounds


@pytest.mark.skipif(not os.environ.get("CBPAUSE_FUZZ_STEPS"), reason="nox -s fuzz's campaign (CI runs it briefly: "
                    "tests/test_sessions.py); TestProtocolComparison is the suite's own run of the machine")
def test_fuzz_campaign():
    """A campaign of at least CBPAUSE_FUZZ_STEPS steps (``nox -s fuzz`` runs 100,000, its brief run 200); prints its
    seed."""
    min_steps = int(os.environ.get("CBPAUSE_FUZZ_STEPS", "3000"))
    master_seed = int(os.environ.get("CBPAUSE_FUZZ_SEED", str(random.randrange(2**32))))
    began = time.monotonic()
    print(f"fuzz: seed={master_seed} (CBPAUSE_FUZZ_SEED={master_seed} reproduces this campaign)")
    steps, rounds = run_campaign(min_steps, master_seed)
    print(f"fuzz: seed={master_seed} steps={steps} rounds={rounds} seconds={time.monotonic() - began:.1f}")
    assert steps >= min_steps


def test_fuzzing_finds_a_planted_bug(monkeypatch):
    """LeavePause that forgets to close the window: the machine must find CountsInv broken."""

    def leave_pause(s, mode=transitions.KEEP, queued=()):  # named as the transition it replaces (traces record it)
        return s._replace(inside=s.inside - 1, count=s.count - 1)

    monkeypatch.setattr(transitions, "leave_pause", leave_pause)
    with pytest.raises(AssertionError, match="CountsInv|SameWindowInv|RankState"):
        run_campaign(20_000, master_seed=1, shrink=False)  # shrinking threads is slow; finding is the point


def test_a_drain_step_releases_a_dead_drain_holder_as_the_model_does():
    """Regression (fuzz campaign, seed 2027): a holder asks for a drain, its thread ends before the decision; the
    group decides a drain with a request in flight.  ``drain_first()`` is DrainFirst then ReleaseDeadHolder
    (issue 26, point 4), and the rank ends where the model's two steps end."""
    g = gr.initial_group(1, (0,), 1)

    def take(label: str, want=lambda succ: True) -> None:
        nonlocal g
        g = next(succ for lbl, succ in gr.next_steps(g) if lbl == label and want(succ))

    p = PauseProtocol(peer_park_timeout=None)
    p.clear()
    for label in ("Submit(1)", "Observe(1)", "AllReduce", "NoPause(1)", "Broadcast", "StartStep(1)", "EndStep(1)"):
        take(label)
    for call in (p.observe, lambda: p.all_reduce(0, 0), p.no_pause, p.start_step, p.end_step):
        on_loop(call)
    assert p.state == g.ranks[0] and g.req == ("active",)
    hold = p.request_pause(None, "drain")
    take("RequestPause(1)", lambda succ: succ.hmode[0] == transitions.DRAIN)
    hold.thread = FINISHED_THREAD
    take("HolderDies(1)")
    for label in ("Observe(1)", "AllReduce"):
        take(label)
    on_loop(p.observe)
    on_loop(p.all_reduce, 0, transitions.DRAIN, True)
    assert p.state == g.ranks[0] and p.state.draining
    on_loop(p.drain_first)
    take("DrainFirst(1)")
    take("ReleaseDeadHolder(1)")
    assert hold.state == "idle" and p.state == g.ranks[0]
