"""scripts/gpu_check.sh in its CPU mode, on the tiny model: both steps run and one figures file holds them.

The script is what a session lent a GPU runs blind (no network, minutes of device time), so its plumbing is
tested here: the engine tables parsed into numbers, the learning run's before/after with their noise."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from benchmarks.real_model_learning import _gain, parse_args, rollouts_to_reach, train_config

ROOT = Path(__file__).resolve().parents[2]


def test_rollouts_to_reach_is_the_first_point_at_or_above_target() -> None:
    curve = [{"rollouts": 0, "success": 0.1}, {"rollouts": 64, "success": 0.3}, {"rollouts": 128, "success": 0.5}]
    assert rollouts_to_reach(curve, 0.3) == 64
    assert rollouts_to_reach(curve, 0.45) == 128
    assert rollouts_to_reach(curve, 0.6) is None


def test_gain_noise_combines_both_evaluations() -> None:
    gain = _gain({"success": 0.2, "se_binomial": 0.03}, {"success": 0.5, "se_binomial": 0.04})
    assert gain["points"] == pytest.approx(0.3)
    assert gain["se"] == pytest.approx(0.05)
    assert gain["z"] == pytest.approx(6.0)


def test_quick_mode_cuts_the_budget_and_eval_tasks_are_bounded() -> None:
    quick, full = parse_args(["--quick"]), parse_args([])
    assert quick.iterations * quick.tasks * quick.group < full.iterations * full.tasks * full.group
    assert quick.eval_tasks * quick.eval_rollouts < full.eval_tasks * full.eval_rollouts
    with pytest.raises(SystemExit):
        parse_args(["--eval-tasks", "111"])  # only 110 tasks are left out of training


def test_the_two_modes_train_alike_but_for_the_reward_and_the_update_flags_reach_the_trainer(tmp_path: Path) -> None:
    args = parse_args(["--mini-batches", "3", "--normalize-per-agent"])
    process, outcome = train_config("process", args, tmp_path), train_config("outcome", args, tmp_path)
    assert (process.reward.mode, outcome.reward.mode) == ("process", "outcome")
    assert process.mini_batches == 3 and process.reward.normalize_per_agent
    same = {"output_dir", "run_name", "reward"}
    assert process.model_dump(exclude=same) == outcome.model_dump(exclude=same)
    assert process.reward.model_dump(exclude={"mode"}) == outcome.reward.model_dump(exclude={"mode"})
    default = train_config("process", parse_args([]), tmp_path)  # the MAPPA release's train batch and whitening
    assert default.mini_batches == 2 and default.reward.normalize_per_agent
    assert not train_config("process", parse_args(["--no-normalize-per-agent"]), tmp_path).reward.normalize_per_agent


@pytest.mark.slow
def test_gpu_check_cpu_mode_writes_the_figures(tmp_path: Path) -> None:
    out = tmp_path / "figures" / "gpu_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.setdefault("MAPPA_CACHE_DIR", str(ROOT / ".mappa_cache"))
    run = subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "cpu", "--model", "tiny", "--out", str(out)],
                         check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["device"] == "cpu" and figures["model"] == "tiny"
    eps = figures["rollout_engine"]["episodes_per_s"]
    assert [int(r[0]) for r in eps] == [4]  # the CPU mode's one concurrency, parsed out of the table
    assert all(v > 0 and math.isfinite(v) for row in eps for v in row)
    assert figures["rollout_engine"]["tokens_per_s"] and "lora_routing_ms" not in figures["rollout_engine"]
    learning = figures["learning"]
    for point in (learning["before"], *learning["after"].values()):
        assert 0.0 <= point["success"] <= 1.0
        assert point["episodes"] == 32 and point["se_binomial"] >= 0.0
    assert set(learning["after"]) == {"process", "outcome"}
    assert learning["ratio_kind"]
    assert (out.parent / "rollout_engine.log").exists() and (out.parent / "real_model_learning.png").exists()


def test_gpu_check_engine_only_writes_engine_figures_alone_and_refuses_an_unknown_step(tmp_path: Path) -> None:
    # --only engine: the short rerun a session makes when its device time is nearly spent
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.setdefault("MAPPA_CACHE_DIR", str(ROOT / ".mappa_cache"))
    run = subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "cpu", "--model", "tiny", "--only", "engine",
                          "--out", str(out)], check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["learning"] is None and figures["rollout_engine"]["episodes_per_s"]
    assert not (tmp_path / "real_model_learning.log").exists()
    bad = subprocess.run(["bash", "scripts/gpu_check.sh", "--only", "judge"], check=False, cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "--only must be engine or learning" in bad.stderr


def _run(folder: Path, seed: int, process: list[float], outcome: list[float], **settings: object) -> str:
    """A real_model_learning.json as a run writes it, with only what --combine reads."""
    def curve(values: list[float]) -> list[dict]:
        return [{"rollouts": 32 * i, "success": v, "se_binomial": 0.03, "episodes": 220} for i, v in enumerate(values)]

    base = {"model": "smollm2-135m", "iterations": len(process) - 1, "tasks": 16, "group": 2, "mini_batches": 2,
            "normalize_per_agent": True, "lr": 1e-3, "eval_every": 1, "eval_tasks": 110, "eval_rollouts": 2,
            "target_gain": 0.4, "target": None, "seed": seed}
    curves = {"process": curve(process), "outcome": curve(outcome)}
    run = {"model": "smollm2-135m", "settings": {**base, **settings}, "curves": curves, "before": curves["process"][0],
           "after": {m: c[-1] for m, c in curves.items()}, "target": process[0] + 0.4, "budget_rollouts": 96,
           "rollouts_to_target": {}, "ratio_process_over_outcome": None, "ratio_kind": "", "seconds": {"wall": 1.0}}
    folder.mkdir()
    (folder / "real_model_learning.json").write_text(json.dumps(run))
    return str(folder)


def test_combine_reads_the_ratio_off_the_seeds_mean_curves(tmp_path: Path) -> None:
    from benchmarks.real_model_learning import combine

    a = _run(tmp_path / "a", 0, [0.2, 0.5, 0.7, 0.7], [0.2, 0.3, 0.4, 0.7])
    b = _run(tmp_path / "b", 1, [0.2, 0.5, 0.6, 0.8], [0.2, 0.3, 0.5, 0.8])
    figures = combine([a, b], tmp_path / "out")
    assert figures["target"] == pytest.approx(0.6)
    assert [p["success"] for p in figures["curves"]["process"]] == pytest.approx([0.2, 0.5, 0.65, 0.75])
    assert figures["rollouts_to_target"] == {"process": 64, "outcome": 96}  # outcome's mean: 0.2, 0.3, 0.45, 0.75
    assert figures["ratio_process_over_outcome"] == pytest.approx(64 / 96)
    assert figures["curves"]["outcome"][0]["se_binomial"] == pytest.approx(0.03 / math.sqrt(2))
    assert (tmp_path / "out" / "real_model_learning_combined.png").stat().st_size > 0
    c = _run(tmp_path / "c", 2, [0.2, 0.5, 0.7, 0.7], [0.2, 0.3, 0.4, 0.7], lr=5e-4)
    with pytest.raises(SystemExit, match="same settings but the seed"):
        combine([a, c], tmp_path / "out")
