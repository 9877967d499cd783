"""Tracer overhead: the same 3-node graph (a chat model that answers in 1 ms) run plain and instrumented,
interleaved in one process so drift hits both alike. Goal: instrumented / plain wall time <= 1.02.

    .venv/bin/python benchmarks/tracer_overhead.py [--runs 500]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from langchain_core.messages import HumanMessage

from mappa_graph import TraceStore, instrument
from tests.graphs import build_graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=500)
    args = parser.parse_args()

    plain = build_graph(delay_s=0.001).compile()
    with tempfile.TemporaryDirectory() as tmp:
        store = TraceStore(Path(tmp) / "bench.db")
        variants = {
            "plain": plain,
            "instrumented (memory)": instrument(build_graph(delay_s=0.001).compile()),
            "instrumented (SQLite store)": instrument(build_graph(delay_s=0.001).compile(), store=store),
        }
        totals = dict.fromkeys(variants, 0.0)
        for graph in variants.values():  # warm-up
            graph.invoke({"messages": [HumanMessage("task-1")]})
        for i in range(args.runs):
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
        assert store.count("episodes") == args.runs + 1
        store.close()
    print(f"{args.runs} runs of a 3-node graph (planner, coder + tool call, ToolNode), 1 ms per model call")
    for name, total in totals.items():
        print(f"  {name:30s} {1000 * total / args.runs:7.3f} ms/run   ratio {total / totals['plain']:.3f}")


if __name__ == "__main__":
    main()
