"""The house: the folders are the layers, the layers stay apart, and modules and functions stay readable.

* the package holds its ``__init__`` and the layers' folders, nothing else: ``core``, ``integrations``, ``tlc``,
  ``testing``, ``serve``, ``client``, ``apps`` (and ``tla``, a link to the spec, which ships inside the package);
* the core (``cbpause/core/``: the pure transitions, ``PauseProtocol``, its errors, the trace recorder) imports
  only the standard library and the core;
* data flows down: the integration uses the core; the tooling (``cbpause.tlc``) and ``cbpause.testing`` read
  the core, never the integration or the applications; nothing imports an application (``cbpause/apps/``)
  but itself; the server (``cbpause.serve``) uses the integration and the core, and only applications import it;
  the fleet client (``cbpause.client``, the trainer's side) imports nothing of cbpause;
* no module of ``src/`` is over 650 lines, no function over 80;
* no nox session runs a module of ``tests/``.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from .conftest import ROOT

pytestmark = pytest.mark.layer("core")

SRC = ROOT / "src" / "cbpause"
LAYERS = {"core", "integrations", "tlc", "testing", "serve", "client", "apps"}


def layer_modules(layer: str) -> set[str]:
    """The dotted names of a layer's modules and packages, read from its folder."""
    return {module_name(path) for path in (SRC / layer).rglob("*.py")}


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__")


def imports(path: Path) -> set[str]:
    """The modules ``path`` imports, absolute (``cbpause.x`` for relative imports of the package)."""
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                if node.module:
                    found.add(f"{base}.{node.module}")
                else:  # from . import x: the modules x
                    found |= {f"{base}.{alias.name}" for alias in node.names}
            else:
                found.add(node.module)
    return found


def sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_the_folders_are_the_layers():
    # and tla, the link to the repository's tla/ that ships the spec inside the package
    assert {path.name for path in SRC.iterdir() if path.name != "__pycache__"} == LAYERS | {"__init__.py", "tla"}
    assert (SRC / "tla").is_symlink() and (SRC / "tla").resolve() == (ROOT / "tla").resolve()
    assert "cbpause.apps.soak" in layer_modules("apps") and "cbpause.core.transitions" in layer_modules("core")


def test_the_core_imports_the_standard_library_and_the_core_only():
    core = layer_modules("core")
    for path in sorted((SRC / "core").rglob("*.py")):
        for imported in imports(path):
            top = imported.split(".")[0]
            if top == "cbpause":
                assert imported in core or imported == "cbpause.core", f"{path.name} imports {imported}"
            else:
                assert top in sys.stdlib_module_names or top == "__future__", f"{path.name} imports {imported}"


@pytest.mark.parametrize("layer", ["tlc", "testing", "integrations", "serve", "client"])
def test_data_flows_down(layer):
    """The tooling, the testing kit, the integration and the server never import the applications (nor the server,
    but itself); the tooling and the testing kit never import the integration; the client imports nothing of cbpause.
    One exception: the server imports the weight-update group's wire protocol, which both ends speak
    (``cbpause.client.weight_group`` and its packed buckets, ``cbpause.client.buckets``: torch only, nothing of the
    client's HTTP side)."""
    forbidden = {"cbpause.apps", "cbpause.client"} | ({"cbpause.serve"} if layer != "serve" else set())
    allowed = {"cbpause.client.weight_group", "cbpause.client.buckets"} if layer == "serve" else set()
    if layer == "client":  # its own modules only
        allowed = {module_name(path) for path in (SRC / "client").rglob("*.py")} | {"cbpause.client"}
    if layer not in ("integrations", "serve"):
        forbidden.add("cbpause.integrations")
    if layer == "client":
        forbidden = {"cbpause"}
    for path in (SRC / layer).rglob("*.py"):
        for imported in imports(path):
            assert imported in allowed or not any(imported == f or imported.startswith(f + ".") for f in forbidden), (
                path, imported)


def application(module: str) -> str | None:
    """``cbpause.apps.bench`` for any module of that application (a package or one file of ``apps/``)."""
    parts = module.split(".")
    return ".".join(parts[:3]) if parts[:2] == ["cbpause", "apps"] and len(parts) > 2 else None


def test_nothing_imports_an_application():
    for path in sources():
        own = application(module_name(path))
        for imported in imports(path):
            if application(imported) not in (None, own):
                pytest.fail(f"{path} imports the application {imported}")


def test_modules_and_functions_stay_readable():
    too_long = []
    for path in sources():
        text = path.read_text()
        if len(text.splitlines()) > 650:
            too_long.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                too_long.append(f"{path.relative_to(ROOT)}: {node.name}() is {node.end_lineno - node.lineno + 1} lines")
    assert too_long == []


def test_no_nox_session_runs_a_module_of_the_tests():
    noxfile = (ROOT / "noxfile.py").read_text()
    assert not re.search(r'"-m",\s*"tests\.', noxfile)


def test_the_import_reader_sees_relative_imports(tmp_path, monkeypatch):
    fake = tmp_path / "cbpause"
    (fake / "core").mkdir(parents=True)
    (fake / "core" / "protocol.py").write_text("from .. import tlc\nfrom .transitions import x\nimport torch\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", fake)
    assert imports(fake / "core" / "protocol.py") == {"cbpause.tlc", "cbpause.core.transitions", "torch"}


def test_ci_runs_the_readme_s_test_command():
    """The README gives two commands: the main job, then the tests; `.ci/run` runs the second, word for word (one home
    for what CI runs: the README)."""
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```sh\n(python3 -m pip install nox uv && python3 -m nox [^\n]+)\n```", readme)
    assert len(commands) >= 2 and commands[0].endswith("nox -s tlc")
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci.splitlines(), f".ci/run does not run the README's test command {commands[1]!r}"
