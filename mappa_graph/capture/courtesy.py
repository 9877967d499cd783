"""The trace writer's courtesy to the graph: give the GIL back every few steps of background work.

An instrumented graph builds and stores its episodes on a worker thread so that the work overlaps the graph's
waits (model calls, tools). But a worker thread running pure Python keeps the GIL until the interpreter's switch
interval (5 ms) forces it out, so a graph thread that wakes from a 1 ms model call waits for the rest of the
worker's job: measured on the 3-node benchmark graph, a 0.3 ms Python job on the worker cost the graph 0.17 ms
per run, and the same job with a `time.sleep(0)` every few steps cost it nothing measurable. The worker thread
marks itself; the builder and the store call `yield_gil()` between steps, which is free on any other thread.
"""

from __future__ import annotations

import threading
import time

_local = threading.local()


def mark_background() -> None:
    """Called once by a trace worker thread: `yield_gil()` on it then lets waiting threads run."""
    _local.background = True


def yield_gil() -> None:
    """On a trace worker, release the GIL for a moment (a thread waiting for it takes it); elsewhere, nothing."""
    if getattr(_local, "background", False):
        time.sleep(0)
