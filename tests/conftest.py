import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TLA_DIR = ROOT / "tla"


def _tlc_available() -> str | None:
    if shutil.which("java") is None:
        return "java is not installed"
    try:
        from cbpause.tlc import find_jar

        find_jar()
    except Exception as exc:  # noqa: BLE001 - any reason to skip is reported
        return str(exc)
    return None


@pytest.fixture(scope="session")
def tlc_ready() -> None:
    """TLC must be runnable; in CI (CI=true) a missing TLC is a failure, not a skip."""
    import os

    reason = _tlc_available()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"TLC is required in CI: {reason}")
        pytest.skip(reason)


@pytest.fixture
def tla_copy(tmp_path: Path) -> Path:
    """A private copy of tla/ that a test may mutate."""
    dest = tmp_path / "tla"
    shutil.copytree(TLA_DIR, dest)
    return dest
