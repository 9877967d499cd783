"""Tracer overhead: the same graph run plain and instrumented, interleaved in one process so drift hits both
alike, on two graphs: the 3-node graph (a chat model that answers in 1 ms) and a create_supervisor team over two
create_react_agent workers (each model call 1 ms; 11 actions per run, handoffs included). Goal: instrumented /
plain wall time <= 1.02 on the 3-node graph.

    .venv/bin/python benchmarks/tracer_overhead.py [--runs 500] [--supervisor-runs 200]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from langchain_core.messages import HumanMessage

from mappa_graph import TraceStore, instrument
from tests.graphs import build_graph


def supervisor_graph() -> Any:
    """tests/capture/apps.py's supervisor team, every scripted model answering in 1 ms."""
    from langgraph.prebuilt import create_react_agent

    from tests.capture import apps
    from tests.fakes import ScriptedChatModel

    def model(script: Callable) -> ScriptedChatModel:
        return ScriptedChatModel(script=script, delay_s=0.001)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        workers = [create_react_agent(model(apps.researcher_script), [apps.search], name="researcher"),
                   create_react_agent(model(apps.math_script), [apps.add], name="math_expert")]
        return apps.supervisor_app(model(apps.supervisor_script), workers)


def measure(label: str, build: Callable[[], Any], runs: int) -> None:
    plain = build()
    with tempfile.TemporaryDirectory() as tmp:
        store = TraceStore(Path(tmp) / "bench.db")
        variants = {
            "plain": plain,
            "instrumented (memory)": instrument(build()),
            "instrumented (SQLite store)": instrument(build(), store=store),
        }
        totals = dict.fromkeys(variants, 0.0)
        for graph in variants.values():  # warm-up
            graph.invoke({"messages": [HumanMessage("task-1")]})
        for i in range(runs):
            task = {"messages": [HumanMessage(f"task-{i}")]}
            names = list(variants)
            for name in names[i % 3 :] + names[: i % 3]:  # rotate, so no variant always runs first
                graph = variants[name]
                start = time.perf_counter()
                graph.invoke(task)
                totals[name] += time.perf_counter() - start
        for name, graph in variants.items():  # the background writer's tail counts against the tracer
            start = time.perf_counter()
            getattr(graph, "flush", lambda: None)()
            totals[name] += time.perf_counter() - start
        assert store.count("episodes") == runs + 1
        store.close()
    print(label)
    for name, total in totals.items():
        print(f"  {name:30s} {1000 * total / runs:7.3f} ms/run   ratio {total / totals['plain']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--supervisor-runs", type=int, default=200)
    args = parser.parse_args()
    measure(f"{args.runs} runs of a 3-node graph (planner, coder + tool call, ToolNode), 1 ms per model call",
            lambda: build_graph(delay_s=0.001).compile(), args.runs)
    measure(f"{args.supervisor_runs} runs of a create_supervisor team (2 create_react_agent workers, 2 handoffs, "
            "2 tool calls, 7 model calls), 1 ms per model call", supervisor_graph, args.supervisor_runs)


if __name__ == "__main__":
    main()
