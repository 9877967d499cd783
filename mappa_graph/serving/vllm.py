"""vLLM backend: one OpenAI-compatible server for the base model with LoRA on, one adapter name per agent.

    backend = VLLMBackend.start(policies=policies)                  # serve its base, load every agent's adapter
    # or: backend = VLLMBackend.connect("http://host:8000"); backend.sync(policies, 0)
    graph = build_team({a: backend.chat_model(a) for a in agents})
    Trainer(graph, policies, judge, tasks, on_update=backend.sync)  # new versions after each update

Each update is exported to a fresh folder and loaded under a fresh name (`{adapter}-v{iteration}`): vLLM
caches adapters by name, and a reused name can keep serving the old weights. Routing switches to the new name
and the old version is unloaded, without restarting the server (`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`,
`POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`). Calls are routed per agent by model name, and
a route that would reach the base model is refused: rolling out the base while training an adapter is a
silent, known failure elsewhere.

Replies record token ids and log-probs as the server gave them (`logprobs=true`,
`extra_body={"return_token_ids": true}`: top-level `prompt_token_ids`, per-choice `token_ids`). A server that
gives no ids (vLLM < 0.10.2) gets the prompt and output re-tokenised here, and the Action says
`token_source="retokenized"`.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatResult
from pydantic import Field

try:
    import httpx
    from langchain_openai import ChatOpenAI
except ImportError as exc:  # the optional extra
    raise ImportError(f'the vLLM backend needs langchain-openai: pip install "mappa-graph[vllm]" ({exc})') from exc

from ..errors import VLLMError
from ..messages import MAPPA_KEY, content_text
from ..models.chat import call_seed, to_hf_messages
from .adapter_files import adapter_rank, save_adapter
from .export import AdapterManifest, load_manifest

INSTALL_HINT = 'pip install "mappa-graph[vllm]"'
_VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's --max-lora-rank accepts
_TOKEN_ID = re.compile(r"^token_id:(\d+)$")


def vllm_command(
    model: str,
    *,
    adapters: Mapping[str, str | Path] | None = None,
    served_model_name: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_lora_rank: int | None = None,
    max_loras: int | None = None,
    max_cpu_loras: int | None = None,
    logprobs_mode: str | None = "processed_logprobs",
    extra_args: Sequence[str] = (),
    python: str | None = None,
) -> list[str]:
    """The vLLM OpenAI-server command line for `model` with LoRA on and `adapters` (name -> folder) loaded at
    start. `--logprobs-mode processed_logprobs` makes the reported log-probs those of the distribution that
    was sampled (temperature applied), which the loss's importance ratio needs; None leaves vLLM's default."""
    from ..models.loading import resolve_model_path

    adapters = dict(adapters or {})
    rank = max_lora_rank or max((adapter_rank(p) for p in adapters.values()), default=16)
    rank = next((r for r in _VLLM_RANKS if r >= rank), rank)
    loras = max_loras or max(1, len(adapters))
    cmd = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
           resolve_model_path(model), "--host", host, "--port", str(port)]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    cmd += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(loras),
            # a sync loads the new version before unloading the old one: room for both avoids reloading from disk
            "--max-cpu-loras", str(max_cpu_loras or 2 * loras)]
    if adapters:
        cmd += ["--lora-modules", *(f"{name}={Path(path).resolve()}" for name, path in adapters.items())]
    if logprobs_mode:
        cmd += ["--logprobs-mode", logprobs_mode]
    return cmd + list(extra_args)


def require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(f"starting a vLLM server needs vLLM, which is not installed: {INSTALL_HINT} "
                          "(or start vLLM yourself and use VLLMBackend.connect(url))")


class VLLMBackend:
    """A vLLM server (started here or already running) and the agent -> adapter-name routes to it."""

    def __init__(
        self,
        base_url: str,
        *,
        base_model: str | None = None,
        tokenizer: Any = None,
        tokenizer_path: str | None = None,
        api_key: str = "EMPTY",
        adapter_dir: str | Path | None = None,
        timeout: float = 120.0,
        process: subprocess.Popen[bytes] | None = None,
    ) -> None:
        root = base_url.rstrip("/")
        self.base_url = root if root.endswith("/v1") else root + "/v1"
        self.api_key = api_key
        self.http = httpx.Client(base_url=self.base_url, timeout=timeout)
        self.process = process
        self.routes: dict[str, str] = {}  # agent -> served adapter name
        self.folders: dict[str, Path] = {}  # adapter name -> the folder this backend exported and loaded
        self.iteration: int | None = None
        self._used: set[str] = set()
        self._tokenizer, self._tokenizer_path = tokenizer, tokenizer_path
        self._lock = threading.RLock()
        cards = self.model_cards()
        base = [c for c in cards if not c.get("parent")] or cards
        if not base:
            raise VLLMError(f"the server at {self.base_url} lists no models")
        chosen = next((c for c in base if c["id"] == base_model), None) if base_model else base[0]
        if chosen is None:
            raise VLLMError(f"the server at {self.base_url} does not serve base model {base_model!r} "
                            f"(it serves: {', '.join(c['id'] for c in base)})")
        self.base_model: str = chosen["id"]
        self.base_root: str | None = chosen.get("root")
        self._used.update(c["id"] for c in cards)
        # where sync exports versions; the server reads them from here, so it must share this filesystem
        self._own_dir = adapter_dir is None
        self.adapter_dir = Path(adapter_dir) if adapter_dir else Path(tempfile.mkdtemp(prefix="mappa-adapters-"))

    @classmethod
    def connect(cls, base_url: str, **kwargs: Any) -> VLLMBackend:
        """Use a running server (`http://host:port` or `.../v1`)."""
        return cls(base_url, **kwargs)

    @classmethod
    def start(
        cls,
        model: str | None = None,
        *,
        manifest: AdapterManifest | str | Path | None = None,
        adapters: Mapping[str, str | Path] | None = None,
        policies: Any = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        served_model_name: str | None = None,
        max_lora_rank: int | None = None,
        max_loras: int | None = None,
        extra_args: Sequence[str] = (),
        logprobs_mode: str | None = "processed_logprobs",
        startup_timeout: float = 900.0,
        log_file: str | Path | None = None,
        **kwargs: Any,
    ) -> VLLMBackend:
        """Launch `python -m vllm.entrypoints.openai.api_server` for `model` and wait until `/v1/models`
        answers. With `manifest`, its base is served and its adapters loaded and routed; with `policies` (for
        training), its base is served, sized for its adapters, and `sync(policies, 0)` loads them."""
        require_vllm()
        if policies is not None:
            model = model or policies.base_path or policies.base_name
            served_model_name = served_model_name or policies.base_name
            max_lora_rank = max_lora_rank or policies.lora.r
            max_loras = max_loras or len(policies.adapters)
        if manifest is not None and not isinstance(manifest, AdapterManifest):
            manifest = load_manifest(manifest)
        if manifest is not None:
            adapters = {**manifest.adapter_names(), **(adapters or {})}
            local = manifest.base_model_path and Path(manifest.base_model_path).exists()
            model = model or (manifest.base_model_path if local else manifest.base_model)
            served_model_name = served_model_name or manifest.base_model
        if model is None:
            raise ValueError("VLLMBackend.start needs a model (or a manifest naming its base model)")
        port = port or _free_port(host)
        cmd = vllm_command(model, adapters=adapters, served_model_name=served_model_name, host=host, port=port,
                           max_lora_rank=max_lora_rank, max_loras=max_loras, logprobs_mode=logprobs_mode,
                           extra_args=extra_args)
        log_path = Path(log_file) if log_file else Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
        env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
        with log_path.open("ab") as log:
            process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://{host}:{port}/v1"
        try:
            _wait_for_models(url, process, startup_timeout, log_path, kwargs.get("api_key", "EMPTY"))
            backend = cls(url, base_model=served_model_name, process=process, **kwargs)
        except BaseException:
            process.terminate()
            raise
        backend._used.update(adapters or {})
        if manifest is not None:
            for entry in manifest.nodes.values():
                backend.route(entry.agent, entry.adapter_name)
        if policies is not None:
            backend.sync(policies, 0)
        return backend

    # ---- server state -------------------------------------------------------------------------------------
    def model_cards(self) -> list[dict[str, Any]]:
        return list(self._request("GET", "/models", what="list models").json().get("data", []))

    def models(self) -> list[str]:
        """Every name the server answers to: the base first, then the loaded adapters."""
        return [c["id"] for c in self.model_cards()]

    def load_adapter(self, name: str, path: str | Path) -> None:
        """Load a PEFT adapter folder under `name`. Names are never reused (vLLM caches by name)."""
        if name == self.base_model:
            raise ValueError(f"adapter name {name!r} is the base model's name; give the adapter its own name")
        with self._lock:
            if name in self.models():
                raise VLLMError(f"adapter name {name!r} is already loaded on {self.base_url}; a reused name can "
                                "serve a stale cached version: load new weights under a new name (sync does)")
            self._request("POST", "/load_lora_adapter", json={"lora_name": name, "lora_path": str(Path(path).resolve())},
                          what=f"load adapter {name!r} from {path}")
            self._used.add(name)

    def unload_adapter(self, name: str) -> None:
        with self._lock:
            routed = sorted(a for a, n in self.routes.items() if n == name)
            if routed:
                raise VLLMError(f"adapter {name!r} is still routed for {', '.join(routed)}; route them elsewhere first")
            self._request("POST", "/unload_lora_adapter", json={"lora_name": name}, what=f"unload adapter {name!r}")
            folder = self.folders.pop(name, None)
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)

    def route(self, agent: str, name: str) -> None:
        """Send `agent`'s calls to the adapter served as `name` (it must be loaded)."""
        self._check_not_base(agent, name)
        served = self.models()
        if name not in served:
            raise VLLMError(f"adapter {name!r} is not loaded on {self.base_url} (served: {', '.join(served)}); "
                            "load_adapter it first")
        with self._lock:
            self.routes[agent] = name

    def adapter_name(self, agent: str) -> str:
        """The served name `agent`'s next call goes to."""
        with self._lock:
            name = self.routes.get(agent)
        if name is None:
            raise VLLMError(f"no adapter is routed for agent {agent!r} (routed: {', '.join(sorted(self.routes)) or 'none'}); "
                            "call backend.sync(policies, 0) or bind a manifest first")
        self._check_not_base(agent, name)
        return name

    def _check_not_base(self, agent: str, name: str) -> None:
        if name == self.base_model:
            raise ValueError(f"agent {agent!r} is routed to the base model {name!r}: its rollouts would come from "
                             "the base, not its adapter, and training on them is silently wrong; route it to an "
                             "adapter name")

    # ---- training: new adapter versions after each update -----------------------------------------------
    def sync(self, policies: Any, iteration: int) -> dict[str, str]:
        """Export every adapter of `policies`, load each under `{adapter}-v{iteration}`, switch the agents
        using it to the new name and unload the version they used before. Returns agent -> served name.
        Runs between rollouts (Trainer calls on_update after the update), so no call is in flight."""
        new = {adapter: self._load_fresh(policies, adapter, f"{adapter}-v{iteration}") for adapter in policies.adapters}
        with self._lock:  # every agent switches at once, after every new version loaded
            old = set(self.routes.values())
            for agent, adapter in policies.adapter_of.items():
                self.routes[agent] = new[adapter]
            stale = old - set(self.routes.values())
            self.iteration = iteration
        for name in sorted(stale):
            self.unload_adapter(name)
        return dict(self.routes)

    def _load_fresh(self, policies: Any, adapter: str, stem: str, attempts: int = 8) -> str:
        """Load `adapter` under an unused name. Several clients may share one server (Ray workers on a node):
        when another one loads the name between our check and our load, take the next name instead."""
        for _ in range(attempts):
            name = self._fresh_name(stem)
            folder = save_adapter(policies, adapter, self.adapter_dir / name)
            try:
                self.load_adapter(name, folder)
            except VLLMError:
                if name not in self.models():
                    raise  # a real failure, not a name taken by another client
                self._used.add(name)
                shutil.rmtree(folder, ignore_errors=True)
                continue
            self.folders[name] = folder
            return name
        raise VLLMError(f"could not find an unused adapter name for {stem!r} on {self.base_url} in {attempts} tries")

    def _fresh_name(self, stem: str) -> str:
        served = set(self.models()) | self._used
        if stem not in served:
            return stem
        k = 2
        while f"{stem}-r{k}" in served:
            k += 1
        return f"{stem}-r{k}"

    # ---- production: a manifest's adapters ----------------------------------------------------------------
    def use_manifest(self, manifest: AdapterManifest, nodes: Sequence[str] | None = None, *, check_base: bool = True) -> None:
        """Load (if not loaded yet) and route the adapters a manifest names for `nodes` (default: all)."""
        if check_base:
            self.check_base(manifest)
        served = set(self.models())
        for node in nodes or list(manifest.nodes):
            entry = manifest.nodes[node]
            if entry.adapter_name not in served:
                self.load_adapter(entry.adapter_name, manifest.adapter_dir(node))
                served.add(entry.adapter_name)
            self.route(entry.agent, entry.adapter_name)

    def check_base(self, manifest: AdapterManifest) -> None:
        from ..models.loading import resolve_model_path

        wanted = {manifest.base_model, manifest.base_model_path, resolve_model_path(manifest.base_model)} - {None}
        have = {self.base_model, self.base_root} - {None}
        same = wanted & have or {w for w in wanted for h in have if _same_path(w, h)}
        if not same:
            raise ValueError(f"base model mismatch: the adapters were trained on {manifest.base_model!r} but the "
                             f"server at {self.base_url} serves {self.base_model!r} (root {self.base_root!r}); start "
                             "vLLM on the manifest's base (`mappa serve --manifest DIR`), or pass check_base=False "
                             "if it is the same model under another name")

    # ---- chat models --------------------------------------------------------------------------------------
    def chat_model(self, agent: str, *, greedy: bool = False, max_new_tokens: int | None = None,
                   temperature: float | None = None, **kwargs: Any) -> VLLMChatModel:
        """A ChatOpenAI whose calls go to `agent`'s current adapter name (looked up per call, so a model made
        before a sync uses the new version after it)."""
        return VLLMChatModel(backend=self, agent=agent, model=self.routes.get(agent, agent), base_url=self.base_url,
                             api_key=self.api_key, temperature=0.0 if greedy else temperature,
                             max_tokens=max_new_tokens, **kwargs)

    @property
    def tokenizer(self) -> Any:
        """The base model's tokenizer, loaded on first need (re-tokenising for a server that gave no ids)."""
        with self._lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                from ..models.loading import resolve_model_path

                path = self._tokenizer_path or self.base_root or self.base_model
                try:
                    self._tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(path))
                except OSError as exc:
                    raise VLLMError(f"the server gave no token ids and no tokenizer loads from {path!r} to "
                                    f"re-tokenise; pass tokenizer= or tokenizer_path= to VLLMBackend ({exc})") from exc
            return self._tokenizer

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def close(self) -> None:
        self.http.close()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if self._own_dir:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)

    def __enter__(self) -> VLLMBackend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _request(self, method: str, path: str, *, what: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, headers={"Authorization": f"Bearer {self.api_key}"}, **kwargs)
        except httpx.HTTPError as exc:
            raise VLLMError(f"cannot {what}: {self.base_url} did not answer ({exc})") from exc
        if response.status_code >= 400:
            try:
                detail = response.json().get("error", response.json())
                detail = detail.get("message", detail) if isinstance(detail, dict) else detail
            except ValueError:
                detail = response.text
            hint = " (was vLLM started with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True?)" if response.status_code == 404 \
                and "lora_adapter" in path else ""
            raise VLLMError(f"cannot {what}: HTTP {response.status_code}: {detail}{hint}")
        return response


class VLLMChatModel(ChatOpenAI):
    """ChatOpenAI routed to one agent's adapter on a VLLMBackend; replies carry `response_metadata["mappa"]`
    (agent, adapter, model, prompt/output token ids, output log-probs, token_source, finished).

    On a vLLM older than `return_token_ids`, `extra_body={"return_tokens_as_token_ids": True}` still gives
    exact output ids (read from the log-prob entries); only the prompt is then re-rendered."""

    backend: Any = Field(default=None, exclude=True)
    agent: str = ""
    logprobs: bool | None = True
    extra_body: Mapping[str, Any] | None = Field(default_factory=lambda: {"return_token_ids": True})
    # streamed chunks would arrive without token ids; invoke() is what records them
    disable_streaming: bool = True
    use_responses_api: bool | None = False

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return False

    @property
    def _llm_type(self) -> str:
        return "mappa-vllm"

    def _get_request_payload(self, input_: Any, *, stop: list[str] | None = None, **kwargs: Any) -> dict:
        payload = super()._get_request_payload(input_, stop=stop, **kwargs)
        payload["model"] = self.backend.adapter_name(self.agent)
        payload["logprobs"] = True
        # vLLM applies the model's generation_config (e.g. top_k=20, top_p=0.8) to requests that leave them
        # unset; the behaviour policy the loss assumes is plain temperature sampling, as on the local backend
        payload.setdefault("top_p", 1.0)
        # temperature only (issue 13 item 3): the server would otherwise apply the model's generation_config
        # (repetition_penalty, min_p, top_k...), and the recorded log-probs would not be the distribution training
        # recomputes
        payload["extra_body"] = {"top_k": -1, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
                                 **(payload.get("extra_body") or {}), "return_token_ids": True}
        return payload

    def _create_chat_result(self, response: Any, generation_info: dict | None = None) -> ChatResult:
        result = super()._create_chat_result(response, generation_info)
        choices = _get(response, "choices") or []
        for gen, choice in zip(result.generations, choices):
            gen.generation_info = {**(gen.generation_info or {}), "_mappa_raw": {
                "prompt_token_ids": _get(response, "prompt_token_ids"),
                "token_ids": _get(choice, "token_ids"),
                "model": _get(response, "model"),
                "finish_reason": _get(choice, "finish_reason"),
            }}
        return result

    def _call_kwargs(self, messages: list[BaseMessage], run_manager: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        meta = (run_manager.metadata if run_manager is not None else None) or {}
        if meta.get("mappa_greedy"):
            kwargs["temperature"] = 0.0
        elif meta.get("mappa_temperature") and kwargs.get("temperature", self.temperature) != 0:
            kwargs["temperature"] = float(meta["mappa_temperature"])  # the trainer's, for a sampled call
        # Explicit in every request: vLLM would otherwise take the model's generation_config default, and
        # the action must record the temperature its log-probs are under (the loss divides by it).
        if kwargs.get("temperature") is None:
            kwargs["temperature"] = 1.0 if self.temperature is None else float(self.temperature)
        if self.seed is None and "seed" not in kwargs:
            seed = call_seed(meta, self.agent, messages)  # (seed, agent, node, step, turn count): reproducible
            if seed is not None:
                kwargs["seed"] = seed
        return kwargs

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        kwargs = self._call_kwargs(messages, run_manager, kwargs)
        return self._attach(super()._generate(messages, stop=stop, run_manager=run_manager, **kwargs), messages, kwargs)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        kwargs = self._call_kwargs(messages, run_manager, kwargs)
        result = await super()._agenerate(messages, stop=stop, run_manager=run_manager, **kwargs)
        return self._attach(result, messages, kwargs)

    def _attach(self, result: ChatResult, messages: list[BaseMessage], kwargs: dict[str, Any]) -> ChatResult:
        for gen in result.generations:
            info = dict(gen.generation_info or {})
            raw = info.pop("_mappa_raw", {})
            info[MAPPA_KEY] = token_record(self.backend, self.agent, raw, info.get("logprobs"), gen.message, messages,
                                           kwargs.get("tools"))
            info[MAPPA_KEY]["temperature"] = float(kwargs["temperature"])  # 0.0: greedy
            gen.generation_info = info
        return result


def token_record(backend: VLLMBackend, agent: str, raw: Mapping[str, Any], logprobs: Any, message: BaseMessage,
                 messages: list[BaseMessage], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The mappa record from what the server returned; ids it did not return are re-tokenised here."""
    content = (logprobs or {}).get("content") or []
    output_logprobs: list[float] | None = [float(c["logprob"]) for c in content]
    output_ids = raw.get("token_ids")
    if output_ids is None and content and all(_TOKEN_ID.match(c.get("token", "")) for c in content):
        output_ids = [int(_TOKEN_ID.match(c["token"]).group(1)) for c in content]  # return_tokens_as_token_ids
    prompt_ids = raw.get("prompt_token_ids")
    finished = raw.get("finish_reason") in ("stop", "tool_calls")
    source = "backend"
    if prompt_ids is None or output_ids is None:
        source = "retokenized"
        tokenizer, hf = backend.tokenizer, to_hf_messages(messages)
        if prompt_ids is None:
            prompt_ids = _render(tokenizer, hf, tools, add_generation_prompt=True)[1]
        if output_ids is None:
            output_ids = _retokenize_output(tokenizer, hf, tools, message, finished)
    if output_logprobs is not None and len(output_logprobs) != len(output_ids):
        output_logprobs = None  # no token-by-token alignment: the loss recomputes rather than mis-pairs
    return {
        "agent": agent,
        "adapter": raw.get("model") or backend.routes.get(agent),
        "model": backend.base_model,
        "prompt_token_ids": [int(t) for t in prompt_ids],
        "output_token_ids": [int(t) for t in output_ids],
        "output_logprobs": output_logprobs,
        "token_source": source,
        "finished": finished,
    }


def _render(tokenizer: Any, hf: list[dict[str, Any]], tools: Any, *, add_generation_prompt: bool) -> tuple[str, list[int]]:
    text = tokenizer.apply_chat_template(hf, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt)
    return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _retokenize_output(tokenizer: Any, hf: list[dict[str, Any]], tools: Any, message: BaseMessage, finished: bool) -> list[int]:
    """The reply's tokens as the chat template writes an assistant turn (tool calls included), cut at the end
    of turn: the text the model produced, as near as text can say. Only used when the server gave no ids."""
    reply = to_hf_messages([message])[0] if isinstance(message, AIMessage) else {"role": "assistant",
                                                                               "content": content_text(message.content)}
    prompt, _ = _render(tokenizer, hf, tools, add_generation_prompt=True)
    full, _ = _render(tokenizer, [*hf, reply], tools, add_generation_prompt=False)
    eos = tokenizer.eos_token or ""
    if full.startswith(prompt):
        text = full[len(prompt):]
        if eos and eos in text:
            text = text[: text.index(eos) + (len(eos) if finished else 0)]
    else:  # a template that is not append-only: fall back to the content
        text = content_text(message.content) + (eos if finished else "")
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)


def _same_path(a: str, b: str) -> bool:
    try:
        return Path(a).exists() and Path(b).exists() and Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _wait_for_models(url: str, process: subprocess.Popen[bytes], timeout: float, log_path: Path, api_key: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise VLLMError(f"vLLM exited with status {process.returncode} before serving (log {log_path}):\n{tail}")
        try:
            if httpx.get(f"{url}/models", headers={"Authorization": f"Bearer {api_key}"}, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise VLLMError(f"vLLM did not answer {url}/models within {timeout:.0f} s (log {log_path})")
