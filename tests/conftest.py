import os
import sys

# meshfuse's pytest plugin is the package's pytest11 entry point, which pytest loads before this
# file when meshfuse is installed; register it here only when it was not loaded that way (a plain
# `PYTHONPATH=. pytest`, or plugin autoload disabled). Registering it twice is an error.
if "meshfuse.testing.plugin" not in sys.modules:
    pytest_plugins = ["meshfuse.testing.plugin"]

# A collective that waits this long for a rank ends in CommunicationError on every rank still
# running (meshfuse's default is 300 s): a broken test fails in minutes, naming the step and the
# missing rank, instead of hanging its batch. The spawned ranks inherit it.
os.environ.setdefault("MESHFUSE_TIMEOUT", "120")


def pytest_addoption(parser):
    parser.addoption(
        "--fuzz-programs", type=int, default=None, metavar="N",
        help="programs per world size for tests/test_fuzz.py (default 200; the long mode "
        "runs 5000 or more); the same as MESHFUSE_FUZZ_PROGRAMS=N",
    )


def pytest_configure(config):
    # This suite's own process keeps full garbage collections to what each test file makes,
    # as the plugin's worker ranks do (a worker registers it itself): collections of the
    # objects that live all along took a fifth of its CPU time, 4 s of it at exit.
    # (Imported here: imported before pytest_plugins above is read, the plugin's module
    # would not have its asserts rewritten.)
    from meshfuse.testing.plugin import harness_mode
    from meshfuse.testing.worker import FreezeBetweenFiles

    if harness_mode(os.environ)[0] != "worker":
        config.pluginmanager.register(FreezeBetweenFiles(), "meshfuse-suite-gc")
    # Through the environment, so that the spawned ranks see it too.
    if config.getoption("--fuzz-programs", default=None) is not None:
        os.environ["MESHFUSE_FUZZ_PROGRAMS"] = str(config.getoption("--fuzz-programs"))
