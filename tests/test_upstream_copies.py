"""The integration is tied to the transformers it was checked against by fingerprints, and copies none of it.

Every upstream function the integration overrides, wraps or restates has a fingerprint
(``cbpause.integrations.upstream``): a change anywhere in one of them fails here, and so does upstream ceasing to
call a method the integration wraps.  And no four consecutive lines of the project (normalised: no blank or
comment lines, no trailing comments, no signatures -- an override has its upstream's --, module aliases read as
upstream's names) are four consecutive lines of one of those upstream functions: the behaviour is reached by
calling upstream or said in the project's own words.
"""

from __future__ import annotations

import importlib.util
import inspect
import re

import pytest

pytest.importorskip("transformers")

from .conftest import ROOT  # noqa: E402

pytestmark = pytest.mark.layer("loop")

SRC = ROOT / "src" / "cbpause"
RUN = 4  # consecutive lines that make a copy


def normalise(lines: list[str]) -> list[str]:
    out, signature = [], False
    for line in lines:
        line = re.sub(r"\s+#\s.*$", "", line).strip()
        if line.startswith("def ") and not line.endswith(":"):
            signature = True  # an override's signature is its upstream's, by necessity: left out
        if signature:
            signature = not line.endswith(":")
            continue
        if not line or line.startswith("#"):
            continue
        line = re.sub(r"\b_api\.", "", line)
        line = re.sub(r"\b_dist\.", "dist.", line)
        out.append(line)
    return out


def runs(lines: list[str]) -> set[tuple[str, ...]]:
    """Every ``RUN`` consecutive lines, but those made of short lines only (``)``, ``else:``, ``return False``)."""
    found = set()
    for i in range(len(lines) - RUN + 1):
        run = tuple(lines[i : i + RUN])
        if sum(len(line) > 16 for line in run) >= 2:
            found.add(run)
    return found


def upstream_runs() -> dict[tuple[str, ...], str]:
    from cbpause.integrations import upstream

    found = {}
    for name in upstream.fingerprints():
        obj = upstream.upstream_function(name)
        source = inspect.getsource(obj.fget if isinstance(obj, property) else obj).splitlines()
        for run in runs(normalise(source)):
            found[run] = name
    return found


def copied(text: str, theirs: dict[tuple[str, ...], str]) -> list[str]:
    return [f"{theirs[run]}: {' / '.join(run)}" for run in runs(normalise(text.splitlines())) if run in theirs]


def test_no_line_of_transformers_is_copied_into_the_project():
    theirs = upstream_runs()
    found = {str(path.relative_to(ROOT)): copied(path.read_text(), theirs) for path in sorted(SRC.rglob("*.py"))}
    assert {path: runs for path, runs in found.items() if runs} == {}


def test_a_copy_would_be_noticed():
    from cbpause.integrations import upstream

    source = inspect.getsource(upstream.upstream_function("continuous_api.ContinuousBatchingManager.stop"))
    planted = (SRC / "integrations" / "transformers.py").read_text() + "\n".join(source.splitlines()[-6:])
    assert copied(planted, upstream_runs())


# ------------------------------------------------------------------------------ fingerprints (issue 27, point 5)


def overridden() -> set[str]:
    """Every upstream function a class of the integration overrides (a method or property its class or a mixin
    defines, which an upstream base defines too), as the table names it (``upstream.upstream_name``)."""
    from cbpause.integrations import admission, modes, upstream
    from cbpause.integrations import transformers as cbt

    ours = [cbt.PausableContinuousBatchingManager, cbt.PausableBatchProcessor, admission.TrackingRouter,
            modes.RetractedRequestState]  # fmt: skip
    if importlib.util.find_spec("fastapi") is not None and upstream.release() in upstream.SERVED:  # the serve extra
        from cbpause.integrations import serving

        server = serving._server()
        ours += [getattr(server, name) for name in server.__all__ if isinstance(getattr(server, name), type)]
    found = set()
    for cls in ours:
        for klass in (k for k in cls.__mro__ if k.__module__.startswith("cbpause")):
            for name, value in vars(klass).items():
                if not (inspect.isfunction(value) or isinstance(value, property)):
                    continue
                upstream_bases = [b for b in cls.__mro__ if b.__module__.startswith("transformers") and name in vars(b)]
                if upstream_bases:
                    found.add(upstream.upstream_name(upstream_bases[0], name))
    return found


def test_every_override_wrap_and_restatement_of_upstream_has_a_fingerprint():
    from cbpause.integrations import upstream

    callers = {c for cs in (*upstream.WRAPPED.values(), *upstream.replaced().values()) for c in cs}
    readers = {r for rs in upstream.SETS.values() for r in rs}
    touched = overridden() | set(upstream.WRAPPED) | set(upstream.replaced()) | callers | set(upstream.RESTATED)
    touched |= readers
    touched |= set(upstream.REMOVED_ROUTES.values())
    touched -= upstream.dropped()
    if upstream.release() not in upstream.SERVED:  # the server's are neither overridden nor checked there
        touched = {name for name in touched if not name.startswith("cli.")}
    assert touched == set(upstream.fingerprints())
    later = set(upstream.fingerprints()) - set(upstream.fingerprints("5.23"))
    assert all(name.startswith("cli.") for name in later), "a loop function only a later release has"


def test_the_private_attributes_set_and_the_routes_removed_are_the_table_s():
    """The serving modules and the manager set exactly the upstream attributes of ``SETS`` (each still assigned by
    upstream's class), and the serving module removes exactly the routes of ``REMOVED_ROUTES`` (each still declared by
    the function that builds the app)."""
    from cbpause.integrations import upstream

    if upstream.release() not in upstream.SERVED:
        pytest.skip(f"the serving module does not run on transformers {upstream.release()}")
    pytest.importorskip("fastapi")
    from cbpause.integrations import serving

    server = serving._server().__name__.rsplit(".", 1)[1]
    text = "".join((SRC / "integrations" / f"{module}.py").read_text() for module in ("serving", server))
    assigned = {f"_{name}" for name in re.findall(r"\bstate\._(\w+)", text)}
    assigned |= set(re.findall(r"\brouter\.(\w+)\[\w+\] = ", text))  # an entry of upstream's output router
    assigned |= set(re.findall(r"\brouter\.(\w+)\.pop\(", text))  # one taken out
    manager = (SRC / "integrations" / "transformers.py").read_text()  # the manager's own upstream attributes replaced
    assigned |= {name for name in re.findall(r"\bself\.(\w+) = ", manager)
                 if any(k.endswith(f"ContinuousBatchingManager.{name}") for k in upstream.SETS)}
    sets = {name: readers for name, readers in upstream.SETS.items() if readers[0] not in upstream.dropped()}
    assert assigned == {k.rsplit(".", 1)[1] for k in sets}
    for name, readers in sets.items():
        attribute = name.rsplit(".", 1)[1]
        init = inspect.getsource(upstream.upstream_function(readers[0]))
        assert re.search(rf"self\.{attribute}\b", init), f"{readers[0]} no longer sets {attribute}"
    for route, builder in upstream.REMOVED_ROUTES.items():
        source = inspect.getsource(upstream.upstream_function(builder))
        assert re.search(rf"@app\.\w+\(\"{re.escape(route)}\"\)", source), f"{builder} no longer declares {route}"
    assert "upstream.REMOVED_ROUTES" in text


def test_upstream_is_the_transformers_the_integration_was_checked_against():
    """A change anywhere in an upstream function the integration overrides, wraps or restates fails here, naming
    it; ``python -m cbpause.integrations.upstream`` prints the new table once the change has been reviewed."""
    from cbpause.integrations import upstream

    release = upstream.release()
    assert release in upstream.CHECKED_WITH, f"transformers {release} was never checked"
    changed = [name for name, digest in upstream.fingerprints().items() if upstream.fingerprint(name) != digest]
    assert changed == [], f"changed upstream since transformers {upstream.CHECKED_WITH[release]}: {changed}"


def test_upstream_still_calls_what_the_integration_wraps():
    from cbpause.integrations import upstream

    checked = upstream.fingerprints()
    for wrapped, callers in (*upstream.WRAPPED.items(), *upstream.replaced().items()):
        method = wrapped.rsplit(".", 1)[1]
        for caller in (c for c in callers if c in checked):
            source = inspect.getsource(upstream.upstream_function(caller))
            assert re.search(rf"\.{method}\(", source), f"{caller} no longer calls {method}"


def test_the_stamps_on_upstream_objects_are_the_table_s():
    stamped = set()
    for path in (ROOT / "src" / "cbpause" / "integrations").glob("*.py"):
        stamped |= set(re.findall(r"\._cbpause_(\w+)\s*=", path.read_text()))
    from cbpause.integrations import upstream

    assert {f"_cbpause_{name}" for name in stamped} == set(upstream.STAMPS)


def test_a_changed_upstream_function_fails_its_fingerprint(monkeypatch):
    from cbpause.integrations import upstream

    name = "continuous_api.ContinuousBatchingManager.stop"
    real = inspect.getsource
    monkeypatch.setattr(inspect, "getsource", lambda obj: real(obj) + "\n    pass\n")
    assert upstream.fingerprint(name) != upstream.fingerprints()[name]


def test_each_release_s_table_is_5_23_s_with_the_changes_reviewed():
    """The table of a later release is 5.23.0's with what that release changed (``CHANGED_IN``, each change said in
    a comment), and the server's names only where the serving module runs."""
    from cbpause.integrations import upstream

    assert set(upstream.CHECKED_WITH) == set(upstream.CHANGED_IN) | {"5.23"}
    for minor, changes in upstream.CHANGED_IN.items():
        new = set(changes) - set(upstream.FINGERPRINTS)
        assert all(name.startswith("cli.") and changes[name] is not None for name in new), minor  # a server's only
        assert upstream.dropped(minor) <= set(upstream.FINGERPRINTS), minor
        table = upstream.fingerprints(minor)
        assert all(table[name] == digest for name, digest in changes.items() if name in table)
        assert any(name.startswith("cli.") for name in table) == (minor in upstream.SERVED)
    newest = max(upstream.CHECKED_WITH, key=upstream._key)
    assert upstream.fingerprints("5.99") == upstream.fingerprints(newest)  # an unchecked release: the newest's


def test_the_supported_releases_are_one_list():
    """The releases the integration accepts, the ones fingerprinted, the nox matrix and the pins agree (one home per
    fact: docs/transformers-releases.md's steps name each copy)."""
    import tomllib

    pytest.importorskip("nox")
    spec = importlib.util.spec_from_file_location("cbpause_noxfile", ROOT / "noxfile.py")
    noxfile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(noxfile)
    from cbpause.integrations import transformers as cbt
    from cbpause.integrations import upstream

    assert set(cbt.SUPPORTED) == set(upstream.CHECKED_WITH) == set(noxfile.RELEASES)
    assert noxfile.RELEASES == upstream.CHECKED_WITH and noxfile.SERVED == upstream.SERVED
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    newest, served = max(cbt.SUPPORTED, key=upstream._key), max(upstream.SERVED, key=upstream._key)
    assert f"transformers>=5.23.0,<{_next(newest)}" in extras["transformers"]
    assert f"transformers>=5.23.0,<{_next(served)}" in extras["serve"]


def _next(minor: str) -> str:
    major, number = minor.split(".")
    return f"{major}.{int(number) + 1}"
