"""The demo checks its arguments before starting any rank: one line on stderr, exit code 2.

One bad command line runs ``python -m meshfuse.demo`` as a user would (the process imports
torch and meshfuse, parses, and exits: the entry point's exit code and output); every case of
the first-contact report, and more, runs through ``parse_args`` and ``main`` in this process,
the code that process runs (a process per case would pay the imports of torch each time).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshfuse import demo

ROOT = Path(__file__).resolve().parents[1]

COMMAND_LINES = {
    "--seq 0": "--seq: 0 is not positive",
    "--batch -1": "--batch: -1 is not positive",
    "--embed 100 --heads 12": "--embed 100 is not a multiple of --heads 12",
    "--nproc 0": "--nproc: 0 is not positive",
}
BAD_ARGUMENTS = {
    **COMMAND_LINES,
    "--heads 0": "--heads: 0 is not positive",
    "--embed -768": "--embed: -768 is not positive",
    "--seq many": "--seq: 'many' is not an integer",
    "--sequence 8": "unrecognized arguments: --sequence 8",
}


def test_bad_command_line_exits_2_with_one_line():
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "RANK")}
    env["PYTHONPATH"] = str(ROOT)
    args = "--embed 100 --heads 12"
    # A guard against a demo that started its ranks after all, not a timing check.
    run = subprocess.run([sys.executable, "-m", "meshfuse.demo", *args.split()], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 2, run.stderr
    assert run.stdout == ""
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("python -m meshfuse.demo: error: ")
    assert COMMAND_LINES[args] in lines[0]


@pytest.mark.parametrize("args", list(COMMAND_LINES))
def test_main_exits_2_with_one_line_before_any_rank(capsys, monkeypatch, args):
    started = []
    monkeypatch.setattr(demo, "spawn", lambda *a, **k: started.append(a) or [0])
    monkeypatch.setattr(demo, "launcher_world_size", lambda: None)
    with pytest.raises(SystemExit) as exit_:
        demo.main(args.split())
    assert exit_.value.code == 2 and started == []
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("python -m meshfuse.demo: error: ")
    assert COMMAND_LINES[args] in captured.err


@pytest.mark.parametrize("args", list(BAD_ARGUMENTS))
def test_bad_argument_is_one_line_and_exit_2(capsys, monkeypatch, args):
    monkeypatch.setattr(demo, "default_nproc", lambda: 4)
    with pytest.raises(SystemExit) as exit_:
        demo.parse_args(args.split())
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("python -m meshfuse.demo: error: ")
    assert BAD_ARGUMENTS[args] in captured.err


def test_help_shows_the_command_and_defaults(capsys):
    with pytest.raises(SystemExit) as exit_:
        demo.parse_args(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: python -m meshfuse.demo ")
    for option, default in (("--batch", 2), ("--heads", 12), ("--seq", 1024), ("--embed", 768)):
        line = next(line for line in text.splitlines() if line.strip().startswith(option))
        assert f"(default: {default})" in line


@pytest.fixture
def cpu_host(monkeypatch):
    """A host without GPUs, where any --nproc is valid (with GPUs, at most their count)."""
    monkeypatch.setattr(demo, "gpu_count", lambda: 0)


def test_good_arguments_pass(capsys, cpu_host):
    args = demo.parse_args(["--nproc", "2", "--heads", "4", "--embed", "64", "--seq", "8"])
    assert (args.nproc, args.batch, args.heads, args.seq, args.embed) == (2, 2, 4, 8, 64)
    assert capsys.readouterr().err == ""


def test_under_a_launcher_any_head_count_splits_over_its_ranks(capsys):
    """Heads that the ranks do not divide are uneven shards (6 over 4 ranks: 2, 2, 2, 0)."""
    assert demo.parse_args(["--heads", "6", "--embed", "96"], launcher_size=3).heads == 6
    assert demo.parse_args(["--heads", "6", "--embed", "96"], launcher_size=4).heads == 6
    assert capsys.readouterr().err == ""


def test_nproc_must_agree_with_a_launcher(capsys):
    with pytest.raises(SystemExit) as exit_:
        demo.parse_args(["--nproc", "2"], launcher_size=4)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--nproc 2, but the launcher started 4 ranks" in err
    assert len(err.splitlines()) == 1


def test_no_rank_starts_on_a_bad_argument(monkeypatch, cpu_host):
    started = []
    monkeypatch.setattr(demo, "spawn", lambda *a, **k: started.append(a) or [0])
    monkeypatch.setattr(demo, "launcher_world_size", lambda: None)
    with pytest.raises(SystemExit):
        demo.main(["--seq", "0"])
    assert started == []
    assert demo.main(["--nproc", "2", "--heads", "4", "--embed", "64"]) == 0
    assert started == [(2, ["-m", "meshfuse.demo", "--nproc", "2", "--heads", "4",
                            "--embed", "64"])]


def test_nproc_above_the_gpu_count_is_refused(capsys, monkeypatch):
    monkeypatch.setattr(demo, "gpu_count", lambda: 1)
    assert demo.parse_args(["--nproc", "1"]).nproc == 1
    with pytest.raises(SystemExit) as exit_:
        demo.parse_args(["--nproc", "2"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--nproc 2, but this host has 1 GPUs (one rank per GPU); choose --nproc of at " \
        "most 1" in err
    assert len(err.splitlines()) == 1
    assert demo.default_nproc() == 1
