"""The docs agree with the code and with themselves: README.md and docs/*.md.

docs/settings.md is what scripts/gen_settings_doc.py makes from elasticd.config
now; every relative link in the README and docs/ names a file that exists (and,
for a page of docs, a heading it has); the README keeps its two quick-start
commands, the slow-case command CI runs, and the benchmark table's markers; no
page tells history. Reads files only: well under a second.
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from elasticd import config

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
# [text](target) outside code spans; a target has no spaces (titles are not used).
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
# What telling history reads like; the docs say what is, in the present tense.
HISTORY = re.compile(r"\bused to\b|\bno longer\b|\bwas \d|\(was\b|\bbefore this change\b"
                     r"|\bformerly\b|\bissue \d+", re.I)


def _generator():
    spec = importlib.util.spec_from_file_location(
        "gen_settings_doc", REPO / "scripts" / "gen_settings_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of ``page``."""
    out = set()
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for line in text.splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            title = m.group(1).strip().lower()
            slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
            out.add(slug)
    return out


def _links(page: Path) -> list[str]:
    return LINK.findall(CODE.sub("", page.read_text()))


def test_settings_doc_matches_config():
    gen = _generator()
    current = (DOCS / "settings.md").read_text()
    assert current == gen.expected(current, config), (
        "docs/settings.md differs from elasticd.config: run python scripts/gen_settings_doc.py")


def test_settings_doc_lists_every_setting():
    text = (DOCS / "settings.md").read_text()
    for sname, cls in config.SECTIONS.items():
        for name in cls.__dataclass_fields__:
            assert f"| `{sname}.{name}` |" in text, f"{sname}.{name} missing from docs/settings.md"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_links_point_at_files_that_exist(page):
    bad = []
    for target in _links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):      # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not bad, f"{page.relative_to(REPO)}: " + "; ".join(bad)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in _links(README)}
    missing = [p.name for p in DOCS.glob("*.md") if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_readme_quick_start_and_bench_markers():
    text = README.read_text()
    for command in ("bash scripts/demo.sh", "bash scripts/test.sh",
                    "bash scripts/test.sh -m slow"):
        assert command in text, f"README.md lost its command {command!r}"
    lines = text.splitlines()
    begin, end = "<!-- bench-table:begin -->", "<!-- bench-table:end -->"
    assert lines.count(begin) == 1 and lines.count(end) == 1, "bench-table markers, once each"
    table = lines[lines.index(begin) + 1:lines.index(end)]
    assert table and all(row.startswith("|") for row in table), "only the table between them"
    for row in table[2:]:
        assert re.search(r"bench/[\w/]+\.(py|sh)", row), f"a bench row names no script: {row}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_history(page):
    found = [m.group(0) for m in HISTORY.finditer(page.read_text())]
    assert not found, f"{page.relative_to(REPO)} tells history: {found}"


def test_layout_names_every_package_folder():
    """docs/layout.md's tree names each folder of daemon/elasticd/ (stubs aside), no more."""
    text = (DOCS / "layout.md").read_text()
    named = set(re.findall(r"^  ([a-z_]+)/", text, re.M))
    pkg = REPO / "daemon" / "elasticd"
    folders = {p.name for p in pkg.iterdir()
               if p.is_dir() and any(p.glob("*.py")) and p.name != "v1"}
    assert named == folders, (f"docs/layout.md names {sorted(named - folders)} that are not "
                              f"folders, misses {sorted(folders - named)}")
