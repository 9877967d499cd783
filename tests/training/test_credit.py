"""Advantage maths on hand-made cases."""

import math

import pytest

from mappa_graph import Action, Episode, Reward
from mappa_graph.training.credit import (
    CreditStats,
    RewardConfig,
    Sample,
    assign_advantages,
    episode_rewards,
    filter_samples,
    group_advantages,
    reinforce_pp_advantages,
    returns_to_go,
)


def _episode(task: str, scores: dict[str, float | None], outcome: float | None = None):
    ep = Episode(task_id=task, outcome=outcome)
    rewards = []
    for agent, score in scores.items():
        a = Action(episode_id=ep.id, node=agent, agent=agent, prompt_token_ids=[1], output_token_ids=[2],
                   output_logprobs=[-1.0])
        ep.actions.append(a)
        rewards.append(Reward(action_id=a.id, episode_id=ep.id, agent=agent, judge="j", score=score,
                              unscored_reason=None if score is not None else "bad reply"))
    return ep, rewards


def _s(agent: str, reward: float, episode: str = "e") -> Sample:
    return Sample(action_id="a", episode_id=episode, agent=agent, prompt_token_ids=[1], output_token_ids=[2], reward=reward)


def test_reinforce_pp_normalises_over_the_whole_batch() -> None:
    adv = reinforce_pp_advantages([1.0, 0.0, 0.5, 0.5])
    # mean 0.5, std sqrt(0.125)
    std = math.sqrt(0.125)
    assert adv == pytest.approx([0.5 / std, -0.5 / std, 0.0, 0.0], rel=1e-5)
    assert reinforce_pp_advantages([0.7, 0.7]) == pytest.approx([0.0, 0.0])


def test_group_baseline_is_per_task_and_agent_and_optionally_normalised() -> None:
    samples = [_s("planner", 1.0, "e1"), _s("planner", 0.0, "e2"), _s("coder", 0.8, "e1"), _s("coder", 0.4, "e2"),
               _s("planner", 0.3, "e3")]
    task_of = {"e1": "t1", "e2": "t1", "e3": "t2"}
    assert group_advantages(samples, task_of, per_agent_norm=False) == pytest.approx([0.5, -0.5, 0.2, -0.2, 0.0])
    normed = group_advantages(samples, task_of, per_agent_norm=True)
    planner_std = math.sqrt((0.25 + 0.25 + 0.0) / 3)
    assert normed[:2] == pytest.approx([0.5 / planner_std, -0.5 / planner_std], rel=1e-5)
    assert normed[2:4] == pytest.approx([1.0, -1.0], rel=1e-4)  # coder advantages +-0.2, std 0.2


def test_outcome_mode_gives_every_action_the_episode_outcome() -> None:
    ep1, r1 = _episode("t", {"planner": 1.0, "coder": 0.0}, outcome=0.0)
    ep2, r2 = _episode("t", {"planner": 0.0, "coder": 1.0}, outcome=1.0)
    ep3, r3 = _episode("t", {"planner": 1.0}, outcome=None)
    samples, stats = episode_rewards([ep1, ep2, ep3], r1 + r2 + r3, RewardConfig(mode="outcome"))
    assert [(s.agent, s.reward) for s in samples] == [("planner", 0.0), ("coder", 0.0), ("planner", 1.0), ("coder", 1.0)]
    assert stats.no_outcome == 1


def test_process_mode_uses_own_scores_mixes_outcome_and_excludes_unscored() -> None:
    ep, rewards = _episode("t", {"planner": 0.2, "coder": None, "reporter": 0.6}, outcome=1.0)
    samples, stats = episode_rewards([ep], rewards, RewardConfig())
    assert [(s.agent, s.reward) for s in samples] == [("planner", 0.2), ("reporter", 0.6)]
    assert stats.unscored == 1
    mixed, _ = episode_rewards([ep], rewards, RewardConfig(process_weight=0.5, outcome_weight=0.5))
    assert [s.reward for s in mixed] == pytest.approx([0.6, 0.8])


def test_returns_to_go_follow_each_agents_own_later_actions() -> None:
    assert returns_to_go(["a", "b", "a", "b"], [1.0, 0.0, 1.0, 2.0], 0.5) == pytest.approx([1.5, 1.0, 1.0, 2.0])


def test_curriculum_filter_drops_flat_groups_and_low_quality_episodes_early() -> None:
    samples = [_s("planner", 1.0, "e1"), _s("planner", 1.0, "e2"), _s("coder", 0.9, "e1"), _s("coder", 0.1, "e2")]
    task_of = {"e1": "t", "e2": "t"}
    stats = CreditStats()
    kept = filter_samples(samples, task_of, RewardConfig(filter_zero_signal=True), stats)
    assert [(s.agent, s.reward) for s in kept] == [("coder", 0.9), ("coder", 0.1)]
    assert stats.filtered_zero_signal == 2
    cfg = RewardConfig(filter_zero_signal=False, min_episode_score=0.6, filter_until_iteration=3)
    stats = CreditStats()
    assert [s.episode_id for s in filter_samples(samples, task_of, cfg, stats, iteration=1)] == ["e1", "e1"]
    assert stats.filtered_low_quality_episodes == 1
    assert len(filter_samples(samples, task_of, cfg, CreditStats(), iteration=3)) == 4  # no longer early


def test_assign_advantages_uses_the_configured_estimator() -> None:
    samples = [_s("a", 1.0, "e1"), _s("a", 0.0, "e2")]
    assign_advantages(samples, {"e1": "t", "e2": "t"}, RewardConfig(estimator="group"))
    assert [s.advantage for s in samples] == pytest.approx([0.5, -0.5])
    assign_advantages(samples, {}, RewardConfig())
    assert [s.advantage for s in samples] == pytest.approx([1.0, -1.0], rel=1e-4)


def test_reinforce_pp_can_whiten_each_agents_advantages_apart() -> None:
    samples = [Sample(action_id=f"a{i}", episode_id="e", agent=agent, prompt_token_ids=[1], output_token_ids=[2],
                      reward=reward)
               for i, (agent, reward) in enumerate([("a", 0.0), ("a", 1.0), ("b", 10.0), ("b", 30.0)])]
    assign_advantages(samples, {"e": "t"}, RewardConfig(normalize_per_agent=True))
    assert [round(s.advantage, 4) for s in samples] == [-1.0, 1.0, -1.0, 1.0]
    assign_advantages(samples, {"e": "t"}, RewardConfig())  # the batch together: agent b's large rewards dominate
    assert samples[0].advantage < 0 and samples[1].advantage < 0 and samples[3].advantage > 0


def test_greedy_actions_are_counted_and_never_trained() -> None:
    """A temperature-0 action was not sampled: it has no behaviour distribution to clip against."""
    sampled = Action(node="a", agent="a", prompt_token_ids=[1], output_token_ids=[2], output_logprobs=[-0.5],
                     temperature=0.7)
    greedy = Action(node="a", agent="a", prompt_token_ids=[1], output_token_ids=[3], output_logprobs=[0.0],
                    temperature=0.0)
    episode = Episode(actions=[sampled, greedy])
    rewards = [Reward(action_id=a.id, episode_id=episode.id, agent="a", judge="j", score=0.5) for a in (sampled, greedy)]
    samples, stats = episode_rewards([episode], rewards, RewardConfig())
    assert [s.action_id for s in samples] == [sampled.id] and samples[0].temperature == 0.7
    assert stats.greedy == 1
