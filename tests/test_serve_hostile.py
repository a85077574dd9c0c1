"""``cbpause serve`` and ``Fleet`` against a hostile user (issue 39): each case of the issue's list
(:data:`cbpause.apps.hostile.serve_cases.CASES`, the hostile suite's serve section), a test each, on one guarded
server process; the SIGTERM case starts and stops a server of its own."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
pytest.importorskip("openai")

from cbpause.apps.hostile import serve_cases  # noqa: E402
from cbpause.client import MODES as CLIENT_MODES  # noqa: E402
from cbpause.serve.control import MODES  # noqa: E402

# Every case runs in one test, in order, on one server: the last case replays the lease log of all the others.  (As
# one test per case they were split between CI's two pytest-xdist workers, each with a server of its own, while
# xdist_group had no effect under pytest 9 (tests/conftest.py, _group_for_xdist, mends that now): the lease log then
# lacked the other worker's writes, a flaky failure.)
pytestmark = pytest.mark.layer("system")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from cbpause.testing.trl_cpu import save_tiny_policy

    root = tmp_path_factory.mktemp("serve-hostile")
    checkpoint = save_tiny_policy(root / "tiny", vocab_size=serve_cases.VOCAB)
    (root / "weights").mkdir()
    (root / "scratch").mkdir()
    with serve_cases.guarded_server(checkpoint, root / "weights", root / "scratch") as guarded:
        yield guarded


def test_the_server_withstands_every_hostile_case_in_order(server):
    for name, case in serve_cases.CASES.items():
        try:
            case(server)
        except Exception as error:
            raise AssertionError(f"hostile case {name}: {error!r}") from error


def test_the_client_s_modes_are_the_server_s():
    assert CLIENT_MODES == MODES
