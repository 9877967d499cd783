"""A vLLM stand-in on loopback: the endpoints VLLMBackend uses, answered by a real model with real adapters.

    with LoRAServer.from_pretrained(str(tiny_path)) as server:
        backend = VLLMBackend.connect(server.base_url)

Built on OpenAIServer's route registry, backed by an AgentPolicies of its own (its own copy of the base, so
nothing is shared with the trainer's policies but the files on disk):

- `GET /v1/models`: the base (served name, `parent` None) and every loaded adapter (`parent` = the base);
- `POST /v1/load_lora_adapter` `{"lora_name", "lora_path"}`: peft `load_adapter` into a new slot; a name
  already loaded is refused (HTTP 400) as vLLM does without `load_inplace`; success is a plain-text 200;
- `POST /v1/unload_lora_adapter` `{"lora_name"}`: peft `delete_adapter`; an unknown name is a 404;
- `POST /v1/chat/completions`: `model` picks the adapter (the base name: adapters off), the tokenizer's chat
  template renders the messages, generation follows the request (temperature 0 is greedy, `max_tokens` /
  `max_completion_tokens`, `seed`, `stop`), and the reply carries `logprobs.content[]` when `logprobs` is
  set and, with `return_token_ids`, top-level `prompt_token_ids` and per-choice `token_ids`.

Log-probs are those of the distribution each token was sampled from (temperature applied), what vLLM reports
with `--logprobs-mode processed_logprobs`, which is how VLLMBackend.start launches it. `token_ids=False`
plays an older vLLM that ignores `return_token_ids`, to exercise the client's re-tokenising fallback.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..messages import content_text
from ..models.chat import assistant_reply
from .openai_server import OpenAIServer, Request, Response, error_response

if TYPE_CHECKING:
    from ..models.policies import AgentPolicies

_ROLES = {"developer": "system"}


class LoRAServer:
    """OpenAI-compatible multi-LoRA server over one AgentPolicies' base model; a context manager."""

    def __init__(
        self,
        policies: AgentPolicies,
        *,
        served_name: str | None = None,
        token_ids: bool = True,
        max_lora_rank: int = 64,
        runtime_lora_updating: bool = True,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.policies = policies
        self.served_name = served_name or policies.base_name
        self.root = policies.base_path or policies.base_name
        self.token_ids = token_ids
        self.max_lora_rank = max_lora_rank
        self.adapters: dict[str, tuple[str, str]] = {}  # served name -> (peft slot, folder)
        self._slots = itertools.count(1)
        self._lock = threading.Lock()
        self.http = OpenAIServer(models=[], host=host, port=port)
        self.http.route("GET", "/v1/models", self.list_models)
        self.http.route("POST", "/v1/chat/completions", self.chat_completions)
        if runtime_lora_updating:  # vLLM registers these only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
            self.http.route("POST", "/v1/load_lora_adapter", self.load_lora_adapter)
            self.http.route("POST", "/v1/unload_lora_adapter", self.unload_lora_adapter)

    @classmethod
    def from_pretrained(cls, name_or_path: str, **kwargs: Any) -> LoRAServer:
        """A server on its own copy of the base. AgentPolicies needs one agent; its adapter is never served."""
        from ..models.policies import AgentPolicies

        return cls(AgentPolicies.from_pretrained(name_or_path, ["_unserved"]), **kwargs)

    # ---- lifecycle ----------------------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return self.http.base_url

    @property
    def requests(self) -> list[Request]:
        return self.http.requests

    def paths(self, path: str) -> list[Any]:
        """JSON bodies of the requests received on `path`, in order."""
        return [r.json for r in list(self.http.requests) if r.path == path]

    def start(self) -> LoRAServer:
        self.http.start()
        return self

    def stop(self) -> None:
        self.http.stop()

    def __enter__(self) -> LoRAServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- models and adapters ------------------------------------------------------------------------------
    def list_models(self, request: Request) -> Response:
        created = int(time.time())
        cards = [{"id": self.served_name, "object": "model", "created": created, "owned_by": "vllm",
                  "root": self.root, "parent": None}]
        with self._lock:
            for name, (_, folder) in self.adapters.items():
                cards.append({"id": name, "object": "model", "created": created, "owned_by": "vllm",
                              "root": folder, "parent": self.served_name})
        return Response(json={"object": "list", "data": cards})

    def load_lora_adapter(self, request: Request) -> Response:
        body = request.json or {}
        return self.load(body.get("lora_name"), body.get("lora_path"))

    def load(self, name: str | None, path: str | None) -> Response:
        """Load a PEFT folder under `name` (what `--lora-modules name=path` and the load endpoint do)."""
        if not name or not path:
            return error_response(400, "Both 'lora_name' and 'lora_path' must be provided.", kind="InvalidUserInput")
        with self._lock:
            if name in self.adapters or name == self.served_name:
                return error_response(400, f"The lora adapter '{name}' has already been loaded. If you want to load "
                                      "the adapter in place, set 'load_inplace' to True.", kind="InvalidUserInput")
            config_file = Path(path) / "adapter_config.json"
            if not config_file.exists():
                return error_response(404, f"Loading lora {name} failed: No adapter found for {path}",
                                      kind="NotFoundError")
            rank = int(json.loads(config_file.read_text()).get("r", 0))
            if rank > self.max_lora_rank:
                return error_response(400, f"LoRA rank {rank} is greater than max_lora_rank {self.max_lora_rank}.",
                                      kind="BadRequestError")
            slot = f"slot{next(self._slots)}"  # peft module keys cannot hold every served name ('.' is refused)
            with self.policies.lock:
                self.policies.model.load_adapter(str(path), adapter_name=slot)
            self.adapters[name] = (slot, str(path))
        return _plain(f"Success: LoRA adapter '{name}' added successfully.")

    def unload_lora_adapter(self, request: Request) -> Response:
        name = (request.json or {}).get("lora_name")
        if not name:
            return error_response(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                                  kind="InvalidUserInput")
        with self._lock:
            if name not in self.adapters:
                return error_response(404, f"The lora adapter '{name}' cannot be found.", kind="NotFoundError")
            slot, _ = self.adapters.pop(name)
            with self.policies.lock:
                if self.policies.model.active_adapter == slot:  # peft warns when the active adapter goes
                    self.policies.model.set_adapter(self.policies.adapters[0])
                self.policies.model.delete_adapter(slot)
        return _plain(f"Success: LoRA adapter '{name}' removed successfully.")

    # ---- chat completions ---------------------------------------------------------------------------------
    def chat_completions(self, request: Request) -> Response:
        try:
            payload = request.json
        except json.JSONDecodeError as exc:
            return error_response(400, f"request body is not JSON: {exc}", kind="BadRequestError")
        if not isinstance(payload, dict) or not isinstance(payload.get("messages"), list):
            return error_response(400, "chat completion needs a 'messages' list", kind="BadRequestError")
        if payload.get("stream"):
            return error_response(400, "this test server does not stream", kind="BadRequestError")
        if (payload.get("n") or 1) != 1:
            return error_response(400, "this test server answers n=1 only", kind="BadRequestError")
        model = payload.get("model") or self.served_name
        with self._lock:
            slot = None if model == self.served_name else self.adapters.get(model, (False, ""))[0]
        if slot is False:
            return error_response(404, f"The model `{model}` does not exist.", kind="NotFoundError")

        policies = self.policies
        tools = payload.get("tools") or None
        prompt_ids = policies.render(_hf_messages(payload["messages"]), tools=tools)
        temperature = payload.get("temperature")
        temperature = 1.0 if temperature is None else float(temperature)
        max_tokens = payload.get("max_completion_tokens") or payload.get("max_tokens") or 64
        top_k = int(payload.get("top_logprobs") or 0)
        ids, logprobs, tops, finished = self._generate(slot, prompt_ids, int(max_tokens), temperature,
                                                       payload.get("seed"), top_k)
        stop = payload.get("stop")
        ids, logprobs, tops, finished, message = assistant_reply(
            ids, logprobs, tops, finished, [stop] if isinstance(stop, str) else stop, policies.tokenizer.decode)
        calls = message.get("tool_calls")
        as_ids = bool(payload.get("return_tokens_as_token_ids"))
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": {"content": [self._logprob_entry(t, lp, top, as_ids) for t, lp, top in zip(ids, logprobs, tops)]}
            if payload.get("logprobs") else None,
            "finish_reason": ("tool_calls" if calls else "stop") if finished else "length",
            "stop_reason": None,
        }
        reply: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                      "total_tokens": len(prompt_ids) + len(ids)},
        }
        if self.token_ids and payload.get("return_token_ids"):
            reply["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = ids
        return Response(json=reply)

    def _generate(self, slot: str | None, prompt_ids: list[int], max_tokens: int, temperature: float,
                  seed: int | None, top_k: int) -> tuple[list[int], list[float], list[list[tuple[int, float]]], bool]:
        """The same sampling AgentPolicies.generate does, routed by slot (adapter name) instead of by agent."""
        greedy = temperature == 0.0
        gen = self.policies.sample(slot, prompt_ids, max_new_tokens=max_tokens, temperature=temperature,
                                   do_sample=not greedy, seed=seed, top_logprobs=top_k)
        tops = gen.top_logprobs or [[] for _ in gen.output_token_ids]
        return gen.output_token_ids, gen.output_logprobs, tops, gen.finished

    def _logprob_entry(self, token: int, logprob: float, top: list[tuple[int, float]], as_ids: bool) -> dict[str, Any]:
        def text(t: int) -> str:
            return f"token_id:{t}" if as_ids else self.policies.tokenizer.decode([t])

        word = text(token)
        return {"token": word, "logprob": logprob, "bytes": list(word.encode("utf-8")),
                "top_logprobs": [{"token": text(t), "logprob": lp, "bytes": list(text(t).encode("utf-8"))}
                                 for t, lp in top]}


def _plain(text: str) -> Response:
    return Response(body=text.encode(), headers={"Content-Type": "text/plain; charset=utf-8"})


def _hf_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI request messages to the chat-template shape; tool-call arguments arrive as JSON strings and go
    to the template as objects, as vLLM does."""
    out = []
    for m in messages:
        hf: dict[str, Any] = {"role": _ROLES.get(m.get("role"), m.get("role")), "content": content_text(m.get("content") or "")}
        if m.get("tool_calls"):
            hf["tool_calls"] = []
            for c in m["tool_calls"]:
                args = c["function"].get("arguments") or "{}"
                hf["tool_calls"].append({"type": "function", "id": c.get("id"), "function": {
                    "name": c["function"]["name"], "arguments": json.loads(args) if isinstance(args, str) else args}})
        for key in ("tool_call_id", "name"):
            if m.get(key):
                hf[key] = m[key]
        out.append(hf)
    return out


def main(argv: list[str] | None = None) -> None:
    """Run as a stand-in for `python -m vllm.entrypoints.openai.api_server` (the vLLM flags it understands;
    others are ignored), so VLLMBackend.start can be tested without vLLM."""
    import argparse
    import os
    import sys

    parser = argparse.ArgumentParser(description="loopback multi-LoRA test server (vLLM's flags)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--served-model-name")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--lora-modules", nargs="+", default=[])
    parser.add_argument("--max-lora-rank", type=int, default=16)
    args, _ = parser.parse_known_args(argv)
    updating = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true")
    server = LoRAServer.from_pretrained(args.model, served_name=args.served_model_name or args.model,
                                        max_lora_rank=args.max_lora_rank, runtime_lora_updating=updating,
                                        host=args.host, port=args.port)
    for spec in args.lora_modules:
        name, _, path = spec.partition("=")
        answer = server.load(name, path)
        if answer.status != 200:
            sys.exit(f"cannot load --lora-modules {spec}: {answer.json}")
    server.start()
    threading.Event().wait()  # serve until terminated


if __name__ == "__main__":
    main()
