"""A collective that fails while requests are in hand loses none of them (issue 24, R-NOTHING-LOST-DELIVERED).

Every collective call site of one iteration of transformers' loop, on the real CPU loop, with requests in every
place a request can be: drained from the input queue this iteration (and so in transit: in no queue and no
scheduler yet), in the scheduler's batch, and still queued.  At each site the collective raises, as gloo does when
a peer died; every accepted request must then get exactly one terminal output, the loop must stop with the error
recorded, and nothing may hang.  One process: the TP helper's methods are wrapped on the instance, and the two
sites that only run under TP (the barrier's all-reduce and the monitored barrier) are reached by giving the helper
a CPU group from the decision of the test's one window until the fault.  ``tests/test_integration_tp.py`` kills a
real peer.

The sites, in the order an iteration reaches them:

* ``group_all_reduce``: ``tp_all_reduce_state`` of the group step, with the drained requests' count as payload;
* ``barrier_all_reduce``: the all-reduce at the barrier that agrees whether a window changed the weights;
* ``monitored_barrier``: the barrier after a pause window;
* ``payload_broadcast``: ``tp_broadcast_object_from_rank_0``, which carries the drained requests to every rank;
* ``forward_collective``: a collective of the model's own forward step (the forward step raises);
* ``critical_all_reduce``: the all-reduce that tells the group of a fatal error, after the forward step raised.
"""

from __future__ import annotations

import collections
import threading

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.generation.continuous_batching.requests import RequestStatus  # noqa: E402

from cbpause.integrations import iteration  # noqa: E402
from cbpause.integrations import transformers as cbt  # noqa: E402
from cbpause.testing import JOIN_TIMEOUT, batching_config, greedy_config, probed, run_thread  # noqa: E402

from .conftest import MAX_NEW, PROMPT, WAIT, submit  # noqa: E402

pytestmark = pytest.mark.layer("loop")

SITES = (
    "group_all_reduce",
    "barrier_all_reduce",
    "monitored_barrier",
    "payload_broadcast",
    "forward_collective",
    "critical_all_reduce",
)
WINDOW_SITES = ("barrier_all_reduce", "monitored_barrier")  # reached only in an iteration that pauses
CPU_GROUP = object()  # stands for gloo's CPU group around the one window of a barrier site


class CollectiveFault(RuntimeError):
    """What a collective raises when a peer of the group is gone."""


class Faults:
    """Wraps the manager's TP helper so that the collective at ``site`` raises once, in the iteration that drained
    the requests of the test (``armed`` is set just before that iteration begins)."""

    def __init__(self, manager, site: str, monkeypatch) -> None:
        self.manager, self.site = manager, site
        self.armed, self.fired = threading.Event(), threading.Event()
        self.forward: BaseException | None = None  # the forward step's fault, once armed
        self.error = CollectiveFault(f"peer gone at {site}")
        helper = manager.distributed_helper
        self._all_reduce, self._broadcast = helper.tp_all_reduce_state, helper.tp_broadcast_object_from_rank_0
        monkeypatch.setattr(helper, "tp_all_reduce_state", self.all_reduce)
        monkeypatch.setattr(helper, "tp_broadcast_object_from_rank_0", self.broadcast)
        monkeypatch.setattr(iteration._dist, "monitored_barrier", self.monitored_barrier, raising=False)

    def _fire(self, site: str) -> None:
        if self.site == site and self.armed.is_set() and not self.fired.is_set():
            self.fired.set()
            self.manager.distributed_helper.cpu_comm_group = None  # the fake group ends with the fault
            raise self.error

    def all_reduce(self, payload_size: int, stop_status: int, pause_requested: int = 0):
        state = self.manager.background_thread_status.state
        if state.phase == "reduce" and state.fatal:
            self._fire("critical_all_reduce")
        elif state.phase == "reduce" and payload_size > 0:  # the group step of the iteration that drained them
            self._fire("group_all_reduce")
            if self.site in ("forward_collective", "critical_all_reduce") and self.armed.is_set() and not self.forward:
                # The forward step that follows (with the drained requests in its batch) raises.
                self.forward = self.manager.probe.fail_with = CollectiveFault("a collective of the forward step failed")
        elif state.phase == "barrier":
            self._fire("barrier_all_reduce")
        return self._all_reduce(payload_size, stop_status, pause_requested)

    def broadcast(self, payload):
        self._fire("payload_broadcast")
        return self._broadcast(payload)

    def monitored_barrier(self, *args, **kwargs):
        self._fire("monitored_barrier")


def outputs_until_quiet(manager) -> collections.Counter:
    """The request id of every output delivered, counted (the loop has exited: nothing more will come)."""
    seen: collections.Counter = collections.Counter()
    while (out := manager.get_result(timeout=0.5)) is not None:
        seen[out.request_id] += 1
        assert out.is_finished(), f"{out.request_id}: a partial output after the loop exited"
    return seen


@pytest.mark.parametrize("in_hand", [1, 3], ids=["one-in-hand", "three-in-hand"])
@pytest.mark.parametrize("site", SITES)
def test_a_failed_collective_loses_no_request(cpu_model, site, in_hand, monkeypatch):
    """Requests in the batch, ``in_hand`` drained by the iteration whose collective fails at ``site``, more queued
    behind: each gets exactly one terminal output; the loop stops with the error recorded; the holder of a window
    site got in and out."""
    manager = cbt.init_continuous_batching(cpu_model, greedy_config(MAX_NEW), batching_config(), peer_park_timeout=WAIT)
    with probed(manager, cpu_model) as manager:
        probe, status = manager.probe, manager.background_thread_status
        faults = Faults(manager, site, monkeypatch)
        manager.start()
        running = submit(manager, 2)
        assert probe.wait_steps(2, WAIT), "the loop does not step"
        reached, release = probe.hold_next()
        assert reached.wait(WAIT), "the loop ran no forward step"
        # The loop is inside a forward step: what is submitted now is drained by its next iteration.
        drained = submit(manager, in_hand)
        holder = box = None
        if site in WINDOW_SITES:
            def hold():
                # A group from before the decision (the loop is held in its forward step): its barrier follows the
                # window.  (The loop decides as the window opens whether it has peers to meet at the barrier.)
                manager.distributed_helper.cpu_comm_group = CPU_GROUP
                with manager.pause(timeout=WAIT):
                    pass

            manager._wake_up_loop.clear()
            holder, box = run_thread(hold, name="holder")
            assert manager._wake_up_loop.wait(WAIT), "the pause did not ask"
        faults.armed.set()
        release.set()
        thread = manager._generation_thread
        thread.join(WAIT)
        assert not thread.is_alive(), f"the loop still runs after the fault at {site}"
        if holder is not None:
            holder.join(JOIN_TIMEOUT)
            assert not holder.is_alive() and "error" not in box, box.get("error")
        if site == "forward_collective":
            assert faults.forward is not None and probe.fail_with is None, "the forward step's fault never fired"
        else:
            assert faults.fired.is_set(), f"the fault at {site} never fired: the test did not reach the site"
        late = manager.add_request(list(PROMPT), max_new_tokens=MAX_NEW)
        assert late is None, "a stopped loop accepted a request"
        seen = outputs_until_quiet(manager)
        accepted = running + drained
        lost = [i for i in accepted if seen[i] == 0]
        assert not lost, f"no terminal output for {lost} after the fault at {site} (R-NOTHING-LOST-DELIVERED)"
        assert all(seen[i] == 1 for i in accepted), f"duplicated outputs: {dict(seen)}"
        assert set(seen) == set(accepted), f"outputs for requests never submitted: {set(seen) - set(accepted)}"
        assert status.state.phase == "stopped" and status.state.fatal
        assert status.fatal_error is not None
        assert manager._live_ids == set(), f"requests still counted as in flight: {manager._live_ids}"


def test_the_requests_in_transit_fail_with_the_collective_error(cpu_model, monkeypatch):
    """The requests the broadcast carried get the broadcast's error as theirs (not a generic one), and a request of
    the batch keeps its partial tokens."""
    manager = cbt.init_continuous_batching(cpu_model, greedy_config(MAX_NEW), batching_config(), peer_park_timeout=WAIT)
    with probed(manager, cpu_model) as manager:
        probe = manager.probe
        faults = Faults(manager, "payload_broadcast", monkeypatch)
        manager.start()
        running = submit(manager, 1)
        assert probe.wait_steps(2, WAIT)
        reached, release = probe.hold_next()
        assert reached.wait(WAIT)
        drained = submit(manager, 2)
        faults.armed.set()
        release.set()
        manager._generation_thread.join(WAIT)
        assert not manager._generation_thread.is_alive()
        outs = {}
        while (out := manager.get_result(timeout=0.5)) is not None:
            outs[out.request_id] = out
        assert sorted(outs) == sorted(running + drained)
        for rid in drained:
            assert outs[rid].status == RequestStatus.FAILED and "peer gone at payload_broadcast" in str(outs[rid].error)
        assert outs[running[0]].status == RequestStatus.FAILED and outs[running[0]].generated_tokens
        assert manager.background_thread_status.fatal_error is faults.error
