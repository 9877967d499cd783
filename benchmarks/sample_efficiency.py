"""Sample efficiency: process rewards vs outcome-only on the arithmetic team, same seeds, same budget.

    .venv/bin/python benchmarks/sample_efficiency.py [--seeds 3] [--iterations 30] [--target 0.6] [--kl-coefs 0,0.01]

For each seed, both modes start from the same warm-started base and fresh adapters and train side by side;
held-out success (60 tasks x --eval-rollouts, sampled decoding) is measured every --eval-every iterations. Prints the rollouts
each mode needed to reach --target (a run that never reaches it counts its whole budget, so the ratio is then
a bound) and the ratio process / outcome (the reference reports about 0.6; our goal is <= 0.5), and saves a
plot of held-out success against rollouts. `--kl-coefs 0,0.01` runs the process mode once per KL coefficient
(k1 KL to the base taken off the reward, the reference's 0.01) so the default can be set from the measurement.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from agents import arithmetic
from mappa_graph import (
    RewardConfig,
    TrainConfig,
)


def run(mode: str, seed: int, args: argparse.Namespace, out: Path, kl_coef: float = 0.0) -> list[tuple[int, float]]:
    torch.manual_seed(seed)
    config = TrainConfig(
        run_name=f"{mode}-{seed}", output_dir=str(out / f"{mode}-{kl_coef:g}-{seed}"), iterations=args.iterations,
        tasks_per_iteration=args.tasks, rollouts_per_task=args.group, rollout_concurrency=1, seed=seed,
        lr=args.lr, ppo_epochs=1, max_new_tokens=6, checkpoint_every=10_000, reward=RewardConfig(mode=mode),
        kl_coef=kl_coef, kl_mode="reward", temperature=args.temperature,
    )
    trainer = arithmetic.build_trainer(config)
    per_iteration = config.tasks_per_iteration * config.rollouts_per_task
    curve = [(0, trainer.evaluate(rollouts=args.eval_rollouts))]
    for it in range(1, args.iterations + 1):
        trainer.step()
        if it % args.eval_every == 0:
            curve.append((it * per_iteration, trainer.evaluate(rollouts=args.eval_rollouts)))
        print(f"  {mode:8s} seed {seed} iteration {it:3d}  held-out {curve[-1][1]:.2f}", flush=True)
    return curve


def rollouts_to_reach(curve: list[tuple[int, float]], target: float, budget: int) -> tuple[int, bool]:
    for rollouts, success in curve:
        if success >= target:
            return rollouts, True
    return budget, False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--group", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-rollouts", type=int, default=2, help="sampled rollouts per held-out task")
    parser.add_argument("--target", type=float, default=0.45)
    parser.add_argument("--kl-coefs", default="0", help="comma-separated KL coefficients for the process mode")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the rollouts")
    parser.add_argument("--out", default="runs/sample_efficiency")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = args.iterations * args.tasks * args.group
    kl_coefs = [float(x) for x in args.kl_coefs.split(",")]
    process_modes = {("process" if k == 0 else f"process+kl{k:g}"): k for k in kl_coefs}
    curves: dict[str, dict[int, list[tuple[int, float]]]] = {m: {} for m in [*process_modes, "outcome"]}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for mode in curves:
                reward_mode = "outcome" if mode == "outcome" else "process"
                curves[mode][seed] = run(reward_mode, seed, args, Path(tmp), process_modes.get(mode, 0.0))
    (out / "curves.json").write_text(json.dumps(curves))
    needed = {mode: [rollouts_to_reach(c, args.target, budget) for c in per_seed.values()]
              for mode, per_seed in curves.items()}
    print(f"\nrollouts to reach held-out success {args.target} (budget {budget} per run):")
    for mode, results in needed.items():
        cells = ", ".join(f"{n}{'' if hit else ' (not reached)'}" for n, hit in results)
        print(f"  {mode:8s} {cells}   mean {sum(n for n, _ in results) / len(results):.0f}")
    mean = {m: sum(n for n, _ in r) / len(r) for m, r in needed.items()}
    bound = " (a bound: outcome-only did not always reach the target)" if not all(h for _, h in needed["outcome"]) else ""
    for mode in process_modes:
        print(f"ratio {mode} / outcome: {mean[mode] / mean['outcome']:.2f}{bound}")
    final = {m: sum(c[-1][1] for c in per_seed.values()) / len(per_seed) for m, per_seed in curves.items()}
    print("final held-out success: " + ", ".join(f"{m} {v:.2f}" for m, v in final.items()))
    _plot(curves, args.target, out / "sample_efficiency.png")
    print(f"plot: {out / 'sample_efficiency.png'}")


def _plot(curves, target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colors = ["tab:blue", "tab:green", "tab:purple", "tab:red"]
    for mode, color in zip(curves, [*colors[: len(curves) - 1], "tab:orange"]):
        for i, curve in enumerate(curves[mode].values()):
            ax.plot(*zip(*curve), color=color, alpha=0.8, label=f"{mode} rewards" if i == 0 else None)
    ax.axhline(target, color="gray", linestyle=":", label="target")
    ax.set_xlabel("rollouts (episodes)")
    ax.set_ylabel("held-out success")
    ax.set_title("arithmetic team: process vs outcome-only rewards")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
