"""TraceCollector: a langchain-core callback handler that turns a LangGraph run into an Episode.

Attribution rides on what LangGraph already puts in every node task's run metadata (`langgraph_node`,
`langgraph_step`, `langgraph_checkpoint_ns`) and that every child run inherits, the same way LangGraph's own
message-streaming handler works. Runs are grouped by their root run, so one collector can watch many episodes
at once (`batch`, `asyncio.gather`) without mixing them.

The callbacks sit on the graph's hot path, so they only append the raw event to their root's list; the
Episode is built from those events when the root run ends, on an executor when one is given (the
instrumented graph uses a background thread, so building and storing overlap the next model call). This
module never imports torch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import ToolMessage

from ..messages import MAPPA_KEY, content_text, message_to_dict, to_jsonable
from ..traces import Action, Episode, ToolCall, ToolResult

log = logging.getLogger(__name__)

# (kind, run_id, parent_run_id, metadata, payload, time, extra)
Event = tuple[str, UUID, UUID | None, Mapping[str, Any] | None, Any, float, Mapping[str, Any]]


class TraceCollector(BaseCallbackHandler):
    """Records one Episode per root run it sees.

    `agents` maps node names to agent names (default: the node's own name). `on_episode` is called with each
    finished Episode (the instrumented graph uses it to write to the store). Finished episodes are kept in
    `episodes`; `wait()` returns once every ended run's Episode is built (with an executor, building is
    asynchronous).
    """

    # Ordering matters (a node's start must be seen before its model call), so run in the caller's thread
    # even under asyncio instead of being pushed to an executor.
    run_inline = True
    raise_error = False

    def __init__(
        self,
        *,
        run: str = "default",
        agents: Mapping[str, str] | None = None,
        on_episode: Callable[[Episode], None] | None = None,
        episode_defaults: Mapping[str, Any] | None = None,
        executor: Executor | None = None,
    ) -> None:
        self.run = run
        self.agents = dict(agents or {})
        self.on_episode = on_episode
        self.episode_defaults = dict(episode_defaults or {})
        self.executor = executor
        self.episodes: list[Episode] = []
        self._events: dict[UUID, list[Event]] = {}
        self._root_of: dict[UUID, UUID] = {}
        self._pending: list[Future[Episode]] = []
        self._lock = threading.Lock()

    # ---- capture: as little as possible per callback ----------------------------------------------------
    def _start(self, kind: str, run_id: UUID, parent: UUID | None, metadata: Any, payload: Any, extra: Any) -> None:
        root = self._root_of.get(parent) if parent is not None else None
        if root is None:
            root = run_id
            self._events[root] = []
        self._root_of[run_id] = root
        self._events[root].append((kind, run_id, parent, metadata, payload, time.time(), extra))

    def _end(self, kind: str, run_id: UUID, payload: Any, extra: Any = None) -> None:
        root = self._root_of.get(run_id)
        if root is None:
            return
        events = self._events[root]
        events.append((kind, run_id, None, None, payload, time.time(), extra))
        if run_id == root and kind in ("chain_end", "chain_error"):
            del self._events[root]
            for event in events:
                self._root_of.pop(event[1], None)
            self._submit(events)

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
            episode = EpisodeBuilder(self.run, self.agents, self.episode_defaults).build(events)
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


@dataclass
class _NodeRun:
    action: Action
    llm_actions: list[Action] = field(default_factory=list)
    tool_results: list[ToolResult] = field(default_factory=list)


class EpisodeBuilder:
    """Replays one root run's events into an Episode: node turns, model calls, tool calls and results."""

    def __init__(self, run: str, agents: Mapping[str, str], defaults: Mapping[str, Any]) -> None:
        self.run, self.agents, self.defaults = run, agents, defaults
        self.node_by_ns: dict[str, _NodeRun] = {}
        self.node_by_run: dict[UUID, _NodeRun] = {}
        self.llm_by_run: dict[UUID, Action] = {}
        self.tool_by_run: dict[UUID, tuple[str, str | None, float, str | None]] = {}
        self.call_owner: dict[str, Action] = {}
        self.order: list[Action] = []
        self.episode: Episode | None = None

    def build(self, events: Sequence[Event]) -> Episode:
        for kind, run_id, parent, metadata, payload, at, extra in events:
            getattr(self, f"_{kind}")(run_id, parent, metadata or {}, payload, at, extra)
        assert self.episode is not None
        return self._finish()

    def _agent(self, node: str) -> str:
        return self.agents.get(node, node)

    def _chain_start(self, run_id: UUID, parent: UUID | None, meta: Mapping[str, Any], inputs: Any, at: float, _: Any) -> None:
        if self.episode is None:
            fields = dict(self.defaults)
            for key in ("task_id", "reference"):
                if f"mappa_{key}" in meta:
                    fields[key] = meta[f"mappa_{key}"]
            if "mappa_episode_metadata" in meta:
                fields["metadata"] = dict(meta["mappa_episode_metadata"])
            self.episode = Episode(run=self.run, input=to_jsonable(inputs), started_at=at, **fields)
            self.root = run_id
            return
        ns, node = meta.get("langgraph_checkpoint_ns"), meta.get("langgraph_node")
        if ns is None or node is None or ns in self.node_by_ns:
            return  # not a node task's own run (a router, a writer inside the task)
        parent_ns = ns.rsplit("|", 1)[0] if "|" in ns else None
        parent_node = self.node_by_ns.get(parent_ns) if parent_ns else None
        action = Action(
            episode_id=self.episode.id,
            kind="node",
            node=node,
            agent=self._agent(node),
            step=meta.get("langgraph_step"),
            checkpoint_ns=ns,
            parent_id=parent_node.action.id if parent_node else None,
            node_input=to_jsonable(inputs),
            started_at=at,
        )
        self.node_by_ns[ns] = self.node_by_run[run_id] = _NodeRun(action)
        self.order.append(action)

    def _chain_end(self, run_id: UUID, parent: Any, meta: Any, outputs: Any, at: float, _: Any) -> None:
        node_run = self.node_by_run.get(run_id)
        if node_run is not None:
            node_run.action.node_output = to_jsonable(outputs)
            node_run.action.latency_s = at - node_run.action.started_at
        if run_id == self.root:
            self.episode.final_state = to_jsonable(outputs)
            self.episode.ended_at = at

    def _chain_error(self, run_id: UUID, parent: Any, meta: Any, error: BaseException, at: float, _: Any) -> None:
        node_run = self.node_by_run.get(run_id)
        if node_run is not None:
            node_run.action.error = f"{type(error).__name__}: {error}"
        if run_id == self.root:
            self.episode.error = f"{type(error).__name__}: {error}"
            self.episode.ended_at = at

    def _llm_start(self, run_id: UUID, parent: Any, meta: Mapping[str, Any], messages: Any, at: float, params: Any) -> None:
        node_run = self.node_by_ns.get(meta.get("langgraph_checkpoint_ns", ""))
        node = node_run.action.node if node_run else meta.get("langgraph_node", "?")
        params = params or {}
        action = Action(
            episode_id=self.episode.id,
            kind="llm",
            node=node,
            agent=self._agent(node),
            step=meta.get("langgraph_step"),
            checkpoint_ns=meta.get("langgraph_checkpoint_ns"),
            parent_id=node_run.action.parent_id if node_run else None,
            input_messages=[message_to_dict(m) for m in (messages[0] if messages else [])],
            model=params.get("model") or params.get("model_name") or meta.get("ls_model_name"),
            started_at=at,
        )
        self.llm_by_run[run_id] = action
        self.order.append(action)
        if node_run is not None:
            node_run.llm_actions.append(action)

    def _llm_end(self, run_id: UUID, parent: Any, meta: Any, response: Any, at: float, _: Any) -> None:
        action = self.llm_by_run.get(run_id)
        if action is None:
            return
        action.latency_s = at - action.started_at
        generations = response.generations[0] if response.generations else []
        if not generations:
            return
        message = getattr(generations[0], "message", None)
        if message is None:
            action.output_message = {"role": "assistant", "content": getattr(generations[0], "text", "")}
            return
        action.output_message = message_to_dict(message)
        for call in action.output_message.get("tool_calls", []):
            action.tool_calls.append(ToolCall(id=call.get("id"), name=call["name"], args=call.get("args", {})))
            if call.get("id"):
                self.call_owner[call["id"]] = action
        _copy_token_record(action, getattr(message, "response_metadata", None) or {})

    def _llm_error(self, run_id: UUID, parent: Any, meta: Any, error: BaseException, at: float, _: Any) -> None:
        action = self.llm_by_run.get(run_id)
        if action is not None:
            action.error = f"{type(error).__name__}: {error}"
            action.latency_s = at - action.started_at

    def _tool_start(self, run_id: UUID, parent: Any, meta: Mapping[str, Any], _input: Any, at: float, extra: Any) -> None:
        name, call_id = extra
        self.tool_by_run[run_id] = (name, call_id, at, meta.get("langgraph_checkpoint_ns"))

    def _tool_end(self, run_id: UUID, parent: Any, meta: Any, output: Any, at: float, _: Any) -> None:
        self._tool_done(run_id, output, None, at)

    def _tool_error(self, run_id: UUID, parent: Any, meta: Any, error: BaseException, at: float, _: Any) -> None:
        self._tool_done(run_id, None, f"{type(error).__name__}: {error}", at)

    def _tool_done(self, run_id: UUID, output: Any, error: str | None, at: float) -> None:
        if run_id not in self.tool_by_run:
            return
        name, call_id, started, ns = self.tool_by_run.pop(run_id)
        if isinstance(output, ToolMessage):
            call_id = call_id or output.tool_call_id
            text = content_text(output.content)
            if output.status == "error" and error is None:
                error = text
        else:
            text = "" if output is None else content_text(output) if isinstance(output, (str, list)) else str(output)
        result = ToolResult(tool_call_id=call_id, name=name, output=text, error=error, latency_s=at - started)
        node_run = self.node_by_ns.get(ns) if ns is not None else None
        if node_run is not None:
            node_run.tool_results.append(result)
        # The LLM action that asked for this call also gets its result: the judge scores a tool call by it.
        owner = self.call_owner.get(call_id) if call_id else None
        if owner is not None:
            owner.tool_results.append(result)

    def _finish(self) -> Episode:
        episode = self.episode
        actions: list[Action] = []
        for action in self.order:
            if action.kind == "node":
                node_run = self.node_by_ns[action.checkpoint_ns or ""]
                action.tool_results = node_run.tool_results
                # A node whose model calls are recorded needs no separate node action; one with none (a
                # ToolNode, a router, plain code) still shows, so the judge sees the whole team's work.
                if node_run.llm_actions:
                    for llm_action in node_run.llm_actions:
                        llm_action.node_output = action.node_output
                    continue
            actions.append(action)
        for i, action in enumerate(actions):
            action.index = i
        episode.actions = actions
        return episode


def _copy_token_record(action: Action, response_metadata: Mapping[str, Any]) -> None:
    """Take the token ids and behaviour log-probs a backend reported (local policy or vLLM) onto the Action."""
    record = response_metadata.get(MAPPA_KEY)
    if not isinstance(record, Mapping):
        return
    action.prompt_token_ids = _ints(record.get("prompt_token_ids"))
    action.output_token_ids = _ints(record.get("output_token_ids"))
    logprobs = record.get("output_logprobs")
    action.output_logprobs = [float(x) for x in logprobs] if logprobs is not None else None
    action.token_source = record.get("token_source")
    if record.get("agent"):
        # The call went to this agent's adapter: that is where its gradient belongs.
        action.agent = str(record["agent"])
    action.adapter = record.get("adapter")
    action.model = record.get("model") or action.model


def _ints(values: Sequence[Any] | None) -> list[int] | None:
    return [int(v) for v in values] if values is not None else None
