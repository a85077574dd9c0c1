"""One name per concept: the name table of spec/PROTOCOL.md (section 8) agrees with tla/ and src/.

The checker reads a repository tree (the spec's table, the TLA+ modules' text, the Python modules' syntax
trees; nothing is imported), so that it can be run on a mutated copy: renaming an action in one layer
alone must make it fail.
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest

from cbpause.tlc.tla import checked_definitions, definitions, next_actions

from .conftest import ROOT

pytestmark = pytest.mark.layer("core")

# Names that a rename retired: they must appear nowhere in the repository (code, tests, TLA+, docs).
RETIRED = {
    r"\bPeerPauseTimeout\b": "PeerParkTimeout",
    r"\brequests_waiting\b": "holders_waiting",
    r"\btpStop\b|\bobsStop\b|\btp_stop\b|\bobs_stop\b": "tpStatus / obsStatus, tp_status / obs_status",
    r"\bpc\[|\bLoopStates\b": "phase, Phases",
    r"(?<![A-Za-z])FatalError\(": "RecordFatalError",
    r"\bfatal_error\(s\)|\bt\.fatal_error\b|\bcrashes\s*(=|'|\+)": "record_fatal_error; budgets in MC*.tla",
    r"\bWitness_(enters|resumes|stops|delivers)\b": "Witness_NeverInside and its kind",
    r"\bfakeloop\b|\btrace_scenarios\b|\btinymodel\b|\bcbpause\.traces\b|\bcbpause\.conformance\b": "cbpause.testing, "
    "cbpause.apps.scenarios, cbpause.tlc.traces, cbpause.tlc.conformance",
    r"\bcbpause\.tlc\.scenarios\b": "cbpause.apps.scenarios (an application: it runs the real loop)",
    r"\bis_live\b": "live",
}
SEARCHED = ("src", "tests", "tla", "spec", "docs", "README.md", "noxfile.py")


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower() if name != "TypeOK" else "type_ok"


def kebab(name: str) -> str:
    return "P-" + re.sub(r"(?<!^)(?=[A-Z])", "-", name).upper()


def name_table(spec: str) -> list[tuple[str, str, str, list[str]]]:
    """Section 8's rows: (concept, prose, TLA+ name, Python names)."""
    section = spec[spec.index("## 8. Names") :]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 4 and cells[2].startswith("`"):
            rows.append((cells[0], cells[1], cells[2].strip("`"), re.findall(r"`([\w.]+)`", cells[3])))
    return rows


def python_names(src: Path) -> set[str]:
    """``module.name`` and ``module.Class.name`` for what each module of the core defines."""
    names = set()
    for path in (src / "cbpause" / "core").glob("*.py"):
        module = path.stem
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(f"{module}.{node.name}")
            if isinstance(node, ast.ClassDef):
                names.add(node.name)
                for item in ast.walk(node):
                    if isinstance(item, ast.FunctionDef):
                        names.add(f"{node.name}.{item.name}")
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        names.add(f"{node.name}.{item.target.id}")
                    elif isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store):
                        names.add(f"{node.name}.{item.attr}")
    # A class's names include those it inherits (PauseProtocol <- RankProtocol <- the mixin LoopSteps).
    bases = {
        node.name: [b.id for b in node.bases if isinstance(b, ast.Name)]
        for path in (src / "cbpause" / "core").glob("*.py")
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.ClassDef)
    }  # fmt: skip

    def ancestors(cls: str) -> list[str]:
        return [b for base in bases.get(cls, []) for b in (base, *ancestors(base))]

    for cls in bases:
        for base in ancestors(cls):
            names |= {f"{cls}.{n.split('.', 1)[1]}" for n in set(names) if n.startswith(base + ".")}
    return names


def check_names(root: Path) -> list[str]:
    """Every way the name table and the layers of the tree at ``root`` disagree."""
    spec = (root / "spec" / "PROTOCOL.md").read_text()
    tla = (root / "tla" / "PauseProtocol.tla").read_text()
    rows = name_table(spec)
    defined, python = definitions(tla), python_names(root / "src")
    block = re.sub(r"\\\*.*", "", tla[tla.index("VARIABLES") + len("VARIABLES") : tla.index("loopVars ==")])
    variables = set(re.findall(r"\w+", block))
    problems = []
    for concept, prose, name, py in rows:
        if name not in defined and name not in variables:
            problems.append(f"{concept!r}: TLA+ {name} is defined nowhere in tla/PauseProtocol.tla")
        problems += [f"{concept!r}: Python {n} does not exist" for n in py if n not in python]
        if name.endswith("Prop"):
            continue
        if not any(n.rsplit(".", 1)[1] == snake(name) for n in py):
            problems.append(f"{concept!r}: no Python name is {snake(name)}, the TLA+ {name} in snake case")
        if prose.startswith("P-") and prose.split()[0] != kebab(name) and "(its guard)" not in prose:
            problems.append(f"{concept!r}: the requirement of {name} is {kebab(name)}, not {prose}")
    named = {name for _, _, name, _ in rows}
    wanted = (next_actions(tla) | {"FailLoop"}) | variables | checked_definitions(tla)
    problems += [f"{n} (TLA+) has no row in the name table" for n in sorted(wanted - named)]
    transitions = (root / "src" / "cbpause" / "core" / "transitions.py").read_text()
    actions = set(re.findall(r'^def (\w+)\(.*\n\s+"""P-', transitions, re.M))
    problems += [f"transitions.{f} has no row in the name table" for f in sorted(actions - {snake(n) for n in named})]
    return problems


def retired_names(root: Path) -> list[str]:
    found = []
    for entry in SEARCHED:
        paths = [root / entry] if (root / entry).is_file() else (root / entry).rglob("*")
        for path in paths:
            if path.suffix not in (".py", ".tla", ".cfg", ".md", ".toml") or path.name == "test_names.py":
                continue
            text = path.read_text()
            for pattern, now in RETIRED.items():
                for m in re.finditer(pattern, text):
                    line = text.count("\n", 0, m.start()) + 1
                    found.append(f"{path.relative_to(root)}:{line}: {m.group(0)!r} was renamed ({now})")
    return found


def test_the_name_table_agrees_with_the_tla_and_the_python():
    assert check_names(ROOT) == []
    assert len(name_table((ROOT / "spec" / "PROTOCOL.md").read_text())) >= 50


def test_retired_names_appear_nowhere():
    assert retired_names(ROOT) == []


@pytest.mark.parametrize(
    ("layer", "old", "new", "complaint"),
    [
        ("tla/PauseProtocol.tla", "OpenWindow", "OpenPauseWindow", "TLA+ OpenWindow is defined nowhere"),
        ("src/cbpause/core/transitions.py", "def open_window(", "def open_window_now(",
         "transitions.open_window does not"),
        ("spec/PROTOCOL.md", "| `OpenWindow` | `transitions.open_window`", "| `OpenPauseWindow` | "
         "`transitions.open_pause_window`", "OpenWindow (TLA+) has no row"),
    ],
)  # fmt: skip
def test_renaming_in_one_layer_alone_fails(tmp_path, layer, old, new, complaint):
    for part in ("spec", "tla", "src"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    path = tmp_path / layer
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))
    problems = check_names(tmp_path)
    assert any(complaint in p for p in problems), problems


def test_the_variable_map_is_derived_and_covers_every_variable_of_the_spec():
    """The state-graph comparison's encoding names every variable of PauseProtocol.tla, no other, by the rule of
    the name table (cbpause.core.group.tla_variable): renaming a field in one layer alone fails here."""
    from cbpause.core import group as gr
    from cbpause.core.transitions import RankState
    from cbpause.tlc.conformance import encode
    from cbpause.tlc.tla import variables

    declared = variables((ROOT / "tla" / "PauseProtocol.tla").read_text())
    assert {name for name, _ in encode(gr.initial_group(2, (0, 1), 1))} == declared
    fields = set(RankState._fields)
    assert set(gr.RANK_VARIABLES + gr.SHARED_VARIABLES) <= fields
    assert {gr.tla_variable(f) for f in gr.RANK_VARIABLES + gr.SHARED_VARIABLES} <= declared


def test_the_holder_actions_are_one_table_of_actions_of_next():
    from cbpause.core import group as gr
    from cbpause.core import transitions
    from cbpause.core.recorder import action_of

    actions = next_actions((ROOT / "tla" / "PauseProtocol.tla").read_text())
    assert set(gr.HOLDER_ACTIONS) <= actions
    for action, (by, after) in gr.HOLDER_ACTIONS.items():
        assert by in ("holder", "environment", "loop") and after in {gr.tla_holder_state(x) for x in gr.HOLDER_STATES}
        assert action_of(gr.python_name(action)) == action
        assert hasattr(transitions, gr.python_name(action)) or hasattr(gr, gr.python_name(action)), action


def test_the_other_modules_share_only_the_names_the_spec_lists():
    """RequestVersions.tla and StopTeardown.tla share with PauseProtocol.tla only names of the same meaning, the
    ones section 8 lists; reusing ``phase`` or ``RequestPause`` for something else there fails here."""
    from cbpause.tlc.tla import variables

    spec = (ROOT / "spec" / "PROTOCOL.md").read_text()
    section = spec[spec.index("| Module | Names it shares with `PauseProtocol.tla` |") :].split("\n\n")[0]
    listed = {}
    for line in section.splitlines()[2:]:
        module, names = (c.strip() for c in line.strip().strip("|").split("|"))
        listed[module.strip("`")] = set(re.findall(r"`(\w+)`", names)) - {"PauseProtocol"}
    base = (ROOT / "tla" / "PauseProtocol.tla").read_text()
    base_names = definitions(base) | variables(base)
    modules = {p.stem for p in (ROOT / "tla").glob("*.tla")} - {"PauseProtocol", "TracePauseProtocol"}
    modules = {m for m in modules if not m.startswith("MC")}
    assert set(listed) == modules
    for module, names in listed.items():
        text = (ROOT / "tla" / f"{module}.tla").read_text()
        assert (definitions(text) | variables(text)) & base_names == names, module
