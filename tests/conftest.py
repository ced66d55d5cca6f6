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
