""".venv/bin/python examples/existing_app.py [--iterations 3] [--out runs/existing_app]

Train an existing LangGraph app without changing its code. agents/support_team.py is a langgraph-supervisor
team whose supervisor and two `create_react_agent` workers all run on a plain `ChatOpenAI` (no mappa import
there). Here the policy endpoint serves the tiny model's three LoRA adapters (supervisor, researcher, writer)
on loopback; `OPENAI_BASE_URL` points the app's ChatOpenAI at it; the Trainer attaches the endpoint's router
to the app, so every model call, the supervisor's handoffs included, goes to its own agent's adapter and the
trace records the exact token ids and log-probs the endpoint sampled; each adapter is then updated on its own
agent's actions only.

The tiny model starts from random weights and cannot write a handoff (a tool call) from scratch, so the base
gets a short supervised warm start first (cached by hash) on the app's own prompts: the app is run once per
warm-start task with scripted stand-ins for its models that record every prompt they are shown (the messages
and tools langgraph-supervisor and create_react_agent build), and answer what the team should: the supervisor
`<tool_call>{"name": "transfer_to_researcher", ...}</tool_call>`, then the writer, then a short final answer;
the workers a short reply. The endpoint's parser turns the supervisor's `<tool_call>` text into OpenAI tool
calls. The rewards are toy process rewards (the supervisor: the right handoff in order, then finishing; the
workers: a keyword rubric): the run shows the plumbing (routing, exact traces, per-agent updates), not learning.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict, Field

from agents.support_team import WORKERS, build_support_team
from mappa_graph.judging.verifier import VerifierJudge
from mappa_graph.models.chat import to_hf_messages
from mappa_graph.models.policies import AgentPolicies
from mappa_graph.models.sft import SFTExample, warm_start
from mappa_graph.serving.endpoint import PolicyEndpoint
from mappa_graph.traces import Action, Task
from mappa_graph.training.config import TrainConfig
from mappa_graph.training.credit import RewardConfig
from mappa_graph.training.trainer import Trainer

SUPERVISOR = "supervisor"  # langgraph-supervisor's node name: the router's default agent for its calls
AGENTS = (SUPERVISOR, *WORKERS)
FINAL = "The team has answered."
# words the tiny model's vocabulary has, so the toy rubric can tell the workers' replies apart
KEYWORDS = {"researcher": ("data", "value", "number", "count", "table"), "writer": ("answer", "final", "yes", "correct", "result")}
# what the workers are warm-started to say: some replies use their keywords, some do not, so RL has a signal
REPLIES = {
    "researcher": ["The data value is in the table.", "Order {o}: the number is {n}.", "Check the order.",
                   "The count is {n}, data found.", "I look at it."],
    "writer": ["The final answer: yes, a refund.", "Sorry. The result is correct.", "We will help you.",
               "Yes, the answer is a refund.", "Thank you for the order."],
}
ISSUES = ["it arrived damaged", "it never came", "wrong colour", "it came late", "a part is missing",
          "the box was open", "I want a refund", "it does not work"]
TASKS = [("A17", "it arrived damaged"), ("C99", "it never came"), ("B42", "wrong colour")]
HANDOFF = '<tool_call>{}</tool_call>'


def ask(order: str, issue: str) -> dict[str, Any]:
    return {"messages": [HumanMessage(f"Order {order}: {issue}. What can you do?")]}


# ---- warm start on the app's own prompts ----------------------------------------------------------------
def expected_move(messages: Sequence[dict[str, Any]]) -> str:
    """What the supervisor should do next, from the messages it was shown: hand off to the first worker it
    has not handed off to yet, in order, or answer (`FINAL`) once both have been. Takes trace messages
    (`{"name": ...}` tool calls) or Hugging Face ones (`{"function": {"name": ...}}`)."""
    handed = {c.get("name") or c.get("function", {}).get("name") for m in messages for c in m.get("tool_calls") or []}
    return next((f"transfer_to_{w}" for w in WORKERS if f"transfer_to_{w}" not in handed), FINAL)


class Recorder(BaseChatModel):
    """A scripted stand-in for one of the app's models during the warm-start run: it records each prompt
    (messages and bound tools, as the Hugging Face chat template will see them) with the reply the team should
    give, and answers with that reply so the app moves on to its next model call."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    role: str  # "supervisor" or "worker"
    rng: Any
    examples: list[SFTExample] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None

    @property
    def _llm_type(self) -> str:
        return "warm-start-recorder"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Any:
        # a copy that shares `examples`: each agent binds its own tools, as ChatOpenAI.bind_tools would send them
        return self.model_copy(update={"tools": [convert_to_openai_tool(t) for t in tools]})

    def _generate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:
        hf = to_hf_messages(messages)
        if self.role == SUPERVISOR:
            move = expected_move(hf)
            if move == FINAL:
                text, reply = FINAL, AIMessage(FINAL)
            else:
                text = HANDOFF.format(json.dumps({"name": move, "arguments": {}}))
                reply = AIMessage("", tool_calls=[{"name": move, "args": {}, "id": f"call_{uuid.uuid4().hex[:12]}"}])
        else:
            worker = "researcher" if any(t["function"]["name"] == "lookup_order" for t in self.tools or []) else "writer"
            text = self.rng.choice(REPLIES[worker]).format(o=self.rng.choice(TASKS)[0], n=self.rng.randint(1, 99))
            reply = AIMessage(text)
        self.examples.append(SFTExample(messages=_without_ids(hf), tools=self.tools or None, reply=text))
        return ChatResult(generations=[ChatGeneration(message=reply)])


def _without_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages without tool-call ids, which the chat template does not render and which are random
    (uuid4), so the warm start's cache key (a hash of its examples) stays the same from run to run."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k != "tool_call_id"}
        if m.get("tool_calls"):
            m["tool_calls"] = [{k: v for k, v in c.items() if k != "id"} for c in m["tool_calls"]]
        out.append(m)
    return out


def warm_start_examples(*, runs: int = 32, seed: int = 0) -> list[SFTExample]:
    """The app's own prompts, each with the reply the team should give: `runs` passes through the real
    compiled app (langgraph-supervisor's handoff tools, handoff-back messages and all) with Recorders in
    place of its models. Per run: three supervisor turns (each with its tools in both orders), one per worker."""
    rng = random.Random(seed)
    supervisor, worker = Recorder(role=SUPERVISOR, rng=rng), Recorder(role="worker", rng=rng)
    worker.examples = supervisor.examples  # one list for both
    app = build_support_team(supervisor_model=supervisor, worker_model=worker)
    for _ in range(runs):
        order = f"{rng.choice('ABCDE')}{rng.randint(10, 99)}"
        app.invoke(ask(order, rng.choice(ISSUES)))
    # langgraph-supervisor lists its handoff tools in set order, which changes from process to process (hash
    # randomization): learn both orders, listed in a fixed order so the cache key stays the same
    examples = []
    for example in supervisor.examples:
        if example.tools and len(example.tools) > 1:
            tools = sorted(example.tools, key=lambda t: t["function"]["name"])
            examples += [example.model_copy(update={"tools": order}) for order in (tools, tools[::-1])]
        else:
            examples.append(example)
    return examples


# ---- rewards ------------------------------------------------------------------------------------------
def supervisor_move(action: Action) -> str:
    """What the supervisor's call did: the handoff it made, FINAL for a plain answer, or "" for neither (an
    empty reply, or a `<tool_call>` the parser could not read)."""
    calls = (action.output_message or {}).get("tool_calls") or []
    if calls:
        return calls[0]["name"] if len(calls) == 1 else ""
    text = action.output_text.strip()
    return FINAL if text and "<tool_call>" not in text else ""


def team_rubric(action: Action, episode: Any, reference: Any) -> float | None:
    """Toy process reward. The supervisor: 1 for the right move (hand off to the researcher, then the writer,
    then answer), else 0. A worker: half for the keywords its reply uses, half for brevity."""
    if action.agent == SUPERVISOR:
        return float(supervisor_move(action) == expected_move(action.input_messages))
    words = KEYWORDS.get(action.agent)
    if words is None:
        return None
    text = action.output_text.lower()
    brevity = 1.0 - min(len(action.output_token_ids or []), 16) / 16
    return 0.5 * sum(w in text for w in words) / len(words) + 0.5 * brevity


def exact(action: Action) -> bool:
    """The call's trace holds the endpoint's own tokens: prompt and output ids, one log-prob per output id."""
    return bool(action.token_source == "backend" and action.prompt_token_ids and action.output_token_ids
                and action.output_logprobs and len(action.output_logprobs) == len(action.output_token_ids))


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--warm-steps", type=int, default=150, help="supervised warm-start steps (cached)")
    parser.add_argument("--out", default="runs/existing_app")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the tiny model's ops are too small to split across threads
    torch.manual_seed(0)
    started = time.monotonic()

    examples = warm_start_examples()
    base = str(warm_start("tiny", examples, steps=args.warm_steps, batch_size=4, lr=5e-3, progress=False))
    print(f"warm start: {len(examples)} prompts of the app's own, {args.warm_steps} steps "
          f"({time.monotonic() - started:.0f}s, cached)")
    policies = AgentPolicies.from_pretrained(base, list(AGENTS))
    tasks = [Task(id=f"order-{o}", input=ask(o, issue)) for o, issue in TASKS]
    config = TrainConfig(run_name="existing-app", output_dir=args.out, iterations=args.iterations,
                         tasks_per_iteration=2, rollouts_per_task=4, rollout_concurrency=8, lr=5e-3,
                         reward=RewardConfig(filter_zero_signal=False))
    # max_tokens: the supervisor's ChatOpenAI asks for no length, and a handoff is ~35 tokens of the tiny model
    with PolicyEndpoint(policies, max_tokens=48) as endpoint:
        # the deployment's side: where the app's OpenAI client goes (the app's code stays as it is)
        os.environ["OPENAI_BASE_URL"] = endpoint.base_url
        os.environ.setdefault("OPENAI_API_KEY", "mappa-local")
        app = build_support_team(max_tokens=16)
        before = {a: {n: p.detach().clone() for n, p in policies.adapter_parameters(a).items()} for a in AGENTS}
        trainer = Trainer(app, policies, VerifierJudge(team_rubric, name="team-rubric"), tasks, config,
                          endpoint=endpoint)
        records = trainer.train()
        trainer.close()
        served = endpoint.requests_served
        left_pending = len(endpoint.registry.pending())

    episodes = trainer.store.episodes(run=config.run_name)
    calls = [a for e in episodes for a in e.actions if a.kind == "llm"]
    print(f"endpoint answered {served} requests; {len(episodes)} episodes stored in {args.out}/traces.db; "
          f"{left_pending} calls left pending")
    print(f"model calls with exact token ids and log-probs: {sum(map(exact, calls))}/{len(calls)} "
          f"({', '.join(f'{a}: {sum(c.agent == a for c in calls)}' for a in AGENTS)})")
    for record in records:
        stats = {a: record["agents"].get(a) or {} for a in AGENTS}
        cells = ", ".join(f"{a}: {stats[a].get('samples', 0)} samples, reward "
                          f"{_number(stats[a].get('mean_reward'))}" for a in AGENTS)
        print(f"iteration {record['iteration']}: {cells}")
    moved = {}
    for agent in AGENTS:
        routed = sorted({str(a.adapter) for a in calls if a.agent == agent})
        params = policies.adapter_parameters(agent)
        moved[agent] = sum(float((p.detach() - before[agent][n]).abs().sum()) for n, p in params.items())
        size = sum(p.numel() for p in params.values())
        print(f"{agent}: calls routed to adapter(s) {routed}, adapter moved by mean |dW| {moved[agent] / size:.2e}")
    print(f"wall time {time.monotonic() - started:.0f}s")
    return {"episodes": episodes, "records": records, "served": served, "pending": left_pending,
            "moved": moved, "policies": policies, "examples": examples}


if __name__ == "__main__":
    main()
