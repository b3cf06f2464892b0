"""The README's layout section matches the tree, and its links lead somewhere.

The layout section is a code block under ``## Layout``: a line that starts in the first column
names a path from the repository root (``src/lowcomm/``, ``tests/``), a line indented by two
spaces names a path under the last such root, and deeper lines continue a description. Every
package under ``src/lowcomm`` must be named there, and every path named there must exist, so
the section cannot fall behind a new package or keep one that was removed.
"""

from __future__ import annotations

import re
from pathlib import Path

_ENTRY = re.compile(r"^( {2})?(\S+)")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def layout_entries(readme: str) -> list[str]:
    """The paths the layout section names, relative to the repository root (``/`` kept on a
    directory). Raises ValueError when the README has no layout section or no block in it."""
    match = re.search(r"^## Layout\n(.*?)(?=^## |\Z)", readme, flags=re.M | re.S)
    if match is None:
        raise ValueError("README.md has no '## Layout' section")
    block = re.search(r"^```[^\n]*\n(.*?)^```", match.group(1), flags=re.M | re.S)
    if block is None:
        raise ValueError("README.md's '## Layout' section has no code block")
    entries: list[str] = []
    root = ""
    for line in block.group(1).splitlines():
        entry = _ENTRY.match(line)
        if entry is None:
            continue  # a blank line, or a description continued deeper
        name = entry.group(2)
        if entry.group(1) is None:
            root = name if name.endswith("/") else ""
            entries.append(name)
        elif root:
            entries.append(root + name)
    return entries


def layout_problems(readme: str, repo: Path) -> list[str]:
    """What the layout section gets wrong about ``repo``: a package under src/lowcomm it does
    not name, or a path it names that does not exist."""
    entries = layout_entries(readme)
    named = {entry.rstrip("/") for entry in entries}
    problems = [
        f"{entry}: named in README.md's layout section, but there is no such "
        f"{'directory' if entry.endswith('/') else 'file'}"
        for entry in entries
        if not ((repo / entry).is_dir() if entry.endswith("/") else (repo / entry).is_file())
    ]
    for init in sorted((repo / "src" / "lowcomm").rglob("__init__.py")):
        package = init.parent.relative_to(repo).as_posix()
        if package != "src/lowcomm" and package not in named:
            problems.append(f"{package}/: a package that README.md's layout section does not name")
    return problems


def link_problems(page: Path, repo: Path) -> list[str]:
    """Relative links of the markdown ``page`` that do not lead to a file in ``repo``."""
    problems = []
    for target in _LINK.findall(page.read_text()):
        path = target.split("#", 1)[0]
        if not path or re.match(r"^[a-z][a-z0-9+.-]*:", path):
            continue  # an anchor on the same page, or a URL
        if not (page.parent / path).is_file():
            problems.append(f"{page.relative_to(repo)}: link {target} leads to no file")
    return problems


def test_the_layout_section_names_every_package_and_only_paths_that_exist(
    repo_root: Path,
) -> None:
    readme = (repo_root / "README.md").read_text()
    assert layout_problems(readme, repo_root) == []
    assert "src/lowcomm/strategies/" in layout_entries(readme)


def test_every_relative_link_of_the_readme_leads_to_a_file(repo_root: Path) -> None:
    assert link_problems(repo_root / "README.md", repo_root) == []


def test_every_relative_link_of_the_topic_pages_leads_to_a_file(repo_root: Path) -> None:
    pages = [*sorted((repo_root / "docs").glob("*.md")), repo_root / "docs/results/README.md"]
    assert len(pages) > 10  # the topic pages are there to check
    assert [problem for page in pages for problem in link_problems(page, repo_root)] == []


def test_the_check_finds_a_missing_package_and_a_path_that_is_gone(tmp_path: Path) -> None:
    for package in ("comm", "strategies", "comm/inner"):
        (tmp_path / "src" / "lowcomm" / package).mkdir(parents=True)
        (tmp_path / "src" / "lowcomm" / package / "__init__.py").write_text("")
    (tmp_path / "src" / "lowcomm" / "__init__.py").write_text("")
    (tmp_path / "src" / "lowcomm" / "cli.py").write_text("")
    (tmp_path / "tests").mkdir()
    readme = (
        "# x\n\n## Layout\n\n```\nsrc/lowcomm/\n  comm/        communicators,\n"
        "               strategies/ in a description is not an entry\n  cli.py       the command\n"
        "  plan.py      gone\ntests/         tests\ndocs/          gone too\n```\n\n## Next\n"
    )
    assert layout_entries(readme) == [
        "src/lowcomm/", "src/lowcomm/comm/", "src/lowcomm/cli.py", "src/lowcomm/plan.py",
        "tests/", "docs/",
    ]  # fmt: skip
    problems = layout_problems(readme, tmp_path)
    assert problems == [
        "src/lowcomm/plan.py: named in README.md's layout section, but there is no such file",
        "docs/: named in README.md's layout section, but there is no such directory",
        "src/lowcomm/comm/inner/: a package that README.md's layout section does not name",
        "src/lowcomm/strategies/: a package that README.md's layout section does not name",
    ]


def test_the_link_check_finds_a_link_to_nothing(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "data.md").write_text("# data\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[data](docs/data.md#tokens) [gone](docs/gone.md) [a dir](docs/) "
        "[web](https://pytorch.org) [here](#layout)\n"
    )
    assert link_problems(page, tmp_path) == [
        "README.md: link docs/gone.md leads to no file",
        "README.md: link docs/ leads to no file",
    ]
