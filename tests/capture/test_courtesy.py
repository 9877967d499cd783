from __future__ import annotations

import gc
import threading

import pytest

from mappa_graph import instrument
from mappa_graph.capture import builder as builder_module
from mappa_graph.capture.courtesy import gc_paused
from tests.fakes import QueuedBuilds
from tests.graphs import build_graph, task_input


@pytest.fixture(autouse=True)
def _collector_enabled():
    assert gc.isenabled()
    yield
    gc.enable()


def test_episodes_are_built_with_the_gc_paused_and_it_resumes_after(monkeypatch) -> None:
    seen = []
    build = builder_module.EpisodeBuilder.build

    def spy(self, events):
        seen.append(gc.isenabled())
        return build(self, events)

    monkeypatch.setattr(builder_module.EpisodeBuilder, "build", spy)
    app = instrument(build_graph().compile())
    for n in range(3):
        app.invoke(task_input(n))
    app.flush()
    assert seen == [False, False, False]
    assert gc.isenabled()
    assert len(app.episodes) == 3


def test_a_failed_build_resumes_the_collector(monkeypatch) -> None:
    def broken(self, events):
        raise RuntimeError("bad events")

    monkeypatch.setattr(builder_module.EpisodeBuilder, "build", broken)
    app = instrument(build_graph().compile())
    app.invoke(task_input(1))
    with pytest.raises(RuntimeError, match="bad events"):
        app.flush()
    assert gc.isenabled()


def test_a_collector_the_app_disabled_stays_disabled() -> None:
    gc.disable()
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_overlapping_builds_on_two_threads_do_not_make_one_long_pause() -> None:
    """Shared, the pauses of several busy writers overlapped and kept the collector off for seconds: the
    collector resumes when the build that paused it ends, whatever else is building."""
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    states = {}

    def first() -> None:
        with gc_paused():
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second() -> None:
        first_in.wait(5)
        with gc_paused():
            second_in.set()
            first_out.wait(5)
            states["after the first ended"] = gc.isenabled()
        states["after both"] = gc.isenabled()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert states == {"after the first ended": True, "after both": True}


def test_the_runs_objects_go_inside_the_pause_and_the_store_write_comes_after(monkeypatch) -> None:
    """Resumed while a run's events (its messages, states and replies) were still held, the collector's next
    allocation set off a collection on the writer thread that promoted them all into older generations: the
    events are released before it resumes. The store write may wait on a lock: it runs after."""
    from mappa_graph.capture import courtesy
    from mappa_graph.capture.collector import TraceCollector

    later, seen = QueuedBuilds(), {}

    class SpyGc:
        def __getattr__(self, name):
            return getattr(gc, name)

        def enable(self):
            seen["events left when resumed"] = len(events)
            gc.enable()

    def recorder(episode):
        seen["recorder paused"] = not gc.isenabled()
        return lambda: seen.setdefault("write paused", not gc.isenabled())

    collector = TraceCollector(executor=later, recorder=recorder, keep_episodes=False)
    build_graph().compile().invoke(task_input(3), {"callbacks": [collector]})
    (build, (events,)), = later.queued
    assert len(events) > 10
    monkeypatch.setattr(courtesy, "gc", SpyGc())
    build(events)
    assert seen == {"recorder paused": True, "events left when resumed": 0, "write paused": False}


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork (POSIX)")
def test_a_child_forked_during_a_build_has_its_collector_back() -> None:
    """A pause held by the parent's writer thread when the process forks has no thread in the child to end
    it: the child's garbage collector stayed off for good (and its next build waited on the parent's lock)."""
    from tests.capture.test_instrument import _in_forked_child

    app = instrument(build_graph().compile())
    inside, release = threading.Event(), threading.Event()

    def build_in_the_parent() -> None:
        with gc_paused():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=build_in_the_parent)
    thread.start()
    inside.wait(5)
    answer = _in_forked_child(lambda: f"{gc.isenabled()} {len(app.episodes)}", app)
    release.set()
    thread.join(10)
    assert answer == "True 1"
    assert gc.isenabled()


def test_the_writers_gate_opens_for_a_model_call_a_waiter_or_its_patience() -> None:
    """The writer's gate (see ModelGate): it waits while no model call is in flight, and only that long."""
    import time

    from mappa_graph.capture.courtesy import ModelGate

    def waited(gate: ModelGate, step=None, after_s: float = 0.2) -> float:
        if step is not None:
            threading.Timer(after_s, step).start()
        started = time.monotonic()
        gate.wait()
        return time.monotonic() - started

    gate = ModelGate(patience=30.0)
    gate.models = 1  # a model call in flight: the writer goes at once
    assert waited(gate) < 1
    gate.models = 0

    def model_starts() -> None:  # what a collector does as a model call starts
        gate.models += 1
        if gate.waiting:
            gate.open()

    assert 0.15 < waited(gate, model_starts) < 10
    gate.models = 0

    flushed = threading.Event()

    def flush() -> None:
        with gate.hurried():
            time.sleep(0.5)
        flushed.set()

    assert 0.15 < waited(gate, flush) < 10
    assert flushed.wait(10)  # that flush is over (not a sleep as long as it: on a busy machine it ended later)
    gate.patience = 0.3
    assert 0.25 < waited(gate) < 10  # nothing opened it: its patience
    started = time.monotonic()
    gate.pause()  # the job's patience is spent: a later part of it does not wait again
    assert time.monotonic() - started < 0.1
