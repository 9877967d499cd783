"""The trainer on the arithmetic team (tiny warm-started model)."""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from agents import arithmetic
from mappa_graph.training.config import TrainConfig, add_config_arguments, config_from_args
from mappa_graph.training.credit import RewardConfig

ROOT = Path(__file__).resolve().parents[2]


def _config(out: Path, **kw) -> TrainConfig:
    base = dict(run_name="t", output_dir=str(out), iterations=3, tasks_per_iteration=6, rollouts_per_task=2,
                rollout_concurrency=2, lr=5e-3, ppo_epochs=2, max_new_tokens=6, checkpoint_every=1,
                reward=RewardConfig(filter_zero_signal=False))
    base.update(kw)
    return TrainConfig(**base)


def _policies():
    torch.manual_seed(0)
    return arithmetic.warm_policies()


def _adapters(trainer) -> dict[str, torch.Tensor]:
    return {f"{a}:{n}": p.detach().clone() for a in trainer.policies.adapters
            for n, p in trainer.policies.adapter_parameters(a).items()}


def test_frozen_agent_and_base_stay_bit_identical(tmp_path) -> None:
    trainer = arithmetic.build_trainer(_config(tmp_path, frozen_agents=["planner"]), _policies())
    before = {n: p.detach().clone() for n, p in trainer.policies.model.named_parameters()}
    record = trainer.step()
    after = dict(trainer.policies.model.named_parameters())
    calc = set(trainer.policies.adapter_parameters("calculator"))
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved and moved <= calc
    assert record["agents"]["planner"]["samples"] == 0 and record["agents"]["calculator"]["samples"] > 0
    assert record["agents"]["calculator"]["tokens"] > 0
    assert 0.0 <= record["agents"]["calculator"]["clip_fraction"] <= 1.0


def test_resume_gives_the_same_next_iteration_state_as_an_unbroken_run(tmp_path) -> None:
    # one rollout at a time: with concurrent rollouts the engine's batches form by timing, which changes the
    # log-probs' float rounding (~1e-7), and Adam's first steps amplify that on near-zero gradients; the tokens
    # stay the same (tests/models/test_engine.py), the weights only to ~1e-4
    unbroken = arithmetic.build_trainer(_config(tmp_path / "a", rollout_concurrency=1), _policies())
    unbroken.train(2)
    want = _adapters(unbroken)
    want_opt = unbroken.optimizers.state_dict()

    first = arithmetic.build_trainer(_config(tmp_path / "b", rollout_concurrency=1), _policies())
    first.train(1)
    del first  # "killed" after iteration 1's checkpoint
    resumed = arithmetic.build_trainer(_config(tmp_path / "b", rollout_concurrency=1), _policies(), resume=True)
    assert resumed.iteration == 1
    resumed.train(2)
    got = _adapters(resumed)
    assert set(got) == set(want)
    for name in want:
        assert torch.allclose(got[name], want[name], atol=1e-6), name
    for adapter, state in want_opt.items():
        got_state = resumed.optimizers.state_dict()[adapter]["state"]
        for key, tensors in state["state"].items():
            assert torch.allclose(got_state[key]["exp_avg"], tensors["exp_avg"], atol=1e-6)
    lines = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in lines] == [1, 2]


class _Planted:
    """What a tampered checkpoint holds: an object whose unpickling runs code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_checkpoint_that_would_run_code_as_it_loads_is_refused(tmp_path) -> None:
    trainer = arithmetic.build_trainer(_config(tmp_path / "run", iterations=1), _policies())
    trainer.train(1)
    folder = tmp_path / "run" / "checkpoints"
    state = folder / (folder / "latest").read_text().strip() / "state.pt"
    payload = torch.load(state, weights_only=False)
    payload["trainer"] = {"note": _Planted(tmp_path / "ran")}
    torch.save(payload, state)
    with pytest.raises(ValueError, match="holds more than tensors and plain values, so it was not loaded"):
        arithmetic.build_trainer(_config(tmp_path / "run", iterations=1), _policies(), resume=True)
    assert not (tmp_path / "ran").exists()
    (folder / "latest").write_text("../../elsewhere")
    with pytest.raises(ValueError, match="not a checkpoint of this folder"):
        arithmetic.build_trainer(_config(tmp_path / "run", iterations=1), _policies(), resume=True)


def test_nonfinite_advantage_skips_the_step_and_says_so(tmp_path, caplog) -> None:
    trainer = arithmetic.build_trainer(_config(tmp_path), _policies())
    tasks = trainer.sample_tasks(1)
    episodes = trainer.rollout(tasks, 1)
    samples, _ = trainer.credit(episodes, trainer.score(episodes), 1)
    assert samples
    samples[0].advantage = float("nan")
    before = _adapters(trainer)
    stats = trainer.update(samples)
    bad = trainer.policies.adapter_of[samples[0].agent]
    assert stats[bad]["skipped_step"] == trainer.config.ppo_epochs == 2  # each epoch's step, summed over epochs
    assert "non-finite loss or gradient" in caplog.text
    after = _adapters(trainer)
    assert all(torch.equal(before[n], after[n]) for n in before if n.startswith(f"{bad}:"))


def test_config_loads_from_yaml_toml_and_flags(tmp_path) -> None:
    import argparse

    (tmp_path / "c.yaml").write_text("iterations: 7\nreward:\n  mode: outcome\n")
    (tmp_path / "c.toml").write_text("iterations = 9\nlr = 0.01\n[reward]\nestimator = 'group'\n")
    assert TrainConfig.from_file(tmp_path / "c.yaml").reward.mode == "outcome"
    cfg = TrainConfig.from_file(tmp_path / "c.toml")
    assert (cfg.iterations, cfg.lr, cfg.reward.estimator) == (9, 0.01, "group")
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = parser.parse_args(["--iterations", "4", "--reward.mode", "outcome", "--frozen-agents", '["planner"]',
                              "--tensorboard", "false", "--ray.workers", "3", "--rollout-backend", "ray"])
    cfg = config_from_args(args, TrainConfig.from_file(tmp_path / "c.toml"))
    assert (cfg.iterations, cfg.lr, cfg.reward.mode, cfg.frozen_agents) == (4, 0.01, "outcome", ["planner"])
    assert (cfg.rollout_backend, cfg.ray.workers, cfg.ray.cpus_per_worker) == ("ray", 3, 1.0)
    with pytest.raises(ValueError, match="unknown config format"):
        TrainConfig.from_file(tmp_path / "c.ini")


@pytest.mark.slow
def test_sigkill_mid_run_resumes_losing_at_most_one_iteration(tmp_path, tiny_path) -> None:
    arithmetic.warm_policies()  # build the warm base here, so the child only trains
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "examples" / "arithmetic_team.py"), "--iterations", "6", "--out", str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    time.sleep(0.7)  # land somewhere inside a later iteration
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    done = [json.loads(x)["iteration"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert done and done[-1] < 6
    resumed = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    iterations = [json.loads(x)["iteration"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert iterations == [1, 2, 3, 4, 5, 6]
    from mappa_graph import TraceStore

    with TraceStore(out / "traces.db") as store:
        per_iteration: dict[int, int] = {}
        for ep in store.episodes(run="arith-process"):
            per_iteration[ep.metadata["iteration"]] = per_iteration.get(ep.metadata["iteration"], 0) + 1
    assert per_iteration == {i: 64 for i in range(1, 7)}  # 32 tasks x 2 rollouts, none lost, none twice
    assert (out / "adapters" / "manifest.json").exists()


def test_a_failing_rollout_is_counted_and_dropped_not_fatal(tmp_path, caplog) -> None:
    trainer = arithmetic.build_trainer(_config(tmp_path, tasks_per_iteration=4, rollout_concurrency=1), _policies())
    real = trainer.policies.generate
    calls = {"n": 0}

    def flaky(*args, **kwargs):  # the second model call of the iteration fails inside its node
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("tool server went away")
        return real(*args, **kwargs)

    trainer.policies.generate = flaky
    record = trainer.step()
    assert record["failed_rollouts"] == 1 and record["episodes"] == 7
    assert "tool server went away" in caplog.text
    trainer.graph.flush()
    stored = trainer.store.episodes(run="t")
    assert len(stored) == 8 and sum(1 for e in stored if e.error) == 1  # the failed one is kept, with its error


def test_an_iteration_whose_every_rollout_fails_stops_the_run_with_the_first_error(tmp_path) -> None:
    # a broken model or tool fails every episode: training on nothing for hours, with one warning line per
    # rollout, is the wrong answer; the episodes (with their errors) are still stored
    trainer = arithmetic.build_trainer(_config(tmp_path, tasks_per_iteration=4, rollout_concurrency=2), _policies())

    def broken(*args, **kwargs):
        raise TypeError("pad(): argument 'input' must be Tensor, not NoneType")

    trainer.policies.generate = broken
    with pytest.raises(RuntimeError, match=r"all 8 rollouts of iteration 1 failed.*pad\(\)"):
        trainer.step()
    trainer.graph.flush()
    stored = trainer.store.episodes(run="t")
    assert len(stored) == 8 and all(e.error for e in stored)
    assert trainer.evaluate(trainer.eval_tasks[:2]) == 0.0  # an evaluation reports, it does not end the run


def test_a_factory_hook_gets_each_adapter_version_before_the_rollouts_that_use_it(tmp_path) -> None:
    from mappa_graph.training.ray_rollouts import adapter_checksum
    from mappa_graph.training.trainer import Trainer

    seen: list[tuple[int, dict[str, float]]] = []

    def team(policies):  # a graph served elsewhere returns (graph, push-new-version), e.g. VLLMBackend.sync
        return arithmetic.team_graph(policies, max_new_tokens=6), lambda p, v: seen.append((v, adapter_checksum(p)))

    train, _ = arithmetic.train_and_eval_tasks()
    trainer = Trainer(team, _policies(), arithmetic.process_judge(), train, _config(tmp_path, tasks_per_iteration=3))
    trainer.train(2)
    assert [v for v, _ in seen] == [0, 1]  # the start, then after the first update; none after the last
    assert seen[0][1] != seen[1][1] and trainer.weights_version == 2
    with pytest.raises(TypeError, match="returns a compiled graph or"):
        Trainer(lambda p: (1, 2, 3), trainer.policies, arithmetic.process_judge(), train, _config(tmp_path / "x"))


def test_quick_start_trainer_with_an_llm_judge_steps_and_stores_its_rewards(tmp_path) -> None:
    """The README's quick start: Trainer scored by an LLMJudge (issue 13 item 1 crashed here: score_many's one
    list per episode was stored as if flat)."""
    from mappa_graph import LLMJudge, TraceStore, Trainer
    from mappa_graph.testing import ScriptedChatModel

    judge = LLMJudge(ScriptedChatModel(reply=lambda messages: '{"score": 7, "rationale": "fine"}'))
    train, _ = arithmetic.train_and_eval_tasks()
    config = _config(tmp_path, iterations=1, tasks_per_iteration=2, ppo_epochs=1)
    graph = functools.partial(arithmetic.team_graph, max_new_tokens=config.max_new_tokens)
    trainer = Trainer(graph, _policies(), judge, train, config, outcome=arithmetic.outcome)
    record = trainer.step()
    assert record["agents"]["planner"]["samples"] > 0
    stored = TraceStore(tmp_path / "traces.db").rewards(run="t")
    assert stored and all(r.judge == judge.name and r.score == pytest.approx(0.7) for r in stored)


def test_a_judge_without_score_many_is_refused_with_the_fix(tmp_path) -> None:
    from mappa_graph import Trainer

    class OnlyScore:
        name = "half"

        def score(self, episode, actions=None):
            return []

    train, _ = arithmetic.train_and_eval_tasks()
    with pytest.raises(TypeError, match="lacks score_many.*mappa_graph.judging.Judge"):
        Trainer(arithmetic.team_graph, _policies(), OnlyScore(), train, _config(tmp_path))


def _one_iteration(trainer):
    tasks = trainer.sample_tasks(1)
    episodes = trainer.rollout(tasks, 1)
    return episodes, trainer.score(episodes)


def test_ppo_without_behaviour_log_probs_still_clips_after_the_first_epoch(tmp_path) -> None:
    """Issue 13 item 5: with no recorded log-probs the 'old' policy was recomputed every epoch (ratio 1 forever,
    no clip). It is one snapshot before the first step, so later epochs see the ratio move and clip."""
    trainer = arithmetic.build_trainer(_config(tmp_path, lr=5e-2, ppo_epochs=3, clip_eps=0.01), _policies())
    episodes, rewards = _one_iteration(trainer)
    samples, _ = trainer.credit(episodes, rewards, 1)
    for s in samples:
        s.behaviour_logprobs = None  # a backend that records none
    stats = trainer.update(samples)
    for adapter, s in stats.items():
        assert s["epochs"] == 3
        assert s["clip_fraction_last_epoch"] > 0, adapter  # was 0.0: every epoch compared the policy with itself
        assert s["log_ratio"] != 0.0


def test_reward_kl_reference_pass_runs_in_micro_batches_and_logs_a_kl(tmp_path, monkeypatch) -> None:
    """Issue 13 items 2 and 12: the reference forward for the reward KL ran over the whole iteration at once; and
    in reward mode the logged `kl` was the behaviour log-ratio, not a KL."""
    trainer = arithmetic.build_trainer(_config(tmp_path, kl_coef=0.01, kl_mode="reward", micro_batch_size=3,
                                               ppo_epochs=1), _policies())
    sizes: list[int] = []
    real = trainer.policies.token_logprobs

    def spy(adapter, prompts, outputs, **kw):
        if adapter is None:
            sizes.append(len(prompts))
        return real(adapter, prompts, outputs, **kw)

    monkeypatch.setattr(trainer.policies, "token_logprobs", spy)
    record = trainer.step()
    assert sizes and max(sizes) <= 3 and sum(sizes) == sum(a["samples"] for a in record["agents"].values())
    for agent, stats in record["agents"].items():
        if stats["samples"]:  # the k1 KL of the behaviour policy to the base, per token; the log-ratio apart
            # fresh adapters (LoRA B = 0) are the base: the KL is 0 up to float rounding
            assert abs(stats["kl"]) < 1e-5 and "log_ratio" in stats


def test_eval_every_zero_evaluates_once_at_the_end(tmp_path) -> None:
    """Issue 13 item 12: documented as 'only at the end', it never evaluated."""
    trainer = arithmetic.build_trainer(_config(tmp_path, iterations=2, eval_every=0), _policies())
    trainer.eval_tasks = trainer.eval_tasks[:4]
    records = trainer.train()
    assert "eval_success" not in records[0] and 0.0 <= records[-1]["eval_success"] <= 1.0


def test_eval_tasks_without_an_outcome_are_refused_up_front(tmp_path) -> None:
    from mappa_graph import Trainer

    train, held_out = arithmetic.train_and_eval_tasks()
    with pytest.raises(ValueError, match="need an outcome function"):
        Trainer(arithmetic.team_graph, _policies(), arithmetic.process_judge(), train, _config(tmp_path),
                eval_tasks=held_out)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_loss_aggregation_weighs_tokens_or_actions_as_configured(tmp_path, aggregation) -> None:
    """On the first epoch against a snapshot the ratio is exactly 1, so each token's loss is -A: the logged loss is
    then the token mean (long actions weigh more) or the mean of per-action means (the MAPPA release)."""
    trainer = arithmetic.build_trainer(_config(tmp_path, ppo_epochs=1, loss_aggregation=aggregation,
                                               frozen_agents=["planner"]), _policies())
    episodes, rewards = _one_iteration(trainer)
    samples, _ = trainer.credit(episodes, rewards, 1)
    for i, s in enumerate(samples):
        s.behaviour_logprobs, s.advantage = None, float(i % 3) - 1.0
    assert len({len(s.output_token_ids) for s in samples}) > 1  # actions of different lengths
    loss = trainer.update(samples)[trainer.policies.adapter_of["calculator"]]["loss"]
    if aggregation == "token_mean":
        want = -sum(s.advantage * len(s.output_token_ids) for s in samples) / sum(len(s.output_token_ids) for s in samples)
    else:
        want = -sum(s.advantage for s in samples) / len(samples)
    assert loss == pytest.approx(want, abs=1e-5)


def test_resume_drops_the_eval_episodes_of_the_iteration_it_redoes(tmp_path) -> None:
    """Issue 13 item 9: eval rollouts of an unfinished iteration were kept, so a resumed run stored them twice."""
    from mappa_graph import TraceStore

    config = _config(tmp_path, eval_every=1, checkpoint_every=2)
    first = arithmetic.build_trainer(config, _policies())
    first.eval_tasks = first.eval_tasks[:3]
    first.evaluate()  # before training: iteration 0, kept
    first.step()  # iteration 1 evaluated, not checkpointed (a kill before iteration 2)
    store = TraceStore(tmp_path / "traces.db")
    assert {e.metadata["iteration"] for e in store.episodes(run="t/eval")} == {0, 1}
    del first
    resumed = arithmetic.build_trainer(config, _policies(), resume=True)
    assert resumed.iteration == 0
    assert {e.metadata["iteration"] for e in resumed.store.episodes(run="t/eval")} == {0}


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
def test_first_epoch_ratio_is_one_at_any_temperature_whatever_the_generation_config(tmp_path, temperature) -> None:
    """Issue 13 item 3: behaviour log-probs came from generate's processed scores (temperature, plus the model's
    generation_config processors) while the loss recomputed raw logits: clip fraction 0.03 at T=0.7 on-policy."""
    policies = _policies()
    policies.model.generation_config.repetition_penalty = 1.1
    policies.model.generation_config.top_k = 20
    trainer = arithmetic.build_trainer(_config(tmp_path, temperature=temperature, ppo_epochs=1), policies)
    episodes, rewards = _one_iteration(trainer)
    samples, _ = trainer.credit(episodes, rewards, 1)
    assert samples and all(s.temperature == temperature for s in samples)
    for adapter in {trainer.policies.adapter_of[s.agent] for s in samples}:
        mine = [s for s in samples if trainer.policies.adapter_of[s.agent] == adapter]
        with torch.no_grad():
            new = trainer.policies.token_logprobs(adapter, [s.prompt_token_ids for s in mine],
                                                  [s.output_token_ids for s in mine],
                                                  temperature=[s.temperature for s in mine])
        worst = max(float((n.detach() - torch.tensor(s.behaviour_logprobs)).abs().max()) for n, s in zip(new, mine))
        assert worst < 1e-5, (adapter, worst)
    stats = trainer.update(samples)
    assert all(s["clip_fraction"] == 0.0 for s in stats.values())


def test_a_shorter_train_call_still_ends_with_its_checkpoint_and_evaluation(tmp_path) -> None:
    """train(iterations=N) below config.iterations ends its own run: the final checkpoint and evaluation follow N."""
    trainer = arithmetic.build_trainer(_config(tmp_path, iterations=5, checkpoint_every=10), _policies())
    trainer.eval_tasks = trainer.eval_tasks[:3]
    records = trainer.train(1)
    assert "eval_success" in records[-1] and (tmp_path / "checkpoints").is_dir()


def test_reward_kl_of_a_sample_without_behaviour_log_probs_is_measured_not_zero(tmp_path) -> None:
    trainer = arithmetic.build_trainer(_config(tmp_path, kl_coef=0.01), _policies())
    episodes, rewards = _one_iteration(trainer)
    samples, _ = trainer.credit(episodes, rewards, 1)
    with torch.no_grad():  # move the adapters away from the base, so the KL to it is not 0
        for adapter in trainer.policies.adapters:
            for p in trainer.policies.adapter_parameters(adapter).values():
                p.add_(0.05 * torch.randn_like(p))
    recorded = trainer._sample_kl(samples)
    for s in samples:
        s.behaviour_logprobs = None
    unrecorded = trainer._sample_kl(samples)
    assert any(abs(k) > 1e-4 for k in unrecorded)  # was exactly 0 for every such sample
    assert all(math.isfinite(k) for k in recorded + unrecorded)


def test_mini_batches_take_one_optimizer_step_each_on_a_disjoint_share_of_the_batch(tmp_path, monkeypatch) -> None:
    """mini_batches=3, ppo_epochs=2: six steps per adapter per iteration, each on a third of its samples (seeded
    shuffle), together covering every sample once per epoch; the logged tokens are the adapter's whole batch."""
    trainer = arithmetic.build_trainer(_config(tmp_path, ppo_epochs=2, mini_batches=3), _policies())
    episodes, rewards = _one_iteration(trainer)
    samples, _ = trainer.credit(episodes, rewards, 1)
    seen: dict[str, list[list[int]]] = {}
    update = type(trainer)._update_adapter

    def spy(self, adapter, part, old, total_tokens, total_samples):
        seen.setdefault(adapter, []).append([id(s) for s in part])
        assert total_samples == len(part) and total_tokens == sum(len(s.output_token_ids) for s in part)
        return update(self, adapter, part, old, total_tokens, total_samples)

    monkeypatch.setattr(type(trainer), "_update_adapter", spy)
    stats = trainer.update(samples)
    for adapter, steps in seen.items():
        mine = [s for s in samples if trainer.policies.adapter_of[s.agent] == adapter]
        assert len(steps) == 6 and stats[adapter]["optimizer_steps"] == 6 and stats[adapter]["epochs"] == 2
        for epoch in (steps[:3], steps[3:]):
            assert sorted(i for part in epoch for i in part) == sorted(id(s) for s in mine)
            assert all(abs(len(p) - len(mine) / 3) < 1 for p in epoch)
        assert stats[adapter]["tokens"] == sum(len(s.output_token_ids) for s in mine)


def test_evaluations_on_the_same_seed_iteration_draw_the_same_rollouts(tmp_path) -> None:
    """Before/after comparisons on common random numbers: an unchanged policy evaluated at another iteration
    with the same seed_iteration gives the same episodes (the default seeds from the current iteration)."""
    trainer = arithmetic.build_trainer(_config(tmp_path), _policies())
    tasks = trainer.sample_tasks(1)[:4]
    outputs = []
    for iteration in (0, 2):
        trainer.iteration = iteration
        trainer.evaluate(tasks, rollouts=2, seed_iteration=0)
        episodes = sorted(trainer.store.episodes(run=trainer.eval_run), key=lambda e: e.started_at)[-8:]
        outputs.append(sorted(str([a.output_token_ids for a in e.actions]) for e in episodes))
    assert outputs[0] == outputs[1]


def test_the_app_as_the_user_holds_it_trains_uncompiled_checkpointed_or_instrumented(tmp_path) -> None:
    """What the README's quick start passes (the StateGraph as built), an app compiled with a checkpointer (each
    rollout needs a thread of its own), and an app already instrumented into a store under another run name
    (its rollouts are this run's: the update, train_from_traces and a resume find them by run_name)."""
    from langgraph.checkpoint.memory import InMemorySaver

    from mappa_graph import TraceStore, Trainer, instrument

    policies = _policies()
    models = {a: policies.chat_model(a, max_new_tokens=6) for a in arithmetic.AGENTS}
    tasks, _ = arithmetic.train_and_eval_tasks()
    store = TraceStore(tmp_path / "app.db")
    apps = {
        "uncompiled": arithmetic.build_arithmetic_graph(models),
        "checkpointed": arithmetic.build_arithmetic_graph(models).compile(checkpointer=InMemorySaver()),
        "instrumented": instrument(arithmetic.build_arithmetic_graph(models).compile(), store=store),
    }
    for name, app in apps.items():
        config = _config(tmp_path / name, run_name=name, iterations=1, tasks_per_iteration=2)
        trainer = Trainer(app, policies, arithmetic.process_judge(), tasks, config, outcome=arithmetic.outcome)
        record = trainer.step()
        assert trainer.failed_rollouts == 0, name
        assert record["agents"]["calculator"]["samples"] > 0, name
        assert len(trainer.store.episodes(run=name)) == 4, name
    assert trainer.store is store and store.count("episodes") == 4
    threads = {e.metadata.get("thread_id") for e in TraceStore(tmp_path / "checkpointed" / "traces.db").episodes()}
    assert len(threads) == 4 and None not in threads  # a new thread per rollout
