"""What a model was told, as the trace records it: the ToolMessage each tool call got back (from the tool, from
ToolNode's error handler, from a middleware that answered instead of the tool, from structured output), in the
order the model asked; a streamed reply as the assistant's; a node's list of Commands as its handoff."""

from __future__ import annotations

import time
from typing import Annotated, TypedDict

import pytest
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import InjectedToolCallId, tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode
from langgraph.types import Command
from pydantic import BaseModel

from mappa_graph import instrument
from mappa_graph.messages import dict_to_message, message_to_dict
from tests.capture.apps import call
from tests.fakes import ScriptedChatModel

pytestmark = pytest.mark.filterwarnings("ignore::langgraph.warnings.LangGraphDeprecatedSinceV10")


@tool
def boom(x: int) -> int:
    """Explodes."""
    raise ValueError("bad x")


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def once(name: str, args: dict, call_id: str):
    """A model that asks for one tool call, then answers once it has a ToolMessage."""
    return lambda m: AIMessage("ok") if isinstance(m[-1], ToolMessage) else call(name, args, call_id)


def told(output: dict, call_id: str) -> ToolMessage:
    return next(m for m in output["messages"] if isinstance(m, ToolMessage) and m.tool_call_id == call_id)


def results(episode, call_id: str) -> list[tuple[str, str | None]]:
    """(output, error) of every result recorded on the model call that asked for `call_id`."""
    asking = next(a for a in episode.actions if a.kind == "llm" and any(c.id == call_id for c in a.tool_calls))
    return [(r.output, r.error) for r in asking.tool_results if r.tool_call_id == call_id]


@pytest.mark.parametrize("handler", [True, "custom: try again"])
def test_a_tool_error_handled_by_tool_node_records_what_the_model_was_told(handler) -> None:
    from langgraph.prebuilt import create_react_agent

    app = instrument(create_react_agent(ScriptedChatModel(script=once("boom", {"x": 1}, "b0")),
                                        ToolNode([boom], handle_tool_errors=handler)))
    out = app.invoke({"messages": [HumanMessage("go")]})
    assert results(app.last_episode, "b0") == [(told(out, "b0").content, "ValueError: bad x")]
    assert told(out, "b0").content  # the handler's text, never empty


def test_a_middleware_that_answers_instead_of_the_tool_is_the_calls_result() -> None:
    from langchain.agents import create_agent
    from langchain.agents.middleware import wrap_tool_call

    @wrap_tool_call
    def deny(request, handler):
        return ToolMessage("denied by policy", tool_call_id=request.tool_call["id"], name=request.tool_call["name"],
                           status="error")

    app = instrument(create_agent(ScriptedChatModel(script=once("add", {"a": 1, "b": 1}, "c0")), [add],
                                  middleware=[deny]))
    app.invoke({"messages": [HumanMessage("go")]})
    assert results(app.last_episode, "c0") == [("denied by policy", "denied by policy")]
    assert [r.name for r in app.last_episode.actions[0].tool_results] == ["add"]


def test_structured_output_tool_calls_get_their_tool_messages() -> None:
    from langchain.agents import create_agent
    from langchain.agents.structured_output import ToolStrategy

    class Answer(BaseModel):
        value: int

    def script(m: list[BaseMessage]) -> AIMessage:
        retried = any(isinstance(x, ToolMessage) for x in m)
        return call("Answer", {"value": 2}, "s1") if retried else call("Answer", {"value": "two"}, "s0")

    app = instrument(create_agent(ScriptedChatModel(script=script), [], response_format=ToolStrategy(Answer)))
    out = app.invoke({"messages": [HumanMessage("go")]})
    assert out["structured_response"] == Answer(value=2)
    # the parse error comes back as an ordinary ToolMessage (status "success"): its text says what went wrong
    assert results(app.last_episode, "s0") == [(told(out, "s0").content, None)]
    assert "Failed to parse" in told(out, "s0").content
    assert results(app.last_episode, "s1") == [(told(out, "s1").content, None)]


def test_tool_messages_a_node_only_passes_on_are_not_taken_as_results_again() -> None:
    """A worker graph's output holds its whole history: ToolMessages its tools already answered, and in a
    later turn of a thread, answers to an earlier episode's calls (same ids, or ids no call of this one made)."""
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.prebuilt import create_react_agent

    def script(m: list[BaseMessage]) -> AIMessage:
        turn = sum(isinstance(x, HumanMessage) for x in m)
        return once("add", {"a": 1, "b": 2}, "call_0" if turn < 3 else "call_1")(m)

    worker = create_react_agent(ScriptedChatModel(script=script), [add], name="worker")
    team = StateGraph(MessagesState)
    team.add_node("worker", worker)
    team.add_edge(START, "worker")
    app = instrument(team.compile(checkpointer=InMemorySaver()))
    cfg = {"configurable": {"thread_id": "t"}}
    for text in ("go", "again", "once more"):
        app.invoke({"messages": [HumanMessage(text)]}, cfg)
    for episode, call_id in zip(app.episodes, ["call_0", "call_0", "call_1"]):
        assert results(episode, call_id) == [("3", None)]
        assert [(a.kind, a.path) for a in episode.actions] == [("llm", "worker/agent"), ("node", "worker/tools"),
                                                               ("llm", "worker/agent")]
        assert [r.tool_call_id for a in episode.actions for r in a.tool_results] == [call_id, call_id]


@pytest.mark.parametrize("constructor", ["create_agent", "create_react_agent"])
def test_results_of_parallel_tool_calls_go_in_the_order_the_model_asked(constructor: str) -> None:
    """create_agent runs each call in a task of its own (a Send each); create_react_agent's v1 ToolNode runs
    both in one task."""
    from langchain.agents import create_agent
    from langgraph.prebuilt import create_react_agent

    @tool
    def slow(x: int) -> str:
        """Slow tool."""
        time.sleep(0.2)
        return f"slow {x}"

    @tool
    def fast(x: int) -> str:
        """Fast tool."""
        return f"fast {x}"

    def script(m: list[BaseMessage]) -> AIMessage:
        if isinstance(m[-1], ToolMessage):
            return AIMessage("done")
        return AIMessage("", tool_calls=[{"name": "slow", "args": {"x": 1}, "id": "t1"},
                                         {"name": "fast", "args": {"x": 2}, "id": "t2"}])

    model = ScriptedChatModel(script=script)
    agent = (create_agent(model, [slow, fast]) if constructor == "create_agent"
             else create_react_agent(model, [slow, fast], version="v1"))
    app = instrument(agent)
    app.invoke({"messages": [HumanMessage("go")]})
    asking = app.last_episode.actions[0]
    assert [r.tool_call_id for r in asking.tool_results] == ["t1", "t2"]
    tool_nodes = [a for a in app.last_episode.actions if a.node == "tools"]
    assert [r.tool_call_id for a in tool_nodes for r in a.tool_results] == ["t1", "t2"]


def test_a_streamed_reply_is_the_assistants_turn() -> None:
    model = GenericFakeChatModel(messages=iter([AIMessage("hello streaming world"), AIMessage("second reply")]))

    def chat(state: MessagesState) -> dict:
        full = None
        for chunk in model.stream(state["messages"]):
            full = chunk if full is None else full + chunk
        return {"messages": [full]}

    graph = StateGraph(MessagesState)
    graph.add_node("chat", chat)
    graph.add_node("again", chat)
    graph.add_edge(START, "chat")
    graph.add_edge("chat", "again")
    app = instrument(graph.compile())
    app.invoke({"messages": [HumanMessage("hi")]})
    first, second = app.last_episode.actions
    assert first.output_message == {"role": "assistant", "content": "hello streaming world"}
    assert isinstance(dict_to_message(first.output_message), AIMessage)
    assert [m["role"] for m in second.input_messages] == ["user", "assistant"]


def test_message_chunks_and_chat_messages_keep_their_roles() -> None:
    from langchain_core.messages import (
        AIMessageChunk,
        ChatMessage,
        HumanMessageChunk,
        SystemMessageChunk,
        ToolMessageChunk,
    )

    assert [message_to_dict(m)["role"] for m in (
        AIMessageChunk("a"), HumanMessageChunk("h"), SystemMessageChunk("s"), ToolMessageChunk("t", tool_call_id="1"),
        ChatMessage(role="assistant", content="c"), ChatMessage(role="user", content="u"),
        ChatMessage(role="system", content="s"))] == ["assistant", "user", "system", "tool", "assistant", "user",
                                                      "system"]


class _State(TypedDict, total=False):
    x: str


def test_a_node_that_returns_a_list_of_commands_hands_off_like_one_that_returns_one() -> None:
    def route(state: _State) -> list[Command]:
        return [Command(update={"x": "a"}, goto="b")]

    graph = StateGraph(_State)
    graph.add_node("a", route, destinations=("b",))
    graph.add_node("b", lambda state: {})
    graph.add_edge(START, "a")
    app = instrument(graph.compile())
    app.invoke({"x": ""})
    routed = app.last_episode.actions[0]
    assert routed.handoff == ["b"]
    assert routed.node_output == [{"command": {"goto": ["b"], "update": {"x": "a"}}}]


def test_a_tool_that_routes_with_a_command_is_its_tool_nodes_handoff() -> None:
    @tool
    def escalate(reason: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> Command:
        """Escalate to a human team."""
        return Command(goto="human_team",
                       update={"messages": [ToolMessage(f"escalated: {reason}", tool_call_id=tool_call_id)]})

    model = ScriptedChatModel(script=lambda m: call("escalate", {"reason": "angry"}, "e1"))
    graph = StateGraph(MessagesState)
    graph.add_node("agent", lambda s: {"messages": [model.invoke(s["messages"])]})
    graph.add_node("tools", ToolNode([escalate]))
    graph.add_node("human_team", lambda s: {"messages": [AIMessage("a human will call you")]})
    graph.add_edge(START, "agent")
    graph.add_edge("agent", "tools")
    app = instrument(graph.compile())
    assert app.invoke({"messages": [HumanMessage("help")]})["messages"][-1].content == "a human will call you"
    tools = next(a for a in app.last_episode.actions if a.node == "tools")
    assert tools.handoff == ["human_team"]
    assert results(app.last_episode, "e1") == [("escalated: angry", None)]


def test_a_retried_tool_keeps_each_attempts_own_result() -> None:
    from langchain.agents import create_agent
    from langchain.agents.middleware import ToolRetryMiddleware

    failed: list[int] = []

    @tool
    def flaky(x: int) -> str:
        """Fails the first time."""
        if not failed:
            failed.append(x)
            raise ValueError("transient")
        return f"good {x}"

    retry = ToolRetryMiddleware(max_retries=2, initial_delay=0, retry_on=(ValueError,))
    app = instrument(create_agent(ScriptedChatModel(script=once("flaky", {"x": 1}, "f0")), [flaky],
                                  middleware=[retry]))
    app.invoke({"messages": [HumanMessage("go")]})
    assert results(app.last_episode, "f0") == [("", "ValueError: transient"), ("good 1", None)]


def test_fan_out_branches_reusing_a_call_id_are_each_told_their_own_result() -> None:
    """Branch A's worker task ends while branch B's call (the same id, the latest) has no result yet."""
    from langgraph.prebuilt import create_react_agent
    from langgraph.types import Send

    @tool
    def work(x: str) -> str:
        """Work on x."""
        time.sleep(0.3 if x == "A" else 0.8)
        return f"worked {x}"

    def script(m: list[BaseMessage]) -> AIMessage:
        which = "A" if "task-A" in str(m[0].content) else "B"
        if isinstance(m[-1], ToolMessage):
            return AIMessage(f"done {which}")
        time.sleep(0.1 if which == "B" else 0)
        return call("work", {"x": which}, "call_0")

    team = StateGraph(MessagesState)
    team.add_node("plan", lambda s: {})
    team.add_node("worker", create_react_agent(ScriptedChatModel(script=script), [work], name="worker"))
    team.add_edge(START, "plan")
    team.add_conditional_edges("plan", lambda s: [Send("worker", {"messages": [HumanMessage(f"task-{w}")]})
                                                  for w in "AB"])
    app = instrument(team.compile())
    app.invoke({"messages": [HumanMessage("go")]})
    asked = [a for a in app.last_episode.actions if a.tool_calls]
    assert [[(r.tool_call_id, r.output) for r in a.tool_results] for a in asked] == [
        [("call_0", "worked A")], [("call_0", "worked B")]]


def test_a_subgraph_resumed_from_its_checkpoint_does_not_retell_earlier_results() -> None:
    """On resume a subgraph reloads its messages from its own checkpoint: copies, with the same ids, of those in
    its node's input."""
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.prebuilt import create_react_agent
    from langgraph.types import interrupt

    @tool
    def approve(what: str) -> str:
        """Ask a human."""
        return f"human said {interrupt(what)}"

    def script(m: list[BaseMessage]) -> AIMessage:
        first = sum(isinstance(x, HumanMessage) for x in m) == 1
        return once("add", {"a": 1, "b": 2}, "a1")(m) if first else once("approve", {"what": "ok?"}, "p1")(m)

    team = StateGraph(MessagesState)
    team.add_node("worker", create_react_agent(ScriptedChatModel(script=script), [add, approve], name="worker"))
    team.add_edge(START, "worker")
    app = instrument(team.compile(checkpointer=InMemorySaver()))
    cfg = {"configurable": {"thread_id": "t"}}
    app.invoke({"messages": [HumanMessage("go")]}, cfg)
    app.invoke({"messages": [HumanMessage("again")]}, cfg)
    app.invoke(Command(resume="yes"), cfg)
    resumed = app.episodes[-1]
    assert [(a.path, [(r.tool_call_id, r.output) for r in a.tool_results]) for a in resumed.actions] == [
        ("worker/tools", [("p1", "human said yes")]), ("worker/agent", [])]
