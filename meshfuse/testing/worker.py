"""The worker side of the multi-device test harness: run the parent's tests, record outcomes.

A worker is one rank of a batch that :mod:`meshfuse.testing.launcher` spawned. It keeps only
the tests the parent asked for and appends one JSON line per event to its records file:

- ``{"event": "start", "nodeid": ...}`` when a test starts;
- ``{"event": "end", "nodeid": ..., "outcome": ..., "text": ...}`` when it ends, with outcome
  ``passed``, ``failed``, ``skipped`` or ``xfailed`` and the failure text or skip reason;
- ``{"event": "done", "exitstatus": ...}`` when the session ends normally.

A missing ``done`` means the worker crashed; a ``start`` without ``end`` names the test it was
in. Lines are appended and flushed one at a time, so a crash loses nothing already recorded.
A worker ends itself when the parent process is gone (a parent killed by SIGTERM or SIGKILL
cannot clean up). On ``SIGUSR1`` a worker writes the Python stacks of all its threads to its stacks file: the
parent asks for them before it kills a batch that timed out, to show where each rank hung.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

WORKER_ENV = "MESHFUSE_TEST_WORKER"
RECORDS_ENV = "MESHFUSE_TEST_RECORDS"
NODEIDS_ENV = "MESHFUSE_TEST_NODEIDS"
PARENT_PID_ENV = "MESHFUSE_TEST_PARENT_PID"
MAX_TEXT = 20_000


def records_path(directory: str | Path, rank: int) -> Path:
    """The records file of ``rank`` in a batch directory."""
    return Path(directory) / f"rank{rank}.jsonl"


def log_path(directory: str | Path, rank: int) -> Path:
    """The file that receives ``rank``'s stdout and stderr."""
    return Path(directory) / f"rank{rank}.log"


def stacks_path(records: Path) -> Path:
    """The file beside a rank's records file that receives its stacks on ``SIGUSR1``."""
    return records.with_suffix(".stacks")


def read_records(path: Path) -> list[dict]:
    """The records in ``path``; a missing file or a torn last line (a crash) is skipped."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def exit_with_parent(parent_pid: int, poll_s: float = 1.0) -> None:
    """Ends this process as soon as its parent ``parent_pid`` is gone (checked every ``poll_s``)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="meshfuse-parent-watch", daemon=True).start()


class WorkerRecorder:
    """A pytest plugin object for a worker process: filters tests and records their outcomes.

    Args:
        path: the records file to append to.
        nodeids: the node ids to run; every other collected test is deselected.
    """

    def __init__(self, path: Path, nodeids: set[str]) -> None:
        self._path = path
        self._nodeids = nodeids
        self._reports: dict[str, list[pytest.TestReport]] = {}
        if hasattr(signal, "SIGUSR1"):
            # Kept open for the life of the process: faulthandler writes to its descriptor.
            self._stacks = open(stacks_path(path), "w")  # noqa: SIM115
            faulthandler.register(signal.SIGUSR1, file=self._stacks, all_threads=True)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        keep = [i for i in items if i.nodeid in self._nodeids]
        dropped = [i for i in items if i.nodeid not in self._nodeids]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = keep

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self._write({"event": "start", "nodeid": nodeid})

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._reports.setdefault(report.nodeid, []).append(report)

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        outcome, text = outcome_of(self._reports.pop(nodeid, []))
        self._write({"event": "end", "nodeid": nodeid, "outcome": outcome, "text": text})

    def pytest_sessionfinish(self, exitstatus: int) -> None:
        self._write({"event": "done", "exitstatus": int(exitstatus)})

    def _write(self, record: dict) -> None:
        with open(self._path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


class FreezeBetweenFiles:
    """A pytest plugin object for a worker: as the tests of each file start, collects the
    garbage and puts what lives then out of the garbage collector's sight (``gc.freeze``).

    What lives then mostly stays: the collected items, the modules imported, torch's and
    Inductor's tables. Left in sight, every full collection walked those few hundred thousand
    objects again: a tenth of a CPU rank's time, and a second more at exit (pytest collects
    five times there, for unraisable exceptions). Frozen, a full collection walks what the
    tests of one file made. Objects freed by their reference counts still are; a cycle alive
    as a file starts and dropped later is not collected (it lives until the rank exits).
    """

    def __init__(self) -> None:
        self._file: str | None = None

    def pytest_runtest_logstart(self, location: tuple[str, int | None, str]) -> None:
        if location[0] != self._file:
            self._file = location[0]
            gc.collect()
            gc.freeze()


def outcome_of(reports: list[pytest.TestReport]) -> tuple[str, str]:
    """The outcome of one test from its setup/call/teardown reports, and its text.

    The first failing phase wins. An xpass, strict or not, counts as ``passed``: the parent's
    test item carries the same xfail mark and judges it again.
    """
    outcome, text = "passed", ""
    for report in reports:
        longrepr = str(report.longrepr) if report.longrepr is not None else ""
        if report.failed and not longrepr.startswith("[XPASS(strict)]"):
            return "failed", _failure_text(report)
        if report.skipped and hasattr(report, "wasxfail"):
            outcome, text = "xfailed", report.wasxfail
        elif report.skipped:
            outcome, text = "skipped", _skip_reason(report)
    return outcome, text


def _failure_text(report: pytest.TestReport) -> str:
    """The captured output and logs, then the traceback: a long text keeps its end, so the
    error itself survives however much a test logged (torch's debug logs run to megabytes)."""
    parts = [f"{'-' * 20} {title} {'-' * 20}\n{content}" for title, content in report.sections]
    parts.append(report.longreprtext if report.when == "call"
                 else f"error in {report.when}:\n{report.longreprtext}")
    text = "\n".join(parts)
    return text if len(text) <= MAX_TEXT else "...\n" + text[-MAX_TEXT:]


def _skip_reason(report: pytest.TestReport) -> str:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return reason.removeprefix("Skipped: ")
