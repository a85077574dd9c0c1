"""Every named session runs: its own commands (``noxfile.COMMANDS``), with brief arguments, in an environment the
session itself installs.

A session installs one of ``noxfile.ENVIRONMENTS`` and nothing else, so a brief run in a test of the layer whose
session installs the same environment (``core`` for the light one, ``system`` for the full one) shows that the
session's commands run with what it installs: nothing missing, no argument its tools refuse (``nox -s fuzz`` once
passed ``--timeout`` to a pytest without pytest-timeout).  ``bench -- --trl`` and ``bench -- --http`` run through the
same ``main()`` in ``tests/test_trl.py`` and ``tests/test_serve.py``; the main job (``nox -s tlc``) and the docs run in
full in CI.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cbpause.testing import HANG_S

from .conftest import ROOT

pytest.importorskip("nox")
_spec = importlib.util.spec_from_file_location("cbpause_noxfile", ROOT / "noxfile.py")
noxfile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(noxfile)

pytestmark = pytest.mark.layer("core")


def last_fields(out: str, prefix: str) -> dict[str, str]:
    """The ``key=value`` fields of the last line that starts with ``prefix``."""
    line = [ln for ln in out.splitlines() if ln.startswith(prefix)][-1]
    return dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)


def bench_report(out: str, tmp: Path) -> None:
    """The bench's overhead case (its brief run) writes both implementations' rows, each with a ratio."""
    assert "per-iteration checks" in out
    rows = json.loads((tmp / "bench.json").read_text())["rows"]
    assert [row["case"] for row in rows] == ["1", "1b"]
    for row in rows:
        assert row["upstream"]["median"] > 0 and row["cbpause"]["median"] > 0 and "ratio" in row


def gpu_report(out: str, tmp: Path) -> None:
    """Without a GPU the CUDA tests are collected and skipped, the bench's stand-in runs on the CPU, and the report
    says that the CUDA parts were skipped (with one, the check runs in full: nox -s gpu)."""
    report = json.loads((tmp / "gpu.json").read_text())
    if report["device"]["cuda"]:
        assert report["tests"]["exit"] == 0 and report["tests"]["failures"] == 0
        return
    assert "no CUDA device" in report["device"]["why"]
    tests = report["tests"]
    assert tests["exit"] == 0 and tests["skipped"] > 0 and tests["passed"] == 0 and tests["failures"] == 0
    assert report["bench"]["stand_in"] and [r["case"] for r in report["bench"]["rows"]] == ["1", "1b"]
    md = (tmp / "gpu.md").read_text()
    assert "The CUDA parts were skipped" in md and "| 1 | per-iteration checks |" in md


def hostile_table(out: str, tmp: Path) -> None:
    """A covering pair of probes through the runner itself (a process each, a deadline each): both OK."""
    assert "2 of 2 probes OK" in out
    for probe in ("dropin_status_before_mark_as_stopped", "same_thread_escalation"):
        assert any(line.split()[:2] == [probe, "OK"] for line in out.splitlines()), probe


def _true(out: str, tmp: Path) -> None:
    return None


def _contains(*needles: str):
    def check(out: str, tmp: Path) -> None:
        for needle in needles:
            assert needle in out, needle

    return check


def _fields(prefix: str, **expected: str):
    def check(out: str, tmp: Path) -> None:
        fields = last_fields(out, prefix)
        for name, value in expected.items():
            assert fields[name] == value, (name, fields)

    return check


# What each brief run must show, beyond exiting 0.
CHECKS = {
    "tlc": _contains("Upstream_D1", "PauseProtocol_1r2h"),
    "tlc_deep": _contains("IndInv_1r2h", "PauseProtocol_1r2h: ", "same graph"),
    "crosshair": _true,  # exit 0: no counterexample to any contract of leave_pause
    "fuzz": _contains("1 passed"),
    "traces": _fields("traces:", rejected="0"),
    "traces_real": _fields("traces:", rejected="0", labels="1"),
    "bench": bench_report,
    "gpu": gpu_report,
    "hostile": hostile_table,
    "soak": _fields("soak:", lost="0", duplicated="0", hangs="0"),
    "soak_http": _fields("soak-http:", lost="0", duplicated="0", hangs="0", wrong="0"),
}


# The sessions whose brief runs are tests of their own, one a command, each output checked alone: the HTTP soak's two
# (two servers, then a TP engine: half a minute each, mostly the servers' start), which CI's two processes then share.
SEPARATE = {"soak_http"}


def brief(name: str, part: int | None = None):
    layer = noxfile.ENV_LAYER[noxfile.SESSION_ENV[name]]
    return pytest.param(name, part, id=name if part is None else f"{name}-{part}", marks=[pytest.mark.layer(layer)])


def briefs() -> list:
    """One parameter a session, or one a command of its brief run for those of :data:`SEPARATE`."""
    return [brief(n, part) for n in sorted(noxfile.COMMANDS)
            for part in (range(len(noxfile.COMMANDS[n]["brief"](""))) if n in SEPARATE else [None])]  # fmt: skip


def test_every_named_session_has_a_brief_run_and_an_environment():
    assert set(CHECKS) == set(noxfile.COMMANDS)
    assert set(noxfile.SESSION_ENV.values()) <= set(noxfile.ENVIRONMENTS)
    for name in noxfile.COMMANDS:
        assert noxfile.SESSION_ENV[name] in noxfile.ENV_LAYER, name


def test_the_light_environment_has_no_torch():
    """The core's layer runs without torch: the core is the standard library (and its tests, their tools)."""
    extras = noxfile.ENVIRONMENTS["light"][1]
    assert extras == ".[dev]"
    import tomllib

    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert not any(req.split("[")[0].split(">")[0].split("=")[0].strip() in ("torch", "transformers") for req in dev)


@pytest.mark.parametrize(("name", "part"), briefs())
def test_the_session_runs_briefly(name, part, tmp_path):
    if shutil.which("java") is None and name in ("tlc_deep", "traces", "traces_real"):
        pytest.skip("java is not installed")
    out = []
    commands = noxfile.COMMANDS[name]["brief"](str(tmp_path))
    for argv, env in commands if part is None else [commands[part]]:
        exe = shutil.which(argv[0], path=os.path.dirname(sys.executable)) or shutil.which(argv[0])
        command = [sys.executable, *argv[1:]] if argv[0] == "python" else [exe or argv[0], *argv[1:]]
        done = subprocess.run(command, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True,
                              timeout=HANG_S)  # fmt: skip
        out.append(done.stdout + done.stderr)
        assert done.returncode == 0, f"{name}: {' '.join(argv)} exited {done.returncode}\n{''.join(out)[-4000:]}"
    CHECKS[name]("".join(out), tmp_path)


def test_what_ci_leaves_out_of_its_ci_session_the_same_run_makes_elsewhere():
    """CI runs each check once: its ``ci`` session leaves out the release tests and the real-loop campaign
    (``noxfile.left_to_the_newest_release``) only because the README's test command, which ``.ci/run`` runs, also
    runs the newest release's session, whose tests and campaign they are."""
    import re

    readme = (ROOT / "README.md").read_text()
    command = re.findall(r"```sh\n(python3 -m pip install nox uv && python3 -m nox [^\n]+)\n```", readme)[1]
    sessions = command.split(" -s ", 1)[1].split()
    assert "ci" in sessions and f"transformers-{noxfile.NEWEST}" in sessions, sessions
    left = noxfile.left_to_the_newest_release()
    ignored = [a.removeprefix("--ignore=") for a in left if a.startswith("--ignore=")]
    assert ignored and set(ignored) <= set(noxfile.RELEASE_TESTS)
    assert all((ROOT / f).is_file() for f in ignored)
    assert noxfile.NEWEST in noxfile.SERVED or "tests/test_serve.py" not in ignored  # skipped there: kept here
    assert left[-2:] == ["--deselect", "tests/test_sessions.py::test_the_session_runs_briefly[traces_real]"]
    assert noxfile.RELEASE_CAMPAIGN("") == noxfile.COMMANDS["traces_real"]["brief"]("")
    assert "traces_real" in noxfile.COMMANDS  # the id deselected is one of test_the_session_runs_briefly's


def test_uv_takes_what_pip_would_take():
    """An install through uv reads pip's configuration (``noxfile.uv_settings_from_pip``): without it, uv would take
    torch from PyPI (a CUDA build, several GB) instead of the CPU wheel on the machine's disk."""
    listed = "\n".join([
        ":env:.find-links='/opt/wheels'",
        "global.find-links='/elsewhere'",
        "global.constraint='/etc/xdg/pip/constraints.txt'",
        "global.extra-index-url='file:///a/simple file:///b/simple'",
        "install.index-url='https://mirror.example/simple'",
        "global.index-url='https://ignored.example/simple'",
        "global.cert='/etc/ssl/certs/ca-certificates.crt'",
        ":env:.default-timeout='180'",
    ])  # fmt: skip
    settings = noxfile.uv_settings_from_pip(listed)
    assert settings == {
        "UV_INDEX_STRATEGY": "unsafe-best-match", "UV_PYTHON_DOWNLOADS": "never",
        "UV_FIND_LINKS": "/opt/wheels", "UV_CONSTRAINT": "/etc/xdg/pip/constraints.txt",
        "UV_EXTRA_INDEX_URL": "file:///a/simple file:///b/simple", "UV_INDEX_URL": "https://mirror.example/simple",
        "SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt",
    }  # fmt: skip
    assert noxfile.uv_settings_from_pip("global.find-links='/x /y'")["UV_FIND_LINKS"] == "/x,/y"
    assert set(noxfile.uv_settings_from_pip("")) == {"UV_INDEX_STRATEGY", "UV_PYTHON_DOWNLOADS"}


def test_uv_reads_pip_s_values_as_pip_prints_them():
    """A hostile review: pip.conf's several indexes on several lines (``pip config list`` prints the newlines
    escaped) were passed to uv as one bogus URL, which uv dropped for PyPI; a value with both quotes crashed every
    install; ``no-index`` and ``trusted-host`` were dropped."""
    several = noxfile.uv_settings_from_pip("global.extra-index-url='\\nfile:///a/simple\\nfile:///b/simple'")
    assert several["UV_EXTRA_INDEX_URL"] == "file:///a/simple file:///b/simple"
    both = noxfile.uv_settings_from_pip("global.find-links='it\\'s \"x\"'")
    assert both["UV_FIND_LINKS"] == "it's,\"x\""
    assert noxfile.uv_settings_from_pip("global.trusted-host='a.example b.example'")["UV_INSECURE_HOST"] == (
        "a.example b.example"
    )
    assert noxfile.pip_flags("global.no-index='true'") == ["--no-index"]
    assert noxfile.pip_flags("global.no-index='false'") == [] and noxfile.pip_flags("") == []
