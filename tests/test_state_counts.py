"""The pure transitions reach exactly as many states as TLC finds in the fast models."""

import pytest

from cbpause.core import group as gr
from cbpause.tlc import load_manifest
from cbpause.tlc.conformance import FAST_MODEL_SHAPES, Shape, encode, explore

from .conftest import TLA_DIR

EXPECTED = {m.name: m.distinct_states for m in load_manifest(TLA_DIR)}


def reachable(shape: Shape) -> int:
    """Every invariant holds in every reachable state; MonotoneStopInv on every step.  States are counted as TLC
    sees them (:func:`encode`): Python tells a dead holder that was waiting from one that was inside, TLA+ does
    not."""
    start = gr.initial_group(shape.n_ranks, shape.rank_of, shape.n_requests)
    seen = {start}
    for g, label, succ in explore(shape):
        assert gr.monotone_stop_inv(g, succ), label
        if succ not in seen:
            for name, inv in gr.GROUP_INVARIANTS.items():
                assert inv(succ), f"{name} broken by {label}: {succ}"
            seen.add(succ)
    return len({encode(g) for g in seen})


@pytest.mark.parametrize("name", sorted(FAST_MODEL_SHAPES))
def test_python_reaches_as_many_states_as_tlc(name):
    assert reachable(FAST_MODEL_SHAPES[name]) == EXPECTED[name]
