"""Runs of TLC kept by what they ran, so that one run per model serves every check of it (issue 38).

A model's run is fixed by what TLC reads: the jar, every module of ``tla/``, the cfg it was given, the module it
checks and its options.  :meth:`Cache.key` hashes all of these; a run kept under that key (its
output, and its state graph when one was dumped) is what a new run would print, but for the timings.  So the main
job, the test suite and the documentation's pictures, run one after the other (``nox -s tlc core ci docs``), explore
each state space once: the first run keeps it, the others read it.

Nothing is kept unless a folder is given: ``python -m cbpause.tlc --cache DIR``, or the environment variable
``CBPAUSE_TLC_CACHE`` (the nox sessions set it to ``.cache/tlc`` in the checkout).  A kept run never outlives the
spec it was made from: any change to a module, a cfg, the witnesses the run observes or the options is another
key.
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
_VERSION = b"cbpause-tlc-cache 2"  # bump when what a kept run holds changes


def default_cache() -> Cache | None:
    """The cache the environment names (``CBPAUSE_TLC_CACHE``), or None."""
    folder = os.environ.get(ENV)
    return Cache(Path(folder)) if folder else None


class Cache:
    """A folder of kept TLC runs: ``<key>/output.txt``, ``<key>/graph.dot`` when the run dumped it, and
    ``<key>/done.txt`` (the seconds the run took and the files' digests), written last."""

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
        none); None when nothing whole is kept there.  An entry whose files do not match the digests its
        ``done.txt`` records (damaged, half-deleted, or written by another version) is no entry: the run is made
        again and kept in its place."""
        if not self.read:
            return None
        entry = self.folder / key
        try:
            seconds, output_digest, graph_digest = (entry / "done.txt").read_text().split()
            output = (entry / "output.txt").read_bytes()
            graph = entry / "graph.dot"
            if _digest(output) != output_digest:
                return None
            if graph_digest != "-" and _digest(graph.read_bytes()) != graph_digest:
                return None
            return output.decode(), float(seconds), graph if graph_digest != "-" else None
        except (OSError, ValueError, UnicodeDecodeError):
            return None

    def put(self, key: str, output: str, seconds: float, graph: Path | None) -> Path | None:
        """Keep a run (atomically: a reader sees it whole or not at all); returns where its graph now lies.

        A whole entry kept under ``key`` stays, unless this cache does not read (``--fresh``, whose run replaces it):
        another process may be reading it, and what it holds is what this run found.  Two writers of one key race
        harmlessly: the first rename wins, the other's copy is dropped."""
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=self.folder))
        data = output.encode()
        (tmp / "output.txt").write_bytes(data)
        graph_digest = "-"
        if graph is not None:
            shutil.copy(graph, tmp / "graph.dot")
            graph_digest = _digest((tmp / "graph.dot").read_bytes())
        (tmp / "done.txt").write_text(f"{seconds:.3f} {_digest(data)} {graph_digest}\n")  # last: the entry is whole
        entry = self.folder / key
        old = None
        if entry.exists():
            if self.read and Cache(self.folder).get(key) is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                return entry / "graph.dot" if graph is not None else None
            # --fresh, or a part left by a process that died writing it, or a damaged entry: moved aside, then gone.
            old = Path(tempfile.mkdtemp(prefix=f".{key}-old-", dir=self.folder))
            try:
                entry.rename(old / "entry")
            except OSError:
                pass
        try:
            tmp.rename(entry)
        except OSError:  # another process kept the same run meanwhile: theirs is as good
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return entry / "graph.dot" if graph is not None else None


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]
