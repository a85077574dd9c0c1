"""Runs of TLC kept by what they ran, so that one run per model serves every check of it (issue 38).

A model's run is fixed by what TLC reads: the jar, every module of ``tla/``, the cfg it was given, the module it
checks and its options.  :meth:`Cache.key` hashes all of these; a run kept under that key (its
output, and its state graph when one was dumped) is what a new run would print, but for the timings.  So the main
job, the test suite and the documentation's pictures, run one after the other (``nox -s tlc tests docs``), explore
each state space once: the first run keeps it, the others read it.

Nothing is kept unless a folder is given: ``python -m cbpause.tlc --cache DIR``, or the environment variable
``CBPAUSE_TLC_CACHE`` (the nox sessions set it to ``.cache/tlc`` in the checkout).  A kept run never outlives the
spec it was made from: any change to a module, a cfg or the options is another key.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["ENV", "Cache", "default_cache"]

ENV = "CBPAUSE_TLC_CACHE"
_VERSION = b"cbpause-tlc-cache 1"  # bump when what a kept run holds changes


def default_cache() -> Cache | None:
    """The cache the environment names (``CBPAUSE_TLC_CACHE``), or None."""
    folder = os.environ.get(ENV)
    return Cache(Path(folder)) if folder else None


class Cache:
    """A folder of kept TLC runs: ``<key>/output.txt`` and, when the run dumped it, ``<key>/graph.dot``."""

    def __init__(self, folder: Path, *, read: bool = True):
        self.folder = Path(folder)
        self.read = read  # False: write what runs, never read (a main job that must run TLC itself)

    @staticmethod
    def key(jar: Path, tla_dir: Path, cfg_text: str, module: str, options: Sequence[str], graph: bool) -> str:
        """What fixes a run's verdict, counts, coverage and graph.  Not the number of workers, which changes only the
        depth TLC reports (shown, never checked) and the timings: a model whose counterexample must be the same every
        time fixes its workers among its options (``-workers 1``)."""
        h = hashlib.sha256(_VERSION)
        h.update(hashlib.sha256(Path(jar).read_bytes()).digest())
        for path in sorted(Path(tla_dir).glob("*.tla")):
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        for part in (cfg_text, module, "\0".join(options), str(graph)):
            h.update(part.encode() + b"\0")
        return h.hexdigest()[:32]

    def get(self, key: str) -> tuple[str, float, Path | None] | None:
        """The output of the run kept under ``key``, the seconds it took, and its graph's path (None if it dumped
        none)."""
        if not self.read:
            return None
        entry = self.folder / key
        if not (entry / "seconds.txt").is_file():  # written last: the entry is whole
            return None
        graph = entry / "graph.dot"
        seconds = float((entry / "seconds.txt").read_text())
        return (entry / "output.txt").read_text(), seconds, graph if graph.is_file() else None

    def put(self, key: str, output: str, seconds: float, graph: Path | None) -> Path | None:
        """Keep a run (atomically: a reader sees it whole or not at all); returns where its graph now lies."""
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=self.folder))
        (tmp / "output.txt").write_text(output)
        (tmp / "seconds.txt").write_text(f"{seconds:.3f}")
        if graph is not None:
            shutil.copy(graph, tmp / "graph.dot")
        entry = self.folder / key
        if (entry / "seconds.txt").is_file():  # another process kept the same run: a reader may be reading it
            shutil.rmtree(tmp, ignore_errors=True)
            return entry / "graph.dot" if graph is not None else None
        shutil.rmtree(entry, ignore_errors=True)  # a part left by a process that died writing it
        try:
            tmp.rename(entry)
        except OSError:  # another process kept the same run meanwhile: theirs is as good
            shutil.rmtree(tmp, ignore_errors=True)
        return entry / "graph.dot" if graph is not None else None
