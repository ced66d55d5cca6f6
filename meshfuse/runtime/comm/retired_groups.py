"""Process groups that ``Communicator.recover`` destroyed, kept until they can be freed
without blocking.

A failure can leave a collective pending for ever in a group (a rank never launched its part).
Freeing a gloo group joins its worker threads, which wait in that collective until it times
out; so whatever call happened to drop the group's last reference (a garbage collection, at
any later step) would block for the whole timeout, with the other ranks waiting for it. The
groups are therefore held by a daemon thread until the collective has timed out, and freed
there. A process that exits first never frees them: a daemon thread's references are not
released at exit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any


def keep_until_timed_out(groups: Sequence[Any], seconds: float) -> None:
    """Holds ``groups`` (destroyed process groups) for ``seconds``, then drops them on a
    daemon thread of their own."""
    if not groups:
        return
    held = list(groups)  # the thread's own references

    def hold() -> None:
        time.sleep(seconds)
        held.clear()

    threading.Thread(target=hold, name="meshfuse-retired-groups", daemon=True).start()
