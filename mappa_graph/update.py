"""The per-agent policy-gradient update: scored Actions in, one AdamW step per agent's adapter out.

This is the vertical slice's update (REINFORCE with a per-agent mean baseline). The trainer builds its
clipped, importance-weighted loss on the same sample type and log-prob pass. Never imports langgraph.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from pydantic import BaseModel

from .traces import Action, Episode, Reward

if TYPE_CHECKING:
    import torch

    from .policy import AgentPolicies


class Sample(BaseModel):
    """One training sample: an agent's action (exact tokens) and its judged reward."""

    action_id: str
    episode_id: str
    agent: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    behaviour_logprobs: list[float] | None = None
    reward: float
    advantage: float = 0.0


def build_samples(
    episodes: Iterable[Episode], rewards: Iterable[Reward], *, agents: Sequence[str] | None = None
) -> tuple[list[Sample], dict[str, int]]:
    """Join trainable actions with their rewards. Unscored rewards and actions without tokens are left out,
    and counted, never given a default score."""
    by_action: dict[str, Reward] = {}
    for reward in rewards:
        by_action[reward.action_id] = reward  # later rewards (e.g. human overrides) win
    skipped = {"unscored": 0, "no_reward": 0, "not_trainable": 0, "other_agent": 0}
    samples = []
    for episode in episodes:
        for action in episode.actions:
            if agents is not None and action.agent not in agents:
                skipped["other_agent"] += 1
                continue
            if not action.trainable:
                skipped["not_trainable"] += int(action.kind == "llm")
                continue
            reward = by_action.get(action.id)
            if reward is None:
                skipped["no_reward"] += 1
            elif reward.score is None:
                skipped["unscored"] += 1
            else:
                samples.append(sample_from_action(action, reward.score))
    return samples, skipped


def sample_from_action(action: Action, score: float) -> Sample:
    return Sample(
        action_id=action.id,
        episode_id=action.episode_id,
        agent=action.agent,
        prompt_token_ids=action.prompt_token_ids or [],
        output_token_ids=action.output_token_ids or [],
        behaviour_logprobs=action.output_logprobs,
        reward=score,
    )


def per_agent_baseline_advantages(samples: Sequence[Sample]) -> list[float]:
    """advantage = reward - mean reward of the same agent in this batch (each agent its own baseline)."""
    totals: dict[str, list[float]] = defaultdict(list)
    for s in samples:
        totals[s.agent].append(s.reward)
    means = {agent: sum(v) / len(v) for agent, v in totals.items()}
    return [s.reward - means[s.agent] for s in samples]


def reinforce_loss(logprobs: Sequence[torch.Tensor], advantages: Sequence[float]) -> torch.Tensor:
    """REINFORCE: -(advantage * sum_t log pi(a_t | s_t)), averaged over the agent's samples."""
    import torch

    if len(logprobs) != len(advantages) or not logprobs:
        raise ValueError(f"need one advantage per sample, got {len(logprobs)} samples and {len(advantages)} advantages")
    terms = [-(adv * lp.sum()) for lp, adv in zip(logprobs, advantages)]
    return torch.stack(terms).mean()


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


def policy_gradient_step(
    policies: AgentPolicies,
    samples: Sequence[Sample],
    optimizers: AgentOptimizers,
    *,
    agents: Sequence[str] | None = None,
    max_grad_norm: float | None = 1.0,
) -> dict[str, float]:
    """One update per agent present in `samples` (or in `agents`): advantages against the agent's own
    baseline, backward into that agent's adapter only, one AdamW step. Returns the loss per agent."""
    import torch

    advantages = per_agent_baseline_advantages(samples)
    by_agent: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        policies.check_agent(s.agent)
        by_agent[s.agent].append(i)
    losses = {}
    for agent, idx in by_agent.items():
        if agents is not None and agent not in agents:
            continue
        opt = optimizers[agent]
        opt.zero_grad(set_to_none=True)
        logprobs = policies.token_logprobs(
            agent, [samples[i].prompt_token_ids for i in idx], [samples[i].output_token_ids for i in idx]
        )
        loss = reinforce_loss(logprobs, [advantages[i] for i in idx])
        loss.backward()
        params = list(policies.adapter_parameters(agent).values())
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
        for i in idx:
            samples[i].advantage = advantages[i]
        losses[agent] = float(loss.detach())
    return losses
