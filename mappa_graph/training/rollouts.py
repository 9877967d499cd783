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


class RolloutResult(BaseModel):
    episode: Episode | None = None  # with `error` set, the partial episode (to store, not to train on)
    error: str | None = None


def run_job(graph: InstrumentedGraph, job: RolloutJob) -> RolloutResult:
    """Run one rollout; a graph that raises returns its error and partial episode (the caller counts it).
    An app compiled with a checkpointer needs a thread: each rollout gets a new one, so no rollout continues
    another's (or an earlier run's) conversation."""
    config: dict[str, Any] = {"metadata": job.metadata}
    if getattr(graph.graph, "checkpointer", None) not in (None, False):
        config["configurable"] = {"thread_id": f"mappa-rollout-{uuid.uuid4().hex}"}
    try:
        _, episode = graph.run_episode(job.input, task_id=job.task_id, reference=job.reference, config=config)
    except Exception as exc:
        mine = job.metadata.get("mappa_episode_metadata", {})
        partial = next((e for e in reversed(graph.episodes) if e.task_id == job.task_id
                        and all(e.metadata.get(k) == v for k, v in mine.items())), None)
        return RolloutResult(episode=partial, error=f"{type(exc).__name__}: {exc}")
    return RolloutResult(episode=episode)


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
