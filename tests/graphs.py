"""The 3-node test graph: planner (LLM) -> coder (LLM, may call a tool) -> tools (ToolNode) -> coder,
with a conditional edge from the coder to the tools or the end."""

from __future__ import annotations

from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

from tests.fakes import ScriptedChatModel, task_number


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def planner_script(messages: list[BaseMessage]) -> AIMessage:
    n = task_number(messages)
    return AIMessage(content=f"plan for task-{n}: add {n} and 100")


def coder_script(messages: list[BaseMessage]) -> AIMessage:
    n = task_number(messages)
    if any(isinstance(m, ToolMessage) for m in messages):
        return AIMessage(content=f"task-{n} answer: {messages[-1].content}")
    return AIMessage(content="", tool_calls=[{"name": "add", "args": {"a": n, "b": 100}, "id": f"call-{n}"}])


def build_graph(planner_model: Any = None, coder_model: Any = None, delay_s: float = 0.0):
    planner_model = planner_model or ScriptedChatModel(script=planner_script, delay_s=delay_s)
    coder_model = (coder_model or ScriptedChatModel(script=coder_script, delay_s=delay_s)).bind_tools([add])

    def planner(state: MessagesState) -> dict:
        return {"messages": [planner_model.invoke([SystemMessage("You plan."), *state["messages"]])]}

    def coder(state: MessagesState) -> dict:
        return {"messages": [coder_model.invoke([SystemMessage("You code."), *state["messages"]])]}

    def route(state: MessagesState) -> str:
        return "tools" if state["messages"][-1].tool_calls else END

    g = StateGraph(MessagesState)
    g.add_node("planner", planner)
    g.add_node("coder", coder)
    g.add_node("tools", ToolNode([add]))
    g.add_edge(START, "planner")
    g.add_edge("planner", "coder")
    g.add_conditional_edges("coder", route, ["tools", END])
    g.add_edge("tools", "coder")
    return g
