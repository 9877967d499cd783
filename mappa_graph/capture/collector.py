"""TraceCollector: a langchain-core callback handler that turns a LangGraph run into an Episode.

Attribution rides on what LangGraph already puts in every node task's run metadata (`langgraph_node`,
`langgraph_step`, `langgraph_checkpoint_ns`) and that every child run inherits, the same way LangGraph's own
message-streaming handler works; the agent is the agent boundary of the node's path (see paths.py). Runs are
grouped by their root run, so one collector can watch many episodes at once (`batch`, `asyncio.gather`) without
mixing them.

The callbacks sit on the graph's hot path, so they only append the raw event to their root's list; the
Episode is built from those events when the root run ends, on an executor when one is given (the
instrumented graph uses a background thread, so building and storing overlap the next model call). This
module never imports torch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextvars import ContextVar, Token
from typing import Any, Protocol
from uuid import UUID, uuid4

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.tracers.context import register_configure_hook

from ..traces import Episode
from .builder import EpisodeBuilder, Event, Raised, freeze
from .courtesy import gc_paused
from .paths import AgentResolver, AgentsSpec

log = logging.getLogger(__name__)

# The collector of the call running in this context. A node that calls a model or a chain with callbacks of its
# own (`model.invoke(x, config={"callbacks": [my_handler]})`, `agent.invoke(x, config={"callbacks": []})`)
# replaces what it inherited, this collector among them; langchain-core adds the handler a configure hook's
# variable holds to every callback manager configured in its context (LangSmith's tracer rides the same way),
# so those calls still reach the collector, which puts them under the node task that made them. The instrumented
# graph binds it for exactly the time its call computes (`bound`, and `bound_steps` around each step of a
# stream): a caller holding several streams, or one abandoned part way, never lends a collector to another call.
_CALL_COLLECTOR: ContextVar[BaseCallbackHandler | None] = ContextVar("mappa_call_collector", default=None)
register_configure_hook(_CALL_COLLECTOR, inheritable=True)


class bound:  # noqa: N801 - used as a context manager, like contextlib's lower-case ones
    """Make `collector` the one the configure hook adds while its call runs here, and no longer: a call that
    raises, or ends in another call's context, leaves no collector behind for later calls to join. A class
    rather than a @contextmanager: it runs on every call, and the generator's machinery was six Python calls."""

    __slots__ = ("_collector", "_token")

    def __init__(self, collector: BaseCallbackHandler) -> None:
        self._collector = collector

    def __enter__(self) -> None:
        self._token = _CALL_COLLECTOR.set(self._collector)

    def __exit__(self, *exc: object) -> None:
        _CALL_COLLECTOR.reset(self._token)


def bound_steps(collector: BaseCallbackHandler, steps: Iterator[Any]) -> Iterator[Any]:
    """A graph's stream with `collector` bound only while the graph computes a step, not while the caller holds
    one: streams read in turn in one context (or one nested in another's node) each see their own collector,
    and the caller's own model calls between chunks belong to no episode. Closing it closes the graph's stream
    under the same binding, so the steps a stopped stream cancels still reach their episode."""
    try:
        while True:
            with bound(collector):
                try:
                    step = next(steps)
                except StopIteration:
                    return
            yield step
    finally:
        close = getattr(steps, "close", None)
        if close is not None:
            with bound(collector):
                close()


async def abound_steps(collector: BaseCallbackHandler, steps: AsyncIterator[Any],
                       around: tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]] | None = None,
                       ) -> AsyncIterator[Any]:
    """`bound_steps` for an async stream (`astream`, `astream_events`); `around` is awaited before the first
    step and after the stream ends, however it ends (the checkpoint reads of an async-only saver)."""
    try:
        if around is not None:
            await around[0]()
        while True:
            with bound(collector):
                try:
                    step = await steps.__anext__()
                except StopAsyncIteration:
                    return
            yield step
    finally:
        aclose = getattr(steps, "aclose", None)
        try:
            if aclose is not None:
                with bound(collector):
                    await aclose()
        finally:
            if around is not None:
                await around[1]()


def _is_interrupt(error: BaseException) -> bool:
    """A LangGraph pause (interrupt() or a breakpoint); langgraph is imported only once an error comes, so
    importing this module loads no graph library."""
    from langgraph.errors import GraphInterrupt

    return isinstance(error, GraphInterrupt)


def thread_config(thread_id: Any) -> dict[str, Any]:
    """The checkpointer config of a thread's top-level graph."""
    return {"thread_id": thread_id, "checkpoint_ns": ""}


def _checkpoint_of(found: Any) -> str | None:
    """The id of a checkpoint tuple a saver returned (None: the thread has none yet)."""
    return found.config["configurable"].get("checkpoint_id") if found is not None else None


class Pending(Protocol):
    """A submitted build: a concurrent.futures.Future, or the instrumented graph's lighter job."""

    def result(self, timeout: float | None = None) -> Any: ...


class BuildExecutor(Protocol):
    """Where episodes are built: any concurrent.futures.Executor, or the instrumented graph's writer thread."""

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Pending: ...


class TraceCollector(BaseCallbackHandler):
    """Records one Episode per root run it sees.

    `agents` maps node paths (`worker`, `worker/agent`) to agent names, or is a function of the path (default:
    the path's first name, the agent boundary). `on_episode` is called with each finished Episode (the
    instrumented graph uses it to write to the store). Finished episodes are kept in `episodes`; `wait()` returns
    once every ended run's Episode is built (with an executor, building is asynchronous). With the graph's
    `checkpointer`, an episode run on a thread records the checkpoint it started from and the one it left.
    `train_failed` keeps the model calls of failed attempts trainable. `keep_episodes=False` hands episodes on
    without keeping them: a collector stays reachable from the cyclic garbage of the exceptions LangGraph
    raises for control flow (a handoff's frames hold the run's config, its callbacks, this collector), and an
    episode kept there waited for the garbage collector instead of being freed. `recorder` is what an
    instrumented graph does with each episode as it is built (keep it, serialise it for its store): it runs with
    the garbage collector paused, so it must not block, and returns what to run once the pause is over (the
    store write) or None. `paused_before`, given a thread's checkpoint where a run ended, names the nodes it
    goes on with if it stopped at a static breakpoint (the instrumented graph asks its graph's state): asked
    as every run on a thread ends, or with `breakpoints=False` (a graph with no breakpoints of its own) only
    after a run in which a node raised GraphInterrupt (a subgraph's breakpoint stops its parent's run too).
    `one_call=True` is a collector for a single call (the instrumented graph's): while that call runs, a model
    call or chain a node makes with callbacks of its own still reaches it and joins the node task that made it;
    a run that belongs to no task of the call is not recorded.
    """

    # Ordering matters (a node's start must be seen before its model call), so run in the caller's thread
    # even under asyncio instead of being pushed to an executor.
    run_inline = True
    raise_error = False
    # langchain-core asks a handler these before every event; plain attributes instead of the base class's
    # properties save a Python call per event; the events an episode is not built from (retrievers, retries,
    # custom events) are not sent at all. Tool events are gated by `ignore_agent`.
    ignore_chain = ignore_llm = ignore_chat_model = ignore_agent = False
    ignore_retriever = ignore_retry = ignore_custom_event = True

    def __init__(
        self,
        *,
        run: str = "default",
        agents: AgentsSpec | AgentResolver | None = None,
        on_episode: Callable[[Episode], None] | None = None,
        episode_defaults: Mapping[str, Any] | None = None,
        executor: BuildExecutor | None = None,
        checkpointer: Any = None,
        train_failed: bool = False,
        keep_episodes: bool = True,
        recorder: Callable[[Episode], Callable[[], None] | None] | None = None,
        paused_before: Callable[[dict[str, Any]], list[str]] | None = None,
        breakpoints: bool = True,
        one_call: bool = False,
    ) -> None:
        self.run = run
        self.one_call = one_call
        self._root_opened = False
        self._context_token: Token[BaseCallbackHandler | None] | None = None
        self.recorder = recorder
        self.paused_before = paused_before
        self.breakpoints = breakpoints
        self._interrupted = False  # a run of this call raised GraphInterrupt: it may have paused in a subgraph
        # An async call on a saver that cannot read synchronously on the event loop's thread (AsyncSqliteSaver):
        # the caller awaits `astart` before the call (the start checkpoint) and, once the call is over, `aend`
        # (the end one and where it paused), which then hands the run's events on.
        self.async_reads = False
        self.start_checkpoint: str | None = None
        self._deferred: list[tuple[list[Event], dict[str, Any], str, dict[str, Any]]] = []
        self.keep_episodes = keep_episodes
        self.agents = agents if isinstance(agents, AgentResolver) else AgentResolver(agents)
        self.checkpointer = checkpointer
        self.train_failed = train_failed
        self._threads: dict[int, dict[str, Any]] = {}
        self.on_episode = on_episode
        self.episode_defaults = dict(episode_defaults or {})
        self.executor = executor
        self._gate = getattr(executor, "gate", None)  # the instrumented graph's writer works during model calls
        self._models = 0  # this call's model calls in flight, counted in the gate too
        self.episodes: list[Episode] = []
        # Every open run's root event list, keyed by `UUID.int`: hashing an int is C, hashing a UUID is a
        # Python call, and this lookup runs on every callback. The events carry the ints too.
        self._runs: dict[int | None, list[Event]] = {}  # None: no parent, never a key
        self._pending: list[Pending] = []
        self._lock = threading.Lock()

    # ---- capture: as little as possible per callback ----------------------------------------------------
    # Each callback is one frame that appends a raw event tuple to its root's list; everything else (paths,
    # agents, serialization, Actions) waits for the builder. `_runs` maps every open run to that list, so a
    # start costs one lookup of its parent and an end one lookup of itself; the list's first event is its
    # root's start. The bodies are inlined rather than shared through a helper: LangGraph sends about 20 of
    # these per 3-node run, and one dict plus no helper frame took the collector's own time from about 32 to
    # 21 us per run (unprofiled).
    def on_chain_start(self, serialized: Any, inputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None,
                       metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        run, parent = run_id.int, parent_run_id.int if parent_run_id is not None else None
        events, extra = self._runs.get(parent), None
        if events is None:
            events, parent, metadata, extra = self._orphan(run, metadata, None)
            if events is None:
                return
        self._runs[run] = events
        events.append(("chain_start", run, parent, metadata, inputs, time.time(), extra))

    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
        run = run_id.int
        events = self._runs.get(run)
        if events is not None:
            if events[0][1] == run:
                self._close_root(events, "chain_end", run, outputs)
            else:
                events.append(("chain_end", run, None, None, outputs, time.time(), None))

    def on_chain_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        run = run_id.int
        events = self._runs.get(run)
        if events is not None:
            if _is_interrupt(error):
                self._interrupted = True
            if events[0][1] == run:
                self._close_root(events, "chain_error", run, Raised.of(error))
            else:
                events.append(("chain_error", run, None, None, Raised.of(error), time.time(), None))

    def on_cached_task(self, node: str, inputs: Any, metadata: Mapping[str, Any], parent_run_id: UUID | None,
                       outputs: Any, at: float) -> None:
        """A node task a LangGraph cache answered (it did not run, and sent no callback; see cache_hits.py): it
        is recorded as a node run of its graph run that started and ended at once, marked cached."""
        parent = parent_run_id.int if parent_run_id is not None else None
        events = self._runs.get(parent)
        if events is not None:
            run = uuid4().int
            events.append(("chain_start", run, parent, metadata, inputs, at, "cached"))
            events.append(("chain_end", run, None, None, outputs, at, None))

    def on_chat_model_start(self, serialized: Any, messages: Any, *, run_id: UUID, parent_run_id: UUID | None = None,
                            metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        run, parent = run_id.int, parent_run_id.int if parent_run_id is not None else None
        events, extra = self._runs.get(parent), kwargs.get("invocation_params")
        if events is None:
            events, parent, metadata, extra = self._orphan(run, metadata, extra)
            if events is None:
                return
        self._runs[run] = events
        events.append(("llm_start", run, parent, metadata, messages, time.time(), extra))
        gate = self._gate
        if gate is not None:  # the graph now waits for the model: the writer's turn
            self._models += 1
            gate.models += 1
            if gate.waiting:
                gate.open()

    def on_llm_start(self, serialized: Any, prompts: list[str], **kwargs: Any) -> None:
        """A completion-style model (a langchain-core BaseLLM): its prompt strings are recorded as a chat
        model's messages are (a chat model reports through on_chat_model_start instead, as this handler has one).
        Not on any chat model's path, so it shares that callback's body."""
        self.on_chat_model_start(serialized, prompts, **kwargs)

    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        events = self._runs.get(run_id.int)
        if events is not None:
            events.append(("llm_end", run_id.int, None, None, response, time.time(), None))
            if self._models:
                self._models -= 1
                self._gate.models -= 1  # type: ignore[union-attr]  # counted only with a gate

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        events = self._runs.get(run_id.int)
        if events is not None:
            # a stream cut short or failed part way reports what the model had said by then
            events.append(("llm_error", run_id.int, None, None, Raised.of(error), time.time(), kwargs.get("response")))
            if self._models:
                self._models -= 1
                self._gate.models -= 1  # type: ignore[union-attr]  # counted only with a gate

    def on_tool_start(self, serialized: Any, input_str: str, *, run_id: UUID, parent_run_id: UUID | None = None,
                      metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        run, parent = run_id.int, parent_run_id.int if parent_run_id is not None else None
        name = kwargs.get("name") or (serialized or {}).get("name") or "tool"
        events, extra = self._runs.get(parent), (name, kwargs.get("tool_call_id"))
        if events is None:
            events, parent, metadata, extra = self._orphan(run, metadata, extra)
            if events is None:
                return
        self._runs[run] = events
        # the arguments it ran with (langchain passes them as `inputs`, injected ones left out): a reviewer or a
        # middleware may have changed the model's call before it ran
        events.append(("tool_start", run, parent, metadata, kwargs.get("inputs"), time.time(), extra))

    def on_tool_end(self, output: Any, *, run_id: UUID, **kwargs: Any) -> None:
        events = self._runs.get(run_id.int)
        if events is not None:
            events.append(("tool_end", run_id.int, None, None, output, time.time(), None))

    def on_tool_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        events = self._runs.get(run_id.int)
        if events is not None:
            events.append(("tool_error", run_id.int, None, None, Raised.of(error), time.time(), None))

    def _orphan(self, run: int, metadata: Mapping[str, Any] | None,
                extra: Any) -> tuple[list[Event] | None, int | None, Mapping[str, Any] | None, Any]:
        """A run whose parent this collector has not seen: the events it goes in, its parent, metadata and
        start extra. It starts an episode, except in a one-call collector once its call's root is open: then
        a run a node task made with callbacks of its own (it came through the configure hook, with no parent
        this collector knows) joins that task, as a run inside it, and any other is dropped (None)."""
        if self.one_call:
            if self._root_opened:
                return self._inside_task(metadata, extra)
            self._root_opened = True
            if _CALL_COLLECTOR.get() is not self:  # a call not bound by the instrumented graph (stream_events)
                self._context_token = _CALL_COLLECTOR.set(self)
        events, extra = self._open_root(run, metadata, extra)
        return events, None, metadata, extra

    def _inside_task(self, metadata: Mapping[str, Any] | None,
                     extra: Any) -> tuple[list[Event] | None, int | None, Mapping[str, Any] | None, Any]:
        """The open node task a parentless run was made in, found by its checkpoint namespace (its metadata's,
        or, when the caller replaced the metadata, the one LangGraph left in the config), the latest attempt
        first. Rare (a model called with callbacks of its own), so it reads the open events instead of keeping
        an index on every callback."""
        metadata = metadata or {}
        ns = metadata.get("langgraph_checkpoint_ns") or metadata.get("checkpoint_ns")
        if not ns:
            return None, None, None, extra
        # A copy: another thread of the call (a Send fan-out's workers) may open or close runs meanwhile.
        for events in {id(events): events for events in list(self._runs.values())}.values():
            for event in reversed(events):
                # A root run is not a task: an instrumented graph called inside a node of another has the
                # node's namespace, and the node's other runs (its consumer's own calls) are not the graph's.
                if (event[0] == "chain_start" and event[2] is not None and event[3]
                        and event[3].get("langgraph_checkpoint_ns") == ns):
                    if metadata.get("langgraph_checkpoint_ns") != ns:  # the builder reads the task's namespace
                        metadata = {**event[3], **metadata, "langgraph_checkpoint_ns": ns}
                    return events, event[1], metadata, extra
        return None, None, None, extra

    def _open_root(self, run: int, metadata: Mapping[str, Any] | None, extra: Any) -> tuple[list[Event], Any]:
        """A run whose parent this collector has not seen starts an episode: a new event list, and on a thread
        of a checkpointed graph the checkpoint it starts from (then the start event's extra)."""
        events: list[Event] = []
        if self.checkpointer is not None and metadata and metadata.get("thread_id") is not None:
            thread = thread_config(metadata["thread_id"])
            extra = {"checkpoint_id": self.start_checkpoint if self.async_reads else self._checkpoint_id(thread)}
            self._threads[run] = thread
        return events, extra

    def _close_root(self, events: list[Event], kind: str, run: int, payload: Any) -> None:
        """The root run ended: record its end (with the checkpoint it left), forget its runs, build its
        episode. Runs of this root that report after this are dropped, as their episode is already built."""
        thread = self._threads.pop(run, None) if self._threads else None
        extra: dict[str, Any] | None = None
        deferred = thread is not None and self.async_reads
        if deferred:
            extra = {}  # filled in by aend
        elif thread is not None:
            extra = {"checkpoint_id": self._checkpoint_id(thread)}
            if self._asks_where_paused(kind, extra["checkpoint_id"]):
                extra["paused_before"] = self.paused_before({**thread, "checkpoint_id": extra["checkpoint_id"]})
        if self.executor is not None:  # built later, on another thread: what the caller may change is read now
            frozen = freeze(events[0][4], payload) if kind == "chain_end" else freeze(events[0][4])
            extra = {**(extra or {}), "frozen": frozen}
        events.append((kind, run, None, None, payload, time.time(), extra))
        if self._models:  # a model run that never reported its end (a stream left unread) is over with its call
            self._gate.models -= self._models  # type: ignore[union-attr]  # counted only with a gate
            self._models = 0
        if self._context_token is not None:
            token, self._context_token = self._context_token, None
            try:
                _CALL_COLLECTOR.reset(token)
            except ValueError:  # the call ended in another context than it started in: that one ends with it
                pass
        runs = self._runs
        for event in events:
            runs.pop(event[1], None)
        if deferred:
            self._deferred.append((events, thread, kind, extra))  # type: ignore[arg-type]  # dicts when deferred
            return
        self._submit(events)

    def _asks_where_paused(self, kind: str, checkpoint: str | None) -> bool:
        """Whether a root run that ended at `checkpoint` may have stopped at a static breakpoint: see
        `paused_before` and `breakpoints`."""
        return (self.paused_before is not None and (self.breakpoints or self._interrupted) and bool(checkpoint)
                and kind == "chain_end")

    async def astart(self, thread_id: Any) -> None:
        """With `async_reads`, before the call: the checkpoint its run starts from, read with the saver's
        async methods (see `aend`)."""
        try:
            found = await self.checkpointer.aget_tuple({"configurable": thread_config(thread_id)})
        except Exception:  # noqa: BLE001 - bookkeeping must never break the graph
            return
        self.start_checkpoint = _checkpoint_of(found)

    async def aend(self, paused_before: Callable[[dict[str, Any]], Awaitable[list[str]]] | None = None) -> None:
        """With `async_reads`, once the call is over: read the checkpoint its run left (and, with
        `paused_before`, where it paused) with the saver's async methods, then hand the run's events on. The
        events go on whatever the reads do, so the episode is never lost to them."""
        deferred, self._deferred = self._deferred, []
        for events, thread, kind, extra in deferred:
            try:
                checkpoint = _checkpoint_of(await self.checkpointer.aget_tuple({"configurable": thread}))
                extra["checkpoint_id"] = checkpoint
                if paused_before is not None and self._asks_where_paused(kind, checkpoint):
                    extra["paused_before"] = await paused_before({**thread, "checkpoint_id": checkpoint})
            except Exception:  # noqa: BLE001 - bookkeeping must never break the graph
                log.debug("mappa_graph: could not read the checkpoint an async call left", exc_info=True)
            finally:
                self._submit(events)

    def _checkpoint_id(self, thread: dict[str, Any]) -> str | None:
        """The thread's latest checkpoint: read once as a run starts and once as it ends (one lookup each, only
        for runs on a thread of a checkpointed graph). An async-only saver cannot answer from the event loop's
        thread: an instrumented graph's async calls then read with `aend` instead; any other caller's episode
        goes without checkpoint ids rather than slow or break the run."""
        try:
            found = self.checkpointer.get_tuple({"configurable": thread})
        except Exception:  # noqa: BLE001 - bookkeeping must never break the graph
            return None
        return _checkpoint_of(found)

    # ---- building -------------------------------------------------------------------------------------
    def _submit(self, events: list[Event]) -> None:
        if self.executor is None:
            self._build_and_emit(events)
            return
        future = self.executor.submit(self._build_and_emit, events)
        with self._lock:
            self._pending.append(future)

    def _build_and_emit(self, events: list[Event]) -> None:
        """Build the episode and hand it on. The build, the `recorder`, and the last references to the episode
        and to the run's events (the run's messages, states and replies) all fall inside one pause of the
        garbage collector (see courtesy.py): resumed while they were still alive, the collector's first
        allocation set off a collection on this thread that promoted them all. What the recorder returns (a
        store write, which may wait on a lock) and `on_episode` (the user's code) run after the pause."""
        with gc_paused():
            try:
                episode = EpisodeBuilder(self.run, self.agents, self.episode_defaults,
                                         train_failed=self.train_failed).build(events)
            except Exception:
                log.exception("mappa_graph: could not build an episode from its trace events")
                raise
            finally:
                events.clear()  # the list is this build's alone (see _close_root)
            if self.keep_episodes:
                with self._lock:
                    self.episodes.append(episode)
            after = self.recorder(episode) if self.recorder is not None else None
            handed_on = episode if self.on_episode is not None else None
            del episode
        try:
            if after is not None:
                if self._gate is not None:
                    self._gate.pause()  # the store write, too, waits for a model call (see ModelGate)
                after()
        finally:  # a failed store write is raised (by flush), and the user's hook still gets the episode
            if handed_on is not None:
                self.on_episode(handed_on)  # type: ignore[misc]  # set whenever handed_on is

    def wait(self) -> list[Episode]:
        """Block until every ended run's Episode is built and handed on; re-raises a build or store error."""
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            future.result()
        return self.episodes
