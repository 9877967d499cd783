"""A trace store of scored episodes with known outcomes, shared by the report, override and CLI tests."""

from __future__ import annotations

from mappa_graph import Action, Episode, Reward, TraceStore, VerifierJudge


def score_of(action: Action, episode: Episode) -> float:
    """A judge that likes successful episodes, long outputs and later positions: biases to find."""
    base = 0.6 if episode.outcome else 0.2
    return round(min(1.0, base + 0.05 * action.index + len(action.output_text) / 1000), 4)


def build_store(path) -> tuple[TraceStore, list[Episode]]:
    store = TraceStore(path)
    episodes = []
    for e in range(12):
        episode = Episode(run="r1", input=f"task {e}", outcome=float(e % 2), metadata={"task_type": "ab"[e % 3 == 0]})
        for i, agent in enumerate(["solver", "executor", "verifier"]):
            episode.actions.append(Action(episode_id=episode.id, node=agent, agent=agent, index=i,
                                          output_message={"role": "assistant", "content": "x" * (10 + 20 * e + i)}))
        episodes.append(episode)
    store.add_episodes(episodes)
    judge = VerifierJudge(lambda a, ep, ref: score_of(a, ep), name="coach")
    store.add_rewards(r for episode in episodes for r in judge.score(episode))
    # One unscored verdict, worded the way LLMJudge words them.
    last = episodes[-1].actions[-1]
    store.add_rewards([Reward(action_id=last.id, episode_id=last.episode_id, agent=last.agent, judge="coach",
                              unscored_reason=f"judge 'coach' could not score action {last.id[:8]} (node 'verifier', "
                                              "agent 'verifier'): score 11 outside 0-10 (still unusable after 1 "
                                              "repair request(s))")])
    other = Episode(run="r2", input="other run", outcome=1.0,
                    actions=[Action(node="solver", agent="solver", output_message={"role": "assistant", "content": "y"})])
    store.add_episode(other)
    return store, episodes
