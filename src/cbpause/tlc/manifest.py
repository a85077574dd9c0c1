"""The manifest of the TLC models (``tla/models.toml``) and the one reader of TLC's ``.cfg`` files.

Each model names the TLA+ module that holds its bounds, its ``.cfg``, its suite, the result TLC must give
and, as in tlaplus/Examples' manifest, what a run of it is: its distinct and total states, the depth of the
search, its features (``liveness``, ``symmetry``, ``ignore deadlock``) and its runtime on the development
machine.  A model expected to fail passes only if TLC still finds that failure.

Four fields go beyond that manifest.  ``never_fires`` lists the actions that a complete run of a passing model
must never take (TLC's action coverage; any other action that never fires fails the run: a guard that
disables an action makes every safety property hold, vacuously).  ``witnesses`` lists, as expected results,
the witness properties that must fail on the constants of that model: the model's own run observes them
(:mod:`~cbpause.tlc.witnesses`), and each is also a model of its own, ``Witness_<Property>_<model>``, whose cfg is
the model's with the witness as its only invariant or property (run alone, it shows the witness's counterexample).
``graph = true`` has the model's run dump its state graph (TLC's ``-dump dot,actionlabels``), for the comparison
with the Python transitions and the documentation's phase diagram; ``workers`` fixes TLC's workers (a defect's
counterexample, drawn in the documentation, must be the same every time: one worker and a fixed fingerprint).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import re
import tomllib
from collections.abc import Iterable
from pathlib import Path

from .launcher import TLCError

__all__ = ["FEATURES", "SUITES", "Cfg", "Model", "default_tla_dir", "load_manifest", "select"]

# "main": the main job (`nox -s tlc`: the headline models and every defect of upstream, in minutes); "fast": the
# other models that finish in seconds (`nox -s verify`, or `--suite fast`: main and fast); "deep": minutes each.
SUITES = ("main", "fast", "deep")
FEATURES = ("liveness", "symmetry", "ignore deadlock", "simulation")
_REQUIRED = {"name", "module", "cfg", "suite", "expect", "features"}


@dataclasses.dataclass(frozen=True)
class Model:
    """One entry of ``tla/models.toml``."""

    name: str
    module: str
    cfg: str
    suite: str
    expect: str
    features: tuple[str, ...] = ()
    distinct_states: int | None = None
    total_states: int | None = None
    state_depth: int | None = None
    runtime: str = ""
    options: tuple[str, ...] = ()
    description: str = ""
    note: str = ""
    never_fires: tuple[str, ...] = ()
    witnesses: tuple[str, ...] = ()
    graph: bool = False
    workers: int | None = None
    witness: str = ""  # set on a witness model derived from ``witnesses``: its expected result
    parent: str = ""  # set on a witness model: the model whose run observes it

    @property
    def simulated(self) -> bool:
        """TLC checks random behaviours (``-simulate``), not the whole graph: no counts, no coverage."""
        return "-simulate" in self.options

    def cfg_text(self, tla_dir: Path) -> str:
        """The cfg TLC runs: the file, or for a witness model the file's constants and specification with the
        witness as its only invariant (or action property)."""
        text = (Path(tla_dir) / self.cfg).read_text()
        if not self.witness:
            return text
        kind, _, name = self.witness.partition(":")
        keyword = "PROPERTY" if kind == "action-property" else "INVARIANT"
        return Cfg(text).without("INVARIANT", "PROPERTY") + f"{keyword}\n    {name}\n"


def _witness_models(model: Model) -> list[Model]:
    short = model.name.removeprefix("PauseProtocol_")
    derived = []
    for expect in model.witnesses:
        kind, _, prop = expect.partition(":")
        if kind not in ("invariant", "action-property") or not prop.endswith("Witness"):
            raise TLCError(f"model {model.name}: a witness is 'invariant:NeverXWitness' or "
                           f"'action-property:NeverXWitness', not {expect!r}")  # fmt: skip
        derived.append(Model(
            name=f"Witness_{prop.removesuffix('Witness')}_{short}", module=model.module, cfg=model.cfg,
            suite=model.suite, expect=expect, description=f"non-vacuity: {prop} must fail on {model.name}'s constants",
            witness=expect, parent=model.name,
            features=tuple(f for f in model.features if f in ("symmetry", "ignore deadlock")),
            options=tuple(o for o in model.options if o == "-deadlock"),  # a model whose behaviours end keeps it
        ))  # fmt: skip
    return derived


def default_tla_dir() -> Path:
    """The ``tla/`` that ships inside the package (in a checkout, ``src/cbpause/tla`` is a link to the
    repository's ``tla/``), found with :mod:`importlib.resources` wherever cbpause is installed."""
    candidate = importlib.resources.files("cbpause") / "tla"
    if isinstance(candidate, Path) and (candidate / "models.toml").is_file():
        return candidate.resolve()
    raise TLCError(f"no models.toml in {candidate} (cbpause installed without its tla/?): pass --tla-dir")


def load_manifest(tla_dir: Path) -> list[Model]:
    """Read and validate ``models.toml`` in ``tla_dir``."""
    manifest = Path(tla_dir) / "models.toml"
    if not manifest.is_file():
        raise TLCError(f"no manifest at {manifest}")
    try:
        data = tomllib.loads(manifest.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise TLCError(f"{manifest}: {exc}") from None
    models: list[Model] = []
    for i, entry in enumerate(data.get("model", [])):
        missing = _REQUIRED - entry.keys()
        if missing:
            raise TLCError(f"{manifest}: model #{i + 1} lacks {sorted(missing)}")
        name = entry["name"]
        if entry["suite"] not in SUITES:
            raise TLCError(f"{manifest}: model {name}: suite must be one of {SUITES}")
        unknown = set(entry["features"]) - set(FEATURES)
        if unknown:
            raise TLCError(f"{manifest}: model {name}: unknown features {sorted(unknown)}; known: {FEATURES}")
        unknown = entry.keys() - {f.name for f in dataclasses.fields(Model)}
        if unknown:
            raise TLCError(f"{manifest}: model {name}: unknown fields {sorted(unknown)}")
        if any(m.name == name for m in models):
            raise TLCError(f"{manifest}: model {name} is listed twice")
        fields = {
            **entry, "features": tuple(entry["features"]), "options": tuple(entry.get("options", ())),
            "never_fires": tuple(entry.get("never_fires", ())), "witnesses": tuple(entry.get("witnesses", ())),
        }  # fmt: skip
        if fields.get("witness") or fields.get("parent"):
            raise TLCError(f"{manifest}: model {name}: 'witness' and 'parent' are set by the runner; list 'witnesses'")
        model = Model(**fields)
        models.append(model)
        for derived in _witness_models(model):
            if any(m.name == derived.name for m in models):
                raise TLCError(f"{manifest}: model {derived.name} is listed twice")
            models.append(derived)
    return models


def select(models: list[Model], names: Iterable[str], suite: str) -> list[Model]:
    """The models called ``names``, or else those of ``suite``: ``"main"``, ``"fast"`` (every model that finishes in
    seconds: main's and fast's), ``"deep"``, or ``"all"``."""
    names = list(names)
    if names:
        by_name = {m.name: m for m in models}
        unknown = [n for n in names if n not in by_name]
        if unknown:
            known = ", ".join(sorted(by_name))
            raise TLCError(f"unknown model(s) {', '.join(unknown)}; known models: {known}")
        return [by_name[n] for n in names]
    if suite == "all":
        return list(models)
    suites = ("main", "fast") if suite == "fast" else (suite,)
    return [m for m in models if m.suite in suites]


# ------------------------------------------------------------------------------------------------ .cfg

_KEYWORDS = {
    "INVARIANT": "INVARIANT", "INVARIANTS": "INVARIANT", "PROPERTY": "PROPERTY", "PROPERTIES": "PROPERTY",
    "CONSTANT": "CONSTANT", "CONSTANTS": "CONSTANT", "SPECIFICATION": "SPECIFICATION", "INIT": "INIT",
    "NEXT": "NEXT", "VIEW": "VIEW", "SYMMETRY": "SYMMETRY", "CONSTRAINT": "CONSTRAINT",
    "CONSTRAINTS": "CONSTRAINT", "ACTION_CONSTRAINT": "ACTION_CONSTRAINT",
    "ACTION_CONSTRAINTS": "ACTION_CONSTRAINT",
}  # fmt: skip


class Cfg:
    """A TLC ``.cfg``: its sections in order, each a keyword (singular) and the lines under it."""

    def __init__(self, text: str):
        self.text = text
        self.sections: list[tuple[str, list[str]]] = []
        for raw in text.splitlines():
            line = raw.split("\\*", 1)[0].strip()
            if not line:
                continue
            first, _, rest = line.partition(" ")
            if first in _KEYWORDS:
                self.sections.append((_KEYWORDS[first], [rest.strip()] if rest.strip() else []))
            elif self.sections:
                self.sections[-1][1].append(line)
            else:
                raise TLCError(f"cfg line outside any section: {raw!r}")

    @classmethod
    def read(cls, path: Path) -> Cfg:
        return cls(Path(path).read_text())

    def names(self, keyword: str) -> list[str]:
        """The names listed under ``keyword`` (``INVARIANT``, ``PROPERTY``, ``SYMMETRY``, ...)."""
        return [tok for kw, lines in self.sections if kw == keyword for line in lines for tok in line.split()]

    def constants(self) -> dict[str, str]:
        """``CONSTANTS``: each name with its value (``= v``) or its substitute (``<- Op``), as text."""
        out = {}
        for kw, lines in self.sections:
            if kw == "CONSTANT":
                for line in lines:
                    m = re.match(r"(\w+)\s*(=|<-)\s*(.+)$", line)
                    if m is None:
                        raise TLCError(f"cannot read the constant {line!r}")
                    out[m.group(1)] = m.group(3).strip()
        return out

    def without(self, *keywords: str) -> str:
        """The cfg without the sections of ``keywords`` (e.g. ``"PROPERTY"`` for a safety-only run)."""
        kept = [(kw, lines) for kw, lines in self.sections if kw not in keywords]
        return "".join(kw + "\n" + "".join(f"    {line}\n" for line in lines) for kw, lines in kept)

    def features(self, options: Iterable[str] = ()) -> tuple[str, ...]:
        """What a run of this cfg is, in the manifest's words."""
        found = []
        if any(name.endswith("Prop") for name in self.names("PROPERTY")):  # the others are [][A]_v, safety
            found.append("liveness")
        if self.names("SYMMETRY"):
            found.append("symmetry")
        if "-deadlock" in options:
            found.append("ignore deadlock")
        if "-simulate" in options:
            found.append("simulation")
        return tuple(found)
