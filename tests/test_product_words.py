"""The tracked tree speaks of the product: no work-log words, no issue numbers, no paths outside
the repository, no dated result files in bench/results (one current set per bench)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Built from parts so that this file does not match itself.
LOG_WORD = re.compile(r"\b" + "ses" + r"sions?\b", re.I)
ISSUE_REF = re.compile(r"\b" + "iss" + r"ues? #?\d+", re.I)
OUTSIDE_PATH = re.compile(r"\.\./" + "shared|" + r"\bscr" + r"atch/|/root/" + "out")
LENT_MACHINE = re.compile(r"\b(lent|borrowed|leased) (GPU |device )?machine", re.I)
PYTEST_SCOPE = 'scope="' + "ses" + 'sion"'


def _tracked() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / p for p in out.decode().split("\0") if p]


def _text_files():
    for path in _tracked():
        if path.suffix in {".png", ".whl"} or not path.is_file():
            continue
        try:
            yield path, path.read_text()
        except UnicodeDecodeError:
            continue


def test_no_work_log_words_in_the_tree():
    found = []
    for path, text in _text_files():
        for n, line in enumerate(text.splitlines(), 1):
            line = line.replace(PYTEST_SCOPE, "")
            for pattern in (LOG_WORD, ISSUE_REF, OUTSIDE_PATH, LENT_MACHINE):
                if pattern.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not found, "\n".join(found)


def test_results_are_one_current_set_per_bench():
    files = [p for p in _tracked() if p.parent == ROOT / "bench" / "results"]
    assert len(files) <= 40
    dated = [p.name for p in files if re.search(r"\d{4}-\d\d-\d\d", p.name)]
    assert not dated, dated


def test_cited_result_files_exist():
    """Every result file the tree cites under bench/results is there (``NAME.*`` and
    ``NAME.{a,b}`` too); a result that left the tree is cited as ``git show <commit>:<path>``."""
    cite = re.compile(r"(?<!:)bench/results/([A-Za-z0-9_.*{},-]+)")
    results = ROOT / "bench" / "results"
    missing = []
    for path, text in _text_files():
        for n, line in enumerate(text.splitlines(), 1):
            for name in cite.findall(line):
                name = name.rstrip(".,")
                if not name or name.startswith("<"):
                    continue
                alternatives = re.sub(r"\{([^}]*)\}", lambda m: "*", name)
                if not list(results.glob(alternatives)):
                    missing.append(f"{path.relative_to(ROOT)}:{n}: bench/results/{name}")
    assert not missing, "\n".join(missing)
