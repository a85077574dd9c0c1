"""Every model of the main and fast suites gives its expected result, state counts and action coverage, and breaks
each of its witnesses: from one TLC run per model (the session's ``tlc_results``; the main job's runs, kept in the
cache, are read, not run again).  The main suite's models are in CI's selection; the fast suite's are marked
``extended`` and run in ``nox -s verify``."""

import pytest

from cbpause.tlc import Cfg, load_manifest

from .conftest import TLA_DIR

pytestmark = pytest.mark.layer("verify")

MODELS = load_manifest(TLA_DIR)
CHECKED = [
    pytest.param(m, id=m.name, marks=[] if m.suite == "main" else [pytest.mark.extended])
    for m in MODELS
    if m.suite in ("main", "fast")
]


@pytest.mark.parametrize("model", CHECKED)
def test_model_gives_expected_result(model, tlc_results):
    result = tlc_results(model.name)
    assert result.outcome == model.expect, result.run.output[-3000:]
    assert result.mismatches() == []  # distinct and total states, actions that never fire
    if model.expect != "ok" and not model.parent:
        # An expected failure must come with a readable counterexample.
        assert result.run.trace, result.run.output[-3000:]


def test_manifest_has_the_models_the_design_requires():
    names = {m.name for m in MODELS}
    assert {"PauseProtocol_1r2h", "PauseProtocol_2r1h", "Upstream_D1"} <= names
    deep = [m for m in MODELS if m.suite == "deep"]
    assert any("2r2h" in m.name for m in deep) and any("3r" in m.name for m in deep)
    for m in MODELS:
        assert m.runtime or m.parent, f"{m.name}: record its runtime (docs/tlc.md's table states it)"
        if m.expect == "ok" and not m.simulated:
            assert None not in (m.distinct_states, m.total_states, m.state_depth), f"{m.name}: record its figures"


def test_the_main_job_finds_every_defect_and_checks_the_headline_models():
    """`nox -s tlc` (the main suite) shows what a reader comes for: every defect of upstream found, the protocol
    holding on one rank with every fault a rank has and on two ranks with a peer's pause (D3's set-up)."""
    main = {m.name: m for m in MODELS if m.suite == "main"}
    from cbpause.apps.diagrams import DEFECT_MODELS

    assert set(DEFECT_MODELS.values()) <= set(main)
    assert all(main[name].expect != "ok" for name in DEFECT_MODELS.values())
    assert {"PauseProtocol_1r2h", "PauseProtocol_peer_absent"} <= set(main)


def test_manifest_features_are_what_the_cfgs_check():
    for m in MODELS:
        assert m.features == Cfg(m.cfg_text(TLA_DIR)).features(m.options), m.name


def test_every_witness_model_is_named_after_its_property():
    """Witness_NeverX checks NeverXWitness, and must fail on it; its parent's run observes it."""
    by_name = {m.name: m for m in MODELS}
    for m in MODELS:
        if m.name.startswith("Witness_"):
            prop = m.name.removeprefix("Witness_").split("_")[0] + "Witness"
            assert m.expect.endswith(":" + prop) and m.witness == m.expect, m
            assert m.expect in by_name[m.parent].witnesses and by_name[m.parent].suite == m.suite, m
