"""The docs point at things that exist: every relative link in README.md and docs/*.md, and every
path of the repository they name (rlctl/..., scripts/..., tests/..., recipes/..., docs/...)."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"(?<![\w./-])((?:rlctl|scripts|tests|recipes|docs)/[\w./*-]*[\w/*])")


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def broken_links(page: Path) -> list[str]:
    """Relative Markdown links of a page whose target does not exist (anchors and URLs skipped)."""
    broken = []
    for target in LINK.findall(page.read_text()):
        path = target.split("#", 1)[0]
        if not path or re.match(r"^[a-z][a-z0-9+.-]*:", path):
            continue
        if not (page.parent / path).exists():
            broken.append(target)
    return broken


def missing_paths(page: Path) -> list[str]:
    """Repository paths named in a page's text that do not exist; a glob (scripts/gpu_*.py) must
    match at least one."""
    named = set(REPO_PATH.findall(page.read_text()))
    return sorted(p for p in named if not (REPO / p).exists() and not any(REPO.glob(p)))


def test_every_relative_link_points_to_a_file_that_exists():
    broken = {page.name: links for page in _pages() if (links := broken_links(page))}
    assert broken == {}


def test_every_repository_path_the_docs_name_exists():
    missing = {page.name: paths for page in _pages() if (paths := missing_paths(page))}
    assert missing == {}


def test_the_checks_catch_a_broken_link_and_a_missing_path(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("See [there](nowhere.md), [the web](https://example.org), [here](#top),\n"
                    "rlctl/no_such_module.py, rlctl/cli.py, scripts/gpu_*.py and scripts/no_*.py.\n")
    assert broken_links(page) == ["nowhere.md"]
    assert missing_paths(page) == ["rlctl/no_such_module.py", "scripts/no_*.py"]
