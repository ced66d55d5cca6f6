"""The multi-device test harness: the fixture on every rank, and the parent's bookkeeping."""

import json
import os
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from meshfuse.ir.mesh import DeviceMesh
from meshfuse.ir.parallel_type import ParallelType
from meshfuse.testing import launcher, plugin, worker
from meshfuse.testing.launcher import BatchSpec, RankRun, Verdict

# ----- on every rank ---------------------------------------------------------------------------


def test_fixture_matches_torch_distributed(multidevice_test, meshfuse_world_size):
    assert multidevice_test.size == meshfuse_world_size == dist.get_world_size()
    assert multidevice_test.rank == dist.get_rank()
    assert multidevice_test.local_rank == multidevice_test.communicator.local_rank
    assert multidevice_test.local_size == multidevice_test.communicator.local_size
    assert multidevice_test.device == multidevice_test.communicator.device


@pytest.mark.mpi
def test_marked_test_gets_torch_distributed(meshfuse_world_size):
    assert dist.is_initialized() and dist.get_world_size() == meshfuse_world_size


def test_shard_and_unshard_with_an_int_dim(multidevice_test):
    d, rank = multidevice_test.size, multidevice_test.rank
    t = torch.arange(2 * d * 3).reshape(2 * d, 3)
    local = multidevice_test.shard_tensor(t, 0)
    assert local.device == multidevice_test.device
    assert torch.equal(local.cpu(), t[2 * rank : 2 * rank + 2])
    assert torch.equal(multidevice_test.unshard_tensor(local, 0).cpu(), t)

    u = torch.arange(3 * d).reshape(3, d)
    assert torch.equal(multidevice_test.shard_tensor(u, -1).cpu(), u[:, rank : rank + 1])


def test_shard_with_a_2d_mesh(multidevice_test):
    if multidevice_test.size != 4:
        pytest.skip(f"needs 4 ranks, has {multidevice_test.size}")
    mesh = DeviceMesh([[0, 1], [2, 3]])
    t = torch.arange(8)
    local = multidevice_test.shard_tensor(t, 0, mesh)  # along mesh_x: replicated over mesh_y
    c = mesh.coordinate(multidevice_test.rank)[mesh.axis_of(ParallelType.mesh_x)]
    assert torch.equal(local.cpu(), t[4 * c : 4 * c + 4])
    assert torch.equal(multidevice_test.unshard_tensor(local, 0, mesh).cpu(), t)


# ----- the parent's bookkeeping (one process) ----------------------------------------------------


def test_aggregate():
    assert launcher.aggregate([("passed", ""), ("passed", "")]) == Verdict("passed")
    assert launcher.aggregate([("skipped", "no"), ("skipped", "no")]) == Verdict("skipped", "no")
    assert launcher.aggregate([("xfailed", "bug"), ("passed", "")]) == Verdict("xfailed", "bug")

    failed = launcher.aggregate([("passed", ""), ("failed", "E boom 1"), ("failed", "E boom 1")])
    assert failed.outcome == "failed"
    assert failed.message.startswith("failed on ranks 1, 2 of 3")
    assert "--- rank 1 ---\nE boom 1" in failed.message
    assert "--- rank 2: the same as rank 1 ---" in failed.message

    disagree = launcher.aggregate([("passed", ""), ("skipped", "odd rank")])
    assert disagree.outcome == "failed"
    assert "rank 1 skipped (odd rank)" in disagree.message


def _spec():
    return BatchSpec(
        world_size=2,
        nodeids=("t.py::a", "t.py::b", "t.py::c"),
        paths=("/x/t.py",),
        rootdir="/x",
        pytest_args=(),
        timeout_s=5.0,
        env={},
    )


def _rank(rank, started, ended, done=True, exit_code=0):
    return RankRun(rank, started, ended, done, exit_code, tail=f"tail of {rank}")


def test_judge_crash_fails_the_crashed_test_and_retries_the_rest():
    ok = ("passed", "")
    ranks = [
        _rank(0, ["t.py::a", "t.py::b"], {"t.py::a": ok}, done=False, exit_code=None),
        _rank(1, ["t.py::a", "t.py::b"], {"t.py::a": ok}, done=False, exit_code=-11),
    ]
    spec = _spec()
    verdicts, retry = launcher.judge(list(spec.nodeids), ranks, "crash", spec)
    assert verdicts["t.py::a"] == Verdict("passed")
    assert verdicts["t.py::b"].outcome == "failed"
    assert "rank 1 died of SIGSEGV while running t.py::b" in verdicts["t.py::b"].message
    assert "tail of 1" in verdicts["t.py::b"].message
    assert retry == ["t.py::c"]


def test_judge_timeout_fails_every_unfinished_test():
    ranks = [_rank(0, ["t.py::a"], {}, False, None), _rank(1, ["t.py::a"], {}, False, None)]
    spec = _spec()
    verdicts, retry = launcher.judge(list(spec.nodeids), ranks, "timeout", spec)
    assert retry == []
    assert "timed out after 5 s" in verdicts["t.py::a"].message
    assert "rank 0 was running it" in verdicts["t.py::a"].message
    assert "did not run" in verdicts["t.py::c"].message


def test_worker_records_round_trip(tmp_path):
    path = worker.records_path(tmp_path, 3)
    recorder = worker.WorkerRecorder(path, {"t.py::a"})
    recorder.pytest_runtest_logstart("t.py::a")
    recorder.pytest_runtest_logfinish("t.py::a")
    recorder.pytest_sessionfinish(0)
    with open(path, "a") as f:
        f.write('{"event": "sta')  # a torn last line, as a crash leaves it
    assert worker.read_records(path) == [
        {"event": "start", "nodeid": "t.py::a"},
        {"event": "end", "nodeid": "t.py::a", "outcome": "passed", "text": ""},
        {"event": "done", "exitstatus": 0},
    ]
    assert json.loads(path.read_text().splitlines()[1])["outcome"] == "passed"


def test_a_worker_freezes_what_lives_as_each_file_starts(monkeypatch):
    calls = []
    monkeypatch.setattr(worker.gc, "collect", lambda: calls.append("collect"))
    monkeypatch.setattr(worker.gc, "freeze", lambda: calls.append("freeze"))
    plugin_object = worker.FreezeBetweenFiles()
    for file in ("a.py", "a.py", "b.py", "b.py", "a.py"):
        plugin_object.pytest_runtest_logstart((file, 1, "test"))
    # garbage first, then what lives; once per change of file
    assert calls == ["collect", "freeze"] * 3


def test_worker_env(tmp_path):
    base = {"PATH": "/bin", "PYTEST_ADDOPTS": "-x", "OMPI_COMM_WORLD_SIZE": "8"}
    env = launcher.worker_env(base, 1, 2, 1234, str(tmp_path), tmp_path / "ids", 3)
    assert env["PATH"] == "/bin"
    assert "PYTEST_ADDOPTS" not in env and "OMPI_COMM_WORLD_SIZE" not in env
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (
        "1",
        "2",
        "1",
        "2",
    )
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["OMP_NUM_THREADS"]) == (
        "127.0.0.1",
        "1234",
        "3",
    )
    assert plugin.harness_mode(env) == ("worker", 2)


CRASHING_TESTS = """
import os

def test_dies_on_rank_1():
    if os.environ["RANK"] == "1":
        os._exit(7)

def test_lives():
    assert os.environ["WORLD_SIZE"] == "2"
    assert os.getppid() == int(os.environ["MESHFUSE_TEST_PARENT_PID"])  # its watch on its parent
"""


def _run_two_ranks(tmp_path, name: str, text: str, nodeids: tuple[str, ...],
                   **env: str) -> dict[str, Verdict]:
    """The verdicts of a real batch of 2 workers (forked from the zygote on Linux) running
    ``nodeids`` of a test file ``name`` holding ``text``, with meshfuse's plugin."""
    (tmp_path / name).write_text(text)
    (tmp_path / "conftest.py").write_text(textwrap.dedent("""
        import sys
        if "meshfuse.testing.plugin" not in sys.modules:
            pytest_plugins = ["meshfuse.testing.plugin"]
    """))
    root = str(Path(launcher.__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get(
        "PYTHONPATH")])), **env)
    spec = BatchSpec(2, nodeids, (str(tmp_path / name),), str(tmp_path),
                     ("-p", "no:cacheprovider", "-q", "--rootdir", str(tmp_path)), 600.0, env)
    return launcher.run_batch(spec)


def test_batch_judges_a_crashed_rank_and_runs_the_rest_again(tmp_path):
    """A real batch of 2 workers (forked from the zygote on Linux): rank 1 dies inside a test,
    which fails naming the exit; the test that did not finish runs again and passes."""
    nodeids = ("test_crash.py::test_dies_on_rank_1", "test_crash.py::test_lives")
    verdicts = _run_two_ranks(tmp_path, "test_crash.py", CRASHING_TESTS, nodeids)
    assert verdicts[nodeids[1]] == Verdict("passed"), verdicts[nodeids[1]].message
    died = verdicts[nodeids[0]]
    assert died.outcome == "failed", died
    assert "rank 1 exited with code 7 while running test_crash.py::test_dies_on_rank_1" in (
        died.message), died.message


def test_harness_mode_and_world_sizes():
    assert plugin.harness_mode({}) == ("parent", 1)
    assert plugin.harness_mode({"RANK": "0", "WORLD_SIZE": "2"}) == ("launcher", 2)
    assert plugin.harness_mode({"OMPI_COMM_WORLD_SIZE": "4"}) == ("launcher", 4)
    with pytest.raises(pytest.UsageError, match="WORLD_SIZE='0'"):
        plugin.harness_mode({"WORLD_SIZE": "0"})
    assert plugin.parse_world_sizes(None) == (1, 2, 4)
    assert plugin.parse_world_sizes("2, 1,2") == (2, 1)
    for bad in ("0", "two", "1,,2"):
        with pytest.raises(pytest.UsageError, match="positive integers"):
            plugin.parse_world_sizes(bad)


def test_parent_runs_single_process_then_multidevice_then_exclusive_items(request):
    """The parent's order: single-process items (while the batches run in the background),
    the multi-device items, then the exclusive ones (when no batch runs); stable within each."""

    class Item:
        def __init__(self, name, size=None, exclusive=False):
            self.name, self._exclusive = name, exclusive
            if size is not None:
                self.callspec = type("CallSpec", (), {"params": {plugin.WORLD_SIZE_PARAM: size}})

        def get_closest_marker(self, name):
            return object() if name == "exclusive" and self._exclusive else None

    items = [Item("a"), Item("b", 2), Item("c", exclusive=True), Item("d", 1), Item("e")]
    assert [i.name for i in sorted(items, key=plugin.run_order)] == ["a", "e", "b", "d", "c"]
    # This very test is a single-process one; a marked rank-failure job is exclusive.
    assert plugin.run_order(request.node) == 0
    assert "exclusive" in {m.split(":")[0] for m in request.config.getini("markers")}


OUT_OF_STEP_TESTS = """
from meshfuse.errors import ExecutionError

def test_leaves_the_ranks_out_of_step(multidevice_test):
    lone = multidevice_test.communicator.lone
    if multidevice_test.rank == 1:  # a lone failure no other rank answers
        lone.told(ExecutionError("rank 1: step 0: boom"), lone.begin_call(), "step 0")
        assert lone.out_of_step is not None

def test_runs_after_it(multidevice_test):
    assert multidevice_test.communicator.lone.out_of_step is None
"""


def test_a_test_that_leaves_the_ranks_out_of_step_fails_and_the_next_runs(tmp_path):
    """A real batch of 2 workers: the first test leaves rank 1 out of step (its lone failure,
    never recovered from): that test fails, naming the rank and its error, and the ranks are
    recovered for the next one, which passes (it was failing with the first one's
    consequences, far from the cause)."""
    nodeids = ("test_steps.py::test_leaves_the_ranks_out_of_step[ws2]",
               "test_steps.py::test_runs_after_it[ws2]")
    verdicts = _run_two_ranks(tmp_path, "test_steps.py", OUT_OF_STEP_TESTS, nodeids,
                              MESHFUSE_TEST_WORLD_SIZES="2")
    left = verdicts[nodeids[0]]
    assert left.outcome == "failed", left
    assert "left the ranks out of step (rank 1: its own error in call 1" in left.message, \
        left.message
    assert verdicts[nodeids[1]] == Verdict("passed"), verdicts[nodeids[1]].message


def test_free_ports_are_not_handed_out_twice():
    """The OS hands a port it just gave out again soon (124 of 2000 calls here, once); jobs
    started together by one process (the rank-failure tests start forty) must not share one:
    their rank 0s would race to bind it, one failing with EADDRINUSE (a full CI run did)."""
    from meshfuse.launch import free_port

    ports = [free_port() for _ in range(1000)]
    assert len(set(ports)) == len(ports)
