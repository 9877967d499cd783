"""One rollout, wherever it runs: the job (task, run name, seeded metadata), running it on an instrumented
graph, judging episodes, and building the team from a graph factory. The trainer's in-process path and the
Ray workers (ray_rollouts.py) share these, which is what keeps the two paths' episodes equal.
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from ..capture.instrument import InstrumentedGraph
from ..traces import Episode

if TYPE_CHECKING:
    from ..models.policies import AgentPolicies

OnVersion = Callable[["AgentPolicies", int], Any]


class RolloutJob(BaseModel):
    """One rollout: the task, and the run name and metadata the trainer would give it in-process."""

    task_id: str
    input: Any
    reference: Any = None
    run: str
    metadata: dict[str, Any]
    use_async: bool | None = None  # run with ainvoke; None: when the app has a tool that only runs async


class RolloutResult(BaseModel):
    episode: Episode | None = None  # with `error` set, the partial episode (to store, not to train on)
    error: str | None = None


def run_job(graph: InstrumentedGraph, job: RolloutJob) -> RolloutResult:
    """Run one rollout; a graph that raises returns its error and partial episode (the caller counts it).
    An app compiled with a checkpointer needs a thread: each rollout gets a new one, so no rollout continues
    another's (or an earlier run's) conversation. An app with a tool that only runs async runs with `ainvoke`
    on an event loop of this thread's own (`job.use_async`, by default when `has_async_only_tools`)."""
    config: dict[str, Any] = {"metadata": job.metadata}
    if getattr(graph.graph, "checkpointer", None) not in (None, False):
        config["configurable"] = {"thread_id": f"mappa-rollout-{uuid.uuid4().hex}"}
    use_async = job.use_async if job.use_async is not None else has_async_only_tools(graph.graph)
    kwargs = {"task_id": job.task_id, "reference": job.reference, "config": config}
    try:
        if use_async:
            _, episode = asyncio.run(graph.arun_episode(job.input, **kwargs))
        else:
            _, episode = graph.run_episode(job.input, **kwargs)
    except Exception as exc:
        mine = job.metadata.get("mappa_episode_metadata", {})
        partial = next((e for e in reversed(graph.episodes) if e.task_id == job.task_id
                        and all(e.metadata.get(k) == v for k, v in mine.items())), None)
        error = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, NotImplementedError) and "sync invocation" in str(exc) and not use_async:
            error += (" (a tool of the app runs only async and was called by invoke: set "
                      "TrainConfig(async_rollouts=True) to run rollouts with ainvoke)")
        return RolloutResult(episode=partial, error=error)
    return RolloutResult(episode=episode)


def has_async_only_tools(graph: Any) -> bool:
    """Whether a ToolNode of the app (or of a subgraph: a supervisor's worker, an agent node) holds a tool with
    no sync implementation (an `async def` @tool, an MCP tool): `invoke` would fail at its first call with
    LangChain's "does not support sync invocation", `ainvoke` runs it. A tool called from a node's own code
    cannot be seen here: `TrainConfig(async_rollouts=True)` covers that."""
    subgraphs = getattr(graph, "get_subgraphs", None)  # absent on an app that is not a LangGraph graph
    graphs = [graph, *(sub for _, sub in subgraphs(recurse=True))] if subgraphs is not None else [graph]
    for pregel in graphs:
        for node in (getattr(pregel, "nodes", None) or {}).values():
            tools = getattr(getattr(node, "bound", None), "tools_by_name", None) or {}
            if any(getattr(t, "func", None) is None and getattr(t, "coroutine", None) is not None
                   for t in tools.values()):
                return True
    return False


def rollout_metadata(seed: int, iteration: int, task_id: str, g: int, greedy: bool = False,
                     temperature: float | None = None) -> dict[str, Any]:
    """What a rollout's config carries: the seed every sampling call derives from, where it sits in the run,
    and how the trainer wants it sampled (greedy, or at `temperature`), which the chat models and the endpoint
    read from the run metadata because the app, not the trainer, constructs them."""
    meta: dict[str, Any] = {"mappa_seed": f"{seed}:{iteration}:{task_id}:{g}",
                            "mappa_episode_metadata": {"iteration": iteration, "rollout": g}}
    if greedy:
        meta["mappa_greedy"] = True
    if temperature is not None:
        meta["mappa_temperature"] = float(temperature)
    return meta


def build_graph(graph: Any, policies: AgentPolicies) -> Any:
    """A compiled graph as given, an uncompiled StateGraph compiled, or one built by a factory: `f(policies)`, or
    `f()` for one that takes nothing."""
    if hasattr(graph, "compile") and not hasattr(graph, "invoke"):  # a StateGraph as the user built it
        return graph.compile()
    if hasattr(graph, "invoke") or not callable(graph):
        return graph
    try:
        takes_policies = bool(inspect.signature(graph).parameters)
    except (TypeError, ValueError):
        takes_policies = True
    return graph(policies) if takes_policies else graph()


def split_team(built: Any) -> tuple[Any, OnVersion | None]:
    """A factory's result: a compiled graph, or (graph, on_version) where on_version(policies, version) pushes
    each new adapter version to where the graph's models are served (e.g. `VLLMBackend.sync`)."""
    if isinstance(built, tuple):
        if len(built) != 2 or not callable(built[1]):
            raise TypeError("a graph factory returns a compiled graph or (compiled graph, on_version(policies, "
                            f"version)); got a tuple of {len(built)}")
        return built[0], built[1]
    return built, None
