"""The documentation stays true to the repository: every setting in one table, no link leading out of it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTING = re.compile(r"LORAPLEX_[A-Z0-9_]*[A-Z0-9]")
# Where settings are read: the package, the Makefile, and the test fixtures' own (LORAPLEX_TEST_*).
CODE = [*sorted((ROOT / "loraplex").rglob("*.py")), ROOT / "Makefile", *sorted((ROOT / "tests").rglob("conftest.py"))]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)[^)]*\)")
AUTOLINK = re.compile(r"<([a-z][a-z0-9+.-]*:[^>\s]*)>", re.IGNORECASE)
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)
PARENT_PATH = re.compile(r"(?<![\w/.])((?:\.\./)+[\w.-][\w./-]*)")


def code_settings() -> set[str]:
    return {name for path in CODE for name in SETTING.findall(path.read_text(encoding="utf-8"))}


def table_settings() -> set[str]:
    """The names in the first column of docs/configuration.md's table."""
    names = set()
    for line in (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8").splitlines():
        cells = line.split("|")
        if line.startswith("|") and len(cells) > 2:
            names.update(SETTING.findall(cells[1]))
    return names


def test_the_configuration_table_names_every_setting_in_the_code() -> None:
    missing = code_settings() - table_settings()
    assert not missing, f"docs/configuration.md lacks {sorted(missing)}"


def test_every_setting_in_the_configuration_table_exists_in_the_code() -> None:
    unknown = table_settings() - code_settings()
    assert not unknown, f"docs/configuration.md names settings the code never reads: {sorted(unknown)}"


def link_targets(text: str) -> list[str]:
    """Markdown link targets, autolinks, then bare `../` paths outside links, in that order."""
    bare = AUTOLINK.sub("", MARKDOWN_LINK.sub("", text))
    return MARKDOWN_LINK.findall(text) + AUTOLINK.findall(text) + PARENT_PATH.findall(bare)


def broken_links(text: str, directory: Path) -> list[str]:
    """Targets in `text`, read from `directory`, that leave the repository (a URL, a path above its root)
    or name nothing."""
    broken = []
    for target in link_targets(text):
        if SCHEME.match(target):
            broken.append(f"{target} (outside the repository)")
            continue
        path = target.split("#", 1)[0]
        if not path:
            continue  # an anchor on the same page
        resolved = (directory / path).resolve()
        if not resolved.is_relative_to(ROOT):
            broken.append(f"{target} (outside the repository)")
        elif not resolved.exists():
            broken.append(f"{target} (no such file)")
    return broken


def test_no_link_in_the_docs_leaves_the_repository_or_names_nothing() -> None:
    broken = {page.relative_to(ROOT).as_posix(): found for page in PAGES
              if (found := broken_links(page.read_text(encoding="utf-8"), page.parent))}
    assert not broken, broken


def test_the_link_check_catches_urls_paths_above_the_root_and_missing_files() -> None:
    text = ("[a](https://example.com) <http://127.0.0.1:8000/admin> see ../../shared/DESIGN.md, "
            "[b](../../elsewhere.md) [c](missing.md) [ok](serving.md#endpoints) [top](#x) ../bench/RESULTS.md "
            "and ../docs/nothing-here.md")
    assert broken_links(text, ROOT / "docs") == [
        "https://example.com (outside the repository)", "../../elsewhere.md (outside the repository)",
        "missing.md (no such file)", "http://127.0.0.1:8000/admin (outside the repository)",
        "../../shared/DESIGN.md (outside the repository)", "../docs/nothing-here.md (no such file)"]


def test_the_settings_check_reads_the_table_column_and_the_code() -> None:
    assert "LORAPLEX_DATABASE_URL" in code_settings() & table_settings()
    assert "LORAPLEX_TEST_DEVICE" in code_settings()  # tests/conftest.py
