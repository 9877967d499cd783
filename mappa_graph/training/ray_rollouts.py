"""Rollouts and judge calls fanned out to Ray actors (`TrainConfig(rollout_backend="ray")`).

Each actor rebuilds the team once: the base model and one LoRA adapter per agent (`PolicySpec`), the graph
from the user's factory `f(policies) -> compiled graph`, and the judge. Where a server generates (vLLM per
node), `RayConfig(load_base=False)` gives the factory an `AdapterFiles` instead of a model: the adapters'
PEFT files, which is all the worker needs to push each version to its server. From then on only adapters
travel: the driver puts each new adapter version in Ray's object store once (a few MB, never the base model)
and every call names the version it needs, so an actor that Ray restarted after a crash catches up before
it runs the retried call. Episodes come back to the driver, which alone writes the trace store: a retried call
yields one result, so nothing is written twice. An episode is a pure function of (seed, iteration, task, g,
adapter weights), which is why Ray rollouts equal in-process ones.

Ray is an optional extra: `pip install mappa-graph[ray]`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from ..capture.instrument import InstrumentedGraph, instrument
from ..judging.protocol import score_all
from ..models.policies import LoraSettings
from ..serving.adapter_files import AdapterFiles
from ..traces import Episode, Reward
from .config import RayConfig
from .rollouts import RolloutJob, RolloutResult, run_job, split_team

if TYPE_CHECKING:
    from ..judging.protocol import ProcessJudge
    from ..models.policies import AgentPolicies

log = logging.getLogger(__name__)

GraphFactory = Callable[..., Any]
"""`f(policies) -> compiled graph` (or `f()` when the team has no local policies). It may instead return
`(compiled graph, on_version)`: the worker calls `on_version(policies, version)` after loading each new adapter
version, which is how a worker pushes the adapters to the vLLM server on its node (`VLLMBackend.sync`)."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            "rollout_backend='ray' needs Ray: pip install 'mappa-graph[ray]' (or use rollout_backend='local')"
        ) from exc
    return ray


def check_shippable(obj: Any, what: str) -> None:
    """Fail before any actor starts if `obj` cannot be pickled to a worker, naming the object and the fix."""
    from ray import cloudpickle

    try:
        cloudpickle.dumps(obj)
    except Exception as exc:
        raise TypeError(
            f"{what} {obj!r} cannot be sent to Ray workers ({type(exc).__name__}: {exc}); make it a module-level "
            "function (or functools.partial of one) that builds what it needs inside the worker"
        ) from exc


def shippable(obj: Any) -> bool:
    from ray import cloudpickle

    try:
        cloudpickle.dumps(obj)
    except Exception:
        return False
    return True


class PolicySpec(BaseModel):
    """How a worker rebuilds the team's policies: the base by name or path, the agents and their LoRA shape."""

    model_config = ConfigDict(extra="forbid")

    base: str
    agents: list[str]
    lora: LoraSettings
    share: dict[str, str] = {}
    dtype: str | None = None

    @classmethod
    def of(cls, policies: AgentPolicies) -> PolicySpec:
        dtype = str(next(policies.model.parameters()).dtype).removeprefix("torch.")
        share = {a: owner for a, owner in policies.adapter_of.items() if a != owner}
        return cls(base=policies.base_name, agents=policies.agents, lora=policies.lora, share=share, dtype=dtype)

    def adapter_of(self) -> dict[str, str]:
        return {a: self.share.get(a, a) for a in self.agents}

    def build(self) -> AgentPolicies:
        from ..models.policies import AgentPolicies

        return AgentPolicies.from_pretrained(self.base, self.agents, lora=self.lora, share=self.share or None,
                                             dtype=self.dtype)


def adapter_state(policies: AgentPolicies) -> dict[str, dict[str, Any]]:
    """Every adapter's LoRA tensors, detached CPU copies: what a new policy version ships to the workers."""
    return {a: {n: p.detach().cpu().clone() for n, p in policies.adapter_parameters(a).items()}
            for a in policies.adapters}


def load_adapter_state(policies: AgentPolicies, state: dict[str, dict[str, Any]]) -> None:
    import torch

    with policies.lock, torch.no_grad():
        for adapter, tensors in state.items():
            params = policies.adapter_parameters(adapter)
            for name, value in tensors.items():
                params[name].copy_(value.to(params[name].device, params[name].dtype))


def adapter_checksum(policies: AgentPolicies) -> dict[str, float]:
    """Per adapter, the sum of |w| over its LoRA tensors: equal on two processes that hold the same version."""
    return {a: float(sum(p.detach().abs().sum() for p in policies.adapter_parameters(a).values()))
            for a in policies.adapters}


class RolloutWorker:
    """One Ray actor: the team rebuilt once, then rollouts and judge calls on request."""

    def __init__(self, factory: GraphFactory, spec: PolicySpec | None, judge: ProcessJudge | None,
                 agents: dict[str, str], load_base: bool = True) -> None:
        self.policies: AgentPolicies | AdapterFiles | None = None
        if spec is not None:
            self.policies = spec.build() if load_base else AdapterFiles(spec.base, spec.adapter_of())
        self.compiled, self.on_version = split_team(factory(self.policies) if self.policies is not None else factory())
        self.agents = agents
        self.judge = judge
        self.version = -1
        self.graphs: dict[str, InstrumentedGraph] = {}
        self.lock = threading.Lock()

    def _sync(self, version: int, box: list[Any]) -> None:
        with self.lock:
            if version == self.version:
                return
            if self.policies is not None:
                import ray

                update = ray.get(box[0])
                if isinstance(self.policies, AdapterFiles):
                    self.policies.files = update
                else:
                    load_adapter_state(self.policies, update)
                if self.on_version is not None:
                    self.on_version(self.policies, version)
            self.version = version

    def _graph(self, run: str) -> InstrumentedGraph:
        with self.lock:
            if run not in self.graphs:
                self.graphs[run] = instrument(self.compiled, run=run, agents=self.agents)
            return self.graphs[run]

    def rollout(self, job: RolloutJob, version: int, box: list[Any]) -> RolloutResult:
        self._sync(version, box)
        return run_job(self._graph(job.run), job)

    def score(self, episodes: list[Episode]) -> list[Reward]:
        if self.judge is None:
            raise RuntimeError("this worker was started without a judge")
        return score_all(self.judge, episodes)

    def info(self) -> dict[str, Any]:
        """Which process this is, the adapter version it holds and a checksum of it (to check a cluster)."""
        import os

        holds = ("nothing" if self.policies is None else
                 "adapter files" if isinstance(self.policies, AdapterFiles) else "model")
        return {"pid": os.getpid(), "version": self.version, "holds": holds,
                "checksum": adapter_checksum(self.policies) if holds == "model" else None}


class RayRollouts:
    """The driver's side: a pool of `RolloutWorker` actors, the current adapter version, and dispatch.

    `rollout()` keeps every worker busy with `concurrency_per_worker` calls in flight and returns results in
    job order. A call lost with its actor is retried by Ray (`max_restarts`, `max_task_retries`); one that is
    still lost after that comes back as a failed result, counted and dropped by the trainer.
    """

    def __init__(self, factory: GraphFactory, *, policies: AgentPolicies | None = None,
                 judge: ProcessJudge | None = None, agents: dict[str, str] | None = None,
                 config: RayConfig | None = None) -> None:
        ray = import_ray()
        self.config = config or RayConfig()
        check_shippable(factory, "the graph factory")
        if judge is not None and not shippable(judge):
            log.warning("judge %r cannot be pickled to Ray workers; it scores on the driver instead", judge)
            judge = None
        self.judges_on_workers = judge is not None
        if not ray.is_initialized():
            ray.init(address=self.config.address, runtime_env=self.config.runtime_env, include_dashboard=False)
        actor = ray.remote(RolloutWorker).options(
            num_cpus=self.config.cpus_per_worker, num_gpus=self.config.gpus_per_worker,
            max_restarts=self.config.max_restarts, max_task_retries=self.config.max_task_retries,
            max_concurrency=self.config.concurrency_per_worker)
        spec = PolicySpec.of(policies) if policies is not None else None
        self.workers = [actor.remote(factory, spec, judge, dict(agents or {}), self.config.load_base)
                        for _ in range(self.config.workers)]
        try:  # wait until every worker has built its team, so a broken factory or model path fails here, once
            ray.get([w.info.remote() for w in self.workers])
        except ray.exceptions.RayError as exc:
            self.shutdown()
            raise RuntimeError(f"Ray rollout workers could not start: {exc}") from exc
        self.live = list(range(len(self.workers)))  # a worker dead beyond its restarts stays out
        self.version = -1
        self.box: list[Any] = [None]

    def publish(self, policies: AgentPolicies, version: int) -> None:
        """Put the adapter weights in the object store as `version`; each worker loads it on its next call."""
        ray = import_ray()
        update = adapter_state(policies) if self.config.load_base else AdapterFiles.of(policies).files
        self.box = [ray.put(update)]  # boxed: Ray passes it on by reference, not by value
        self.version = version

    def rollout(self, jobs: Sequence[RolloutJob], *, progress: Callable[[], None] | None = None) -> list[RolloutResult]:
        ray = import_ray()
        results: list[RolloutResult | None] = [None] * len(jobs)
        pending = list(range(len(jobs)))[::-1]
        live = self.live
        in_flight: dict[Any, tuple[int, int]] = {}  # ref -> (job index, worker index)

        def submit(w: int) -> None:
            i = pending.pop()
            in_flight[self.workers[w].rollout.remote(jobs[i], self.version, self.box)] = (i, w)

        for w in live:
            for _ in range(self.config.concurrency_per_worker):
                if pending:
                    submit(w)
        while in_flight:
            [ref], _ = ray.wait(list(in_flight), num_returns=1)
            i, w = in_flight.pop(ref)
            try:
                results[i] = ray.get(ref)
            except ray.exceptions.RayError as exc:  # the actor died beyond its retries: the rollout is lost
                results[i] = RolloutResult(error=f"lost on Ray worker {w}: {type(exc).__name__}: {exc}")
                if isinstance(exc, ray.exceptions.RayActorError) and w in live:
                    log.error("Ray rollout worker %d is gone; its remaining work moves to the others", w)
                    live.remove(w)
            if progress is not None:
                progress()
            if pending and w in live:
                submit(w)
            elif pending and not in_flight and live:
                submit(live[0])
        for i in pending:  # every worker died: what was never started is lost too
            results[i] = RolloutResult(error="lost: no Ray rollout worker left")
        return [r for r in results if r is not None]

    def score(self, episodes: Sequence[Episode], fallback: ProcessJudge) -> list[Reward]:
        """Episodes split across the workers' judges; a chunk whose worker is lost is scored on the driver."""
        ray = import_ray()
        if not self.judges_on_workers or not episodes or not self.live:
            return score_all(fallback, episodes)
        workers = [self.workers[w] for w in self.live]
        n = len(workers)
        chunks = [list(episodes[k::n]) for k in range(n)]
        refs = [w.score.remote(c) if c else None for w, c in zip(workers, chunks)]
        by_episode: dict[str, list[Reward]] = {}
        for chunk, ref in zip(chunks, refs):
            if ref is None:
                continue
            try:
                rewards = ray.get(ref)
            except ray.exceptions.RayError as exc:
                log.warning("judge call lost on a Ray worker (%s); scoring those %d episodes on the driver",
                            type(exc).__name__, len(chunk))
                rewards = score_all(fallback, chunk)
            for r in rewards:
                by_episode.setdefault(r.episode_id, []).append(r)
        return [r for e in episodes for r in by_episode.get(e.id, [])]  # the order the driver would give

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the workers and return once they are gone. `ray.kill` alone only asks: a call made just after
        it could still be answered by a live worker (seen on a loaded machine). Each worker ends once the calls
        queued before are done (`__ray_terminate__`, whose result comes back as the worker exits); one that
        has not ended within `timeout` seconds is killed."""
        ray = import_ray()
        ends = [w.__ray_terminate__.remote() for w in self.workers]
        ended, _ = ray.wait(ends, num_returns=len(ends), timeout=timeout) if ends else ([], [])
        for worker, end in zip(self.workers, ends):
            if end not in ended:
                ray.kill(worker)
        self.workers, self.live = [], []
