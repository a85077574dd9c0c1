"""The pure transitions and the TLA+ spec have the same state graph on every fast model."""

import pytest

from cbpause.core import transitions
from cbpause.tlc import Cfg, load_manifest
from cbpause.tlc.conformance import (
    DEEP_MODEL_SHAPES,
    FAST_MODEL_SHAPES,
    compare,
    parse_tla_value,
    python_graph,
    tlc_graph,
)

from .conftest import TLA_DIR

MODELS = {m.name: m for m in load_manifest(TLA_DIR)}


@pytest.fixture(scope="module")
def tlc_graphs(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = tlc_graph(MODELS[name], TLA_DIR, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


@pytest.mark.tlc
@pytest.mark.parametrize("name", sorted(FAST_MODEL_SHAPES))
def test_same_states_and_transitions_as_tlc(name, tlc_graphs, tlc_ready):
    tlc = tlc_graphs(name)
    py = python_graph(FAST_MODEL_SHAPES[name])
    assert compare(tlc, py) == []
    assert len(tlc.states) == MODELS[name].distinct_states
    assert len(tlc.edges) > len(tlc.states)  # not vacuous: the graph has branching


@pytest.mark.tlc
def test_a_mutated_guard_is_found_and_named(monkeypatch, tlc_graphs, tlc_ready):
    """Open the pause window even when the group hard-stops: the comparison names the transition."""
    tlc = tlc_graphs("PauseProtocol_1r2h")
    monkeypatch.setattr(
        transitions, "pause_decided", lambda s: s.phase == "decided" and s.tp_pause  # guard tp_status < HARD removed
    )
    diffs = compare(tlc, python_graph(FAST_MODEL_SHAPES["PauseProtocol_1r2h"]))
    assert diffs, "the mutated transitions must not match the spec"
    assert diffs[0].startswith("transition only in Python: OpenWindow from a state both reach"), diffs
    assert "tpStatus=2" in "\n".join(diffs)  # the diff shows the state in which the guard mattered


@pytest.mark.parametrize("name", sorted({**FAST_MODEL_SHAPES, **DEEP_MODEL_SHAPES}))
def test_shapes_match_the_cfg_constants(name):
    constants = Cfg.read(TLA_DIR / MODELS[name].cfg).constants()
    shape = {**FAST_MODEL_SHAPES, **DEEP_MODEL_SHAPES}[name]
    assert len(parse_tla_value(constants["Ranks"])) == shape.n_ranks
    assert len(parse_tla_value(constants["Holders"])) == len(shape.rank_of)
    assert len(parse_tla_value(constants["Requests"])) == shape.n_requests
    assert parse_tla_value(constants["Faults"]) == shape.bounds.faults
    assert parse_tla_value(constants["MaxRestarts"]) == shape.bounds.max_restarts
    assert parse_tla_value(constants["Modes"]) == shape.bounds.modes


@pytest.mark.parametrize(
    ("text", "value"),
    [('<<"read", "dead">>', ("read", "dead")), ("<< >>", ()), ("TRUE", True), ("-1", -1),
     ('{"stop", "crash"}', frozenset({"stop", "crash"})), ("<<<<1>>, <<>>>>", ((1,), ()))],
)  # fmt: skip
def test_parse_tla_value(text, value):
    assert parse_tla_value(text) == value
