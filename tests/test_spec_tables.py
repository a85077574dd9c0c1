"""spec/PROTOCOL.md and tla/PauseProtocol.tla name the same requirements and actions."""

import re

from cbpause.tlc import cfg_names, load_manifest

from .conftest import ROOT, TLA_DIR

SPEC = (ROOT / "spec" / "PROTOCOL.md").read_text()
TLA = (TLA_DIR / "PauseProtocol.tla").read_text()


def table_rows(text: str, id_prefix: str) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells and cells[0].startswith(id_prefix):
            rows.append(cells)
    return rows


def tla_definitions(text: str) -> set[str]:
    return set(re.findall(r"^(\w+)(?:\([^)]*\))?\s*==", text, re.MULTILINE))


def checked_definitions() -> set[str]:
    """Invariants and properties of the spec: names ending in Inv or Prop, and TypeOK."""
    return {d for d in tla_definitions(TLA) if d.endswith(("Inv", "Prop")) or d == "TypeOK"}


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
    assert named_checks == checked_definitions()


def test_requirement_ids_are_unique_and_statements_normative():
    ids = [cells[0] for p in ("R-", "K-") for cells in table_rows(SPEC, p)]
    assert len(ids) == len(set(ids))
    for p in ("R-", "K-"):
        for cells in table_rows(SPEC, p):
            assert "MUST" in cells[1] or "SHOULD" in cells[1], cells


def test_every_name_in_the_tables_exists_in_the_tla():
    defined = tla_definitions(TLA)
    for rid, names in requirement_column().items():
        assert names <= defined, f"{rid} names undefined TLA+: {names - defined}"


def test_every_action_has_its_p_requirement():
    """P-OPEN-WINDOW <-> OpenWindow: the ID is the action's name in kebab case."""
    rows = table_rows(SPEC, "P-")
    defined = tla_definitions(TLA)
    for cells in rows:
        action = re.match(r"`(\w+)", cells[1]).group(1)
        assert action in defined, f"{cells[0]}: no TLA+ action {action}"
        kebab = "P-" + re.sub(r"(?<!^)(?=[A-Z])", "-", action).upper()
        assert cells[0] == kebab, f"{cells[0]} should be named {kebab} after {action}"
        assert f"\\* {cells[0]}" in TLA, f"the TLA+ action {action} should cite {cells[0]}"
    next_body = TLA[TLA.index("LoopAction(r) =="): TLA.index("Spec ==")]
    in_next = set(re.findall(r"\b([A-Z]\w+)\(", next_body)) | {"AllReduce", "Barrier", "Restart", "Terminated"}
    in_next -= {"LoopAction", "HolderWakes", "WF_vars", "SF_vars"}
    in_spec = {re.match(r"`(\w+)", c[1]).group(1) for c in rows}
    assert in_next <= in_spec, f"actions of Next without a P- row: {in_next - in_spec}"


def test_models_that_must_pass_check_every_requirement():
    """The fast liveness models check every invariant and property of the spec."""
    wanted = checked_definitions()
    for m in load_manifest(TLA_DIR):
        if m.suite == "fast" and m.expect == "ok":
            cfg = (TLA_DIR / m.cfg).read_text()
            listed = set(cfg_names(cfg, "INVARIANT")) | set(cfg_names(cfg, "PROPERTY"))
            assert wanted <= listed, f"{m.name} does not check {wanted - listed}"
