"""Models: the shared base (a hub name, a local path, or the offline `tiny` model), one LoRA adapter per agent
(`AgentPolicies`), the chat model that routes an agent's calls to its adapter, and the supervised warm start.

torch, transformers and peft load on first use, so importing this package stays light.
"""

from __future__ import annotations

from .chat import PolicyChatModel
from .loading import load_base_model
from .policies import AgentPolicies, LoraSettings
from .tiny import build_tiny_model

__all__ = ["AgentPolicies", "LoraSettings", "PolicyChatModel", "build_tiny_model", "load_base_model"]
