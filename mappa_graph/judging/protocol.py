"""The judge protocol: what the trainer, the Ray workers and the report call on any judge.

A judge has a `name`, `score(episode, actions) -> list[Reward]` and `score_many(items) -> list[list[Reward]]`
(one list per item, in order): one return shape, so callers never guess. `Judge` gives `score_many` to a judge
that scores one episode at a time; an LLM judge overrides it to batch its calls. A failed verdict is a Reward
with `score=None` and the reason, never a silent neutral score (the reference falls back to 5/10 on any failure;
we count and exclude).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from ..traces import Action, Episode, Reward

EpisodeItem = Episode | tuple[Episode, Sequence[Action] | None]
"""What `score_many` takes per item: an episode (judge all its actions) or (episode, the actions to judge)."""


@runtime_checkable
class ProcessJudge(Protocol):
    """Scores actions in the context of their episode. Scores are in [0, 1]; None means unscored."""

    name: str

    def score(self, episode: Episode, actions: Sequence[Action] | None = None) -> list[Reward]: ...

    def score_many(self, items: Sequence[EpisodeItem]) -> list[list[Reward]]: ...


class Judge:
    """Base class for a judge that scores one episode at a time: `score_many` is the loop over `score`.

    Subclass it (or write `score_many` yourself) so the trainer, the Ray workers and the judge report can call
    every judge the same way."""

    name: str = "judge"

    def score(self, episode: Episode, actions: Sequence[Action] | None = None) -> list[Reward]:
        raise NotImplementedError(f"{type(self).__name__} must define score(episode, actions=None)")

    def score_many(self, items: Sequence[EpisodeItem]) -> list[list[Reward]]:
        return [self.score(*split_item(item)) for item in items]


def split_item(item: EpisodeItem) -> tuple[Episode, Sequence[Action] | None]:
    return item if isinstance(item, tuple) else (item, None)


def require_judge(judge: Any, *, where: str = "judge") -> ProcessJudge:
    """The judge itself, or a TypeError that names what it lacks and how to give it."""
    missing = [m for m in ("score", "score_many") if not callable(getattr(judge, m, None))]
    if not hasattr(judge, "name"):
        missing.insert(0, "name")
    if missing:
        raise TypeError(f"{where} {type(judge).__name__} is not a judge: it lacks {', '.join(missing)}. Subclass "
                        "mappa_graph.judging.Judge (which gives score_many as a loop over score) or define "
                        "name, score(episode, actions=None) and score_many(items)")
    return judge


def score_all(judge: ProcessJudge, episodes: Sequence[Episode]) -> list[Reward]:
    """Every reward of `judge.score_many(episodes)`, flattened, after checking it answered once per episode."""
    per_episode = judge.score_many(list(episodes))
    if len(per_episode) != len(episodes) or any(not isinstance(r, list) for r in per_episode):
        raise TypeError(f"judge '{judge.name}'.score_many must return one list of Rewards per episode "
                        f"({len(episodes)} lists), got {type(per_episode).__name__} of {len(per_episode)}")
    return [reward for rewards in per_episode for reward in rewards]


def unscored(action: Action, judge: str, reason: str) -> Reward:
    return Reward(
        action_id=action.id,
        episode_id=action.episode_id,
        agent=action.agent,
        judge=judge,
        score=None,
        unscored_reason=reason,
    )


def check_score(value: float, *, low: float = 0.0, high: float = 1.0) -> float:
    """Validate a numeric verdict; raises ValueError naming the bad value."""
    score = float(value)
    if math.isnan(score) or math.isinf(score):
        raise ValueError(f"score {score!r} is not a finite number")
    if not low <= score <= high:
        raise ValueError(f"score {score!r} is outside [{low}, {high}]")
    return score
