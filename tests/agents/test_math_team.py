"""agents/math_team.py: the graph's structure (solver -> verifier, a conditional edge back for a retry), one
traced episode with scripted models where the verifier rejects the first attempt, the process judge's
scores and the outcome, and one episode and one training step on the real tiny policy."""

from __future__ import annotations

from pathlib import Path

import pytest
from langchain_core.messages import BaseMessage
from langgraph.graph import END, START

from agents import math_team
from agents.math_team import AGENTS, build_math_graph, outcome, parse_verdict, process_judge, to_task
from mappa_graph import instrument
from mappa_graph.testing import ScriptedChatModel
from tools.math_answers import MathProblem, synthetic_arithmetic

PROBLEM = MathProblem(id="t/1", prompt="Compute (2 + 3) * 4.", answer="20", source="test")


def _last(messages: list[BaseMessage]) -> str:
    return str(messages[-1].content)


WRONG, RIGHT = "2 + 3 = 6. 6 * 4 = 24. \\boxed{24}", "2 + 3 = 5. 5 * 4 = 20. \\boxed{20}"


def scripted_team(*, first: str = WRONG, fixed: str = RIGHT,
                  approve=lambda text: "\\boxed{20}" in text) -> dict[str, ScriptedChatModel]:
    """A solver that slips on its first attempt and fixes it once told, and a verifier that approves
    exactly the solutions `approve` accepts."""
    def solver(messages: list[BaseMessage]) -> str:
        return fixed if "The verifier replied" in _last(messages) else first

    def verifier(messages: list[BaseMessage]) -> str:
        if approve(_last(messages)):
            return "VERDICT: correct. 5 * 4 = 20."
        return "VERDICT: incorrect. 2 + 3 is 5, not 6."

    return {"solver": ScriptedChatModel(reply=solver), "verifier": ScriptedChatModel(reply=verifier)}


def run(models, *, max_retries: int = 1, problem: MathProblem = PROBLEM):
    graph = instrument(build_math_graph(models, max_retries=max_retries).compile(), background=False)
    task = to_task(problem)
    return graph.run_episode(task.input, task_id=task.id, reference=task.reference)


def test_graph_structure() -> None:
    drawn = build_math_graph(scripted_team()).compile().get_graph()
    assert set(drawn.nodes) == {START, "solver", "verifier", END}
    edges = {(e.source, e.target): e.conditional for e in drawn.edges}
    assert edges == {(START, "solver"): False, ("solver", "verifier"): False,
                     ("verifier", "solver"): True, ("verifier", END): True}


def test_graph_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match=r"no chat model for agent\(s\) verifier \(team agents: solver, verifier\)"):
        build_math_graph({"solver": scripted_team()["solver"]})
    with pytest.raises(ValueError, match="max_retries must be >= 0, got -1"):
        build_math_graph(scripted_team(), max_retries=-1)


def test_parse_verdict() -> None:
    assert parse_verdict("VERDICT: correct. fine") is True
    assert parse_verdict("verdict: **Incorrect** because") is False
    assert parse_verdict("VERDICT: incorrect ... on reflection VERDICT: correct") is True
    assert parse_verdict("looks right to me") is None and parse_verdict("") is None


def test_traced_episode_with_a_retry() -> None:
    models = scripted_team()
    output, episode = run(models)
    assert [(a.node, a.agent, a.kind) for a in episode.actions] == [
        ("solver", "solver", "llm"), ("verifier", "verifier", "llm"),
        ("solver", "solver", "llm"), ("verifier", "verifier", "llm")]
    assert [a.index for a in episode.actions] == [0, 1, 2, 3]
    steps = [a.step for a in episode.actions]
    assert steps == sorted(steps) and len(set(steps)) == 4
    first, rejection, retry, approval = episode.actions
    assert first.input_messages[-1] == {"role": "user", "content": PROBLEM.prompt}
    assert "\\boxed{24}" in rejection.input_messages[-1]["content"]
    # the retry sees its first attempt and the verifier's reason
    assert [m["role"] for m in retry.input_messages] == ["system", "user", "assistant", "user"]
    assert retry.input_messages[2]["content"] == first.output_text
    assert "2 + 3 is 5, not 6" in retry.input_messages[3]["content"]
    assert "\\boxed{20}" in approval.input_messages[-1]["content"]
    assert output["attempts"] == [first.output_text, retry.output_text]
    assert [parse_verdict(v) for v in output["verdicts"]] == [False, True]
    assert output["answer"] == "20" and episode.final_state["answer"] == "20"
    assert episode.task_id == "t/1" and episode.reference == {"answer": "20", "source": "test"}

    rewards = process_judge().score(episode)
    assert [(r.agent, r.score) for r in rewards] == [("solver", 0.2), ("verifier", 1.0), ("solver", 1.0),
                                                     ("verifier", 1.0)]
    assert "answer_correct=0" in rewards[1].rationale and "answer_correct=1" in rewards[3].rationale
    assert outcome(episode) == 1.0


def test_judge_scores_a_fooled_verifier_and_a_missing_box() -> None:
    # the verifier approves a wrong answer: the team fails, and the judge blames the verifier, not only the solver
    _, fooled = run(scripted_team(approve=lambda text: True))
    assert [a.agent for a in fooled.actions] == ["solver", "verifier"]
    assert [r.score for r in process_judge().score(fooled)] == [0.2, 0.0]
    assert outcome(fooled) == 0.0
    # no box at all, rejected, retried, still no box: out of retries (max_retries=1), the episode ends
    _, boxless = run(scripted_team(first="it is twenty", fixed="twenty", approve=lambda text: False))
    assert [a.agent for a in boxless.actions] == ["solver", "verifier"] * 2
    assert [r.score for r in process_judge().score(boxless)] == [0.0, 1.0, 0.0, 1.0]
    assert boxless.final_state["answer"] is None and outcome(boxless) == 0.0


def test_retries_are_capped() -> None:
    never = scripted_team(approve=lambda text: False)
    _, none = run(never, max_retries=0)
    assert [a.agent for a in none.actions] == ["solver", "verifier"]
    _, two = run(never, max_retries=2)
    assert [a.agent for a in two.actions] == ["solver", "verifier"] * 3


def test_verifier_without_a_verdict_ends_the_episode() -> None:
    models = scripted_team()
    models["verifier"] = ScriptedChatModel(reply=lambda messages: "hmm")
    _, episode = run(models)
    assert [a.agent for a in episode.actions] == ["solver", "verifier"]
    assert [r.score for r in process_judge().score(episode)] == [0.2, 0.0]


@pytest.fixture(scope="module")
def tiny_policies(tiny_path: Path):
    from mappa_graph.models.policies import AgentPolicies

    return AgentPolicies.from_pretrained(str(tiny_path), list(AGENTS))


def test_episode_on_the_tiny_policy_carries_token_ids(tiny_policies) -> None:
    models = {a: tiny_policies.chat_model(a, max_new_tokens=8) for a in AGENTS}
    graph = instrument(build_math_graph(models).compile(), background=False)
    task = to_task(PROBLEM)
    _, episode = graph.run_episode(task.input, task_id=task.id, reference=task.reference,
                                   config={"metadata": {"mappa_seed": "test:0"}})
    assert [a.agent for a in episode.actions][:2] == ["solver", "verifier"]
    for action in episode.actions:
        assert action.trainable and action.token_source == "backend" and action.adapter == action.agent
        assert action.prompt_token_ids and 1 <= len(action.output_token_ids) <= 8
        assert len(action.output_logprobs) == len(action.output_token_ids)
    rewards = process_judge().score(episode)
    assert len(rewards) == len(episode.actions) and all(r.score is not None for r in rewards)


def test_build_trainer_runs_a_step_on_the_tiny_policy(tiny_policies, tmp_path: Path) -> None:
    from mappa_graph.training.config import TrainConfig

    config = TrainConfig(run_name="math-test", output_dir=str(tmp_path), iterations=1, tasks_per_iteration=2,
                         rollouts_per_task=2, rollout_concurrency=1, max_new_tokens=6)
    tasks = [to_task(p) for p in synthetic_arithmetic(4, seed=0)]
    trainer = math_team.build_trainer(config, tiny_policies, train_tasks=tasks, eval_tasks=tasks[:1], max_retries=0)
    record = trainer.step()
    assert record["episodes"] == 4 and record["success_rate"] is not None
    assert set(record["agents"]) == set(AGENTS)
    assert all(record["agents"][a]["mean_reward"] is not None for a in AGENTS)  # both agents were judged
    assert (tmp_path / "metrics.jsonl").exists() and (tmp_path / "traces.db").exists()
