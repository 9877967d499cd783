"""The math team: a solver writes a solution ending in `\\boxed{}`, a verifier checks it, and a rejected
solution goes back to the solver with the verifier's reason, while retries are left.

    solver ──► verifier ──(VERDICT: incorrect, retries left)──► solver
                  └──────(correct, no verdict, or out of retries)──► END

MAPPA's math team also runs a code executor between the two; this one keeps the two roles whose credit is
hardest to untangle with the outcome alone (a right verifier is blamed for a wrong solver). The process
judge scores each agent's own step against the reference: the solver by its boxed answer, the verifier by
whether its verdict is true of the solution it was shown.
"""

from __future__ import annotations

import operator
import random
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, TypedDict

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import convert_to_messages
from langgraph.graph import END, START, StateGraph

from mappa_graph import Action, AgentPolicies, Episode, Task, TrainConfig, Trainer, VerifierJudge
from mappa_graph.models import LoraSettings
from mappa_graph.models.sft import SFTExample, warm_start
from tools.math_answers import MathProblem, answers_match, extract_boxed, synthetic_arithmetic

AGENTS = ("solver", "verifier")
# Short on purpose: every token of a role is paid for in each warm-start step and rollout on the CPU.
SOLVER_ROLE = "Solve the problem step by step. End with the final answer in \\boxed{}."
VERIFIER_ROLE = "Check the solution. Reply VERDICT: correct or VERDICT: incorrect, then the reason."
SOLUTION_MARK = "\n\nSolution:\n"
_VERDICT = re.compile(r"VERDICT\s*:\s*\**\s*(correct|incorrect)\b", re.IGNORECASE)
# Scores of the solver's step: the reference's 1 / 0 with partial credit for following the format.
SOLVER_RIGHT, SOLVER_WRONG, SOLVER_NO_BOX = 1.0, 0.2, 0.0


class MathState(TypedDict, total=False):
    problem: str
    attempts: Annotated[list[str], operator.add]  # every solution the solver wrote, in order
    verdicts: Annotated[list[str], operator.add]  # the verifier's reply to each attempt
    answer: str | None  # the last attempt's boxed answer (None: it had none)


def solver_messages(problem: str, attempts: Sequence[str] = (), verdicts: Sequence[str] = ()) -> list[dict[str, str]]:
    """The solver's prompt (HF format): the problem, then each earlier attempt with the verifier's reply."""
    messages = [{"role": "system", "content": SOLVER_ROLE}, {"role": "user", "content": problem}]
    for attempt, verdict in zip(attempts, verdicts):
        messages.append({"role": "assistant", "content": attempt})
        messages.append({"role": "user", "content": f"The verifier replied: {verdict}\nSolve it again."})
    return messages


def verifier_messages(problem: str, solution: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": VERIFIER_ROLE},
            {"role": "user", "content": f"Problem:\n{problem}{SOLUTION_MARK}{solution}"}]


def parse_verdict(text: str) -> bool | None:
    """True for "VERDICT: correct", False for "VERDICT: incorrect" (the last one wins), None for neither."""
    found = _VERDICT.findall(text or "")
    return found[-1].lower() == "correct" if found else None


def build_math_graph(models: Mapping[str, BaseChatModel], *, max_retries: int = 1) -> StateGraph:
    """The team's graph (uncompiled, so callers can add a checkpointer). `models` maps "solver" and
    "verifier" to the chat model that plays each; `max_retries` caps the solver's extra attempts. A verifier
    reply with no VERDICT line ends the episode: only an explicit rejection sends the solver back."""
    missing = [a for a in AGENTS if a not in models]
    if missing:
        raise ValueError(f"no chat model for agent(s) {', '.join(missing)} (team agents: {', '.join(AGENTS)})")
    if max_retries < 0:
        raise ValueError(f"max_retries must be >= 0, got {max_retries}")

    def solver(state: MathState) -> dict[str, Any]:
        prompt = solver_messages(state["problem"], state.get("attempts", []), state.get("verdicts", []))
        solution = str(models["solver"].invoke(convert_to_messages(prompt)).content).strip()
        return {"attempts": [solution], "answer": extract_boxed(solution)}

    def verifier(state: MathState) -> dict[str, Any]:
        prompt = verifier_messages(state["problem"], state["attempts"][-1])
        return {"verdicts": [str(models["verifier"].invoke(convert_to_messages(prompt)).content).strip()]}

    def after_verifier(state: MathState) -> str:
        rejected = parse_verdict(state["verdicts"][-1]) is False
        return "solver" if rejected and len(state["attempts"]) <= max_retries else END

    graph = StateGraph(MathState)
    graph.add_node("solver", solver)
    graph.add_node("verifier", verifier)
    graph.add_edge(START, "solver")
    graph.add_edge("solver", "verifier")
    graph.add_conditional_edges("verifier", after_verifier, ["solver", END])
    return graph


def to_task(problem: MathProblem) -> Task:
    return Task(id=problem.id, input={"problem": problem.prompt},
                reference={"answer": problem.answer, "source": problem.source})


# ---- judge and outcome --------------------------------------------------------------------------------------
def solution_seen(action: Action) -> str | None:
    """The solution a verifier action was shown, read back from its prompt."""
    for message in reversed(action.input_messages):
        content = message.get("content")
        if message.get("role") == "user" and isinstance(content, str) and SOLUTION_MARK in content:
            return content.split(SOLUTION_MARK, 1)[1]
    return None


def _step_score(action: Action, episode: Episode, reference: Any) -> tuple[float, str] | None:
    if action.kind != "llm":
        return None
    answer = reference["answer"]
    if action.agent == "solver":
        boxed = extract_boxed(action.output_text)
        if boxed is None:
            return SOLVER_NO_BOX, "no \\boxed{} answer"
        if answers_match(boxed, answer):
            return SOLVER_RIGHT, f"boxed {boxed!r} matches the reference"
        return SOLVER_WRONG, f"boxed {boxed!r}, reference {answer!r}"
    if action.agent == "verifier":
        solution = solution_seen(action)
        if solution is None:
            return None  # a prompt this judge cannot read: no verdict on the verifier
        true = answers_match(extract_boxed(solution), answer)
        verdict = parse_verdict(action.output_text)
        flag = f"answer_correct={int(true)}"  # the reference's 0/1 flag on the verifier's turn
        if verdict is None:
            return 0.0, f"no VERDICT line; {flag}"
        agrees = verdict == true
        return float(agrees), f"said {'correct' if verdict else 'incorrect'}, {'right' if agrees else 'wrong'}; {flag}"
    return None


def process_judge() -> VerifierJudge:
    """Each agent's own step against the reference: the programmatic stand-in for MAPPA's coach."""
    return VerifierJudge(_step_score, name="math-process")


def outcome(episode: Episode) -> float:
    """1.0 when the team's final boxed answer matches the reference."""
    return float(answers_match((episode.final_state or {}).get("answer"), episode.reference["answer"]))


# ---- warm start and trainer ---------------------------------------------------------------------------------
def _wrong(problem: MathProblem) -> str:
    wrong = int(problem.answer) + 1  # one systematic slip: the last step off by one
    steps = (problem.solution or "").rsplit("\\boxed", 1)[0].strip()
    steps = re.sub(rf"= {re.escape(problem.answer)}\.$", f"= {wrong}.", steps)
    return f"{steps} \\boxed{{{wrong}}}".strip()


def sft_examples(problems: Sequence[MathProblem], *, noise: float = 0.3, seed: int = 0) -> list[SFTExample]:
    """Synthetic traces of both agents on problems with integer answers and worked solutions (as
    `synthetic_arithmetic` makes them): the solver writes the solution
    (a `noise` share off by one), the verifier judges a right and a wrong solution, and a rejected solver
    retries with the right one. Enough to learn the formats; the arithmetic itself is left to RL."""
    rng = random.Random(seed)
    examples = []
    for p in problems:
        right, wrong = p.solution or f"\\boxed{{{p.answer}}}", _wrong(p)
        first = wrong if rng.random() < noise else right
        examples.append(SFTExample(messages=solver_messages(p.prompt), reply=first))
        rejection = f"VERDICT: incorrect. The answer is not {int(p.answer) + 1}."
        examples.append(SFTExample(messages=verifier_messages(p.prompt, right),
                                   reply="VERDICT: correct. Each step checks out."))
        examples.append(SFTExample(messages=verifier_messages(p.prompt, wrong), reply=rejection))
        examples.append(SFTExample(messages=solver_messages(p.prompt, [wrong], [rejection]), reply=right))
    return examples


def train_and_eval_problems() -> tuple[list[MathProblem], list[MathProblem]]:
    train = synthetic_arithmetic(200, seed=1)
    return train, synthetic_arithmetic(40, seed=2, exclude={p.prompt for p in train})


def math_policies(base: str = "tiny", *, warm_steps: int = 150, noise: float = 0.3,
                  batch_size: int = 16) -> AgentPolicies:
    """The base with one fresh LoRA adapter per agent; `warm_steps` > 0 first fine-tunes the base on the
    synthetic traces (cached), which the tiny model needs to learn the formats. Use 0 for a real
    instruction-tuned model: it already writes `\\boxed{}` and a full fine-tune would be wasted."""
    if warm_steps > 0:
        train, _ = train_and_eval_problems()
        base = str(warm_start(base, sft_examples(train, noise=noise, seed=3), steps=warm_steps,
                              batch_size=batch_size))
    return AgentPolicies.from_pretrained(base, list(AGENTS), lora=LoraSettings(r=8, alpha=16))


def build_trainer(
    config: TrainConfig,
    policies: AgentPolicies | None = None,
    *,
    train_tasks: Sequence[Task] | None = None,
    eval_tasks: Sequence[Task] | None = None,
    max_retries: int = 1,
    **trainer_kwargs: Any,
) -> Trainer:
    """The whole recipe: team graph on the policies, process judge, outcome, and tasks (default: the
    synthetic arithmetic set, train and held out)."""
    policies = policies or math_policies()
    train, held_out = train_and_eval_problems()
    models = {a: policies.chat_model(a, max_new_tokens=config.max_new_tokens) for a in AGENTS}
    graph = build_math_graph(models, max_retries=max_retries).compile()
    return Trainer(graph, policies, process_judge(), list(train_tasks or [to_task(p) for p in train]), config,
                   outcome=outcome, eval_tasks=list(eval_tasks or [to_task(p) for p in held_out]), **trainer_kwargs)
