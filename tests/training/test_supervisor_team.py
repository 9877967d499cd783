"""The trainer on a team built with the real create_supervisor: each worker (a create_react_agent on its own
adapter, `policies.chat_model(worker)`) is its own agent, so each worker's LoRA moves, and only on that worker's
actions. The supervisor routes by a scripted model (the tiny model cannot write tool calls), so every episode
visits both workers."""

from __future__ import annotations

import warnings

import pytest
import torch

from mappa_graph.judging.verifier import VerifierJudge
from mappa_graph.models.policies import AgentPolicies
from mappa_graph.traces import Task
from mappa_graph.training.config import TrainConfig
from mappa_graph.training.credit import RewardConfig
from mappa_graph.training.trainer import Trainer
from tests.capture.apps import supervisor_app

WORKERS = ["researcher", "math_expert"]


def team(policies: AgentPolicies):
    from langgraph.prebuilt import create_react_agent

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        workers = [create_react_agent(policies.chat_model(w, max_new_tokens=4), [], name=w) for w in WORKERS]
    return supervisor_app(workers=workers)


def parity(scored: list[str]):
    def score(action, episode, reference):
        if action.agent not in scored:
            return None  # unscored: the scripted supervisor, and workers left out on purpose
        return float(len(action.output_text) % 2)  # any varied verdict: the test is about where gradients go

    return score


@pytest.mark.filterwarnings("ignore::langgraph.warnings.LangGraphDeprecatedSinceV10")
@pytest.mark.parametrize("scored", [WORKERS, ["math_expert"]], ids=["both-scored", "researcher-unscored"])
def test_each_supervisor_worker_trains_its_own_adapter_on_its_own_actions(scored, tmp_path, tiny_path,
                                                                          one_torch_thread):
    """peft-style: snapshot, train, compare. Each scored worker's LoRA moves; a worker whose actions carry no
    reward stays bit-identical although the other worker trains in the same steps; the base never moves."""
    torch.manual_seed(0)
    policies = AgentPolicies.from_pretrained(str(tiny_path), WORKERS)
    tasks = [Task(id=f"t{n}", input={"messages": [{"role": "user", "content": f"solve task-{n}"}]}) for n in range(4)]
    config = TrainConfig(run_name="sup", output_dir=str(tmp_path), iterations=2, tasks_per_iteration=2,
                         rollouts_per_task=2, rollout_concurrency=2, max_new_tokens=4, lr=5e-2,
                         reward=RewardConfig(filter_zero_signal=False))
    trainer = Trainer(team, policies, VerifierJudge(parity(scored), name="parity"), tasks, config)
    base = {n: p.detach().clone() for n, p in policies.model.named_parameters() if "lora_" not in n}
    before = {w: {n: p.detach().clone() for n, p in policies.adapter_parameters(w).items()} for w in WORKERS}
    records = trainer.train()
    trainer.close()

    episodes = trainer.store.episodes(run="sup")
    assert len(episodes) == 2 * 2 * 2
    for ep in episodes:
        trainable = [(a.agent, a.path, a.adapter) for a in ep.actions if a.trainable]
        # both workers' model calls, each on its own adapter, and nothing of the supervisor's
        assert trainable == [(w, f"{w}/agent", policies.adapter_of[w]) for w in WORKERS]
        assert [a.agent for a in ep.actions if a.path == "supervisor/agent"] == ["supervisor"] * 3
    for record in records:
        assert {w: record["agents"][w]["samples"] for w in WORKERS} == {w: 4 if w in scored else 0 for w in WORKERS}
    for w in WORKERS:
        after = policies.adapter_parameters(w)
        moved = any(not torch.equal(before[w][n], after[n]) for n in after)
        assert moved == (w in scored), f"{w}'s adapter {'did not move' if w in scored else 'moved'}"
    assert all(torch.equal(base[n], p) for n, p in policies.model.named_parameters() if n in base)
