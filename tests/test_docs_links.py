"""Every link of README.md, benchmarks/README.md and docs/*.md leads somewhere: a relative Markdown link
(or image) names a file or folder of the repository, and so does a repository path in backquotes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
# `docs/serving.md`, `benchmarks/results/scale.json`, `tests/test_cli.py::test_x`: a file of the repository
# named in backquotes; one with a placeholder (`<collection>`, `NAME`, `*`, `{a,b}`) names no one file
REPOSITORY_PATH = re.compile(r"`(?P<path>(?:docs|benchmarks|recipes|src|tests)/[\w./-]+?)(?:::[\w:\[\]-]+)?`")
PLACEHOLDER = re.compile(r"[<>*{}]|\b[A-Z]{2,}\b")


def _prose(page: Path) -> list[tuple[int, str]]:
    """The lines of `page` outside its fenced code blocks, numbered from 1."""
    kept, fenced = [], False
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if re.match(r"^\s*(```|~~~)", line):
            fenced = not fenced
        elif not fenced:
            kept.append((number, line))
    return kept


def relative_links(page: Path) -> list[tuple[int, str]]:
    """Each relative link target of `page` (its anchor left off), with its line."""
    found = []
    for number, line in _prose(page):
        for link in LINK.finditer(line):
            target = link["target"].split("#", 1)[0]
            if target and not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                found.append((number, target))
    return found


def repository_paths(page: Path) -> list[tuple[int, str]]:
    """Each repository path `page` names in backquotes, with its line."""
    return [
        (number, named["path"].rstrip("."))
        for number, line in _prose(page)
        for named in REPOSITORY_PATH.finditer(line)
        if not PLACEHOLDER.search(named["path"])
    ]


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_every_relative_link_leads_to_a_file(page: Path) -> None:
    where = page.relative_to(ROOT)
    broken = [f"{where}:{number}: {target}" for number, target in relative_links(page)
              if not (page.parent / target).exists()]  # fmt: skip
    assert broken == []


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_every_repository_path_named_exists(page: Path) -> None:
    where = page.relative_to(ROOT)
    missing = [
        f"{where}:{number}: {path}" for number, path in repository_paths(page) if not (ROOT / path).exists()
    ]
    assert missing == []


def test_the_links_are_found() -> None:
    readme = ROOT / "README.md"
    assert (ROOT / "docs" / "scale.md") in {readme.parent / target for _, target in relative_links(readme)}
    assert "docs/outputs.md" in {path for _, path in repository_paths(readme)}
