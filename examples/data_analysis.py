"""MAPPA on a data-analysis team (planner -> coder with a sandboxed Python tool -> analyst) over real DABench
tables. The README's main job:

    .venv/bin/python examples/data_analysis.py [--iterations 6] [--out reports/data_analysis]

CPU default: the tiny offline model, warm-started on templated questions over six small DABench tables (a
column mean, a count above or below a column's quantile, a correlation; answers computed with pandas; see
SMALL_TABLES for why these) from demonstrations in which 30% of the coder's replies call no tool and 30% of the
analyst's file the value under the wrong name (an imperfect teacher; `--warm-noise 0` for clean ones), then a
short MAPPA run with the process judge on templated questions the warm start never saw, whose per-action rewards
tell each agent which of its own replies slipped, then held-out accuracy before/after (sampled rollouts, with the
standard error) on a third set of templated questions and on a few real DABench questions (the tiny model is not
expected to solve those: they show the path works). Writes a report folder: report.json, rewards.png,
metrics.jsonl, the exported adapters and the trace DB.

Real models: `--model Qwen/Qwen3-1.7B` (HF name or local path) trains on real DABench questions;
`--judge http://host:8000/v1 --judge-model NAME` scores with an LLM judge over an OpenAI-compatible
endpoint; `--vllm http://host:8001/v1` runs rollouts through a vLLM server with one LoRA per agent.

Ray: `--ray local` (a Ray instance on this machine) or `--ray auto` / `--ray ray://head:10001` (a cluster)
fans rollouts and judge calls out to `--ray-workers` actors; with `--vllm http://localhost:8000/v1` each
worker uses the vLLM server on its own node. See docs/scaling.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from agents import data_analysis as team
from agents import data_analysis_training as recipe
from mappa_graph import (
    AgentPolicies,
    LLMJudge,
    MixJudge,
    RewardConfig,
    TrainConfig,
    Trainer,
    export_adapters,
)
from mappa_graph.training import RayConfig
from mappa_graph.training.metrics import plot_rewards
from tools.dabench import load_dabench
from tools.dabench_templates import SMALL_TABLES, templated_tasks
from tools.sandbox import PythonSandbox


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="base model: HF name, local path, or 'tiny' (offline)")
    p.add_argument("--judge", help="OpenAI-compatible base URL of an LLM judge (default: the programmatic judge)")
    p.add_argument("--judge-model", default="judge", help="model name at --judge")
    p.add_argument("--vllm", help="OpenAI-compatible base URL of a vLLM server for rollouts (LoRA enabled)")
    p.add_argument("--ray", help="run rollouts on Ray: 'local', 'auto' or a cluster address")
    p.add_argument("--ray-workers", type=int, default=2, help="Ray rollout actors (one per node with --vllm)")
    p.add_argument("--ray-concurrency", type=int, default=1, help="episodes each Ray actor runs at once")
    p.add_argument("--ray-cpus-per-worker", type=float, default=1.0, help="CPUs Ray reserves per actor")
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--tasks-per-iteration", type=int, default=16)
    p.add_argument("--held-out", type=int, default=24,
                   help="held-out questions to evaluate on: templated (tiny model), else real DABench ones")
    p.add_argument("--rl-tasks", type=int, default=96,
                   help="templated questions MAPPA trains on, none seen in the warm start (tiny model only)")
    p.add_argument("--eval-rollouts", type=int, default=4, help="sampled rollouts per held-out question")
    p.add_argument("--real-questions", type=int, default=3, help="real DABench questions to evaluate on")
    p.add_argument("--warm-steps", type=int, default=1000, help="supervised warm-start steps (tiny model only)")
    p.add_argument("--warm-tries", type=int, default=3,
                   help="warm starts to try, each with the next seed, until one's coder is right on 60%% of "
                        "validation questions (tiny model only; see recipe.validated_warm_start)")
    p.add_argument("--warm-noise", type=float, default=0.3,
                   help="share of the coder's and the analyst's warm-start replies with a typical slip, which "
                        "MAPPA's per-action rewards then train away (tiny model only; 0: clean demonstrations)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (0: torch's default; default: 2 for the tiny model, torch's default for "
                        "others). The tiny model's training takes a different path on another thread count (float "
                        "sums in another order, amplified by a 1000-step warm start at a high learning rate), so "
                        "its count is fixed: the README's figures reproduce on any machine of the same CPU family, "
                        "whatever its core count")
    p.add_argument("--out", default="reports/data_analysis")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    started = time.time()
    threads = args.threads if args.threads is not None else (2 if args.model == "tiny" else 0)
    if threads:
        import torch

        torch.set_num_threads(threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tool = team.make_table_tool(PythonSandbox(cpu_seconds=10, wall_seconds=20, memory_mb=1024))  # warm start
    real = [recipe.to_task(t) for t in load_dabench(levels=["easy"], limit=args.real_questions)]
    if args.model == "tiny":
        templated = templated_tasks(1000, seed=args.seed, tables=SMALL_TABLES, max_number_chars=5)
        # three disjoint sets: the warm start's questions, MAPPA's (new to the model, so reward comes only from
        # the skill, not from a remembered answer) and the held-out ones
        if args.held_out < 1 or args.rl_tasks < 1 or args.held_out + args.rl_tasks >= len(templated):
            raise SystemExit(f"--held-out and --rl-tasks must be >= 1 and leave warm-start questions: "
                             f"{len(templated)} templated questions, got --held-out {args.held_out} --rl-tasks "
                             f"{args.rl_tasks}")
        held_raw = templated[-args.held_out :]
        rl_raw = templated[-args.held_out - args.rl_tasks : -args.held_out]
        warm_raw = templated[: -args.held_out - args.rl_tasks]
        print(f"warm start on {len(warm_raw)} templated questions (a tenth kept to validate it) over "
              f"{len(SMALL_TABLES)} DABench tables ({args.warm_noise:.0%} of the coder's and the analyst's "
              f"demonstrations slip); MAPPA on {len(rl_raw)} others; {len(held_raw)} held out ...", flush=True)
        base, warm_scores = recipe.validated_warm_start(warm_raw, tool, noise=args.warm_noise, seed=args.seed,
                                                        steps=args.warm_steps, lr=1e-2, batch_size=8,
                                                        tries=args.warm_tries)
        train, held_out = [recipe.to_task(t) for t in rl_raw], [recipe.to_task(t) for t in held_raw]
    else:
        base, warm_scores = args.model, []
        pool = [recipe.to_task(t) for t in load_dabench()]
        if not 0 < args.held_out < len(pool):
            raise SystemExit(f"--held-out must be between 1 and {len(pool) - 1} ({len(pool)} DABench questions: "
                             f"the others train), got {args.held_out}")
        train, held_out = pool[: -args.held_out], pool[-args.held_out :]
    policies = AgentPolicies.from_pretrained(base, list(team.AGENTS))
    graph = functools.partial(recipe.team_graph, vllm=args.vllm)  # each Ray worker builds its own copy
    judge = recipe.process_judge()
    if args.judge:
        from langchain_openai import ChatOpenAI

        llm = ChatOpenAI(base_url=args.judge, model=args.judge_model, api_key="none", temperature=0)
        judge = MixJudge([(LLMJudge(llm, roles=team.ROLES), 0.5), (judge, 0.5)])
    config = TrainConfig(
        run_name="data-analysis", output_dir=str(out), iterations=args.iterations,
        tasks_per_iteration=args.tasks_per_iteration, rollouts_per_task=4, rollout_concurrency=8, seed=args.seed,
        # four optimiser steps per epoch: with one, the policy barely moves in three iterations (log-ratio ~1e-3)
        lr=3e-3, ppo_epochs=2, mini_batches=4, max_new_tokens=64,
        # advantages whitened per agent, as the MAPPA release does: seeds 0/1/2 gained +22..+25/+1/+3 points with it,
        # +16..+22/-3/0 with the whole batch whitened together (the library's default)
        reward=RewardConfig(filter_zero_signal=False, normalize_per_agent=True),
        # a real model's backward keeps every layer's activations and attention maps: with SmolLM2-135M in
        # fp32, one update micro-batch of 16 actions of 500+60 tokens peaks at 19.6 GB RSS, of 4 at 6.2 GB
        micro_batch_size=16 if args.model == "tiny" else 4,
        rollout_backend="ray" if args.ray else "local",
        ray=RayConfig(address=None if args.ray in (None, "local") else args.ray, workers=args.ray_workers,
                      concurrency_per_worker=args.ray_concurrency, cpus_per_worker=args.ray_cpus_per_worker,
                      load_base=not args.vllm,  # with a server generating, workers need only the adapter files
                      runtime_env=None if args.ray in (None, "local") else {"working_dir": str(ROOT)}),
    )
    trainer = Trainer(graph, policies, judge, train, config, outcome=recipe.outcome)

    def accuracy(tasks: list, rollouts: int) -> dict[str, float]:
        """Mean outcome of `rollouts` sampled episodes per task, with its binomial standard error; before and
        after training on the same random draws, so the difference is the policy's."""
        p = trainer.evaluate(tasks, rollouts=rollouts, seed_iteration=0)  # before and after: the same draws
        n = len(tasks) * rollouts
        return {"accuracy": p, "stderr": (p * (1 - p) / n) ** 0.5, "episodes": n}

    kind = "templated" if args.model == "tiny" else "DABench"

    def show(label: str, acc: dict[str, dict[str, float]]) -> None:
        h, r = acc["held_out"], acc["real_dabench"]
        print(f"accuracy {label} held-out {kind} {h['accuracy']:.2f} ± {h['stderr']:.2f} ({h['episodes']} "
              f"episodes), real DABench {r['accuracy']:.2f} ({r['episodes']} episodes)", flush=True)

    before = {"held_out": accuracy(held_out, args.eval_rollouts), "real_dabench": accuracy(real, 1)}
    show("before:", before)
    records = trainer.train()
    after = {"held_out": accuracy(held_out, args.eval_rollouts), "real_dabench": accuracy(real, 1)}
    show("after: ", after)

    print("\nmean reward per agent and iteration (process judge):")
    print("  iter  " + "  ".join(f"{a:>8s}" for a in team.AGENTS) + "  success")
    for r in records:
        cells = [f"{r['agents'][a]['mean_reward']:8.2f}" if r["agents"][a]["mean_reward"] is not None else "       -"
                 for a in team.AGENTS]
        print(f"  {r['iteration']:4d}  " + "  ".join(cells) + f"  {r['success_rate'] or 0:7.2f}")
    plot_rewards(out / "metrics.jsonl", out / "rewards.png", title="data-analysis team: mean reward per agent")
    manifest = export_adapters(policies, out / "adapters", run=config.run_name, iteration=trainer.iteration,
                               metrics={"accuracy_before": before, "accuracy_after": after})
    report = {
        "model": args.model, "warm_start_validation": warm_scores, "iterations": trainer.iteration,
        "train_tasks": len(train),
        "held_out_tasks": len(held_out), "real_dabench_ids": [t.id for t in real],
        "accuracy_before": before, "accuracy_after": after, "seconds": round(time.time() - started, 1),
        "adapters": {node: e.path for node, e in manifest.nodes.items()},
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(f"\nreport written to {out}/: report.json, rewards.png, metrics.jsonl, adapters/, traces.db "
          f"({report['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
