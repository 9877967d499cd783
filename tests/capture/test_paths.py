"""Node paths and agent boundaries: the agent of a node task is decided by its namespace path."""

from __future__ import annotations

import pytest

from mappa_graph.capture.paths import AgentResolver, enclosing_ns, graph_paths, is_internal, node_path
from tests.graphs import build_graph


def test_node_path_strips_task_ids_and_the_instrumented_graphs_own_namespace() -> None:
    assert node_path("researcher:1f2|agent:9a8") == ("researcher", "agent")
    assert node_path("outer:1|team:2|agent:3", root_ns="outer:1") == ("team", "agent")
    assert node_path("planner:77") == ("planner",)
    assert is_internal(("__start__",)) and is_internal(("team", "__start__")) and not is_internal(("team", "agent"))


def test_run_counters_of_a_task_that_runs_graphs_again_are_not_node_names() -> None:
    # the third graph run inside task `team` (a loop over sub.invoke, a retried subgraph node)
    assert node_path("team:1a|2|draft:9f") == ("team", "draft")
    assert node_path("team:1a|12|agent:3c|1|tools:4d") == ("team", "agent", "tools")
    assert enclosing_ns("team:1a|2|draft:9f") == "team:1a"
    assert enclosing_ns("team:1a|agent:3c") == "team:1a"
    assert enclosing_ns("team:1a") is None


def test_default_agent_is_the_outermost_node_and_the_longest_mapped_prefix_wins() -> None:
    default = AgentResolver()
    assert default(("researcher", "agent")) == "researcher" and default(("planner",)) == "planner"
    mapped = AgentResolver({"team": "crew", "team/coder": "coder", "team/coder/inner": "deep"})
    assert mapped(("team", "planner")) == "crew"
    assert mapped(("team", "coder")) == "coder"
    assert mapped(("team", "coder", "inner", "x")) == "deep"
    assert mapped(("solo",)) == "solo"


def test_a_function_of_the_path_may_defer_to_the_default() -> None:
    resolve = AgentResolver(lambda path: f"{path[0]}-{path[-1]}" if len(path) > 1 else None)
    assert resolve(("team", "agent")) == "team-agent"
    assert resolve(("planner",)) == "planner"


def test_paths_of_a_plain_graph_and_the_refusal_names_them() -> None:
    graph = build_graph().compile()
    assert graph_paths(graph) == ["planner", "coder", "tools"]
    AgentResolver({"coder": "analyst"}).check(graph)
    with pytest.raises(ValueError, match=r"unknown node 'planer' in agents= \(graph node paths: planner, coder, tools\)"):
        AgentResolver({"planer": "p"}).check(graph)


def test_agent_names_that_are_not_names_are_refused_before_any_run() -> None:
    graph = build_graph().compile()
    with pytest.raises(TypeError, match=r"agents= maps node paths to agent names .*'coder': 5"):
        AgentResolver({"coder": 5})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="agents= takes a mapping"):
        AgentResolver(["coder"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"agents= failed on node path 'planner': KeyError"):
        AgentResolver(lambda path: {"coder": "c"}[path[0]]).check(graph)
    with pytest.raises(ValueError, match=r"node path 'planner': TypeError: the agents= function returned 7"):
        AgentResolver(lambda path: 7).check(graph)
    AgentResolver(lambda path: "team" if path[0] != "tools" else None).check(graph)


def test_a_graph_a_tool_runs_is_its_own_agent_unless_mapped() -> None:
    resolve = AgentResolver({"tools/ask_writer": "writer"})
    assert resolve(("tools", "ask_researcher", "model"), "ask_researcher") == "ask_researcher"
    assert resolve(("tools", "ask_writer", "model"), "ask_writer") == "writer"


@pytest.mark.filterwarnings("ignore::langgraph.warnings.LangGraphDeprecatedSinceV10")
def test_keys_below_a_path_langgraph_cannot_see_into_are_taken_on_trust() -> None:
    from tests.capture.apps import supervisor_app

    graph = supervisor_app()
    AgentResolver({"researcher/tools/ask_expert": "expert", "math_expert/agent": "m"}).check(graph)
    with pytest.raises(ValueError, match=r"unknown node 'researcher/agent/'"):
        AgentResolver({"researcher/agent/": "r"}).check(graph)
    with pytest.raises(ValueError, match=r"unknown node 'researcher/tool'"):
        AgentResolver({"researcher/tool": "r"}).check(graph)
