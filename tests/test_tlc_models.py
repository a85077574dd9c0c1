"""Every fast model of tla/models.toml gives its expected result and state count."""

import pytest

from cbpause.tlc import Cfg, load_manifest, run_model

from .conftest import TLA_DIR

FAST = [m for m in load_manifest(TLA_DIR) if m.suite == "fast"]


@pytest.mark.tlc
@pytest.mark.parametrize("model", FAST, ids=[m.name for m in FAST])
def test_fast_model_gives_expected_result(model, tlc_ready):
    result = run_model(model, TLA_DIR, workers=2)
    assert result.outcome == model.expect, result.run.output[-3000:]
    assert result.mismatches() == []  # distinct and total states, actions that never fire
    if model.expect != "ok":
        # An expected failure must come with a readable counterexample.
        assert result.run.trace, result.run.output[-3000:]


def test_manifest_has_the_models_the_design_requires():
    names = {m.name for m in load_manifest(TLA_DIR)}
    assert {"PauseProtocol_1r2h", "PauseProtocol_2r1h", "Upstream_D1"} <= names
    deep = [m for m in load_manifest(TLA_DIR) if m.suite == "deep"]
    assert any("2r2h" in m.name for m in deep) and any("3r" in m.name for m in deep)
    for m in load_manifest(TLA_DIR):
        if m.expect == "ok" and not m.simulated:
            assert None not in (m.distinct_states, m.total_states, m.state_depth), f"{m.name}: record its figures"


def test_manifest_features_are_what_the_cfgs_check():
    for m in load_manifest(TLA_DIR):
        assert m.features == Cfg(m.cfg_text(TLA_DIR)).features(m.options), m.name


def test_every_witness_model_is_named_after_its_property():
    """Witness_NeverX checks NeverXWitness, and must fail on it."""
    for m in load_manifest(TLA_DIR):
        if m.name.startswith("Witness_"):
            prop = m.name.removeprefix("Witness_").split("_")[0] + "Witness"
            assert m.expect.endswith(":" + prop) and m.witness == m.expect, m
