import shutil
import signal
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


@pytest.fixture(autouse=True)
def sigint_raises_keyboard_interrupt():
    """Tests deliver real SIGINTs; make sure SIGINT raises KeyboardInterrupt in the main thread.

    A process started in the background by a non-interactive shell inherits SIGINT as ignored, and Python
    then leaves it ignored: the interrupt would never arrive and the waiter would wait for ever.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(autouse=True)
def end_leftover_fake_loops():
    """A test that fails (or xfails) before stopping its fake loop must not leave it stepping."""
    yield
    from .fakeloop import end_leftover_loops

    end_leftover_loops()
