"""The data-analysis team: graph structure, and one traced episode through the real sandbox and judge."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, ToolMessage

from agents import data_analysis as team
from mappa_graph import instrument
from tests.fakes import ScriptedChatModel


@pytest.fixture()
def task(dabench_dir):
    from agents.data_analysis_training import to_task
    from tools.dabench import load_dabench

    return to_task(load_dabench(ids=[0])[0])  # mean fare of test_ave.csv: @mean_fare[34.65]


def _coder_script(messages):
    tool_messages = [m for m in messages if isinstance(m, ToolMessage)]
    code = "print(df['Fare'].mean(" if not tool_messages else "print(round(df['Fare'].mean(), 2))"
    return AIMessage(content="", tool_calls=[{"name": "python", "args": {"code": code}, "id": f"c{len(tool_messages)}"}])


def _models():
    return {
        "planner": ScriptedChatModel(script=lambda m: AIMessage(content="1. Use Fare. 2. Compute the mean.")),
        "coder": ScriptedChatModel(script=_coder_script),
        "analyst": ScriptedChatModel(script=lambda m: AIMessage(
            content=f"@mean_fare[{m[-1].content.split('Code output:')[1].strip()}]")),
    }


def test_graph_structure_has_the_retry_edge() -> None:
    from tools.sandbox import PythonSandbox

    graph = team.build_data_analysis_graph(_models(), team.make_table_tool(PythonSandbox())).compile()
    drawn = graph.get_graph()
    assert set(graph.nodes) - {"__start__"} == {"planner", "coder", "tools", "analyst"}
    edges = {(e.source, e.target, e.conditional) for e in drawn.edges}
    assert ("__start__", "planner", False) in edges and ("planner", "coder", False) in edges
    assert {("coder", "tools", True), ("coder", "analyst", True), ("tools", "coder", True),
            ("tools", "analyst", True), ("analyst", "__end__", False)} <= edges


def test_missing_agent_model_is_named() -> None:
    from tools.sandbox import PythonSandbox

    with pytest.raises(ValueError, match="no chat model for agent.*analyst"):
        team.build_data_analysis_graph({"planner": None, "coder": None}, team.make_table_tool(PythonSandbox()))


def test_one_traced_episode_with_a_failing_then_fixed_tool_call(task, tmp_path) -> None:
    from agents.data_analysis_training import outcome, process_judge
    from tools.sandbox import PythonSandbox

    tool = team.make_table_tool(PythonSandbox(root=tmp_path, wall_seconds=20))
    app = instrument(team.build_data_analysis_graph(_models(), tool).compile())
    out, episode = app.run_episode(task.input, task_id=task.id, reference=task.reference)
    assert out["answer"] == "@mean_fare[34.65]"
    assert [(a.node, a.kind) for a in episode.actions] == [
        ("planner", "llm"), ("coder", "llm"), ("tools", "node"), ("coder", "llm"), ("tools", "node"), ("analyst", "llm")
    ]
    first, second = episode.actions[1], episode.actions[3]
    assert first.tool_results[0].output.startswith("error:") and "SyntaxError" in first.tool_results[0].output
    assert second.tool_results[0].output.strip() == "34.65"
    rewards = {r.action_id: r for r in process_judge().score(episode)}
    assert rewards[episode.actions[0].id].score == 1.0  # the plan names Fare
    assert rewards[first.id].score == 0.2 and rewards[second.id].score == 1.0
    assert rewards[episode.actions[5].id].score == 1.0
    assert episode.actions[2].id not in rewards  # the ToolNode's turn shows, but is not judged
    episode.final_state = out
    assert outcome(episode) == 1.0


def test_warm_start_slips_are_independent_and_no_answer_follows_a_slipped_code(dabench_dir) -> None:
    """The noisy warm start's demonstrations: the coder and the analyst slip at the given rate, each on its own;
    the planner never does (the coder copies columns from the plan); there is no answer to demonstrate where
    the code never ran; and an analyst's slip still copies the printed value."""
    from agents.data_analysis_training import warm_start_examples
    from tools.dabench_templates import SMALL_TABLES, templated_tasks

    tasks = templated_tasks(120, seed=0, tables=SMALL_TABLES, max_number_chars=5)
    tool = team.make_table_tool(sandbox=None)
    clean = warm_start_examples(tasks, tool, noise=0.0, seed=0)
    assert len(clean) == 3 * len(tasks)
    noisy = warm_start_examples(tasks, tool, noise=0.4, seed=0)

    def of(agent: str, examples: list) -> list:
        return [e for e in examples if e.messages[0]["content"] == team.ROLES[agent]]

    assert [e.reply for e in of("planner", noisy)] == [e.reply for e in of("planner", clean)]
    coder = of("coder", noisy)
    slipped = [e for e in coder if "<tool_call>" not in e.reply]
    assert len(coder) == len(tasks) and 0.25 < len(slipped) / len(coder) < 0.55
    answers = of("analyst", noisy)
    assert len(answers) == len(tasks) - len(slipped)
    misnamed = [e for e in answers if e.reply.startswith("@answer[")]
    assert 0.25 < len(misnamed) / len(answers) < 0.55
    formatted = {e.reply for e in of("analyst", clean)}
    # the same value under the wrong name: the copy of the number is demonstrated as often as without noise
    assert all(any(f.endswith(e.reply.removeprefix("@answer")) for f in formatted) for e in misnamed)


def test_validated_warm_start_keeps_the_first_coder_good_enough_and_else_the_best(dabench_dir, monkeypatch) -> None:
    """Each try trains on the same questions with the next seed, none of the validation questions among them,
    and the first whose coder reaches the bar ends the search; with none there, the best try is kept."""
    from agents import data_analysis_training as recipe
    from mappa_graph.models import sft
    from tools.dabench_templates import SMALL_TABLES, templated_tasks

    tasks = templated_tasks(40, seed=0, tables=SMALL_TABLES, max_number_chars=5)
    trained: list[tuple[int, set[str]]] = []

    def fake_warm_start(base, examples, *, seed, **_):
        trained.append((seed, {e.messages[-1]["content"] for e in examples}))
        return f"/warm/{seed}"

    validated: list[list[int]] = []
    demonstrated: list[list[int]] = []
    scores = iter([0.2, 0.7, 0.9])
    examples_of = recipe.warm_start_examples

    def fake_skill(folder, validation, tool):
        validated.append([t.id for t in validation])
        return next(scores)

    def spy_examples(chosen, *args, **kwargs):
        demonstrated.append([t.id for t in chosen])
        return examples_of(chosen, *args, **kwargs)

    monkeypatch.setattr(recipe, "warm_start_examples", spy_examples)

    monkeypatch.setattr(sft, "warm_start", fake_warm_start)
    monkeypatch.setattr(recipe, "coder_skill", fake_skill)
    tool = team.make_table_tool(sandbox=None)
    folder, got = recipe.validated_warm_start(tasks, tool, noise=0.3, seed=5, steps=10, lr=1e-2, batch_size=8)
    assert (folder, got) == ("/warm/6", [0.2, 0.7]) and [s for s, _ in trained] == [5, 6]
    assert trained[0][1] == trained[1][1]
    assert validated[0] == validated[1] == [t.id for t in tasks[-4:]]
    assert demonstrated == [[t.id for t in tasks[:-4]]]

    trained.clear()
    scores = iter([0.3, 0.5, 0.1])
    folder, got = recipe.validated_warm_start(tasks, tool, noise=0.3, seed=0, steps=10, lr=1e-2, batch_size=8,
                                              tries=3, good_enough=0.6)
    assert (folder, got) == ("/warm/1", [0.3, 0.5, 0.1])
    with pytest.raises(ValueError, match="at least 2 questions"):
        recipe.validated_warm_start(tasks[:1], tool, noise=0.3, seed=0, steps=10, lr=1e-2, batch_size=8)


def test_coder_skill_counts_the_demonstrated_tool_call_and_nothing_else(dabench_dir, monkeypatch) -> None:
    """The validation score reads a greedy reply the way the warm start wrote it: the teacher's own tool call
    counts, a described computation or another quantile does not."""
    from agents import data_analysis_training as recipe
    from mappa_graph.models.policies import AgentPolicies, Generation
    from tools.dabench_templates import SMALL_TABLES, templated_tasks

    tasks = [t for t in templated_tasks(200, seed=0, tables=SMALL_TABLES, max_number_chars=5)
             if t.concepts == ["count"]][:3]
    tool = team.make_table_tool(sandbox=None)
    coder = [e.reply for e in recipe.warm_start_examples(tasks, tool, noise=0.0, seed=0)
             if e.messages[0]["content"] == team.ROLES["coder"]]
    replies: list[str] = []

    def scripted(self, adapter, prompt_ids, **_):
        ids = self.tokenizer(replies[len(self.seen)], add_special_tokens=False)["input_ids"]
        self.seen.append(prompt_ids)
        return Generation(prompt_token_ids=list(prompt_ids), output_token_ids=ids, output_logprobs=[0.0] * len(ids),
                          finished=True)

    monkeypatch.setattr(AgentPolicies, "sample", scripted)
    monkeypatch.setattr(AgentPolicies, "seen", [], raising=False)
    replies[:] = coder
    assert recipe.coder_skill("tiny", tasks, tool) == 1.0
    AgentPolicies.seen.clear()
    replies[:] = [coder[0].replace("quantile(", "quantile(0.3 if False else "), "I will count the rows.", coder[2]]
    assert recipe.coder_skill("tiny", tasks, tool) == pytest.approx(1 / 3)
