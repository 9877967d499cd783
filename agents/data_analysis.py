"""The data-analysis team as a LangGraph StateGraph: planner -> coder (Python tool) -> analyst.

    planner ──► coder ──(tool call)──► tools ──(error, turns left)──► coder
                  │                       └──(ran, or out of turns)──► analyst ──► END
                  └──(no tool call)──────────────────────────────────► analyst

Each agent builds its own prompt from the shared state (its role, the question, what the team has produced so
far), so a node's model call is exactly that agent's action: what the judge scores and the adapter trains on.
Any langchain-core chat model serves each role: a `PolicyChatModel` (one adapter per agent), ChatOpenAI...
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Annotated, Any, TypedDict

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import BaseTool
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode

AGENTS = ("planner", "coder", "analyst")
ANALYST_OUTPUT_CHARS = 400  # the analyst needs the printed values, not pages of a DataFrame

ROLES: dict[str, str] = {
    "planner": (
        "You are the planner of a data-analysis team. Read the question and the table's columns and write a "
        "short numbered plan: which columns to use and which computation answers the question."
    ),
    "coder": (
        "You are the coder of a data-analysis team. The table is loaded as the pandas DataFrame `df`. Call the "
        "python tool with code that prints exactly the numbers the question asks for. If the last run failed, "
        "fix the code and call the tool again."
    ),
    "analyst": (
        "You are the analyst of a data-analysis team. From the code output, write the final answer in exactly "
        "the requested format, e.g. @name[value], with the rounding the question asks for."
    ),
}


class AnalysisState(TypedDict, total=False):
    table_path: str
    question: str
    constraints: str
    format: str
    columns: list[str]
    plan: str
    messages: Annotated[list[BaseMessage], add_messages]  # the coder's tool dialogue
    coder_turns: Annotated[int, operator.add]
    answer: str


def task_brief(state: Mapping[str, Any]) -> str:
    parts = [f"Question: {state['question']}"]
    if state.get("constraints"):
        parts.append(f"Constraints: {state['constraints']}")
    if state.get("columns"):
        parts.append(f"Columns: {', '.join(state['columns'])}")
    if state.get("format"):
        parts.append(f"Answer format: {state['format']}")
    return "\n".join(parts)


def last_tool_output(state: Mapping[str, Any]) -> ToolMessage | None:
    for message in reversed(state.get("messages", [])):
        if isinstance(message, ToolMessage):
            return message
    return None


def tool_failed(message: ToolMessage | None) -> bool:
    return message is not None and (message.status == "error" or message.content.startswith("error:"))


def planner_prompt(state: Mapping[str, Any]) -> list[BaseMessage]:
    return [SystemMessage(ROLES["planner"]), HumanMessage(task_brief(state))]


def coder_prompt(state: Mapping[str, Any]) -> list[BaseMessage]:
    return [
        SystemMessage(ROLES["coder"]),
        HumanMessage(f"{task_brief(state)}\nPlan:\n{state.get('plan', '')}"),
        *state.get("messages", []),
    ]


def analyst_prompt(state: Mapping[str, Any]) -> list[BaseMessage]:
    output = last_tool_output(state)
    seen = str(output.content)[:ANALYST_OUTPUT_CHARS] if output is not None else "(no code was run)"
    return [SystemMessage(ROLES["analyst"]), HumanMessage(f"{task_brief(state)}\nCode output:\n{seen}")]


def build_data_analysis_graph(
    models: Mapping[str, BaseChatModel],
    python_tool: BaseTool,
    *,
    max_coder_turns: int = 3,
) -> StateGraph:
    """The team's graph (uncompiled, so callers can add a checkpointer). `models` maps each of AGENTS to the
    chat model that plays it."""
    missing = [a for a in AGENTS if a not in models]
    if missing:
        raise ValueError(f"no chat model for agent(s) {', '.join(missing)} (team agents: {', '.join(AGENTS)})")
    coder_model = models["coder"].bind_tools([python_tool])

    def planner(state: AnalysisState) -> dict[str, Any]:
        return {"plan": str(models["planner"].invoke(planner_prompt(state)).content)}

    def coder(state: AnalysisState) -> dict[str, Any]:
        return {"messages": [coder_model.invoke(coder_prompt(state))], "coder_turns": 1}

    def analyst(state: AnalysisState) -> dict[str, Any]:
        return {"answer": str(models["analyst"].invoke(analyst_prompt(state)).content)}

    def after_coder(state: AnalysisState) -> str:
        last = state["messages"][-1]
        return "tools" if isinstance(last, AIMessage) and last.tool_calls else "analyst"

    def after_tools(state: AnalysisState) -> str:
        if tool_failed(last_tool_output(state)) and state.get("coder_turns", 0) < max_coder_turns:
            return "coder"
        return "analyst"

    graph = StateGraph(AnalysisState)
    graph.add_node("planner", planner)
    graph.add_node("coder", coder)
    graph.add_node("tools", ToolNode([python_tool], handle_tool_errors=True))
    graph.add_node("analyst", analyst)
    graph.add_edge(START, "planner")
    graph.add_edge("planner", "coder")
    graph.add_conditional_edges("coder", after_coder, ["tools", "analyst"])
    graph.add_conditional_edges("tools", after_tools, ["coder", "analyst"])
    graph.add_edge("analyst", END)
    return graph


def make_table_tool(sandbox: Any, *, name: str = "python", cache: bool = True) -> BaseTool:
    """The coder's Python tool: runs code in `sandbox` on the current task's table (`table_path` in the graph
    state, injected by ToolNode), so one graph serves every task. Runs are deterministic for a given (code,
    table), so results are memoised: a training run repeats the same code often, and each sandbox start costs
    an interpreter and a pandas import. Only runs that succeeded are kept: a timeout or a memory kill depends
    on the machine's load at the time, and replayed it would fail every later episode that wrote the same
    code. `cache=False` for code whose output is meant to vary (random draws, the clock)."""
    from typing import Annotated as A

    from langchain_core.tools import StructuredTool
    from langgraph.prebuilt import InjectedState
    from pydantic import BaseModel, Field

    memo: dict[tuple[str, str | None], str] = {}

    class PythonInput(BaseModel):
        code: str = Field(description="Python source; the table is the pandas DataFrame `df`; print() results")
        state: A[dict, InjectedState]

    def run(code: str, state: dict) -> str:
        key = (code, state.get("table_path"))
        if cache and key in memo:
            return memo[key]
        ran = sandbox.run(code, table_path=state.get("table_path"))
        result = ran.as_text(2000)
        if cache and ran.ok:  # a failure may be the machine's (a timeout under load): the next call runs again
            memo[key] = result
        return result

    return StructuredTool.from_function(
        func=run, name=name, args_schema=PythonInput,
        description="Run Python code on the task's table (`df`, with pd, np, plt imported) and get what it printed.",
    )
