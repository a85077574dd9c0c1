"""The cache of TLC runs (cbpause.tlc.cache) serves a run only for the spec, witnesses and options it was made from,
never a damaged entry, and ``--fresh`` replaces what it holds; the runner's command line refuses what it cannot
do before any TLC runs.  No TLC here: the runs are stand-ins (found by a hostile review of issue 38)."""

from __future__ import annotations

import dataclasses

import pytest

from cbpause.tlc import load_manifest
from cbpause.tlc import models as runner
from cbpause.tlc.cache import Cache
from cbpause.tlc.launcher import TLCError

from .conftest import TLA_DIR

pytestmark = pytest.mark.layer("core")


def _kept(tmp_path, output="TLC says ok\n", graph_text=None):
    cache = Cache(tmp_path / "cache")
    graph = None
    if graph_text is not None:
        graph = tmp_path / "g.dot"
        graph.write_text(graph_text)
    cache.put("k", output, 1.5, graph)
    return cache


def test_a_kept_run_is_read_back_whole(tmp_path):
    cache = _kept(tmp_path, graph_text="digraph {}")
    output, seconds, graph = cache.get("k")
    assert (output, seconds, graph.read_text()) == ("TLC says ok\n", 1.5, "digraph {}")
    assert cache.get("other") is None


@pytest.mark.parametrize("damage", ["truncate output", "remove output", "garble done", "remove done", "remove graph",
                                    "alter graph"])  # fmt: skip
def test_a_damaged_entry_is_no_entry_and_the_next_run_replaces_it(tmp_path, damage):
    cache = _kept(tmp_path, output="x" * 1000, graph_text="digraph { a -> b }")
    entry = cache.folder / "k"
    {
        "truncate output": lambda: (entry / "output.txt").write_text("x" * 300),
        "remove output": lambda: (entry / "output.txt").unlink(),
        "garble done": lambda: (entry / "done.txt").write_text("not a number"),
        "remove done": lambda: (entry / "done.txt").unlink(),
        "remove graph": lambda: (entry / "graph.dot").unlink(),
        "alter graph": lambda: (entry / "graph.dot").write_text("digraph {}"),
    }[damage]()
    assert cache.get("k") is None
    graph = tmp_path / "g2.dot"
    graph.write_text("digraph { a -> b }")
    cache.put("k", "x" * 1000, 2.0, graph)
    assert cache.get("k")[:2] == ("x" * 1000, 2.0)


def test_a_whole_entry_stays_and_fresh_replaces_it(tmp_path):
    cache = _kept(tmp_path)
    cache.put("k", "another run\n", 9.0, None)  # a second writer of the same key: the kept run stays
    assert cache.get("k")[0] == "TLC says ok\n"
    fresh = Cache(cache.folder, read=False)
    assert fresh.get("k") is None  # --fresh never reads ...
    fresh.put("k", "the fresh run\n", 3.0, None)  # ... and its run takes the entry's place
    assert cache.get("k")[:2] == ("the fresh run\n", 3.0)
    assert sorted(p.name for p in cache.folder.iterdir()) == ["k"]  # nothing left aside


def test_the_key_covers_the_witnesses_a_run_observes():
    """A witness added to or removed from the manifest is another run: the observer module is in the key."""
    model = {m.name: m for m in load_manifest(TLA_DIR)}["StopTeardown_cbpause"]
    fewer = dataclasses.replace(model, witnesses=model.witnesses[:1])
    assert runner._observer(model, TLA_DIR) != runner._observer(fewer, TLA_DIR)
    assert runner._observer(dataclasses.replace(model, witnesses=()), TLA_DIR) is None


def test_an_action_witness_is_broken_only_by_a_step_that_changes_the_variables():
    """[][~XStep]_vars allows a stuttering XStep step: the observer must not count one."""
    model = {m.name: m for m in load_manifest(TLA_DIR)}["PauseProtocol_1r2h"]
    text = runner._observer(model, TLA_DIR)
    assert "(ResumesStep /\\ vars' # vars)" in text


def test_a_witness_the_observer_cannot_read_is_an_error_before_any_run(tmp_path):
    model = {m.name: m for m in load_manifest(TLA_DIR)}["PauseProtocol_1r2h"]
    odd = dataclasses.replace(model, witnesses=("action-property:NeverRestartsWitness",))
    with pytest.raises(TLCError, match="must be written"):
        runner.run_models([odd], TLA_DIR, jobs=1, workers=1)


@pytest.mark.parametrize("argv, says", [
    (["--jobs", "0"], "must be 1 or more"),
    (["--workers", "-2"], "must be 1 or more"),
    (["--model", "Upstream_D2", "--suite", "fast"], "give one"),
])  # fmt: skip
def test_the_runner_refuses_bad_arguments(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        runner.main(argv)
    assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_a_cache_folder_that_cannot_keep_runs_is_refused_before_tlc_runs(tmp_path, capsys, monkeypatch):
    not_a_folder = tmp_path / "afile"
    not_a_folder.write_text("")
    monkeypatch.setattr(runner, "find_java", lambda: "java")
    monkeypatch.setattr(runner, "find_jar", lambda: tmp_path / "tla2tools.jar")

    def no_tlc(*args, **kwargs):
        raise AssertionError("TLC ran")

    monkeypatch.setattr(runner, "run_models", no_tlc)
    assert runner.main(["--model", "Upstream_D2", "--cache", str(not_a_folder)]) == 2
    assert "cannot keep runs" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--real", "--covering", "--count", "3"],
    ["--real", "--covering", "--plans", "kill_*"],
    ["--real", "--covering", "--record", "r.txt"],
    ["--real", "--plans", "kill_*", "--record", "r.txt"],
    ["--real", "--repeat", "5"],
    ["--covering"],
])  # fmt: skip
def test_the_scenarios_refuse_flags_they_would_ignore(argv, capsys):
    from cbpause.apps.scenarios.__main__ import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2 and "error:" in capsys.readouterr().err
