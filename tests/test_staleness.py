"""R-STALENESS on transformers' real loop: ``init_continuous_batching(..., max_staleness=n, on_stale=...)``.

The loop is held right after a forward step (:class:`~cbpause.testing.StepGate`) at each window, as in
``tests/test_versions.py``, so that each request is known to be in flight with tokens of the versions set so far.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cbpause.integrations import transformers as cbt  # noqa: E402
from cbpause.integrations.weights import STALE  # noqa: E402
from cbpause.testing import StepGate, batching_config, greedy_config  # noqa: E402

from .conftest import MAX_NEW, PROMPT, WAIT, results, submit  # noqa: E402
from .test_versions import window_after_a_step  # noqa: E402

pytestmark = pytest.mark.layer("loop")


@pytest.fixture
def bounded(cpu_model, request):
    """A manager with ``max_staleness=1`` and the ``on_stale`` of the test's parameter, started at version 1."""
    manager = cbt.init_continuous_batching(cpu_model, greedy_config(MAX_NEW), batching_config(), max_staleness=1,
                                           on_stale=request.param)  # fmt: skip
    manager.start()
    with manager.pause():
        manager.set_weight_version(1)
    yield manager
    if manager.is_running():
        manager.stop(block=True, timeout=WAIT)


def reference(manager, n: int) -> list[list[int]]:
    """What ``n`` requests generate without any window (the weights never change here: greedy decoding repeats)."""
    return [list(o.generated_tokens) for o in results(manager, submit(manager, n))]


@pytest.mark.parametrize("bounded", ["restart"], indirect=True)
@pytest.mark.parametrize("mode", ["keep", "retract"])
def test_a_request_two_versions_behind_restarts_from_its_prompt(bounded, mode):
    manager = bounded
    expected = reference(manager, 1)[0]
    ids = submit(manager, 3)
    gate = StepGate(manager.background_thread_status, "end_step")
    assert gate.reached.wait(WAIT)
    gate.release()
    first = window_after_a_step(manager, 2, mode)  # one version behind: within the bound
    assert all(0 < first[i] < MAX_NEW for i in ids)
    window_after_a_step(manager, 3, mode)  # two behind: each restarts from its prompt
    for out in results(manager, ids):
        assert out.error is None and list(out.prompt_ids) == PROMPT
        assert list(out.generated_tokens) == expected  # nothing of the discarded tokens is left
        assert out.weight_versions == out.kv_versions == [(0, 3)], (out.weight_versions, out.kv_versions)
    assert manager.weight_version == 3 and manager.versions.stale == 3


@pytest.mark.parametrize("bounded", ["abort"], indirect=True)
def test_a_stale_request_ends_with_an_error_that_says_so(bounded):
    manager = bounded
    ids = submit(manager, 3)
    gate = StepGate(manager.background_thread_status, "end_step")
    assert gate.reached.wait(WAIT)
    gate.release()
    window_after_a_step(manager, 2)
    counts = window_after_a_step(manager, 3)
    for out in results(manager, ids):
        assert out.error.startswith(STALE) and "2 versions behind" in out.error, out.error
        assert len(out.generated_tokens) == counts[out.request_id]  # the tokens it had, delivered once
        assert out.weight_versions[0] == (0, 1)
    assert manager.get_result(timeout=0.2) is None  # one terminal output each
    later = results(manager, submit(manager, 1))[0]  # the loop goes on
    assert later.error is None and later.weight_versions == [(0, 3)]


@pytest.mark.parametrize("bounded", ["restart"], indirect=True)
def test_no_request_is_stale_without_a_new_version_or_within_the_bound(bounded):
    manager = bounded
    ids = submit(manager, 2)
    gate = StepGate(manager.background_thread_status, "end_step")
    assert gate.reached.wait(WAIT)
    gate.release()
    first = window_after_a_step(manager, 1)  # the same version: nothing restarts
    window_after_a_step(manager, 2)  # one behind
    for out in results(manager, ids):
        assert out.weight_versions[0] == (0, 1) and out.weight_versions[-1][1] == 2
        assert out.weight_versions[-1][0] > first[out.request_id]


def test_a_request_the_updates_leave_no_time_ends_once_its_restarts_are_spent(cpu_model):
    """Issue 40, point 1: ``max_staleness=0`` and a new version after every forward step, so the request is stale at
    every window.  It was restarted at every window for ever and never delivered; now it is restarted
    ``max_stale_restarts`` times (``StaleRestarted`` in ``RequestVersions.tla``), then ends with a stale error that
    says why."""
    manager = cbt.init_continuous_batching(cpu_model, greedy_config(MAX_NEW), batching_config(), max_staleness=0,
                                           max_stale_restarts=2)  # fmt: skip
    manager.start()
    try:
        with manager.pause():
            manager.set_weight_version(1)
        (rid,) = submit(manager, 1)
        for version in (2, 3, 4):  # two restarts, then the end
            window_after_a_step(manager, version)
        (out,) = results(manager, [rid])
        assert out.error is not None and out.error.startswith(STALE), out.error
        assert "restarted 2 times" in out.error and "max_stale_restarts=2" in out.error, out.error
        assert manager.versions.stale == 3 and manager.versions.restarts == {}
        assert manager.get_result(timeout=0.2) is None  # one terminal output
        later = results(manager, submit(manager, 1))[0]  # without windows a request is delivered
        assert later.error is None and later.weight_versions == [(0, 4)]
    finally:
        manager.stop(block=True, timeout=WAIT)


def test_bad_staleness_arguments_are_refused_before_anything_is_built(cpu_model):
    for bad, error in (({"max_staleness": -1}, ValueError), ({"max_staleness": "1"}, TypeError),
                       ({"max_staleness": True}, TypeError), ({"on_stale": "drop"}, ValueError),
                       ({"max_stale_restarts": -1}, ValueError), ({"max_stale_restarts": 2.0}, TypeError)):  # fmt: skip
        with pytest.raises(error):
            cbt.init_continuous_batching(cpu_model, greedy_config(MAX_NEW), batching_config(), **bad)
    assert getattr(cpu_model, "_cached_continuous_batching_manager", None) is None


def test_the_ledger_catches_labels_that_break_r_versions_or_r_kv_versions():
    """The soak's and the traffic's check of every output's labels (``Ledger.check_labels``) can fail."""
    from types import SimpleNamespace

    from cbpause.testing import Ledger

    def out(weights, kv, n=4):
        return SimpleNamespace(request_id="r", generated_tokens=[0] * n, weight_versions=weights, kv_versions=kv)

    ledger = Ledger()
    good = (out([(0, None), (2, 1)], [(0, None)]), out([(0, 1)], [(0, 1)]), out([(0, 1), (1, 3)], [(0, 1), (3, 3)]))
    for case in good:
        ledger.check_labels(case)
    assert ledger.label_faults == []
    bad = (out([(0, 1)], [(0, 2)]), out([(0, 2), (1, 1)], [(0, 1)]), out([(1, 1)], [(0, 1)]), out([], [(0, 1)]),
           out([(0, 1)], [(0, 1), (9, 1)]), out([(0, "a"), (1, 2)], [(0, 1)]))  # fmt: skip
    for case in bad:
        ledger.check_labels(case)
    assert len(ledger.label_faults) == len(bad), ledger.label_faults
