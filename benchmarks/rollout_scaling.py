"""Rollout throughput on Ray with 1 vs 2 workers: prints episodes/s for each and the ratio.

    .venv/bin/python benchmarks/rollout_scaling.py [--episodes 40] [--delay 0.05] [--calls 2]

The team is a solver -> checker graph whose every model call waits `delay` seconds, as a served model does
(I/O-bound, so two CPU cores are not the limit). Both pools run on one local Ray cluster
(`ray.init(num_cpus=2)`), one call in flight per worker; each pool is warmed up first, so actor start-up is
not timed. What is timed is `RayRollouts.rollout`: dispatch, the instrumented runs on the workers, and the
Episodes shipped back to the driver. The issue's goal is a ratio of at least 1.8.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any, TypedDict

from langchain_core.messages import AIMessage, HumanMessage
from langgraph.graph import END, START, StateGraph

from mappa_graph.testing import ScriptedChatModel
from mappa_graph.training import RayConfig
from mappa_graph.training.ray_rollouts import RayRollouts
from mappa_graph.training.rollouts import RolloutJob, rollout_metadata


class TeamState(TypedDict, total=False):
    question: str
    draft: str
    verdict: str


def slow_team(delay: float, calls: int) -> Any:
    """`calls` nodes in a chain, each one model call that takes `delay` seconds."""

    def reply(messages: list[Any]) -> AIMessage:
        time.sleep(delay)
        return AIMessage(content=f"seen: {messages[-1].content}")

    model = ScriptedChatModel(reply=reply)
    graph = StateGraph(TeamState)
    names = [f"agent{i}" for i in range(calls)]

    def node(state: TeamState) -> dict[str, str]:
        out = model.invoke([HumanMessage(state.get("draft") or state["question"])])
        return {"draft": str(out.content)}

    for name in names:
        graph.add_node(name, node)
    graph.add_edge(START, names[0])
    for a, b in zip(names, names[1:]):
        graph.add_edge(a, b)
    graph.add_edge(names[-1], END)
    return graph.compile()


def jobs(n: int, tag: str) -> list[RolloutJob]:
    return [RolloutJob(task_id=f"{tag}{i}", input={"question": f"q{i}"}, run=f"bench-{tag}",
                       metadata=rollout_metadata(0, 1, f"{tag}{i}", 0)) for i in range(n)]


def throughput(workers: int, args: argparse.Namespace) -> float:
    from functools import partial

    pool = RayRollouts(partial(slow_team, args.delay, args.calls), config=RayConfig(workers=workers))
    try:
        pool.rollout(jobs(2 * workers, "warm"))  # every actor built and its first call done
        started = time.perf_counter()
        results = pool.rollout(jobs(args.episodes, f"w{workers}-"))
        elapsed = time.perf_counter() - started
    finally:
        pool.shutdown()
    failed = [r.error for r in results if r.error]
    if failed:
        raise SystemExit(f"{len(failed)} rollouts failed: {failed[0]}")
    return args.episodes / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=40)
    parser.add_argument("--delay", type=float, default=0.05, help="seconds each model call waits")
    parser.add_argument("--calls", type=int, default=2, help="model calls per episode")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        one = throughput(1, args)
        two = throughput(2, args)
    finally:
        ray.shutdown()
    ideal = 1 / (args.delay * args.calls)
    print(f"{args.episodes} episodes, {args.calls} model calls of {args.delay * 1000:.0f} ms each "
          f"(one worker's ceiling: {ideal:.1f} episodes/s)")
    print(f"1 Ray worker : {one:6.2f} episodes/s")
    print(f"2 Ray workers: {two:6.2f} episodes/s")
    print(f"ratio 2/1    : {two / one:.2f}  (goal >= 1.8)")


if __name__ == "__main__":
    main()
