"""A ``main(argv)`` for tests/test_forks.py: prints what it was given, leaves a file at exit, exits as told."""

import atexit
import os
import signal
import sys
import threading


def main(argv: list[str]) -> None:
    out, how = argv
    print(f"argv={sys.argv[1:]} env={os.environ.get('CBPAUSE_FORK_TEST')}", flush=True)
    atexit.register(lambda: open(out, "w").write("atexit ran"))  # noqa: SIM115
    if how == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if how in ("wait", "ignore_term"):
        threading.Event().wait()
    sys.exit(int(how))
