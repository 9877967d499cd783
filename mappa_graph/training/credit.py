"""Credit assignment: judged actions to per-sample rewards to advantages. Pure functions, no torch.

MAPPA's default (and ours): each action is one sample whose reward is its own process score (process weight
1, outcome weight 0, no discounting), and advantages are REINFORCE++-normalised over the global batch of all
agents' actions, because agents see different upstream inputs, so GRPO's identical-state group assumption
fails. The outcome-only mode (every action gets the episode's outcome) is the baseline it is compared to.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..traces import Action, Episode, Reward


class Sample(BaseModel):
    """One training sample: an agent's action (exact tokens) and its judged reward."""

    action_id: str
    episode_id: str
    agent: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    behaviour_logprobs: list[float] | None = None
    temperature: float = 1.0  # what the behaviour log-probs were sampled at; training divides logits by it
    reward: float
    advantage: float = 0.0


def sample_from_action(action: Action, score: float) -> Sample:
    return Sample(
        action_id=action.id,
        episode_id=action.episode_id,
        agent=action.agent,
        prompt_token_ids=action.prompt_token_ids or [],
        output_token_ids=action.output_token_ids or [],
        behaviour_logprobs=action.output_logprobs,
        temperature=action.temperature or 1.0,  # unrecorded (older traces): the plain softmax
        reward=score,
    )


class RewardConfig(BaseModel):
    """How judged actions become rewards and advantages."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["process", "outcome"] = Field("process", description="process scores, or outcome-only baseline")
    process_weight: float = Field(1.0, description="weight of the action's own judged score")
    outcome_weight: float = Field(0.0, description="weight of the episode outcome added to every action")
    discount: float | None = Field(None, ge=0.0, le=1.0, description="return-to-go over an agent's later actions")
    estimator: Literal["reinforce++", "group"] = Field(
        "reinforce++", description="global batch normalisation, or group baseline over a task's rollouts"
    )
    normalize_per_agent: bool = Field(False, description="whiten each agent's advantages apart (the MAPPA release "
                                      "does, one process group per agent); False: the whole batch together")
    # Off by default: under REINFORCE++ a group whose G rollouts all agree still carries signal against the
    # global batch mean (measured on the arithmetic team: filtering it halved the samples and stalled learning).
    filter_zero_signal: bool = Field(False, description="drop (task, agent) groups whose rewards are all equal")
    min_episode_score: float | None = Field(None, description="drop episodes whose mean score is below this")
    filter_until_iteration: int | None = Field(None, description="apply min_episode_score only before this")


class CreditStats(BaseModel):
    samples: int = 0
    unscored: int = 0
    no_reward: int = 0
    no_outcome: int = 0
    filtered_zero_signal: int = 0
    filtered_low_quality_episodes: int = 0
    greedy: int = 0  # actions decoded greedily (temperature 0): no sampling distribution to train on


def episode_rewards(
    episodes: Iterable[Episode], rewards: Iterable[Reward], config: RewardConfig
) -> tuple[list[Sample], CreditStats]:
    """One Sample per trainable action, its reward shaped as configured. Unscored actions are left out and
    counted; they never get a neutral score. In outcome mode an episode without an outcome is left out."""
    stats = CreditStats()
    by_action: dict[str, Reward] = {}
    for reward in rewards:
        by_action[reward.action_id] = reward  # later rewards (human overrides) win
    samples: list[Sample] = []
    for episode in episodes:
        trainable = [a for a in episode.actions if a.trainable]
        greedy = [a for a in trainable if a.temperature == 0]
        if greedy:  # an arg-max action was not sampled: its log-probs are no behaviour policy to clip against
            stats.greedy += len(greedy)
            trainable = [a for a in trainable if a.temperature != 0]
        if config.mode == "outcome" or config.outcome_weight:
            if episode.outcome is None:
                stats.no_outcome += len(trainable)
                continue
        values: list[float] = []
        kept = []
        for action in trainable:
            reward = by_action.get(action.id)
            if config.mode == "outcome":
                values.append(float(episode.outcome))  # type: ignore[arg-type]
                kept.append(action)
                continue
            if reward is None:
                stats.no_reward += 1
                continue
            if reward.score is None:
                stats.unscored += 1
                continue
            value = config.process_weight * reward.score
            if config.outcome_weight:
                value += config.outcome_weight * float(episode.outcome)  # type: ignore[arg-type]
            values.append(value)
            kept.append(action)
        if config.discount is not None:
            values = returns_to_go([a.agent for a in kept], values, config.discount)
        samples.extend(sample_from_action(a, v) for a, v in zip(kept, values))
    stats.samples = len(samples)
    return samples, stats


def returns_to_go(agents: Sequence[str], values: Sequence[float], gamma: float) -> list[float]:
    """G_i = r_i + gamma * G_next, where next is the same agent's next action in the episode."""
    out = [0.0] * len(values)
    running: dict[str, float] = {}
    for i in range(len(values) - 1, -1, -1):
        out[i] = values[i] + gamma * running.get(agents[i], 0.0)
        running[agents[i]] = out[i]
    return out


def filter_samples(
    samples: Sequence[Sample],
    task_of: Mapping[str, str | None],
    config: RewardConfig,
    stats: CreditStats,
    *,
    iteration: int = 0,
) -> list[Sample]:
    """Curriculum filtering: drop episodes below the quality threshold (early iterations only, if set), and
    (task, agent) groups whose rewards are all equal, since they carry no learning signal."""
    kept = list(samples)
    threshold = config.min_episode_score
    if threshold is not None and (config.filter_until_iteration is None or iteration < config.filter_until_iteration):
        per_episode: dict[str, list[float]] = defaultdict(list)
        for s in kept:
            per_episode[s.episode_id].append(s.reward)
        low = {e for e, v in per_episode.items() if sum(v) / len(v) < threshold}
        stats.filtered_low_quality_episodes += len(low)
        kept = [s for s in kept if s.episode_id not in low]
    if config.filter_zero_signal:
        groups = _groups(kept, task_of)
        flat = {key for key, members in groups.items() if len({kept[i].reward for i in members}) <= 1}
        dropped = {i for key in flat for i in groups[key]}
        stats.filtered_zero_signal += len(dropped)
        kept = [s for i, s in enumerate(kept) if i not in dropped]
    stats.samples = len(kept)
    return kept


def _groups(samples: Sequence[Sample], task_of: Mapping[str, str | None]) -> dict[tuple[str, str], list[int]]:
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        task = task_of.get(s.episode_id) or s.episode_id
        groups[(task, s.agent)].append(i)
    return groups


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    return mean, math.sqrt(var)


def reinforce_pp_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """REINFORCE++: (r - mean) / std over the whole batch, all agents together."""
    if not rewards:
        return []
    mean, std = _mean_std(rewards)
    return [(r - mean) / (std + eps) for r in rewards]


def group_advantages(
    samples: Sequence[Sample], task_of: Mapping[str, str | None], *, per_agent_norm: bool, eps: float = 1e-6
) -> list[float]:
    """r minus the mean of the same agent on the same task (its G rollouts); optionally divided by the
    agent's advantage std across the batch."""
    adv = [0.0] * len(samples)
    for members in _groups(samples, task_of).values():
        mean, _ = _mean_std([samples[i].reward for i in members])
        for i in members:
            adv[i] = samples[i].reward - mean
    if per_agent_norm:
        by_agent: dict[str, list[int]] = defaultdict(list)
        for i, s in enumerate(samples):
            by_agent[s.agent].append(i)
        for members in by_agent.values():
            _, std = _mean_std([adv[i] for i in members])
            for i in members:
                adv[i] = adv[i] / (std + eps)
    return adv


Estimator = Callable[[Sequence[Sample], Mapping[str, str | None]], list[float]]


def assign_advantages(samples: Sequence[Sample], task_of: Mapping[str, str | None], config: RewardConfig) -> None:
    """Set `advantage` on each sample with the configured estimator."""
    if config.estimator == "reinforce++" and config.normalize_per_agent:
        values = [0.0] * len(samples)
        by_agent: dict[str, list[int]] = defaultdict(list)
        for i, s in enumerate(samples):
            by_agent[s.agent].append(i)
        for members in by_agent.values():
            for i, a in zip(members, reinforce_pp_advantages([samples[i].reward for i in members])):
                values[i] = a
    elif config.estimator == "reinforce++":
        values = reinforce_pp_advantages([s.reward for s in samples])
    else:
        values = group_advantages(samples, task_of, per_agent_norm=config.normalize_per_agent)
    for s, a in zip(samples, values):
        s.advantage = a
