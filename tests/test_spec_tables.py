"""spec/PROTOCOL.md and tla/PauseProtocol.tla name the same requirements and actions."""

import re

import pytest

from cbpause.tlc import Cfg, load_manifest
from cbpause.tlc.tla import checked_definitions, definitions, next_actions

from .conftest import ROOT, TLA_DIR

pytestmark = pytest.mark.layer("core")

SPEC = (ROOT / "spec" / "PROTOCOL.md").read_text()
TLA = (TLA_DIR / "PauseProtocol.tla").read_text()
# R-BOUNDED-ENTRY is checked over a ghost counter that only its model wrapper has.
ENTRY = (TLA_DIR / "MCPauseProtocolEntry.tla").read_text()
# R-STOP-NO-TEARDOWN, over an abstraction of the manager's stop().
TEARDOWN = (TLA_DIR / "StopTeardown.tla").read_text()


def table_rows(text: str, id_prefix: str) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells and cells[0].startswith(id_prefix):
            rows.append(cells)
    return rows


def requirement_column() -> dict[str, set[str]]:
    table = {}
    for prefix in ("R-", "K-"):
        for cells in table_rows(SPEC, prefix):
            assert len(cells) == 3, f"requirement row needs ID | requirement | TLA+: {cells}"
            table[cells[0]] = set(re.findall(r"`(\w+)`", cells[2]))
    return table


def test_every_invariant_and_property_has_a_requirement_and_back():
    named = set().union(*requirement_column().values())
    named_checks = {n for n in named if n.endswith(("Inv", "Prop")) or n == "TypeOK"}
    requests = checked_definitions((TLA_DIR / "RequestVersions.tla").read_text())
    teardown = checked_definitions(TEARDOWN) - {"TypeOK"}
    fleet = checked_definitions((TLA_DIR / "FleetPause.tla").read_text()) - {"TypeOK"}
    assert named_checks == checked_definitions(TLA) | {"BoundedEntryInv"} | requests | teardown | fleet
    assert "BoundedEntryInv" in definitions(ENTRY)


def test_requirement_ids_are_unique_and_statements_normative():
    ids = [cells[0] for p in ("R-", "K-") for cells in table_rows(SPEC, p)]
    assert len(ids) == len(set(ids))
    for p in ("R-", "K-"):
        for cells in table_rows(SPEC, p):
            assert "MUST" in cells[1] or "SHOULD" in cells[1], cells


def test_every_name_in_the_tables_exists_in_the_tla():
    defined = definitions(TLA) | definitions(ENTRY) | definitions((TLA_DIR / "RequestVersions.tla").read_text())
    defined |= definitions(TEARDOWN) | definitions((TLA_DIR / "FleetPause.tla").read_text())
    for rid, names in requirement_column().items():
        assert names <= defined, f"{rid} names undefined TLA+: {names - defined}"


def test_every_action_has_its_p_requirement():
    """P-OPEN-WINDOW <-> OpenWindow: the ID is the action's name in kebab case."""
    rows = table_rows(SPEC, "P-")
    defined = definitions(TLA)
    for cells in rows:
        action = re.match(r"`(\w+)", cells[1]).group(1)
        assert action in defined, f"{cells[0]}: no TLA+ action {action}"
        kebab = "P-" + re.sub(r"(?<!^)(?=[A-Z])", "-", action).upper()
        assert cells[0] == kebab, f"{cells[0]} should be named {kebab} after {action}"
        assert f"\\* {cells[0]}" in TLA, f"the TLA+ action {action} should cite {cells[0]}"
    in_next = next_actions(TLA)
    in_spec = {re.match(r"`(\w+)", c[1]).group(1) for c in rows}
    assert in_next <= in_spec, f"actions of Next without a P- row: {in_next - in_spec}"


def test_models_that_must_pass_check_every_requirement():
    """The fast models of the protocol check every invariant and property of the spec; the bounded-entry ones,
    R-BOUNDED-ENTRY; those of the requests under pauses, every one of tla/RequestVersions.tla; the model of
    cbpause's stop(), every one of tla/StopTeardown.tla; the fleet's, every one of tla/FleetPause.tla; the staleness
    bound's restarts, every one of tla/StaleRestarts.tla."""
    wanted = checked_definitions(TLA)
    requests = checked_definitions((TLA_DIR / "RequestVersions.tla").read_text())
    for m in load_manifest(TLA_DIR):
        if m.suite == "fast" and m.expect == "ok":
            cfg = Cfg.read(TLA_DIR / m.cfg)
            listed = set(cfg.names("INVARIANT")) | set(cfg.names("PROPERTY"))
            need = {"BoundedEntryInv"} if m.module == "MCPauseProtocolEntry" else wanted
            if cfg.constants().get("Modes") == "{1}":  # KEEP only: no holder is deferred, PauseReturnsProp says it all
                need = need - {"ModePauseReturnsProp"}
            if cfg.constants().get("RankOf") in ("TwoRanksOneHolderEach", "OneHolderOnRankOne"):
                # One holder per rank: its leave closes the window (no other is pending), so WindowsCloseProp is
                # HoldersLeave and ResumeProp, which the model checks; the closing flag is never set there.
                need = need - {"WindowsCloseProp", "QueuedEntersProp"}  # nor is any holder queued there
            need = requests if m.module == "RequestVersions" else need
            need = checked_definitions(TEARDOWN) if m.module == "StopTeardown" else need
            need = checked_definitions((TLA_DIR / "FleetPause.tla").read_text()) if m.module == "FleetPause" else need
            if m.module == "StaleRestarts":
                need = checked_definitions((TLA_DIR / "StaleRestarts.tla").read_text())
            if m.module == "FleetPause" and cfg.constants().get("MaxEpoch") == "2":  # liveness is the 1-pause models'
                need = need - {"NoPausedForEverProp"}
            assert need <= listed, f"{m.name} does not check {need - listed}"


def test_budgets_live_in_the_model_wrappers():
    """The protocol's actions carry no fault budget or bound: the MC* wrappers set them (as etcd-io/raft's and
    microsoft/CCF's do)."""
    assert not re.search(r"\b(Faults|MaxRestarts)\b|\bcrashes\s*[=']", TLA)
    wrapper = (TLA_DIR / "MCPauseProtocol.tla").read_text()
    for name in ("Faults", "MaxRestarts", "MCSpec"):
        assert name in wrapper, name


def test_the_verification_table_has_every_action_and_checks_each():
    """docs/verification.md section 5: one row per action of Next, its Python transition exists, the code it
    names exists where it says, its test files exist, and no row is left without a check."""
    from cbpause.core import group, transitions

    doc = (ROOT / "docs" / "verification.md").read_text()
    rows = [cells for cells in table_rows(doc, "`") if len(cells) == 7]
    actions = [re.fullmatch(r"`(\w+)`", cells[0]).group(1) for cells in rows]
    assert sorted(actions) == sorted(next_actions(TLA)), "one row per action of Next"
    src = ROOT / "src" / "cbpause"
    for action, python, where, graph, traces, crosshair, tests in rows:
        module, function = re.fullmatch(r"`(\w+)\.(\w+)`", python).groups()
        assert hasattr({"transitions": transitions, "group": group}[module], function), python
        for path, names in re.findall(r"`([\w/]+\.py)`: ((?:`\w+`(?:, )?)+)", where):
            text = (src / path).read_text()
            for name in re.findall(r"`(\w+)`", names):
                assert re.search(rf"def {name}\b", text), f"{action}: no {name} in {path}"
        for test_file in re.findall(r"`(tests/\w+\.py)`", tests):
            assert (ROOT / test_file).is_file(), test_file
        checks = [graph, traces, crosshair]
        assert "not covered" not in " ".join(checks + [tests])
        assert any(c.startswith("yes") for c in checks) and re.search(r"tests/", tests), f"{action} unchecked"


# ------------------------------------------------------------------ the code the prose names (issue 38, point 5)


def _code_facts() -> tuple[dict[str, set[str]], dict[str, object]]:
    """Read from the sources, without importing them: each class of cbpause with the names it defines (methods,
    class attributes, ``self.x`` it assigns), and each module-level constant with its value."""
    import ast

    classes: dict[str, set[str]] = {}
    constants: dict[str, object] = {}
    for path in (ROOT / "src" / "cbpause").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        constants[target.id] = node.value.value
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                names = classes.setdefault(node.name, set())
                for item in ast.walk(node):
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(item.name)
                    elif isinstance(item, ast.Attribute) and getattr(item.value, "id", None) == "self":
                        names.add(item.attr)
                    elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                        for target in item.targets if isinstance(item, ast.Assign) else [item.target]:
                            if isinstance(target, ast.Name):
                                names.add(target.id)
    # A class has what its bases in cbpause have (RankProtocol has RankCore's _apply).
    for path in (ROOT / "src" / "cbpause").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                stack = [b.id for b in node.bases if isinstance(b, ast.Name)]
                seen = set()
                while stack:
                    base = stack.pop()
                    if base in classes and base not in seen:
                        seen.add(base)
                        classes[node.name] |= classes[base]
    return classes, constants


def _prose() -> dict[str, str]:
    files = [ROOT / "spec" / "PROTOCOL.md", ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return {str(p.relative_to(ROOT)): p.read_text() for p in files}


def test_the_code_the_prose_names_exists():
    """Every ``src/cbpause/...`` path, and every ``Class.name`` of a cbpause class, that the spec, the README or the
    docs name exists (the spec's fairness table says which line of code makes each premise true: a rename must not
    leave it naming code that is gone)."""
    classes, _ = _code_facts()
    missing = []
    for where, text in _prose().items():
        for path in set(re.findall(r"`(src/cbpause/[\w/]+\.py)`", text)):
            if not (ROOT / path).is_file():
                missing.append(f"{where}: {path}")
        for cls, name in set(re.findall(r"`([A-Z]\w+)\.(_?[a-z]\w*)`", text)):
            if cls in classes and name not in classes[cls] and name not in ("tla", "cfg", "py", "md", "toml"):  # files
                missing.append(f"{where}: {cls}.{name}")
    assert missing == []


def test_the_figures_the_prose_gives_for_constants_are_the_code_s():
    """`NAME` = value (a constant of the code and the value the prose gives it) agree, in the spec, the README and
    the docs: the prose restates them, so a test compares."""
    _, constants = _code_facts()
    wrong, found = [], 0
    for where, text in _prose().items():
        for name, value in re.findall(r"`([A-Z][A-Z_]+)` = ([\d.]+)", text):
            if name in constants:
                found += 1
                if float(value) != float(constants[name]):
                    wrong.append(f"{where}: {name} = {value}, the code says {constants[name]}")
    assert wrong == [] and found > 0
