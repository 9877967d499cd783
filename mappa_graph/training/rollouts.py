"""One rollout, wherever it runs: the job (task, run name, seeded metadata), running it on an instrumented
graph, judging episodes, and building the team from a graph factory. The trainer's in-process path and the
Ray workers (ray_rollouts.py) share these, which is what keeps the two paths' episodes equal.
"""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from ..capture.instrument import InstrumentedGraph
from ..event_loop import BackgroundLoop
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


# Async rollouts run here, every one on the same loop: see event_loop.py (a loop per rollout broke ChatOpenAI).
_ROLLOUT_LOOP = BackgroundLoop("mappa-rollout-loop", own_thread_hint="await graph.arun_episode() there")


def run_job(graph: InstrumentedGraph, job: RolloutJob) -> RolloutResult:
    """Run one rollout; a graph that raises returns its error and partial episode (the caller counts it).
    An app compiled with a checkpointer needs a thread: each rollout gets a new one, so no rollout continues
    another's (or an earlier run's) conversation. An app with a tool that only runs async runs with `ainvoke`,
    on one long-lived event loop that every such rollout shares (`job.use_async`, by default when
    `has_async_only_tools`). Each episode's metadata carries its `rollout_id`."""
    rollout_id = uuid.uuid4().hex
    mine = {**job.metadata.get("mappa_episode_metadata", {}), "rollout_id": rollout_id}
    config: dict[str, Any] = {"metadata": {**job.metadata, "mappa_episode_metadata": mine}}
    if getattr(graph.graph, "checkpointer", None) not in (None, False):
        config["configurable"] = {"thread_id": f"mappa-rollout-{rollout_id}"}
    kwargs = {"task_id": job.task_id, "reference": job.reference, "config": config}
    use_async = job.use_async
    try:
        if use_async is None:
            use_async = has_async_only_tools(graph.graph)
        if use_async:
            _, episode = _ROLLOUT_LOOP.run(graph.arun_episode(job.input, **kwargs))
        else:
            _, episode = graph.run_episode(job.input, **kwargs)
    except Exception as exc:  # noqa: BLE001 - one broken rollout must not end a run of hours
        partial = next((e for e in graph.episodes_newest_first() if e.metadata.get("rollout_id") == rollout_id),
                       None)
        error = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, NotImplementedError) and not use_async:
            error += (" (if a tool of the app runs only async, invoke cannot call it: set "
                      "TrainConfig(async_rollouts=True) to run rollouts with ainvoke)")
        return RolloutResult(episode=partial, error=error)
    return RolloutResult(episode=episode)


def has_async_only_tools(graph: Any) -> bool:
    """Whether a ToolNode of the app (or of a subgraph: a supervisor's worker, an agent node; wrapped or not,
    as `with_retry()` does) holds a tool made from a coroutine alone (an `async def` @tool, an MCP tool):
    `invoke` fails at its first call with LangChain's "does not support sync invocation", `ainvoke` runs it. A
    tool called from a node's own code, or a BaseTool whose `_run` raises, cannot be seen here:
    `TrainConfig(async_rollouts=True)` covers those."""
    subgraphs = getattr(graph, "get_subgraphs", None)  # absent on an app that is not a LangGraph graph
    graphs = [graph, *(sub for _, sub in subgraphs(recurse=True))] if subgraphs is not None else [graph]
    for pregel in graphs:
        for node in (getattr(pregel, "nodes", None) or {}).values():
            runnable = getattr(node, "bound", None)
            for _ in range(8):  # a ToolNode inside bindings and retries (each keeps what it wraps in `bound`)
                tools = getattr(runnable, "tools_by_name", None)
                if tools is not None:
                    if any(getattr(t, "func", None) is None and getattr(t, "coroutine", None) is not None
                           for t in tools.values()):
                        return True
                    break
                runnable = getattr(runnable, "bound", None)
                if runnable is None:
                    break
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
