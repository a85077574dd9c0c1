"""The checking is real: remove a guard from a copy of the spec and TLC finds the bug."""

from pathlib import Path

import pytest

from cbpause.tlc import Model, format_trace, run_model

pytestmark = pytest.mark.layer("verify")


def remove_guard(tla_dir: Path, tag: str) -> None:
    spec = tla_dir / "PauseProtocol.tla"
    lines = spec.read_text().splitlines(keepends=True)
    kept = [ln for ln in lines if f"\\* guard:{tag}" not in ln]
    assert len(kept) == len(lines) - 1, f"expected exactly one line tagged guard:{tag}"
    spec.write_text("".join(kept))


def write_cfg(tla_dir: Path, name: str, body: str) -> str:
    (tla_dir / name).write_text(body)
    return name


ONE_RANK_ONE_HOLDER = """
CONSTANTS
    Ranks = {1}
    Holders = {1}
    RankOf <- OneHolderOnRankOne
    Requests = {}
    Modes = {1}
    Faults = {"interrupt", "stop"}
    MaxRestarts = 0
SPECIFICATION MCSpec
"""


def test_unmutated_small_model_passes(tla_copy, tlc_ready):
    cfg = write_cfg(tla_copy, "small.cfg", ONE_RANK_ONE_HOLDER + "INVARIANT CountsInv\nPROPERTY ResumeProp\n")
    result = run_model(Model("small", "MCPauseProtocol", cfg, "fast", "ok"), tla_copy, workers=1)
    assert result.outcome == "ok", result.run.output[-2000:]


def test_removing_the_d1_guard_brings_d1_back(tla_copy, tlc_ready):
    """Without `count[r] > 0` in OpenWindow the loop parks with nobody to release it (D1)."""
    remove_guard(tla_copy, "D1")
    cfg = write_cfg(tla_copy, "d1.cfg", ONE_RANK_ONE_HOLDER + "PROPERTY ResumeProp\n")
    # -deadlock: after a hard stop nothing else is enabled, and the stuck loop must be named by the
    # property it breaks rather than reported as a deadlock.
    model = Model("d1", "MCPauseProtocol", cfg, "fast", "property:ResumeProp", options=("-deadlock",))
    result = run_model(model, tla_copy, workers=1)
    assert result.outcome == "property:ResumeProp", result.run.output[-2000:]
    text = format_trace(result.run.trace)
    # The counterexample is D1: a withdrawn request, then a window opened for nobody.
    assert "Interrupt" in text and "OpenWindow" in text


def test_removing_the_d1_guard_breaks_the_counts_invariant(tla_copy, tlc_ready):
    remove_guard(tla_copy, "D1")
    cfg = write_cfg(tla_copy, "d1s.cfg", ONE_RANK_ONE_HOLDER + "INVARIANT CountsInv\n")
    result = run_model(
        Model("d1s", "MCPauseProtocol", cfg, "fast", "invariant:CountsInv"), tla_copy, workers=1
    )
    assert result.outcome == "invariant:CountsInv", result.run.output[-2000:]


def test_removing_the_window_guard_breaks_exclusion(tla_copy, tlc_ready):
    """Without `~paused[r]` in CloseWindow the loop steps while a holder is inside."""
    remove_guard(tla_copy, "exclusion")
    body = ONE_RANK_ONE_HOLDER.replace("Requests = {}", "Requests = {1}")
    cfg = write_cfg(tla_copy, "ex.cfg", body + "INVARIANT ExclusionInv\n")
    result = run_model(
        Model("ex", "MCPauseProtocol", cfg, "fast", "invariant:ExclusionInv"), tla_copy, workers=1
    )
    assert result.outcome == "invariant:ExclusionInv", result.run.output[-2000:]
    assert "EnterPause" in format_trace(result.run.trace)


def test_removing_the_window_closes_guard_brings_d11_back(tla_copy, tlc_ready):
    """Without `~closing[r]` in RequestPause two holders that take turns keep the window open for ever, and the
    request in flight is never delivered, though each holder leaves every time (D11, R-WINDOW-CLOSES)."""
    remove_guard(tla_copy, "window-closes")
    body = ONE_RANK_ONE_HOLDER.replace("Holders = {1}", "Holders = {1, 2}").replace(
        "RankOf <- OneHolderOnRankOne", "RankOf <- OneRankTwoHolders").replace("Requests = {}", "Requests = {1}")
    cfg = write_cfg(tla_copy, "wc.cfg", body.replace('Faults = {"interrupt", "stop"}', "Faults = {}")
                    + "PROPERTY NothingLostProp\n")  # fmt: skip
    model = Model("wc", "MCPauseProtocol", cfg, "fast", "property:NothingLostProp")
    result = run_model(model, tla_copy, workers=1)
    assert result.outcome == "property:NothingLostProp", result.run.output[-2000:]
    assert "LeavePause" in format_trace(result.run.trace)


def remove_conjunct(tla_dir: Path, module: str, definition: str, conjunct: str) -> None:
    """Drop the line ``/\\ conjunct`` from ``definition`` in ``module``."""
    path = tla_dir / f"{module}.tla"
    text = path.read_text()
    head, _, rest = text.partition(f"\n{definition} ==\n")
    body, sep, tail = rest.partition("\n\n")
    line = f"    /\\ {conjunct}\n"
    assert (body + "\n").count(line) == 1, f"{definition} has no conjunct {conjunct}"
    path.write_text(head + f"\n{definition} ==\n" + (body + "\n").replace(line, "").rstrip("\n") + sep + tail)


@pytest.mark.extended  # a deep model (IndInv_1r1h, 15-40 s): nox -s verify
def test_ind_inv_is_inductive_and_fails_without_its_mode_conjunct(tla_copy, tlc_ready):
    """IndInv is inductive with every mode and the death fault (one step from every state of its bounds); without
    ModeWindowInv it is not: a keep holder enters a DRAIN window with a request in flight (issue 25)."""
    model = Model("ind", "MCPauseProtocolInd", "MCPauseProtocolInd_1r1h.cfg", "fast", "ok")
    result = run_model(model, tla_copy, workers=1)
    assert result.outcome == "ok", result.run.output[-2000:]
    for definition in ("IndInv", "IndInit"):  # IndInit is IndTypeOK /\ IndInv, written out
        remove_conjunct(tla_copy, "MCPauseProtocolInd", definition, "ModeWindowInv")
    cfg = (tla_copy / "MCPauseProtocolInd_1r1h.cfg").read_text()
    write_cfg(tla_copy, "ind-.cfg", cfg[: cfg.index("INVARIANTS")] + "INVARIANT ModeInv\n")
    broken = Model("ind-", "MCPauseProtocolInd", "ind-.cfg", "fast", "invariant:ModeInv")
    result = run_model(broken, tla_copy, workers=1)
    assert result.outcome == "invariant:ModeInv", result.run.output[-2000:]
    assert "EnterPause" in format_trace(result.run.trace)
