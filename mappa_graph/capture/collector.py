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
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler

from ..traces import Episode
from .builder import EpisodeBuilder, Event
from .paths import AgentResolver, AgentsSpec

log = logging.getLogger(__name__)


class TraceCollector(BaseCallbackHandler):
    """Records one Episode per root run it sees.

    `agents` maps node paths (`worker`, `worker/agent`) to agent names, or is a function of the path (default:
    the path's first name, the agent boundary). `on_episode` is called with each finished Episode (the
    instrumented graph uses it to write to the store). Finished episodes are kept in `episodes`; `wait()` returns
    once every ended run's Episode is built (with an executor, building is asynchronous). With the graph's
    `checkpointer`, an episode run on a thread records the checkpoint it started from and the one it left.
    `train_failed` keeps the model calls of failed attempts trainable.
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
        executor: Executor | None = None,
        checkpointer: Any = None,
        train_failed: bool = False,
    ) -> None:
        self.run = run
        self.agents = agents if isinstance(agents, AgentResolver) else AgentResolver(agents)
        self.checkpointer = checkpointer
        self.train_failed = train_failed
        self._threads: dict[int, dict[str, Any]] = {}
        self.on_episode = on_episode
        self.episode_defaults = dict(episode_defaults or {})
        self.executor = executor
        self.episodes: list[Episode] = []
        # Keyed by `UUID.int`: hashing an int is C, hashing a UUID is a Python call, and these lookups run on
        # every callback. The events carry the ints too.
        self._events: dict[int, list[Event]] = {}
        self._root_of: dict[int, int] = {}
        self._pending: list[Future[Episode]] = []
        self._lock = threading.Lock()

    # ---- capture: as little as possible per callback ----------------------------------------------------
    def _start(self, kind: str, run_uuid: UUID, parent_uuid: UUID | None, metadata: Any, payload: Any,
               extra: Any) -> None:
        run_id, parent = run_uuid.int, parent_uuid.int if parent_uuid is not None else None
        root = self._root_of.get(parent) if parent is not None else None
        if root is None:
            root = run_id
            self._events[root] = []
            if self.checkpointer is not None and metadata and metadata.get("thread_id") is not None:
                self._threads[root] = {"thread_id": metadata["thread_id"], "checkpoint_ns": ""}
                extra = {"checkpoint_id": self._checkpoint_id(root)}
        self._root_of[run_id] = root
        self._events[root].append((kind, run_id, parent, metadata, payload, time.time(), extra))

    def _end(self, kind: str, run_uuid: UUID, payload: Any, extra: Any = None) -> None:
        run_id = run_uuid.int
        root = self._root_of.get(run_id)
        if root is None:
            return
        events = self._events[root]
        ended = run_id == root and kind in ("chain_end", "chain_error")
        if ended and root in self._threads:
            extra = {"checkpoint_id": self._checkpoint_id(root)}
            del self._threads[root]
        events.append((kind, run_id, None, None, payload, time.time(), extra))
        if ended:
            del self._events[root]
            for event in events:
                self._root_of.pop(event[1], None)
            self._submit(events)

    def _checkpoint_id(self, root: int) -> str | None:
        """The thread's latest checkpoint: read once as a run starts and once as it ends (one lookup each, only
        for runs on a thread of a checkpointed graph). An async-only saver cannot answer from the event loop's
        thread; the episode then goes without checkpoint ids rather than slow or break the run."""
        try:
            found = self.checkpointer.get_tuple({"configurable": self._threads[root]})
        except Exception:  # noqa: BLE001 - bookkeeping must never break the graph
            return None
        return found.config["configurable"].get("checkpoint_id") if found is not None else None

    def on_chain_start(self, serialized: Any, inputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None,
                       metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self._start("chain_start", run_id, parent_run_id, metadata, inputs, None)

    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._end("chain_end", run_id, outputs)

    def on_chain_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._end("chain_error", run_id, error)

    def on_chat_model_start(self, serialized: Any, messages: Any, *, run_id: UUID, parent_run_id: UUID | None = None,
                            metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self._start("llm_start", run_id, parent_run_id, metadata, messages, kwargs.get("invocation_params"))

    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._end("llm_end", run_id, response)

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._end("llm_error", run_id, error)

    def on_tool_start(self, serialized: Any, input_str: str, *, run_id: UUID, parent_run_id: UUID | None = None,
                      metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        name = kwargs.get("name") or (serialized or {}).get("name") or "tool"
        self._start("tool_start", run_id, parent_run_id, metadata, input_str, (name, kwargs.get("tool_call_id")))

    def on_tool_end(self, output: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._end("tool_end", run_id, output)

    def on_tool_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._end("tool_error", run_id, error)

    # ---- building -------------------------------------------------------------------------------------
    def _submit(self, events: list[Event]) -> None:
        if self.executor is None:
            self._build_and_emit(events)
            return
        future = self.executor.submit(self._build_and_emit, events)
        with self._lock:
            self._pending.append(future)

    def _build_and_emit(self, events: list[Event]) -> Episode:
        try:
            builder = EpisodeBuilder(self.run, self.agents, self.episode_defaults, train_failed=self.train_failed)
            episode = builder.build(events)
        except Exception:
            log.exception("mappa_graph: could not build an episode from its trace events")
            raise
        with self._lock:
            self.episodes.append(episode)
        if self.on_episode is not None:
            self.on_episode(episode)
        return episode

    def wait(self) -> list[Episode]:
        """Block until every ended run's Episode is built and handed on; re-raises a build or store error."""
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            future.result()
        return self.episodes
