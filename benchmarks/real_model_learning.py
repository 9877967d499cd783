"""Learning on a real pretrained model: the planner -> calculator team on SmolLM2-135M-Instruct, process
rewards vs outcome-only rewards, side by side in one run.

    .venv/bin/python benchmarks/real_model_learning.py [--quick] [--device cpu|cuda] [--threads 2]
        [--iterations 12] [--tasks 16] [--group 2] [--mini-batches 2] [--no-normalize-per-agent]
        [--eval-every 1] [--eval-rollouts 2] [--out DIR]
    .venv/bin/python benchmarks/real_model_learning.py --combine DIR_SEED0 DIR_SEED1 ... [--out DIR]

Steps (all figures land in DIR/real_model_learning.json, the curves in DIR/real_model_learning.png):
1. A short supervised warm start (full fine-tune, cached) teaches SmolLM2 the two output formats ("3+5" and
   "8") on NOISY synthetic traces (agents/arithmetic.py `sft_examples`: a --warm-noise share of each agent's
   replies carries one systematic slip). Zero-shot SmolLM2 never answers in either format, and a clean warm
   start would leave RL little to fix; the noise leaves each agent right only part of the time.
2. Held-out success before training: --eval-tasks tasks (none seen in training) x --eval-rollouts sampled
   rollouts, with the binomial standard error sqrt(p(1-p)/n) and the task-clustered one (rollouts of one task
   are correlated). Both modes start from this same policy (fresh LoRA adapters are the identity), so it is
   measured once.
3. Per mode (process: each agent judged on its own step; outcome: the team's final answer for every
   action), fresh adapters train for --iterations iterations of --tasks x --group rollouts, evaluated every
   --eval-every iterations. The update follows the MAPPA release's settings where they apply: 2 samples per
   prompt, optimiser steps of 16 samples per agent (its train batch 16: --mini-batches 2 of each adapter's 32),
   advantages whitened per agent (its one process group per agent). Rollouts to reach the target
   (start + --target-gain, or --target) per mode, and their ratio process / outcome (goal <= 0.5; a mode
   that never reaches it counts its whole budget, so the ratio is then a bound).
Wall time of each phase is recorded. Defaults are sized for under 60 minutes on 2 CPU cores. One seed's
ratio moves with its evaluation noise (each point +- 0.03, read at steps of 32 rollouts) and its warm start:
`--combine` puts runs on several seeds together, on the mean of their curves.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from agents import arithmetic
from mappa_graph import AgentPolicies, RewardConfig, Task, TrainConfig, Trainer
from mappa_graph.judging.protocol import score_all
from mappa_graph.models import LoraSettings
from mappa_graph.models.sft import warm_start

MODES = ("process", "outcome")
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]  # attention only: the LoRA setting measured for speed
ALL_TASKS = 310  # 1-digit a+b (100) and a-b with a >= b (55), two phrasings each


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test of a few minutes (tiny budget, noisy)")
    parser.add_argument("--model", default="smollm2-135m", help="base model (smollm2-135m, or tiny for tests)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the warm start always runs on the CPU)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--tasks", type=int, default=16, help="tasks per iteration")
    parser.add_argument("--group", type=int, default=2, help="rollouts per task per iteration")
    parser.add_argument("--concurrency", type=int, default=16, help="episodes decoded together (batched engine)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate of the LoRA adapters")
    parser.add_argument("--mini-batches", type=int, default=2, help="optimiser steps per iteration per adapter "
                        "(2: steps of 16 samples, the MAPPA release's train batch)")
    parser.add_argument("--normalize-per-agent", action=argparse.BooleanOptionalAction, default=True,
                        help="whiten each agent's advantages apart, as the MAPPA release does")
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--kl-coef", type=float, default=0.0, help="k1 KL to the base taken off the reward "
                        "(0: no reference pass, a third less compute per update)")
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--eval-tasks", type=int, default=110, help="held-out tasks (at most 110 exist)")
    parser.add_argument("--eval-rollouts", type=int, default=2, help="sampled rollouts per held-out task")
    parser.add_argument("--eval-every", type=int, default=1, help="iterations between held-out evaluations "
                        "(1: rollouts to the target resolved to one iteration's)")
    parser.add_argument("--target-gain", type=float, default=0.4, help="target = start + this")
    parser.add_argument("--target", type=float, default=None, help="absolute target (overrides --target-gain)")
    parser.add_argument("--warm-steps", type=int, default=30)
    parser.add_argument("--warm-batch", type=int, default=16)
    parser.add_argument("--warm-lr", type=float, default=5e-5)
    parser.add_argument("--warm-noise", type=float, default=0.6, help="share of warm-start replies with a slip")
    parser.add_argument("--out", default="runs/real_model_learning")
    parser.add_argument("--combine", nargs="+", metavar="DIR", help="no training: the --out folders of runs on "
                        "several --seed values, as one figure (mean curves, and each seed's own)")
    args = parser.parse_args(argv)
    if args.quick:  # the training and evaluation cut to a few minutes on one thread; the warm start is the
        # full run's (cached, so they share it: fewer steps leave SmolLM2 without the formats and every figure 0)
        args.iterations, args.tasks, args.group, args.eval_every = 2, 8, 2, 1
        args.eval_tasks, args.eval_rollouts = 32, 1
    if not 1 <= args.eval_tasks <= ALL_TASKS - 200:
        parser.error(f"--eval-tasks must be 1..{ALL_TASKS - 200} (the tasks not used for training)")
    return args


def held_out_success(trainer: Trainer, tasks: list[Task], rollouts: int) -> dict[str, Any]:
    """Sampled held-out rollouts: success with its noise, and each agent's step accuracy (the process judge's
    verdicts, computed here for both modes so the curves say which agent improved)."""
    episodes = trainer.rollout(tasks, trainer.iteration, rollouts=rollouts, graph=trainer.eval_graph,
                               run=trainer.eval_run, desc="eval")
    outcomes = [float(e.outcome or 0.0) for e in episodes]
    n = len(outcomes)
    p = sum(outcomes) / n if n else 0.0
    by_task: dict[str, list[float]] = {}
    for e, o in zip(episodes, outcomes):
        by_task.setdefault(e.task_id, []).append(o)
    means = [sum(v) / len(v) for v in by_task.values()]
    k = len(means)
    spread = sum((m - p) ** 2 for m in means) / (k - 1) if k > 1 else 0.0
    steps: dict[str, list[float]] = {}
    for reward in score_all(arithmetic.process_judge(), episodes):
        if reward.score is not None:
            steps.setdefault(reward.agent, []).append(reward.score)
    return {"success": p, "episodes": n, "tasks": k, "failed_rollouts": trainer.failed_rollouts,
            "se_binomial": math.sqrt(p * (1 - p) / n) if n else None,
            "se_task_clustered": math.sqrt(spread / k) if k > 1 else None,
            "step_accuracy": {a: sum(v) / len(v) for a, v in sorted(steps.items())}}


def train_config(mode: str, args: argparse.Namespace, out: Path) -> TrainConfig:
    """One mode's training settings; the two modes differ only in `reward.mode`."""
    return TrainConfig(
        run_name=f"real-{mode}", output_dir=str(out / mode), iterations=args.iterations,
        tasks_per_iteration=args.tasks, rollouts_per_task=args.group, rollout_concurrency=args.concurrency,
        seed=args.seed, lr=args.lr, ppo_epochs=1, mini_batches=args.mini_batches,
        max_new_tokens=args.max_new_tokens, temperature=1.0, kl_coef=args.kl_coef,
        reward=RewardConfig(mode=mode, normalize_per_agent=args.normalize_per_agent),
        checkpoint_every=10_000, keep_checkpoints=1,
    )


def make_trainer(mode: str, warm: Path, train: list[Task], held_out: list[Task], args: argparse.Namespace,
                 out: Path) -> Trainer:
    torch.manual_seed(args.seed)  # same adapter initialisation for both modes
    policies = AgentPolicies.from_pretrained(
        str(warm), list(arithmetic.AGENTS), device=args.device,
        lora=LoraSettings(r=args.lora_r, alpha=2 * args.lora_r, target_modules=TARGET_MODULES))
    config = train_config(mode, args, out)
    graph = partial(arithmetic.team_graph, max_new_tokens=config.max_new_tokens)
    return Trainer(graph, policies, arithmetic.process_judge(), train, config, outcome=arithmetic.outcome,
                   eval_tasks=held_out)


def train_mode(mode: str, trainer: Trainer, start: dict[str, Any], held_out: list[Task],
               args: argparse.Namespace) -> dict[str, Any]:
    per_iteration = args.tasks * args.group
    curve = [{"rollouts": 0, "iteration": 0, **start}]
    train_rewards = []
    started = time.time()
    eval_seconds = 0.0
    for it in range(1, args.iterations + 1):
        record = trainer.step()
        train_rewards.append({"iteration": it, "success_rate": record["success_rate"],
                              **{f"{a}_reward": m.get("mean_reward") for a, m in record["agents"].items()}})
        if it % args.eval_every == 0 or it == args.iterations:
            t = time.time()
            point = held_out_success(trainer, held_out, args.eval_rollouts)
            eval_seconds += time.time() - t
            curve.append({"rollouts": it * per_iteration, "iteration": it, **point})
            print(f"  {mode:8s} iteration {it:3d}  rollouts {it * per_iteration:5d}  held-out "
                  f"{point['success']:.3f} +- {point['se_binomial']:.3f}  steps {_fmt(point['step_accuracy'])}"
                  f"  ({time.time() - started:.0f} s)", flush=True)
    return {"curve": curve, "train": train_rewards, "seconds": time.time() - started,
            "eval_seconds": eval_seconds, "after": curve[-1]}


def rollouts_to_reach(curve: list[dict[str, Any]], target: float) -> int | None:
    return next((p["rollouts"] for p in curve if p["success"] >= target), None)


def compare(curves: dict[str, list[dict[str, Any]]], target: float,
            budget: int) -> tuple[dict[str, int | None], float | None, str]:
    """Rollouts each mode needed to reach the target, their ratio process / outcome, and what kind of figure
    that ratio is: process never reaching the target leaves no ratio; outcome never reaching it, a bound."""
    reached = {m: rollouts_to_reach(curves[m], target) for m in MODES}
    needed = {m: reached[m] if reached[m] is not None else budget for m in MODES}
    ratio = needed["process"] / needed["outcome"] if reached["process"] is not None and needed["outcome"] else None
    kind = ("measured" if all(reached[m] is not None for m in MODES)
            else "upper bound (outcome-only never reached the target)" if reached["process"] is not None
            else "undefined (process rewards never reached the target)")
    return reached, ratio, kind


def combine(folders: list[str], out: Path) -> dict[str, Any]:
    """Runs of the same settings on several seeds, as one figure: the seeds' mean held-out curve per mode (its
    noise is a single run's over the square root of the seed count), the target the mean start + the runs'
    --target-gain, and the ratio on those mean curves, beside each seed's own."""
    runs = [json.loads((Path(f) / "real_model_learning.json").read_text()) for f in folders]
    keep = ("model", "iterations", "tasks", "group", "mini_batches", "normalize_per_agent", "lr", "eval_every",
            "eval_tasks", "eval_rollouts", "target_gain", "target")
    settings = [{k: r["settings"].get(k) for k in keep} for r in runs]
    if any(s != settings[0] for s in settings[1:]):
        raise SystemExit(f"--combine needs runs of the same settings but the seed; got {settings}")
    steps = [[p["rollouts"] for p in r["curves"][m]] for r in runs for m in MODES]
    if any(x != steps[0] for x in steps[1:]):
        raise SystemExit("--combine needs runs evaluated at the same rollouts")
    n = len(runs)

    def mean_point(points: list[dict[str, Any]]) -> dict[str, Any]:
        success = sum(p["success"] for p in points) / n
        se = math.sqrt(sum(p["se_binomial"] ** 2 for p in points)) / n
        return {"rollouts": points[0]["rollouts"], "success": success, "se_binomial": se,
                "episodes": sum(p["episodes"] for p in points)}

    curves = {m: [mean_point([r["curves"][m][i] for r in runs]) for i in range(len(steps[0]))] for m in MODES}
    start = curves[MODES[0]][0]
    given = settings[0]["target"]
    target = given if given is not None else min(start["success"] + settings[0]["target_gain"], 1.0)
    budget = runs[0]["budget_rollouts"]
    reached, ratio, kind = compare(curves, target, budget)
    figures = {
        "model": f"{runs[0]['model']} (mean of {n} seeds)", "seeds": [r["settings"]["seed"] for r in runs],
        "folders": folders, "target": target, "budget_rollouts": budget, "before": start,
        "after": {m: curves[m][-1] for m in MODES}, "gain": {m: _gain(start, curves[m][-1]) for m in MODES},
        "rollouts_to_target": reached, "ratio_process_over_outcome": ratio, "ratio_kind": kind, "curves": curves,
        "per_seed": [{"seed": r["settings"]["seed"], "before": r["before"]["success"], "target": r["target"],
                      "after": {m: r["after"][m]["success"] for m in MODES},
                      "rollouts_to_target": r["rollouts_to_target"], "ratio": r["ratio_process_over_outcome"],
                      "ratio_kind": r["ratio_kind"], "wall_s": r["seconds"]["wall"]} for r in runs],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "real_model_learning_combined.json").write_text(json.dumps(figures, indent=1))
    _plot(figures, out / "real_model_learning_combined.png")
    print(f"{n} seeds, each its own warm start, draws and held-out sample (per seed: before -> after, rollouts "
          "to its own target, ratio):")
    for row in figures["per_seed"]:
        ratio_text = f"{row['ratio']:.2f} ({row['ratio_kind']})" if row["ratio"] is not None else row["ratio_kind"]
        print(f"  seed {row['seed']}: {row['before']:.3f} -> process {row['after']['process']:.3f} / outcome "
              f"{row['after']['outcome']:.3f}; rollouts {row['rollouts_to_target']}; ratio {ratio_text}")
    print(f"mean curves: before {start['success']:.3f} +- {start['se_binomial']:.3f}; after process "
          f"{curves['process'][-1]['success']:.3f}, outcome {curves['outcome'][-1]['success']:.3f}; target "
          f"{target:.3f}: process {reached['process']}, outcome {reached['outcome']} rollouts")
    print(f"ratio process / outcome on the mean curves: {ratio:.2f} ({kind}; goal <= 0.5)" if ratio is not None
          else f"ratio process / outcome on the mean curves: n/a ({kind})")
    print(f"wrote {out / 'real_model_learning_combined.json'} and {out / 'real_model_learning_combined.png'}")
    return figures


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.combine:
        return combine(args.combine, Path(args.out))
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here; run with --device cpu")
    wall = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train = arithmetic.make_tasks(200, seed=1)
    held_out = arithmetic.make_tasks(args.eval_tasks, seed=2, exclude={t.id for t in train})
    timing: dict[str, float] = {}

    t = time.time()
    warm = warm_start(args.model, arithmetic.sft_examples(train, noise=args.warm_noise, seed=3),
                      steps=args.warm_steps, batch_size=args.warm_batch, lr=args.warm_lr, seed=args.seed,
                      progress=False)
    timing["warm_start"] = time.time() - t
    print(f"warm start: {args.warm_steps} steps x {args.warm_batch} on noisy traces (noise {args.warm_noise}), "
          f"{timing['warm_start']:.0f} s (cached after the first run) -> {warm}", flush=True)

    results: dict[str, Any] = {}
    start: dict[str, Any] | None = None
    for mode in MODES:
        t = time.time()
        trainer = make_trainer(mode, warm, train, held_out, args, out)
        timing[f"{mode}_load"] = time.time() - t
        if start is None:
            t = time.time()
            start = held_out_success(trainer, held_out, args.eval_rollouts)
            timing["eval_before"] = time.time() - t
            print(f"held-out success before training: {start['success']:.3f} +- {start['se_binomial']:.3f} "
                  f"(binomial SE, {start['episodes']} episodes = {start['tasks']} tasks x {args.eval_rollouts}; "
                  f"task-clustered SE {start['se_task_clustered']:.3f})  steps {_fmt(start['step_accuracy'])}",
                  flush=True)
        results[mode] = train_mode(mode, trainer, start, held_out, args)
        timing[mode] = results[mode]["seconds"]
        trainer.close()
        del trainer
        gc.collect()
    assert start is not None

    target = args.target if args.target is not None else min(start["success"] + args.target_gain, 1.0)
    budget = args.iterations * args.tasks * args.group
    reached, ratio, ratio_kind = compare({m: results[m]["curve"] for m in MODES}, target, budget)
    timing["wall"] = time.time() - wall
    figures = {
        "model": args.model, "device": args.device, "threads": torch.get_num_threads(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "lora_target_modules": TARGET_MODULES,
        "warm_start": {"path": str(warm), "steps": args.warm_steps, "batch": args.warm_batch, "lr": args.warm_lr,
                       "noise": args.warm_noise, "seconds": timing["warm_start"]},
        "before": start,
        "after": {m: results[m]["after"] for m in MODES},
        "gain": {m: _gain(start, results[m]["after"]) for m in MODES},
        "target": target, "budget_rollouts": budget,
        "rollouts_to_target": reached, "ratio_process_over_outcome": ratio, "ratio_kind": ratio_kind,
        "curves": {m: results[m]["curve"] for m in MODES},
        "train_rewards": {m: results[m]["train"] for m in MODES},
        "seconds": timing,
    }
    (out / "real_model_learning.json").write_text(json.dumps(figures, indent=1))
    _plot(figures, out / "real_model_learning.png")
    _summary(figures)
    print(f"wrote {out / 'real_model_learning.json'} and {out / 'real_model_learning.png'}")
    return figures


def _gain(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float | None]:
    diff = after["success"] - before["success"]
    se = math.sqrt(before["se_binomial"] ** 2 + after["se_binomial"] ** 2)
    return {"points": diff, "se": se, "z": diff / se if se > 0 else None}


def _fmt(steps: dict[str, float]) -> str:
    return " ".join(f"{a} {v:.2f}" for a, v in steps.items())


def _summary(f: dict[str, Any]) -> None:
    b = f["before"]
    print(f"\n== {f['model']} on {f['device']} ({f['threads']} threads), wall {f['seconds']['wall'] / 60:.1f} min "
          f"(warm start {f['seconds']['warm_start']:.0f} s, process {f['seconds']['process']:.0f} s, "
          f"outcome {f['seconds']['outcome']:.0f} s)")
    print(f"held-out success ({b['episodes']} sampled episodes, {b['tasks']} unseen tasks; +- binomial SE):")
    print(f"  before (both modes)      {b['success']:.3f} +- {b['se_binomial']:.3f}   steps {_fmt(b['step_accuracy'])}")
    for m in MODES:
        a, g = f["after"][m], f["gain"][m]
        print(f"  after  {m:8s} rewards {a['success']:.3f} +- {a['se_binomial']:.3f}   steps "
              f"{_fmt(a['step_accuracy'])}   gain {g['points']:+.3f} (SE {g['se']:.3f}, z {g['z'] or 0:.1f})")
    print(f"rollouts to reach held-out success {f['target']:.3f} (budget {f['budget_rollouts']} per mode):")
    for m in MODES:
        n = f["rollouts_to_target"][m]
        print(f"  {m:8s} {n if n is not None else 'not reached'}")
    ratio = f["ratio_process_over_outcome"]
    print(f"ratio process / outcome: {ratio:.2f} ({f['ratio_kind']}; goal <= 0.5)" if ratio is not None
          else f"ratio process / outcome: n/a ({f['ratio_kind']})")


def _plot(f: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, color in zip(MODES, ("tab:blue", "tab:orange")):
        curve = f["curves"][mode]
        ax.errorbar([p["rollouts"] for p in curve], [p["success"] for p in curve],
                    yerr=[p["se_binomial"] for p in curve], color=color, marker="o", capsize=3,
                    label=f"{mode} rewards")
    ax.axhline(f["target"], color="gray", linestyle=":", label=f"target {f['target']:.2f}")
    ax.set_xlabel("training rollouts (episodes)")
    ax.set_ylabel("held-out success (sampled, +- binomial SE)")
    ax.set_title(f"{f['model']}: planner -> calculator, process vs outcome-only rewards", fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1:])
