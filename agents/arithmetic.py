"""A two-agent arithmetic team, small enough that a 1M-parameter model learns it on a CPU in minutes.

    planner ("Q: 3 plus 5" -> "3+5") ──► calculator ("3+5" -> "8") ──► END

The team succeeds only when both agents are right, which is what makes it a credit-assignment problem: with
the outcome alone, a right planner is blamed for a wrong calculator; a process judge scores each agent's own
step (the planner against the question, the calculator against the expression it was actually given).
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from functools import partial
from typing import Any, TypedDict

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph

from mappa_graph import Action, AgentPolicies, Episode, Task, TrainConfig, Trainer, VerifierJudge
from mappa_graph.models import LoraSettings
from mappa_graph.models.sft import SFTExample, warm_start

AGENTS = ("planner", "calculator")
PLANNER_ROLE = "Write the expression."
CALCULATOR_ROLE = "Compute."
_WORDS = {"+": ["plus", "add"], "-": ["minus", "take"]}


class ArithmeticState(TypedDict, total=False):
    question: str
    expression: str
    answer: str


def planner_messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": PLANNER_ROLE}, {"role": "user", "content": question}]


def calculator_messages(expression: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": CALCULATOR_ROLE}, {"role": "user", "content": expression}]


def build_arithmetic_graph(models: Mapping[str, BaseChatModel]) -> StateGraph:
    def planner(state: ArithmeticState) -> dict[str, Any]:
        m = planner_messages(state["question"])
        reply = models["planner"].invoke([SystemMessage(m[0]["content"]), HumanMessage(m[1]["content"])])
        return {"expression": str(reply.content).strip()}

    def calculator(state: ArithmeticState) -> dict[str, Any]:
        m = calculator_messages(state.get("expression", ""))
        reply = models["calculator"].invoke([SystemMessage(m[0]["content"]), HumanMessage(m[1]["content"])])
        return {"answer": str(reply.content).strip()}

    graph = StateGraph(ArithmeticState)
    graph.add_node("planner", planner)
    graph.add_node("calculator", calculator)
    graph.add_edge(START, "planner")
    graph.add_edge("planner", "calculator")
    graph.add_edge("calculator", END)
    return graph


def question(a: int, op: str, b: int, phrasing: int) -> str:
    return f"{a} {_WORDS[op][phrasing]} {b}"


def make_tasks(n: int, *, seed: int, exclude: set[str] | None = None) -> list[Task]:
    """n distinct tasks (a op b with single digits, two phrasings per operator), none whose id is in exclude."""
    rng = random.Random(seed)
    all_tasks = [(a, op, b, p) for a in range(10) for b in range(10) for op in "+-" for p in (0, 1) if op == "+" or a >= b]
    rng.shuffle(all_tasks)
    tasks = []
    for a, op, b, p in all_tasks:
        tid = f"{a}{op}{b}/{p}"
        if exclude and tid in exclude:
            continue
        value = a + b if op == "+" else a - b
        tasks.append(Task(id=tid, input={"question": question(a, op, b, p)},
                          reference={"expression": f"{a}{op}{b}", "value": value}))
        if len(tasks) == n:
            break
    return tasks


def evaluate_expression(text: str) -> int | None:
    match = re.fullmatch(r"\s*(\d)\s*([+-])\s*(\d)\s*", text or "")
    if not match:
        return None
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return a + b if op == "+" else a - b


def _corrupt_expression(expr: str) -> str:
    a, op, b = expr[0], expr[1], expr[2]
    return f"{a}{op}{(int(b) + 1) % 10}"  # one systematic slip: the second operand off by one


def sft_examples(tasks: list[Task], *, noise: float, seed: int) -> list[SFTExample]:
    """Synthetic traces for both agents; a `noise` share carries one consistent mistake per agent, so the
    warm-started team is right only part of the time and RL has something to fix."""
    rng = random.Random(seed)
    examples = []
    for task in tasks:
        ref = task.reference
        expr = ref["expression"]
        plan = _corrupt_expression(expr) if rng.random() < noise else expr
        examples.append(SFTExample(messages=planner_messages(task.input["question"]), reply=plan))
        for e in sorted({expr, _corrupt_expression(expr)}):
            value = evaluate_expression(e)
            answer = value + 1 if rng.random() < noise else value  # the calculator's slip: one too many
            examples.append(SFTExample(messages=calculator_messages(e), reply=str(answer)))
    return examples


def _step_score(action: Action, episode: Episode, reference: Any) -> float | None:
    if action.kind != "llm":
        return None
    if action.agent == "planner":
        return 1.0 if action.output_text.strip() == reference["expression"] else 0.0
    if action.agent == "calculator":
        given = action.input_messages[-1]["content"] if action.input_messages else ""
        expected = evaluate_expression(given)
        if expected is None:
            return None  # nothing well-formed to compute: no verdict on the calculator (it is not its fault)
        return 1.0 if action.output_text.strip() == str(expected) else 0.0
    return None


def process_judge() -> VerifierJudge:
    """Scores each agent's own step in context: the programmatic stand-in for MAPPA's coach."""
    return VerifierJudge(_step_score, name="arithmetic-process")


def outcome(episode: Episode) -> float:
    answer = str((episode.final_state or {}).get("answer", "")).strip()
    return 1.0 if answer == str(episode.reference["value"]) else 0.0


def train_and_eval_tasks() -> tuple[list[Task], list[Task]]:
    train = make_tasks(200, seed=1)
    return train, make_tasks(60, seed=2, exclude={t.id for t in train})


def warm_policies(base: str = "tiny", *, warm_steps: int = 400, noise: float = 0.6) -> AgentPolicies:
    """The base warm-started on noisy traces of both agents (cached), with a fresh LoRA adapter per agent."""
    train, _ = train_and_eval_tasks()
    warm = warm_start(base, sft_examples(train, noise=noise, seed=3), steps=warm_steps)
    return AgentPolicies.from_pretrained(str(warm), list(AGENTS), lora=LoraSettings(r=8, alpha=16))


def team_graph(policies: AgentPolicies, *, max_new_tokens: int = 32, temperature: float = 1.0) -> Any:
    """The compiled team on these policies: the factory Ray workers call to build their own copy."""
    models = {a: policies.chat_model(a, max_new_tokens=max_new_tokens, temperature=temperature) for a in AGENTS}
    return build_arithmetic_graph(models).compile()


def build_trainer(config: TrainConfig, policies: AgentPolicies | None = None, **trainer_kwargs: Any) -> Trainer:
    """The whole recipe: team graph on the policies, process judge, outcome, train and held-out tasks."""
    policies = policies or warm_policies()
    train, held_out = train_and_eval_tasks()
    graph = partial(team_graph, max_new_tokens=config.max_new_tokens)  # config.temperature: the trainer applies it
    return Trainer(graph, policies, process_judge(), train, config, outcome=outcome, eval_tasks=held_out,
                   **trainer_kwargs)
