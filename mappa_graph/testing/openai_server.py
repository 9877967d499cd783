"""A real OpenAI-compatible HTTP server on loopback, replying from a script, for tests and benchmarks.

    with OpenAIServer(["{\"score\": 7, \"rationale\": \"ok\"}"], delay=0.05) as server:
        chat = ChatOpenAI(base_url=server.base_url, api_key="test", model="judge", max_retries=0)

Clients talk to it over a real TCP connection (stdlib `ThreadingHTTPServer`, one thread per connection,
HTTP/1.1 keep-alive), so the path through `openai` and `httpx` is the one production takes. Routes live in a
registry keyed by (method, path): `server.route("POST", "/v1/load_lora_adapter", handler)` adds an endpoint
without touching the chat handler, which is how a local-model backend can grow LoRA load/unload later.
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


@dataclass
class Request:
    """One HTTP request as a route handler sees it."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        if not self.body:
            return None
        return json.loads(self.body)


@dataclass
class Response:
    """A route's answer: `json` (serialised for you), raw `body`, or `events` sent as server-sent events."""

    status: int = 200
    json: Any = None
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    events: Iterable[str] | None = None


@dataclass
class ScriptedReply:
    """A reply with more control than a plain string: finish reason, its own delay, or an HTTP error."""

    content: str = ""
    finish_reason: str = "stop"
    delay: float | None = None
    status: int | None = None


Handler = Callable[[Request], Response]
ReplyFn = Callable[[dict[str, Any]], str | ScriptedReply]
Script = str | ScriptedReply | ReplyFn | Iterable[str | ScriptedReply]


def error_response(status: int, message: str, *, kind: str = "server_error") -> Response:
    """An error in the shape OpenAI clients parse (`{"error": {"message", "type", "code"}}`)."""
    headers = {"Retry-After": "0"} if status == 429 else {}
    return Response(status=status, json={"error": {"message": message, "type": kind, "code": status}}, headers=headers)


class OpenAIServer:
    """OpenAI-compatible chat server on 127.0.0.1 (port 0: the OS picks a free one); a context manager.

    `script` answers `POST /v1/chat/completions`: one reply for every request (a str or ScriptedReply), a
    callable(request_json) -> str | ScriptedReply, or a list or iterator of replies used in order (an exhausted script answers 500, so a test that asks once too often
    fails loudly). `delay` is slept before each reply; the first `fail_first` chat requests get HTTP
    `fail_status` instead. Every request is recorded in `requests`; `in_flight_max` is the most chat requests
    served at the same moment.
    """

    def __init__(
        self,
        script: Script | None = None,
        *,
        delay: float = 0.0,
        fail_first: int = 0,
        fail_status: int = 500,
        models: Iterable[str] = ("judge",),
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        if script is None:
            script = '{"score": 5, "rationale": "default scripted reply"}'
        if isinstance(script, (str, ScriptedReply)):
            script = (lambda reply: lambda request: reply)(script)
        self._reply_fn: ReplyFn | None = script if callable(script) else None
        self._replies: Iterator[str | ScriptedReply] | None = None if callable(script) else iter(script)
        self.delay = delay
        self.fail_first = fail_first
        self.fail_status = fail_status
        self.models = list(models)
        self.host = host
        self.port = port
        self.requests: list[Request] = []
        self.in_flight = 0
        self.in_flight_max = 0
        self.routes: dict[tuple[str, str], Handler] = {}
        self._chat_seen = 0
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.route("POST", "/v1/chat/completions", self.chat_completions)
        self.route("GET", "/v1/models", self.list_models)
        self.route("GET", "/health", lambda request: Response(json={"status": "ok"}))

    # ---- routes -----------------------------------------------------------------------------------------
    def route(self, method: str, path: str, handler: Handler | None = None) -> Any:
        """Register `handler` for (method, path); without a handler, returns a decorator."""
        if handler is None:
            return lambda fn: self.route(method, path, fn)
        self.routes[(method.upper(), path.rstrip("/") or "/")] = handler
        return handler

    def list_models(self, request: Request) -> Response:
        created = int(time.time())
        data = [{"id": m, "object": "model", "created": created, "owned_by": "mappa-test"} for m in self.models]
        return Response(json={"object": "list", "data": data})

    def chat_completions(self, request: Request) -> Response:
        try:
            payload = request.json
        except json.JSONDecodeError as exc:
            return error_response(400, f"request body is not JSON: {exc}", kind="invalid_request_error")
        if not isinstance(payload, dict) or not isinstance(payload.get("messages"), list):
            return error_response(400, "chat completion needs a JSON object with a 'messages' list",
                                  kind="invalid_request_error")
        with self._lock:
            seen = self._chat_seen
            self._chat_seen += 1
            self.in_flight += 1
            self.in_flight_max = max(self.in_flight_max, self.in_flight)
        try:
            if seen < self.fail_first:
                time.sleep(self.delay)
                return error_response(self.fail_status, f"injected failure {seen + 1} of {self.fail_first}")
            reply = self._next_reply(payload)
            if reply is None:
                return error_response(500, "the server's reply script is exhausted")
            if isinstance(reply, str):
                reply = ScriptedReply(content=reply)
            time.sleep(self.delay if reply.delay is None else reply.delay)
            if reply.status is not None:
                return error_response(reply.status, f"scripted HTTP {reply.status}")
            model = str(payload.get("model") or (self.models[0] if self.models else "model"))
            if payload.get("stream"):
                return Response(events=self._chunks(model, reply))
            return Response(json=self._completion(model, payload, reply))
        finally:
            with self._lock:
                self.in_flight -= 1

    def _next_reply(self, payload: dict[str, Any]) -> str | ScriptedReply | None:
        if self._reply_fn is not None:
            return self._reply_fn(payload)
        with self._lock:
            return next(self._replies, None)  # type: ignore[arg-type]

    def _completion(self, model: str, payload: dict[str, Any], reply: ScriptedReply) -> dict[str, Any]:
        prompt_chars = sum(len(str(m.get("content", ""))) for m in payload["messages"] if isinstance(m, dict))
        prompt_tokens, completion_tokens = prompt_chars // 4 + 1, len(reply.content) // 4 + 1
        return {
            "id": f"chatcmpl-{next(self._ids)}-{uuid.uuid4().hex[:8]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": reply.content},
                    "finish_reason": reply.finish_reason,
                    "logprobs": None,
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    def _chunks(self, model: str, reply: ScriptedReply) -> Iterator[str]:
        head = {"id": f"chatcmpl-{next(self._ids)}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": model}
        pieces = [reply.content[i:i + 16] for i in range(0, len(reply.content), 16)] or [""]
        yield json.dumps({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                               "finish_reason": None}]})
        for piece in pieces:
            yield json.dumps({**head, "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]})
        yield json.dumps({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": reply.finish_reason}]})
        yield "[DONE]"

    # ---- bookkeeping ------------------------------------------------------------------------------------
    def count(self, path: str | None = "/v1/chat/completions") -> int:
        """Requests received on `path` (all paths with None)."""
        with self._lock:
            return sum(1 for r in self.requests if path is None or r.path == path)

    @property
    def chat_requests(self) -> list[dict[str, Any]]:
        with self._lock:
            chosen = [r for r in self.requests if r.path == "/v1/chat/completions"]
        return [r.json for r in chosen]

    def reset_counts(self) -> None:
        with self._lock:
            self.requests.clear()
            self.in_flight_max = 0

    def _record(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)

    # ---- lifecycle --------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("the server is not running: use `with OpenAIServer(...) as server:` or call start()")
        return f"http://{self.host}:{self._httpd.server_address[1]}"

    @property
    def base_url(self) -> str:
        """The URL OpenAI clients take as `base_url` (ends in /v1)."""
        return self.url + "/v1"

    def start(self) -> OpenAIServer:
        if self._httpd is not None:
            return self
        self._httpd = _QuietServer((self.host, self.port), _make_handler(self))
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), name="openai-test-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        # Keep-alive connections outlive serve_forever; close them so no client talks to a stopped server.
        with self._lock:
            connections, self._connections = list(self._connections), set()
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._httpd = None
        self._thread = None

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 512  # socketserver's default backlog of 5 drops connections under a concurrent burst

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hangs up mid-reply (a cancelled request, a closed event loop) is normal here.
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


def _make_handler(app: OpenAIServer) -> type[BaseHTTPRequestHandler]:
    class _Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 30  # an idle keep-alive connection is dropped after this long

        def setup(self) -> None:
            super().setup()
            # Headers and body go out in two writes; without this, Nagle's algorithm and delayed ACKs add
            # ~40 ms to every keep-alive reply and would swamp the latency a test means to script.
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with app._lock:
                app._connections.add(self.connection)

        def finish(self) -> None:
            with app._lock:
                app._connections.discard(self.connection)
            super().finish()

        def log_message(self, format: str, *args: Any) -> None:  # tests stay quiet
            pass

        def _serve(self) -> None:
            split = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            request = Request(
                method=self.command,
                path=split.path.rstrip("/") or "/",
                query=parse_qs(split.query),
                headers={k.lower(): v for k, v in self.headers.items()},
                body=body,
            )
            app._record(request)
            handler = app.routes.get((request.method, request.path))
            if handler is None:
                known = ", ".join(f"{m} {p}" for m, p in sorted(app.routes))
                response = error_response(404, f"no route for {request.method} {request.path} (routes: {known})",
                                          kind="not_found")
            else:
                try:
                    response = handler(request)
                except Exception as exc:  # a broken script must show up as a 500, not a hung client
                    response = error_response(500, f"handler raised {type(exc).__name__}: {exc}")
            self._send(response)

        def _send(self, response: Response) -> None:
            if response.events is not None:
                self.send_response(response.status)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                for key, value in response.headers.items():
                    self.send_header(key, value)
                self.end_headers()
                for event in response.events:
                    self.wfile.write(f"data: {event}\n\n".encode())
                    self.wfile.flush()
                self.close_connection = True
                return
            if response.body is not None:
                body, content_type = response.body, response.headers.get("Content-Type", "application/octet-stream")
            else:
                body, content_type = json.dumps(response.json).encode(), "application/json"
            self.send_response(response.status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for key, value in response.headers.items():
                if key.lower() != "content-type":
                    self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = do_DELETE = _serve

    return _Handler
