"""Processes forked from a preloaded fork server: the TP ranks (:func:`~cbpause.testing.tp.spawn_ranks`) and the
``cbpause serve`` processes (:mod:`cbpause.testing.servers`) of the tests, the campaign, the soak and the bench.

A fresh interpreter imports torch, transformers and the server's stack before it does anything: 3.5-4.5 s of CPU,
and one CI run started about fifty of them (2026-12-07).  multiprocessing's ``forkserver`` imports them once per
process (:data:`PRELOAD`, at the first start) and forks each child from there: a process of one Python thread that
has touched no device, so a child gets CUDA, gloo and its ports fresh, as a spawned one does.

What a child would differ in from a fresh interpreter, and how :func:`_enter` makes it the same:

* its environment is the fork server's (taken at its start): it installs the one it is given (``os.environ``, and
  torch's thread count from ``OMP_NUM_THREADS``);
* its output: file descriptors 1 and 2 point at the log it is given;
* multiprocessing's start method in the child is the fork server's: reset to the platform's default (under the fork
  server's, a lock tqdm takes was a named semaphore left behind by every server stopped with SIGTERM);
* numpy's global random state is the fork server's: seeded afresh (Python's ``random`` reseeds itself at a fork);
* a multiprocessing child ends in ``os._exit`` and runs no ``atexit`` handler, and ``cbpause`` registers one (the
  manager's hard stop at exit): :func:`_run_module` runs them when ``main`` returns.

And what is left to each child's end: it dies with the fork server (``PR_SET_PDEATHSIG``: else a fork server killed,
say by the OOM killer, left its servers listening, reported as exited and so never stopped), and this process kills
whatever it started that still runs when it exits (multiprocessing's own exit sends SIGTERM to daemon children and
then waits for them without bound: a child that ignores SIGTERM hung it).

Still different, and written here so that nobody relies on it: a variable a library reads when it is imported (say
``HF_HUB_OFFLINE``) has the fork server's value in the child; the ``atexit`` handlers run before, not after, the
non-daemon threads are joined; and the parent's main module is imported in each child as ``__mp_main__``, as
multiprocessing's spawn does.  Where the platform has no fork server, children are spawned (a fresh interpreter
each).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import multiprocessing
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["ForkedProcess", "context", "run_rank", "start"]

# Imported once by the fork server; one that fails to import (an environment without the serve extra) is skipped.
PRELOAD = (
    "torch", "torch.distributed", "transformers", "transformers.generation.continuous_batching", "uvicorn", "fastapi",
    "cbpause.integrations.transformers", "cbpause.integrations.serving", "cbpause.serve.__main__",
)  # fmt: skip


def context() -> Any:
    """multiprocessing's context for the children: the fork server, preloaded (:data:`PRELOAD`), else spawn."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # no effect once this process's fork server runs: it has them
    return ctx


_PR_SET_PDEATHSIG = 1


def _install(env: Mapping[str, str]) -> None:
    """The child's environment is ``env``, as a fresh interpreter started with it would have it."""
    os.environ.clear()
    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS")
    if threads and "torch" in sys.modules:  # torch read the variable when the fork server imported it
        sys.modules["torch"].set_num_threads(int(threads))
    multiprocessing.set_start_method(None, force=True)  # the platform's default, not the fork server's
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _die_with_the_fork_server() -> None:
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):  # not Linux: a fork server's death leaves its children
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    # The fork server died before the line above: while this child was still unpickling its work, or even before the
    # first line, when this child was already someone else's (init's) and the death signal will never come.
    if os.getppid() != parent or not _a_fork_server(parent):
        os._exit(1)


def _a_fork_server(pid: int) -> bool:
    """Whether process ``pid`` is a fork server of multiprocessing (True where ``/proc`` cannot tell)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return b"multiprocessing.forkserver" in cmdline.read()
    except OSError:
        return True


def _enter(env: Mapping[str, str], log: str) -> None:
    _die_with_the_fork_server()
    _install(env)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _run_module(module: str, argv: list[str], env: Mapping[str, str], log: str) -> None:
    _enter(env, log)
    sys.argv = [module, *argv]
    try:
        importlib.import_module(module).main(argv)
    finally:
        atexit._run_exitfuncs()  # what the interpreter's exit runs, and a multiprocessing child does not


def run_rank(rank: int, env: Mapping[str, str], fn: Callable[..., None], *args: Any) -> None:
    """``fn(rank, *args)`` in the environment ``env`` (:func:`~cbpause.testing.tp.spawn_ranks`' ranks)."""
    _die_with_the_fork_server()
    _install(env)
    fn(rank, *args)


class ForkedProcess:
    """The part of :class:`subprocess.Popen` the harness uses, for a child of the fork server (not of this process:
    the fork server reaps it and reports its exit status, a signal's as ``-signum`` as Popen does)."""

    def __init__(self, process: Any) -> None:
        self._process = process
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"process {self.pid}", timeout or 0.0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_started: list[Any] = []  # the children this process started (multiprocessing.Process), for its exit
_kill_at_exit_registered = False


def _kill_what_runs() -> None:
    for process in _started:
        if process.exitcode is None:
            with contextlib.suppress(OSError):
                os.kill(process.pid, signal.SIGKILL)
            process.join(5)


def start(module: str, argv: list[str], env: Mapping[str, str], log: str) -> ForkedProcess:
    """``python -m module *argv`` as a child of the fork server: ``module.main(argv)``, with environment ``env`` and
    its output appended to ``log`` (``os.devnull`` for none).  Killed when this process exits, at the latest."""
    process = context().Process(target=_run_module, args=(module, list(argv), dict(env), log))
    global _kill_at_exit_registered
    if not _kill_at_exit_registered:  # after multiprocessing's own (context() imported it): atexit runs the last first
        atexit.register(_kill_what_runs)
        _kill_at_exit_registered = True
    _started[:] = [p for p in _started if p.exitcode is None]
    _started.append(process)
    process.start()
    return ForkedProcess(process)
