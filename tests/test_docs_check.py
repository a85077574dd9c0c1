"""``scripts/docs_check.py`` finds what it must: a planted fault of every kind on a tiny site fails, a clean page
passes.  Needs Playwright and Debian's Chromium, which ``nox -s docs_check`` installs and runs this test with
before checking the real site; elsewhere it is skipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import load_script

pytestmark = pytest.mark.layer("system")

CHROMIUM = Path("/usr/bin/chromium")

pytest.importorskip("playwright.sync_api")
if not CHROMIUM.is_file():
    pytest.skip("no Chromium at /usr/bin/chromium (Debian: apt-get install -y chromium)", allow_module_level=True)


@pytest.fixture(scope="module")
def docs_check():
    return load_script("docs_check")


PIXEL = (  # a 1x1 PNG
    b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x06\x00\x00\x00\x1f\x15\xc4\x89"
    b"\x00\x00\x00\rIDATx\x9cc\xf8\xff\xff?\x00\x05\xfe\x02\xfe\xa7\x35\x81\x84\x00\x00\x00\x00IEND\xaeB`\x82"
)


def test_every_kind_of_fault_is_found_and_a_clean_page_passes(docs_check, tmp_path):
    site = tmp_path / "site"
    (site / "sub").mkdir(parents=True)
    (site / "pixel.png").write_bytes(PIXEL)
    (site / "sub" / "ok.html").write_text(
        '<html><body><h2 id="here">ok</h2><img src="../pixel.png"><a href="../bad.html">back</a>'
        '<a href="ok.html#here">here</a><a href="https://example.org/">out</a></body></html>'
    )
    (site / "bad.html").write_text(
        '<html><body><img src="missing.png"><a href="nope.html">gone</a><a href="sub/ok.html#nowhere">no anchor</a>'
        '<script>console.error("boom")</script><script>undefinedFunction()</script></body></html>'
    )
    faults = docs_check.check_site(site, tmp_path / "shots", str(CHROMIUM))
    assert faults["sub/ok.html"] == []
    bad = "\n".join(faults["bad.html"])
    for expected in ("image did not load: missing.png", "HTTP 404", "broken link:", "nope.html",
                     "no anchor #nowhere", "console error: boom", "uncaught exception"):  # fmt: skip
        assert expected in bad, (expected, bad)
    assert sorted(p.name for p in (tmp_path / "shots").iterdir()) == ["bad.png", "sub__ok.png"]
