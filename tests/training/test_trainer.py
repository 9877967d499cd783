"""The trainer on the arithmetic team (tiny warm-started model)."""

from __future__ import annotations

import json
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
    unbroken = arithmetic.build_trainer(_config(tmp_path / "a"), _policies())
    unbroken.train(2)
    want = _adapters(unbroken)
    want_opt = unbroken.optimizers.state_dict()

    first = arithmetic.build_trainer(_config(tmp_path / "b"), _policies())
    first.train(1)
    del first  # "killed" after iteration 1's checkpoint
    resumed = arithmetic.build_trainer(_config(tmp_path / "b"), _policies(), resume=True)
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
    assert stats[bad]["skipped_step"] == 1
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
