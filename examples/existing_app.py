""".venv/bin/python examples/existing_app.py [--iterations 3] [--out runs/existing_app]

Train an existing LangGraph app without changing its code. agents/support_team.py is a langgraph-supervisor
team whose two workers are `create_react_agent` agents on a plain `ChatOpenAI` (no mappa import there). Here
the policy endpoint serves the tiny model's two LoRA adapters on loopback; `OPENAI_BASE_URL` points the app's
ChatOpenAI at it; the Trainer attaches the endpoint's router to the app, so each worker's calls go to its own
adapter and the trace records the exact token ids and log-probs the endpoint sampled; each worker's adapter
is then updated on its own actions only.

What the tiny model cannot do: write tool calls. The supervisor's handoffs are tool calls, so the supervisor
here is a deterministic router (researcher, then writer, then done) passed through the app's own
`supervisor_model` argument; the workers' calls, the ones trained, all go through the endpoint. The rewards
are a toy keyword rubric: the run shows the plumbing (routing, traces, per-worker updates), not learning.
"""

from __future__ import annotations

import argparse
import os
import uuid
from collections.abc import Sequence
from typing import Any

import torch
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult

from agents.support_team import WORKERS, build_support_team
from mappa_graph.judging.verifier import VerifierJudge
from mappa_graph.models.policies import AgentPolicies
from mappa_graph.serving.endpoint import PolicyEndpoint
from mappa_graph.traces import Task
from mappa_graph.training.config import TrainConfig
from mappa_graph.training.credit import RewardConfig
from mappa_graph.training.trainer import Trainer

# words the tiny model's vocabulary has, so the toy rubric can tell its replies apart
KEYWORDS = {"researcher": ("data", "value", "number", "count", "table"), "writer": ("answer", "final", "yes", "correct", "result")}


class HandoffInTurn(BaseChatModel):
    """The supervisor's model: hands off to each worker in turn, then answers (what a tool-calling model would
    decide here; the tiny model writes no tool calls)."""

    @property
    def _llm_type(self) -> str:
        return "handoff-in-turn"

    def _generate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:
        done = {m.name for m in messages if isinstance(m, ToolMessage)}
        nxt = next((w for w in WORKERS if f"transfer_to_{w}" not in done), None)
        if nxt is None:
            reply = AIMessage("The team has answered.")
        else:
            reply = AIMessage("", tool_calls=[{"name": f"transfer_to_{nxt}", "args": {},
                                               "id": f"call_{uuid.uuid4().hex[:8]}"}])
        return ChatResult(generations=[ChatGeneration(message=reply)])

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Any:
        return self


def keyword_rubric(action, episode, reference) -> float | None:
    """Toy process reward: half for the worker's keywords its reply uses, half for brevity (None: not a
    worker's call, so the supervisor's scripted calls carry no reward)."""
    words = KEYWORDS.get(action.agent)
    if words is None:
        return None
    text = action.output_text.lower()
    brevity = 1.0 - min(len(action.output_token_ids or []), 16) / 16
    return 0.5 * sum(w in text for w in words) / len(words) + 0.5 * brevity


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--out", default="runs/existing_app")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the tiny model's ops are too small to split across threads
    torch.manual_seed(0)

    policies = AgentPolicies.from_pretrained("tiny", list(WORKERS))
    tasks = [Task(id=f"order-{o}", input={"messages": [HumanMessage(f"Order {o}: {issue}. What can you do?")]})
             for o, issue in [("A17", "it arrived damaged"), ("C99", "it never came"), ("B42", "wrong colour")]]
    config = TrainConfig(run_name="existing-app", output_dir=args.out, iterations=args.iterations,
                         tasks_per_iteration=2, rollouts_per_task=4, rollout_concurrency=8, lr=2e-2,
                         reward=RewardConfig(filter_zero_signal=False))
    with PolicyEndpoint(policies, max_tokens=16) as endpoint:
        # the deployment's side: where the app's OpenAI client goes (the app's code stays as it is)
        os.environ["OPENAI_BASE_URL"] = endpoint.base_url
        os.environ.setdefault("OPENAI_API_KEY", "mappa-local")
        app = build_support_team(supervisor_model=HandoffInTurn())
        before = {w: {n: p.detach().clone() for n, p in policies.adapter_parameters(w).items()} for w in WORKERS}
        trainer = Trainer(app, policies, VerifierJudge(keyword_rubric, name="keywords"), tasks, config,
                          endpoint=endpoint)
        records = trainer.train()
        trainer.close()
        served = endpoint.requests_served

    episodes = trainer.store.episodes(run=config.run_name)
    worker_calls = [a for e in episodes for a in e.actions if a.kind == "llm" and a.agent in WORKERS]
    exact = [a for a in worker_calls if a.token_source == "backend" and a.prompt_token_ids and a.output_token_ids
             and a.output_logprobs and len(a.output_logprobs) == len(a.output_token_ids)]
    print(f"endpoint answered {served} requests; {len(episodes)} episodes stored in {args.out}/traces.db")
    print(f"worker model calls with the endpoint's exact token ids and log-probs: {len(exact)}/{len(worker_calls)}")
    for record in records:
        cells = ", ".join(f"{w}: {record['agents'][w]['samples']} samples, reward "
                          f"{record['agents'][w].get('mean_reward', float('nan')):.3f}" for w in WORKERS)
        print(f"iteration {record['iteration']}: {cells}")
    for w in WORKERS:
        routed = sorted({a.adapter for a in worker_calls if a.agent == w})
        params = policies.adapter_parameters(w)
        moved = sum(float((p.detach() - before[w][n]).abs().sum()) for n, p in params.items())
        size = sum(p.numel() for p in params.values())
        print(f"{w}: calls routed to adapter(s) {routed}, adapter moved by mean |dW| {moved / size:.2e}")


if __name__ == "__main__":
    main()
