"""The pure transitions reach exactly as many states as TLC finds in the fast models."""

import pytest

from cbpause.tlc import load_manifest
from cbpause.transitions import GROUP_INVARIANTS, group_actions, initial_group, monotone_stop_inv

from .conftest import TLA_DIR

EXPECTED = {m.name: m.distinct_states for m in load_manifest(TLA_DIR)}

MODELS = {
    # name: (ranks, rank of each holder, requests, faults, max restarts), as in the .cfg
    "PauseProtocol_1r2h": (1, (0, 0), 1, {"interrupt", "timeout", "error", "stop"}, 1),
    "PauseProtocol_peer_absent": (2, (0,), 1, {"interrupt", "stop"}, 1),
    "PauseProtocol_2r1h": (2, (0, 1), 1, {"interrupt", "crash", "stop"}, 0),
}


def reachable(n_ranks, rank_of, n_requests, faults, max_restarts) -> int:
    start = initial_group(n_ranks, rank_of, n_requests)
    seen, frontier = {start}, [start]
    while frontier:
        nxt = []
        for g in frontier:
            for label, succ in group_actions(g, frozenset(faults), max_restarts):
                assert monotone_stop_inv(g, succ), label
                if succ not in seen:
                    for name, inv in GROUP_INVARIANTS.items():
                        assert inv(succ), f"{name} broken by {label}: {succ}"
                    seen.add(succ)
                    nxt.append(succ)
        frontier = nxt
    return len(seen)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_python_reaches_as_many_states_as_tlc(name):
    assert reachable(*MODELS[name]) == EXPECTED[name]
