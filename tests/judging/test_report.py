"""Judge quality report (AUROC, per-agent stats, bias probes, plot), human overrides and the `mappa` CLI."""

from __future__ import annotations

import pytest

from mappa_graph.judging.report import auroc, judge_report, pearson, spearman
from mappa_graph.judging.verifier import VerifierJudge
from tests.judging.stored import build_store, score_of


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






