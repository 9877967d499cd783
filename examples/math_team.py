""".venv/bin/python examples/math_team.py [--model tiny] [--data aime_eval_32 amc_eval_32] [--iterations 4] [--out runs/math]

The math team (solver -> verifier -> solver retry) trained from per-action process rewards, then run on real
AIME/AMC problems. On the CPU default the tiny offline model is warm-started on synthetic arithmetic traces
(cached after the first run), trained for a few iterations on the synthetic set, then evaluated greedily on a
few real problems. It cannot solve them (expect 0 correct): the run shows the path a real model takes, from
loading the JSON files through prompting, `\\boxed{}` extraction and checking to the table printed at the
end. `--model` (a hub name or local folder of an instruction-tuned model, no warm start), `--train
AIME_1983_2024` and a larger `--max-new-tokens` run the same path for real; the other settings in
default_config are sized for the tiny model. Writes metrics.jsonl, eval.jsonl, traces.db, checkpoints and
adapters under --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from agents import math_team
from mappa_graph import (
    Episode,
    TrainConfig,
    export_adapters,
)
from tools.math_answers import load_math


def default_config(out: str, iterations: int = 4, seed: int = 0, max_new_tokens: int = 32) -> TrainConfig:
    return TrainConfig(
        run_name="math", output_dir=out, iterations=iterations, tasks_per_iteration=8, rollouts_per_task=2,
        rollout_concurrency=1, seed=seed, lr=2e-3, ppo_epochs=2, max_new_tokens=max_new_tokens, checkpoint_every=1,
    )


def result_rows(episodes: list[Episode]) -> list[dict[str, object]]:
    rows = []
    for e in episodes:
        state = e.final_state or {}
        verdicts = [math_team.parse_verdict(v) for v in state.get("verdicts", [])]
        rows.append({
            "id": e.task_id,
            "reference": e.reference["answer"],
            "boxed": state.get("answer"),
            "attempts": len(state.get("attempts", [])),
            "verdicts": ",".join({True: "ok", False: "no", None: "?"}[v] for v in verdicts),
            "correct": bool(e.outcome),
            "last reply": " ".join((state.get("attempts") or [""])[-1].split()),
        })
    return rows


def print_table(rows: list[dict[str, object]]) -> None:
    columns = ["id", "reference", "boxed", "attempts", "verdicts", "correct", "last reply"]
    cells = [[_cell(row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))


def _cell(value: object) -> str:
    text = "-" if value is None else str(value)
    return text if len(text) <= 32 else text[:29] + "..."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1].split(". ")[0])
    parser.add_argument("--model", default="tiny", help="base model: 'tiny' (offline), a hub name or a local folder")
    parser.add_argument("--data", nargs="+", default=["aime_eval_32", "amc_eval_32"],
                        help="evaluation sets: bundled names (aime_2025, amc_eval_32, ...) or JSON/JSONL files")
    parser.add_argument("--limit", type=int, default=3, help="problems evaluated from each --data set")
    parser.add_argument("--train", default="synthetic", help="'synthetic' or a bundled name / file to train on")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--warm-steps", type=int, default=None,
                        help="warm-start steps on synthetic traces (default: 150 for tiny, 0 otherwise)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", default="runs/math")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    started = time.time()
    out = Path(args.out)
    eval_problems = [p for name in args.data for p in load_math(name, limit=args.limit)]
    warm_steps = args.warm_steps if args.warm_steps is not None else (150 if args.model == "tiny" else 0)
    policies = math_team.math_policies(args.model, warm_steps=warm_steps)
    train_tasks = None if args.train == "synthetic" else [math_team.to_task(p) for p in load_math(args.train)]
    config = default_config(str(out), args.iterations, args.seed, args.max_new_tokens)
    trainer = math_team.build_trainer(config, policies, train_tasks=train_tasks)
    print(f"loaded {len(eval_problems)} problems from {', '.join(args.data)}; training on {args.train} "
          f"({len(trainer.tasks)} tasks); ready in {time.time() - started:.0f} s")

    for record in trainer.train():
        rewards = ", ".join(f"{a} {m['mean_reward']:.2f}" for a, m in record["agents"].items()
                            if m.get("mean_reward") is not None)
        print(f"iteration {record['iteration']}: synthetic success {record['success_rate']:.2f}; "
              f"mean process reward {rewards} ({record['seconds']:.0f} s)")
    tasks = [math_team.to_task(p) for p in eval_problems]
    episodes = trainer.rollout(tasks, trainer.iteration, rollouts=1, greedy=True, graph=trainer.eval_graph,
                               desc="eval")
    rows = result_rows(episodes)
    print(f"\nafter {trainer.iteration} iterations, greedy, on {len(rows)} real problems:")
    print_table(rows)
    solved = sum(bool(r["correct"]) for r in rows)
    boxed = sum(r["boxed"] is not None for r in rows)
    print(f"solved {solved}/{len(rows)}; a boxed answer in {boxed}/{len(rows)}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    export_adapters(trainer.policies, out / "adapters", run=config.run_name, iteration=trainer.iteration,
                    metrics={"eval_solved": solved, "eval_problems": len(rows)})
    print(f"wrote {out}/metrics.jsonl, eval.jsonl, adapters/, traces.db in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
