"""Training from stored traces: what the store holds, judged where it is not, with human corrections winning.

The on-policy loop judges fresh rollouts only, so a human's `mappa override` never reached training. Here the
batch comes from the trace store: actions without a verdict are judged now, every action's reward is its
effective one (the latest human override, else the judge's), and actions too far off-policy are dropped and
counted. The update that follows is the same clipped one as on-policy, against each action's recorded behaviour
log-probs (an action without them cannot be importance-weighted and is dropped, not re-scored as on-policy).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel

from ..capture.store import TraceStore
from ..judging.overrides import effective_rewards
from ..judging.protocol import ProcessJudge
from ..traces import Action, Episode, Reward


class OfflineStats(BaseModel):
    """What an offline batch held and what was left out, and why."""

    episodes: int = 0
    judged_now: int = 0
    overridden: int = 0
    stale_actions: int = 0
    unversioned_actions: int = 0
    no_behaviour_logprobs: int = 0


def stored_batch(store: TraceStore, judge: ProcessJudge | None, *, run: str, judge_name: str | None,
                 iteration: int, max_staleness: int | None) -> tuple[list[Episode], list[Reward], OfflineStats]:
    """The run's stored episodes and their effective rewards, ready for credit assignment at `iteration`.

    Staleness is counted in iterations: an episode rolled out at iteration i was sampled by the adapters after
    i - 1 updates, so at `iteration` it is `iteration - i` versions old. Episodes with no iteration (traces of a
    production app) are kept and counted as unversioned; the clip bounds how far their ratio can pull."""
    episodes = store.episodes(run=run)
    stats = OfflineStats(episodes=len(episodes))
    if judge is not None:
        scored = {r.action_id for r in store.rewards(run=run)}
        todo = [(e, [a for a in e.actions if a.id not in scored]) for e in episodes]
        todo = [(e, actions) for e, actions in todo if actions]
        if todo:
            fresh = [r for rewards in judge.score_many(todo) for r in rewards]
            store.add_rewards(fresh)
            stats.judged_now = len(fresh)
    chosen = effective_rewards(store, run=run, judge=judge_name)
    stats.overridden = sum(r.override_by is not None for r in chosen.values())
    kept: list[Episode] = []
    for episode in episodes:
        sampled_at = episode.metadata.get("iteration")
        trainable = [a for a in episode.actions if a.trainable]
        if sampled_at is None:
            stats.unversioned_actions += len(trainable)
        elif max_staleness is not None and iteration - int(sampled_at) > max_staleness:
            stats.stale_actions += len(trainable)
            continue
        missing = [a for a in trainable if a.output_logprobs is None]
        stats.no_behaviour_logprobs += len(missing)
        kept.append(_without(episode, missing))
    return kept, [chosen[a.id] for e in kept for a in e.actions if a.id in chosen], stats


def _without(episode: Episode, actions: Sequence[Action]) -> Episode:
    if not actions:
        return episode
    dropped = {a.id for a in actions}
    return episode.model_copy(update={"actions": [a for a in episode.actions if a.id not in dropped]})
