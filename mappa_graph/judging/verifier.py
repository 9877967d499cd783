"""A programmatic judge: a user's function scores each action (a unit test, an answer checker, a rule)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import JudgeError
from ..traces import Action, Episode, Reward
from .protocol import Judge, check_score, unscored

log = logging.getLogger(__name__)

VerifierResult = float | int | bool | None | tuple[float | int | bool | None, str]
VerifierFn = Callable[[Action, Episode, Any], VerifierResult]


class VerifierJudge(Judge):
    """A programmatic judge: `fn(action, episode, reference)` returns a score in [0, 1], or None to abstain,
    optionally as `(score, rationale)`. The episode's `reference` is passed as the third argument.

    Only actions of `kinds` are judged (default: model calls, the trainable ones). An exception from `fn` on one action becomes an unscored Reward for that action only; the other actions
    and the episode are untouched.
    """

    def __init__(
        self,
        fn: VerifierFn,
        *,
        name: str | None = None,
        agents: Sequence[str] | None = None,
        kinds: Sequence[str] = ("llm",),
        strict: bool = False,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"VerifierJudge needs a callable fn(action, episode, reference), got {type(fn).__name__}")
        self.fn = fn
        self.name = name or f"verifier:{getattr(fn, '__name__', 'fn')}"
        self.agents = set(agents) if agents is not None else None
        self.kinds = set(kinds)  # node turns (a ToolNode) show in the trace but are not trained: not judged
        self.strict = strict

    def score(self, episode: Episode, actions: Sequence[Action] | None = None) -> list[Reward]:
        chosen = list(episode.actions if actions is None else actions)
        rewards: list[Reward] = []
        for action in chosen:
            if self.agents is not None and action.agent not in self.agents:
                continue
            if action.kind not in self.kinds:
                continue
            rewards.append(self._score_one(action, episode))
        return rewards

    def _score_one(self, action: Action, episode: Episode) -> Reward:
        where = f"action {action.id[:8]} (node '{action.node}', agent '{action.agent}')"
        try:
            result = self.fn(action, episode, episode.reference)
        except Exception as exc:  # a user's verifier may raise anything; keep the episode, record why
            reason = f"judge '{self.name}' raised {type(exc).__name__} on {where}: {exc}"
            if self.strict:
                raise JudgeError(reason) from exc
            log.warning(reason)
            return unscored(action, self.name, reason)
        rationale = ""
        if isinstance(result, tuple):
            result, rationale = result
        if result is None:
            return unscored(action, self.name, f"judge '{self.name}' abstained on {where}")
        try:
            score = check_score(float(result))
        except (TypeError, ValueError) as exc:
            reason = f"judge '{self.name}' gave an invalid score on {where}: {exc}"
            if self.strict:
                raise JudgeError(reason) from exc
            log.warning(reason)
            return unscored(action, self.name, reason)
        return Reward(
            action_id=action.id,
            episode_id=action.episode_id,
            agent=action.agent,
            judge=self.name,
            score=score,
            raw_score=float(result),
            rationale=rationale,
        )
