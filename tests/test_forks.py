"""cbpause.testing.forks: a child of the preloaded fork server behaves as ``python -m module`` would for what the
harness reads of it: its arguments, environment, output, exit status (a signal's as ``-signum``), ``atexit``."""

import os
import signal
import subprocess

import pytest

from cbpause.testing import HANG_S, forks

pytestmark = pytest.mark.layer("loop")


def test_a_forked_main_gets_its_argv_environment_and_log_and_runs_atexit(tmp_path):
    log, out = tmp_path / "log", tmp_path / "out"
    env = {**os.environ, "CBPAUSE_FORK_TEST": "given"}
    process = forks.start("tests.fork_target", [str(out), "3"], env, str(log))
    assert process.wait(HANG_S) == 3 and process.returncode == 3 and process.poll() == 3
    assert log.read_text().splitlines()[0] == f"argv={[str(out), '3']} env=given"
    assert out.read_text() == "atexit ran"
    assert "CBPAUSE_FORK_TEST" not in os.environ  # the parent's environment is its own


def test_a_forked_child_reports_a_signal_and_a_wait_that_runs_out(tmp_path):
    process = forks.start("tests.fork_target", [str(tmp_path / "out"), "wait"], dict(os.environ), os.devnull)
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(0.01)
    assert process.poll() is None
    process.terminate()
    assert process.wait(HANG_S) == -signal.SIGTERM
    process.kill()  # after its end: nothing to signal, no error
