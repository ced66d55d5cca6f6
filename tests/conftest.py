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
