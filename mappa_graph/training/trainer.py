"""The MAPPA trainer: rollouts -> judge every action -> advantages -> per-agent LoRA updates, repeated.

`Trainer.step()` reads top to bottom (nanoGPT style): sample tasks, roll out, judge, assign credit, update,
log, checkpoint. The loss is the token-level PPO-clipped surrogate on REINFORCE++ advantages (see loss.py),
each agent's samples updating only its own adapter through its own optimiser. This module never imports
langgraph: the graph arrives already instrumented, or is instrumented through mappa_graph.capture.instrument.
"""

from __future__ import annotations

import logging
import math
import random
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..capture.instrument import InstrumentedGraph, instrument
from ..capture.store import TraceStore
from ..judging.protocol import ProcessJudge, require_judge, score_all
from ..models.policies import AgentPolicies
from ..traces import Episode, Reward, Task
from . import distributed
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .config import TrainConfig
from .credit import Sample, assign_advantages, episode_rewards, filter_samples
from .loss import behaviour_tensor, clipped_surrogate, flatten_tokens, k1_kl, k3_kl
from .metrics import MetricsLog
from .offline import stored_batch
from .optim import AgentOptimizers
from .rollouts import OnVersion, RolloutJob, build_graph, has_async_only_tools, rollout_metadata, run_job, split_team

log = logging.getLogger(__name__)

OutcomeFn = Callable[[Episode], "float | None"]


class Trainer:
    def __init__(
        self,
        graph: Any,
        policies: AgentPolicies,
        judge: ProcessJudge,
        tasks: Sequence[Task],
        config: TrainConfig | None = None,
        *,
        outcome: OutcomeFn | None = None,
        eval_tasks: Sequence[Task] | None = None,
        store: TraceStore | None = None,
        resume: bool = False,
        on_update: Callable[[AgentPolicies, int], None] | None = None,
        endpoint: Any = None,
    ) -> None:
        """`endpoint`: a running serving.endpoint.PolicyEndpoint that the graph's own ChatOpenAI nodes call
        (`base_url` / OPENAI_BASE_URL): the unchanged app is trained through it, each node's requests routed
        to its agent's adapter and its token ids recorded on the trace."""
        self.config = config or TrainConfig()
        if not tasks:
            raise ValueError("Trainer needs at least one task")
        require_judge(judge, where="Trainer judge")
        for agent in self.config.frozen_agents:
            policies.check_agent(agent)
        if self.config.rollout_backend == "ray" and (hasattr(graph, "invoke") or not callable(graph)):
            raise TypeError(
                "rollout_backend='ray' needs the graph as a factory, f(policies) -> compiled graph, that Ray can "
                f"send to each worker (the workers build their own models); got {type(graph).__name__}, which "
                "holds the driver's model. Pass e.g. functools.partial(build_team, max_new_tokens=32)"
            )
        distributed.init_from_env()  # under torchrun: join its process group (a no-op in a single process)
        if self.config.rollout_backend == "ray" and distributed.is_distributed():
            raise ValueError("rollout_backend='ray' under torchrun is not supported: use one of the two")
        self.out = Path(self.config.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        # every rank runs the same seeded rollouts; rank 0's go to the trace store, the others' stay in memory
        # a store passed in is the caller's (e.g. `mappa train --from-traces DB`): resume never deletes from it
        # (an app instrumented into a store already keeps writing there, and its rollouts are this trainer's)
        self.owns_store = store is None
        if store is None and isinstance(graph, InstrumentedGraph) and graph.store is not None:
            store = graph.store
        self.store = store or TraceStore(self.out / "traces.db" if distributed.is_main_process() else ":memory:")
        self.eval_run = f"{self.config.run_name}/eval"
        # on Ray the workers build the team (each beside its own model server); the driver builds no graph
        self.graph: InstrumentedGraph | None = None
        self.eval_graph: InstrumentedGraph | None = None
        self.on_version: OnVersion | None = None
        if self.config.rollout_backend == "local":
            if isinstance(graph, InstrumentedGraph):
                # the rollouts are this run's, whatever run the app was instrumented under: the update, the
                # traces it trains from and a resume all find them by the run name
                graph.store, graph.run = self.store, self.config.run_name
                if endpoint is not None:
                    graph.graph = endpoint.attach(graph.graph)
                self.graph = graph
            else:
                compiled, self.on_version = split_team(build_graph(graph, policies))
                if endpoint is not None:  # route each of the app's own model calls to its node's adapter
                    compiled = endpoint.attach(compiled)
                self.graph = instrument(compiled, store=self.store, run=self.config.run_name)
            self.eval_graph = instrument(self.graph.graph, store=self.store, run=self.eval_run,
                                         agents=self.graph.agents)
        self.synced_version = -1  # the adapter version rollouts last got (Ray workers, or on_version)
        self.failed_rollouts = 0  # of the last rollout() call, and its first error (this rank's)
        self.first_rollout_error: str | None = None
        self.policies, self.judge, self.tasks = policies, judge, list(tasks)
        self.eval_tasks = list(eval_tasks or [])
        if self.eval_tasks and outcome is None:
            raise ValueError("eval_tasks need an outcome function to score them: Trainer(..., outcome=fn(episode) "
                             "-> 0..1)")
        self.outcome = outcome
        self.on_update = on_update
        torch.manual_seed(self.config.seed)
        random.seed(self.config.seed)
        self.optimizers = AgentOptimizers(policies, lr=self.config.lr, weight_decay=self.config.weight_decay)
        self.metrics = MetricsLog(self.out / "metrics.jsonl",
                                  tensorboard_dir=self.out / "tb" if self.config.tensorboard else None)
        self.iteration = 0
        self.reward_kl: dict[str, float] = {}  # per agent, the k1 KL taken off this iteration's rewards
        self.final_iteration: int | None = None  # set by train(); step() alone ends at config.iterations
        self.weights_version = 0  # bumped by every change of the adapters; rollouts get each version once
        self.ray = None
        if self.config.rollout_backend == "ray":
            from .ray_rollouts import RayRollouts

            self.ray = RayRollouts(graph, policies=policies, judge=judge, config=self.config.ray)
        if resume:
            self.resume()

    # ---- the loop ----------------------------------------------------------------------------------------
    def train(self, iterations: int | None = None) -> list[dict[str, Any]]:
        total = iterations or self.config.iterations
        self.final_iteration = total  # the end-of-run checkpoint and evaluation follow this run's length
        records = []
        # disable=None: a live bar on a terminal; in a log (CI, `> file`) no carriage-return redraws, one line an
        # iteration instead
        with tqdm(total=total, initial=min(self.iteration, total), desc="mappa train", unit="it",
                  disable=None) as bar:
            while self.iteration < total:
                record = self.step()
                records.append(record)
                bar.update(1)
                bar.set_postfix(_postfix(record))
                if bar.disable:
                    cells = ", ".join(f"{k} {v}" for k, v in _postfix(record).items())
                    print(f"iteration {record['iteration']}/{total}: {cells} ({record['seconds']:.1f} s)",
                          file=sys.stderr, flush=True)
        return records

    def step(self) -> dict[str, Any]:
        iteration = self.iteration + 1
        started = time.time()
        tasks = self.sample_tasks(iteration)
        episodes = self.rollout(tasks, iteration)  # under torchrun: this rank's shard of the rollouts
        rewards = self.score(episodes)  # judged where they ran
        episodes, rewards = self.gather(episodes, rewards)  # the global batch, on every rank
        launched = len(tasks) * self.config.rollouts_per_task
        if not episodes and launched >= 4:  # a broken model or tool, not bad luck: stop, on every rank alike
            raise RuntimeError(
                f"all {launched} rollouts of iteration {iteration} failed, "
                f"{'first with ' + self.first_rollout_error if self.first_rollout_error else 'on other ranks'}; "
                "nothing to train on. Their partial episodes and errors are in the trace store (and the warnings "
                f"above); fix the cause and rerun with --resume (it starts again at iteration {iteration})")
        samples, credit = self.credit(episodes, rewards, iteration)
        update = self.update(samples)
        self.iteration = iteration
        record = self.record(iteration, episodes, rewards, samples, credit, update, time.time() - started)
        every = self.config.eval_every and iteration % self.config.eval_every == 0
        last = iteration == (self.final_iteration or self.config.iterations)
        if self.eval_tasks and (every or last):  # eval_every=0: at the end only
            record["eval_success"] = self.evaluate()
        if distributed.is_main_process():  # under torch distributed, rank 0 alone writes metrics and checkpoints
            self.metrics.write(record)
            if iteration % self.config.checkpoint_every == 0 or last:
                self.checkpoint()
        return record

    # ---- the parts ---------------------------------------------------------------------------------------
    def sample_tasks(self, iteration: int) -> list[Task]:
        """Tasks for one iteration, a pure function of (seed, iteration): nothing to checkpoint, and a
        resumed run draws exactly what the unbroken run would have."""
        rng = random.Random(f"{self.config.seed}:{iteration}")
        k = self.config.tasks_per_iteration
        if k <= len(self.tasks):
            return rng.sample(self.tasks, k)
        return [rng.choice(self.tasks) for _ in range(k)]

    def rollout(self, tasks: Sequence[Task], iteration: int, *, rollouts: int | None = None, greedy: bool = False,
                graph: InstrumentedGraph | None = None, run: str | None = None,
                desc: str = "rollouts") -> list[Episode]:
        """G rollouts of each task, run concurrently; each call is seeded from (seed, iteration, task, g)."""
        graph = graph or self.graph
        run = run or (graph.run if graph is not None else self.config.run_name)
        use_async = self.config.async_rollouts
        if use_async is None and graph is not None:  # decided once for the batch, not per rollout
            use_async = has_async_only_tools(graph.graph)
        jobs = [RolloutJob(task_id=task.id, input=task.input, reference=task.reference, run=run,
                           metadata=rollout_metadata(self.config.seed, iteration, task.id, g, greedy,
                                                     self.config.temperature),
                           use_async=use_async)
                for task in tasks for g in range(rollouts or self.config.rollouts_per_task)]
        positions = list(range(len(jobs)))
        if distributed.is_distributed():  # each rank runs its share; gather() puts them back in this order
            positions = distributed.shard(positions, distributed.rank(), distributed.world_size())
            jobs = [jobs[i] for i in positions]
        if self.synced_version != self.weights_version:  # rollouts see the adapters as they are now
            if self.ray is not None:
                self.ray.publish(self.policies, self.weights_version)
            elif self.on_version is not None:
                self.on_version(self.policies, self.weights_version)
            self.synced_version = self.weights_version
        with tqdm(total=len(jobs), desc=desc, leave=False, unit="ep", disable=None) as bar:
            if self.ray is not None:
                results = self.ray.rollout(jobs, progress=lambda: bar.update(1))
                self.store.add_episodes(r.episode for r in results if r.episode is not None)
            else:  # concurrent episodes share each decoding step (continuous batching, one adapter per row)
                # decoded in this thread (drive), the one that trains: on a CPU a second thread running torch
                # ops would make libgomp stop spin-waiting in both (see RolloutEngine)
                with self.policies.batched(max_batch=max(self.config.rollout_concurrency, 1), on_caller=True) \
                        as engine, ThreadPoolExecutor(max_workers=self.config.rollout_concurrency) as pool:
                    futures = [pool.submit(run_job, graph, job) for job in jobs]
                    counted = threading.Lock()  # episodes end on the pool's threads

                    def count(_: Any) -> None:
                        with counted:
                            bar.update(1)

                    for future in futures:
                        future.add_done_callback(count)
                    try:
                        engine.drive(futures)
                    except BaseException:  # e.g. Ctrl-C: rollouts not started yet never start
                        for future in futures:
                            future.cancel()
                        raise
                    results = [future.result() for future in futures]
        episodes: list[Episode] = []
        self.failed_rollouts = 0
        self.first_rollout_error = None
        self.job_position: dict[str, int] = {}
        for job, position, result in zip(jobs, positions, results):
            if result.error is None and result.episode is not None:
                episodes.append(result.episode)
                self.job_position[result.episode.id] = position
                continue
            # one broken rollout must not end a run of hours; its partial episode stays in the store
            self.failed_rollouts += 1
            log.warning("rollout of task %r (%s) failed at iteration %d: %s; dropped from this update",
                        job.task_id, job.metadata["mappa_episode_metadata"], iteration, result.error)
            if self.first_rollout_error is None:
                self.first_rollout_error = result.error
        if self.outcome is not None:
            for episode in episodes:
                episode.outcome = self.outcome(episode)
                self.store.set_outcome(episode.id, episode.outcome)
        return episodes

    def score(self, episodes: Sequence[Episode]) -> list[Reward]:
        """Judge every action; rewards go to the store as they are (unscored ones with their reason)."""
        if self.config.reward.mode == "outcome":
            return []
        if self.ray is not None:
            rewards = self.ray.score(episodes, fallback=self.judge)
        else:
            rewards = score_all(self.judge, episodes)
        self.store.add_rewards(rewards)
        return rewards

    def gather(self, episodes: Sequence[Episode], rewards: Sequence[Reward]) -> tuple[list[Episode], list[Reward]]:
        """Under torchrun: every rank's episodes and rewards on every rank, in job order (what one process would
        hold), with rank 0 storing the other ranks' share; in one process, the lists as they are."""
        if not distributed.is_distributed():
            return list(episodes), list(rewards)
        mine = {e.id for e in episodes}
        everyone = distributed.gather_in_order([(self.job_position[e.id], e) for e in episodes])
        order = {e.id: i for i, e in enumerate(everyone)}
        all_rewards = distributed.gather_in_order([((order[r.episode_id], i), r) for i, r in enumerate(rewards)])
        self.failed_rollouts = int(distributed.all_reduce_sum([self.failed_rollouts])[0])
        if distributed.is_main_process():
            self.store.add_episodes(e for e in everyone if e.id not in mine)
            self.store.add_rewards([r for r in all_rewards if r.episode_id not in mine])
        return everyone, all_rewards

    def credit(self, episodes: Sequence[Episode], rewards: Sequence[Reward], iteration: int):
        cfg = self.config.reward
        samples, stats = episode_rewards(episodes, rewards, cfg)
        task_of = {e.id: e.task_id for e in episodes}
        samples = filter_samples(samples, task_of, cfg, stats, iteration=iteration)
        samples = [s for s in samples if s.agent not in self.config.frozen_agents]
        self.reward_kl = {}
        if self.config.kl_coef and self.config.kl_mode == "reward" and samples:
            # the reference's choice: the k1 KL to the base, summed over the action, is taken off the reward
            kls = self._sample_kl(samples)
            for s, kl in zip(samples, kls):
                s.reward -= self.config.kl_coef * kl
            self.reward_kl = _per_agent_token_mean(samples, kls)
        assign_advantages(samples, task_of, cfg)
        return samples, stats

    def _sample_kl(self, samples: Sequence[Sample]) -> list[float]:
        """k1 KL(pi_behaviour || base) summed over each action's tokens; the reference pass runs in micro-batches
        so a large iteration never holds an (all tokens x vocab) tensor."""
        out: list[float] = []
        step = self.config.micro_batch_size
        for start in range(0, len(samples), step):
            chunk = samples[start : start + step]
            ref = self.policies.token_logprobs(None, [s.prompt_token_ids for s in chunk],
                                               [s.output_token_ids for s in chunk],
                                               temperature=[s.temperature for s in chunk])
            current = self._unrecorded_logprobs(chunk)
            out += [float(k1_kl(current[i] if i in current else behaviour_tensor(s.behaviour_logprobs, r), r).sum())
                    for i, (s, r) in enumerate(zip(chunk, ref))]
        return out

    def _unrecorded_logprobs(self, samples: Sequence[Sample]) -> dict[int, torch.Tensor]:
        """By position, for the samples a backend recorded no log-probs for: their adapter's log-probs now, in
        micro-batches and without grad. On-policy that is the behaviour policy: the reward KL's and PPO's "old"
        side for them."""
        found: dict[int, torch.Tensor] = {}
        by_adapter: dict[str, list[int]] = defaultdict(list)
        for i, s in enumerate(samples):
            if s.behaviour_logprobs is None:
                by_adapter[self.policies.adapter_of[s.agent]].append(i)
        step = self.config.micro_batch_size
        with torch.no_grad():
            for adapter, missing in by_adapter.items():
                for start in range(0, len(missing), step):
                    idx = missing[start : start + step]
                    got = self.policies.token_logprobs(adapter, [samples[i].prompt_token_ids for i in idx],
                                                       [samples[i].output_token_ids for i in idx],
                                                       temperature=[samples[i].temperature for i in idx])
                    found.update({i: g.detach() for i, g in zip(idx, got)})
        return found

    def update(self, samples: Sequence[Sample]) -> dict[str, dict[str, float]]:
        """ppo_epochs passes; per adapter, one optimiser step per mini-batch of its samples (one per pass by
        default), each accumulated over micro-batches."""
        cfg = self.config
        by_adapter: dict[str, list[Sample]] = defaultdict(list)
        for s in samples:
            by_adapter[self.policies.adapter_of[s.agent]].append(s)
        # PPO's "old" policy is the one that sampled: recorded behaviour log-probs, or, where a backend recorded
        # none, one snapshot taken before the first step (recomputing it each epoch would make every epoch's
        # ratio 1 and silently drop the clip after the first step)
        # every rank holds the same global batch (see gather), so every rank updates the same adapters and calls
        # the same all-reduces; each takes its shard of an adapter's samples, normalised by the global counts
        # mini-batches are cut from the global batch (the same cut on every rank), then sharded
        minis: dict[str, list[tuple[list[Sample], tuple[int, int]]]] = {}
        for adapter, group in by_adapter.items():
            minis[adapter] = []
            for part in _mini_batches(group, cfg.mini_batches, f"{cfg.seed}:{self.iteration}:{adapter}"):
                totals = (sum(len(s.output_token_ids) for s in part), len(part))
                if distributed.is_distributed():
                    part = distributed.shard(part, distributed.rank(), distributed.world_size())
                minis[adapter].append((part, totals))
        old = {adapter: [self._old_logprobs(part) for part, _ in parts] for adapter, parts in minis.items()}
        steps: dict[str, list[dict[str, float]]] = defaultdict(list)
        for _ in range(cfg.ppo_epochs):
            for adapter, parts in minis.items():
                for (part, totals), old_logprobs in zip(parts, old[adapter]):
                    steps[adapter].append(self._update_adapter(adapter, part, old_logprobs, *totals))
        if by_adapter:
            self.weights_version += 1
        if self.on_update is not None and by_adapter:
            self.on_update(self.policies, self.iteration + 1)
        return {adapter: _merge_epochs(stats, len(minis[adapter])) for adapter, stats in steps.items()}

    def _old_logprobs(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """Per sample (T_i,): the behaviour log-probs recorded at rollout, else its adapter's own before any step."""
        snapshot = self._unrecorded_logprobs(samples)
        return [snapshot[i] if i in snapshot else torch.tensor(s.behaviour_logprobs) for i, s in enumerate(samples)]

    def _update_adapter(self, adapter: str, samples: Sequence[Sample], old_logprobs: Sequence[torch.Tensor],
                        total_tokens: int, total_samples: int) -> dict[str, float]:
        """One optimiser step on `samples` (this rank's shard under torchrun), the loss divided by the global
        batch's `total_tokens` / `total_samples` so that the ranks' summed gradients are the global gradient."""
        cfg = self.config
        opt = self.optimizers.optimizers[adapter]
        params = list(self.policies.adapter_parameters(adapter).values())
        opt.zero_grad(set_to_none=True)
        data_parallel = distributed.is_distributed()
        started = time.time()
        loss_sum, kl_sum, log_ratio_sum, clipped = 0.0, 0.0, 0.0, 0
        for start in range(0, len(samples), cfg.micro_batch_size):
            chunk = samples[start : start + cfg.micro_batch_size]
            # logits / T at each action's own sampling temperature: the distribution its behaviour log-probs are
            # under, so the first epoch's ratio is 1 whatever the temperature
            new = self.policies.token_logprobs(adapter, [s.prompt_token_ids for s in chunk],
                                               [s.output_token_ids for s in chunk],
                                               temperature=[s.temperature for s in chunk])
            old = [o.to(device=n.device, dtype=n.dtype) for o, n in zip(old_logprobs[start : start + len(chunk)], new)]
            logp, adv = flatten_tokens(new, [s.advantage for s in chunk])  # (N,)
            old_flat, _ = flatten_tokens(old, [s.advantage for s in chunk])
            token_loss, was_clipped = clipped_surrogate(logp, old_flat, adv, cfg.clip_eps)
            if cfg.loss_aggregation == "sequence_mean":  # each action's token mean, then the mean over actions
                _, weights = flatten_tokens([torch.empty(len(s.output_token_ids)) for s in chunk],
                                            [1.0 / max(len(s.output_token_ids), 1) for s in chunk])
                loss = (token_loss * weights.to(token_loss.device)).sum() / total_samples
            else:  # token-level mean over the adapter's whole batch: long actions weigh more
                loss = token_loss.sum() / total_tokens
            if cfg.kl_coef and cfg.kl_mode == "loss":
                with torch.no_grad():
                    ref = self.policies.token_logprobs(None, [s.prompt_token_ids for s in chunk],
                                                       [s.output_token_ids for s in chunk],
                                                       temperature=[s.temperature for s in chunk])
                kl = k3_kl(logp, torch.cat(ref).to(logp.device))  # (N,) k3: its gradient pulls toward the base
                loss = loss + cfg.kl_coef * kl.sum() / total_tokens
                kl_sum += float(kl.detach().sum())
            log_ratio_sum += float((logp.detach() - old_flat).sum())
            loss.backward()
            loss_sum += float(loss.detach())
            clipped += int(was_clipped.sum())
        if data_parallel:  # summed grads of per-rank losses over the global count: the global batch's gradient
            distributed.all_reduce_adapter_grads(self.policies, adapter)
            loss_sum, kl_sum, log_ratio_sum, clipped = distributed.all_reduce_sum(
                [loss_sum, kl_sum, log_ratio_sum, clipped])
            clipped = int(clipped)
        grads = [p.grad for p in params if p.grad is not None]
        finite = math.isfinite(loss_sum) and all(torch.isfinite(g).all() for g in grads)
        grad_norm = float("nan")
        if finite and cfg.max_grad_norm is not None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
            finite = math.isfinite(grad_norm)
        if finite:
            opt.step()
        else:
            log.warning("adapter %r: non-finite loss or gradient at iteration %d; step skipped", adapter,
                        self.iteration + 1)
        opt.zero_grad(set_to_none=True)
        elapsed = max(time.time() - started, 1e-9)
        tokens = max(total_tokens, 1)
        stats = {"loss": loss_sum, "log_ratio": log_ratio_sum / tokens, "clip_fraction": clipped / tokens,
                 "tokens": total_tokens, "tokens_per_s": total_tokens / elapsed, "grad_norm": grad_norm,
                 "skipped_step": 0 if finite else 1}
        if cfg.kl_coef and cfg.kl_mode == "loss":
            stats["kl"] = kl_sum / tokens  # k3 estimate of KL to the base, per token
        return stats

    def train_from_traces(self, *, run: str | None = None, judge: str | None = None,
                          max_staleness: int | None = 4) -> dict[str, Any]:
        """One update from the trace store instead of fresh rollouts: what is unscored is judged now, a human
        override (`mappa override`) wins over the judge, actions sampled more than `max_staleness` iterations
        ago are dropped (None keeps all), and the clipped update runs against each action's recorded behaviour
        log-probs. `run` defaults to this trainer's run; `judge` picks one judge's verdicts when several scored it."""
        if distributed.is_distributed():
            raise NotImplementedError("train_from_traces under torchrun is not supported: the stored batch lives on "
                                      "rank 0's store only; run it in one process")
        iteration = self.iteration + 1
        started = time.time()
        judging = self.judge if self.config.reward.mode != "outcome" else None
        episodes, rewards, offline = stored_batch(self.store, judging, run=run or self.config.run_name,
                                                  judge_name=judge, iteration=iteration, max_staleness=max_staleness)
        samples, credit = self.credit(episodes, rewards, iteration)
        update = self.update(samples)
        self.iteration = iteration
        self.failed_rollouts = 0
        record = self.record(iteration, episodes, rewards, samples, credit, update, time.time() - started)
        record["offline"] = offline.model_dump()
        if distributed.is_main_process():
            self.metrics.write(record)
            self.checkpoint()
        return record

    # ---- evaluation, records, checkpoints ------------------------------------------------------------
    def evaluate(self, tasks: Sequence[Task] | None = None, *, greedy: bool = False, rollouts: int = 1,
                 seed_iteration: int | None = None) -> float:
        """Held-out success: `rollouts` per task (sampled as in training, or greedy), mean outcome. Each call is
        seeded from the current iteration, or from `seed_iteration`: give the same one before and after training
        and both policies answer on the same random draws, so their difference is the training's and not the
        draws' (common random numbers; a 96-episode evaluation moved by 0.11 between two iterations' seeds)."""
        if self.outcome is None:
            raise ValueError("evaluate() needs an outcome function: Trainer(..., outcome=fn(episode) -> 0..1)")
        tasks = list(tasks or self.eval_tasks)
        if not tasks:
            raise ValueError("no evaluation tasks: pass eval_tasks= to Trainer or tasks= to evaluate()")
        iteration = self.iteration if seed_iteration is None else seed_iteration
        episodes = self.rollout(tasks, iteration, rollouts=1 if greedy else rollouts, greedy=greedy,
                                graph=self.eval_graph, run=self.eval_run, desc="eval")
        episodes, _ = self.gather(episodes, [])  # under torchrun: every rank's share of the held-out rollouts
        values = [e.outcome for e in episodes if e.outcome is not None]
        return sum(values) / len(values) if values else 0.0

    def record(self, iteration, episodes, rewards, samples, credit, update, seconds) -> dict[str, Any]:
        per_agent: dict[str, dict[str, Any]] = {}
        scores: dict[str, list[float]] = defaultdict(list)
        unscored: dict[str, int] = defaultdict(int)
        for r in rewards:
            if r.score is None:
                unscored[r.agent] += 1
            else:
                scores[r.agent].append(r.score)
        advs: dict[str, list[float]] = defaultdict(list)
        for s in samples:
            advs[s.agent].append(s.advantage)
            if self.config.reward.mode == "outcome":
                scores.setdefault(s.agent, []).append(s.reward)
        for agent in self.policies.agents:
            a = advs.get(agent, [])
            sc = scores.get(agent, [])
            mean_adv = sum(a) / len(a) if a else None
            per_agent[agent] = {
                "mean_reward": sum(sc) / len(sc) if sc else None,
                "samples": len(a),
                "unscored": unscored.get(agent, 0),
                "adv_mean": mean_adv,
                "adv_std": math.sqrt(sum((x - mean_adv) ** 2 for x in a) / len(a)) if a else None,
                **update.get(self.policies.adapter_of[agent], {}),
            }
            if agent in self.reward_kl:  # kl_mode="reward": the k1 KL taken off the rewards
                per_agent[agent]["kl"] = self.reward_kl[agent]
        outcomes = [e.outcome for e in episodes if e.outcome is not None]
        return {
            "iteration": iteration,
            "episodes": len(episodes),
            "failed_rollouts": self.failed_rollouts,
            "success_rate": sum(outcomes) / len(outcomes) if outcomes else None,
            "seconds": seconds,
            "credit": credit.model_dump(),
            "agents": per_agent,
        }

    def close(self) -> None:
        """Stop the Ray rollout workers (if any) and flush the traces; the trainer's files stay as written."""
        if self.ray is not None:
            self.ray.shutdown()
            self.ray = None
        if self.graph is not None:
            self.graph.flush()

    def checkpoint(self) -> Path:
        if self.graph is not None:
            self.graph.flush()
        return save_checkpoint(self.out / "checkpoints", self.iteration, self.policies, self.optimizers,
                               config=self.config.model_dump(mode="json"), trainer_state={},
                               keep=self.config.keep_checkpoints)

    def resume(self) -> int:
        """Continue from the latest checkpoint: adapters, optimisers, RNG and iteration restored; metrics and
        traces of the iteration that was cut off are dropped, so it is redone, never counted twice."""
        path = latest_checkpoint(self.out / "checkpoints")
        if path is None:
            log.info("no checkpoint under %s: starting from iteration 0", self.out / "checkpoints")
            self.iteration = 0
        else:
            payload = load_checkpoint(path, self.policies, self.optimizers)
            self.iteration = int(payload["iteration"])
            self.weights_version += 1
        if distributed.is_main_process():
            self.metrics.truncate_after(self.iteration)
        dropped = 0
        if self.owns_store:  # the traces of the iteration that is redone; eval rollouts of it too
            dropped = sum(self.store.delete_episodes_after(run, self.iteration)
                          for run in (self.config.run_name, self.eval_run))
        log.info("resuming at iteration %d from %s (dropped %d episodes of unfinished iterations)",
                 self.iteration, path, dropped)
        return self.iteration


def _postfix(record: dict[str, Any]) -> dict[str, str]:
    out = {}
    if record.get("success_rate") is not None:
        out["success"] = f"{record['success_rate']:.2f}"
    for agent, m in record["agents"].items():
        if m.get("mean_reward") is not None:
            out[agent[:8]] = f"{m['mean_reward']:.2f}"
    return out


def _per_agent_token_mean(samples: Sequence[Sample], values: Sequence[float]) -> dict[str, float]:
    """Per agent: sum of per-sample values over the agent's output tokens (a per-token mean)."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for s, v in zip(samples, values):
        totals[s.agent][0] += v
        totals[s.agent][1] += len(s.output_token_ids)
    return {agent: total / max(tokens, 1.0) for agent, (total, tokens) in totals.items()}


def _merge_epochs(steps: Sequence[dict[str, float]], per_epoch: int = 1) -> dict[str, float]:
    """One adapter's stats over all optimiser steps of an iteration (`per_epoch` mini-batch steps per PPO
    epoch): means of per-token figures and of the loss, skipped steps summed, the last grad norm, the
    adapter's tokens (one epoch's mini-batches), and the counts of epochs and steps."""
    merged = {key: sum(e[key] for e in steps) / len(steps) for key in steps[0] if key not in ("skipped_step",)}
    merged["skipped_step"] = sum(e["skipped_step"] for e in steps)
    merged["grad_norm"] = steps[-1]["grad_norm"]
    merged["tokens"] = sum(e["tokens"] for e in steps[:per_epoch])
    merged["epochs"] = len(steps) // per_epoch
    merged["optimizer_steps"] = len(steps)
    last = steps[-per_epoch:]
    merged["clip_fraction_last_epoch"] = sum(e["clip_fraction"] * e["tokens"] for e in last) / max(
        sum(e["tokens"] for e in last), 1)
    return merged


def _mini_batches(samples: Sequence[Sample], k: int, seed: str) -> list[list[Sample]]:
    """`samples` shuffled into min(k, len) near-equal mini-batches; the whole batch, in order, when k is 1. The
    cut depends on the samples' content and the seed only, not on their order or ids: ranks that gathered the
    same batch in another order (sharded rollouts) cut it the same way."""
    if k <= 1 or len(samples) <= 1:
        return [list(samples)]
    order = sorted(samples, key=lambda s: (s.prompt_token_ids, s.output_token_ids, s.advantage, s.agent))
    random.Random(seed).shuffle(order)
    k = min(k, len(order))
    return [order[i * len(order) // k : (i + 1) * len(order) // k] for i in range(k)]
