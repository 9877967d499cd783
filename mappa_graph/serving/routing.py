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

A pending call must not outlive its episode: a stale one would hold memory and, worse, answer a later request
with the same messages (under its agent's adapter, or refusing it as ambiguous). So a call leaves the registry
when its reply or error comes back, when the outermost run it belongs to ends without it (an episode failed or
abandoned while a callback never fired), and at the latest `stale_after` seconds after it was registered (an
app process that died with calls in flight, which no callback will ever report). A completion answered after
its call left (the client disconnected or gave up) is not kept: no one would collect its record.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
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
    temperature: float | None = None  # the trainer's sampling temperature (None: the request's own)
    claims: int = 0
    registered_at: float = 0.0  # the registry's clock when registered: a call older than stale_after expires


class CallRegistry:
    """Pending calls by key, and the token records the endpoint produced until the router collects them.

    Thread-safe: the app's threads register, the server's event loop claims. Records wait under their
    completion id (bounded: a client without the router never collects them). A call registered more than
    `stale_after` seconds ago (by `clock`) is expired: dropped, never claimed."""

    def __init__(self, *, keep_records: int = 4096, stale_after: float = 900.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if stale_after <= 0:
            raise ValueError(f"stale_after must be > 0 seconds, got {stale_after}")
        self._pending: dict[UUID, PendingCall] = {}  # in registration order, so the oldest come first
        self._by_key: dict[str, list[UUID]] = {}
        self._records: OrderedDict[str, tuple[dict[str, Any], UUID | None]] = OrderedDict()
        self._record_of_run: dict[UUID, str] = {}
        self._keep = keep_records
        self.stale_after, self.clock = stale_after, clock
        self.expired = 0  # calls dropped as stale, for the endpoint's logs and tests
        self._lock = threading.Lock()

    def register(self, call: PendingCall) -> None:
        with self._lock:
            self._expire()
            self._drop(call.run_id)  # a run id registered twice (a retried callback) is one call, not two
            call.registered_at = self.clock()
            self._pending[call.run_id] = call
            self._by_key.setdefault(call.key, []).append(call.run_id)

    def drop(self, run_id: UUID) -> None:
        """The call is over (answered, failed or abandoned): forget it and any record it left uncollected."""
        with self._lock:
            self._drop(run_id)

    def _drop(self, run_id: UUID) -> None:
        call = self._pending.pop(run_id, None)
        if call is not None:
            ids = self._by_key.get(call.key, [])
            if run_id in ids:
                ids.remove(run_id)
            if not ids:
                self._by_key.pop(call.key, None)
        completion_id = self._record_of_run.pop(run_id, None)
        if completion_id is not None:
            self._records.pop(completion_id, None)

    def _expire(self) -> None:
        """Drop the calls older than stale_after (the oldest come first in `_pending`). Lock held."""
        horizon = self.clock() - self.stale_after
        stale = []
        for run_id, call in self._pending.items():
            if call.registered_at > horizon:
                break
            stale.append(run_id)
        for run_id in stale:
            self._drop(run_id)
        self.expired += len(stale)

    def pending(self) -> list[PendingCall]:
        with self._lock:
            self._expire()
            return list(self._pending.values())

    def counts(self) -> dict[str, int]:
        """How much the registry holds: pending calls, keys, uncollected records and run-to-record links."""
        with self._lock:
            return {"pending": len(self._pending), "keys": len(self._by_key), "records": len(self._records),
                    "record_links": len(self._record_of_run)}

    def claim(self, key: str, *, model: str | None, agents: Sequence[str]) -> PendingCall | None:
        """The pending call a request with this key answers, or None when the client named an agent as
        `model` and no pending call matches (a direct call: that agent's adapter answers).

        Among identical pending calls of one agent, the least claimed one is taken (each of G identical
        rollouts gets its own). Raises RouteError: 409 when pending calls of two agents match (the request
        cannot say which), 404 when nothing matches and `model` names no agent, or the matched call's agent
        is not served."""
        named = model if model in agents else None
        with self._lock:
            self._expire()
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

    def put_record(self, completion_id: str, record: dict[str, Any], run_id: UUID | None, *,
                   key: str | None = None) -> bool:
        """Keep the token record of a completion until the router collects it (by the completion id the reply
        carries, or by the run id for a client that drops it).

        Identical calls of one agent are interchangeable, so the claimed call (`run_id`) may have finished
        already, collected by its twin's request: the record is then linked to a twin still pending (same
        `key`). With none to link to, the record is kept unlinked, for a client that reads it by completion id
        (one still waiting on this very reply), and it leaves with the bounded queue's oldest: never under a
        finished run id, which no one would free. Returns whether the record is linked to a pending call."""
        with self._lock:
            if run_id is not None and run_id not in self._pending:
                twins = [r for r in self._by_key.get(key or "", []) if r not in self._record_of_run]
                run_id = twins[0] if twins else None
            if run_id is not None:
                earlier = self._record_of_run.get(run_id)
                if earlier in self._records:
                    # a second request matched to this call (a retry, or a twin's request that claimed it): the
                    # earlier record may be another client's reply, which it reads by completion id, so it stays
                    # (unlinked, bounded) rather than being discarded
                    self._records[earlier] = (self._records[earlier][0], None)
                self._record_of_run[run_id] = completion_id
            self._records[completion_id] = (record, run_id)
            while len(self._records) > self._keep:
                cid, (_, owner) = self._records.popitem(last=False)
                if owner is not None and self._record_of_run.get(owner) == cid:
                    del self._record_of_run[owner]
            return run_id is not None

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
                    record, owner = self._records.pop(cid)
                    if owner is not None and owner != run_id and self._record_of_run.get(owner) == cid:
                        del self._record_of_run[owner]
                    return record
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
        # the outermost open run (an episode) of each open chain/tool run, and the calls each episode still has
        # pending: when the episode ends, what is left was abandoned (a callback that never came) and is dropped
        self._root_of: dict[UUID, UUID] = {}
        self._open_calls: dict[UUID, set[UUID]] = {}
        self._root_of_call: dict[UUID, UUID] = {}
        self._lock = threading.Lock()
        if agents is None:
            self.agent_of: AgentOf = first_node
        elif callable(agents):
            self.agent_of = agents
        else:
            mapping = dict(agents)
            self.agent_of = lambda meta: mapping.get(first_node(meta) or "", first_node(meta))

    # ---- episode bookkeeping: which outermost run each call belongs to ------------------------------------
    def _enter(self, run_id: UUID, parent_run_id: UUID | None) -> None:
        with self._lock:
            self._root_of[run_id] = self._root_of.get(parent_run_id, run_id) if parent_run_id else run_id

    def _exit(self, run_id: UUID) -> None:
        with self._lock:
            root = self._root_of.pop(run_id, None)
            leftover = self._open_calls.pop(run_id, set()) if root == run_id else set()
            for call in leftover:
                self._root_of_call.pop(call, None)
        for call in leftover:  # the episode is over and these replies never came: they will not now
            self.registry.finish(call, [])

    def _call_done(self, run_id: UUID) -> None:
        with self._lock:
            root = self._root_of_call.pop(run_id, None)
            if root is not None:
                calls = self._open_calls.get(root)
                if calls is not None:
                    calls.discard(run_id)

    def on_chain_start(self, serialized: Any, inputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None,
                       **kwargs: Any) -> None:
        self._enter(run_id, parent_run_id)

    def on_tool_start(self, serialized: Any, input_str: str, *, run_id: UUID, parent_run_id: UUID | None = None,
                      **kwargs: Any) -> None:
        self._enter(run_id, parent_run_id)

    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._exit(run_id)

    def on_chain_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._exit(run_id)

    def on_tool_end(self, output: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._exit(run_id)

    def on_tool_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._exit(run_id)

    # ---- the calls ------------------------------------------------------------------------------------------
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
            seed=call_seed(meta, agent or "", prompt), greedy=bool(meta.get("mappa_greedy")),
            temperature=meta.get("mappa_temperature")))
        with self._lock:
            root = self._root_of.get(parent_run_id) if parent_run_id else None
            if root is not None:
                self._open_calls.setdefault(root, set()).add(run_id)
                self._root_of_call[run_id] = root

    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._call_done(run_id)
        messages = [g.message for gens in response.generations or [] for g in gens if getattr(g, "message", None)]
        records = self.registry.finish(run_id, [_completion_id(m.response_metadata) for m in messages])
        for message, record in zip(messages, records):
            if record is not None:
                message.response_metadata[MAPPA_KEY] = record

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._call_done(run_id)
        self.registry.finish(run_id, [])

    def open_runs(self) -> int:
        """Open chain/tool runs and episodes with calls in flight that the router is tracking (0 when idle)."""
        with self._lock:
            return len(self._root_of) + len(self._open_calls)


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
                                    "key": call.key, "seed": call.seed, "greedy": call.greedy,
                                    "temperature": call.temperature})

    def finish(self, run_id: UUID, completion_ids: Sequence[str | None]) -> list[dict[str, Any] | None]:
        return self._post(f"/mappa/calls/{run_id}/finish", {"completion_ids": list(completion_ids)})["records"]

    def close(self) -> None:
        self.http.close()


def remote_router(base_url: str, *, api_key: str | None = None,
                  agents: Mapping[str, str] | AgentOf | None = None) -> CallRouter:
    """A CallRouter for an app whose policy endpoint runs in another process: add it to the app's callbacks
    (`app.with_config(callbacks=[remote_router(url)])`), then instrument the app as usual."""
    return CallRouter(RemoteCallRegistry(base_url, api_key=api_key), agents=agents)  # type: ignore[arg-type]
