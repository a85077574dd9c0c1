"""Every block the integration copied from transformers is still what the installed transformers says.

The integration marks each copy: ``# copied from transformers (<file>, <Class.function>)`` ... ``# end of
copy`` (``, with model for self`` where a method became a function).  The copy, normalised (no blank or
comment lines, no trailing comments, the integration's module aliases ``_api.`` and ``_dist.`` read as
upstream's names), must stand as consecutive lines in upstream's function, normalised the same way.
Should a transformers release change the original, this fails and names the copy.

Beyond the copies: every upstream function the integration overrides, wraps or copies from has a fingerprint
(``cbpause.integrations.upstream``), so that a change anywhere in one of them fails here, and so does upstream
ceasing to call a method the integration wraps.
"""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

pytest.importorskip("transformers")

from .conftest import ROOT  # noqa: E402

INTEGRATION = ROOT / "src" / "cbpause" / "integrations" / "transformers.py"
_MARK = re.compile(r"^\s*# copied from transformers \(([\w/.]+), ([\w.]+)\)(, with (\w+) for (\w+))?\s*$")


def normalise(lines: list[str], renames: dict[str, str] | None = None) -> list[str]:
    out = []
    for line in lines:
        line = re.sub(r"\s+#\s.*$", "", line).strip()
        if not line or line.startswith("#"):
            continue
        line = re.sub(r"\b_api\.", "", line)
        line = re.sub(r"\b_dist\.", "dist.", line)
        for ours, theirs in (renames or {}).items():
            line = re.sub(rf"\b{ours}(?=\.\w|[,)])", theirs, line)  # code, not prose in strings
        out.append(line)
    return out


def copies() -> list[tuple[int, str, str, dict[str, str], list[str]]]:
    """(line, upstream file, upstream function, renames, the copied lines) for every marked block."""
    lines = INTEGRATION.read_text().splitlines()
    found, start = [], None
    for n, line in enumerate(lines, 1):
        m = _MARK.match(line)
        if m:
            assert start is None, f"line {n}: a copy starts inside the copy of line {start[0]}"
            renames = {m.group(4): m.group(5)} if m.group(3) else {}
            start = (n, m.group(1), m.group(2), renames)
        elif line.strip() == "# end of copy":
            assert start is not None, f"line {n}: an end of copy with no start"
            found.append((*start, lines[start[0] : n - 1]))
            start = None
    assert start is None, f"the copy of line {start[0]} never ends"
    return found


def upstream_source(file: str, function: str) -> list[str]:
    module = importlib.import_module("transformers.generation.continuous_batching." + file.removesuffix(".py"))
    obj = module
    for part in function.split("."):
        obj = getattr(obj, part)
    return inspect.getsource(obj).splitlines()


def contains(haystack: list[str], needle: list[str]) -> bool:
    return any(haystack[i : i + len(needle)] == needle for i in range(len(haystack) - len(needle) + 1))


def test_the_integration_marks_its_copies():
    found = copies()
    assert len(found) >= 8
    assert {function for _, _, function, _, _ in found} >= {
        "ContinuousBatchProcessor._update_tp_group_state",
        "ContinuousBatchingManager.stop",
        "ContinuousBatchingManager._handle_critical_error",
        "ContinuousMixin.init_continuous_batching",
    }


@pytest.mark.parametrize("copy", copies(), ids=lambda c: f"line{c[0]}")
def test_each_copy_still_matches_the_installed_transformers(copy):
    line, file, function, renames, lines = copy
    ours = normalise(lines, renames)
    assert ours, f"line {line}: an empty copy"
    theirs = normalise(upstream_source(file, function))
    assert contains(theirs, ours), (
        f"the copy at src/cbpause/integrations/transformers.py:{line} no longer matches transformers' "
        f"{file} {function}: review the change upstream and update the copy\nours:\n" + "\n".join(ours)
    )


def test_a_changed_original_is_noticed():
    line, file, function, renames, lines = copies()[0]
    changed = [ln.replace("payload", "load") for ln in upstream_source(file, function)]
    assert not contains(normalise(changed), normalise(lines, renames))


# ------------------------------------------------------------------------------ fingerprints (issue 27, point 5)


def overridden() -> set[str]:
    """Every upstream function a class of the integration overrides (a method or property its class or a mixin
    defines, which an upstream base defines too), as ``module.Class.function``."""
    from cbpause.integrations import admission, modes
    from cbpause.integrations import transformers as cbt

    package = "transformers.generation.continuous_batching."
    ours = [cbt.PausableContinuousBatchingManager, cbt.PausableBatchProcessor, admission.TrackingRouter,
            modes.RetractedRequestState]  # fmt: skip
    found = set()
    for cls in ours:
        for klass in (k for k in cls.__mro__ if k.__module__.startswith("cbpause")):
            for name, value in vars(klass).items():
                if not (inspect.isfunction(value) or isinstance(value, property)):
                    continue
                upstream = [b for b in cls.__mro__ if b.__module__.startswith("transformers") and name in vars(b)]
                base = upstream[0] if upstream else None
                if base is not None:
                    found.add(f"{base.__module__.removeprefix(package)}.{base.__qualname__}.{name}")
    return found


def test_every_override_wrap_and_copy_of_upstream_has_a_fingerprint():
    from cbpause.integrations import upstream

    callers = {c for cs in upstream.WRAPPED.values() for c in cs}
    copied = {f"{file.removesuffix('.py')}.{function}" for _, file, function, _, _ in copies()}
    assert overridden() | set(upstream.WRAPPED) | callers | copied == set(upstream.FINGERPRINTS)


def test_upstream_is_the_transformers_the_integration_was_checked_against():
    """A change anywhere in an upstream function the integration overrides, wraps or copies fails here, naming
    it; ``python -m cbpause.integrations.upstream`` prints the new table once the change has been reviewed."""
    from cbpause.integrations import upstream

    changed = [name for name, digest in upstream.FINGERPRINTS.items() if upstream.fingerprint(name) != digest]
    assert changed == [], f"changed upstream since transformers {upstream.CHECKED_WITH}: {changed}"


def test_upstream_still_calls_what_the_integration_wraps():
    from cbpause.integrations import upstream

    for wrapped, callers in upstream.WRAPPED.items():
        method = wrapped.rsplit(".", 1)[1]
        for caller in callers:
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
    assert upstream.fingerprint(name) != upstream.FINGERPRINTS[name]
