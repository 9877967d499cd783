"""instrument(graph): the same compiled LangGraph app, recording one Episode per call.

Each call gets its own TraceCollector merged into the call's config (callbacks are added, never replaced), so
concurrent calls cannot mix their actions and the graph's own behaviour and outputs stay exactly as they were.

Each call is one Episode, also on a checkpointed thread: a call that paused in `interrupt()` is an Episode with
status "interrupted" (and the interrupts' values), its `Command(resume=...)` is the next Episode, both carrying
`metadata["thread_id"]` and the checkpoint each started from and left (`start_checkpoint_id`,
`end_checkpoint_id`). `TraceStore.episodes(thread_id=...)` lists a thread's episodes;
`TraceStore.join_thread(thread_id)` makes them one Episode, which is how a resumed run is judged and trained as
one.
"""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import functools
import logging
import os
import pickle
import queue
import threading
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from concurrent.futures import Executor
from contextlib import suppress
from pathlib import Path
from typing import Any

from langchain_core.callbacks import BaseCallbackManager
from langchain_core.runnables import Runnable, RunnableConfig

from ..traces import Episode
from .collector import TraceCollector, abound_steps, bound, bound_steps, thread_config
from .courtesy import ModelGate, mark_background
from .held_signals import Hold, signals_held
from .paths import AgentResolver, AgentsSpec
from .store import TraceStore

log = logging.getLogger(__name__)


def _check_compiled(graph: Any) -> None:
    from langgraph.graph import StateGraph
    from langgraph.pregel import Pregel

    if isinstance(graph, StateGraph):
        raise TypeError(
            "instrument() needs a compiled graph, got an uncompiled StateGraph: call graph.compile() first, "
            "then instrument(graph.compile())"
        )
    if not isinstance(graph, Pregel):
        inside = [getattr(graph, "bound", None), *(getattr(graph, "steps", None) or ())]
        fix = ""
        if any(isinstance(part, Pregel) for part in inside):  # a binding, a retry, a sequence around a graph
            fix = (": it wraps a compiled graph: instrument the graph itself and wrap the instrumented one the same "
                   "way (it is a Runnable), e.g. instrument(graph).with_retry(), prompt | instrument(graph)")
        raise TypeError(
            f"instrument() needs a compiled LangGraph graph (CompiledStateGraph / Pregel), got "
            f"{type(graph).__name__}{fix}"
        )


@functools.cache
def _found_as_a_subgraph() -> None:
    """Make LangGraph see an instrumented graph that keeps checkpoints as a graph. A parent graph finds a node's
    subgraph by type (`PregelProtocol`): wrapped and used as a node, the subgraph was not found, and the
    parent's `get_state(subgraphs=True)` lost its state while paused (so `update_state` inside it too), as did
    `get_subgraphs()` and the debug stream. A graph compiled with `checkpointer=False` is one LangGraph does
    not treat as a subgraph, so its wrapper is not registered either. Not covered: `get_subgraphs` lists no
    subgraph inside the wrapped one (LangGraph recurses only into its own Pregel class), so `update_state`
    cannot reach that deeper level by namespace, and a wrapper bound with `with_config` is not found.
    Registered on the first instrument(), so importing mappa_graph.capture stays free of langgraph."""
    from langgraph.pregel.protocol import PregelProtocol

    PregelProtocol.register(_FoundAsSubgraph)


def _reporting_cache_hits(graph: Any) -> Any:
    """The graph a call runs: a graph with a cache runs as a copy whose cache reports its hits (nodes that did
    not run, see cache_hits.py), made per call (a shallow copy, as `with_config` makes, about 15 us) so that what
    the user sets on their graph later (`graph.checkpointer = ...`) still holds; the user's graph and cache are
    left as they are."""
    if getattr(graph, "cache", None) is None:
        return graph
    from .cache_hits import RecordingCache

    return graph.copy({"cache": RecordingCache(graph.cache)})


def _with_handler(config: RunnableConfig | None, handler: TraceCollector, extra_metadata: Mapping[str, Any]) -> RunnableConfig:
    merged: dict[str, Any] = dict(config or {})
    callbacks = merged.get("callbacks")
    if callbacks is None:
        merged["callbacks"] = [handler]
    elif isinstance(callbacks, BaseCallbackManager):
        manager = callbacks.copy()
        manager.add_handler(handler, inherit=True)
        merged["callbacks"] = manager
    else:
        merged["callbacks"] = [*callbacks, handler]
    if extra_metadata:
        merged["metadata"] = {**(merged.get("metadata") or {}), **extra_metadata}
    return merged  # type: ignore[return-value]


class _TraceWorker(Executor):
    """One background thread that builds and stores episodes in the order their runs ended, remembering the
    last job (so `flush()` can wait for all) and the failed ones (so it surfaces a failed write instead of
    losing it).

    A bare thread on a SimpleQueue rather than a ThreadPoolExecutor: handing a job over is then one C-level
    `put` that shares no Python lock with the worker, so the graph's thread never waits on the worker (the
    pool's idle semaphore is released by the worker after each job, and a `submit` that meets it mid-release
    blocked the graph for the worker's whole next job, up to the interpreter's 5 ms switch interval). The
    thread is a daemon, started on the first job and holding only the queue and the error list: it ends once
    the worker is collected, and an exit hook drains it first, so no episode is lost at exit.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        """No thread, no jobs: a new worker, or a forked child's copy (see _forget_threads_after_fork)."""
        self._queue: queue.SimpleQueue[tuple[_Job, Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None]
        self._queue = queue.SimpleQueue()
        # Jobs run in order, so waiting for the last one waits for all; the failed ones are kept for flush()
        # to raise. Nothing else of a finished job stays: a server that never flushes must not keep them all.
        self._last: _Job | None = None
        self._errors: deque[BaseException] = deque()  # append and popleft are atomic
        self._jobs_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.gate = ModelGate()

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        with self._jobs_lock:  # `_last` is the last job queued: two threads' submits must not cross
            if self._thread is None:  # the first job (a forked child's copy forgets its thread, see below)
                self._thread = threading.Thread(target=_work, args=(self._queue, self.gate),
                                                name="mappa-trace", daemon=True)
                self._thread.start()
                weakref.finalize(self, self._queue.put, None)
                _WORKERS.add(self)
            job = self._last = _Job(self.gate, self._errors, fn, args, kwargs, self._last)
            self._queue.put(job)  # C-level, never waits: the worker takes no lock to get
        return job

    def flush(self, wait: bool = True) -> None:
        """Every queued job done (`wait`), or, from inside another worker's job, only what this thread can
        write itself now: the last job, if it has not started and the one before it is done. Waiting there
        could wait for a job (another writer's, inside its own) that waits for this one."""
        if self.gate in _gates_here():
            return  # a job of this worker's that reads the store: waiting for itself would never return
        last = self._last
        if last is not None:
            if wait:
                last.exception()  # hurries the gate
            else:
                last.run_if_ready()
        errors = self._take_errors()
        for error in errors[1:]:
            log.error("mappa_graph: another episode failed to build or store: %r", error)
        if errors:
            raise errors[0]

    def _take_errors(self) -> list[BaseException]:
        """The failures no one has raised yet, each taken once, by one flush, whichever thread flushes."""
        errors = []
        with suppress(IndexError):
            while True:
                errors.append(self._errors.popleft())
        return errors

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Finish the queued jobs (when `wait`) and stop the thread; a later submit starts a new one."""
        with self._jobs_lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            if wait:
                with self.gate.hurried():
                    thread.join()


_running = threading.local()


def _gates_here() -> list[ModelGate]:
    """The gates of the workers whose jobs this thread is running (its own worker's, on a writer thread; a
    job's, while it runs one in place), innermost last: see _TraceWorker.flush and InstrumentedGraph._settle."""
    gates = getattr(_running, "gates", None)
    if gates is None:
        gates = _running.gates = []
    return gates


class _Job:
    """One queued build, as `submit` returns it: `result()` and `exception()` as on a Future, without the
    Condition and RLock a Future builds, a dozen Python calls on the graph's thread per run. A lock held until
    the job has run is all the waiting needs. It keeps no result (the episode reaches its collector, the kept
    episodes and the store), nor, once run, its work, so a job that is still referenced holds no episode alive.

    Whoever waits for a job the worker has not started, once the job before it is done, runs it in place
    (`claim`): a `flush()` right after a call then costs the job's own CPU, not the worker's two wake-ups (from
    the queue, then at the gate) before it, measured at 125 us on the 3-node benchmark graph, and the job runs
    on the thread whose caches hold its events. It runs as on the writer: in a context of its own (a model
    call the store makes is not the waiter's call's), and to the end unless a second Ctrl-C forces it (see
    signals_held). Jobs still run one at a time and in order: each runs only once the one queued before it is
    done."""

    __slots__ = ("_done", "_claimed", "_error", "_errors", "_gate", "_work", "_before", "_worked")

    def __init__(self, gate: ModelGate, errors: deque[BaseException], fn: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any], before: _Job | None) -> None:
        self._gate = gate  # waiting for the job hurries its worker (see ModelGate)
        self._errors = errors  # the worker's, which flush() raises (not the worker: a job must not keep it alive)
        self._work: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None = (fn, args, kwargs)
        self._before = before  # run first; forgotten once this job runs, so jobs never chain past the queue
        self._done = threading.Lock()
        self._done.acquire()
        self._claimed = threading.Lock()  # taken by the one thread that runs the job
        self._error: BaseException | None = None
        self._worked = False  # its work has run (to its end, or to its failure)

    def claim(self) -> bool:
        return self._claimed.acquire(blocking=False)

    def run(self, held: Hold | None = None) -> None:
        """Run by the thread that claimed the job, after the job before it is done; a failure joins the
        worker's errors before the job counts as done, so a flush() that waited for it sees it. Only the job's
        own work may be forced short (`held`, see signals_held). Nothing of the job is left in this frame,
        which a failure's traceback keeps (with the job before, the one before that, and so on, had each
        failed)."""
        before = work = fn = args = kwargs = None
        try:  # from the first step: whatever cuts it short, the job ends done
            before, self._before = self._before, None
            work, self._work = self._work, None
            if work is None:  # run again to end a run that was cut short (see _run_in_place)
                if self._worked:
                    return
                raise RuntimeError("mappa_graph: a trace job was interrupted before it ran; its episode is lost")
            if before is not None:
                before._wait()
                before = None
            fn, args, kwargs = work
            work = None
            try:
                if held is None:
                    fn(*args, **kwargs)
                else:  # a press forced in forcible()'s exit, the work done, still fails the job: it was asked
                    with held.forcible():
                        fn(*args, **kwargs)
            finally:
                self._worked = True
        except BaseException as error:  # noqa: BLE001 - handed to flush(), which re-raises it
            self._error = error
            self._errors.append(error)
        finally:
            before = work = fn = args = kwargs = None  # see the docstring
            self._done.release()

    def _wait(self, timeout: float | None = None) -> bool:
        if timeout is None:
            with self._done:  # an interrupt cannot leave it taken
                return True
        done = self._done.acquire(timeout=timeout)
        if done:
            self._done.release()
        return done

    def _run_in_place(self) -> None:
        """Claimed before the gate is hurried, so a writer held at the gate with this job does not wake to
        race for it (nor to take the GIL from the build here); hurried, so the store write does not wait there
        for a model call. Once claimed, the job is this thread's alone: a run cut short is run again until the
        job ends done (at worst failed), or every later wait for it would hang (see _end_here)."""
        with signals_held() as held:
            gates = _gates_here()
            depth = len(gates)
            try:
                gates.append(self._gate)
                if self.claim():  # else the worker took it first
                    self._end_here(held)
            finally:
                del gates[depth:]

    def _end_here(self, held: Hold | None) -> None:
        """Run the claimed job, and again, until it ends done, if something cut its run short (a signal
        handler that raised between two steps); the first such exception is raised once it is done."""
        cut: BaseException | None = None
        while self._done.locked():
            try:
                with self._gate.hurried(wake=False):
                    contextvars.Context().run(self.run, held)
            except BaseException as error:  # noqa: BLE001 - raised below, once the job is done
                cut = cut or error
        if cut is not None:
            raise cut

    def run_if_ready(self) -> None:
        """Run it here, now, if it has not started and the job before it is done."""
        before = self._before
        if self._work is not None and (before is None or not before._done.locked()):
            del before
            self._run_in_place()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if timeout is None:
            self.run_if_ready()
        with self._gate.hurried():
            if not self._wait(timeout):
                raise TimeoutError(f"the trace writer did not finish this job within {timeout} s")
        return self._error

    def result(self, timeout: float | None = None) -> None:
        """Raise the job's failure to the one waiting for it (`run_episode`), taking it from the errors a later
        flush() raises: one failed write is reported once, not again as another lost episode."""
        error = self.exception(timeout)
        if error is not None:
            with suppress(ValueError):  # a flush on another thread took it first
                self._errors.remove(error)
            raise error


def _work(jobs: queue.SimpleQueue[_Job | None], gate: ModelGate) -> None:
    """The worker thread: run jobs in order until a None, skipping those a waiting thread claimed first. The
    first job of a batch waits at the gate; the ones queued behind it run at once."""
    mark_background(gate)
    _gates_here().append(gate)  # its jobs' store reads wait for no other thread's job (see InstrumentedGraph._settle)
    ready = False
    while True:
        try:
            job = jobs.get_nowait() if ready else jobs.get()
        except queue.Empty:
            ready = False
            continue
        if job is None:
            return
        if not ready:
            gate.wait()  # until the graph waits for a model (see ModelGate)
            ready = True
        if job.claim():
            job.run()
        del job  # drop the episode's events before waiting for the next job


_WORKERS: weakref.WeakSet[_TraceWorker] = weakref.WeakSet()


def _forget_threads_after_fork() -> None:
    """A forked child has none of its parent's threads: each worker starts its own on its next job. A hook
    rather than a `Thread.is_alive()` per submit, which cost the graph's thread two Python calls per run.
    The parent's queued and running builds stay the parent's (the child would write them twice, and wait
    forever on the one that was running), and its lock may have been held by a thread the child lacks."""
    for worker in list(_WORKERS):
        worker._reset()


if hasattr(os, "register_at_fork"):  # POSIX; elsewhere there is no fork
    os.register_at_fork(after_in_child=_forget_threads_after_fork)


@atexit.register
def _drain_workers() -> None:
    """At interpreter exit, write what the workers still hold (their daemon threads would otherwise die with
    episodes queued), and report the writes that failed."""
    for worker in list(_WORKERS):
        worker.shutdown(wait=True)
        errors = worker._take_errors()  # no flush() will come to raise them: say so before the process ends
        if errors:
            log.error("mappa_graph: %d episode%s could not be built or stored before exit; the first error: %r",
                      len(errors), "" if len(errors) == 1 else "s", errors[0], exc_info=errors[0])


def _next_unless_interrupted(state: Any) -> list[str]:
    """A thread's next nodes if its run stopped at a static breakpoint; [] if it finished or paused in
    interrupt() (recorded from that node's own event)."""
    if any(task.interrupts for task in state.tasks):
        return []
    return list(state.next)


def _episode(kept: bytes | Episode) -> Episode:
    """A kept episode as `episodes` returns it: unpickled (a new copy on each read)."""
    return pickle.loads(kept) if isinstance(kept, bytes) else kept  # our own bytes, never read from outside


def _of_graph(name: str) -> Any:
    """The wrapped graph's attribute `name` (a method comes bound to the graph): for what Runnable defines
    itself and so never reaches `__getattr__`."""
    return property(lambda self: getattr(self.graph, name))


class InstrumentedGraph(Runnable[Any, Any]):
    """Behaves like the compiled graph it wraps (`invoke`, `ainvoke`, `stream`, `astream`, `batch`, `abatch`,
    and every other attribute by delegation); each call also yields an Episode, kept in `episodes` (the most
    recent `keep` of them; each read gives new copies) and written to the store when one is given.

    With `background=True` (the default) episodes are built and stored on a worker thread, off the graph's
    hot path, while the graph waits for a model call (or within 0.1 s; see `ModelGate`);
    `episodes`, `last_episode`, `run_episode`, `flush()` and the store's own reads (`store.episodes()`,
    `count()`, rewards for a just-run episode) wait for it, so nothing is missed, and a failed write is raised
    by whichever of them comes first. (A store read made inside a trace job, by a store write that reads the
    store, does not wait for another thread's job: that job could be waiting for this one; see `_settle`.)

    It is a Runnable itself, so what LangChain builds on a Runnable records too: `with_config`, `with_retry`,
    `with_fallbacks`, `app | next_step`, `batch_as_completed`, `astream_log`, a tool made with `as_tool`. What
    describes the graph (its name, schemas, `get_graph()`) and everything else (`get_state`, `update_state`,
    `checkpointer`, ...) is the wrapped graph's.

    `agents` maps node paths (`researcher`, `researcher/agent`; the longest matching prefix wins) to agent
    names, or is a function of the path tuple (`("researcher", "agent")`) returning a name or None for the
    default, the path's first name. `train_failed_attempts=True` trains the model calls of attempts that a
    RetryPolicy retried after a failure as well (by default they are judged, shown as failed, and not trained).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> InstrumentedGraph:  # noqa: PYI034 - may be a subclass
        """A graph that keeps checkpoints gets the subclass LangGraph finds as a subgraph (see
        `_found_as_a_subgraph`)."""
        graph = args[0] if args else kwargs.get("graph")
        if cls is InstrumentedGraph and graph is not None and getattr(graph, "checkpointer", None) is not False:
            _found_as_a_subgraph()
            return super().__new__(_FoundAsSubgraph)
        return super().__new__(cls)

    def __init__(
        self,
        graph: Any,
        *,
        store: TraceStore | None = None,
        run: str = "default",
        agents: AgentsSpec | None = None,
        keep: int = 1000,
        background: bool = True,
        train_failed_attempts: bool = False,
    ) -> None:
        _check_compiled(graph)
        resolver = AgentResolver(agents)
        resolver.check(graph)
        self.graph = graph
        self.store = store
        self.run = run
        self.agents = agents if resolver.function is not None else dict(resolver.mapping)  # as given, to reuse
        self._resolver = resolver
        self.train_failed_attempts = train_failed_attempts
        saver = getattr(graph, "checkpointer", None)
        self._checkpointer = saver if hasattr(saver, "get_tuple") else None
        self._async_only: bool | None = None  # the saver refuses sync reads on the event loop (see _reads_async)
        self._breakpoints = bool(getattr(graph, "interrupt_before_nodes", None)
                                 or getattr(graph, "interrupt_after_nodes", None))
        self.keep = keep
        self._episodes: list[bytes | Episode] = []  # pickled: see _record
        self._episodes_lock = threading.Lock()
        self._worker = _TraceWorker() if background else None
        if store is not None and self._worker is not None:
            store.attach_writer(self._settle)  # the store's reads wait for this graph's queued episodes

    # ---- episode plumbing -----------------------------------------------------------------------------
    def _collector(self, keep: bool, breakpoints: bool = False) -> TraceCollector:
        return TraceCollector(run=self.run, agents=self._resolver, recorder=self._record, executor=self._worker,
                              checkpointer=self._checkpointer, train_failed=self.train_failed_attempts,
                              keep_episodes=keep, paused_before=self._paused_before, breakpoints=breakpoints,
                              one_call=True)

    def _reads_async(self, config: RunnableConfig | None, collector: TraceCollector) -> bool:
        """Whether this async call must read its checkpoints with the saver's async methods: a call on a
        thread of a saver whose sync reads refuse to run on the event loop's thread (AsyncSqliteSaver,
        AsyncPostgresSaver), found out on the first such call and remembered. The collector then leaves the
        reads to its `astart` and `aend`."""
        if self._checkpointer is None:
            return False
        thread = ((config or {}).get("configurable") or {}).get("thread_id")
        if thread is None:
            return False
        if self._async_only is None:
            try:
                self._checkpointer.get_tuple({"configurable": thread_config(thread)})
            except Exception:  # noqa: BLE001 - any refusal: read asynchronously from now on
                self._async_only = True
            else:
                self._async_only = False
        collector.async_reads = self._async_only
        return self._async_only

    async def _apaused_before(self, checkpoint: dict[str, Any]) -> list[str]:
        """`_paused_before` with the saver's async reads."""
        try:
            state = await self.graph.aget_state({"configurable": checkpoint})
        except Exception:  # noqa: BLE001 - bookkeeping must never break the graph
            return []
        return _next_unless_interrupted(state)

    def _paused_before(self, checkpoint: dict[str, Any]) -> list[str]:
        """The nodes a call that ended at `checkpoint` goes on with when resumed, if it stopped at a static
        breakpoint; [] if it finished, or paused in interrupt() (recorded from that node's own event)."""
        try:
            state = self.graph.get_state({"configurable": checkpoint})
        except Exception:  # noqa: BLE001 - bookkeeping must never break the graph (an async-only saver)
            return []
        return _next_unless_interrupted(state)

    def _record(self, episode: Episode) -> Callable[[], None] | None:
        """Keep the episode pickled and prepare its store write (`TraceStore.prepare_write`: serialised now, or
        the episode itself for a store subclass with its own `add_episode`), inside the build's pause of the
        garbage collector; returns the write, which the collector runs after the pause (it may wait on a lock or
        a network).

        Kept as Python objects, episodes (some 60 containers for a 4-action one) outlived the garbage
        collector's young generations, and each quarter more of them in its oldest one set off a full
        collection of the whole process, on whichever thread was allocating: 0.2 ms per run of the overhead
        benchmark's graph. Bytes are nothing for the collector to walk, and unlike JSON they give back every
        value as it was (a tuple, a date, an infinite log-prob, the app's own reference type). An episode that
        cannot be pickled is kept as it is."""
        try:
            kept: bytes | Episode = pickle.dumps(episode, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - e.g. a reference holding a lambda: kept as the object instead
            kept = episode
        with self._episodes_lock:
            self._episodes.append(kept)
            if len(self._episodes) > self.keep:
                del self._episodes[: len(self._episodes) - self.keep]
        return self.store.prepare_write(episode) if self.store is not None else None

    def flush(self) -> None:
        """Wait until every finished call's Episode is built and stored; re-raises a failed store write.

        From inside one of this graph's own trace jobs (a store write that reads the store) it returns at once:
        the job would wait for itself."""
        if self._worker is not None:
            self._worker.flush()

    def _settle(self) -> None:
        """What the store's reads wait for: flush(); from inside a trace job (a store write that reads the
        store, on a writer thread or run in a waiter's place), only this graph's episode that the reading
        thread can write itself now (see _TraceWorker.flush). Two graphs on one store whose writes read it
        would otherwise each wait, inside its job, for the other's."""
        if self._worker is not None:
            self._worker.flush(wait=not _gates_here())

    @property
    def episodes(self) -> list[Episode]:
        return [_episode(item) for item in self._kept()]

    def _kept(self) -> list[bytes | Episode]:
        """The kept episodes as stored, once every finished call's is in."""
        self.flush()
        with self._episodes_lock:
            return list(self._episodes)

    def _config(self, config: RunnableConfig | None, task_id: str | None = None, reference: Any = None, *,
                keep: bool = False, call_kwargs: Mapping[str, Any] | None = None):
        """The call's config with a new collector, which keeps its episode only when `keep` (the caller reads
        it from the collector); every episode is kept by this graph in any case. A call that may stop at a
        static breakpoint (the graph's `interrupt_before`/`interrupt_after`, or the call's) gets a collector
        that asks, as the call ends, where it stopped."""
        breakpoints = self._breakpoints or bool(call_kwargs and (call_kwargs.get("interrupt_before")
                                                                 or call_kwargs.get("interrupt_after")))
        collector = self._collector(keep, breakpoints)
        extra: dict[str, Any] = {}
        if task_id is not None:
            extra["mappa_task_id"] = task_id
        if reference is not None:
            extra["mappa_reference"] = reference
        return _with_handler(config, collector, extra), collector

    def episodes_newest_first(self) -> Iterator[Episode]:
        """The kept episodes from the most recent back, each unpickled only when the iteration reaches it."""
        return (_episode(item) for item in reversed(self._kept()))

    @property
    def last_episode(self) -> Episode | None:
        return next(self.episodes_newest_first(), None)

    @property
    def _runs_on(self) -> Any:
        """The graph each call runs (see `_reporting_cache_hits`)."""
        return _reporting_cache_hits(self.graph)

    # ---- the Runnable interface ---------------------------------------------------------------------
    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        cfg, collector = self._config(config, call_kwargs=kwargs)
        with bound(collector):
            return self._runs_on.invoke(input, cfg, **kwargs)

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        cfg, collector = self._config(config, call_kwargs=kwargs)
        reads = self._reads_async(cfg, collector)
        try:
            if reads:
                await collector.astart(cfg["configurable"]["thread_id"])
            with bound(collector):
                return await self._runs_on.ainvoke(input, cfg, **kwargs)
        finally:
            if reads:
                await collector.aend(self._apaused_before)

    def stream(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Iterator[Any]:
        cfg, collector = self._config(config, call_kwargs=kwargs)
        return bound_steps(collector, self._runs_on.stream(input, cfg, **kwargs))

    def astream(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> AsyncIterator[Any]:
        cfg, collector = self._config(config, call_kwargs=kwargs)
        return abound_steps(collector, self._runs_on.astream(input, cfg, **kwargs), self._around(cfg, collector))

    def _around(self, config: RunnableConfig, collector: TraceCollector) -> tuple[Any, Any] | None:
        """What an async stream awaits before its first step and after its end: an async-only saver's reads."""
        if not self._reads_async(config, collector):
            return None
        return (functools.partial(collector.astart, config["configurable"]["thread_id"]),
                functools.partial(collector.aend, self._apaused_before))

    def astream_events(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        """The graph's own event stream, recorded like `astream`. `version="v3"` (LangGraph's experimental run
        stream) is an awaitable, not an iterator: it is returned as the graph gives it, and its collector binds
        itself from the run's first callback, as under `stream_events`."""
        cfg, collector = self._config(config, call_kwargs=kwargs)
        if kwargs.get("version") == "v3":
            return self._runs_on.astream_events(input, cfg, **kwargs)
        return abound_steps(collector, self._runs_on.astream_events(input, cfg, **kwargs), self._around(cfg, collector))

    def stream_events(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        cfg, _ = self._config(config, call_kwargs=kwargs)
        return self._runs_on.stream_events(input, cfg, **kwargs)

    # batch, abatch, batch_as_completed: Runnable's, as the graph's own are (LangGraph does not override them);
    # each input then runs through invoke/ainvoke above, with a collector of its own bound in its own context.

    # ---- episodes with task context (what the trainer uses) ------------------------------------------
    def run_episode(
        self,
        input: Any,
        *,
        task_id: str | None = None,
        reference: Any = None,
        config: RunnableConfig | None = None,
        **kwargs: Any,
    ) -> tuple[Any, Episode]:
        """Run the graph once on a task and return (output, Episode); the episode carries task id and reference.

        A graph that raises still yields its (partial) episode, stored with the error, before the error
        propagates: nothing already recorded is lost.
        """
        cfg, collector = self._config(config, task_id, reference, keep=True, call_kwargs=kwargs)
        try:
            with bound(collector):
                output = self._runs_on.invoke(input, cfg, **kwargs)
        finally:
            collector.wait()
        return output, collector.episodes.pop()  # not left where a handoff's cyclic garbage reaches it

    async def arun_episode(
        self,
        input: Any,
        *,
        task_id: str | None = None,
        reference: Any = None,
        config: RunnableConfig | None = None,
        **kwargs: Any,
    ) -> tuple[Any, Episode]:
        cfg, collector = self._config(config, task_id, reference, keep=True, call_kwargs=kwargs)
        reads = self._reads_async(cfg, collector)
        try:
            if reads:
                await collector.astart(cfg["configurable"]["thread_id"])
            with bound(collector):
                output = await self._runs_on.ainvoke(input, cfg, **kwargs)
        finally:
            if reads:
                await collector.aend(self._apaused_before)
            await asyncio.get_running_loop().run_in_executor(None, collector.wait)
        return output, collector.episodes.pop()

    def __getattr__(self, name: str) -> Any:
        if name == "graph":  # not set yet (a half-built or unpickled wrapper): no delegation loop
            raise AttributeError(name)
        return getattr(self.graph, name)

    # ---- what describes the graph is the graph's (Runnable's own defaults would shadow __getattr__) -----------
    name = _of_graph("name")
    InputType = _of_graph("InputType")
    OutputType = _of_graph("OutputType")
    input_schema = _of_graph("input_schema")
    output_schema = _of_graph("output_schema")
    config_specs = _of_graph("config_specs")
    get_name = _of_graph("get_name")
    get_input_schema = _of_graph("get_input_schema")
    get_output_schema = _of_graph("get_output_schema")
    get_input_jsonschema = _of_graph("get_input_jsonschema")
    get_output_jsonschema = _of_graph("get_output_jsonschema")
    config_schema = _of_graph("config_schema")
    get_config_jsonschema = _of_graph("get_config_jsonschema")
    get_graph = _of_graph("get_graph")
    get_prompts = _of_graph("get_prompts")

    def __repr__(self) -> str:
        return f"InstrumentedGraph({self.graph!r}, run={self.run!r})"


class _FoundAsSubgraph(InstrumentedGraph):
    """The InstrumentedGraph of a graph that keeps checkpoints: registered as LangGraph's `PregelProtocol`, so
    a parent graph that has it as a node finds it as a subgraph, as it finds the plain one."""


def instrument(
    graph: Any,
    *,
    store: TraceStore | str | Path | None = None,
    run: str = "default",
    agents: AgentsSpec | None = None,
    background: bool = True,
    train_failed_attempts: bool = False,
) -> InstrumentedGraph:
    """Wrap a compiled LangGraph app so each call records an Episode (into `store` when given: a TraceStore
    or a path to its SQLite file). Each action's agent is its agent boundary: the outermost node below this
    graph (a supervisor's or swarm's worker, a subgraph node, a plain node), or the tool whose call ran a graph
    (a subagent as a tool: `tools/ask_researcher/model` belongs to `ask_researcher`), its full node path kept in
    `Action.path`; `agents` maps paths to other agent names or is a function of the path (checked here on every
    path the graph declares)."""
    if isinstance(store, (str, Path)):
        store = TraceStore(store)
    return InstrumentedGraph(graph, store=store, run=run, agents=agents, background=background,
                             train_failed_attempts=train_failed_attempts)
