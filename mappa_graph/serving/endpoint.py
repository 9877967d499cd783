"""PolicyEndpoint: an OpenAI-compatible server that answers each request with the adapter of the node that sent it.

    endpoint = PolicyEndpoint(policies).start()          # http://127.0.0.1:PORT/v1, loopback by default
    app = endpoint.attach(build_app(base_url=endpoint.base_url))   # the app's own ChatOpenAI nodes
    traced = instrument(app)                             # each Action gets the endpoint's token ids

An unchanged LangGraph app (nodes built with `ChatOpenAI(base_url=...)`, or `OPENAI_BASE_URL`, inside
`create_react_agent` or `create_supervisor`) sends plain chat-completion requests. `attach` adds the
CallRouter callback to the app's config; the router registers each model call (node, agent, exact messages and
tools) before its request leaves, and the endpoint matches the request to it (routing.py). A client may also
name an agent as `model`. An app in another process (`mappa serve`) adds `remote_router(endpoint_url)`
instead, which registers its calls over this server's `/v1/mappa/calls` routes.

Two ways to answer a routed request:
- in-process: sample from the team's `AgentPolicies` under the agent's adapter (the rollout engine batches
  concurrent requests when it is started), recording the exact prompt/output token ids and the behaviour
  log-probs (temperature sampling only, as the loss assumes);
- forwarding: with `upstream=VLLMBackend(...)`, pass the request on to vLLM (`--enable-lora`) under the agent's
  served adapter name (versioned by `VLLMBackend.sync`), asking it for `return_token_ids` and log-probs.

Responses follow OpenAI's chat-completions shape (tools, `logprobs`/`top_logprobs`, SSE streaming with
`stream_options.include_usage`) and, when asked with `return_token_ids` as vLLM does, carry
`prompt_token_ids` and each choice's `token_ids`. Errors are OpenAI-style JSON (`{"error": {"message", "type",
"code", "param"}}`) with `x-should-retry: false`, so an OpenAI client does not retry a refused request. The
server is starlette served by uvicorn (the optional extra `mappa-graph[endpoint]`), on a thread of its own.
Streaming sends the tokens once the completion is sampled (the engine returns whole completions).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self
from urllib.parse import quote

from ..messages import MAPPA_KEY
from .routing import AgentOf, CallRegistry, CallRouter, PendingCall, RouteError, call_key, request_messages, tool_names

if TYPE_CHECKING:
    from langchain_core.messages import BaseMessage

    from ..models.policies import AgentPolicies
    from .vllm import VLLMBackend

__all__ = ["MAPPA_KEY", "PolicyEndpoint", "RouteError"]

log = logging.getLogger(__name__)
_NO_RETRY = {"x-should-retry": "false"}  # the openai client's own header: do not retry a refusal


def require_endpoint_extra() -> None:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"the policy endpoint needs starlette and uvicorn ({exc.name} is missing): "
                          'pip install "mappa-graph[endpoint]"') from None


@dataclass
class Completion:
    """One answered request, in the pieces both response shapes (JSON and SSE) are built from."""

    id: str
    model: str
    agent: str
    adapter: str | None
    message: dict[str, Any]  # the OpenAI assistant message (content, tool_calls)
    finish_reason: str
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float] | None
    logprob_entries: list[dict[str, Any]] | None  # OpenAI `logprobs.content`, one per output token
    pieces: list[str]  # the content as streamed, one piece per output token where they line up
    created: int = field(default_factory=lambda: int(time.time()))

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": len(self.output_ids),
                "total_tokens": len(self.prompt_ids) + len(self.output_ids)}


class PolicyEndpoint:
    """The team's policies (or a vLLM server in front of which it stands) behind one OpenAI-compatible URL.

    `agents` maps the outermost node of a call's task path to its agent (or is a function of the call's run
    metadata); by default the node's name is the agent. `api_key`: when set, requests must carry it as a
    Bearer token. `max_tokens`: the completion length when a request sets none; `max_tokens_limit`: the most a
    request may ask for (one request decodes while others wait for the model, so an unbounded one stalled the
    server). `max_body_mb`: the largest request body read. `pending_ttl`: seconds after which a registered call
    whose reply never came back (its app died) is dropped rather than kept for a request it could be mistaken
    for; longer than any request may wait (`upstream_timeout`)."""

    def __init__(
        self,
        policies: AgentPolicies | None = None,
        *,
        upstream: VLLMBackend | None = None,
        agents: Mapping[str, str] | AgentOf | None = None,
        api_key: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_tokens: int = 64,
        max_tokens_limit: int = 4096,
        max_body_mb: float = 16.0,
        served_name: str | None = None,
        upstream_timeout: float = 300.0,
        pending_ttl: float = 900.0,
    ) -> None:
        require_endpoint_extra()
        if (policies is None) == (upstream is None):
            raise ValueError("PolicyEndpoint serves either AgentPolicies (in-process) or an upstream VLLMBackend "
                             "(forwarding): pass exactly one of policies= and upstream=")
        if not 1 <= max_tokens <= max_tokens_limit:
            raise ValueError(f"max_tokens must be in [1, max_tokens_limit={max_tokens_limit}], got {max_tokens}")
        self.policies, self.upstream = policies, upstream
        self.api_key, self.host, self.port = api_key, host, port
        self.max_tokens, self.max_tokens_limit = max_tokens, max_tokens_limit
        self.max_body_bytes = int(max_body_mb * 1024 * 1024)
        self.upstream_timeout = upstream_timeout
        self.served_name = served_name or (policies.base_name if policies is not None else upstream.base_model)
        self.registry = CallRegistry(stale_after=pending_ttl)
        self.router = CallRouter(self.registry, agents=agents)
        # calls registered over HTTP (an app in another process) name their node; map it here as well
        self._node_agents = dict(agents) if isinstance(agents, Mapping) else {}
        self.app = self._build_app()
        self.requests_served = 0
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._http: Any = None  # the upstream client, made on the server's event loop

    # ---- the app side -------------------------------------------------------------------------------------
    @property
    def agents(self) -> list[str]:
        if self.policies is not None:
            return list(self.policies.agents)
        return sorted(self.upstream.routes)

    @property
    def base_url(self) -> str:
        """What to give `ChatOpenAI(base_url=...)` or `OPENAI_BASE_URL`."""
        if self._server is None:
            raise RuntimeError("the endpoint is not running: call endpoint.start() first")
        return f"http://{self.host}:{self.port}/v1"

    def attach(self, graph: Any) -> Any:
        """The same compiled app with the router among its callbacks (LangGraph merges them with a call's own,
        so `instrument()` still adds its collector): every chat-model call it makes is routed to its node's
        adapter. Use the result wherever the app was used."""
        return graph.with_config(callbacks=[self.router])

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> Self:
        """Serve on a background thread; returns once the port accepts connections (port 0: a free one)."""
        import uvicorn

        if self._server is not None:
            return self
        # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on accepted sockets of that proto, and
        # without it Nagle's algorithm meets the client's delayed ACK and every response waits ~40 ms
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM,
                             socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="mappa-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the policy endpoint did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server, self._thread = None, None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def serve_forever(self) -> None:
        """Serve in this thread until interrupted (what `mappa serve` runs)."""
        import uvicorn

        uvicorn.run(self.app, host=self.host, port=self.port, log_level="info")

    # ---- HTTP ----------------------------------------------------------------------------------------------
    def _build_app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.routing import Route

        @contextlib.asynccontextmanager
        async def lifespan(app: Any) -> AsyncIterator[None]:
            if self.upstream is not None:
                import httpx

                self._http = httpx.AsyncClient(base_url=self.upstream.base_url, timeout=self.upstream_timeout)
            try:
                yield
            finally:
                if self._http is not None:
                    await self._http.aclose()
                    self._http = None

        return Starlette(routes=[Route("/v1/models", self._models, methods=["GET"]),
                                 Route("/v1/chat/completions", self._chat_completions, methods=["POST"]),
                                 Route("/v1/mappa/calls", self._register_call, methods=["POST"]),
                                 Route("/v1/mappa/calls/{run_id}/finish", self._finish_call, methods=["POST"])],
                         lifespan=lifespan)

    async def _json(self, request: Any) -> dict[str, Any]:
        """The request body as a JSON object, read up to `max_body_bytes` (a body past it is refused as it
        arrives, not held whole in memory first)."""
        declared = request.headers.get("content-length")
        too_big = RouteError(413, f"the request body is larger than this server takes ({self.max_body_bytes} "
                             "bytes; PolicyEndpoint(max_body_mb=...))", code="request_too_large")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_big
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise too_big
        try:
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise RouteError(400, "the request body is not valid JSON (or nests deeper than a JSON parser "
                             "takes)", code="invalid_json") from None
        if not isinstance(payload, dict):
            raise RouteError(400, "the request body must be a JSON object", code="invalid_json")
        return payload

    def _refuse(self, error: RouteError) -> Any:
        from starlette.responses import JSONResponse

        # a refusal is final (no retry); a failure of the server or of the upstream may be worth retrying
        return JSONResponse(error.body(), status_code=error.status, headers=_NO_RETRY if error.status < 500 else None)

    def _check_key(self, request: Any) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if given != f"Bearer {self.api_key}":
            raise RouteError(401, "missing or wrong API key: send it as 'Authorization: Bearer KEY' (the openai "
                             "client's api_key=)", code="invalid_api_key")

    async def _models(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        try:
            self._check_key(request)
        except RouteError as error:
            return self._refuse(error)
        created = int(time.time())
        cards = [{"id": self.served_name, "object": "model", "created": created, "owned_by": "mappa",
                  "root": self.served_name, "parent": None}]
        for agent in self.agents:
            cards.append({"id": agent, "object": "model", "created": created, "owned_by": "mappa",
                          "root": self._adapter_of(agent), "parent": self.served_name})
        return JSONResponse({"object": "list", "data": cards})

    async def _register_call(self, request: Any) -> Any:
        """A pending call announced by a remote_router in the app's process (routing.RemoteCallRegistry)."""
        from starlette.responses import JSONResponse

        try:
            self._check_key(request)
            body = await self._json(request)
            call = PendingCall(run_id=uuid.UUID(str(body["run_id"])), agent=_optional(body, "agent", str),
                               node=_optional(body, "node", str), key=_call_key(body.get("key")),
                               seed=_optional(body, "seed", int), greedy=_optional(body, "greedy", bool) or False,
                               temperature=_call_temperature(body.get("temperature")))
        except RouteError as error:
            return self._refuse(error)
        except (ValueError, KeyError, TypeError) as exc:
            return self._refuse(RouteError(400, f"bad pending-call registration: {exc!r}", code="invalid_call"))
        call.agent = self._node_agents.get(call.node or "", call.agent)
        self.registry.register(call)
        return JSONResponse({"registered": str(call.run_id)})

    async def _finish_call(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        try:
            self._check_key(request)
            run_id = uuid.UUID(request.path_params["run_id"])
            ids = (await self._json(request)).get("completion_ids") or []
            if not isinstance(ids, list) or not all(i is None or isinstance(i, str) for i in ids):
                raise ValueError(f"completion_ids must be a list of strings (or nulls), got {ids!r:.200}")
        except RouteError as error:
            return self._refuse(error)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return self._refuse(RouteError(400, f"bad call finish: {exc!r}", code="invalid_call"))
        return JSONResponse({"records": self.registry.finish(run_id, ids)})

    async def _chat_completions(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, StreamingResponse

        try:
            self._check_key(request)
            payload = await self._json(request)
            settings = _sampling(payload, self.max_tokens, self.max_tokens_limit)
            messages = request_messages(payload)
            key = call_key(messages, tool_names(payload.get("tools")))
            call = self.registry.claim(key, model=payload.get("model"), agents=self.agents)
            agent = call.agent if call is not None else str(payload["model"])
            if self.policies is not None:
                completion = await self._sample_locally(agent, messages, payload, settings, call)
            else:
                completion = await self._forward(agent, payload, settings, call)
        except RouteError as error:
            return self._refuse(error)
        except ValueError as exc:  # what sampling refuses (a prompt the model cannot take, a bad setting)
            return self._refuse(RouteError(400, f"cannot sample this request: {exc}", code="invalid_request"))
        except Exception as exc:  # answered in OpenAI's shape, and logged, rather than a bare 500
            log.exception("mappa policy endpoint: a chat completion failed")
            return self._refuse(RouteError(500, f"the endpoint failed: {type(exc).__name__}: {exc}",
                                           code="internal_error", type="server_error"))
        self.registry.put_record(completion.id, self._record(completion, settings),
                                 call.run_id if call is not None else None,
                                 key=call.key if call is not None else None)
        self.requests_served += 1
        headers = {"x-mappa-agent": _header(completion.agent), "x-mappa-adapter": _header(str(completion.adapter))}
        if payload.get("stream"):
            return StreamingResponse(self._events(completion, payload), media_type="text/event-stream",
                                     headers=headers)
        return JSONResponse(self._body(completion, payload), headers=headers)

    # ---- answering -----------------------------------------------------------------------------------------
    def _adapter_of(self, agent: str) -> str | None:
        if self.policies is not None:
            return self.policies.adapter_of.get(agent)
        return self.upstream.routes.get(agent)

    async def _sample_locally(self, agent: str, messages: list[BaseMessage], payload: Mapping[str, Any],
                              settings: dict[str, Any], call: PendingCall | None) -> Completion:
        """Render, sample and decode on a worker thread (all of it is CPU work that would stall the event
        loop); `policies.sample` joins the rollout engine's batch when it runs."""
        from starlette.concurrency import run_in_threadpool

        return await run_in_threadpool(self._sample_sync, agent, messages, payload, settings, call)

    def _sample_sync(self, agent: str, messages: list[BaseMessage], payload: Mapping[str, Any],
                     settings: dict[str, Any], call: PendingCall | None) -> Completion:
        from ..models.chat import assistant_reply, to_hf_messages

        policies = self.policies
        # tool_choice "none": the model is not to call a tool, so it is not shown any
        tools = (payload.get("tools") or None) if payload.get("tool_choice") != "none" else None
        try:
            prompt_ids = policies.render(to_hf_messages(messages), tools=tools)
        except Exception as exc:  # noqa: BLE001 - a template that cannot render these messages is the request's fault
            raise RouteError(400, f"cannot render the messages with the model's chat template: {exc}",
                             code="invalid_messages", param="messages") from None
        greedy, seed = _call_sampling(settings, call)
        adapter = policies.adapter_of[agent]
        gen = policies.sample(adapter, prompt_ids, max_new_tokens=settings["max_tokens"],
                              temperature=1.0 if greedy else settings["temperature"], do_sample=not greedy,
                              seed=seed, top_logprobs=settings["top_logprobs"])
        settings["recorded_temperature"] = 0.0 if greedy else settings["temperature"]
        decode = policies.tokenizer.decode
        ids, logprobs, tops, finished, message = assistant_reply(
            list(gen.output_token_ids), list(gen.output_logprobs),
            list(gen.top_logprobs or [[] for _ in gen.output_token_ids]), gen.finished, settings["stop"], decode)
        content, calls = message["content"], message.get("tool_calls")
        pieces = [content]
        if payload.get("stream") and not calls:
            # one streamed piece per token: the text each token adds (byte-level BPE may split a character)
            pieces, before = [], ""
            for n in range(1, len(ids) + 1):
                now = decode(ids[:n], skip_special_tokens=True)
                pieces.append(now.removeprefix(before))
                before = now
            if "".join(pieces) != content:
                pieces = [content]
        entries = None
        if settings["logprobs"]:
            def entry(token: int, logprob: float, top: list[tuple[int, float]]) -> dict[str, Any]:
                word = decode([token])
                return {"token": word, "logprob": logprob, "bytes": list(word.encode()),
                        "top_logprobs": [{"token": decode([t]), "logprob": lp, "bytes": list(decode([t]).encode())}
                                         for t, lp in top]}
            entries = [entry(t, lp, top) for t, lp, top in zip(ids, logprobs, tops)]
        return Completion(id=f"chatcmpl-{uuid.uuid4().hex}", model=str(payload.get("model") or self.served_name),
                          agent=agent, adapter=adapter, message=message,
                          finish_reason=("tool_calls" if calls else "stop") if finished else "length",
                          prompt_ids=list(gen.prompt_token_ids), output_ids=ids, output_logprobs=logprobs,
                          logprob_entries=entries, pieces=pieces)

    async def _forward(self, agent: str, payload: Mapping[str, Any], settings: dict[str, Any],
                       call: PendingCall | None) -> Completion:
        """Send the request to the upstream server under the agent's served adapter name, with what the trace
        needs (token ids, log-probs) and the sampling the loss assumes (temperature only) made explicit."""
        import httpx

        try:
            adapter = self.upstream.adapter_name(agent)
        except Exception as exc:  # noqa: BLE001 - VLLMError / ValueError: no adapter for this agent
            raise RouteError(404, f"agent {agent!r} has no adapter on the upstream server: {exc}",
                             code="model_not_found", param="model") from None
        greedy, seed = _call_sampling(settings, call)
        # only what the local path serves too: anything else (a vLLM-only knob, a chat template) is not sent
        body = {k: v for k, v in payload.items() if k in _FORWARDED}
        body.update(model=adapter, logprobs=True, return_token_ids=True, temperature=0.0 if greedy else settings["temperature"],
                    top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0, max_tokens=settings["max_tokens"])
        if seed is not None:
            body["seed"] = seed
        headers = {"Authorization": f"Bearer {self.upstream.api_key}"}
        try:
            response = await self._http.post("/chat/completions", json=body, headers=headers)
        except httpx.HTTPError as exc:
            raise RouteError(502, f"the upstream server at {self.upstream.base_url} did not answer: {exc}",
                             code="upstream_unreachable", type="upstream_error") from None
        if response.status_code >= 400:
            raise RouteError(response.status_code, f"the upstream server refused the request for adapter {adapter!r}: "
                             f"{response.text[:500]}", code="upstream_error", type="upstream_error")
        data = response.json()
        choice = data["choices"][0]
        entries = (choice.get("logprobs") or {}).get("content")
        message = {k: v for k, v in choice["message"].items() if k in ("role", "content", "tool_calls")}
        output_ids = [int(t) for t in choice.get("token_ids") or []]
        logprobs = [float(e["logprob"]) for e in entries] if entries else None
        if logprobs is not None and len(logprobs) != len(output_ids):
            logprobs = None  # no token-by-token alignment: the loss recomputes rather than mis-pairs
        settings["recorded_temperature"] = body["temperature"]
        content = message.get("content") or ""
        tokens = [e["token"] for e in entries or []]
        return Completion(id=f"chatcmpl-{uuid.uuid4().hex}", model=str(payload.get("model") or self.served_name),
                          agent=agent, adapter=str(data.get("model") or adapter), message=message,
                          finish_reason=choice.get("finish_reason") or "stop",
                          prompt_ids=[int(t) for t in data.get("prompt_token_ids") or []], output_ids=output_ids,
                          output_logprobs=logprobs, logprob_entries=entries if settings["logprobs"] else None,
                          pieces=tokens if "".join(tokens) == content and tokens else [content])

    def _record(self, completion: Completion, settings: Mapping[str, Any]) -> dict[str, Any]:
        """What the router hands the trace (models/chat.py's record shape): the tokens sampled and their
        behaviour log-probs, the agent whose adapter answered, and the temperature they are under."""
        return {
            "agent": completion.agent,
            "adapter": completion.adapter,
            "model": self.served_name,
            "prompt_token_ids": completion.prompt_ids,
            "output_token_ids": completion.output_ids,
            "output_logprobs": completion.output_logprobs,
            "token_source": "backend",
            "finished": completion.finish_reason in ("stop", "tool_calls"),
            "temperature": settings.get("recorded_temperature", settings["temperature"]),
        }

    # ---- response shapes -----------------------------------------------------------------------------------
    def _body(self, c: Completion, payload: Mapping[str, Any]) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "message": c.message, "finish_reason": c.finish_reason,
                                  "logprobs": {"content": c.logprob_entries} if c.logprob_entries is not None else None}
        body: dict[str, Any] = {
            "id": c.id, "object": "chat.completion", "created": c.created, "model": c.model,
            # the fingerprint is the completion id: it is what ChatOpenAI keeps in both modes (routing.py)
            "system_fingerprint": c.id, "choices": [choice], "usage": c.usage(),
            "agent": c.agent, "adapter": c.adapter,
        }
        if payload.get("return_token_ids"):  # as vLLM answers it
            body["prompt_token_ids"] = c.prompt_ids
            choice["token_ids"] = c.output_ids
        return body

    async def _events(self, c: Completion, payload: Mapping[str, Any]) -> AsyncIterator[str]:
        """The completion as server-sent chunks: the role, one content piece per token (with its log-prob and
        token id when asked), the tool calls, the finish reason, usage when asked, then [DONE]."""
        with_ids = bool(payload.get("return_token_ids"))

        def chunk(delta: dict[str, Any], *, finish: str | None = None, entries: Any = None,
                  ids: list[int] | None = None, **top: Any) -> str:
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish,
                                      "logprobs": {"content": entries} if entries is not None else None}
            if with_ids and ids is not None:
                choice["token_ids"] = ids
            data = {"id": c.id, "object": "chat.completion.chunk", "created": c.created, "model": c.model,
                    "system_fingerprint": c.id, "choices": [choice], **top}
            return f"data: {json.dumps(data)}\n\n"

        first = {"prompt_token_ids": c.prompt_ids} if with_ids else {}
        yield chunk({"role": "assistant", "content": ""}, **first)
        entries = c.logprob_entries
        if len(c.pieces) == len(c.output_ids):
            for i, piece in enumerate(c.pieces):
                yield chunk({"content": piece}, entries=[entries[i]] if entries is not None else None,
                            ids=[c.output_ids[i]])
                await asyncio.sleep(0)  # let a disconnect be noticed between chunks
        else:
            yield chunk({"content": c.pieces[0] if c.pieces else ""}, entries=entries, ids=c.output_ids)
        for index, call in enumerate(c.message.get("tool_calls") or []):
            yield chunk({"tool_calls": [{"index": index, **call}]})
        yield chunk({}, finish=c.finish_reason)
        if (payload.get("stream_options") or {}).get("include_usage"):
            data = {"id": c.id, "object": "chat.completion.chunk", "created": c.created, "model": c.model,
                    "system_fingerprint": c.id, "choices": [], "usage": c.usage()}
            yield f"data: {json.dumps(data)}\n\n"
        yield "data: [DONE]\n\n"


# Settings that change what a token is sampled from, with the values that change nothing. The loss assumes
# temperature sampling from the model itself, so a request asking for another value is refused: served as is,
# it would be sampled from one distribution and trained as if from another; ignored, the app would get other
# sampling than it asked for.
_SAMPLED_AS_IS: dict[str, tuple[Any, ...]] = {
    "top_p": (1,), "top_k": (-1, 0), "min_p": (0,), "presence_penalty": (0,), "frequency_penalty": (0,),
    "repetition_penalty": (1,), "min_tokens": (0,), "logit_bias": ({},), "response_format": ({"type": "text"},),
    "structured_outputs": ({},), "guided_json": ((),), "guided_regex": ((),), "guided_choice": ((),),
    "guided_grammar": ((),), "bad_words": ([],), "allowed_token_ids": ([],),
}
# What a forwarded request passes on from the client's (the rest is set by the endpoint or left out)
_FORWARDED = frozenset({"messages", "tools", "tool_choice", "parallel_tool_calls", "stop", "seed", "user",
                        "top_logprobs", "n"})

MIN_TEMPERATURE = 1e-4  # above 0: float32 logits divided by a smaller one overflow, and the log-probs are NaN


def _sampling(payload: Mapping[str, Any], default_max_tokens: int, max_tokens_limit: int = 4096) -> dict[str, Any]:
    """The request's sampling settings, checked; a bad value is a 400 naming the parameter."""
    def bad(param: str, why: str) -> RouteError:
        return RouteError(400, f"invalid '{param}': {why}", code="invalid_value", param=param)

    model = payload.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"must be a string, got {type(model).__name__}")
    n = payload.get("n", 1)
    if n not in (1, None):
        raise bad("n", f"only n=1 is served, got {n!r}; send n requests (identical prompts of one agent are fine)")
    param = "max_completion_tokens" if payload.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = payload.get(param)
    max_tokens = default_max_tokens if max_tokens is None else max_tokens
    if not _is_int(max_tokens) or not 1 <= max_tokens <= max_tokens_limit:
        raise bad(param, f"must be an integer in [1, {max_tokens_limit}] (this server's limit), got {max_tokens!r:.100}")
    temperature = payload.get("temperature")
    temperature = 1.0 if temperature is None else temperature
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not (
            temperature == 0 or MIN_TEMPERATURE <= temperature <= 2):
        raise bad("temperature", f"must be 0 (greedy) or a number in [{MIN_TEMPERATURE:g}, 2], got {temperature!r:.100} "
                  "(a smaller one underflows the log-probs)")
    top_logprobs = payload.get("top_logprobs") or 0
    if not _is_int(top_logprobs) or not 0 <= top_logprobs <= 20:
        raise bad("top_logprobs", f"must be an integer in [0, 20], got {top_logprobs!r:.100}")
    seed = payload.get("seed")
    if seed is not None and not _is_int(seed):
        raise bad("seed", f"must be an integer, got {seed!r:.100}")
    stop = payload.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", f"must be a string or a list of at most 4 non-empty strings, got {stop!r:.100}")
    for key in ("messages", "tools"):
        if payload.get(key) is not None and not isinstance(payload[key], list):
            raise bad(key, "must be a list")
    _check_tools(payload, bad)
    for key in ("stream", "logprobs"):
        if payload.get(key) is not None and not isinstance(payload[key], bool):
            raise bad(key, f"must be true or false, got {payload[key]!r:.100}")
    for key, neutral in _SAMPLED_AS_IS.items():
        if payload.get(key) is not None and payload[key] not in neutral:
            raise bad(key, f"{payload[key]!r:.100} changes the distribution tokens are sampled from, and training "
                      "assumes temperature sampling from the model itself (the recorded log-probs are that "
                      f"distribution's): leave it out or send {neutral[0]!r}")
    options = payload.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool)):
        raise bad("stream_options", f"must be an object such as {{\"include_usage\": true}}, got {options!r:.100}")
    return {"max_tokens": max_tokens, "temperature": float(temperature), "greedy": temperature == 0,
            "top_logprobs": top_logprobs, "logprobs": bool(payload.get("logprobs")), "seed": seed, "stop": stop}


_FORCED_TOOLS = ("{value} makes vLLM decode the reply under a grammar (constrained decoding): its tokens come from "
                 "a masked distribution and would be trained as if sampled from the model itself, and the local "
                 "path cannot force it")


def _check_tools(payload: Mapping[str, Any], bad: Callable[[str, str], RouteError]) -> None:
    """Tools are offered, never forced: a required or named `tool_choice` (`bind_tools(tool_choice="any")`,
    `with_structured_output(method="function_calling")`) or a `strict` tool is refused like `response_format`."""
    choice = payload.get("tool_choice")
    if choice is not None and choice not in ("auto", "none"):
        if choice == "required" or isinstance(choice, dict):
            raise bad("tool_choice", _FORCED_TOOLS.format(value=f"tool_choice {choice!r:.100}") +
                      ": send 'auto' (or leave it out) and prompt the agent to call the tool, or parse its text "
                      "reply (a langchain output parser) for structured output")
        raise bad("tool_choice", f"must be 'auto' or 'none', got {choice!r:.100}")
    for tool in payload.get("tools") or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad("tools", f"each tool must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                      f"got {tool!r:.100}")
        if function.get("strict"):
            raise bad("tools", _FORCED_TOOLS.format(value=f"tool {function['name']!r:.60} with strict: true") +
                      ": leave strict out (bind_tools(..., strict=None))")


def _call_sampling(settings: dict[str, Any], call: PendingCall | None) -> tuple[bool, int | None]:
    """A request's (greedy, seed) once its pending call (a training rollout's) is known: greedy if either
    asks, the request's own seed over the call's; the call's temperature, the trainer's, replaces the
    request's in `settings`, where the recorded temperature is read from."""
    if call is None:
        return settings["greedy"], settings["seed"]
    if call.temperature is not None:
        settings["temperature"] = call.temperature
    return settings["greedy"] or call.greedy, settings["seed"] if settings["seed"] is not None else call.seed


def _call_temperature(value: Any) -> float | None:
    """A registered call's sampling temperature (the trainer's), held to what requests may ask for, but > 0:
    a greedy call registers greedy=true instead."""
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not MIN_TEMPERATURE <= value <= 2:
        raise ValueError(f"temperature must be a number in [{MIN_TEMPERATURE:g}, 2], got {value!r:.100}")
    return float(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional(body: Mapping[str, Any], key: str, kind: type) -> Any:
    """A registration field that is absent, null, or of `kind` (a bool is no int here)."""
    value = body.get(key)
    if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
        raise ValueError(f"{key} must be a {kind.__name__} or null, got {value!r:.100}")
    return value


def _call_key(value: Any) -> str:
    """A registration's key: the digest `call_key` computes (32 hex digits), never the app's text itself."""
    if not isinstance(value, str) or not 1 <= len(value) <= 128:
        raise ValueError(f"key must be the call's digest (routing.call_key), got {value!r:.100}")
    return value


def _header(value: str) -> str:
    """A header value HTTP can carry: an agent named in other scripts than Latin-1 is percent-encoded (UTF-8)."""
    return value if value.isascii() and value.isprintable() else quote(value, safe="")
