"""MkDocs hooks of the documentation site (``mkdocs.yml``: ``hooks``).

Before the build (``on_pre_build``) they write ``docs/generated/`` (git-ignored): the pictures TLC's output
gives (:mod:`cbpause.apps.diagrams`: the loop's phase diagram from the state graphs of fast models, one
sequence diagram per upstream defect from its counterexample), the table of the models of
``tla/models.toml``, and one page per file of ``tla/`` and per test module, so that the site can link to the
TLA+ and the tests it talks about.
TLC runs again whenever a file of ``tla/`` or of :mod:`cbpause.tlc` changes (the results are cached under
``.cache/docs/`` by a hash of both); so a change to the spec changes the pictures.  ``mkdocs serve`` is not
supported (the generated folder would trigger its own rebuilds): build, then open ``site/index.html`` or run
``nox -s docs_check``.

Each page's Markdown (``on_page_markdown``) then gets its ``<!-- include: PATH -->`` and
``<!-- include: PATH#name -->`` lines replaced by that file, or by the part of it between
``<!-- docs:name -->`` and ``<!-- /docs:name -->``, so that ``spec/PROTOCOL.md`` and the README's set-up
commands are rendered, not copied; and every relative link is rewritten for the site: a link to a page of
``docs/`` stays one, ``spec/PROTOCOL.md`` is the protocol page, ``README.md`` the landing page, a file of
``tla/`` or a test module its source page, and a link to any other file of the repository (``src/``)
becomes its text, since the site does not carry those files (the API reference renders ``src/``).
"""

from __future__ import annotations

import hashlib
import posixpath
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
GENERATED = DOCS / "generated"
CACHE = ROOT / ".cache" / "docs"

_INCLUDE = re.compile(r"^([ \t]*)<!-- include: ([\w./-]+)(?:#([\w-]+))? -->$", re.MULTILINE)
_LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s#]*)(#[^)\s]*)?\)")
_FENCE = re.compile(r"^(```|~~~)")


def _key() -> str:
    h = hashlib.sha256()
    from cbpause import tlc
    from cbpause.apps import diagrams

    # the spec, and the code that runs TLC and reads its output (a change to either may change a picture)
    tooling = sorted(Path(tlc.__file__).parent.glob("*.py")) + [Path(diagrams.__file__)]
    sources = sorted((ROOT / "tla").iterdir()) + tooling
    for path in sources:
        if path.is_file():
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:20]


def _pictures(out: Path) -> None:
    from cbpause.apps import diagrams

    cached = CACHE / _key()
    if not (cached / "done").is_file():
        tmp = cached.with_suffix(".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        diagrams.generate(tmp, ROOT / "tla", on_line=lambda line: print(f"docs: TLC: {line}", flush=True))
        (tmp / "done").write_text("")
        shutil.rmtree(cached, ignore_errors=True)
        tmp.rename(cached)
        for old in CACHE.iterdir():  # the pictures of earlier versions of the spec
            if old != cached:
                shutil.rmtree(old, ignore_errors=True)
    for f in cached.iterdir():
        if f.name != "done":
            shutil.copy(f, out / f.name)


def _models_table(out: Path) -> None:
    from cbpause.tlc.manifest import load_manifest

    rows = ["| model | suite | TLC must give | distinct states | what it checks |", "|---|---|---|---|---|"]
    for m in load_manifest(ROOT / "tla"):
        if m.witness:
            continue
        cfg = f"[`{m.cfg}`](sources/{m.cfg}.md)"
        states = f"{m.distinct_states:,}" if m.distinct_states else ""
        rows.append(f"| `{m.name}` ({cfg}) | {m.suite} | `{m.expect}` | {states} | {m.description} |")
    (out / "models.md").write_text("\n".join(rows) + "\n")


_LANG = {".tla": "tla", ".cfg": "text", ".toml": "toml", ".py": "python"}


def _sources(out: Path) -> None:
    """One page per file of ``tla/`` and per test module, for the pages' links to them."""
    (out / "sources" / "tests").mkdir(parents=True)
    files = [p for p in sorted((ROOT / "tla").iterdir()) if p.suffix in (".tla", ".cfg", ".toml")]
    files += sorted((ROOT / "tests").glob("*.py"))
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        text = f"# `{rel}`\n\n```{_LANG[path.suffix]}\n{path.read_text().rstrip()}\n```\n"
        dest = out / "sources" / ("tests" if rel.startswith("tests/") else "") / f"{path.name}.md"
        dest.write_text(text)


def on_pre_build(config, **kwargs) -> None:
    shutil.rmtree(GENERATED, ignore_errors=True)
    GENERATED.mkdir(parents=True)
    _sources(GENERATED)
    _models_table(GENERATED)
    _pictures(GENERATED)


# ------------------------------------------------------------------------------------------ Markdown


def _site_target(repo_path: str, page_dir: str) -> str | None:
    """Where a link to ``repo_path`` (relative to the repository) goes on the site, relative to the page."""
    if repo_path.startswith("docs/"):
        target = repo_path[len("docs/") :]
    elif repo_path == "spec/PROTOCOL.md":
        target = "protocol.md"
    elif repo_path == "README.md":
        target = "index.md"
    elif repo_path.rstrip("/") == "tla":
        target = "tlc.md"
    elif repo_path.startswith("tla/") and (ROOT / repo_path).is_file():
        target = f"generated/sources/{repo_path[4:]}.md"
    elif repo_path.startswith("tests/") and repo_path.endswith(".py") and (ROOT / repo_path).is_file():
        target = f"generated/sources/{repo_path}.md"
    else:
        return None
    return posixpath.relpath(target, page_dir or ".")


def rewrite_links(text: str, source_dir: str, page_dir: str) -> str:
    """Every relative link of ``text`` (written in the repository folder ``source_dir``) as the site has it."""

    def one(m: re.Match) -> str:
        bang, label, target, anchor = m.group(1), m.group(2), m.group(3), m.group(4) or ""
        if not target or re.match(r"^[a-z]+:", target):
            return m.group(0)
        repo_path = posixpath.normpath(posixpath.join(source_dir, target))
        site = _site_target(repo_path, page_dir)
        if site is None:
            return m.group(0) if bang else label
        return f"{bang}[{label}]({site}{anchor})"

    out, fenced = [], False
    for line in text.split("\n"):
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
        out.append(line if fenced else _LINK.sub(one, line))
    return "\n".join(out)


def _section(text: str, name: str, path: str) -> str:
    start, end = f"<!-- docs:{name} -->", f"<!-- /docs:{name} -->"
    if start not in text or end not in text:
        raise ValueError(f"{path} has no section {name!r} (between {start} and {end})")
    return text[text.index(start) + len(start) : text.index(end)].strip("\n")


def on_page_markdown(markdown: str, page, config, files) -> str:
    page_dir = posixpath.dirname(page.file.src_uri)
    source_dir = posixpath.join("docs", page_dir)

    def include(m: re.Match) -> str:
        indent, path, name = m.group(1), m.group(2), m.group(3)
        repo_path = path if (ROOT / path).is_file() else posixpath.normpath(posixpath.join(source_dir, path))
        full = ROOT / repo_path
        if not full.is_file():
            raise FileNotFoundError(f"{page.file.src_uri}: include of {path}: no file {full}")
        text = full.read_text()
        if name:
            text = _section(text, name, repo_path)
        if full.suffix == ".md":
            text = rewrite_links(text, posixpath.dirname(repo_path), page_dir)
        return "\n".join(indent + line if line else line for line in text.split("\n"))

    markdown = _INCLUDE.sub(include, rewrite_links(markdown, source_dir, page_dir))
    return markdown


_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):<code>(~?)([\w.]+)</code>")


def on_page_content(html: str, page, config, files) -> str:
    """The docstrings' Sphinx roles (``:class:`~cbpause.X` ``) as code, the way Sphinx would show them."""
    return _ROLE.sub(lambda m: f"<code>{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}</code>", html)


def on_post_build(config, **kwargs) -> None:
    # The site carries what it needs; docs/generated/ is rebuilt by every build and never committed.
    shutil.rmtree(GENERATED, ignore_errors=True)
