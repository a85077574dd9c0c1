import importlib.util
import os
import shutil
import signal
import threading
from pathlib import Path

import pytest

from cbpause.testing import HANG_S, run_thread

ROOT = Path(__file__).resolve().parents[1]
TLA_DIR = ROOT / "tla"

# Bounds and sizes the tests of the real loop share.
WAIT = HANG_S  # the bound on any wait for something that must happen: a hang, not slowness (cbpause.testing)
MAX_NEW = 24  # tokens each request generates (greedy, no end-of-sequence token)
PROMPT = [1, 2, 3, 4, 5]


def load_script(name: str):
    """A module of ``scripts/`` (which is no package), loaded from its file."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def submit(manager, n: int = 4, prompt: list[int] = PROMPT) -> list[str]:
    """``n`` requests of ``MAX_NEW`` tokens each; their ids."""
    return [manager.add_request(list(prompt), max_new_tokens=MAX_NEW) for _ in range(n)]


def results(manager, ids: list[str]) -> list:
    """The one terminal output of each of ``ids``, in their order (fails on a missing or unknown output)."""
    outs = {}
    for _ in ids:
        out = manager.get_result(timeout=WAIT)
        assert out is not None, f"no output within {WAIT} s; have {sorted(outs)}"
        outs[out.request_id] = out
    assert sorted(outs) == sorted(ids)
    return [outs[i] for i in ids]


def overlapping_holders(manager, **pause_kwargs):
    """Holder A pauses; holder B arrives on the paused loop and enters directly; A leaves.  Returns with B still
    inside: B's thread and box, the event that lets B leave, and the forward steps counted when A left.

    Both count themselves in and out of ``manager.probe.inside`` (R-EXCLUSION).
    """
    probe = manager.probe
    second_in, leave_second = threading.Event(), threading.Event()

    def second_holder():
        with manager.pause(**pause_kwargs):  # arrives on a paused loop: enters directly
            probe.inside += 1
            second_in.set()
            leave_second.wait(WAIT)
            probe.inside -= 1

    with manager.pause(**pause_kwargs):
        probe.inside += 1
        thread, box = run_thread(second_holder)
        assert second_in.wait(WAIT), "a second holder on a paused loop must enter directly"
        probe.inside -= 1
        forwards = probe.forwards
    return thread, box, leave_second, forwards


@pytest.fixture(scope="module")
def cpu_model():
    """A tiny random Llama on the CPU, shared by the tests of one module."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from cbpause.testing import tiny_llama

    return tiny_llama()


@pytest.fixture
def plain_manager(cpu_model):
    """cbpause's manager on ``cpu_model``, not started; stopped after the test if it still runs."""
    from cbpause.integrations import transformers as cbt
    from cbpause.testing import batching_config, greedy_config

    manager = cbt.init_continuous_batching(cpu_model, greedy_config(MAX_NEW), batching_config())
    yield manager
    if manager.is_running():
        manager.stop(block=True, timeout=WAIT)


# ------------------------------------------------------------------------------------------- the layers

# What a test needs, which is where it runs (README, "Which checks a change runs"): each test module says its layer
# (``pytestmark = pytest.mark.layer("...")``; a test may say another), and each layer is a nox session.
LAYERS = {
    "core": "the standard library only (nox -s core; no torch in its environment)",
    "loop": "transformers' real loop on a tiny CPU model (nox -s loop)",
    "verify": "TLC: the models, the state graphs, trace validation, mutations (nox -s verify)",
    "system": "tensor-parallel process groups, soaks, TRL, HTTP servers, the wheel, the applications (nox -s system)",
}


def pytest_addoption(parser):
    group = parser.getgroup("cbpause")
    group.addoption("--layer", action="append", choices=sorted(LAYERS), default=[],
                    help="run only the tests of this layer (repeatable; default: every layer)")  # fmt: skip
    group.addoption("--ci", action="store_true",
                    help="CI's selection: leave out the tests marked `extended`, which their layer's session runs")


def pytest_configure(config):
    config.addinivalue_line("markers", "layer(name): what the test needs, and so the nox session that runs it: "
                            + "; ".join(f"{k}: {v}" for k, v in LAYERS.items()))  # fmt: skip
    config.addinivalue_line("markers", "extended: left out of CI's selection (--ci); its layer's session runs it")


def layer_of(item) -> str | None:
    marker = item.get_closest_marker("layer")
    return marker.args[0] if marker is not None and marker.args else None


def pytest_collection_modifyitems(config, items):
    """Every test has exactly one layer (its own marker, else its module's); ``--layer`` and ``--ci`` select."""
    unsorted = [item.nodeid for item in items if layer_of(item) not in LAYERS]
    if unsorted:
        raise pytest.UsageError("tests without a layer (pytest.mark.layer(...)): " + ", ".join(unsorted[:10]))
    layers, ci = config.getoption("--layer"), config.getoption("--ci")
    kept, dropped = [], []
    for item in items:
        out = (layers and layer_of(item) not in layers) or (ci and item.get_closest_marker("extended"))
        (dropped if out else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    if getattr(config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup (CI's)
        _group_for_xdist(items)


def _group_for_xdist(items) -> None:
    """What pytest-xdist 3.8 does for ``--dist loadgroup``, which has no effect under pytest 9: a test marked
    ``xdist_group(name)`` gets ``@name`` after its id, and the scheduler sends the tests of one name to one process.
    xdist renames ``item._nodeid``, which pytest 9 no longer reads (the id is ``item._id``, a ``NodeId``).  Without it,
    a module's servers (a module-scoped fixture) started once in each of CI's two processes."""
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # pytest 8: xdist's own renaming works
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})  # fmt: skip
        if names and "@" not in item.nodeid:
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")


def _tlc_available() -> str | None:
    if shutil.which("java") is None:
        return "java is not installed"
    try:
        from cbpause.tlc import find_jar

        find_jar()
    except Exception as exc:  # noqa: BLE001 - any reason to skip is reported
        return str(exc)
    return None


@pytest.fixture(scope="session")
def tlc_ready() -> None:
    """TLC must be runnable; in CI (CI=true) a missing TLC is a failure, not a skip."""
    reason = _tlc_available()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"TLC is required in CI: {reason}")
        pytest.skip(reason)


@pytest.fixture(scope="session")
def tlc_results(tlc_ready):
    """The run of a manifest model, by name: each model is run once per session (its verdict, counts, coverage,
    witnesses and, where the manifest asks, its state graph all come from that one run), or read from the cache
    ``CBPAUSE_TLC_CACHE`` names (the nox sessions name ``.cache/tlc``: a run the main job kept is not run again).
    A witness model's result is read from its parent's run."""
    from cbpause.tlc import Result, load_manifest, run_model
    from cbpause.tlc.cache import default_cache

    models = {m.name: m for m in load_manifest(TLA_DIR)}
    cache = default_cache()
    done: dict[str, Result] = {}

    def get(name: str) -> Result:
        if name not in done:
            model = models[name]
            if model.parent:
                parent = get(model.parent)
                done[name] = Result(model, parent.run, parent.found, None, parent.cached, via=model.parent)
            else:
                done[name] = run_model(model, TLA_DIR, cache=cache)
        return done[name]

    return get


@pytest.fixture
def tla_copy(tmp_path: Path) -> Path:
    """A private copy of tla/ that a test may mutate."""
    dest = tmp_path / "tla"
    shutil.copytree(TLA_DIR, dest)
    return dest


@pytest.fixture(autouse=True)
def sigint_raises_keyboard_interrupt():
    """Tests deliver real SIGINTs; make sure SIGINT raises KeyboardInterrupt in the main thread.

    A process started in the background by a non-interactive shell inherits SIGINT as ignored, and Python
    then leaves it ignored: the interrupt would never arrive and the waiter would wait for ever.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(autouse=True)
def end_leftover_fake_loops():
    """A test that fails (or xfails) before stopping its fake loop must not leave it stepping."""
    yield
    from cbpause.testing import end_leftover_loops

    end_leftover_loops()
