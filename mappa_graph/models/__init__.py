"""Models: the shared base (a hub name, a local path, the offline `tiny` model or the real `smollm2-135m`), one
LoRA adapter per agent (`AgentPolicies`), the chat model that routes an agent's calls to its adapter, the
batched rollout engine (engine.py), and the supervised warm start.

torch, transformers and peft load on first use, so importing this package stays light.
"""

from __future__ import annotations

from .chat import PolicyChatModel
from .loading import load_base_model
from .policies import AgentPolicies, LoraSettings
from .tiny import build_tiny_model

__all__ = ["AgentPolicies", "LoraSettings", "PolicyChatModel", "build_tiny_model", "load_base_model"]
