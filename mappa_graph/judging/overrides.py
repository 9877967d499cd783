"""Human corrections of judge scores: appended, never overwritten, and preferred wherever a reward is read.

`override_score` records a human's verdict on one action; `effective_rewards` is what training and the judge
report read: the latest human override of an action, else its judge's reward.
"""

from __future__ import annotations

from ..capture.store import TraceStore
from ..traces import Reward
from .protocol import check_score


def override_score(store: TraceStore, action_id: str, score: float | None, *, by: str, reason: str,
                   judge: str = "human") -> Reward:
    """Append a human verdict on one action (a score in [0, 1], or None to exclude it from training).

    Nothing is overwritten: the judge's reward stays in the store and the override is a newer Reward with
    `override_by` / `override_reason` set, which `effective_rewards` prefers.
    """
    if not by or not by.strip():
        raise ValueError("an override needs who made it: by='alice'")
    if not reason or not reason.strip():
        raise ValueError("an override needs a reason: reason='the code did run, see stdout'")
    action = store.action(action_id)
    value = None if score is None else check_score(score)
    reward = Reward(
        action_id=action.id,
        episode_id=action.episode_id,
        agent=action.agent,
        judge=judge,
        score=value,
        raw_score=value,
        rationale=f"override by {by}: {reason}",
        unscored_reason=None if value is not None else f"excluded by {by}: {reason}",
        override_by=by,
        override_reason=reason,
    )
    store.add_rewards([reward])
    return reward


def effective_rewards(store: TraceStore, *, run: str | None = None, judge: str | None = None,
                      episode_id: str | None = None) -> dict[str, Reward]:
    """The reward to train on, per action id: its latest human override if any, else the latest reward from
    `judge` (from any judge when None; pass a name when several judges scored the same run)."""
    overrides: dict[str, Reward] = {}
    judged: dict[str, Reward] = {}
    for reward in store.rewards(run=run, episode_id=episode_id):
        if reward.override_by is not None:
            overrides[reward.action_id] = reward
        elif judge is None or reward.judge == judge:
            judged[reward.action_id] = reward
    order = dict.fromkeys([*judged, *overrides])
    return {aid: overrides.get(aid) or judged[aid] for aid in order}
