"""The docs' pictures come from TLC's output: a change to the spec changes them.

The phase diagram is TLC's state graph projected onto the loop's phases, and each defect's sequence diagram is
TLC's counterexample (:mod:`cbpause.apps.diagrams`); the tests below change a copy of the spec and check that the
regenerated picture changes with it, and pin the reading of a counterexample (who took each step, whose state
it changed) on a hand-written trace.  The site's link rewriting (``scripts/mkdocs_hooks.py``) is tested here
too: a link the site cannot follow fails ``nox -s docs``, and a wrong rewrite would send readers elsewhere.
"""

from __future__ import annotations

import re
import shutil

import pytest

from cbpause.apps import diagrams
from cbpause.tlc.cache import default_cache
from cbpause.tlc.conformance import tlc_graph
from cbpause.tlc.manifest import load_manifest

from .conftest import ROOT, load_script

pytestmark = pytest.mark.layer("verify")


def _models(tla_dir):
    return {m.name: m for m in load_manifest(tla_dir)}


def _phases(tla_dir):
    # The cache (CBPAUSE_TLC_CACHE) holds the main job's run of the spec as it is; a mutated copy is another key.
    graph = tlc_graph(_models(tla_dir)["PauseProtocol_1r2h"], tla_dir, cache=default_cache())
    return diagrams.phase_edges([("PauseProtocol_1r2h", graph)])


@pytest.fixture(scope="module")
def phases_of_the_spec(tlc_ready):
    """The projection of the spec as it is (one TLC run for the tests that read it)."""
    return _phases(ROOT / "tla")


@pytest.mark.extended  # two TLC runs of mutated specs with their graphs (20 s): nox -s verify
def test_the_phase_diagram_changes_with_the_spec(tla_copy, tlc_ready, tmp_path, phases_of_the_spec):
    """Rename an action and a phase in a copy of the spec: TLC's graph, and so the picture, follow."""
    before = phases_of_the_spec
    assert ("decided", "barrier") in before.edges and "SkipWindow" in before.edges[("decided", "barrier")]
    for f in tla_copy.glob("*.tla"):
        f.write_text(f.read_text().replace("SkipWindow", "PassTheWindowBy").replace('"barrier"', '"rendezvous"'))
    after = _phases(tla_copy)
    assert after.edges[("decided", "rendezvous")] == {"PassTheWindowBy"}
    assert "barrier" not in after.states and after.states["rendezvous"] == before.states["barrier"]
    dot_before, dot_after = diagrams.phase_dot(before), diagrams.phase_dot(after)
    assert dot_before != dot_after
    assert "PassTheWindowBy" in dot_after and "SkipWindow" not in dot_after
    if shutil.which("dot"):
        svg = diagrams.render_svg(dot_after, tmp_path / "phases.svg").read_text()
        assert "PassTheWindowBy" in svg and "rendezvous" in svg


def test_the_phase_diagram_has_the_loops_iteration(tlc_ready, phases_of_the_spec):
    """The main path of one iteration is in the projection of the fast model, with the actions the spec names."""
    p = phases_of_the_spec
    for edge, action in [
        (("read", "reduce"), "Observe"), (("reduce", "decided"), "AllReduce"), (("decided", "window"), "OpenWindow"),
        (("window", "barrier"), "CloseWindow"), (("barrier", "body"), "Barrier"), (("body", "step"), "StartStep"),
        (("step", "read"), "EndStep"), (("decided", "body"), "NoPause"),
    ]:  # fmt: skip
        assert action in p.edges[edge], (edge, action)
    assert p.initial == {"read"}
    table = diagrams.phase_table(p)
    assert "| `read` | `reduce` |" in table


def test_a_defects_sequence_diagram_changes_with_the_spec(tla_copy, tlc_ready, tmp_path):
    """Rename upstream's unconditional park in a copy of the spec: D1's picture shows the new name."""
    d1 = {"D1": "Upstream_D1"}
    diagrams.generate(tmp_path / "before", tla_copy, phase_models=(), defects=d1)
    before = (tmp_path / "before" / "D1.svg").read_text()
    assert "UpstreamOpenWindow" in before
    for path in tla_copy.glob("*.tla"):
        path.write_text(path.read_text().replace("UpstreamOpenWindow", "UpstreamParksAnyway"))
    diagrams.generate(tmp_path / "after", tla_copy, phase_models=(), defects=d1)
    after = (tmp_path / "after" / "D1.svg").read_text()
    assert after != before
    assert "UpstreamParksAnyway" in after and "UpstreamOpenWindow" not in after
    assert "UpstreamParksAnyway" in (tmp_path / "after" / "D1.txt").read_text()


def test_a_defects_picture_is_the_same_every_time(tlc_ready, tmp_path):
    """A liveness counterexample too (TLC's order follows its fingerprint function, which generate fixes)."""
    d7 = {"D7": "Upstream_D7"}
    for run in ("a", "b"):
        diagrams.generate(tmp_path / run, ROOT / "tla", phase_models=(), defects=d7)
    assert (tmp_path / "a" / "D7.svg").read_text() == (tmp_path / "b" / "D7.svg").read_text()


def test_a_picture_of_a_defect_the_model_no_longer_has_is_refused(tla_copy, tlc_ready, tmp_path):
    """With D2's stray release gone from the spec, TLC finds no counterexample: no picture, an error."""
    path = tla_copy / "MCUpstreamBackgroundThreadStatus.tla"
    path.write_text(path.read_text().replace('MCStrayRelease(r) == "stray" \\in Faults', "MCStrayRelease(r) == FALSE"))
    with pytest.raises(RuntimeError, match="no picture of D2"):
        diagrams.generate(tmp_path, tla_copy, phase_models=(), defects={"D2": "Upstream_D2"})


TRACE = [
    ("State 1: <Initial predicate>", {"hs": '<<"idle">>', "count": "<<0, 0>>", "phase": '<<"read", "read">>',
                                      "tpPause": "0", "localStatus": "<<0, 0>>"}),
    ("State 2: <MCRequestPause line 1, col 1 to line 2, col 2 of module M>",
     {"hs": '<<"waiting">>', "count": "<<0, 1>>", "phase": '<<"read", "read">>', "tpPause": "0",
      "localStatus": "<<0, 0>>"}),
    ("State 3: <AllReduce line 1, col 1 to line 2, col 2 of module M>",
     {"hs": '<<"waiting">>', "count": "<<0, 1>>", "phase": '<<"decided", "decided">>', "tpPause": "1",
      "localStatus": "<<0, 0>>"}),
    ("State 4: <MCInterrupt line 1, col 1 to line 2, col 2 of module M>",
     {"hs": '<<"idle">>', "count": "<<0, 0>>", "phase": '<<"decided", "decided">>', "tpPause": "1",
      "localStatus": "<<0, 0>>"}),
    ("State 5: <MCRequestStop line 1, col 1 to line 2, col 2 of module M>",
     {"hs": '<<"idle">>', "count": "<<0, 0>>", "phase": '<<"decided", "decided">>', "tpPause": "1",
      "localStatus": "<<0, 1>>"}),
    ("State 6: Stuttering", {}),
]  # fmt: skip


def test_a_counterexample_is_read_as_threads_and_arrows():
    steps = diagrams.sequence_steps(TRACE)
    assert [s.action for s in steps] == [
        "initial state", "RequestPause", "AllReduce", "Interrupt", "RequestStop", "Stuttering",
    ]  # fmt: skip
    pause, reduce, interrupt, stop = steps[1:5]
    holder, loop2 = diagrams.Lifeline("holder", 1), diagrams.Lifeline("loop", 2)
    assert (pause.actor, pause.target) == (holder, loop2)  # the holder's call reaches its rank's loop (rank 2)
    assert reduce.actor is None and reduce.changes == {"phase": '<<"decided", "decided">>', "tpPause": "1"}
    assert (interrupt.actor, interrupt.target) == (diagrams.Lifeline("environment"), holder)
    assert loop2 in interrupt.touched  # the withdrawn request changed rank 2's count too
    assert (stop.actor, stop.target) == (diagrams.Lifeline("environment"), loop2)
    svg = diagrams.sequence_svg(TRACE, "a title")
    for text in ("environment", "holder", "loop, rank 1", "loop, rank 2", "AllReduce (TP group)", "a title",
                 "nothing can change any more"):  # fmt: skip
        assert text in svg, text


def test_a_liveness_loop_back_is_drawn_as_one():
    trace = [*TRACE[:5], ("Back to state 2: <MCRequestPause line 1, col 1 to line 2, col 2 of module M>", {})]
    steps = diagrams.sequence_steps(trace)
    assert steps[-1].action == "Back to state 2 by RequestPause" and steps[-1].actor is None
    assert "Back to state 2 by RequestPause: the behaviour repeats from there for ever" in diagrams.sequence_svg(trace)


def test_an_invariants_counterexample_ends_with_the_verdict():
    svg = diagrams.sequence_svg(TRACE[:5], verdict="CountsInv is violated in this state")
    assert "CountsInv is violated in this state" in svg
    assert "nothing can change any more" not in svg
    # A violation right after a step of the TP group (drawn with no actor, like the closing lines) is still said.
    verdict = "CountsInv is violated in this state"
    assert verdict in diagrams.sequence_svg(TRACE[:3], verdict=verdict)


# --------------------------------------------------------------------------------------- the site's links


@pytest.fixture(scope="module")
def hooks():
    return load_script("mkdocs_hooks")


@pytest.mark.parametrize(
    ("text", "source", "page", "expected"),
    [
        ("[spec](../spec/PROTOCOL.md#6-requirements)", "docs", "", "[spec](protocol.md#6-requirements)"),
        ("[py](docs/python.md)", "", "", "[py](python.md)"),
        ("[tla](../tla/PauseProtocol.tla)", "spec", "", "[tla](generated/sources/PauseProtocol.tla.md)"),
        ("[the models](tla/)", "", "", "[the models](tlc.md)"),
        ("[`protocol.py`](../src/cbpause/core/protocol.py)", "docs", "", "`protocol.py`"),
        ("[t](../tests/test_holds.py)", "docs", "", "[t](generated/sources/tests/test_holds.py.md)"),
        ("[t](../../tests/test_holds.py)", "docs/sub", "sub", "[t](../generated/sources/tests/test_holds.py.md)"),
        ("![plot](bench/bench.png)", "docs", "", "![plot](bench/bench.png)"),
        ("[web](https://example.org/x.md)", "docs", "", "[web](https://example.org/x.md)"),
        ("```\n[not a link](../src/x.py)\n```", "docs", "", "```\n[not a link](../src/x.py)\n```"),
    ],
)
def test_links_are_rewritten_for_the_site(hooks, text, source, page, expected):
    assert hooks.rewrite_links(text, source, page) == expected


def test_an_include_of_a_missing_section_says_which(hooks):
    with pytest.raises(ValueError, match="no section 'nope'"):
        hooks._section("text", "nope", "README.md")
    readme = (ROOT / "README.md").read_text()
    setup = hooks._section(readme, "setup", "README.md")
    assert "nox -s tlc" in setup and "nox -s tlc core ci lint docs" in setup  # the README's two set-up commands


class _Page:
    class file:  # noqa: N801 -- the shape of mkdocs' Page.file
        src_uri = "sub/page.md"


def test_an_include_renders_the_file_with_its_links_for_the_page(hooks):
    """An included part keeps its indentation (an admonition's body) and its links are the page's."""
    md = "!!! note\n\n    <!-- include: README.md#setup -->\n"
    out = hooks.on_page_markdown(md, _Page, None, None)
    assert "    python3 -m pip install nox uv && python3 -m nox -s tlc core ci lint docs" in out
    assert "<!-- include" not in out
    readme = hooks.on_page_markdown("<!-- include: README.md#reading -->", _Page, None, None)
    assert "[`spec/PROTOCOL.md`](../protocol.md)" in readme  # README's link, from a page in sub/


def test_an_include_of_a_missing_file_names_the_page(hooks):
    with pytest.raises(FileNotFoundError, match="sub/page.md: include of nowhere.md"):
        hooks.on_page_markdown("<!-- include: nowhere.md -->", _Page, None, None)


def test_every_defect_model_has_its_picture_on_the_defects_page():
    """A model that finds an upstream defect (named ..._D<n>) is drawn, and the defects page shows it."""
    found = {m.name for m in load_manifest(ROOT / "tla") if re.search(r"_D\d+$", m.name)}
    assert found == set(diagrams.DEFECT_MODELS.values())
    page = (ROOT / "docs" / "defects.md").read_text()
    for defect, model in diagrams.DEFECT_MODELS.items():
        assert model.endswith(f"_{defect}")
        assert f"## {defect}: " in page and f"](generated/{defect}.svg)" in page, defect
        assert f"<!-- include: generated/{defect}.txt -->" in page, defect
