import os
import sys

# meshfuse's pytest plugin is the package's pytest11 entry point, which pytest loads before this
# file when meshfuse is installed; register it here only when it was not loaded that way (a plain
# `PYTHONPATH=. pytest`, or plugin autoload disabled). Registering it twice is an error.
if "meshfuse.testing.plugin" not in sys.modules:
    pytest_plugins = ["meshfuse.testing.plugin"]

# Every multi-rank test checks that the ranks' inputs agree before running (InputError on
# every rank instead of a hang); the spawned ranks inherit this.
os.environ.setdefault("MESHFUSE_CHECK_RANKS", "1")


def pytest_addoption(parser):
    parser.addoption(
        "--fuzz-programs", type=int, default=None, metavar="N",
        help="programs per world size for tests/test_fuzz.py (default 200; the long mode "
        "runs 5000 or more); the same as MESHFUSE_FUZZ_PROGRAMS=N",
    )


def pytest_configure(config):
    # Through the environment, so that the spawned ranks see it too.
    if config.getoption("--fuzz-programs", default=None) is not None:
        os.environ["MESHFUSE_FUZZ_PROGRAMS"] = str(config.getoption("--fuzz-programs"))
