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

# One process runs every case, in order, on one server: the last case replays the lease log of all the others
# (CI's two pytest-xdist workers would split them: --dist loadgroup keeps a group together).
pytestmark = [pytest.mark.layer("system"), pytest.mark.xdist_group("serve-hostile")]


@pytest.fixture(scope="session")  # not torn down when the worker runs another module in between (the lease log)
def server(tmp_path_factory):
    from cbpause.testing.trl_cpu import save_tiny_policy

    root = tmp_path_factory.mktemp("serve-hostile")
    checkpoint = save_tiny_policy(root / "tiny", vocab_size=serve_cases.VOCAB)
    (root / "weights").mkdir()
    (root / "scratch").mkdir()
    with serve_cases.guarded_server(checkpoint, root / "weights", root / "scratch") as guarded:
        yield guarded


@pytest.mark.parametrize("case", list(serve_cases.CASES))
def test_the_server_withstands_the_hostile_case(server, case):
    serve_cases.CASES[case](server)


def test_the_client_s_modes_are_the_server_s():
    assert CLIENT_MODES == MODES
