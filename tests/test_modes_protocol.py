"""Pause modes at the protocol level (R-MODES), with the explicit loop API: no model, no threads."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from cbpause import PauseProtocol, PeerParkTimeout
from cbpause.core.transitions import ABORT, DRAIN, KEEP, RETRACT
from cbpause.testing import HANG_S

pytestmark = pytest.mark.layer("core")


def decided(p: PauseProtocol, tp_pause: int, busy: bool = False) -> None:
    """One iteration up to the group's decision: this rank observes, the group agrees on ``tp_pause``."""
    p.observe()
    p.all_reduce(p.DONT_STOP, tp_pause, busy)


def test_the_strongest_mode_is_sent_and_a_weaker_decision_is_refused():
    p = PauseProtocol()
    p.clear()
    holds = [p.request_pause(mode=m) for m in ("keep", "drain", "retract")]
    assert p.observe() == (p.DONT_STOP, DRAIN)
    with pytest.raises(ValueError, match="below this rank's"):
        p.all_reduce(p.DONT_STOP, RETRACT)  # a MAX that does not include this rank's request
    with pytest.raises(ValueError, match="not a mode"):
        p.all_reduce(p.DONT_STOP, 7)
    p.all_reduce(p.DONT_STOP, ABORT)  # a peer asked for more: every local holder is covered
    p.open_window()
    for hold in holds:
        p.enter_pause(hold, timeout=0)
        p.leave_pause(hold)
    p.close_window()
    p.barrier()


def test_a_drain_with_work_steps_first_and_opens_no_window():
    p = PauseProtocol()
    p.clear()
    hold = p.request_pause(mode="drain")
    decided(p, DRAIN, busy=True)
    assert p.state.draining
    with pytest.raises(RuntimeError, match="not enabled"):
        p.open_window()  # the batch has work: no window yet
    p.drain_first()
    p.start_step()
    p.end_step()
    decided(p, DRAIN, busy=False)
    assert not p.state.draining
    p.open_window()
    p.enter_pause(hold, timeout=0)
    p.leave_pause(hold)


def test_a_rank_whose_holder_asks_more_than_the_peers_window_says_so_when_its_park_runs_out():
    p = PauseProtocol(peer_park_timeout=0)
    p.clear()
    with ThreadPoolExecutor(max_workers=1) as loop:  # the loop's own thread (holders may not pause from it: D4)
        loop.submit(decided, p, KEEP).result(HANG_S)  # a peer asked for keep; nobody here yet
        loop.submit(p.park_for_peer).result(HANG_S)
        hold = p.request_pause(mode="abort")
        with pytest.raises(TimeoutError):
            p.enter_pause(hold, timeout=0)  # the peers' window is keep: this holder waits for the next one
        hold = p.request_pause(mode="abort")
        with pytest.raises(RuntimeError, match="not enabled"):
            loop.submit(p.join_peer_pause).result(HANG_S)
        error = loop.submit(p.peer_park_timeout).result(HANG_S)
    assert isinstance(error, PeerParkTimeout)
    assert "'abort', stronger than the group's 'keep'" in str(error) and "same mode" in str(error)
    with pytest.raises(RuntimeError, match="stopped before it could pause"):
        p.enter_pause(hold, timeout=0)
