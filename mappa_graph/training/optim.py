"""Optimisers, one per adapter, each over that adapter's LoRA tensors only, so a step can never touch another
agent's weights."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ..models.policies import AgentPolicies


class AgentOptimizers:
    """One AdamW per agent over that agent's LoRA tensors only, so a step can never touch another agent."""

    def __init__(self, policies: AgentPolicies, *, lr: float = 1e-3, weight_decay: float = 0.0) -> None:
        import torch

        self.policies = policies
        # keyed by adapter: agents that share an adapter share its optimiser
        self.optimizers: dict[str, torch.optim.Optimizer] = {
            adapter: torch.optim.AdamW(
                list(policies.adapter_parameters(adapter).values()), lr=lr, weight_decay=weight_decay
            )
            for adapter in policies.adapters
        }

    def __getitem__(self, agent: str) -> torch.optim.Optimizer:
        return self.optimizers[self.policies.adapter_of[self.policies.check_agent(agent)]]

    def state_dict(self) -> dict[str, dict]:
        return {adapter: opt.state_dict() for adapter, opt in self.optimizers.items()}

    def load_state_dict(self, state: Mapping[str, dict]) -> None:
        for adapter, opt_state in state.items():
            self.optimizers[adapter].load_state_dict(opt_state)
