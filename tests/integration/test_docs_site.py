"""The documentation: the mkdocs site builds with no warning (every link and anchor resolves, every API page's
docstrings parse), the README's links and the code's citations of docs pages resolve, and the README's set-up
commands are the ones CI runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(markdown: Path) -> set[str]:
    """The heading anchors of a Markdown file as GitHub and the site (pymdownx `slugify(case="lower")`) make them."""
    slugs = pytest.importorskip("pymdownx.slugs", reason="the docs extra is not installed (pip install -e '.[docs]')")
    slugify = slugs.slugify(case="lower")
    out, fence = set(), False
    for line in markdown.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            out.add(slugify(re.sub(r"`([^`]*)`", r"\1", line.lstrip("#").strip()), "-"))
    return out


def test_mkdocs_build_strict_has_no_warning(tmp_path):
    """`mkdocs build --strict` fails on any warning: a broken link or anchor between pages, a page missing from the
    nav, an API page whose module or docstring griffe cannot read. The output is scanned for warnings too, so that a
    warning the strict mode lets through still fails here."""
    pytest.importorskip("mkdocstrings", reason="the docs extra is not installed (pip install -e '.[docs]')")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    warnings = [line for line in output.splitlines() if "WARNING" in line]
    assert proc.returncode == 0 and not warnings, output[-4000:]
    for page in ("index.html", "reference/objectives/index.html", "methods/dgpo/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    # the API reference is generated from the docstrings: a formula's source cited in one is on its page
    assert "arXiv:2311.12908" in (tmp_path / "site" / "reference/objectives/index.html").read_text()


def test_readme_links_resolve():
    """Every relative link in the README names an existing file, and its anchor a heading of that file."""
    broken = []
    for target in LINK.findall((REPO / "README.md").read_text()):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        if not (REPO / path).exists() or (anchor and anchor not in _anchors(REPO / path)):
            broken.append(target)
    assert not broken, f"README links that do not resolve: {broken}"


CITATION = re.compile(r"(?<![\w/.])docs/([A-Za-z0-9_/]+\.md)(?:#([A-Za-z0-9_\-]+))?")


def test_docs_cited_in_the_code_resolve():
    """Docstrings, comments and configs cite pages as ``docs/<page>.md#<anchor>``: every such page exists and holds the
    anchor (a page moved or a heading renamed without updating its citations fails here)."""
    broken = []
    for folder in ("diffalign", "scripts", "experiments", "tests", "docs"):
        for path in sorted((REPO / folder).rglob("*")):
            if path.suffix not in (".py", ".yaml", ".toml", ".md") or "__pycache__" in path.parts:
                continue
            for page, anchor in CITATION.findall(path.read_text(errors="replace")):
                target = REPO / "docs" / page
                if not target.is_file() or (anchor and anchor not in _anchors(target)):
                    broken.append(f"{path.relative_to(REPO)}: docs/{page}{'#' + anchor if anchor else ''}")
    assert not broken, "citations of docs pages that do not resolve:\n" + "\n".join(broken)


def test_readme_is_a_front_door_and_ci_runs_its_commands():
    """The README stays short (≤ 150 lines; measurements live in docs/results/), and CI (.ci/run) installs and tests
    with the README's two commands: its install line begins command 1, its test line ends command 2."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    block = re.search(r"```bash\n(.*?)```", readme, re.DOTALL).group(1)
    commands = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2, commands
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    install = next(line for line in ci if "pip install" in line)
    test = next(line for line in ci if "pytest" in line)
    assert commands[0].startswith(install), (commands[0], install)
    assert commands[1].endswith(test), (commands[1], test)


MACHINE_LOCAL = re.compile(r"(?<![\w.<>-])/(?:work|root|home)/[^\s`)]*|\.\./shared\b")


def test_docs_name_no_folder_of_the_machine_they_were_written_on():
    """The README and docs/ give commands with paths a reader has or replaces (``runs/...``, ``<work>``,
    ``/models/...``), never a folder of the machine the figures were measured on (``/work/...``, ``/root/...``,
    ``/home/...``) nor the team's notes outside the repository (``../shared``)."""
    found = []
    for path in [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            found += [f"{path.relative_to(REPO)}:{number}: {hit}" for hit in MACHINE_LOCAL.findall(line)]
    assert not found, "machine-local paths in the docs:\n" + "\n".join(found)
    assert MACHINE_LOCAL.findall("--work /work/pretrain/flow2 and ../shared/DESIGN.md, not <work>/x or runs/work/") \
        == ["/work/pretrain/flow2", "../shared"]
