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
import os
import shutil
import subprocess
import sys

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


def nothing_lost(out: str, prefix: str, *zero: str) -> None:
    fields = last_fields(out, prefix)
    for name in ("lost", "duplicated", "hangs", *zero):
        assert fields[name] == "0", (name, fields)


# What each brief run must show, beyond exiting 0.
CHECKS = {
    "tlc": lambda out, tmp: "Upstream_D1" in out and "PauseProtocol_1r2h" in out,
    "tlc_deep": lambda out, tmp: "IndInv_1r2h" in out and "PauseProtocol_1r2h: " in out and "same graph" in out,
    "crosshair": lambda out, tmp: True,
    "fuzz": lambda out, tmp: "1 passed" in out,
    "traces": lambda out, tmp: last_fields(out, "traces:")["rejected"] == "0",
    "traces_real": lambda out, tmp: last_fields(out, "traces:")["rejected"] == "0",
    "bench": lambda out, tmp: (tmp / "bench.json").is_file(),
    "gpu": lambda out, tmp: (tmp / "gpu.json").is_file(),
    "hostile": lambda out, tmp: "2 of 2 probes OK" in out,
    "soak": lambda out, tmp: nothing_lost(out, "soak:") is None,
    "soak_http": lambda out, tmp: nothing_lost(out, "soak-http:", "wrong") is None,
}


def brief(name: str):
    layer = noxfile.ENV_LAYER[noxfile.SESSION_ENV[name]]
    return pytest.param(name, id=name, marks=[pytest.mark.layer(layer)])


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


@pytest.mark.parametrize("name", [brief(n) for n in sorted(noxfile.COMMANDS)])
def test_the_session_runs_briefly(name, tmp_path):
    if shutil.which("java") is None and name in ("tlc_deep", "traces", "traces_real"):
        pytest.skip("java is not installed")
    out = []
    for argv, env in noxfile.COMMANDS[name]["brief"](str(tmp_path)):
        exe = shutil.which(argv[0], path=os.path.dirname(sys.executable)) or shutil.which(argv[0])
        command = [sys.executable, *argv[1:]] if argv[0] == "python" else [exe or argv[0], *argv[1:]]
        done = subprocess.run(command, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True,
                              timeout=HANG_S)  # fmt: skip
        out.append(done.stdout + done.stderr)
        assert done.returncode == 0, f"{name}: {' '.join(argv)} exited {done.returncode}\n{''.join(out)[-4000:]}"
    assert CHECKS[name]("".join(out), tmp_path), "".join(out)[-4000:]
