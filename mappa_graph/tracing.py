"""TraceCollector: a langchain-core callback handler that turns a LangGraph run into an Episode.

Attribution rides on what LangGraph already puts in every node task's run metadata (`langgraph_node`,
`langgraph_step`, `langgraph_checkpoint_ns`) and that every child run inherits, the same way LangGraph's own
message-streaming handler works. Runs are grouped by their root run, so one collector can watch many episodes
at once (`batch`, `asyncio.gather`) without mixing them. This module never imports torch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import BaseMessage, ToolMessage

from .messages import MAPPA_KEY, content_text, message_to_dict, to_jsonable
from .traces import Action, Episode, ToolCall, ToolResult


@dataclass
class _NodeRun:
    action: Action
    llm_actions: list[Action] = field(default_factory=list)
    tool_results: list[ToolResult] = field(default_factory=list)


@dataclass
class _Open:
    """An episode being recorded: its root run and the runs seen under it so far."""

    episode: Episode
    node_by_ns: dict[str, _NodeRun] = field(default_factory=dict)
    node_by_run: dict[UUID, _NodeRun] = field(default_factory=dict)
    llm_by_run: dict[UUID, Action] = field(default_factory=dict)
    tool_start: dict[UUID, tuple[str | None, str, float, str | None]] = field(default_factory=dict)
    call_owner: dict[str, Action] = field(default_factory=dict)
    order: list[Action] = field(default_factory=list)
    runs: list[UUID] = field(default_factory=list)


class TraceCollector(BaseCallbackHandler):
    """Records one Episode per root run it sees.

    `agents` maps node names to agent names (default: the node's own name). `on_episode` is called with each
    finished Episode (the instrumented graph uses it to write to the store). Finished episodes are also kept
    in `episodes`, and `episode_for(run_id)` finds the one a given root run produced.
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
    ) -> None:
        self.run = run
        self.agents = dict(agents or {})
        self.on_episode = on_episode
        self.episode_defaults = dict(episode_defaults or {})
        self.episodes: list[Episode] = []
        self._by_root: dict[UUID, Episode] = {}
        self._open: dict[UUID, _Open] = {}
        self._root_of: dict[UUID, UUID] = {}
        self._lock = threading.Lock()

    # ---- run bookkeeping -------------------------------------------------------------------------------
    def _enter(self, run_id: UUID, parent_run_id: UUID | None) -> _Open | None:
        root = self._root_of.get(parent_run_id) if parent_run_id is not None else None
        if root is None:
            return None
        self._root_of[run_id] = root
        state = self._open.get(root)
        if state is not None:
            state.runs.append(run_id)
        return state

    def _lookup(self, run_id: UUID) -> _Open | None:
        root = self._root_of.get(run_id)
        return self._open.get(root) if root is not None else None

    def _agent_for(self, node: str) -> str:
        return self.agents.get(node, node)

    def _node_for(self, state: _Open, metadata: Mapping[str, Any] | None) -> _NodeRun | None:
        if not metadata:
            return None
        ns = metadata.get("langgraph_checkpoint_ns")
        return state.node_by_ns.get(ns) if ns is not None else None

    # ---- chains: the graph root and its node tasks ----------------------------------------------------
    def on_chain_start(
        self,
        serialized: dict[str, Any] | None,
        inputs: Any,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        tags: list[str] | None = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        with self._lock:
            state = self._enter(run_id, parent_run_id)
            if state is None:
                if parent_run_id is not None and parent_run_id in self._root_of:
                    return
                self._start_episode(run_id, inputs, metadata)
                return
            if not metadata:
                return
            ns = metadata.get("langgraph_checkpoint_ns")
            node = metadata.get("langgraph_node")
            if ns is None or node is None or ns in state.node_by_ns:
                return
            parent_ns = ns.rsplit("|", 1)[0] if "|" in ns else None
            parent = state.node_by_ns.get(parent_ns) if parent_ns else None
            action = Action(
                episode_id=state.episode.id,
                kind="node",
                node=node,
                agent=self._agent_for(node),
                step=metadata.get("langgraph_step"),
                checkpoint_ns=ns,
                parent_id=parent.action.id if parent else None,
                index=len(state.order),
                node_input=to_jsonable(inputs),
            )
            node_run = _NodeRun(action)
            state.node_by_ns[ns] = node_run
            state.node_by_run[run_id] = node_run
            state.order.append(action)

    def _start_episode(self, run_id: UUID, inputs: Any, metadata: Mapping[str, Any] | None) -> None:
        meta = dict(metadata or {})
        fields = {**self.episode_defaults}
        for key in ("task_id", "reference"):
            if f"mappa_{key}" in meta:
                fields[key] = meta[f"mappa_{key}"]
        episode = Episode(run=self.run, input=to_jsonable(inputs), **fields)
        self._root_of[run_id] = run_id
        self._open[run_id] = _Open(episode)

    def on_chain_end(self, outputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        with self._lock:
            state = self._lookup(run_id)
            if state is None:
                return
            node_run = state.node_by_run.get(run_id)
            if node_run is not None:
                node_run.action.node_output = to_jsonable(outputs)
                node_run.action.latency_s = time.time() - node_run.action.started_at
            if self._root_of.get(run_id) == run_id:
                state.episode.final_state = to_jsonable(outputs)
                episode = self._finish(run_id)
            else:
                return
        self._emit(episode)

    def on_chain_error(
        self, error: BaseException, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        with self._lock:
            state = self._lookup(run_id)
            if state is None:
                return
            node_run = state.node_by_run.get(run_id)
            if node_run is not None:
                node_run.action.error = f"{type(error).__name__}: {error}"
            if self._root_of.get(run_id) != run_id:
                return
            state.episode.error = f"{type(error).__name__}: {error}"
            episode = self._finish(run_id)
        self._emit(episode)

    def _finish(self, root: UUID) -> Episode:
        state = self._open.pop(root)
        for run_id in state.runs:
            self._root_of.pop(run_id, None)
        self._root_of.pop(root, None)
        episode = state.episode
        actions: list[Action] = []
        for action in state.order:
            if action.kind == "node":
                node_run = state.node_by_ns[action.checkpoint_ns or ""]
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
        episode.ended_at = time.time()
        self._by_root[root] = episode
        return episode

    def _emit(self, episode: Episode) -> None:
        self.episodes.append(episode)
        if self.on_episode is not None:
            self.on_episode(episode)

    def episode_for(self, root_run_id: UUID) -> Episode | None:
        return self._by_root.get(root_run_id)

    # ---- chat model calls ---------------------------------------------------------------------------
    def on_chat_model_start(
        self,
        serialized: dict[str, Any] | None,
        messages: list[list[BaseMessage]],
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        tags: list[str] | None = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        with self._lock:
            state = self._enter(run_id, parent_run_id)
            if state is None:
                return
            node_run = self._node_for(state, metadata)
            node = node_run.action.node if node_run else (metadata or {}).get("langgraph_node", "?")
            params = kwargs.get("invocation_params") or {}
            action = Action(
                episode_id=state.episode.id,
                kind="llm",
                node=node,
                agent=self._agent_for(node),
                step=(metadata or {}).get("langgraph_step"),
                checkpoint_ns=(metadata or {}).get("langgraph_checkpoint_ns"),
                parent_id=node_run.action.parent_id if node_run else None,
                index=len(state.order),
                input_messages=[message_to_dict(m) for m in (messages[0] if messages else [])],
                model=params.get("model") or params.get("model_name") or (metadata or {}).get("ls_model_name"),
            )
            state.llm_by_run[run_id] = action
            state.order.append(action)
            if node_run is not None:
                node_run.llm_actions.append(action)

    def on_llm_end(self, response: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        with self._lock:
            state = self._lookup(run_id)
            if state is None:
                return
            action = state.llm_by_run.get(run_id)
            if action is None:
                return
            action.latency_s = time.time() - action.started_at
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
                    state.call_owner[call["id"]] = action
            _copy_token_record(action, getattr(message, "response_metadata", None) or {})

    def on_llm_error(
        self, error: BaseException, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        with self._lock:
            state = self._lookup(run_id)
            action = state.llm_by_run.get(run_id) if state else None
            if action is not None:
                action.error = f"{type(error).__name__}: {error}"

    # ---- tools ------------------------------------------------------------------------------------------
    def on_tool_start(
        self,
        serialized: dict[str, Any] | None,
        input_str: str,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        with self._lock:
            state = self._enter(run_id, parent_run_id)
            if state is None:
                return
            name = kwargs.get("name") or (serialized or {}).get("name") or "tool"
            ns = (metadata or {}).get("langgraph_checkpoint_ns")
            state.tool_start[run_id] = (kwargs.get("tool_call_id"), name, time.time(), ns)

    def on_tool_end(self, output: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        with self._lock:
            self._tool_done(run_id, output, None)

    def on_tool_error(
        self, error: BaseException, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        with self._lock:
            self._tool_done(run_id, None, f"{type(error).__name__}: {error}")

    def _tool_done(self, run_id: UUID, output: Any, error: str | None) -> None:
        state = self._lookup(run_id)
        if state is None or run_id not in state.tool_start:
            return
        call_id, name, started, ns = state.tool_start.pop(run_id)
        if isinstance(output, ToolMessage):
            call_id = call_id or output.tool_call_id
            if output.status == "error" and error is None:
                error = content_text(output.content)
            text = content_text(output.content)
        else:
            text = "" if output is None else content_text(output) if isinstance(output, (str, list)) else str(output)
        result = ToolResult(tool_call_id=call_id, name=name, output=text, error=error, latency_s=time.time() - started)
        node_run = state.node_by_ns.get(ns) if ns is not None else None
        if node_run is not None:
            node_run.tool_results.append(result)
        # The LLM action that asked for this call also gets its result: the judge scores a tool call by it.
        owner = state.call_owner.get(call_id) if call_id else None
        if owner is not None:
            owner.tool_results.append(result)


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
