"""The metrics log survives a kill at the worst moment (issue 13 item 9)."""

from __future__ import annotations

import json
import logging

import pytest

from mappa_graph.training.metrics import MetricsLog, read_metrics


def _log_with_torn_tail(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for i in (1, 2, 3):
        log.write({"iteration": i, "loss": 0.5})
    with log.path.open("a") as f:
        f.write('{"iteration": 4, "lo')  # a kill in the middle of iteration 4's line
    return log


def test_a_torn_last_line_is_dropped_with_a_warning_on_resume(tmp_path, caplog) -> None:
    log = _log_with_torn_tail(tmp_path)
    with caplog.at_level(logging.WARNING):
        log.truncate_after(2)  # resuming from the checkpoint of iteration 2
    assert "torn last line" in caplog.text
    assert [r["iteration"] for r in read_metrics(log.path)] == [1, 2]
    log.write({"iteration": 3, "loss": 0.4})
    assert [r["iteration"] for r in log.records()] == [1, 2, 3]


def test_reading_skips_a_torn_tail_but_refuses_corruption_in_the_middle(tmp_path) -> None:
    log = _log_with_torn_tail(tmp_path)
    assert [r["iteration"] for r in read_metrics(log.path)] == [1, 2, 3]
    lines = log.path.read_text().splitlines()
    log.path.write_text("\n".join([lines[0], "{broken", *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        read_metrics(log.path)


def test_truncation_replaces_the_file_atomically(tmp_path, monkeypatch) -> None:
    """A kill during the rewrite must not lose the history: the old file stays until the new one is complete."""
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for i in (1, 2, 3):
        log.write({"iteration": i})
    import mappa_graph.training.metrics as metrics

    def killed(src, dst):
        raise KeyboardInterrupt("killed before the rename")

    monkeypatch.setattr(metrics.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        log.truncate_after(1)
    assert [json.loads(x)["iteration"] for x in log.path.read_text().splitlines()] == [1, 2, 3]


def test_opening_a_log_with_a_torn_tail_cuts_it_so_new_lines_stay_readable(tmp_path, caplog) -> None:
    _log_with_torn_tail(tmp_path)
    with caplog.at_level(logging.WARNING):
        log = MetricsLog(tmp_path / "metrics.jsonl")  # a new run, without --resume
    assert "torn last line" in caplog.text
    log.write({"iteration": 4, "loss": 0.3})
    assert [r["iteration"] for r in read_metrics(log.path)] == [1, 2, 3, 4]
