"""Training: rollouts (in-process or on Ray), credit assignment (REINFORCE++), the clipped policy-gradient loss,
one optimiser per adapter, data-parallel updates under torchrun, checkpoints and metrics.

Imports langgraph only through `capture` (enforced by tests/test_import_rules.py). `Trainer` pulls in torch, so
it loads on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .config import RayConfig, TrainConfig
from .credit import RewardConfig, Sample

_LAZY = {"Trainer": "mappa_graph.training.trainer"}

__all__ = ["RayConfig", "RewardConfig", "Sample", "TrainConfig", "Trainer"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mappa_graph.training' has no attribute {name!r}")
