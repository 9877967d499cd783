"""The 3-node test graph: planner (LLM) -> coder (LLM, may call a tool) -> tools (ToolNode) -> coder,
with a conditional edge from the coder to the tools or the end; and a one-node graph that crashes on demand.

Ray workers import graph factories by module name, so factories they run live here, not in a test module."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypedDict

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
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


class _State(TypedDict, total=False):
    task: str
    answer: str


def crashy_graph(marker_dir: str) -> Any:
    """A one-node team whose node kills its process on some tasks: once ("crash-once"), every time
    ("crash-always"), or raises an ordinary error after its model call ("raise")."""
    model = ScriptedChatModel(script=lambda messages: AIMessage(content=f"done {messages[-1].content}"))

    def work(state: _State) -> dict[str, str]:
        task = state["task"]
        marker = Path(marker_dir) / f"{task}.started"
        if task == "crash-always" or (task == "crash-once" and not marker.exists()):
            marker.touch()
            os._exit(1)
        reply = model.invoke([HumanMessage(task)])
        if task == "raise":
            raise ValueError("the tool broke")
        return {"answer": str(reply.content)}

    graph = StateGraph(_State)
    graph.add_node("work", work)
    graph.add_edge(START, "work")
    graph.add_edge("work", END)
    return graph.compile()


def served_team(policies: Any, base_url: str) -> Any:
    """A one-agent team ("solver") whose model is a vLLM-style server: what a Ray worker builds on a node
    that runs one. Returns (graph, on_version) so each new adapter version is pushed to that server."""
    from mappa_graph.serving.vllm import VLLMBackend

    backend = VLLMBackend.connect(base_url, tokenizer=policies.tokenizer)
    model = backend.chat_model("solver", max_new_tokens=4)

    def solver(state: _State) -> dict[str, str]:
        return {"answer": str(model.invoke([HumanMessage(state["task"])]).content)}

    graph = StateGraph(_State)
    graph.add_node("solver", solver)
    graph.add_edge(START, "solver")
    graph.add_edge("solver", END)
    return graph.compile(), backend.sync


def broken_team() -> Any:
    """A factory that fails inside the worker, as one whose data is missing on that node would."""
    raise FileNotFoundError("no table at /nowhere")


def task_input(n: int) -> dict:
    return {"messages": [HumanMessage(f"solve task-{n}")]}
