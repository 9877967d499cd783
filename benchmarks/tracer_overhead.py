"""Tracer overhead: the same graph run plain and instrumented, side by side in one process, on two graphs: the
3-node graph (a chat model that answers in 1 ms) and a create_supervisor team over two create_react_agent
workers (each model call 1 ms; 11 actions per run, handoffs included). Goal: instrumented / plain wall time
<= 1.02 on the 3-node graph, with the in-memory store and with SQLite. Beside them, the graph with an empty
callback handler: what langchain-core's callback dispatch costs by itself, the floor of any callback tracer.

How it measures, so a busy machine moves both sides alike: one repetition runs a block of `--block` calls of
each variant (plain, instrumented in memory, instrumented into SQLite), the variants' order rotating, and
each instrumented block ends with `flush()` inside its timing, so the background writer's work is paid for
by the calls that caused it and never leaks into a neighbour's block (its last episode, built after the
block's last call returned, is paid in full once per block: a pessimistic share that a longer block shrinks).
Each repetition gives a ratio per variant (its block time / the plain block time); the figure is the median of
those ratios, with its quartiles. Beside it, the ratio of total times, which a rare long pause moves and the
median does not: the garbage collector's full collections are such pauses, and the time each variant spent in
the collector is shown (episodes kept in memory as Python objects made them frequent, see InstrumentedGraph).

`--profile` also reports cProfile figures per graph run, meaningful on a busy machine too (call counts are
deterministic; seconds are the graph thread's CPU time, so neither waits nor other processes count, though the
profiler inflates them): the collector's callbacks on the graph's thread (the hot path; an episode's build is
handed to the writer thread), the Python calls the tracer adds there, and, run synchronously, the deferred
build and store work.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tracer_overhead.py [--runs 600] [--supervisor-runs 200]
        [--block 16] [--profile] [--profile-only]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from langchain_core.callbacks import BaseCallbackHandler
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


def _task(i: int) -> dict[str, Any]:
    return {"messages": [HumanMessage(f"task-{i}")]}


class _Empty(BaseCallbackHandler):
    """A handler that does nothing: what langchain-core's own callback dispatch costs, the floor of any
    tracer built on callbacks. It defines `on_chat_model_start`, as any tracer of chat models must: without it
    langchain-core catches the base class's NotImplementedError and renders every prompt to a string for
    `on_llm_start` instead, work a tracer never asks for (it made this floor read about 2 points high)."""

    run_inline = True

    def on_chat_model_start(self, serialized: Any, messages: Any, **kwargs: Any) -> None:
        return None


class _GcClock:
    """Seconds the garbage collector ran while each variant was being timed (`gc.callbacks`)."""

    def __init__(self) -> None:
        self.variant, self.started, self.seconds = "", 0.0, {}
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
        elif self.variant:
            self.seconds[self.variant] = self.seconds.get(self.variant, 0.0) + time.perf_counter() - self.started

    def close(self) -> None:
        gc.callbacks.remove(self)


class _WithHandler:
    def __init__(self, graph: Any) -> None:
        self.graph, self.config = graph, {"callbacks": [_Empty()]}

    def invoke(self, task: Any) -> Any:
        return self.graph.invoke(task, self.config)


def measure(label: str, build: Callable[[], Any], runs: int, block: int) -> dict[str, float]:
    """Median (and quartiles) over repetitions of each variant's block time / the plain block time."""
    reps = max(1, runs // block)
    with tempfile.TemporaryDirectory() as tmp:
        store = TraceStore(Path(tmp) / "bench.db")
        variants = {
            "plain": build(),
            "empty callback handler": _WithHandler(build()),
            "instrumented (memory)": instrument(build()),
            "instrumented (SQLite store)": instrument(build(), store=store),
        }
        for graph in variants.values():  # warm-up
            graph.invoke(_task(0))
            getattr(graph, "flush", lambda: None)()
        names = list(variants)
        times: dict[str, list[float]] = {name: [] for name in names}
        cpu: dict[str, list[float]] = {name: [] for name in names}
        clock = _GcClock()
        for rep in range(reps):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:  # rotate, so no variant always runs first
                graph = variants[name]
                clock.variant = name
                start, start_cpu = time.perf_counter(), time.process_time()
                for i in range(block):
                    graph.invoke(_task(rep * block + i))
                getattr(graph, "flush", lambda: None)()  # the background writer's tail counts against the tracer
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
        clock.close()
        assert store.count("episodes") == reps * block + 1, "every instrumented call must be stored"
        store.close()
    print(f"{label}\n  {reps} repetitions x {block} calls per variant; wall time, and CPU time of all this "
          "process's threads (the work added, background included, whatever the machine's load)")
    ratios = {}
    for name in names:
        each = [t / p for t, p in zip(times[name], times["plain"])]
        q1, median, q3 = statistics.quantiles(each, n=4) if len(each) > 1 else (each[0],) * 3
        ratios[name] = median
        cpu_ratio = statistics.median(c / p for c, p in zip(cpu[name], cpu["plain"]) if p > 0)
        total = sum(times[name]) / sum(times["plain"])
        print(f"  {name:28s} {1000 * statistics.median(times[name]) / block:7.3f} ms/run   wall ratio median "
              f"{median:.3f} [quartiles {q1:.3f} .. {q3:.3f}], of totals {total:.3f}   CPU ratio median "
              f"{cpu_ratio:.3f}   GC {1000 * clock.seconds.get(name, 0.0) / (reps * block):.3f} ms/run")
    return ratios


def _cumulative(stats: pstats.Stats, module: str, names: set[str]) -> tuple[float, int]:
    """Summed cumulative seconds and calls of the named functions of one module (outermost frames only, so a
    function that calls another of the set is not counted twice)."""
    seconds, calls = 0.0, 0
    for (path, _, function), (_, ncalls, _, cumtime, callers) in stats.stats.items():  # type: ignore[attr-defined]
        if path.endswith(module) and function in names:
            seconds += cumtime
            calls += ncalls
    return seconds, calls


def _profiled(graph: Any, runs: int) -> pstats.Stats:
    graph.invoke(_task(0))
    getattr(graph, "flush", lambda: None)()
    profiler = cProfile.Profile(time.thread_time)  # this thread's CPU time: no waits, no other processes
    profiler.enable()
    for i in range(runs):
        graph.invoke(_task(i))
    profiler.disable()
    getattr(graph, "flush", lambda: None)()
    return pstats.Stats(profiler)


def _calls(stats: pstats.Stats) -> int:
    return sum(ncalls for _, ncalls, _, _, _ in stats.stats.values())  # type: ignore[attr-defined]


def profile(build: Callable[[], Any], runs: int) -> None:
    """cProfile per graph run: the callbacks on the graph's thread (with the background writer, as
    instrument() runs by default), the Python calls the tracer adds to the graph's thread (deterministic), and
    the deferred build + store, run synchronously (background=False) so the profiler sees them."""
    callbacks = {"on_chain_start", "on_chain_end", "on_chain_error", "on_chat_model_start", "on_llm_end",
                 "on_llm_error", "on_tool_start", "on_tool_end", "on_tool_error"}
    plain_calls = _calls(_profiled(build(), runs))
    with tempfile.TemporaryDirectory() as tmp:
        for label, store in (("memory", None), ("SQLite", TraceStore(Path(tmp) / "profile.db"))):
            stats = _profiled(instrument(build(), store=store), runs)
            hot, calls = _cumulative(stats, "capture/collector.py", callbacks)
            print(f"  {label:6s} graph's thread: callbacks {1000 * hot / runs:.3f} ms/run ({calls / runs:.0f} "
                  f"callbacks/run), +{(_calls(stats) - plain_calls) / runs:.0f} Python calls/run over plain")
            stats = _profiled(instrument(build(), store=store, background=False), runs)
            built, _ = _cumulative(stats, "capture/collector.py", {"_build_and_emit"})
            stored, _ = _cumulative(stats, "capture/store.py", {"add_episodes"})
            print(f"  {label:6s} deferred work, run synchronously: build + emit {1000 * built / runs:.3f} ms/run "
                  f"(of which the store {1000 * stored / runs:.3f} ms/run), +{(_calls(stats) - plain_calls) / runs:.0f} "
                  "Python calls/run over plain in all")
            if store is not None:
                store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=600, help="calls of each variant on the 3-node graph")
    parser.add_argument("--supervisor-runs", type=int, default=200, help="calls of each variant on the team")
    parser.add_argument("--block", type=int, default=16, help="consecutive calls of one variant per repetition")
    parser.add_argument("--profile", action="store_true", help="also report cProfile figures per graph run")
    parser.add_argument("--profile-only", action="store_true", help="only the cProfile figures")
    args = parser.parse_args()
    three_node = lambda: build_graph(delay_s=0.001).compile()
    if args.runs and not args.profile_only:
        measure(f"{args.runs} runs of a 3-node graph (planner, coder + tool call, ToolNode), 1 ms per model call",
                three_node, args.runs, args.block)
    if args.supervisor_runs and not args.profile_only:
        measure(f"{args.supervisor_runs} runs of a create_supervisor team (2 create_react_agent workers, 2 handoffs, "
                "2 tool calls, 7 model calls), 1 ms per model call", supervisor_graph, args.supervisor_runs,
                args.block)
    if args.profile or args.profile_only:
        print("cProfile, 3-node graph (per run: CPU ms of the graph's thread, inflated by the profiler; call counts)")
        profile(three_node, min(args.runs, 200) or 200)
        if args.supervisor_runs:
            print("cProfile, supervisor team")
            profile(supervisor_graph, min(args.supervisor_runs, 50))


if __name__ == "__main__":
    main()
