"""Training from stored traces (Trainer.train_from_traces, `mappa train --from-traces`): human overrides reach
the update, and the judge report measures the judge against them."""

from __future__ import annotations

import json

import torch

from agents import arithmetic
from mappa_graph import TraceStore, VerifierJudge, judge_report
from mappa_graph.cli import main
from mappa_graph.training.config import TrainConfig
from mappa_graph.training.credit import RewardConfig


def _trainer(out, judge=None, *, store=None, resume=False, **kw):
    torch.manual_seed(0)
    config = TrainConfig(run_name="t", output_dir=str(out), iterations=3, tasks_per_iteration=6, rollouts_per_task=2,
                         # one episode at a time: the engine then samples the same tokens whatever the machine's
                         # load (concurrent rows batch by timing), so the stored actions are the same every run
                         rollout_concurrency=1, lr=5e-2, ppo_epochs=1, max_new_tokens=6,
                         frozen_agents=["planner"], reward=RewardConfig(filter_zero_signal=False),
                         kl_coef=0.0,  # no KL in the reward: all-equal judge scores then carry no signal at all
                         **kw)
    trainer = arithmetic.build_trainer(config, arithmetic.warm_policies(), store=store, resume=resume)
    trainer.judge = judge or VerifierJudge(lambda action, episode, ref: 0.0, name="stingy")  # all actions look bad
    return trainer


def _logprob(trainer, action) -> float:
    with torch.no_grad():
        [lp] = trainer.policies.token_logprobs("calculator", [action.prompt_token_ids], [action.output_token_ids])
    return float(lp.detach().sum())


def test_a_human_override_moves_that_agents_adapter_toward_the_corrected_action(tmp_path) -> None:
    trainer = _trainer(tmp_path)
    trainer.rollout(trainer.sample_tasks(1), 1)  # stored, not yet judged
    store = TraceStore(tmp_path / "traces.db")
    actions = [a for e in store.episodes(run="t") for a in e.actions if a.agent == "calculator" and a.trainable]
    action, others = actions[0], actions[1:]
    planner_before = {n: p.detach().clone() for n, p in trainer.policies.adapter_parameters("planner").items()}

    # the judge scores everything 0: no signal, no move (REINFORCE++ advantages are all 0)
    control = trainer.train_from_traces()
    assert control["offline"]["judged_now"] > 0 and control["offline"]["overridden"] == 0
    unmoved = [_logprob(trainer, a) for a in actions]

    assert main(["override", "--db", str(tmp_path / "traces.db"), "--action", action.id, "--score", "1.0",
                 "--by", "alice", "--reason", "the calculator was right; the judge misread the expression"]) == 0
    record = trainer.train_from_traces()
    assert record["offline"]["overridden"] == 1 and record["offline"]["judged_now"] == 0
    moved = [_logprob(trainer, a) - u for a, u in zip(actions, unmoved)]
    # the corrected action gained against the others, which now carry negative advantages (its own absolute
    # log-prob may still fall when the others share its tokens: the update raises the advantage-weighted sum)
    assert moved[0] > sum(moved[1:]) / len(others) + 1e-3, moved
    for name, before in planner_before.items():  # the frozen planner never moves
        assert torch.equal(before, trainer.policies.adapter_parameters("planner")[name])

    report = judge_report(store, run="t", judge="stingy")
    assert report.human.n == 1 and report.human.mean_abs_diff == 1.0 and report.human.within_0_2 == 0.0
    assert "agreement with human overrides (n=1)" in report.to_table()


def test_stale_and_unlogged_actions_are_dropped_and_counted(tmp_path) -> None:
    trainer = _trainer(tmp_path)
    trainer.rollout(trainer.sample_tasks(1), 1)
    trainer.iteration = 5  # five updates later: the stored rollouts of iteration 1 are 5 versions old
    record = trainer.train_from_traces(max_staleness=4)
    assert record["offline"]["stale_actions"] > 0 and all(a["samples"] == 0 for a in record["agents"].values())
    assert trainer.train_from_traces(max_staleness=None)["agents"]["calculator"]["samples"] > 0


def test_cli_trains_from_a_trace_store(tmp_path, monkeypatch) -> None:
    trainer = _trainer(tmp_path / "first")
    trainer.rollout(trainer.sample_tasks(1), 1)
    trainer.score(trainer.store.episodes(run="t"))
    monkeypatch.chdir(tmp_path)
    code = main(["train", "agents.arithmetic:build_trainer", "--from-traces", str(tmp_path / "first" / "traces.db"),
                 "--run-name", "t", "--output-dir", str(tmp_path / "offline"), "--max-new-tokens", "6"])
    assert code == 0
    lines = [json.loads(x) for x in (tmp_path / "offline" / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["offline"]["episodes"] == 12


def test_resuming_an_offline_run_never_deletes_from_the_users_trace_store(tmp_path) -> None:
    """The stored traces belong to the caller: a resumed `--from-traces` run must not drop 'later iterations'."""
    first = _trainer(tmp_path / "first")
    for iteration in (1, 2, 3):
        first.rollout(first.sample_tasks(iteration), iteration)
    store = TraceStore(tmp_path / "first" / "traces.db")
    stored = len(store.episodes(run="t"))
    offline = _trainer(tmp_path / "offline", store=store)
    offline.train_from_traces(max_staleness=None)  # checkpoint of iteration 1 under tmp_path/offline
    resumed = _trainer(tmp_path / "offline", store=store, resume=True)
    assert resumed.iteration == 1 and len(store.episodes(run="t")) == stored == 36
