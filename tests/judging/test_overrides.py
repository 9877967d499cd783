"""Human overrides: appended, never overwritten, and preferred wherever rewards are read."""

from __future__ import annotations

import pytest

from mappa_graph.judging.overrides import effective_rewards, override_score
from mappa_graph.judging.report import judge_report
from tests.judging.stored import build_store


def test_override_is_recorded_and_wins(tmp_path):
    store, episodes = build_store(tmp_path / "traces.db")
    action = episodes[0].actions[1]
    before = effective_rewards(store, run="r1", judge="coach")[action.id]
    assert before.override_by is None
    reward = override_score(store, action.id, 0.95, by="alice", reason="the code did run; stdout proves it")
    assert (reward.override_by, reward.judge, reward.score) == ("alice", "human", 0.95)
    assert reward.episode_id == episodes[0].id and reward.agent == "executor"
    after = effective_rewards(store, run="r1", judge="coach")
    assert after[action.id].score == 0.95 and len(after) == 36
    assert [r.score for r in store.rewards(action_id=action.id)] == [before.score, 0.95]  # nothing overwritten
    override_score(store, action.id, 0.5, by="bob", reason="second look")
    assert effective_rewards(store, run="r1")[action.id].override_by == "bob"  # the latest override wins
    excluded = override_score(store, episodes[0].actions[0].id, None, by="alice", reason="judge saw a broken tool")
    assert excluded.score is None and "excluded by alice" in excluded.unscored_reason
    report = judge_report(store, "r1", "coach")
    assert report.overrides == 2 and report.unscored == 2
    assert judge_report(store, "r1", "coach", overrides=False).overrides == 0


@pytest.mark.parametrize("kwargs, error", [
    (dict(score=1.5, by="alice", reason="r"), ValueError),
    (dict(score=0.5, by="", reason="r"), ValueError),
    (dict(score=0.5, by="alice", reason=" "), ValueError),
])
def test_override_rejects_bad_input(tmp_path, kwargs, error):
    store, episodes = build_store(tmp_path / "traces.db")
    with pytest.raises(error):
        override_score(store, episodes[0].actions[0].id, **kwargs)
    with pytest.raises(KeyError, match="unknown action"):
        override_score(store, "no-such-action", 0.5, by="alice", reason="r")
