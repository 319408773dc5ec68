"""The README fits a screen and every link of the README and docs/ leads to a file that exists."""

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_MAX_LINES = 120
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _markdown_files():
    yield os.path.join(REPO, "README.md")
    docs = os.path.join(REPO, "docs")
    for name in sorted(os.listdir(docs)):
        if name.endswith(".md"):
            yield os.path.join(docs, name)


def test_readme_fits_a_screen_and_keeps_two_commands():
    text = open(os.path.join(REPO, "README.md")).read()
    assert len(text.splitlines()) <= README_MAX_LINES
    commands = [line for line in text.splitlines() if line.startswith("python3 -m pip install torch==2.13.0")]
    assert commands == ["python3 -m pip install torch==2.13.0 -e . && ttrace run",
                        "python3 -m pip install torch==2.13.0 -e '.[test]' && python3 -m pytest"]


def test_every_relative_link_exists():
    broken = []
    for path in _markdown_files():
        for target in LINK.findall(open(path).read()):
            if "://" in target:
                continue
            if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(path), target))):
                broken.append(f"{os.path.relpath(path, REPO)} → {target}")
    assert not broken, broken


def test_every_doc_is_linked_from_the_readme():
    readme = open(os.path.join(REPO, "README.md")).read()
    linked = {os.path.normpath(t) for t in LINK.findall(readme)}
    docs = {os.path.relpath(p, REPO) for p in _markdown_files()} - {"README.md"}
    assert docs <= linked, sorted(docs - linked)


def test_benchmarks_summary_is_what_the_result_files_give():
    """BENCHMARKS.md's summary is regenerated from benchmarks/results/ (benchmarks/summary.py), so a
    figure there cannot drift from the measurement it reports."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "summary.py"), "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_benchmarks_links_exist():
    broken = [t for t in LINK.findall(open(os.path.join(REPO, "BENCHMARKS.md")).read())
              if "://" not in t and not os.path.exists(os.path.join(REPO, t))]
    assert not broken, broken
