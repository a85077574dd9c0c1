"""The pure transitions and the TLA+ spec have the same state graph on every fast model that checks the protocol.

TLC's graph is the one its model's run dumped (``graph = true`` in the manifest: the run that also gave the
model's verdict, counts and coverage); the Python graph is explored once, checking every invariant of
``cbpause.core.group`` on the way (the state counts follow: the same states on both sides, as many as the
manifest records).  The main suite's models are in CI's selection; the others run in ``nox -s verify``.
"""

import pytest

from cbpause.core import state
from cbpause.tlc import Cfg, load_manifest
from cbpause.tlc.conformance import (
    DEEP_MODEL_SHAPES,
    FAST_MODEL_SHAPES,
    compare,
    parse_tla_value,
    python_graph,
    read_dot,
)

from .conftest import TLA_DIR

pytestmark = pytest.mark.layer("verify")

MODELS = {m.name: m for m in load_manifest(TLA_DIR)}


@pytest.fixture(scope="module")
def graphs(tlc_results):
    """Each model's two graphs, TLC's (read from its run) and Python's, built once per module."""
    cache = {}

    def get(name):
        if name not in cache:
            result = tlc_results(name)
            assert result.passed and result.graph is not None, f"{name}: {result.outcome} {result.mismatches()}"
            cache[name] = (read_dot(result.graph), python_graph(FAST_MODEL_SHAPES[name]))
        return cache[name]

    return get


def _param(name: str):
    return pytest.param(name, marks=[] if MODELS[name].suite == "main" else [pytest.mark.extended])


@pytest.mark.parametrize("name", [_param(n) for n in sorted(FAST_MODEL_SHAPES)])
def test_same_states_and_transitions_as_tlc(name, graphs):
    tlc, py = graphs(name)
    assert compare(tlc, py) == []
    assert len(tlc.states) == len(py.states) == MODELS[name].distinct_states
    assert len(tlc.edges) > len(tlc.states)  # not vacuous: the graph has branching


def test_a_mutated_guard_is_found_and_named(monkeypatch, graphs):
    """Open the pause window even when the group hard-stops: the comparison names the transition."""
    tlc, _ = graphs("PauseProtocol_1r2h")
    monkeypatch.setattr(
        state, "pause_decided", lambda s: s.phase == "decided" and s.tp_pause  # guard tp_status < HARD removed
    )
    diffs = compare(tlc, python_graph(FAST_MODEL_SHAPES["PauseProtocol_1r2h"]))
    assert diffs, "the mutated transitions must not match the spec"
    assert diffs[0].startswith("transition only in Python: OpenWindow from a state both reach"), diffs
    assert "tpStatus=2" in "\n".join(diffs)  # the diff shows the state in which the guard mattered


def test_every_model_compared_dumps_its_graph():
    for name in {**FAST_MODEL_SHAPES, **DEEP_MODEL_SHAPES}:
        assert MODELS[name].graph, f"{name}: graph = true in tla/models.toml (its run must dump its state graph)"


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
