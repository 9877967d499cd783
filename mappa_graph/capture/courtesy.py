"""The trace writer's courtesy to the graph: do its work while the graph waits for a model, give the GIL back
every few steps of it, and do not let the garbage collector promote what a build makes and drops.

An instrumented graph builds and stores its episodes on a worker thread so that the work overlaps the graph's
waits (model calls, tools). But a worker thread running pure Python keeps the GIL until the interpreter's switch
interval (5 ms) forces it out, so a graph thread that wakes from a 1 ms model call waits for the rest of the
worker's job: measured on the 3-node benchmark graph, a 0.3 ms Python job on the worker cost the graph 0.17 ms
per run, and the same job with a `time.sleep(0)` every few steps cost it nothing measurable. The worker thread
marks itself; the builder and the store call `yield_gil()` between steps, which is free on any other thread.

A yield is not free on the worker: `time.sleep(0)` sleeps for the thread's timer slack (50 us by default on
Linux), which is what gives a waiting thread time to take the GIL. While someone waits for the worker's job
(`flush()`, a store read, `run_episode`: the gate is `hurried`) the worker does not yield: the one who waits
is not running, and yielding made it wait longer. Measured on the 3-node benchmark graph: one job, six
yields, took 0.73 ms of wall time for 0.18 ms of CPU, all of it paid by the `flush()` that waited for it. A
graph running on another thread meanwhile (rollouts in threads, each waiting for its own episode) waits for
the GIL for at most that one job's CPU time, or the interpreter's switch interval if sooner.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

_local = threading.local()


def mark_background(gate: ModelGate) -> None:
    """Called once by a trace worker thread, with its gate: `yield_gil()` on it then lets waiting threads run,
    unless someone waits for the worker (see the module's docstring)."""
    _local.gate = gate


def yield_gil() -> None:
    """On a trace worker, release the GIL for a moment (a thread waiting for it takes it) unless its job is
    waited for; elsewhere, nothing."""
    gate = getattr(_local, "gate", None)
    if gate is not None and not gate.hurry:
        time.sleep(0)


class ModelGate:
    """When a trace writer may work: while the graph waits for a model.

    A writer's work is pure Python that keeps the GIL, so what it does while the graph's thread has work of its
    own makes that thread wait: each time the graph lets the GIL go for a moment (a thread-pool hand-off, a
    lock, a checkpoint write) and wants it back, it waited for the writer's next yield. Measured in place on the
    3-node benchmark graph, a job took 0.8 ms of CPU (0.6 the build) and 1.1 ms of wall time with the in-memory
    store, and 1.2 ms of CPU over 4 ms with SQLite: the writer's work spread over the graph's own. A model call
    is the long wait of an agent's run, so the collectors count the model calls in flight (`models`, plain
    attribute updates on the graph's thread; `open()` only when the writer waits), and the writer starts a job
    at the gate (`wait`) and goes on to its store write (`pause`) while a model call is in flight. It waits for
    one to start for `patience` seconds at most per job (a graph that calls no model, or has long code between
    its calls, still has its episodes stored), and not at all while someone waits for a job (`hurried()`:
    flush, the store's reads, `run_episode`, exit) or while several calls run at once keep a model busy.

    Scheduling only: a count gone wrong (a model run that never ended) makes the writer wait less or more,
    never lose or reorder a job. Nor does it wait inside the build's pause of the garbage collector."""

    __slots__ = ("_open", "_lock", "hurry", "_deadline", "patience", "waiting", "models")

    def __init__(self, patience: float = 0.1) -> None:
        self._open = threading.Lock()
        self._open.acquire()  # held while closed: open() releases it, the writer's next wait takes it again
        self._lock = threading.Lock()
        self.hurry = 0  # threads waiting for a job right now
        self._deadline = 0.0  # the current job waits at the gate until then at most
        self.patience = patience
        self.waiting = False  # the writer waits at the gate: the next model call to start opens it
        self.models = 0  # model calls in flight in this writer's calls

    def wait(self) -> None:
        """The writer, with a new job: return once a model call is in flight, hurried, or after `patience`."""
        self._deadline = time.monotonic() + self.patience
        self.pause()

    def pause(self) -> None:
        """The writer, between two parts of a job: wait as `wait` does, within what is left of the job's
        patience."""
        if self.models > 0 or self.hurry:
            return
        left = self._deadline - time.monotonic()
        if left <= 0:
            return
        self._open.acquire(blocking=False)  # forget an opening from before: closed for sure
        self.waiting = True
        if self.models <= 0 and not self.hurry:  # read after `waiting` is set: from now on either opens
            self._open.acquire(timeout=left)
        self.waiting = False

    def open(self) -> None:
        self.waiting = False
        with suppress(RuntimeError):  # another thread opened it first
            self._open.release()

    @contextmanager
    def hurried(self, wake: bool = True) -> Iterator[None]:
        """While it lasts, the writer neither waits at the gate nor yields the GIL (see `yield_gil`); `wake`
        also lets it go from the gate now (not for a job run in another thread's place)."""
        with self._lock:
            self.hurry += 1
        if wake:
            self.open()
        try:
            yield
        finally:
            with self._lock:
                self.hurry -= 1


_lock = threading.Lock()
_pausing = 0  # pauses that turned the collector off and have not ended: each turns it back on as it ends


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's automatic garbage collection while an episode is built and handed on (bounded CPU work:
    no store write, no I/O; of the app's code only an `agents=` function, once per action), then turn it back
    on if this pause turned it off.

    A build makes a thousand or so containers that live until its episode is pickled, and the run's events
    hold its messages, states and replies until then. A collection that runs meanwhile (set off by the build's
    own allocations, the graph's, or the first allocation after the collector resumes) finds them alive and
    promotes them; each promotion into the oldest generation counts towards the next full collection of the
    whole process, though the objects are freed a moment later. Measured on the overhead benchmark's supervisor
    team (4 x 96 runs, per run): untraced, 1.37 young collections and 0.42 ms in the collector; traced, 2.4
    young collections, a full collection every 100 runs (some 57 ms each) and 1.10 ms; with the build, the
    recorder and the release of episode and events inside this pause, 0.93 young collections and 0.42 ms.

    The app's garbage must not wait on the writers: a pause lasts one build and is never shared (a build that
    starts inside another's pause runs unpaused once that one ends; shared, the pauses of several busy writers
    overlapped and kept the collector off for seconds), and the first allocation after it ends runs the
    collection that came due meanwhile. An app that turns the collector off itself while a pause lasts finds it
    on again when the pause ends."""
    global _pausing
    with _lock:
        began = gc.isenabled()
        if began:
            gc.disable()
            _pausing += 1
    try:
        yield
    finally:
        if began:
            with _lock:
                _pausing -= 1
                gc.enable()


def _resume_in_forked_child() -> None:
    """A forked child has none of its parent's threads, so no build there will end a pause the parent held:
    the child starts with the collector back on, and a lock of its own (the parent's may have been held by a
    thread the child lacks)."""
    global _lock, _pausing
    _lock = threading.Lock()
    if _pausing:
        _pausing = 0
        gc.enable()


if hasattr(os, "register_at_fork"):  # POSIX; elsewhere there is no fork
    os.register_at_fork(after_in_child=_resume_in_forked_child)
