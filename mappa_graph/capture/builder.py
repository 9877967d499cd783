"""EpisodeBuilder: replays one root run's callback events into an Episode.

A node task's own run is the first chain run with a new checkpoint namespace below its parent's; the runs inside
it (the node's function, prompts, routers, parsers) share its namespace. A RetryPolicy reruns the task under the
same namespace: each rerun is another attempt, its own action. LangGraph's control flow arrives as exceptions
(`ParentCommand` for a handoff to the parent graph, `GraphInterrupt` for `interrupt()`): they are recorded as what
the node did, never as its error. Actions are ordered by where they ran (step and task path at each graph level),
not by when their callbacks fired, so parallel branches (`Send`, a batch of tools) give the same episode every
time and the judge's cache keys stay stable. Builds off the graph's hot path; never imports torch, and imports
langgraph only when it runs (importing mappa_graph.capture stays light).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from langchain_core.messages import BaseMessage, ToolMessage

from ..messages import JSON_SCALARS, MAPPA_KEY, content_text, copy_json, message_to_dict, to_jsonable
from ..traces import Action, Episode, ToolCall, ToolResult
from .courtesy import yield_gil
from .paths import START_NODE, AgentResolver, enclosing_ns, is_internal, node_path

# (kind, run_id, parent_run_id, metadata, payload, time, extra); run ids as `UUID.int` (cheap to hash)
Event = tuple[str, int, "int | None", "Mapping[str, Any] | None", Any, float, Any]


class Raised(NamedTuple):
    """An error event's payload: what the build reads of an exception, without the exception. An exception
    holds its traceback, whose frames hold the run's state, config and callbacks, and LangGraph raises one for
    every handoff; kept in the events until the build, those frames outlived the garbage collector's young
    generation and were walked again in the next (a supervisor team's generation-1 collections took 71 ms per
    256 runs traced, 14 untraced; 31 with this record)."""

    type: type[BaseException]
    args: tuple[Any, ...]
    text: str  # str(error); empty for LangGraph's control flow (a handoff, an interrupt), never shown

    @classmethod
    def of(cls, error: BaseException) -> Raised:
        from langgraph.errors import GraphInterrupt, ParentCommand

        if isinstance(error, (GraphInterrupt, ParentCommand)):
            return cls(type(error), error.args, "")
        try:
            text = str(error)
        except Exception:  # noqa: BLE001 - an error that cannot say what it is still ends its run's record
            text = f"<{type(error).__name__} whose str() raised>"
        return cls(type(error), error.args, text)

# events replayed between two yields of the GIL on the background writer (see courtesy.py): measured on the
# 3-node benchmark graph, every 4 cost the graph least (every event: more switches than the graph gains)
_YIELD_EVERY = 4

Frozen = dict[int, tuple[Any, Any]]  # id(obj) -> (obj, its JSON as the call returned)


def freeze(*values: Any) -> Frozen:
    """What a call's caller can reach once it returns (its input and its output, and every message, dict and
    list inside them), converted on the calling thread as the call ends. The episode is built later, on the
    writer thread: read then, an output the caller had edited in place (a reply's text, a chat loop appending
    its next turn to the returned messages) was recorded edited, and one the caller was still filling made
    the build fail ("dictionary changed size during iteration") and the episode was lost. The builder takes
    these objects, wherever they recur (node inputs and outputs, model replies), from here instead."""
    memo: Frozen = {}
    for value in values:
        _freeze(value, memo, 0)
    return memo


def _freeze(value: Any, memo: Frozen, depth: int) -> Any:
    """`value` as JSON, each container and message converted once (`memo`). It runs on the graph's thread, so
    the scalars and messages inside a container are handled in place, not by another call of this function."""
    kind = type(value)
    if kind in JSON_SCALARS:
        return value
    found = memo.get(id(value))
    if found is not None and found[0] is value:
        return found[1]
    if isinstance(value, BaseMessage):
        converted: Any = _message_frozen(value)
    elif kind is dict and depth < 32:
        converted = {str(k): v if type(v) in JSON_SCALARS else _freeze(v, memo, depth + 1)
                     for k, v in value.items()}
    elif (kind is list or kind is tuple) and depth < 32:
        converted = []
        for item in value:
            if type(item) in JSON_SCALARS:
                converted.append(item)
            elif isinstance(item, BaseMessage) and id(item) not in memo:
                message = _message_frozen(item)
                memo[id(item)] = (item, message)
                converted.append(message)
            else:
                converted.append(_freeze(item, memo, depth + 1))
    else:
        converted = to_jsonable(value)  # new JSON: a pydantic model's dump, a dataclass's fields, a repr
    memo[id(value)] = (value, converted)
    return converted


def _message_frozen(message: BaseMessage) -> dict[str, Any]:
    """A message's dict sharing nothing the app can edit: `message_to_dict` makes new dicts for it and its
    tool calls, so only its content blocks and each call's arguments are copied (most messages have neither:
    a whole-dict copy of each was a quarter of this hot-path freeze)."""
    converted = message_to_dict(message)
    if type(converted["content"]) is not str:
        converted["content"] = copy_json(converted["content"])
    for call in converted.get("tool_calls", ()):
        call["args"] = copy_json(call["args"])
    return converted


_LAST = ((9, ""),)  # sorts after every task path: a model call made outside any node task, after the step


class _ToolRun(NamedTuple):
    """A tool call, as the runs inside it (its chains, the graphs it runs) see it."""

    name: str
    place: int | None  # among the tool calls of the model call that asked for it
    asked_by: str | None  # that model call's action id
    task_ns: str | None  # the node task that ran the tool


class _Router(NamedTuple):
    """A conditional START edge's router task, as a model call made in it is recorded."""

    outer: _NodeRun | None  # the node task whose graph it routes; None at the top
    path: tuple[str, ...]
    agent: str
    step: int
    task_path: tuple[Any, ...]


@dataclass
class _NodeRun:
    action: Action
    key: tuple[Any, ...]
    parent: _NodeRun | None = None
    children: list[_NodeRun] = field(default_factory=list)
    llm_actions: list[Action] = field(default_factory=list)
    tool_results: list[ToolResult] = field(default_factory=list)
    # What ran inside this task, in the order it started: its own model calls, and runs of tasks that
    # share a graph loop and a step (a Send fan-out, parallel branches, `@task`s called together).
    seq: int = 0
    last_group: tuple[str, str, int] | None = None
    tool_batches: dict[str, int] = field(default_factory=dict)  # the asking model call's id -> its place here
    # The node's input as LangGraph passed it: converted to JSON only if the node's own action is kept (one
    # with model calls or inner nodes is folded into them), so the whole state is not copied per node.
    raw_input: Any = None
    path: tuple[str, ...] = ()
    boundary: str = ""  # the agent by default: see paths.py


class EpisodeBuilder:
    """Replays one root run's events into an Episode: node turns, attempts, model calls, tool calls, handoffs
    and interrupts. `train_failed` marks the model calls of failed attempts as trainable anyway."""

    def __init__(
        self,
        run: str,
        agents: AgentResolver,
        defaults: Mapping[str, Any],
        *,
        train_failed: bool = False,
    ) -> None:
        from langgraph.errors import GraphInterrupt, ParentCommand
        from langgraph.types import Command, Send

        self._interrupt_type, self._handoff_type, self._command_type, self._send_type = (
            GraphInterrupt, ParentCommand, Command, Send)
        self.run, self.agents, self.defaults, self.train_failed = run, agents, defaults, train_failed
        self.ns_of_run: dict[int, str | None] = {}
        self.node_by_ns: dict[str, _NodeRun] = {}  # the latest attempt of each task
        self.node_by_run: dict[int, _NodeRun] = {}
        self.attempts: dict[str, int] = {}
        self.llm_by_run: dict[int, tuple[Action, tuple[Any, ...]]] = {}
        self.tool_by_run: dict[int, tuple[str, str | None, float, str | None, int | None, ToolCall | None]] = {}
        # A result's place among the calls of the model call that asked (by id() of the ToolResult): results
        # go in the order the model asked, not the order parallel tools finished in
        self.result_place: dict[int, int] = {}
        # Runs inside a tool call: its own run, and the chains and graph runs it starts. A graph a tool runs
        # is a boundary of its own.
        self.tool_of_run: dict[int, _ToolRun] = {}
        self.call_owner: dict[str, Action] = {}  # by tool call id: the model call that asked, the latest
        # ... and by where it was made, ("task" or "graph", namespace, id): a model that numbers its calls per
        # conversation gives each branch of a Send fan-out the same ids, and each branch's tools (run by the
        # same task, or by a ToolNode of the same graph run) answer its own model call
        self.call_owner_in: dict[tuple[str, str | None, str], Action] = {}
        # The model call whose reply (by message id: langchain gives each reply its run's) asked for tool calls:
        # a tool task given that message has its owner, even where parallel branches' models reuse call ids
        self.owner_of_message: dict[str, Action] = {}
        self.order: list[tuple[tuple[Any, ...], Action]] = []
        self.node_of_action: dict[str, _NodeRun] = {}
        self.interrupts: dict[str, Any] = {}  # by interrupt id: one interrupt bubbles through every level
        # The `__start__` tasks that route a conditional START edge, by namespace: a model call in the router
        # (an LLM intent router) is still a turn, of the node whose graph it routes, or of the graph at the top.
        self.routers: dict[str, _Router] = {}
        self.failed: list[tuple[_NodeRun, int, str]] = []  # failed node tasks: (task, its attempt, the error)
        self.root_seq = 0
        self.paused = False  # a top-level task raised GraphInterrupt: the run paused
        self.root_last_step = -1
        self.episode: Episode | None = None
        self.root: int | None = None
        self.root_ns: str | None = None
        # Each message converted once: a run's messages recur in every later model call's input, in node
        # outputs and in the final state (a supervisor run converted each about nine times). Keyed by id():
        # the events hold every message alive until the build ends. Each use gets its own copy, nested parts
        # too (tool calls, content blocks): an edit to one action's copy never reaches another's, or the app's.
        # Most messages are flat (string content, no tool calls): their copy is one C-level dict copy.
        self._message_dicts: dict[int, tuple[dict[str, Any], bool]] = {}
        self._frozen: Frozen | None = None

    def _message(self, message: Any) -> dict[str, Any]:
        found = self._message_dicts.get(id(message))
        if found is None:
            frozen = self._frozen.get(id(message)) if self._frozen else None
            converted = frozen[1] if frozen is not None and frozen[0] is message else message_to_dict(message)
            nested = any(type(v) not in JSON_SCALARS for v in converted.values())
            found = self._message_dicts[id(message)] = (converted, nested)
        return copy_json(found[0]) if found[1] else dict(found[0])

    def _jsonable(self, value: Any) -> Any:
        return to_jsonable(value, message=self._message, memo=self._frozen)

    def build(self, events: Sequence[Event]) -> Episode:
        last = events[-1][6] if events else None  # the root's end: what its caller got, frozen (see freeze)
        self._frozen = last.get("frozen") if isinstance(last, dict) else None
        for i, (kind, run_id, parent, metadata, payload, at, extra) in enumerate(events):
            getattr(self, f"_{kind}")(run_id, parent, metadata or {}, payload, at, extra)
            if i % _YIELD_EVERY == _YIELD_EVERY - 1:
                yield_gil()
        assert self.episode is not None
        try:
            return self._finish()
        finally:
            # A task and its inner tasks point at each other: unlinked, the whole tree (its actions and their
            # messages) is freed now, not left as cyclic garbage for the garbage collector to find (some 300
            # objects per run of a supervisor team).
            for node_run in self.node_of_action.values():
                node_run.parent, node_run.children = None, []

    # ---- chains: the root run and node tasks ----------------------------------------------------------------
    def _chain_start(self, run_id: int, parent: int | None, meta: Mapping[str, Any], inputs: Any, at: float,
                     extra: Any) -> None:
        if self.episode is None:
            self._root_start(run_id, meta, inputs, at, extra)
            return
        ns, node = meta.get("langgraph_checkpoint_ns"), meta.get("langgraph_node")
        parent_ns = self.ns_of_run.get(parent, ns) if parent is not None else None
        self.ns_of_run[run_id] = ns if ns is not None else parent_ns
        tool = self.tool_of_run.get(parent) if self.tool_of_run and parent is not None else None
        if ns is None or node is None or ns == parent_ns or ns == self.root_ns:
            if tool is not None:  # a chain or a graph run inside a tool call: still that call's
                self.tool_of_run[run_id] = tool
            return  # a run inside a node task (its function, a prompt, a router, a parser, a tool's chain)
        path = node_path(ns, self.root_ns)
        outer_ns = enclosing_ns(ns)
        outer = self.node_by_ns.get(outer_ns) if outer_ns is not None else None
        if outer is None and outer_ns is not None and parent_ns is not None:
            # A subgraph compiled with checkpointer=True (its own memory on the thread) names its tasks under
            # its node's name with no task id (`researcher|agent:<id>`): its task is the one its run started in.
            enclosing = self.node_by_ns.get(parent_ns)
            if enclosing is not None and node_path(parent_ns) == node_path(outer_ns):
                outer = enclosing
        if outer is None and tool is not None and tool.task_ns is not None:
            # A graph a tool ran with a config of its own (its own thread_id) starts LangGraph's namespace
            # afresh: it still belongs under the task that ran the tool.
            outer = self.node_by_ns.get(tool.task_ns)
        if is_internal(path):
            if path[-1] == START_NODE:
                self._router_start(ns, meta, outer, tool)
            return
        attempt = self.attempts[ns] = self.attempts.get(ns, 0) + 1
        step = meta.get("langgraph_step")
        self.root_seq += 1  # the last tie-break only: same step, same task path, same attempt
        element = (_step(step), _path_key(meta.get("langgraph_path")), attempt, self.root_seq)
        if outer is None:
            key = (element,)
            boundary = path[0]
        elif tool is not None:
            # A graph a tool call runs: its path takes the tool's name. One model call's tool calls take one
            # place in this task (after that call, when the task made it itself) and go by their place among
            # its calls, as they run side by side; a call no model asked for goes by when it started.
            path = (*outer.path, tool.name, path[-1])
            boundary = tool.name if outer.parent is None else outer.boundary
            outer.last_group = None
            batch = outer.tool_batches.get(tool.asked_by) if tool.asked_by is not None else None
            if batch is None:
                outer.seq += 1
                batch = outer.seq
                if tool.asked_by is not None:
                    outer.tool_batches[tool.asked_by] = batch
            position = (batch, tool.place if tool.place is not None else 0)
        else:
            path, boundary = (*outer.path, path[-1]), outer.boundary
            # Inside a node task things keep the order they started in (a task's body runs in sequence: a
            # loop over `sub.invoke`, two agents in turn, an agent then a `@task`), except that the tasks of
            # one step of one graph loop run side by side and go by task path as above. A loop is known by its
            # namespace with its run counter (`team:<id>|2`) and by the one LangGraph reports as the loop's
            # (a `@task` an entrypoint pushes and an agent the entrypoint runs share the first). The tasks
            # inside a retried task's run are its attempt's.
            group = (ns.rsplit("|", 1)[0], meta.get("checkpoint_ns") or "", _step(step))
            if outer.last_group != group:
                outer.seq += 1
                outer.last_group = group
            position = (outer.seq, 0)
        if outer is not None:
            key = outer.key + ((position, *element),)
            attempt = max(attempt, outer.action.attempt)
        action = Action(
            episode_id=self.episode.id,
            kind="node",
            node=path[-1],
            agent=self.agents(path, boundary),
            path="/".join(path),
            attempt=attempt,
            cached=extra == "cached",
            train_failed=self.train_failed,
            step=step,
            checkpoint_ns=ns,
            parent_id=outer.action.id if outer else None,
            started_at=at,
        )
        node_run = _NodeRun(action, key, outer, raw_input=inputs, path=path, boundary=boundary)
        if outer is not None:
            outer.children.append(node_run)
        else:
            self.root_last_step = max(self.root_last_step, _step(step))
        self.node_by_ns[ns] = self.node_by_run[run_id] = self.node_of_action[action.id] = node_run
        self.order.append((key, action))

    def _router_start(self, ns: str, meta: Mapping[str, Any], outer: _NodeRun | None, tool: _ToolRun | None) -> None:
        """A conditional START edge's router task: where a model call in it belongs. Under a node task, that
        task's (its path with `__start__` added, the tool's name between for a graph a tool runs); at the top,
        the instrumented graph's own `__start__`, in the step it ran."""
        if outer is None:
            path, boundary = (START_NODE,), START_NODE
        elif tool is not None:
            path = (*outer.path, tool.name, START_NODE)
            boundary = tool.name if outer.parent is None else outer.boundary
        else:
            path, boundary = (*outer.path, START_NODE), outer.boundary
        self.routers[ns] = _Router(outer, path, self.agents(path, boundary), _step(meta.get("langgraph_step")),
                                   _path_key(meta.get("langgraph_path")))

    def _root_start(self, run_id: int, meta: Mapping[str, Any], inputs: Any, at: float, extra: Any) -> None:
        fields = dict(self.defaults)
        for key in ("task_id", "reference"):
            if f"mappa_{key}" in meta:
                fields[key] = meta[f"mappa_{key}"]
        metadata = dict(fields.pop("metadata", None) or {})
        metadata.update(meta.get("mappa_episode_metadata") or {})
        if meta.get("thread_id") is not None:
            metadata["thread_id"] = str(meta["thread_id"])
        if meta.get("checkpoint_ns"):
            metadata["checkpoint_ns"] = meta["checkpoint_ns"]
        start = meta.get("checkpoint_id") or (extra or {}).get("checkpoint_id")
        if start:
            metadata["start_checkpoint_id"] = start
        if isinstance(inputs, self._command_type) and inputs.resume is not None:
            metadata["resumed"] = True
        self.episode = Episode(run=self.run, input=self._jsonable(inputs), started_at=at, metadata=metadata, **fields)
        self.root = run_id
        self.root_ns = meta.get("langgraph_checkpoint_ns")
        self.ns_of_run[run_id] = self.root_ns

    def _chain_end(self, run_id: int, parent: Any, meta: Any, outputs: Any, at: float, extra: Any) -> None:
        node_run = self.node_by_run.get(run_id)
        if node_run is not None:
            action = node_run.action
            action.latency_s = at - action.started_at
            commands = self._commands(outputs)
            if commands:  # a node that routes by returning Command(goto=...), or a list of them (a ToolNode)
                action.handoff = [target for command in commands for target in self._targets(command)] or None
            action.node_output = self._output(outputs)
            self._told(node_run, outputs, commands)
            if any(getattr(m, "type", None) == "remove" for m in _messages_of(outputs, commands)):
                _say_what_is_removed(action.node_output, _messages_of(node_run.raw_input, []), self._message)
        if run_id == self.root:
            self.episode.final_state = self._jsonable(outputs)
            self._root_end(at, extra)

    def _chain_error(self, run_id: int, parent: Any, meta: Any, error: Raised, at: float, extra: Any) -> None:
        node_run = self.node_by_run.get(run_id)
        if node_run is not None:
            action = node_run.action
            action.latency_s = at - action.started_at
            if issubclass(error.type, self._handoff_type):
                command = error.args[0]
                action.handoff = self._targets(command)
                action.node_output = self._output(command)
            elif issubclass(error.type, self._interrupt_type):
                action.status = "interrupted"
                # A task of this graph that raised it paused the run, even with no value to show: a subgraph's
                # static breakpoint (the checkpoint's next task, when it can be read, is `paused_before`)
                self.paused = self.paused or node_run.parent is None
                action.node_output = {"interrupts": self._interrupts(error)}
                self._mark(node_run, "interrupted", None, inner=False)
            else:
                action.status, action.error = "error", _describe(error)
                self.failed.append((node_run, self.attempts.get(action.checkpoint_ns or "", 1), action.error))
        if run_id == self.root:
            if issubclass(error.type, self._interrupt_type):  # no checkpointer: the interrupt reaches the caller
                self._interrupts(error)
            else:
                self.episode.status, self.episode.error = "error", _describe(error)
            self._root_end(at, extra)

    def _root_end(self, at: float, extra: Any) -> None:
        self.episode.ended_at = at
        if (extra or {}).get("checkpoint_id"):
            self.episode.metadata["end_checkpoint_id"] = extra["checkpoint_id"]
        if (extra or {}).get("paused_before"):  # a static breakpoint: paused like interrupt(), with no value
            self.episode.metadata["paused_before"] = list(extra["paused_before"])

    def _mark_failed(self) -> None:
        """A node task that failed and was retried takes every model call made inside it along, its inner
        nodes' included: they are what the retry threw away. One that failed for good (no retry, or its last
        attempt) ended the run: only the calls it made itself are marked; inner nodes that had finished keep
        their status, as the same nodes do at the top level."""
        for node_run, attempt, error in self.failed:
            retried = self.attempts.get(node_run.action.checkpoint_ns or "", 0) > attempt
            self._mark(node_run, "error", error, inner=retried)

    def _mark(self, node_run: _NodeRun, status: str, error: str | None, *, inner: bool = True) -> None:
        """Mark the model calls made inside a node task (and with `inner`, its inner nodes' and theirs) that
        are still "ok". One that paused in interrupt() takes only its own calls (the node reruns on resume;
        inner nodes that finished are kept by the subgraph's checkpoint)."""
        for action in node_run.llm_actions:
            if action.status == "ok":
                action.status = status  # type: ignore[assignment]
                if error is not None and action.error is None:
                    action.error = f"its node attempt failed after this call: {error}"
        for child in node_run.children if inner else ():
            if child.action.status == "ok":
                child.action.status = status  # type: ignore[assignment]
                if error is not None and child.action.error is None:
                    child.action.error = f"its enclosing node attempt failed: {error}"
            self._mark(child, status, error)

    # ---- control flow -------------------------------------------------------------------------------------
    def _targets(self, command: Any) -> list[str]:
        goto = getattr(command, "goto", None)
        goto = goto if isinstance(goto, (list, tuple)) else [goto] if goto else []
        return [g.node if isinstance(g, self._send_type) else str(g) for g in goto]

    def _commands(self, value: Any) -> list[Any]:
        """The Commands a node returned: one, or those in the list it returned (LangGraph takes a list of
        updates and Commands: a ToolNode whose tools returned Commands, create_agent's model node)."""
        if isinstance(value, self._command_type):
            return [value]
        if isinstance(value, (list, tuple)):
            return [v for v in value if isinstance(v, self._command_type)]
        return []

    def _told(self, node_run: _NodeRun, outputs: Any, commands: list[Any]) -> None:
        """The ToolMessages a node task added to the state are what the model that asked was told: taken as
        the result of a call no tool run answered (a middleware that answered instead of the tool, a refused
        or limited call, a structured-output reply), and as the output of a tool run that failed and a handler
        answered for (ToolNode's `handle_tool_errors`). Messages the node only passes on from its input (a
        worker graph's whole history) are not its own."""
        told = [m for m in _messages_of(outputs, commands) if isinstance(m, ToolMessage) and m.tool_call_id]
        if not told:
            return
        given = _messages_of(node_run.raw_input, [])
        # passed on: the same object, or a copy with the same id (a subgraph resumed from its own checkpoint)
        passed_on = {id(m) for m in given} | {m.id for m in given if getattr(m, "id", None)}
        ns = node_run.action.checkpoint_ns
        for message in told:
            if id(message) in passed_on or (message.id and message.id in passed_on):
                continue
            call_id, text = message.tool_call_id, content_text(message.content)
            # asked in this task or by a task of the same graph run: never "the latest call with this id", which
            # in a fan-out whose branches reuse ids is another branch's
            owner = self._owner(call_id, ns, latest=False)
            if owner is None and call_id not in _calls_given(node_run.raw_input):
                continue  # no call asked for it: a made-up pair (langgraph-supervisor's "transferring back")
            known = owner.tool_results if owner is not None else node_run.tool_results
            result = next((r for r in reversed(known) if r.tool_call_id == call_id), None)
            if result is not None:  # the latest attempt's (a retried tool): the message is what it ended with
                if result.error is not None and not result.output and not result.paused:
                    result.output = text
                continue
            place = next((i for i, c in enumerate(owner.tool_calls) if c.id == call_id), None) if owner else None
            name = message.name or (owner.tool_calls[place].name if place is not None else "tool")
            result = ToolResult(tool_call_id=call_id, name=name, output=text,
                                error=text if message.status == "error" else None, given_by=_given_by(message))
            if place is not None:
                self.result_place[id(result)] = place
            if owner is not None:
                owner.tool_results.append(result)
            # A call in the node's input that no model call of this episode made (one refused on resume after an
            # approval step) keeps its node's action, and `join_episodes` gives it to the call, in an earlier one.
            node_run.tool_results.append(result)

    def _output(self, value: Any) -> Any:
        if isinstance(value, (list, tuple)) and any(isinstance(v, self._command_type) for v in value):
            return [self._output(v) for v in value]
        if isinstance(value, self._command_type):
            record: dict[str, Any] = {"goto": self._targets(value)}
            goto = value.goto if isinstance(value.goto, (list, tuple)) else [value.goto]
            sends = [{"node": g.node, "arg": self._jsonable(g.arg)} for g in goto if isinstance(g, self._send_type)]
            if sends:  # each Send's target gets an input of its own: what the node handed on
                record["sends"] = sends
            if value.graph is not None:  # Command.PARENT, which LangGraph rewrites to the parent's namespace
                record["graph"] = "parent"
            if value.update is not None:
                record["update"] = self._jsonable(value.update)
            if value.resume is not None:
                record["resume"] = self._jsonable(value.resume)
            return {"command": record}
        return self._jsonable(value)

    def _interrupts(self, error: Raised) -> list[dict[str, Any]]:
        found = error.args[0] if error.args else ()
        found = found if isinstance(found, (list, tuple)) else [found]
        records = [{"value": self._jsonable(getattr(i, "value", i)), "id": getattr(i, "id", None)} for i in found]
        for record in records:
            self.interrupts.setdefault(record["id"] or str(len(self.interrupts)), record["value"])
        return records

    # ---- model calls ----------------------------------------------------------------------------------------
    def _llm_start(self, run_id: int, parent: Any, meta: Mapping[str, Any], messages: Any, at: float,
                   params: Any) -> None:
        ns = meta.get("langgraph_checkpoint_ns")
        self.ns_of_run[run_id] = ns
        node_run = self.node_by_ns.get(ns) if ns is not None else None
        router = self.routers.get(ns) if node_run is None and ns is not None and self.routers else None
        if router is not None:
            node_run = router.outer
        params = params or {}
        if node_run is not None:
            node_run.seq += 1
            node_run.last_group = None
            key = node_run.key + (((node_run.seq, 0),),)
            template = node_run.action
            node, agent, path, attempt = template.node, template.agent, template.path, template.attempt
            last = node_run.llm_actions[-1] if node_run.llm_actions else None
            failed = last if last is not None and last.status == "error" else None  # a retry or a fallback?
            if router is not None:  # the router of the graph this node runs: the node's call, made there
                node, agent, path = START_NODE, router.agent, "/".join(router.path)
        elif router is not None:  # the instrumented graph's own router, in the step it ran
            self.root_seq += 1
            key = ((router.step, router.task_path, 1, self.root_seq),)
            node, agent, path, attempt, failed = START_NODE, router.agent, START_NODE, 1, None
        else:  # a model called outside any node task (the instrumented runnable is not a graph)
            self.root_seq += 1
            key = ((self.root_last_step, _LAST, 0, self.root_seq),)
            node = meta.get("langgraph_node") or "?"
            agent, path, attempt, failed = self.agents((node,)), None, 1, None
        action = Action(
            episode_id=self.episode.id,
            kind="llm",
            node=node,
            agent=agent,
            path=path,
            attempt=attempt,
            train_failed=self.train_failed,
            step=meta.get("langgraph_step"),
            checkpoint_ns=ns,
            parent_id=node_run.action.parent_id if node_run else None,
            input_messages=_prompt_messages(messages[0], self._message) if messages else [],
            model=params.get("model") or params.get("model_name") or meta.get("ls_model_name"),
            # what the app asked for; a backend's token record, when there is one, says what it sampled at
            temperature=_temperature(params.get("temperature", meta.get("ls_temperature"))),
            started_at=at,
        )
        if failed is not None and failed.input_messages == action.input_messages:
            action.retry_of = failed.id  # the same request made again (a retry, a fallback), not a new question
        self.llm_by_run[run_id] = (action, key)
        self.order.append((key, action))
        if node_run is not None:
            node_run.llm_actions.append(action)

    def _llm_end(self, run_id: int, parent: Any, meta: Any, response: Any, at: float, _: Any) -> None:
        action = self.llm_by_run.get(run_id, (None, None))[0]
        if action is None:
            return
        action.latency_s = at - action.started_at
        self._reply(action, response)

    def _reply(self, action: Action, response: Any) -> None:
        """What the model said: its message, tool calls and token record."""
        generations = response.generations[0] if response.generations else []
        if not generations:
            return
        message = getattr(generations[0], "message", None)
        if message is None:
            action.output_message = {"role": "assistant", "content": getattr(generations[0], "text", "")}
            return
        action.output_message = self._message(message)
        if action.output_message.get("tool_calls") and getattr(message, "id", None):
            self.owner_of_message[message.id] = action
        for call in action.output_message.get("tool_calls", []):
            action.tool_calls.append(ToolCall(id=call.get("id"), name=call["name"], args=call.get("args", {})))
            if call.get("id"):
                self.call_owner[call["id"]] = action
                self.call_owner_in["task", action.checkpoint_ns, call["id"]] = action
                self.call_owner_in["graph", _graph_ns(action.checkpoint_ns), call["id"]] = action
        copy_token_record(action, getattr(message, "response_metadata", None) or {})

    def _llm_error(self, run_id: int, parent: Any, meta: Any, error: Raised, at: float, response: Any) -> None:
        action = self.llm_by_run.get(run_id, (None, None))[0]
        if action is not None:
            action.status, action.error = "error", _describe(error)
            action.latency_s = at - action.started_at
            # A stream the node stopped reading (or that failed part way) said something first: that part is
            # what the app used, so the judge sees it; the call stays failed, so it trains only if asked.
            if response is not None and response.generations and response.generations[0]:
                partial = response.generations[0][0]
                if getattr(getattr(partial, "message", None), "content", None) or getattr(
                        getattr(partial, "message", None), "tool_calls", None):
                    self._reply(action, response)

    # ---- tool calls -----------------------------------------------------------------------------------------
    def _tool_start(self, run_id: int, parent: Any, meta: Mapping[str, Any], ran_args: Any, at: float,
                    extra: Any) -> None:
        name, call_id = extra
        # A chain the tool runs (an LLM chain, an agent as a tool) is inside this node task, not a new attempt.
        ns = self.ns_of_run[run_id] = meta.get("langgraph_checkpoint_ns")
        owner = self._owner(call_id, ns)
        place = next((i for i, c in enumerate(owner.tool_calls) if c.id == call_id), None) if owner else None
        self.tool_of_run[run_id] = _ToolRun(name, place, owner.id if owner else None, ns)
        self.tool_by_run[run_id] = (name, call_id, at, ns, place, self._changed(name, call_id, ran_args, owner,
                                                                               place, ns))

    def _changed(self, name: str, call_id: str | None, ran_args: Any, owner: Action | None, place: int | None,
                 ns: str | None) -> ToolCall | None:
        """The call that ran, if it is not the one the model asked for (a reviewer's edit, a middleware that
        rewrote it): compared with the asking model call's, or, on a resume, with the call the task was given."""
        if not isinstance(ran_args, dict):
            return None
        if place is not None:
            asked = owner.tool_calls[place]
            asked_name, asked_args = asked.name, asked.args
        else:
            node_run = self.node_by_ns.get(ns) if ns is not None else None
            asked_name, asked_args = _calls_given(node_run.raw_input if node_run else None).get(call_id, (None, None))
        if asked_name is None or (name, ran_args) == (asked_name, asked_args):
            return None
        return ToolCall(id=call_id, name=name, args=ran_args)

    def _tool_end(self, run_id: int, parent: Any, meta: Any, output: Any, at: float, _: Any) -> None:
        self._tool_done(run_id, output, None, at)

    def _tool_error(self, run_id: int, parent: Any, meta: Any, error: Raised, at: float, _: Any) -> None:
        if issubclass(error.type, self._interrupt_type):  # a tool that asks a human (an approval step): a pause
            asked = [record["value"] for record in self._interrupts(error)]
            self._tool_done(run_id, None, None, at, paused=True, asked=asked[0] if len(asked) == 1 else asked)
        else:
            self._tool_done(run_id, None, _describe(error), at)

    def _tool_done(self, run_id: int, output: Any, error: str | None, at: float, *, paused: bool = False,
                   asked: Any = None) -> None:
        """A tool call ended: with its output, its error, or `paused` in interrupt() having `asked`."""
        if run_id not in self.tool_by_run:
            return
        name, call_id, started, ns, place, ran_call = self.tool_by_run.pop(run_id)
        if isinstance(output, self._command_type):  # a handoff tool: what it says is the ToolMessage it adds
            output = _tool_message_of(output, call_id) or f"Command(goto={self._targets(output)})"
        if isinstance(output, ToolMessage):
            call_id = call_id or output.tool_call_id
            text = content_text(output.content)
            if output.status == "error" and error is None:
                error = text
        else:
            text = "" if output is None else content_text(output) if isinstance(output, (str, list)) else str(output)
        result = ToolResult(tool_call_id=call_id, name=name, output=text, error=error, paused=paused,
                            interrupt=asked, latency_s=at - started, ran_call=ran_call)
        if place is not None:
            self.result_place[id(result)] = place
        node_run = self.node_by_ns.get(ns) if ns is not None else None
        if node_run is not None:
            node_run.tool_results.append(result)
        # The LLM action that asked for this call also gets its result: the judge scores a tool call by it.
        owner = self._owner(call_id, ns)
        if owner is not None:
            owner.tool_results.append(result)

    def _owner(self, call_id: str | None, tool_ns: str | None, latest: bool = True) -> Action | None:
        """The model call that asked for a tool call: the one in the tool's own task, else the one whose reply
        the tool's task was given, else one in its graph run, else (with `latest`) the latest."""
        if not call_id:
            return None
        found = self.call_owner_in
        owner = found.get(("task", tool_ns, call_id))
        if owner is None and self.owner_of_message and tool_ns is not None:
            node_run = self.node_by_ns.get(tool_ns)
            if node_run is not None:
                owner = self.owner_of_message.get(_message_asking(node_run.raw_input, call_id))
        return (owner or found.get(("graph", _graph_ns(tool_ns), call_id))
                or (self.call_owner.get(call_id) if latest else None))

    # ---- the episode ----------------------------------------------------------------------------------------
    def _finish(self) -> Episode:
        episode = self.episode
        self._mark_failed()
        kept: list[Action] = []
        for _, action in sorted(self.order, key=lambda item: item[0]):
            if action.kind == "node":
                node_run = self.node_of_action[action.id]
                action.tool_results = node_run.tool_results
                # A node whose model calls or inner nodes are recorded needs no action of its own; one with
                # neither (a ToolNode, plain code) still shows, so the judge sees the whole team's work. So
                # does one holding a tool result no model call of this episode asked for (a subagent tool
                # rerun on resume): `join_episodes` gives it to the call that asked, in an earlier episode.
                # A node that failed or paused shows too unless an action inside it already says so (a node
                # whose error handler ran inside it, an entrypoint paused after its tasks ran).
                if (node_run.llm_actions or node_run.children) and (
                        action.status == "ok" or _shows_status(node_run, action.status)) and not any(
                        r.tool_call_id and r.tool_call_id not in self.call_owner for r in node_run.tool_results):
                    for llm_action in node_run.llm_actions:
                        llm_action.node_output = action.node_output
                        llm_action.handoff = llm_action.handoff or action.handoff
                    continue
                action.node_input = self._jsonable(node_run.raw_input)
            kept.append(action)
        ids = {a.id for a in kept}
        places = self.result_place
        for i, action in enumerate(kept):
            if len(action.tool_results) > 1:  # stable: results of calls no model asked for go last, in order
                action.tool_results.sort(key=lambda r: (0, places[id(r)]) if id(r) in places else (1, 0))
            action.index = i
            if action.parent_id not in ids:
                action.parent_id = None
        episode.actions = kept
        episode.interrupts = list(self.interrupts.values())
        if episode.status != "error" and (episode.interrupts or episode.metadata.get("paused_before") or self.paused):
            episode.status = "interrupted"
        return episode


def _graph_ns(task_ns: str | None) -> str | None:
    """The namespace of the graph run a node task belongs to (its enclosing task's); None at the top."""
    return enclosing_ns(task_ns) if task_ns else None


def _prompt_messages(prompt: Any, convert: Callable[[Any], dict[str, Any]]) -> list[dict[str, Any]]:
    """A model call's input: a chat model's messages, or a completion model's prompt string (one user turn)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [convert(m) for m in prompt]


def _messages_of(value: Any, commands: list[Any]) -> list[Any]:
    """The messages a node's input or output holds under `messages` (MessagesState's key, the prebuilt agents'):
    in a state update, in each update of a list the node returned, and in its Commands' updates."""
    parts = [*(value if isinstance(value, (list, tuple)) else [value]), *(c.update for c in commands)]
    found: list[Any] = []
    for part in parts:
        if isinstance(part, (list, tuple)):  # a Command's update as (key, value) pairs
            part = {key: v for key, v in (p for p in part if isinstance(p, tuple) and len(p) == 2) if key == "messages"}
        messages = part.get("messages") if isinstance(part, Mapping) else None
        if isinstance(messages, (list, tuple)):
            found.extend(messages)
        elif messages is not None:
            found.append(messages)
    return found


def _calls_given(value: Any) -> dict[str, tuple[str, Any]]:
    """The tool calls a node task was given, by id, as (name, args): those of the AI messages in its input, and
    calls given as themselves (create_agent's tools task gets one per Send, with the state beside it; a ToolNode
    may be given a list of them)."""
    found = {}
    for part in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(part, Mapping) and part.get("__type") == "tool_call_with_context":
            part = part.get("tool_call")
        if isinstance(part, Mapping) and part.get("id") and "name" in part and "args" in part:
            found[part["id"]] = (part.get("name"), part.get("args"))
    for message in _messages_of(value, []):
        found.update((c["id"], (c.get("name"), c.get("args"))) for c in getattr(message, "tool_calls", None) or ()
                     if c.get("id"))
    return found


def _say_what_is_removed(output: Any, given: list[Any], as_dict: Callable[[Any], dict[str, Any]]) -> None:
    """Give each removal in a node's recorded output the message it removes, from the node's input (or "all
    messages"): the judge then tells a trim from a reset."""
    if isinstance(output, list):
        for value in output:
            _say_what_is_removed(value, given, as_dict)
    elif isinstance(output, dict):
        if output.get("role") == "remove" and "id" in output:
            if output["id"] == "__remove_all__":  # langgraph.graph.message.REMOVE_ALL_MESSAGES
                output["removes"] = "all messages"
            else:
                found = next((m for m in given if getattr(m, "id", None) == output["id"]), None)
                if found is not None:
                    output["removes"] = as_dict(found)
            return
        for value in output.values():
            _say_what_is_removed(value, given, as_dict)


def _message_asking(value: Any, call_id: str) -> str | None:
    """The id of the latest message in a task's input (its state, or the state beside the tool call
    create_agent's tools task is given) that asked for tool call `call_id`."""
    if isinstance(value, Mapping) and value.get("__type") == "tool_call_with_context":
        value = value.get("state")
    for message in reversed(_messages_of(value, [])):
        if any(c.get("id") == call_id for c in getattr(message, "tool_calls", None) or ()):
            return getattr(message, "id", None)
    return None


def _given_by(message: ToolMessage) -> str:
    """Who gave a ToolMessage no tool run gave: langchain's agent harness marks its own (`lc_source`, its
    fields in `lc_data`: a human reviewer's decision); any other is the node's (a middleware, a refusal)."""
    source = message.additional_kwargs.get("lc_source")
    if not isinstance(source, str):
        return "node"
    data = message.additional_kwargs.get("lc_data")
    decision = data.get("decision") if isinstance(data, Mapping) else None
    return f"{source}:{decision}" if isinstance(decision, str) else source


def _shows_status(node_run: _NodeRun, status: str) -> bool:
    """Whether an action made inside a node task (its model calls, its inner nodes', theirs) has the task's
    status ("error", "interrupted"): then the task's failure or pause is on the record without its own action
    (a retried attempt's error inside a task that then paused does not say it paused)."""
    return any(a.status == status for a in node_run.llm_actions) or any(
        child.action.status == status or _shows_status(child, status) for child in node_run.children)


def _temperature(value: Any) -> float | None:
    """A temperature from a model's invocation parameters, if it is a number (a provider's own types aside)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if value >= 0 and value == value and value != float("inf") else None


def copy_token_record(action: Action, response_metadata: Mapping[str, Any]) -> None:
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
    if record.get("temperature") is not None:  # the behaviour distribution the log-probs are under
        action.temperature = float(record["temperature"])


def _tool_message_of(command: Any, call_id: str | None) -> ToolMessage | None:
    """The ToolMessage a handoff tool's Command says it answered with: in its update, or in the state it sends
    the next agent (`Send(agent, {"messages": [..., tool_message]})`, langgraph-supervisor's parallel
    handoffs)."""
    goto = getattr(command, "goto", None)
    sent = [g.arg for g in (goto if isinstance(goto, (list, tuple)) else [goto]) if hasattr(g, "arg")]
    for update in (getattr(command, "update", None), *sent):
        messages = update.get("messages") if isinstance(update, Mapping) else None
        for message in reversed(messages if isinstance(messages, (list, tuple)) else []):
            if isinstance(message, ToolMessage) and (call_id is None or message.tool_call_id == call_id):
                return message
    return None


def _describe(error: Raised) -> str:
    if issubclass(error.type, GeneratorExit):  # `break` out of `stream()`: LangGraph closes the run where it was
        return "cut short: the caller stopped reading the stream before the run ended (GeneratorExit)"
    return f"{error.type.__name__}: {error.text}"


def _step(step: Any) -> int:
    return step if isinstance(step, int) else -1


def _path_key(path: Any) -> tuple[Any, ...]:
    """LangGraph's task path (`('__pregel_pull', 'coder')`, `('__pregel_push', 2, ...)`) as a sortable tuple:
    numbers compare as numbers, names as names."""
    if path is None:
        return ()
    items = path if isinstance(path, (list, tuple)) else (path,)
    key: list[Any] = []
    for item in items:
        if isinstance(item, (list, tuple)):
            key.append((2, _path_key(item)))
        elif isinstance(item, bool) or not isinstance(item, int):
            key.append((1, str(item)))
        else:
            key.append((0, item))
    return tuple(key)


def _ints(values: Sequence[Any] | None) -> list[int] | None:
    return [int(v) for v in values] if values is not None else None
