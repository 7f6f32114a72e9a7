"""Dask plugins for the clusters bnlab starts itself (imported only where Dask is)."""
from __future__ import annotations

import signal
import threading

from distributed import WorkerPlugin

__all__ = ["IgnoreSigint"]


class IgnoreSigint(WorkerPlugin):
    """The local cluster's worker processes ignore SIGINT.

    Ctrl-C in a terminal reaches the whole process group; the driver turns it
    into a clean shutdown (commit, requeue, cancel, close the cluster), and
    workers that also raised KeyboardInterrupt would only print tracebacks.
    Registered on clusters bnlab starts itself, never on an existing one.
    """

    name = "bnlab-ignore-sigint"

    def setup(self, worker) -> None:
        # The worker's event loop runs in its process's main thread, the only one allowed to set handlers.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
