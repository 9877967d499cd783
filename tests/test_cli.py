"""The mappa command line."""

from __future__ import annotations

import json

import pytest

from mappa_graph.capture.store import TraceStore
from mappa_graph.cli import COMMANDS, main
from mappa_graph.judging.overrides import effective_rewards
from tests.judging.stored import build_store


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
