"""mappa_graph: fine-tune a team of LangGraph agents from per-action AI feedback (MAPPA).

Only the names a user types are exported here; heavy parts (torch, peft, transformers) load on first use, so
`import mappa_graph` and the tracer stay light.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .instrument import InstrumentedGraph, instrument
from .judge import JudgeError, ProcessJudge, VerifierJudge
from .store import TraceStore
from .traces import Action, Episode, Reward, ToolCall, ToolResult
from .tracing import TraceCollector

_LAZY = {
    "AgentPolicies": "mappa_graph.policy",
    "PolicyChatModel": "mappa_graph.chat",
    "load_base_model": "mappa_graph.models",
    "build_tiny_model": "mappa_graph.tiny",
    "policy_gradient_step": "mappa_graph.update",
    "export_adapters": "mappa_graph.export",
    "AdapterManifest": "mappa_graph.export",
    "load_manifest": "mappa_graph.export",
    "LLMJudge": "mappa_graph.llm_judge",
    "MixJudge": "mappa_graph.judges",
    "OutcomeJudge": "mappa_graph.judges",
    "judge_report": "mappa_graph.judge_report",
    "override_score": "mappa_graph.judge_report",
    "Trainer": "mappa_graph.trainer",
    "Task": "mappa_graph.trainer",
    "TrainConfig": "mappa_graph.config",
    "RewardConfig": "mappa_graph.rewards",
    "bind_adapters": "mappa_graph.bind",
    "merge_adapter": "mappa_graph.bind",
    "LocalBackend": "mappa_graph.serving.local",
    "VLLMBackend": "mappa_graph.serving.vllm",
}

__all__ = [
    "Action",
    "AdapterManifest",
    "AgentPolicies",
    "Episode",
    "InstrumentedGraph",
    "JudgeError",
    "LocalBackend",
    "LLMJudge",
    "MixJudge",
    "OutcomeJudge",
    "RewardConfig",
    "Task",
    "TrainConfig",
    "Trainer",
    "PolicyChatModel",
    "ProcessJudge",
    "Reward",
    "ToolCall",
    "ToolResult",
    "TraceCollector",
    "TraceStore",
    "VLLMBackend",
    "VerifierJudge",
    "bind_adapters",
    "build_tiny_model",
    "export_adapters",
    "instrument",
    "judge_report",
    "load_base_model",
    "load_manifest",
    "merge_adapter",
    "override_score",
    "policy_gradient_step",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mappa_graph' has no attribute {name!r}")
