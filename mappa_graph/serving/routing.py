"""Which agent made this HTTP request? The pending-call registry and the callback that fills it.

An unchanged LangGraph app calls the policy endpoint through `ChatOpenAI(base_url=...)`; the request itself
says nothing about the node that sent it. But langchain-core announces every chat-model call to the run's
callbacks (`on_chat_model_start`, with the exact messages and the bound tools) before the model's HTTP request
leaves, and LangGraph puts the node task in that call's metadata. `CallRouter` is that callback: it registers
each call as pending under a key of its messages and tool names; the endpoint computes the same key from the
request body and claims the pending call, which names the agent (its adapter answers). When the reply comes
back `CallRouter.on_llm_end` puts the endpoint's exact token ids and behaviour log-probs on the reply's
`response_metadata["mappa"]`, which is where the trace collector reads them from (as it does for
PolicyChatModel), so the Action records the tokens that were sampled, not a re-encoding of the text.

Identical in-flight prompts of one agent (G rollouts of a task) are interchangeable for routing; identical
prompts of two agents at once cannot be told apart from the request, so they are refused (`RouteError`, 409)
unless the client names the agent as `model`. This module never imports langgraph.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import BaseMessage, convert_to_messages

from ..messages import MAPPA_KEY, content_text, message_to_dict

AgentOf = Callable[[Mapping[str, Any]], "str | None"]


class RouteError(Exception):
    """A request the endpoint will not answer, in OpenAI's error shape: HTTP `status`, `type` and `code`."""

    def __init__(self, status: int, message: str, *, code: str, type: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.type, self.param = status, message, code, type, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---- the key both sides compute ---------------------------------------------------------------------------
def call_key(messages: Sequence[BaseMessage], tool_names: Iterable[str] = ()) -> str:
    """A digest of what a chat-model call sends: each message's role, text, tool calls (name and arguments)
    and tool-call id, plus the names of the tools offered. Message ids and names are left out: OpenAI-style
    clients drop the first and may drop the second, and neither changes what the model sees."""
    rows = []
    for message in messages:
        d = message_to_dict(message)
        calls = [[c["name"], json.dumps(c.get("args") or {}, sort_keys=True)] for c in d.get("tool_calls", [])]
        content = d.get("content")
        rows.append([d["role"], content_text(content) if content else "", calls, d.get("tool_call_id") or ""])
    text = json.dumps([rows, sorted(tool_names)], ensure_ascii=False)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def request_messages(payload: Mapping[str, Any]) -> list[BaseMessage]:
    """The request body's OpenAI-format messages as langchain-core messages (langchain-core's own converter:
    tool-call arguments arrive as JSON strings and leave as dicts). A malformed list is a RouteError (400)."""
    raw = payload.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RouteError(400, "'messages' must be a non-empty list of chat messages", code="invalid_messages",
                         param="messages")
    try:
        return convert_to_messages(raw)
    except (ValueError, TypeError, KeyError, NotImplementedError) as exc:
        raise RouteError(400, f"cannot read 'messages': {exc}", code="invalid_messages", param="messages") from None


def tool_names(tools: Any) -> list[str]:
    """Names of OpenAI-format tool schemas (`{"type": "function", "function": {"name": ...}}`)."""
    names = []
    for tool in tools or []:
        if isinstance(tool, Mapping):
            function = tool.get("function") if isinstance(tool.get("function"), Mapping) else tool
            if function.get("name"):
                names.append(str(function["name"]))
    return names


def first_node(metadata: Mapping[str, Any]) -> str | None:
    """The default agent of a call: the outermost node of its task path (`langgraph_checkpoint_ns` is
    `node:task|inner:task`), which is a supervisor's or swarm's worker, a subgraph node or a plain node; the
    same agent boundary the trace collector attributes actions to by default."""
    ns = str(metadata.get("langgraph_checkpoint_ns") or "")
    if ns:
        return ns.split("|", 1)[0].split(":", 1)[0] or None
    node = metadata.get("langgraph_node")
    return str(node) if node else None


# ---- the registry ---------------------------------------------------------------------------------------
@dataclass
class PendingCall:
    """One chat-model call whose HTTP request may be on its way: who made it and how it should be sampled."""

    run_id: UUID
    agent: str | None
    node: str | None
    key: str
    seed: int | None = None  # from the rollout's mappa_seed, as PolicyChatModel derives it
    greedy: bool = False  # the trainer's greedy evaluation flag
    claims: int = 0


class CallRegistry:
    """Pending calls by key, and the token records the endpoint produced until the router collects them.

    Thread-safe: the app's threads register, the server's event loop claims. Records wait under their
    completion id (bounded: a client without the router never collects them)."""

    def __init__(self, *, keep_records: int = 4096) -> None:
        self._pending: dict[UUID, PendingCall] = {}
        self._by_key: dict[str, list[UUID]] = {}
        self._records: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._record_of_run: dict[UUID, str] = {}
        self._keep = keep_records
        self._lock = threading.Lock()

    def register(self, call: PendingCall) -> None:
        with self._lock:
            self._pending[call.run_id] = call
            self._by_key.setdefault(call.key, []).append(call.run_id)

    def drop(self, run_id: UUID) -> None:
        with self._lock:
            call = self._pending.pop(run_id, None)
            if call is not None:
                ids = self._by_key.get(call.key, [])
                if run_id in ids:
                    ids.remove(run_id)
                if not ids:
                    self._by_key.pop(call.key, None)
            self._record_of_run.pop(run_id, None)

    def pending(self) -> list[PendingCall]:
        with self._lock:
            return list(self._pending.values())

    def claim(self, key: str, *, model: str | None, agents: Sequence[str]) -> PendingCall | None:
        """The pending call a request with this key answers, or None when the client named an agent as
        `model` and no pending call matches (a direct call: that agent's adapter answers).

        Among identical pending calls of one agent, the least claimed one is taken (each of G identical
        rollouts gets its own). Raises RouteError: 409 when pending calls of two agents match (the request
        cannot say which), 404 when nothing matches and `model` names no agent, or the matched call's agent
        is not served."""
        named = model if model in agents else None
        with self._lock:
            calls = [self._pending[r] for r in self._by_key.get(key, []) if r in self._pending]
            if named is not None:
                calls = [c for c in calls if c.agent == named]
            if not calls:
                if named is not None:
                    return None
                raise RouteError(404, f"no in-flight call of an instrumented app matches this request, and model "
                                 f"{model!r} is not an agent (agents: {', '.join(agents)}); attach the endpoint's "
                                 "router to the app (endpoint.attach(graph)) or name an agent as the model",
                                 code="model_not_found", param="model")
            owners = sorted({str(c.agent) for c in calls})
            if len(owners) > 1:
                raise RouteError(409, f"ambiguous request: agents {', '.join(owners)} each have an in-flight call "
                                 "with exactly these messages and tools, so the request cannot say whose adapter "
                                 "should answer; name the agent as the model (ChatOpenAI(model=AGENT)) or make "
                                 "their prompts differ", code="ambiguous_route")
            call = min(calls, key=lambda c: c.claims)
            call.claims += 1
        if call.agent not in agents:
            raise RouteError(404, f"the call from node {call.node!r} is routed to agent {call.agent!r}, which this "
                             f"endpoint does not serve (agents: {', '.join(agents)}); map that node to an agent "
                             "(CallRouter(agents={...}))", code="model_not_found", param="model")
        return call

    def put_record(self, completion_id: str, record: dict[str, Any], run_id: UUID | None) -> None:
        """Keep the token record of a completion until the router collects it."""
        with self._lock:
            self._records[completion_id] = record
            if run_id is not None:
                self._record_of_run[run_id] = completion_id
            while len(self._records) > self._keep:
                self._records.popitem(last=False)

    def finish(self, run_id: UUID, completion_ids: Sequence[str | None]) -> list[dict[str, Any] | None]:
        """A call's reply is back: the token record of each generation (by the completion id it carries), and
        the call is no longer pending."""
        try:
            return [self.take_record(cid, run_id) for cid in completion_ids]
        finally:
            self.drop(run_id)

    def take_record(self, completion_id: str | None, run_id: UUID) -> dict[str, Any] | None:
        """The record of the completion a reply carries the id of; failing that (a client that drops the id),
        the last completion answered for this run's pending call."""
        with self._lock:
            fallback = self._record_of_run.pop(run_id, None)
            for cid in (completion_id, fallback):
                if cid and cid in self._records:
                    return self._records.pop(cid)
        return None


# ---- the callback ---------------------------------------------------------------------------------------
class CallRouter(BaseCallbackHandler):
    """A langchain-core callback handler to add to an app's run config (`endpoint.attach(graph)` does):
    it registers each chat-model call as pending before its request leaves, and hands the endpoint's token
    record to the reply when it returns.

    `agents` maps a call to its agent: a mapping from node name (the outermost node of the call's task path)
    to agent, or a function of the call's run metadata; by default the outermost node's name is the agent."""

    run_inline = True  # registration must happen before the model's request, in the caller's thread
    raise_error = True  # a call that cannot be registered would be routed wrongly: fail it instead

    def __init__(self, registry: CallRegistry, *, agents: Mapping[str, str] | AgentOf | None = None) -> None:
        self.registry = registry
        if agents is None:
            self.agent_of: AgentOf = first_node
        elif callable(agents):
            self.agent_of = agents
        else:
            mapping = dict(agents)
            self.agent_of = lambda meta: mapping.get(first_node(meta) or "", first_node(meta))

    def on_chat_model_start(self, serialized: Any, messages: list[list[BaseMessage]], *, run_id: UUID,
                            parent_run_id: UUID | None = None, metadata: dict[str, Any] | None = None,
                            **kwargs: Any) -> None:
        from ..models.chat import call_seed

        meta = metadata or {}
        params = kwargs.get("invocation_params") or {}
        prompt = messages[0] if messages else []
        agent = self.agent_of(meta)
        self.registry.register(PendingCall(
            run_id=run_id, agent=agent, node=first_node(meta), key=call_key(prompt, tool_names(params.get("tools"))),
            seed=call_seed(meta, agent or "", prompt), greedy=bool(meta.get("mappa_greedy"))))

    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        messages = [g.message for gens in response.generations or [] for g in gens if getattr(g, "message", None)]
        records = self.registry.finish(run_id, [_completion_id(m.response_metadata) for m in messages])
        for message, record in zip(messages, records):
            if record is not None:
                message.response_metadata[MAPPA_KEY] = record

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self.registry.finish(run_id, [])


def _completion_id(response_metadata: Mapping[str, Any]) -> str | None:
    """The endpoint's completion id as the client kept it: ChatOpenAI keeps the response `id` when not
    streaming and the `system_fingerprint` (which the endpoint sets to the same id) in both modes."""
    cid = response_metadata.get("id")
    if isinstance(cid, str) and cid.startswith("chatcmpl-"):
        return cid
    fingerprint = response_metadata.get("system_fingerprint")
    return fingerprint if isinstance(fingerprint, str) and fingerprint else None


class RemoteCallRegistry:
    """The registry of a policy endpoint in another process (`mappa serve`), over its HTTP API: what
    CallRouter needs (`register`, `finish`), two loopback round trips per model call. The callbacks block
    for them, so registration is done before the model's request leaves."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 10.0) -> None:
        import httpx

        root = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=root if root.endswith("/v1") else root + "/v1", headers=headers,
                                 timeout=timeout)

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self.http.post(path, json=body)
        if response.status_code >= 400:
            raise RuntimeError(f"the policy endpoint at {self.http.base_url} refused {path}: "
                               f"{response.status_code} {response.text[:300]}")
        return response.json()

    def register(self, call: PendingCall) -> None:
        self._post("/mappa/calls", {"run_id": str(call.run_id), "agent": call.agent, "node": call.node,
                                    "key": call.key, "seed": call.seed, "greedy": call.greedy})

    def finish(self, run_id: UUID, completion_ids: Sequence[str | None]) -> list[dict[str, Any] | None]:
        return self._post(f"/mappa/calls/{run_id}/finish", {"completion_ids": list(completion_ids)})["records"]

    def close(self) -> None:
        self.http.close()


def remote_router(base_url: str, *, api_key: str | None = None,
                  agents: Mapping[str, str] | AgentOf | None = None) -> CallRouter:
    """A CallRouter for an app whose policy endpoint runs in another process: add it to the app's callbacks
    (`app.with_config(callbacks=[remote_router(url)])`), then instrument the app as usual."""
    return CallRouter(RemoteCallRegistry(base_url, api_key=api_key), agents=agents)  # type: ignore[arg-type]
