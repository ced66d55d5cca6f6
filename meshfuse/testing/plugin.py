"""meshfuse's pytest plugin: the ``multidevice_test`` fixture and the runner of multi-device tests.

It is the ``meshfuse`` pytest11 entry point of the package; a project that runs its tests
without installing meshfuse lists it in a conftest (``pytest_plugins = ["meshfuse.testing.plugin"]``).

A test is *multi-device* if it is marked ``mpi`` or uses the ``multidevice_test`` fixture. Each
such test gets a ``meshfuse_world_size`` parameter, so its ids read ``test_foo[BHSE-ws2]``, and
is marked ``mpi``. The plugin runs in one of three modes:

- **under a launcher** (``WORLD_SIZE`` or ``OMPI_COMM_WORLD_SIZE`` set, e.g. by
  ``torchrun --nproc-per-node 2 -m pytest`` or ``mpirun -np 2 pytest``): every process runs the
  tests itself, at the launcher's world size;
- **parent** (a plain ``pytest``): single-process tests run here as usual. Multi-device tests run
  at the world sizes of ``--world-sizes`` (else ``$MESHFUSE_TEST_WORLD_SIZES``, else 1,2,4): one
  batch of ``n`` worker processes runs *all* selected tests of size ``n``
  (:mod:`meshfuse.testing.launcher`), and each test item reports the ranks' outcome. The
  multi-device items run after the single-process ones. On CPUs (gloo) every size's batch
  starts when the test loop starts, in the background, so that the ranks' work overlaps the
  single-process tests (which use one core of the host); on a CUDA host (NCCL) a size's batch
  runs when its first item does, one size at a time, and sizes above the GPU count are
  skipped. A single-process test marked ``exclusive`` (one that starts ranks of its own and
  times their collectives in seconds) runs last, once every batch has ended.
  ``$MESHFUSE_TEST_TIMEOUT`` (seconds, default 1200) bounds each size's batch;
- **worker** (a process of such a batch): like a launcher, plus it runs only the tests the
  parent asked for and records their outcomes (:mod:`meshfuse.testing.worker`), and as each
  test file starts it freezes what lives then out of the garbage collector's sight
  (:class:`~meshfuse.testing.worker.FreezeBetweenFiles`). Workers never spawn workers.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from meshfuse.launch import cpu_count
from meshfuse.runtime.comm.communicator import Communicator
from meshfuse.testing.fixture import MultideviceTest
from meshfuse.testing.in_step import RanksInStep
from meshfuse.testing.launcher import BatchSpec, Verdict, run_batch, run_batches
from meshfuse.testing.worker import (
    NODEIDS_ENV,
    PARENT_PID_ENV,
    RECORDS_ENV,
    WORKER_ENV,
    FreezeBetweenFiles,
    WorkerRecorder,
    exit_with_parent,
)

WORLD_SIZE_PARAM = "meshfuse_world_size"
WORLD_SIZES_ENV = "MESHFUSE_TEST_WORLD_SIZES"
TIMEOUT_ENV = "MESHFUSE_TEST_TIMEOUT"
DEFAULT_WORLD_SIZES = (1, 2, 4)
DEFAULT_TIMEOUT_S = 1200.0
_OMP_THREADS = "OMP_NUM_THREADS"
MPI_MARKER = "mpi: a multi-device test; run once per world size by meshfuse's pytest plugin"
EXCLUSIVE_MARKER = (
    "exclusive: a single-process test that runs last, when no multi-device batch runs (it "
    "starts ranks of its own and times their collectives)"
)

_SIZES_KEY = pytest.StashKey[tuple[int, ...]]()
# The directory above the meshfuse package, put on the workers' PYTHONPATH so that they import
# the same meshfuse as this process.
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("meshfuse").addoption(
        "--world-sizes",
        dest="meshfuse_world_sizes",
        default=None,
        metavar="N,N,...",
        help=f"world sizes of multi-device tests without a launcher (default: "
        f"${WORLD_SIZES_ENV}, else {','.join(map(str, DEFAULT_WORLD_SIZES))})",
    )


def pytest_configure(config: pytest.Config) -> None:
    declared = {line.split(":")[0].strip() for line in config.getini("markers")}
    for marker in (MPI_MARKER, EXCLUSIVE_MARKER):
        if marker.split(":")[0] not in declared:
            config.addinivalue_line("markers", marker)
    mode, size = harness_mode(os.environ)
    if mode == "parent":
        sizes = parse_world_sizes(
            config.getoption("meshfuse_world_sizes") or os.environ.get(WORLD_SIZES_ENV)
        )
        config.pluginmanager.register(ParentRunner(config, _timeout_s()), "meshfuse-parent")
    else:
        sizes = (size,)
        config.pluginmanager.register(RankRunner(), "meshfuse-rank")
    if mode == "worker":
        nodeids = set(Path(os.environ[NODEIDS_ENV]).read_text().splitlines())
        recorder = WorkerRecorder(Path(os.environ[RECORDS_ENV]), nodeids)
        config.pluginmanager.register(recorder, "meshfuse-worker")
        config.pluginmanager.register(FreezeBetweenFiles(), "meshfuse-worker-gc")
        if PARENT_PID_ENV in os.environ:
            exit_with_parent(int(os.environ[PARENT_PID_ENV]))
    config.stash[_SIZES_KEY] = sizes


def harness_mode(env: Mapping[str, str]) -> tuple[str, int]:
    """``("worker" | "launcher" | "parent", world size)`` for a process with environment ``env``.

    Raises:
        pytest.UsageError: if a launcher's world size is not a positive integer.
    """
    var = "WORLD_SIZE" if "WORLD_SIZE" in env else "OMPI_COMM_WORLD_SIZE"
    if var not in env:
        return "parent", 1
    try:
        size = int(env[var])
    except ValueError:
        size = 0
    if size < 1:
        raise pytest.UsageError(f"{var}={env[var]!r} is not a positive integer; fix the launcher")
    return ("worker" if env.get(WORKER_ENV) == "1" else "launcher"), size


def parse_world_sizes(text: str | None) -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``; ``None`` or empty gives the default sizes.

    Raises:
        pytest.UsageError: unless ``text`` is comma-separated positive integers.
    """
    if not text or not text.strip():
        return DEFAULT_WORLD_SIZES
    try:
        sizes = tuple(dict.fromkeys(int(s) for s in text.split(",")))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise pytest.UsageError(
            f"world sizes {text!r}: expected comma-separated positive integers such as 1,2,4"
        )
    return sizes


def _timeout_s() -> float:
    text = os.environ.get(TIMEOUT_ENV, "")
    try:
        timeout = float(text) if text.strip() else DEFAULT_TIMEOUT_S
    except ValueError:
        timeout = -1.0
    if timeout <= 0:
        raise pytest.UsageError(f"{TIMEOUT_ENV}={text!r}: expected a positive number of seconds")
    return timeout


def is_multidevice(node: pytest.Item | pytest.Metafunc, fixturenames: list[str]) -> bool:
    """True for a test marked ``mpi`` or using the ``multidevice_test`` fixture."""
    definition = node.definition if isinstance(node, pytest.Metafunc) else node
    return definition.get_closest_marker("mpi") is not None or "multidevice_test" in fixturenames


def world_size_of(item: pytest.Item) -> int | None:
    """The world size a multi-device test item runs at; None for a single-process test."""
    callspec = getattr(item, "callspec", None)
    return callspec.params.get(WORLD_SIZE_PARAM) if callspec is not None else None


@pytest.hookimpl(trylast=True)  # after @parametrize marks, so that ids read "BHSE-ws2"
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if not is_multidevice(metafunc, metafunc.fixturenames):
        return
    if WORLD_SIZE_PARAM not in metafunc.fixturenames:
        metafunc.fixturenames.append(WORLD_SIZE_PARAM)  # lets parametrize take the name
    sizes = metafunc.config.stash[_SIZES_KEY]
    metafunc.parametrize(WORLD_SIZE_PARAM, sizes, ids=[f"ws{n}" for n in sizes])


@pytest.hookimpl(tryfirst=True)  # before -m deselects, so that "-m mpi" selects these tests
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if world_size_of(item) is not None and item.get_closest_marker("mpi") is None:
            item.add_marker("mpi")


@pytest.fixture(scope="session")
def multidevice_test():
    """This process's :class:`~meshfuse.testing.fixture.MultideviceTest` (rank, size, device,
    communicator, shard/unshard helpers)."""
    return MultideviceTest(Communicator.instance())


class RankRunner:
    """The plugin object of a rank (under a launcher, or a worker): multi-device tests run here.

    torch.distributed is initialized before the first multi-device test, so that a test marked
    ``mpi`` may use it without the fixture. After each, the ranks check that it left them in
    step (:mod:`meshfuse.testing.in_step`).
    """

    def __init__(self) -> None:
        self._in_step = RanksInStep()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        if world_size_of(item) is not None:
            Communicator.instance()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item):
        result = yield
        if world_size_of(item) is not None:
            self._in_step.check(item.nodeid)
        return result


class ParentRunner:
    """The plugin object of a plain ``pytest``: multi-device items report their batch's verdict.

    A multi-device item sets up no fixture here (the workers do). Its setup waits for the
    batch of its world size (running it first if it was not started in the background), and
    skips if the ranks skipped; its call passes, fails with the failing ranks' reports, or
    xfails.
    """

    def __init__(self, config: pytest.Config, timeout_s: float) -> None:
        self._config = config
        self._timeout_s = timeout_s
        self._verdicts: dict[int, dict[str, Verdict]] = {}
        self._running: dict[int, Future[dict[str, Verdict]]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._stop = threading.Event()
        # torch's threads here, and $OMP_NUM_THREADS, before the batches started
        self._threads: tuple[int, str | None] | None = None

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            if world_size_of(item) is not None:
                item.fixturenames = []
        # Single-process tests first: they run while the batches work in the background;
        # then the multi-device ones, then the exclusive ones.
        items.sort(key=run_order)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> None:
        """Starts every size's batch in the background on CPU ranks; pytest's own loop then
        runs the items."""
        option = session.config.option
        if option.collectonly or uses_gpus() or (
            session.testsfailed and not option.continue_on_collection_errors
        ):
            return
        items = [i for i in session.items if world_size_of(i) is not None]
        specs = self._specs(items, {world_size_of(i) for i in items})
        if specs:
            self._pool = ThreadPoolExecutor(len(specs), thread_name_prefix="meshfuse-batch")
            for spec in specs:
                self._running[spec.world_size] = self._pool.submit(run_batch, spec, self._stop)
            self._share_the_host()

    def pytest_sessionfinish(self) -> None:
        """Stops the batches still running (after ``-x``, Ctrl-C or a collection error)."""
        self._stop.set()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._give_the_threads_back()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        n = world_size_of(item)
        if n is None:
            if item.get_closest_marker("exclusive") is not None:
                for m in list(self._running):  # none left, unless a plugin reordered items
                    self._collect(m)
            return
        reason = unavailable_reason(n)
        if reason is None and self._verdict(item, n).outcome == "skipped":
            reason = self._verdict(item, n).message
        if reason is not None:
            raise pytest.skip.Exception(reason, _use_item_location=True)

    @pytest.hookimpl(tryfirst=True)
    def pytest_pyfunc_call(self, pyfuncitem: pytest.Function) -> bool | None:
        n = world_size_of(pyfuncitem)
        if n is None:
            return None
        verdict = self._verdict(pyfuncitem, n)
        if verdict.outcome == "failed":
            pytest.fail(f"at world size {n}, {verdict.message}", pytrace=False)
        if verdict.outcome == "xfailed":
            pytest.xfail(verdict.message)
        return True

    def _share_the_host(self) -> None:
        """While the batches run, the tests here, and the processes they start, run torch
        on one thread: the ranks get the cores. With their default threads, kernels here
        spun their OpenMP threads against the ranks' (on 2 cores the CPU flash attention
        tests ran 15x slower, a quick benchmark run 10x)."""
        self._threads = torch.get_num_threads(), os.environ.get(_OMP_THREADS)
        torch.set_num_threads(1)
        os.environ[_OMP_THREADS] = "1"

    def _collect(self, n: int) -> None:
        """Waits for the background batch of size ``n``; once none is left, the tests here
        get their threads back."""
        self._verdicts[n] = self._running.pop(n).result()
        if not self._running:
            self._give_the_threads_back()

    def _give_the_threads_back(self) -> None:
        if self._threads is None:
            return
        threads, omp = self._threads
        torch.set_num_threads(threads)
        if omp is None:
            os.environ.pop(_OMP_THREADS, None)
        else:
            os.environ[_OMP_THREADS] = omp
        self._threads = None

    def _verdict(self, item: pytest.Item, n: int) -> Verdict:
        if n in self._running:
            self._collect(n)
        if n not in self._verdicts:
            items = [i for i in item.session.items if world_size_of(i) is not None]
            sizes = {n}
            if not uses_gpus():  # CPU ranks may share the host: run every size's batch at once
                sizes = {world_size_of(i) for i in items} - self._verdicts.keys()
            specs = self._specs(items, sizes)
            self._verdicts.update(run_batches(specs, parallel=len(specs) > 1))
        return self._verdicts[n].get(
            item.nodeid, Verdict("failed", f"meshfuse harness: no verdict for {item.nodeid}")
        )

    def _specs(self, items: list[pytest.Item], sizes: set[int]) -> list[BatchSpec]:
        """The batches of the world sizes among ``sizes`` that can run here, smallest first;
        the CPUs are shared out among all their ranks."""
        sizes = sorted(m for m in sizes if unavailable_reason(m) is None)
        threads = max(1, cpu_count() // max(1, sum(sizes)))
        return [
            self._spec(m, [i for i in items if world_size_of(i) == m], threads) for m in sizes
        ]

    def _spec(self, n: int, items: list[pytest.Item], threads: int) -> BatchSpec:
        config = self._config
        option = config.option
        args = ["-p", "no:cacheprovider", "-q", "--rootdir", str(config.rootpath)]
        args += ["--import-mode", option.importmode, "--tb", option.tbstyle]
        if config.inipath is not None:
            args += ["-c", str(config.inipath)]
        if option.showlocals:
            args.append("-l")
        if option.noconftest:
            args.append("--noconftest")
        if option.runxfail:  # the workers report xfails; they must run them as the parent asks
            args.append("--runxfail")
        for flag, values in (
            ("-o", option.override_ini),
            ("-p", option.plugins),
            ("-W", option.pythonwarnings),
        ):
            for value in values or []:
                args += [flag, value]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p
        )
        return BatchSpec(
            world_size=n,
            nodeids=tuple(i.nodeid for i in items),
            paths=tuple(dict.fromkeys(str(i.path) for i in items)),
            rootdir=str(config.rootpath),
            pytest_args=tuple(args),
            timeout_s=self._timeout_s,
            env=env,
            threads_per_rank=threads,
        )


def run_order(item: pytest.Item) -> int:
    """Where ``item`` runs in a parent: 0 single-process, 1 multi-device, 2 exclusive."""
    if world_size_of(item) is not None:
        return 1
    return 2 if item.get_closest_marker("exclusive") is not None else 0


def uses_gpus() -> bool:
    """True when ranks run on GPUs (NCCL): CUDA is available and MESHFUSE_BACKEND allows NCCL."""
    if os.environ.get("MESHFUSE_BACKEND", "").strip().lower() not in ("", "nccl"):
        return False
    import torch

    return torch.cuda.is_available()


def unavailable_reason(n: int) -> str | None:
    """Why world size ``n`` cannot run here (NCCL needs a GPU per rank), or None."""
    if not uses_gpus():
        return None
    import torch

    count = torch.cuda.device_count()
    return (
        f"world size {n} needs {n} GPUs (one per rank); this host has {count}"
        if n > count
        else None
    )
