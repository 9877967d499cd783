"""Judges that compose other judges: a weighted mix, and an outcome judge on the final state.

Both follow the ProcessJudge protocol (`name`, `score(episode, actions)`), so the trainer cannot tell them from
an LLMJudge or a VerifierJudge. `OutcomeJudge` is the outcome-only baseline the benchmarks compare against:
every action gets the episode's outcome, i.e. the "identical assignment" that per-action judging replaces.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

from ..errors import JudgeError
from ..traces import Action, Episode, Reward
from .protocol import EpisodeItem, Judge, ProcessJudge, check_score, require_judge, split_item

log = logging.getLogger(__name__)

OutcomeFn = Callable[[Any, Any], float | int | bool | None]


def _reward(action: Action, episode: Episode, judge: str, score: float | None, **fields: Any) -> Reward:
    return Reward(action_id=action.id, episode_id=action.episode_id or episode.id, agent=action.agent, judge=judge,
                  score=score, **fields)


class MixJudge(Judge):
    """A weighted mean of several judges: `MixJudge([(llm_judge, 0.7), (verifier, 0.3)])`.

    For each action, the mean runs over the parts that judge it (a part whose agent or kind filter skips the action
    is left out, weights renormalised). When a part that should have scored it left it unscored (its LLM call
    failed, its verifier raised), the mixed reward is unscored too and names the failed part: silently taking the
    other parts' score would train on a different reward than the one configured. `on_failed_part="renormalize"`
    opts into the mean over the parts that answered, and the rationale records which part failed. The rationale
    lists each part's verdict.
    """

    def __init__(self, parts: Sequence[tuple[ProcessJudge, float]], *, name: str | None = None,
                 on_failed_part: Literal["unscored", "renormalize"] = "unscored") -> None:
        if on_failed_part not in ("unscored", "renormalize"):
            raise ValueError(f"on_failed_part must be 'unscored' or 'renormalize', got {on_failed_part!r}")
        self.on_failed_part = on_failed_part
        if not parts:
            raise ValueError("MixJudge needs at least one (judge, weight) pair")
        checked = []
        for i, part in enumerate(parts):
            if not (isinstance(part, tuple) and len(part) == 2):
                raise TypeError(f"MixJudge part {i} must be a (judge, weight) pair, got {part!r}")
            judge, weight = part
            require_judge(judge, where=f"MixJudge part {i}")
            weight = float(weight)
            if not math.isfinite(weight) or weight <= 0:
                raise ValueError(f"MixJudge weight {weight!r} of judge '{judge.name}' must be a positive number")
            checked.append((judge, weight))
        self.parts = checked
        self.name = name or "mix(" + ", ".join(f"{j.name}*{w:g}" for j, w in checked) + ")"

    def score(self, episode: Episode, actions: Sequence[Action] | None = None) -> list[Reward]:
        return self.score_many([(episode, actions)])[0]

    def score_many(self, items: Sequence[EpisodeItem]) -> list[list[Reward]]:
        """Each part scores the whole batch through its own `score_many` (an LLM part batches its calls)."""
        items = list(items)
        per_part = [judge.score_many(items) for judge, _ in self.parts]  # [part][item] -> rewards
        return [self._combine(*split_item(item), [outputs[i] for outputs in per_part]) for i, item in enumerate(items)]

    async def ascore(self, episode: Episode, actions: Sequence[Action] | None = None) -> list[Reward]:
        """Runs the parts concurrently (their own `ascore` when they have one, else `score` in a thread)."""

        async def one(judge: ProcessJudge) -> list[Reward]:
            if hasattr(judge, "ascore"):
                return await judge.ascore(episode, actions)  # type: ignore[attr-defined]
            return await asyncio.to_thread(judge.score, episode, actions)

        outputs = await asyncio.gather(*(one(judge) for judge, _ in self.parts))
        return self._combine(episode, actions, list(outputs))

    def _combine(self, episode: Episode, actions: Sequence[Action] | None,
                 outputs: list[list[Reward]]) -> list[Reward]:
        by_part = [{r.action_id: r for r in rewards} for rewards in outputs]
        chosen = list(episode.actions if actions is None else actions)
        judged = {r.action_id for rewards in outputs for r in rewards}
        mixed = []
        for action in chosen:
            if action.id not in judged:  # no part wanted this action (agent or kind filters)
                continue
            total = weight_sum = 0.0
            notes, reasons = [], []
            repaired = False
            for (judge, weight), rewards in zip(self.parts, by_part):
                reward = rewards.get(action.id)
                if reward is None:
                    notes.append(f"{judge.name} (w={weight:g}): not judged")
                    reasons.append(f"{judge.name}: not judged")
                elif reward.score is None:
                    notes.append(f"{judge.name} (w={weight:g}): unscored")
                    reasons.append(f"{judge.name}: {reward.unscored_reason}")
                else:
                    total += weight * reward.score
                    weight_sum += weight
                    repaired |= reward.repaired
                    why = f": {reward.rationale}" if reward.rationale else ""
                    notes.append(f"{judge.name} (w={weight:g}): {reward.score:.3f}{why}")
            failed = [r for r in reasons if not r.endswith(": not judged")]
            if failed and (weight_sum == 0 or self.on_failed_part == "unscored"):
                mixed.append(_reward(action, episode, self.name, None, rationale="; ".join(notes),
                                     unscored_reason="a part left it unscored: " + "; ".join(failed)))
            elif weight_sum == 0:
                mixed.append(_reward(action, episode, self.name, None, rationale="; ".join(notes),
                                     unscored_reason="no part judged it: " + "; ".join(reasons)))
            elif failed:  # the opt-in: the mean over the parts that answered, with the failure on record
                mixed.append(_reward(action, episode, self.name, total / weight_sum, repaired=repaired,
                                     rationale="; ".join(notes) + " | renormalised without: " + "; ".join(failed)))
            else:
                mixed.append(_reward(action, episode, self.name, total / weight_sum, rationale="; ".join(notes),
                                     repaired=repaired))
        return mixed


class OutcomeJudge(Judge):
    """Scores the episode's final state: `fn(final_state, reference)` -> a score in [0, 1] (True/False count as
    1/0), or None to abstain. Every judged action gets that score, and it is set as `episode.outcome` (store it
    with `TraceStore.set_outcome`). A raising or invalid `fn` leaves the episode's actions unscored.
    """

    def __init__(self, fn: OutcomeFn, *, name: str | None = None, agents: Sequence[str] | None = None,
                 set_outcome: bool = True, strict: bool = False) -> None:
        if not callable(fn):
            raise TypeError(f"OutcomeJudge needs a callable fn(final_state, reference), got {type(fn).__name__}")
        self.fn = fn
        self.name = name or f"outcome:{getattr(fn, '__name__', 'fn')}"
        self.agents = set(agents) if agents is not None else None
        self.set_outcome = set_outcome
        self.strict = strict

    def outcome(self, episode: Episode) -> tuple[float | None, str]:
        """The episode's outcome score and, when there is none, why."""
        try:
            value = self.fn(episode.final_state, episode.reference)
        except Exception as exc:  # a user's checker may raise anything; the episode stays, unscored
            return None, f"judge '{self.name}' raised {type(exc).__name__} on episode {episode.id[:8]}: {exc}"
        if value is None:
            return None, f"judge '{self.name}' abstained on episode {episode.id[:8]}"
        try:
            return check_score(float(value)), ""
        except (TypeError, ValueError) as exc:
            return None, f"judge '{self.name}' gave an invalid outcome on episode {episode.id[:8]}: {exc}"

    def score(self, episode: Episode, actions: Sequence[Action] | None = None) -> list[Reward]:
        value, reason = self.outcome(episode)
        if value is None:
            if self.strict:
                raise JudgeError(reason)
            log.warning(reason)
        elif self.set_outcome:
            episode.outcome = value
        chosen = [a for a in (episode.actions if actions is None else actions)
                  if self.agents is None or a.agent in self.agents]
        if value is None:
            return [_reward(a, episode, self.name, None, unscored_reason=reason) for a in chosen]
        return [_reward(a, episode, self.name, value, raw_score=value, rationale=f"episode outcome {value:g}")
                for a in chosen]
