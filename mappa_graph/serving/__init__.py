"""Serving: export adapters with a manifest, bind them into production graphs, and the backends that serve them.

Backends share one surface: `chat_model(agent)`, `load_adapter`, `sync(policies,
iteration)` (usable as `Trainer(on_update=backend.sync)`).

- `LocalBackend`: transformers + peft in this process (AgentPolicies).
- `VLLMBackend`: a vLLM OpenAI-compatible server with `--enable-lora`; adapters are loaded, swapped and
  unloaded at run time, and each agent's calls go to its adapter by model name.
- `PolicyEndpoint`: an OpenAI-compatible server (extra `endpoint`) in front of either of those, routing each
  request of an unchanged app (plain `ChatOpenAI` nodes) to its node's adapter; `remote_router` for an app
  in another process.

Names load on first use, so importing this package pulls in neither torch nor langchain-openai.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {
    "AdapterManifest": "mappa_graph.serving.export",
    "export_adapters": "mappa_graph.serving.export",
    "load_manifest": "mappa_graph.serving.export",
    "bind_adapters": "mappa_graph.serving.bind",
    "merge_adapter": "mappa_graph.serving.bind",
    "LocalBackend": "mappa_graph.serving.local",
    "VLLMBackend": "mappa_graph.serving.vllm",
    "VLLMChatModel": "mappa_graph.serving.vllm",
    "vllm_command": "mappa_graph.serving.vllm",
    "PolicyEndpoint": "mappa_graph.serving.endpoint",
    "remote_router": "mappa_graph.serving.routing",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mappa_graph.serving' has no attribute {name!r}")
