"""The sessions.  README, "Which checks a change runs", says when each runs; ``docs/verification.md`` lists every check.

The main job: ``nox -s tlc``.  The tests, by what they need (``tests/conftest.py``'s layers): ``core``, ``loop``,
``verify``, ``system``; ``ci`` is CI's selection of the last three.  The rest: ``tlc_deep``, ``crosshair``, ``fuzz``,
``traces``, ``bench``, ``gpu``, ``hostile``, ``soak``, ``lint``, ``docs``, ``docs_check``.

Every session installs one of a few environments (:data:`ENVIRONMENTS`), never a list of its own, so that the brief
run of each session that CI makes (``tests/test_sessions.py``: the session's own commands, :data:`COMMANDS`, with
their brief arguments, in a test of the layer whose environment is the session's) runs with what the session itself
installs: a session cannot lack a package unseen.  One exception: the main job (``tlc``, whose environment is
``.[tlc]``, a subset of the light one) runs in full in CI, so its brief run only lists the models, in the core
layer.  Virtual environments are reused between runs; a session's TLC
runs are kept in ``.cache/tlc`` (:mod:`cbpause.tlc.cache`), so that ``nox -s tlc core ci docs`` explores each state
space once.
"""

from __future__ import annotations

import ast
import functools
import os
import random
import subprocess
import sys
from pathlib import Path

import nox

nox.options.sessions = ["tlc", "core", "ci", "lint"]
nox.options.reuse_venv = "yes"
# Environments are made and filled by uv where it is installed (the README's commands install it beside nox): a run
# of `.ci/run` fills six, two with torch, and pip took 60 s for each of those (2 min 30 s of CI's 9 minutes, more on
# a loaded machine) where uv takes 5 s and then links from its cache.  Without uv, virtualenv and pip, as before.
nox.options.default_venv_backend = "uv|virtualenv"

# pip's configuration (its files and PIP_* variables) says where packages come from; uv reads none of it.  Given to
# uv as its own variables, an install through uv takes what pip would: here, the CPU torch wheel on the machine's
# disk and the machine's constraints (uv alone would resolve torch==2.13.0 on PyPI: a CUDA build, several GB).  A
# variable the user set is kept.  Each name: (uv's variable, how uv separates a list).
PIP_TO_UV = {
    "index-url": ("UV_INDEX_URL", " "), "extra-index-url": ("UV_EXTRA_INDEX_URL", " "),
    "find-links": ("UV_FIND_LINKS", ","), "constraint": ("UV_CONSTRAINT", " "), "cert": ("SSL_CERT_FILE", " "),
    "trusted-host": ("UV_INSECURE_HOST", " "), "no-index": ("", ""),
}  # fmt: skip
# pip's other settings (pre, only-binary, no-binary, no-compile, ...) are not translated: this project's installs
# need none of them.


def _pip_values(pip_config: str) -> dict[str, str]:
    """Per name of PIP_TO_UV, the value pip uses (its variable's over its files', ``install.`` over ``global.``).
    ``pip config list`` prints each value as a Python literal (a list on several lines of pip.conf keeps its
    newlines, escaped): read back as one, and its items split on whitespace, as pip splits them."""
    values: dict[str, tuple[int, str]] = {}
    for line in pip_config.splitlines():
        key, _, value = line.partition("=")
        scope, _, name = key.rpartition(".")
        rank = {":env:": 3, "install": 2, "global": 1}.get(scope, 0)
        if name in PIP_TO_UV and rank and rank >= values.get(name, (0, ""))[0]:
            try:
                text = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                text = value.strip("'\"")
            values[name] = (rank, " ".join(str(text).split()))
    return {name: value for name, (_, value) in values.items()}


def uv_settings_from_pip(pip_config: str) -> dict[str, str]:
    """uv's variables for ``pip config list``'s output ``pip_config`` (:func:`_pip_values`), with pip's choice among
    indexes (the best version on any of them) and no download of a Python interpreter (only the registries are
    reachable).  ``no-index`` is a flag of the install instead (:func:`install`).  Bytecode is written at import,
    not compiled at install (the comment above :func:`pip_flags`)."""
    settings = {"UV_INDEX_STRATEGY": "unsafe-best-match", "UV_PYTHON_DOWNLOADS": "never"}
    for name, value in _pip_values(pip_config).items():
        variable, separator = PIP_TO_UV[name]
        if variable:
            settings[variable] = separator.join(value.split())
    return settings


# Bytecode is written by the sessions' processes as they import, not compiled at install.  pip compiles all it
# installs; uv does not unless asked (UV_COMPILE_BYTECODE), and where PYTHONDONTWRITEBYTECODE is set, as on CI's
# machine, every process then compiled transformers and torch again at import (CI's tests ran 90 s longer).  Compiling
# at install costs 26 s of CPU for each environment with torch (all of torch, transformers and TRL, 14 s of a CI run
# each); the first import that compiles what a process needs costs 5 s once.  So the sessions' processes, which
# inherit nox's environment, write the bytecode of what they import, whatever the caller's PYTHONDONTWRITEBYTECODE.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def pip_flags(pip_config: str) -> list[str]:
    """The install's flags for pip's settings that uv takes only as flags: ``--no-index`` (an offline wheelhouse)."""
    no_index = _pip_values(pip_config).get("no-index", "").lower()
    return ["--no-index"] if no_index in ("1", "true", "yes", "on") else []


@functools.cache
def _pip_config() -> str:
    try:
        return subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                              timeout=60, check=True).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):  # no pip beside nox (nox from pipx or uv tool): its variables only
        return "\n".join(f":env:.{k[4:].lower().replace('_', '-')}={v!r}" for k, v in os.environ.items()
                         if k.startswith("PIP_"))  # fmt: skip


def uv_environment() -> dict[str, str]:
    """The variables an install runs with: pip's settings for uv (:func:`uv_settings_from_pip`), those the user set
    kept."""
    return {k: v for k, v in uv_settings_from_pip(_pip_config()).items() if k not in os.environ}


def install(session: nox.Session, *packages: str) -> None:
    """Every install of every session (through uv where nox found it, otherwise pip, which reads its own settings)."""
    session.install(*pip_flags(_pip_config()), *packages, env=uv_environment())

PYTHON = "3.11"
ROOT = Path(__file__).resolve().parent
TLC_CACHE = {"CBPAUSE_TLC_CACHE": str(ROOT / ".cache" / "tlc")}

# What a session installs.  "light": no torch (the core's tests, and the tools that read only the core and tla/);
# "full": the integration with everything it serves (transformers and the CPU torch 2.13.0 its pin admits, TRL,
# the HTTP server, the plots).
# tests/test_wheel.py builds the wheel with pip, without build isolation: a venv made by uv has neither.
WHEEL_TOOLS = ("pip", "setuptools>=68")
ENVIRONMENTS = {
    "tlc": ["-e", ".[tlc]"],
    "light": ["-e", ".[dev]"],
    # transformers 5.23.0: the release whose results the docs' figures come from; the other releases run in their own
    # sessions (transformers-5.24, transformers-5.25; CI runs the newest).
    "full": ["-e", ".[dev,transformers,trl,serve,bench]", "transformers==5.23.0", *WHEEL_TOOLS],
    "docs": ["-e", ".[docs]"],
    "docs_check": ["-e", ".[docs,docs-check]", "pytest", "pytest-timeout"],
    "lint": ["ruff"],
}

# The environment of each session, and the layer of the tests whose environment that is (tests/test_sessions.py runs
# a session's brief commands in a test of that layer: "core" tests run in the light environment, the others in the
# full one).
SESSION_ENV = {
    "tlc": "tlc", "tlc_deep": "light", "core": "light", "fuzz": "light", "crosshair": "light", "traces": "light",
    "traces_real": "full", "loop": "full", "verify": "full", "system": "full", "ci": "full", "bench": "full",
    "gpu": "full", "hostile": "full", "soak": "full", "soak_http": "full", "lint": "lint", "docs": "docs",
    "docs_check": "docs_check",
}  # fmt: skip
ENV_LAYER = {"light": "core", "full": "system", "tlc": "core"}  # tlc: see the module's docstring

FUZZ_SEED = "2027"

# CI's selection of the tests spreads over two processes (pytest-xdist): those tests wait as much as they compute
# (threads joined, subprocesses, TLC's start), so two use the CI machine's two cores even beside another busy
# process: 417 s in one process, 286 s in two there (2026-12-06).  The core layer gains nothing (48 s either way).
# Every test is independent of the others' order and process (its own ports, temporary folders and TLC copies; the
# TLC cache is written atomically).
XDIST = ("-n", "2", "--dist", "loadgroup")  # loadgroup: a module marked xdist_group runs in one process, in order


def _fuzz(seed: str, steps: str) -> list[tuple[list[str], dict[str, str]]]:
    return [([
        "pytest", "-q", "-s", "-p", "no:cacheprovider",
        "--timeout=3600",  # the campaign's own bound: the suite's 600 s is a hang detector, not a budget
        "tests/test_protocol_machine.py::test_fuzz_campaign",
    ], {"CBPAUSE_FUZZ_SEED": seed, "CBPAUSE_FUZZ_STEPS": steps})]  # fmt: skip


def _py(*args: str, env: dict[str, str] | None = None) -> list[tuple[list[str], dict[str, str]]]:
    return [(["python", *args], env or {})]


# Each named session's commands: the full run (with the session's arguments), and the brief one CI makes (given a
# folder for what it writes).  A command is (argv, environment).  The sessions that run pytest over a layer (core,
# loop, verify, system, ci) have none: they are what runs the brief commands.
COMMANDS = {
    "tlc": {
        "full": lambda a: _py("-m", "cbpause.tlc", "--fresh", *a, env=TLC_CACHE),
        "brief": lambda tmp: _py("-m", "cbpause.tlc", "--list"),  # CI runs the main job in full (README)
    },
    "tlc_deep": {
        "full": lambda a: _py("-m", "cbpause.tlc", *(a or ["--suite", "deep"]), env=TLC_CACHE)
        + ([] if a else _py("-m", "cbpause.tlc.conformance", env=TLC_CACHE)),
        "brief": lambda tmp: _py("-m", "cbpause.tlc", "--suite", "deep", "--list")
        + _py("-m", "cbpause.tlc.conformance", "--model", "PauseProtocol_1r2h", env=TLC_CACHE),
    },
    "crosshair": {
        "full": lambda a: [([
            "crosshair", "check", "--analysis_kind=PEP316", "--per_condition_timeout=40", "--per_path_timeout=5",
            "src/cbpause/core/transitions.py", *a,
        ], {})] + ([] if a else [(["pytest", "-p", "no:cacheprovider", "--layer", "core", "tests/test_crosshair.py"],
                                  {"CBPAUSE_CROSSHAIR_PLANTED": "1"})]),
        "brief": lambda tmp: [([
            "crosshair", "check", "--analysis_kind=PEP316", "--per_condition_timeout=3", "--per_path_timeout=1",
            "cbpause.core.transitions.leave_pause",
        ], {})],
    },  # fmt: skip
    "fuzz": {
        "full": lambda a: _fuzz(a[0], a[1] if len(a) > 1 else "100000"),  # a[0], the seed: the session draws one
        "brief": lambda tmp: _fuzz(FUZZ_SEED, "200"),
    },
    "traces": {
        "full": lambda a: _py("-m", "cbpause.apps.scenarios", *(a or ["--count", "200"]), env=TLC_CACHE),
        "brief": lambda tmp: _py("-m", "cbpause.apps.scenarios", "--count", "6", "--seed", "11"),
    },
    "traces_real": {
        "full": lambda a: _py("-m", "cbpause.apps.scenarios", "--real", *a),
        "brief": lambda tmp: _py("-m", "cbpause.apps.scenarios", "--real", "--covering", "--seed", "24"),
    },
    "bench": {
        "full": lambda a: _py("-m", "cbpause.apps.bench", *a),
        "brief": lambda tmp: _py("-m", "cbpause.apps.bench", "--quick", "--cases", "overhead", "--repeats", "1",
                                 "--out", tmp),  # fmt: skip
    },
    "gpu": {
        "full": lambda a: _py("-m", "cbpause.apps.bench.gpu", *a),
        "brief": lambda tmp: _py("-m", "cbpause.apps.bench.gpu", "--out", tmp, "--tests", "tests/test_versions.py"),
    },
    "hostile": {
        "full": lambda a: _py("-m", "cbpause.apps.hostile", *a),
        "brief": lambda tmp: _py("-m", "cbpause.apps.hostile", "--only", "dropin_status_before_mark_as_stopped",
                                 "--only", "same_thread_escalation"),  # fmt: skip
    },
    "soak": {
        "full": lambda a: _py("-m", "cbpause.apps.soak", *a),
        "brief": lambda tmp: _py("-m", "cbpause.apps.soak", "--seconds", "4", "--seed", "7"),
    },
    "soak_http": {
        "full": lambda a: _py("-m", "cbpause.apps.soak.http", *a),
        # two servers, then the two ranks of one TP engine (issue 42's relay)
        "brief": lambda tmp: _py("-m", "cbpause.apps.soak.http", "--seconds", "4", "--seed", "29")
        + _py("-m", "cbpause.apps.soak.http", "--seconds", "4", "--seed", "31", "--tp"),
    },
}


def _install(session: nox.Session, name: str) -> None:
    install(session, *ENVIRONMENTS[SESSION_ENV[name]])


def _run(session: nox.Session, commands: list[tuple[list[str], dict[str, str]]]) -> None:
    for argv, env in commands:
        session.run(*argv, env=env)


def _named(session: nox.Session, name: str) -> None:
    _install(session, name)
    _run(session, COMMANDS[name]["full"](list(session.posargs)))


# ------------------------------------------------------------------------------------------------ the main job


@nox.session(python=PYTHON)
def tlc(session: nox.Session) -> None:
    """The main job: TLC checks the main suite (the headline models, every defect of upstream found, each model's
    witnesses), under 3 minutes on 2 cores.  `-- --suite fast` adds the other fast models; `-- --model NAME`."""
    _named(session, "tlc")


# -------------------------------------------------------------------------------------------- the test layers


def _pytest(session: nox.Session, name: str, *args: str) -> None:
    _install(session, name)
    session.run("pytest", *args, *session.posargs, env=TLC_CACHE)


@nox.session(python=PYTHON)
def core(session: nox.Session) -> None:
    """The core's tests, in an environment without torch (seconds), and the brief runs of the light sessions."""
    _pytest(session, "core", "--layer", "core")


@nox.session(python=PYTHON)
def loop(session: nox.Session) -> None:
    """The tests on transformers' real loop (a tiny CPU model)."""
    _pytest(session, "loop", "--layer", "loop")


@nox.session(python=PYTHON)
def verify(session: nox.Session) -> None:
    """The tests that run TLC: every model of the main and fast suites, the state graphs, traces, mutations."""
    _pytest(session, "verify", "--layer", "verify")


@nox.session(python=PYTHON)
def system(session: nox.Session) -> None:
    """TP process groups, soaks, TRL, HTTP servers, the wheel, and the brief runs of the full sessions."""
    _pytest(session, "system", "--layer", "system")


@nox.session(python=PYTHON)
def ci(session: nox.Session) -> None:
    """CI's selection of the loop, verify and system layers (every test but those marked `extended`).  In CI
    (`CI` set, as `.ci/run` does), without what the newest release's session runs in the same run (each check once
    per run): see :func:`left_to_the_newest_release`."""
    elsewhere = left_to_the_newest_release() if os.environ.get("CI") else []
    _pytest(session, "ci", *XDIST, "--ci", "--layer", "loop", "--layer", "verify", "--layer", "system", *elsewhere)


# ------------------------------------------------------------------------------------------- the named sessions


# ------------------------------------------------------------------------------ the transformers releases (issue 41)

# The releases of transformers the integration supports (cbpause.integrations.transformers.SUPPORTED; a test checks
# they agree), each the version its fingerprints were taken on, and those whose server cbpause serve runs on.
RELEASES = {"5.23": "5.23.0", "5.24": "5.24.0", "5.25": "5.25.0"}
SERVED = ("5.23", "5.24", "5.25")
# On each release: the integration's real-loop tests, the TP=2 gloo tests, the serve tests (where it runs), TRL, the
# upstream defect tests (D1-D11, strict xfails: a release that fixes one fails here) and the drop-in fidelity tests
# (transformers' own pause scenarios through cbpause), the fingerprints and the staleness bound; then the real-loop
# campaign's covering subset.
RELEASE_TESTS = (
    "tests/test_integration_transformers.py", "tests/test_integration_tp.py", "tests/test_upstream_copies.py",
    "tests/test_dropin_fidelity.py", "tests/test_protocol_threads.py", "tests/test_staleness.py",
    "tests/test_versions.py", "tests/test_sampling.py", "tests/test_serve.py", "tests/test_serve_openai.py",
    "tests/test_serve_hostile.py", "tests/test_weights_broadcast.py", "tests/test_weights_tp.py", "tests/test_trl.py",
    "tests/test_trl_fleet.py", "tests/test_trl_stock.py",
)  # fmt: skip


SERVE_TESTS = ("tests/test_serve.py", "tests/test_serve_openai.py", "tests/test_serve_hostile.py",
               "tests/test_weights_broadcast.py", "tests/test_weights_tp.py", "tests/test_trl_fleet.py",
               "tests/test_trl_stock.py")  # fmt: skip
NEWEST = max(RELEASES, key=lambda minor: tuple(int(x) for x in minor.split(".")))
# The real-loop campaign's covering subset (every mode, the TP=2 plans, collective faults), its traces validated by
# TLC: each release's session ends with it (the loop's behaviour on that release is the spec's), and it is the brief
# run of traces_real.  After the tests, not among them: it computes as much as they do, and run as one of them
# (pytest-xdist sharing the two cores) it took 83 s instead of 47 and CI's run of the release session grew by 23 s.
RELEASE_CAMPAIGN = COMMANDS["traces_real"]["brief"]


def left_to_the_newest_release() -> list[str]:
    """The ``ci`` session's pytest arguments in CI: leave out the tests that CI's run of the newest release's session
    (``transformers-<NEWEST>``, in the same ``.ci/run``) runs, on the release users upgrade to, and the brief run of
    ``traces_real``, which that session ends with (:data:`RELEASE_CAMPAIGN`); the serve tests would stay if that
    release had no ``cbpause serve`` (they would be skipped there).  The matrix sessions run them on every release."""
    files = [f for f in RELEASE_TESTS if NEWEST in SERVED or f not in SERVE_TESTS]
    campaign = "tests/test_sessions.py::test_the_session_runs_briefly[traces_real]"
    return [*(f"--ignore={f}" for f in files), "--deselect", campaign]


def _release_session(minor: str, version: str) -> None:
    def session_fn(session: nox.Session) -> None:
        extras = "dev,transformers,trl" + (",serve" if minor in SERVED else "")
        install(session, "-e", f".[{extras}]", f"transformers=={version}")
        session.run("python", "-c", "import transformers; print('transformers', transformers.__version__)")
        # In CI (.ci/run sets CI), the newest release's session runs CI's selection of these tests (--ci: not those
        # marked `extended`); run by hand, every one.
        selection = ("--ci",) if os.environ.get("CI") else ()
        session.run("pytest", "-p", "no:cacheprovider", *XDIST, *selection, *RELEASE_TESTS, *session.posargs,
                    env=TLC_CACHE)  # fmt: skip
        _run(session, RELEASE_CAMPAIGN(""))

    session_fn.__doc__ = f"The integration's checks on transformers {version} (its own virtual environment)."
    nox.session(python=PYTHON, name=f"transformers-{minor}")(session_fn)


for _minor, _version in RELEASES.items():
    _release_session(_minor, _version)


@nox.session(python=PYTHON)
def tlc_deep(session: nox.Session) -> None:
    """The deep TLC models (minutes each), then PauseProtocol_2r1h_full's state graph against the Python
    transitions' (`-- --model NAME` runs that model only, without the comparison)."""
    _named(session, "tlc_deep")


@nox.session(python=PYTHON)
def crosshair(session: nox.Session) -> None:
    """CrossHair checks every contract of the pure transitions; fails on any counterexample.  Then it must find the
    two bugs ``tests/test_crosshair.py`` plants (minutes of search each)."""
    _named(session, "crosshair")


@nox.session(python=PYTHON)
def fuzz(session: nox.Session) -> None:
    """A long Hypothesis campaign, PauseProtocol against the pure model: 100,000 steps, seed printed.
    `nox -s fuzz -- SEED [STEPS]` reproduces a campaign."""
    seed = session.posargs[0] if session.posargs else str(random.randrange(2**32))
    session.log(f"fuzz seed {seed}")
    _install(session, "fuzz")
    _run(session, COMMANDS["fuzz"]["full"]([seed, *session.posargs[1:]]))


@nox.session(python=PYTHON)
def traces(session: nox.Session) -> None:
    """Record scenarios and validate every trace with TLC.  `nox -s traces`: 200 random threaded runs of
    PauseProtocol on simulated ranks.  `nox -s traces -- --real [...]`: scenarios on transformers' real loop
    (python -m cbpause.apps.scenarios --help)."""
    _named(session, "traces_real" if "--real" in session.posargs else "traces")


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """cbpause against transformers' own pause, side by side: `nox -s bench -- --quick`; `-- --trl`, `-- --http`,
    `-- --weights`."""
    _named(session, "bench")


@nox.session(python=PYTHON)
def gpu(session: nox.Session) -> None:
    """The GPU check: the CUDA tests and the bench on CUDA (python -m cbpause.apps.bench.gpu); without a CUDA
    device the CUDA parts are skipped and the rest runs.  ``scripts/gpu-check.sh`` does the same in the current
    Python, keeping its torch."""
    _named(session, "gpu")


@nox.session(python=PYTHON)
def hostile(session: nox.Session) -> None:
    """The hostile users' probes, each in its own process with a deadline; fails unless every probe is OK."""
    _named(session, "hostile")


@nox.session(python=PYTHON)
def soak(session: nox.Session) -> None:
    """A soak on the real loop with faults (`-- --minutes 10`, the default); `-- --http [...]`: the soak of
    `cbpause serve` over HTTP."""
    name = "soak_http" if "--http" in session.posargs else "soak"
    _install(session, name)
    _run(session, COMMANDS[name]["full"]([a for a in session.posargs if a != "--http"]))


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff over the package, tests, scripts and noxfile."""
    _install(session, "lint")
    session.run("ruff", "check", "src", "tests", "scripts", "noxfile.py")


DOCS_ENV = {"NO_MKDOCS_2_WARNING": "1", **TLC_CACHE}  # Material's notice about its successor, printed on every build


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Build the documentation site into site/ with warnings as errors; its pictures are drawn from the TLC runs the
    main job and the tests kept (or TLC runs now).  Java and Graphviz's `dot` needed.  Open site/index.html."""
    _install(session, "docs")
    session.run("mkdocs", "build", "--strict", env=DOCS_ENV)


@nox.session(python=PYTHON)
def docs_check(session: nox.Session) -> None:
    """Build the site, serve it on localhost and open every page in headless Chromium (/usr/bin/chromium, Debian's
    `chromium`): a screenshot per page in docs-check/, and a failure for a console error, a failed request, a
    missing image or a broken internal link, after a test that plants each of those faults in a tiny site."""
    _install(session, "docs_check")
    session.run("pytest", "-q", "-p", "no:cacheprovider", "--layer", "system", "tests/test_docs_check.py")
    session.run("mkdocs", "build", "--strict", env=DOCS_ENV)
    session.run("python", "scripts/docs_check.py", "site", "--out", "docs-check", *session.posargs)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run the sessions with nox: python -m nox -s NAME")
