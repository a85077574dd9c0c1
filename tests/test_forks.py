"""cbpause.testing.forks: a child of the preloaded fork server behaves as ``python -m module`` would for what the
harness reads of it: its arguments, environment, output, exit status (a signal's as ``-signum``), ``atexit``."""

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

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


def _script(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (its own fork server), run from the checkout."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=HANG_S)  # fmt: skip


def _ends(pid: int) -> bool:
    """Whether process ``pid`` has ended or ends within HANG_S (its pidfd is readable once it has exited)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], HANG_S)[0])
    finally:
        os.close(fd)


def test_a_child_dies_with_its_fork_server(tmp_path):
    """Hostile review: a fork server killed left its children running, listening, and reported as exited."""
    done = _script(f"""
import os, signal
from multiprocessing import forkserver
from cbpause.testing import forks, HANG_S
child = forks.start("tests.fork_target", [{str(tmp_path / "out")!r}, "wait"], dict(os.environ), os.devnull)
os.kill(forkserver._forkserver._forkserver_pid, signal.SIGKILL)
print(child.pid, child.wait(HANG_S))
""")
    assert done.returncode == 0, done.stderr
    pid, code = map(int, done.stdout.split())
    assert code != 0 and _ends(pid)


def test_a_child_that_ignores_sigterm_does_not_hang_its_parent_s_exit(tmp_path):
    """Hostile review: multiprocessing's exit waited without bound for a child that ignores SIGTERM."""
    done = _script(f"""
import os
from cbpause.testing import forks
child = forks.start("tests.fork_target", [{str(tmp_path / "out")!r}, "ignore_term"], dict(os.environ), os.devnull)
print(child.pid, flush=True)
""")
    assert done.returncode == 0, done.stderr
    assert _ends(int(done.stdout.split()[0]))


def _write_probe(rank: int, out: str) -> None:
    import torch

    with open(f"{out}.{rank}", "w") as f:
        f.write(f"{os.environ.get('CBPAUSE_FORK_TEST')} {torch.get_num_threads()}")


def test_a_rank_gets_the_environment_of_the_moment_it_is_started(tmp_path, monkeypatch):
    """Hostile review: a rank had the fork server's environment, frozen at its first start."""
    from cbpause.testing import spawn_ranks

    assert spawn_ranks(_write_probe, (str(tmp_path / "a"),), 1, HANG_S) == []  # the fork server runs from here
    monkeypatch.setenv("CBPAUSE_FORK_TEST", "later")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert spawn_ranks(_write_probe, (str(tmp_path / "b"),), 2, HANG_S) == []
    assert [(tmp_path / f"b.{r}").read_text() for r in range(2)] == ["later 1", "later 1"]


def test_a_tp_rank_that_exits_at_start_fails_the_engine_s_wait_at_once_named(tmp_path):
    """Hostile review: a bad option on rank 1 alone left rank 0 waiting for its peer until the 300-s health wait
    ran out, and the message named the server that waited, not the one that exited."""
    from cbpause.testing.servers import serve_tp_processes
    from cbpause.testing.trl_cpu import save_tiny_policy

    checkpoint = save_tiny_policy(tmp_path / "tiny", vocab_size=32)  # rank 0 starts well and waits for its peer
    with pytest.raises(RuntimeError, match=r"TP rank 1 exited with 2 before"):  # argparse's exit status
        with serve_tp_processes(checkpoint, 2, rank_args=[(), ("--bogus",)]):
            pass
