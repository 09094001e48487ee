"""The documentation cannot drift: README's example is what ``scripts/demo.py`` prints today, every relative link of
README.md, CHANGELOG.md and docs/*.md leads to a file (and heading) that exists, every file of the repository they
name (a script they run, a module) exists, and the pages speak of stfs, not of how it was made."""

from __future__ import annotations

import difflib
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.helpers import IN_CI, run

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
DEMO_MARK = "<!-- python3 scripts/demo.py ~/demo prints this"


def readme_example() -> list[str]:
    """The lines of README's example: the code block right after the comment that names scripts/demo.py."""
    lines = (REPO / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(DEMO_MARK))
    assert lines[start + 1] == "```", "the example's code block follows its comment"
    end = lines.index("```", start + 2)
    return lines[start + 2 : end]


def demo_environment(tmp_path: Path) -> dict[str, str]:
    """The environment in which ``stfs`` is this checkout's (a shim first on PATH)."""
    shims = tmp_path / "bin"
    shims.mkdir()
    shim = shims / "stfs"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m stfs "$@"\n')
    shim.chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{shims}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }


def test_the_readme_example_is_what_the_demo_prints(tmp_path: Path, require_fuse: None) -> None:
    """``python3 scripts/demo.py WORK`` runs the example's commands on the demo model with this checkout's stfs; its
    output, WORK spelled ``~/demo``, is README's example line for line."""
    env = demo_environment(tmp_path)
    work = tmp_path / "demo"
    result = run([sys.executable, str(REPO / "scripts" / "demo.py"), str(work)], env=env, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    shown = result.stdout.replace(str(work), "~/demo").splitlines()
    expected = readme_example()
    assert shown == expected, "README's example and what scripts/demo.py prints differ:\n" + "\n".join(
        difflib.unified_diff(expected, shown, "README.md", "scripts/demo.py", lineterm="")
    )


def test_the_demo_without_a_folder_leaves_nothing_behind(tmp_path: Path, require_fuse: None) -> None:
    """``python3 scripts/demo.py`` (the README's first command) works in a temporary folder and removes it."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {**demo_environment(tmp_path), "TMPDIR": str(temporary)}
    result = run([sys.executable, str(REPO / "scripts" / "demo.py")], env=env, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "$ stfs unmount mnt" in result.stdout
    assert list(temporary.iterdir()) == []


def test_the_readme_example_mounts_what_the_readme_says() -> None:
    """The example shows the listing of a mount with files/ and a model's tree, not an older one."""
    example = readme_example()
    listing = example[example.index("mnt:") + 1 : example.index("mnt:") + 7]
    assert listing == ["files", "header.json", "index.json", "metadata", "shards", "tensors"]


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code, where brackets are not links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text without markup, lower case, spaces as hyphens, and no
    punctuation but hyphens and underscores."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a Markdown page (a repeated heading's get -1, -2, ... as GitHub numbers them)."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    found: set[str] = set()
    seen: dict[str, int] = {}
    for match in re.finditer(r"^#{1,6} +(.+?) *#*$", text, flags=re.MULTILINE):
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[str]:
    """The targets of the relative links of ``page`` (no scheme, no mailto)."""
    targets = re.findall(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", _prose(page.read_text()))
    return [target for target in targets if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(page: Path) -> None:
    assert page.exists()
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif anchor and anchor not in anchors(destination):
            broken.append(f"{target}: no heading with that anchor in {destination.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


# A path in the repository, as pages name files in prose and in commands (``python3 benchmarks/bench.py``).
REPO_PATH = re.compile(r"(?<![\w/.~-])((?:\.ci|benchmarks|fuzz|scripts|tests|stfs|man|docs)/[\w./*-]*[\w*])")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_file_a_page_names_exists(page: Path) -> None:
    """A file moved or renamed leaves no page naming it, nor a command that runs it (``tests/test_*.py`` is a
    pattern; a capitalised part, ``benchmarks/NAME.py``, a placeholder)."""
    missing = []
    for path in sorted(set(REPO_PATH.findall(page.read_text()))):
        if re.search(r"(?:^|/)[A-Z_]+(?:\.\w+)?(?:/|$)", path):
            continue
        if not (any(REPO.glob(path)) if "*" in path else (REPO / path).exists()):
            missing.append(path)
    assert not missing, f"{page.relative_to(REPO)} names what is not in the repository: {', '.join(missing)}"


def test_readme_links_to_every_page_of_docs() -> None:
    readme = (REPO / "README.md").read_text()
    for page in sorted((REPO / "docs").glob("*.md")):
        assert f"(docs/{page.name}" in readme, f"README.md does not link to docs/{page.name}"


# How the work was organised is the commit log's, not the reader's.
WORKSHOP_WORDS = re.compile(
    r"\bsessions?\b|\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth) pass\b|\bissue \d+"
    r"|(?<![\w&/])#\d+\b|\bhelpers?\b|bench\.lock|/work/",
    re.IGNORECASE,
)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_the_pages_speak_of_stfs_not_of_its_making(page: Path) -> None:
    found = [
        f"line {number}: {match.group(0)!r}"
        for number, line in enumerate(page.read_text().splitlines(), 1)
        for match in WORKSHOP_WORDS.finditer(line)
    ]
    assert not found, f"{page.relative_to(REPO)}: " + "; ".join(found)


def test_readme_stays_short() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) <= 200


def test_benchmarks_keep_the_current_figures_only() -> None:
    assert len((REPO / "docs" / "benchmarks.md").read_text().splitlines()) <= 400


# -- the man page ------------------------------------------------------------------------------------------------------


def test_the_man_page_names_every_format_and_url_scheme(tmp_path: Path) -> None:
    """stfs(1) as the wheel's build writes it (scripts/man_page.py: pyproject.toml's [tool.build_manpages]): NAME and
    every SOURCE's text made from formats.REGISTRY, each format's title and URL_SCHEMES (NAME said "mount
    safetensors models", SOURCE a .safetensors file, an index, a folder or an http(s), s3 or hf URL)."""
    from stfs.formats import REGISTRY, named
    from stfs.sources.base import URL_SCHEMES

    page = tmp_path / "stfs.1"
    made = run([sys.executable, str(REPO / "scripts" / "man_page.py"), str(page)], cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    text = page.read_text().replace("\\-", "-").replace("\\(aq", "'")
    lines = text.splitlines()
    name = lines[lines.index(".SH NAME") + 1]
    titles = [named(module).title for module, _, _ in REGISTRY]
    assert name.startswith("stfs - mount ") and all(title.split()[0] in name for title in titles), name
    assert all(scheme in name for scheme in URL_SCHEMES), name
    for command in ("mount", "info", "check"):
        section = text.split(f"'stfs {command}'", 1)[1]
        for word in (*titles, *URL_SCHEMES, *(s for _, names, indexes in REGISTRY for s in (*names, *indexes))):
            assert word in " ".join(section.split()), (command, word)


def test_man_stfs_works_after_the_readmes_setup() -> None:
    """README's setup (scripts/setup.sh; .ci/run the same) leaves ``man stfs`` working, an editable install too: the
    page was only built into build/man/, where man(1) never looks."""
    if shutil.which("man") is None:
        if IN_CI:
            pytest.fail("man is missing in CI (the Debian package man-db)")
        pytest.skip("no man here (the Debian package man-db; bash scripts/setup.sh)")
    env = {name: value for name, value in os.environ.items() if name != "MANPATH"}
    shown = run(["man", "-P", "cat", "stfs"], env={**env, "MANWIDTH": "100"})
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.lstrip().startswith("STFS(1)") and "NAME stfs - mount " in " ".join(shown.stdout.split())
