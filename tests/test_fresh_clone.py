"""The repository is self-contained: its documents and code name no path outside it, and the
README's quick start, the README's test example and the seed test run from a copy of the
repository's files alone (what a fresh clone holds)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# Spelled in pieces so that this file does not match itself.
OUTSIDE = re.compile("|".join([r"\.\./" + "shared", "/" + "work/", "DESIGN" + r"\.md",
                               "STYLE" + r"\.md", "shared/" + "seed"]))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _repository_files() -> list[Path]:
    """The files a clone has (tracked ones, plus new ones not ignored), relative paths."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout of the repository to list its files")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
        capture_output=True, check=True).stdout.decode()
    files = [Path(p) for p in listed.split("\0") if p and (ROOT / p).is_file()]
    assert any(p.name == "README.md" for p in files)
    return files


def _text_files() -> list[Path]:
    suffixes = {".py", ".md", ".toml", ".txt", ".sh", ".cfg", ".ini", ".json", ".yaml", ".yml"}
    return [p for p in _repository_files() if p.suffix in suffixes or p.name == "run"]


def test_no_document_or_code_names_a_path_outside_the_repository():
    offenders = []
    for path in _text_files():
        for number, line in enumerate((ROOT / path).read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{path}:{number}: {line.strip()}")
    assert offenders == []


def test_every_relative_link_of_the_documents_resolves_inside_the_repository():
    files = {p.as_posix() for p in _repository_files()}
    broken = []
    for doc in (p for p in _text_files() if p.suffix == ".md"):
        for target in LINK.findall((ROOT / doc).read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            resolved = os.path.normpath((doc.parent / target.split("#")[0]).as_posix())
            if resolved not in files and not any(f.startswith(resolved + "/") for f in files):
                broken.append(f"{doc}: {target}")
    assert broken == []


def _readme_block(heading: str, language: str) -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index(heading):]
    return re.search(rf"```{language}\n(.*?)```", section, re.DOTALL).group(1)


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A copy of the repository's files, and nothing else."""
    where = tmp_path_factory.mktemp("clone")
    for path in _repository_files():
        (where / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / path, where / path)
    return where


def _run(clone: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "RANK", "PYTHONPATH")}
    env["PYTHONPATH"] = str(clone)  # the copy's meshfuse, not this checkout's
    # A guard against a hang, not a timing check.
    return subprocess.run([sys.executable, *argv], check=False, cwd=clone, env=env,
                          capture_output=True, text=True, timeout=900)


def test_the_readme_quick_start_runs_from_the_clone(clone):
    # The quick start, then where its meshfuse came from (one process for both).
    (clone / "quickstart.py").write_text(
        _readme_block("## Quick start", "python") + "\nprint(__import__('meshfuse').__file__)\n")
    run = _run(clone, "quickstart.py")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "[]"  # one rank: the allreduce has nobody to talk to
    assert lines[1] == "rank 0 of 1, extents from the definition"
    assert "communications on rank 0: none" in lines
    assert lines[-1] == str(clone / "meshfuse" / "__init__.py")  # the copy's, not this checkout's


@pytest.mark.exclusive  # its pytest starts ranks of its own: not beside this run's batches
def test_the_seed_test_and_the_readme_test_example_run_from_the_clone(clone):
    (clone / "tests" / "test_readme_example.py").write_text(
        _readme_block("## Testing your own multi-rank code", "python"))
    # Two ranks, or one on a host of one GPU (NCCL: a GPU per rank; 2 would skip both tests).
    size = 1 if torch.cuda.is_available() and torch.cuda.device_count() == 1 else 2
    run = _run(clone, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--world-sizes", str(size),
               "-k", "BSHE or readme", "tests/test_seed_sdpa.py", "tests/test_readme_example.py")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 passed" in run.stdout
