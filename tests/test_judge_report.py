"""Judge quality report (AUROC, per-agent stats, bias probes, plot), human overrides and the `mappa` CLI."""

from __future__ import annotations

import json

import pytest

from mappa_graph.cli import COMMANDS, main
from mappa_graph.judge import VerifierJudge
from mappa_graph.judge_report import auroc, effective_rewards, judge_report, override_score, pearson, spearman
from mappa_graph.store import TraceStore
from mappa_graph.traces import Action, Episode, Reward


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


def test_statistics_by_hand():
    assert auroc([0.1, 0.4, 0.35, 0.8], [False, False, True, True]) == pytest.approx(0.75)
    assert auroc([0.5, 0.5, 0.5], [True, False, False]) == pytest.approx(0.5)  # ties count one half
    assert auroc([0.9, 0.8], [True, True]) is None
    assert auroc([0.9, 0.1, 0.2], [True, False, False]) == 1.0
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0) and pearson([1, 2, 3], [3, 3, 3]) is None
    assert spearman([1, 2, 3, 4], [1, 8, 27, 64]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)


def test_report_agreement_distribution_and_bias_probes(tmp_path):
    store, episodes = build_store(tmp_path / "traces.db")
    report = judge_report(store, "r1", "coach", group_by="task_type")
    assert (report.episodes, report.actions, report.judged, report.scored, report.unscored) == (12, 36, 36, 35, 1)
    # The last episode's mean comes from two actions (the third is unscored), which is still enough to separate.
    assert report.labelled_episodes == 12 and report.successes == 6 and report.auroc == pytest.approx(1.0)
    assert report.unscored_reasons == {"score 11 outside 0-10 (still unusable after 1 repair request(s))": 1}
    solver = next(a for a in report.agents if a.agent == "solver")
    expected = sorted(score_of(ep.actions[0], ep) for ep in episodes)
    assert solver.count == 12 and solver.scored == 12 and solver.unscored == 0
    assert solver.mean == pytest.approx(sum(expected) / 12) and solver.min == expected[0] and solver.max == expected[-1]
    assert solver.median == pytest.approx((expected[5] + expected[6]) / 2)
    verifier = next(a for a in report.agents if a.agent == "verifier")
    assert verifier.count == 12 and verifier.unscored == 1
    assert report.length_bias.n == 35 and report.length_bias.spearman > 0.4  # longer outputs scored higher
    assert [p.index for p in report.position_bias] == [0, 1, 2]
    assert report.position_bias[0].mean < report.position_bias[2].mean and report.position_spearman > 0
    assert {g.group for g in report.groups} == {"a", "b"} and sum(g.count for g in report.groups) == 35
    table = report.to_table()
    for needle in ("AUROC", "1.000", "solver", "executor", "verifier", "length bias", "position bias",
                   "score 11 outside 0-10", "by task_type"):
        assert needle in table
    png = report.save_plot(tmp_path / "plots" / "judge.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert judge_report(store, "r2").judged == 0 and judge_report(store, "r2").auroc is None


def test_report_can_run_a_judge_object_on_stored_episodes(tmp_path):
    store, _ = build_store(tmp_path / "traces.db")
    inverted = VerifierJudge(lambda a, ep, ref: 1.0 - score_of(a, ep), name="inverted")
    report = judge_report(store, "r1", inverted)
    assert report.judge == "inverted" and report.scored == 36 and report.auroc == pytest.approx(0.0)
    assert store.count("rewards") == 37  # it wrote nothing


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


def test_cli_judge_report_and_override(tmp_path, capsys):
    db = tmp_path / "traces.db"
    store, episodes = build_store(db)
    store.close()
    assert {"judge-report", "override"} <= set(COMMANDS)
    assert main(["judge-report", "--db", str(db), "--run", "r1", "--judge", "coach",
                 "--plot", str(tmp_path / "report.png")]) == 0
    out = capsys.readouterr()
    assert "AUROC" in out.out and "solver" in out.out and (tmp_path / "report.png").exists()
    assert main(["judge-report", "--db", str(db), "--run", "r1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["auroc"] == pytest.approx(1.0)

    action_id = episodes[3].actions[2].id
    assert main(["override", "--db", str(db), "--action", action_id, "--score", "0.1", "--by", "carol",
                 "--reason", "wrong verdict accepted"]) == 0
    assert json.loads(capsys.readouterr().out)["override_by"] == "carol"
    with TraceStore(db) as store:
        assert effective_rewards(store, judge="coach")[action_id].score == 0.1

    for argv, message in [
        (["judge-report", "--db", str(tmp_path / "missing.db")], "no trace store at"),
        (["judge-report", "--db", str(db), "--run", "nope"], "unknown run 'nope' (runs: r1, r2)"),
        (["override", "--db", str(db), "--action", "zzz", "--score", "0.5", "--by", "a", "--reason", "r"],
         "unknown action 'zzz'"),
        (["override", "--db", str(db), "--action", action_id, "--score", "7", "--by", "a", "--reason", "r"],
         "outside [0.0, 1.0]"),
        (["override", "--db", str(db), "--action", action_id, "--score", "high", "--by", "a", "--reason", "r"],
         "not a number"),
    ]:
        assert main(argv) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "missing.db").exists()
