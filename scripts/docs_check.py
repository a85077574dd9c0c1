"""Open every page of the built site in headless Chromium, save a screenshot of each, and fail on any fault.

Usage: ``python scripts/docs_check.py [SITE_DIR] [--out DIR] [--chromium PATH]`` (``nox -s docs_check`` builds
the site first).  The site is served on localhost by a thread of this script; every ``.html`` page is opened
with Playwright driving Debian's Chromium (``/usr/bin/chromium``, never a downloaded browser), and a page fails
on:

* a message of type ``error`` on the console, or an uncaught exception in its scripts;
* a request of the page that fails or answers 400 or more (a stylesheet, a script, a picture);
* an ``<img>`` that did not load (``naturalWidth`` 0);
* an internal link (same origin) to a page that does not exist, or to an anchor the page does not have.

Screenshots go to ``docs-check/`` (one PNG per page, named after its path); the script prints one line per
page and exits 1 if any page failed.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import sys
import threading
import urllib.parse
from pathlib import Path

CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]  # fmt: skip  # the machine's network is closed: no background connections

_IMAGES = """() => Array.from(document.images)
    .filter(img => !img.complete || img.naturalWidth === 0).map(img => img.getAttribute('src'))"""
_LINKS = "() => Array.from(document.querySelectorAll('a[href]')).map(a => a.href)"
_IDS = "() => Array.from(document.querySelectorAll('[id]')).map(e => e.id)"


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(_Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, name="docs-server", daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def check_site(site: Path, out: Path, chromium: str) -> dict[str, list[str]]:
    """Every page's faults (an empty list for a page without any), screenshots in ``out``."""
    from playwright.sync_api import sync_playwright

    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html"))
    if not pages:
        raise SystemExit(f"docs_check: no .html page in {site}: build the site first (nox -s docs)")
    out.mkdir(parents=True, exist_ok=True)
    server, base = serve(site)
    faults: dict[str, list[str]] = {}
    ids: dict[str, set[str]] = {}
    links: dict[str, list[str]] = {}
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            for rel in pages:
                faults[rel], ids[rel], links[rel] = _open(context, base, rel, out)
            browser.close()
    finally:
        server.shutdown()
    for rel, hrefs in links.items():
        for href in hrefs:
            fault = _link_fault(href, base, site, ids)
            if fault:
                faults[rel].append(fault)
    return faults


def _open(context, base: str, rel: str, out: Path) -> tuple[list[str], set[str], list[str]]:
    page = context.new_page()
    found: list[str] = []
    page.on("console", lambda m: found.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: found.append(f"uncaught exception: {e}"))
    page.on("requestfailed", lambda r: found.append(f"request failed: {r.url} ({r.failure})"))
    page.on("response", lambda r: found.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)
    page.goto(base + rel, wait_until="networkidle")
    found += [f"image did not load: {src}" for src in page.evaluate(_IMAGES)]
    page_ids = set(page.evaluate(_IDS))
    hrefs = page.evaluate(_LINKS)
    page.screenshot(path=str(out / (rel.replace("/", "__").removesuffix(".html") + ".png")), full_page=True)
    page.close()
    return found, page_ids, hrefs


def _link_fault(href: str, base: str, site: Path, ids: dict[str, set[str]]) -> str | None:
    if not href.startswith(base):
        return None  # an external link: not ours to check (and the machine has no network)
    url = urllib.parse.urlsplit(href)
    path = urllib.parse.unquote(url.path).lstrip("/") or "index.html"
    if path.endswith("/"):
        path += "index.html"
    if not (site / path).is_file():
        return f"broken link: {href} (no {path})"
    if url.fragment and path in ids and url.fragment not in ids[path]:
        return f"broken link: {href} (no anchor #{url.fragment} in {path})"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("site", nargs="?", type=Path, default=Path("site"))
    parser.add_argument("--out", type=Path, default=Path("docs-check"), help="folder for the screenshots")
    parser.add_argument("--chromium", default="/usr/bin/chromium", help="the Chromium to drive")
    args = parser.parse_args(argv)
    if not Path(args.chromium).is_file():
        print(f"docs_check: no Chromium at {args.chromium} (Debian: apt-get install -y chromium)", file=sys.stderr)
        return 2
    faults = check_site(args.site.resolve(), args.out, args.chromium)
    for rel, found in faults.items():
        print(f"{'FAIL' if found else 'ok  '} {rel}")
        for f in found:
            print(f"       {f}")
    bad = sum(1 for f in faults.values() if f)
    print(f"docs_check: {len(faults)} pages, {bad} with faults; screenshots in {args.out}/")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
