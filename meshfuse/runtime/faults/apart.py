"""Waiting for a point-to-point transfer on a thread apart, so that the caller can read the
notice board meanwhile.

On gloo a send or receive cannot be waited for in slices, as a collective is (a wait with a
time limit that runs out gives the transfer up and closes the connection), nor asked
whether it is done (``is_completed`` only turns true inside a wait). So a pipeline stage
waiting for an activation from a rank whose stage raised would wait for the whole timeout.
:class:`ApartWaiter` waits for each transfer, whole, on a daemon thread of its own, one
after the other in the order given; the caller waits for the thread's word in slices and
reads the board between them (:meth:`LoneFailures.wait_apart
<meshfuse.runtime.faults.lone_failures.LoneFailures.wait_apart>`).

A transfer that cannot complete any more (its peer failed) keeps the thread until gloo's own
timeout ends it; the ranks are then out of step and every later call raises until
``Communicator.recover()``, which starts a new waiter with the new process groups.
"""

from __future__ import annotations

import queue
import threading
from typing import Any


class Waited(threading.Event):
    """Set once the thread waited for one transfer; ``error``: what its wait raised."""

    error: BaseException | None = None


class ApartWaiter:
    """A daemon thread that waits for the transfers handed to it, in order."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="meshfuse-transfer-waits", daemon=True).start()

    def submit(self, work: Any) -> Waited:
        """Hands ``work`` (a torch.distributed Work) to the thread; the event is set once
        its wait returned or raised."""
        waited = Waited()
        self._queue.put((work, waited))
        return waited

    def _run(self) -> None:
        while True:
            work, waited = self._queue.get()
            try:
                work.wait()
            except BaseException as e:  # noqa: BLE001 - handed to the caller, who raises it
                waited.error = e
            waited.set()
