"""How large a model checks each property: the table of ``docs/tlc.md`` ("The largest sizes checked"), generated
from the manifest and the cfgs, so that it cannot go stale (``tests/test_tlc_runner.py`` compares the two).

For every invariant and property of ``tla/PauseProtocol.tla`` (and R-BOUNDED-ENTRY's and ``IndInv``), the models
expected to pass that check it exhaustively (not by ``-simulate``), and among them the largest on each axis: ranks,
holders on one rank, holders in all, modes, requests.  ``python -m cbpause.tlc.sizes`` prints the table.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from .manifest import Cfg, Model, default_tla_dir, load_manifest
from .tla import checked_definitions

__all__ = ["HOLDER_MAPS", "Size", "model_size", "sizes_table"]

# The holder-to-rank maps of tla/MCPauseProtocol.tla and tla/MCPauseProtocol2x2.tla: holders on each rank (ranks
# past the tuple have none).  A .cfg names a map; model_size raises on a map not listed here.
HOLDER_MAPS = {
    "OneHolderOnRankOne": (1,),
    "OneRankTwoHolders": (2,),
    "OneRankThreeHolders": (3,),
    "TwoRanksOneHolderEach": (1, 1),
    "TwoRanksOneAndTwoHolders": (1, 2),
    "ThreeRanksOneHolderEach": (1, 1, 1),
    "TwoRanksTwoHoldersEach": (2, 2),
    "TwoRanksTwoHoldersEachNumbered": (2, 2),
    "ThreeRanksOneOneTwoHolders": (1, 1, 2),
}


@dataclass(frozen=True)
class Size:
    """What a model's constants say about its size."""

    holders: tuple[int, ...]  # holders on each rank
    modes: int
    requests: int
    faults: tuple[str, ...]

    @property
    def ranks(self) -> int:
        return len(self.holders)

    def describe(self) -> str:
        per_rank = "+".join(map(str, self.holders))
        return f"{self.ranks} rank{'s' if self.ranks > 1 else ''}, holders {per_rank}, {self.modes} mode" + (
            "s" if self.modes > 1 else ""
        ) + f", {self.requests} request{'s' if self.requests != 1 else ''}"


def _set_size(text: str) -> int:
    inner = text.strip().strip("{}").strip()
    return 0 if not inner else len([x for x in inner.split(",") if x.strip()])


def model_size(model: Model, tla_dir: Path) -> Size | None:
    """The size of ``model`` from its cfg, or None for a model of another spec (no ``RankOf``)."""
    cfg = Cfg.read(Path(tla_dir) / model.cfg)
    constants = cfg.constants()
    rank_of = constants.get("RankOf", "")
    mapping = rank_of.strip()
    if not mapping:
        return None
    if mapping not in HOLDER_MAPS:
        raise KeyError(f"{model.cfg}: holder map {mapping!r} is not in cbpause.tlc.sizes.HOLDER_MAPS")
    faults = tuple(sorted(re.findall(r'"(\w+)"', constants.get("Faults", ""))))
    holders = HOLDER_MAPS[mapping]
    holders += (0,) * (_set_size(constants.get("Ranks", "{1}")) - len(holders))  # ranks with no holder
    return Size(holders, _set_size(constants.get("Modes", "{1}")),
                _set_size(constants.get("Requests", "{}")), faults)  # fmt: skip


def _checked(model: Model, tla_dir: Path) -> set[str]:
    cfg = Cfg.read(Path(tla_dir) / model.cfg)
    return set(cfg.names("INVARIANT")) | set(cfg.names("PROPERTY"))


def sizes_table(tla_dir: Path | None = None) -> str:
    """The Markdown table of the largest exhaustive model of each property, on each axis."""
    tla_dir = Path(tla_dir or default_tla_dir())
    spec = (tla_dir / "PauseProtocol.tla").read_text()
    wanted = [*sorted(checked_definitions(spec), key=spec.index), "BoundedEntryInv", "IndInv"]
    passing = [m for m in load_manifest(tla_dir) if m.expect == "ok" and not m.witness]
    sized = [(m, model_size(m, tla_dir)) for m in passing]
    rows = ["| property | models (exhaustive) | most ranks | most holders on one rank | most holders | most modes | "
            "most requests | also simulated |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    axes = (
        lambda s: (s.ranks, sum(s.holders)),
        lambda s: (max(s.holders), sum(s.holders)),
        lambda s: (sum(s.holders), s.ranks),
        lambda s: (s.modes, sum(s.holders)),
        lambda s: (s.requests, sum(s.holders)),
    )
    for prop in wanted:
        checking = [(m, s) for m, s in sized if s is not None and prop in _checked(m, tla_dir)]
        exhaustive = [(m, s) for m, s in checking if not m.simulated]
        simulated = sorted(m.name for m, _ in checking if m.simulated)
        if not exhaustive:
            rows.append(f"| `{prop}` | 0 | — | — | — | — | — | {', '.join(simulated) or '—'} |")
            continue
        cells = []
        for key in axes:
            m, s = max(exhaustive, key=lambda ms: (key(ms[1]), ms[0].name))
            cells.append(f"{s.describe()} ({m.name})")
        rows.append(f"| `{prop}` | {len(exhaustive)} | " + " | ".join(cells) + f" | {', '.join(simulated) or '—'} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(sizes_table(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
