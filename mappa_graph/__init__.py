"""mappa_graph: fine-tune a team of LangGraph agents from per-action AI feedback (MAPPA).

Only the names a user types are exported here; the rest lives in the subpackages along the data flow
(`capture` -> `judging` -> `training` -> `serving`, with `models` for the policies). Heavy parts (torch, peft,
transformers) load on first use, so `import mappa_graph` and the tracer stay light.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .capture import InstrumentedGraph, TraceCollector, TraceStore, instrument
from .traces import Action, Episode, Reward, Task

_LAZY = {
    "AgentPolicies": "mappa_graph.models",
    "PolicyChatModel": "mappa_graph.models",
    "Judge": "mappa_graph.judging",
    "LLMJudge": "mappa_graph.judging",
    "MixJudge": "mappa_graph.judging",
    "OutcomeJudge": "mappa_graph.judging",
    "VerifierJudge": "mappa_graph.judging",
    "judge_report": "mappa_graph.judging",
    "override_score": "mappa_graph.judging",
    "Trainer": "mappa_graph.training",
    "TrainConfig": "mappa_graph.training",
    "RewardConfig": "mappa_graph.training",
    "export_adapters": "mappa_graph.serving",
    "bind_adapters": "mappa_graph.serving",
}

__all__ = [
    "Action",
    "AgentPolicies",
    "Episode",
    "InstrumentedGraph",
    "Judge",
    "LLMJudge",
    "MixJudge",
    "OutcomeJudge",
    "PolicyChatModel",
    "Reward",
    "RewardConfig",
    "Task",
    "TraceCollector",
    "TraceStore",
    "TrainConfig",
    "Trainer",
    "VerifierJudge",
    "bind_adapters",
    "export_adapters",
    "instrument",
    "judge_report",
    "override_score",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mappa_graph' has no attribute {name!r}")
