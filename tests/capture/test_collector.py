"""TraceCollector: each model and tool call attributed to its node and agent, concurrent episodes kept apart."""

from __future__ import annotations

import asyncio

import pytest

from mappa_graph import TraceStore, instrument
from tests.graphs import build_graph, task_input


def test_node_attribution_tool_node_and_conditional_edge() -> None:
    app = instrument(build_graph().compile())
    app.invoke(task_input(7))
    ep = app.last_episode
    assert ep is not None and ep.error is None
    assert [(a.node, a.kind) for a in ep.actions] == [
        ("planner", "llm"), ("coder", "llm"), ("tools", "node"), ("coder", "llm")
    ]
    assert [a.step for a in ep.actions] == [1, 2, 3, 4]
    planner, coder1, tools, coder2 = ep.actions
    assert planner.output_text == "plan for task-7: add 7 and 100"
    assert planner.input_messages[0] == {"role": "system", "content": "You plan."}
    assert [(c.name, c.args, c.id) for c in coder1.tool_calls] == [("add", {"a": 7, "b": 100}, "call-7")]
    # the LLM action that asked for the tool and the ToolNode's own action both carry the result
    assert [(r.name, r.output, r.tool_call_id) for r in coder1.tool_results] == [("add", "107", "call-7")]
    assert [(r.name, r.output) for r in tools.tool_results] == [("add", "107")]
    assert coder2.output_text == "task-7 answer: 107"
    assert coder2.input_messages[-1]["role"] == "tool"
    assert [a.index for a in ep.actions] == [0, 1, 2, 3]
    assert all(a.episode_id == ep.id for a in ep.actions)
    assert ep.final_state["messages"][-1]["content"] == "task-7 answer: 107"


def test_eight_concurrent_batch_episodes_keep_actions_apart(tmp_path) -> None:
    store = TraceStore(tmp_path / "t.db")
    app = instrument(build_graph(delay_s=0.01).compile(), store=store)
    outs = app.batch([task_input(n) for n in range(8)], config={"max_concurrency": 8})
    app.flush()
    assert [o["messages"][-1].content for o in outs] == [f"task-{n} answer: {n + 100}" for n in range(8)]
    _assert_episodes_apart(store.episodes(), range(8))


def test_eight_gathered_async_episodes_keep_actions_apart() -> None:
    app = instrument(build_graph(delay_s=0.01).compile())

    async def main():
        return await asyncio.gather(*(app.ainvoke(task_input(n)) for n in range(10, 18)))

    asyncio.run(main())
    _assert_episodes_apart(app.episodes, range(10, 18))


def test_one_shared_collector_separates_episodes_by_root_run() -> None:
    from mappa_graph import TraceCollector

    collector = TraceCollector()
    graph = build_graph(delay_s=0.005).compile().with_config(callbacks=[collector])
    graph.batch([task_input(n) for n in range(20, 28)], config={"max_concurrency": 8})
    _assert_episodes_apart(collector.episodes, range(20, 28))
    assert collector._runs == {}  # every ended episode's runs are forgotten: a long-lived collector does not grow


def test_a_late_callback_after_its_episode_ended_is_dropped_not_a_new_episode() -> None:
    from uuid import uuid4

    from mappa_graph import TraceCollector

    collector = TraceCollector()
    graph = build_graph().compile().with_config(callbacks=[collector])
    graph.invoke(task_input(3))
    root = next(iter(collector.episodes))
    assert collector._runs == {}
    # an end for a run that is no longer open (its root ended) records nothing and opens no episode
    collector.on_chain_end({}, run_id=uuid4())
    collector.on_llm_end(None, run_id=uuid4())
    assert collector._runs == {} and collector.episodes == [root]


def test_unknown_node_in_agent_map_names_the_nodes() -> None:
    with pytest.raises(ValueError, match=r"unknown node 'sovler'.*graph node paths: planner, coder, tools"):
        instrument(build_graph().compile(), agents={"sovler": "solver"})


def test_agent_map_and_task_metadata() -> None:
    app = instrument(build_graph().compile(), agents={"coder": "analyst"}, run="r1")
    out, ep = app.run_episode(task_input(2), task_id="t-2", reference=102)
    assert out["messages"][-1].content == "task-2 answer: 102"
    assert (ep.task_id, ep.reference, ep.run) == ("t-2", 102, "r1")
    assert [a.agent for a in ep.actions] == ["planner", "analyst", "tools", "analyst"]


def _assert_episodes_apart(episodes, ns) -> None:
    assert sorted(len(e.actions) for e in episodes) == [4] * len(ns)
    seen = set()
    for ep in episodes:
        n = int(ep.actions[0].output_text.split("task-")[1].split(":")[0])
        seen.add(n)
        assert ep.actions[1].tool_calls[0].args == {"a": n, "b": 100}
        assert ep.actions[3].output_text == f"task-{n} answer: {n + 100}"
        assert len({a.episode_id for a in ep.actions}) == 1
    assert seen == set(ns)


def test_backend_token_record_lands_on_the_action_with_its_temperature() -> None:
    from langchain_core.messages import AIMessage

    from mappa_graph.messages import MAPPA_KEY
    from tests.fakes import ScriptedChatModel

    record = {"agent": "planner", "adapter": "a0", "prompt_token_ids": [1, 2], "output_token_ids": [3],
              "output_logprobs": [-0.5], "token_source": "backend", "temperature": 0.7}
    model = ScriptedChatModel(script=lambda m: AIMessage(f"plan for task-{m[-1].content[-1]}",
                                                         response_metadata={MAPPA_KEY: record}))
    app = instrument(build_graph(planner_model=model).compile())
    app.invoke(task_input(4))
    planner = app.last_episode.actions[0]
    assert (planner.temperature, planner.output_logprobs, planner.adapter, planner.trainable) == (0.7, [-0.5], "a0", True)


def test_each_message_is_converted_once_but_every_use_is_its_own_copy(monkeypatch) -> None:
    from mappa_graph.capture import builder

    calls = []
    convert = builder.message_to_dict
    monkeypatch.setattr(builder, "message_to_dict", lambda m: calls.append(m) or convert(m))
    app = instrument(build_graph().compile(), background=False)
    app.invoke(task_input(3))
    ep = app.last_episode
    # the human message is in three model calls' inputs and the final state; converted once
    assert sum(1 for m in calls if m.type == "human") == 1
    planner, coder1 = ep.actions[0], ep.actions[1]
    planner.input_messages[1]["content"] = "changed"
    assert coder1.input_messages[1]["content"] == "solve task-3"
    assert ep.final_state["messages"][0]["content"] == "solve task-3"
    # nested parts too: the coder's tool call recurs in every later input and the final state
    later = [m for a in ep.actions[2:] for m in a.input_messages if m.get("tool_calls")]
    final = [m for m in ep.final_state["messages"] if m.get("tool_calls")]
    assert later and final
    later[0]["tool_calls"][0]["args"]["a"] = -1
    later[0]["tool_calls"].append({"id": "x", "name": "x", "args": {}})
    assert final[0]["tool_calls"] == [{"id": final[0]["tool_calls"][0]["id"], "name": "add", "args": {"a": 3, "b": 100}}]


def test_content_blocks_in_a_trace_are_copies_of_the_apps_own() -> None:
    """A message's content may be a list of blocks (Anthropic-style): the trace's copies must not share it with
    each other or with the message in the app's state."""
    from langchain_core.messages import AIMessage

    from tests.fakes import ScriptedChatModel

    model = ScriptedChatModel(script=lambda m: AIMessage(content=[{"type": "text", "text": "the plan"}]))
    app = instrument(build_graph(planner_model=model).compile(), background=False)
    result = app.invoke(task_input(2))
    ep = app.last_episode
    uses = [m for a in ep.actions[1:] for m in a.input_messages if isinstance(m["content"], list)]
    final = [m for m in ep.final_state["messages"] if isinstance(m["content"], list)]
    assert uses and final
    uses[0]["content"][0]["text"] = "edited"
    uses[0]["content"].append({"type": "text", "text": "more"})
    assert final[0]["content"] == [{"type": "text", "text": "the plan"}]
    assert result["messages"][1].content == [{"type": "text", "text": "the plan"}]


def test_the_background_writer_gives_the_gil_back_while_building(monkeypatch) -> None:
    """A worker thread that holds the GIL through a whole build makes a graph thread waking from a model call
    wait for it (see capture/courtesy.py): the build yields every few events, on the worker only, and not
    while someone waits for it (each yield sleeps the timer slack, 50 us, and a flush() paid them all)."""
    import threading

    from mappa_graph.capture import courtesy

    sleeps: list[str] = []
    monkeypatch.setattr(courtesy.time, "sleep", lambda s: sleeps.append(threading.current_thread().name))
    app = instrument(build_graph().compile(), background=False)
    app.invoke(task_input(1))
    assert sleeps == []  # on the graph's own thread: nothing to give way to
    app = instrument(build_graph().compile())
    app.invoke(task_input(2))
    app.flush()
    assert sleeps == []  # built while flush() waited: no one to give way to
    app.invoke(task_input(3))
    threading.Event().wait(app._worker.gate.patience + 0.5)  # no model call comes: built after its patience
    assert len(sleeps) >= 5 and set(sleeps) == {"mappa-trace"}  # 22 events: a yield every 4
    app.flush()


@pytest.mark.filterwarnings("ignore::langgraph.warnings.LangGraphDeprecatedSinceV10")
def test_events_waiting_for_their_build_hold_no_exception_and_its_frames() -> None:
    """Every handoff is an exception whose traceback holds the run's frames (state, config, callbacks): the
    events waiting for their build kept all of that alive. They hold what the build reads of it instead, and
    the handoffs and errors come out the same."""
    from mappa_graph.capture.collector import TraceCollector
    from tests.capture.apps import supervisor_app
    from tests.fakes import QueuedBuilds

    later = QueuedBuilds()
    collector = TraceCollector(executor=later)
    supervisor_app().invoke({"messages": [{"role": "user", "content": "solve task-5"}]}, {"callbacks": [collector]})
    (build, (events,)), = later.queued
    errors = [event[4] for event in events if event[0].endswith("_error")]
    assert len(errors) >= 2  # the supervisor's two handoffs, at least
    assert not any(isinstance(event[4], BaseException) for event in events)
    build(events)
    (episode,) = collector.episodes
    assert [a.handoff for a in episode.actions if a.handoff] == [["researcher"], ["math_expert"]]
    assert all(a.error is None for a in episode.actions)


def test_an_error_that_cannot_be_printed_still_ends_its_episode() -> None:
    from langgraph.graph import START, StateGraph

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no text")

    def boom(state: dict) -> dict:
        raise Unprintable()

    graph = StateGraph(dict)
    graph.add_node("boom", boom)
    graph.add_edge(START, "boom")
    app = instrument(graph.compile())
    with pytest.raises(Unprintable):
        app.invoke({"x": 1})
    (episode,) = app.episodes
    assert episode.status == "error" and episode.error == "Unprintable: <Unprintable whose str() raised>"


def test_a_node_recovered_by_its_error_handler_still_shows_its_failure() -> None:
    """LangGraph runs a node's error handler inside the failed node's namespace; folded into the handler's
    model call, the failure itself was nowhere in the episode."""
    from langchain_core.messages import HumanMessage
    from langgraph.errors import NodeError
    from langgraph.graph import START, StateGraph
    from langgraph.types import Command
    from typing_extensions import TypedDict

    from mappa_graph import instrument
    from mappa_graph.testing import ScriptedChatModel

    class State(TypedDict, total=False):
        q: str
        a: str

    model = ScriptedChatModel(reply=lambda messages: f"M({messages[-1].content})")

    def fetch(state: State) -> dict:
        raise KeyError("no such page")

    def recover(state: State, error: NodeError) -> Command:
        return Command(update={"a": model.invoke([HumanMessage(f"recover {error.node}")]).content}, goto="report")

    graph = StateGraph(State).set_node_defaults(error_handler=recover)
    graph.add_node("fetch", fetch)
    graph.add_node("report", lambda state: {"q": state["q"] + "!"})
    graph.add_edge(START, "fetch")
    app = instrument(graph.compile())
    assert app.invoke({"q": "x"}) == {"q": "x!", "a": "M(recover fetch)"}
    assert [(a.agent, a.node, a.kind, a.status, a.error) for a in app.last_episode.actions] == [
        ("fetch", "fetch", "node", "error", "KeyError: 'no such page'"),
        ("fetch", "__default_error_handler__", "llm", "ok", None),
        ("report", "report", "node", "ok", None)]


def test_an_entrypoint_that_pauses_after_its_tasks_shows_the_pause() -> None:
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.func import entrypoint, task
    from langgraph.types import Command, interrupt

    from mappa_graph import instrument
    from mappa_graph.testing import ScriptedChatModel

    model = ScriptedChatModel(reply=lambda messages: f"draft of {messages[-1].content}")

    @task
    def draft(topic: str) -> str:
        return model.invoke(topic).content

    @entrypoint(checkpointer=InMemorySaver())
    def write(topic: str) -> str:
        text = draft(topic).result()
        return f"{interrupt({'review': text})}: {text}"

    app = instrument(write)
    config = {"configurable": {"thread_id": "t"}}
    app.invoke("tides", config)
    paused = app.last_episode
    assert paused.status == "interrupted"
    assert [(a.node, a.kind, a.status) for a in paused.actions] == [
        ("write", "node", "interrupted"), ("draft", "llm", "ok")]
    assert app.invoke(Command(resume="ok"), config) == "ok: draft of tides"
    assert [(a.node, a.kind, a.status) for a in app.last_episode.actions] == [("write", "node", "ok")]  # draft: cached


def test_a_completion_model_call_is_recorded_like_a_chat_model_call() -> None:
    """A completion-style model (langchain-core BaseLLM: OpenAI's completions, a local text-generation
    pipeline) reports through on_llm_start with prompt strings, not on_chat_model_start."""
    from langchain_core.language_models.fake import FakeListLLM
    from langgraph.graph import START, StateGraph
    from typing_extensions import TypedDict

    class State(TypedDict, total=False):
        q: str
        a: str

    llm = FakeListLLM(responses=["Paris"])
    graph = StateGraph(State)
    graph.add_node("answer", lambda state: {"a": llm.invoke("Capital of France? " + state["q"])})
    graph.add_edge(START, "answer")
    app = instrument(graph.compile())
    assert app.invoke({"q": "x"}) == {"q": "x", "a": "Paris"}
    assert app.invoke({"q": "y"}) == {"q": "y", "a": "Paris"}
    (action,) = app.last_episode.actions
    assert (action.agent, action.kind, action.status) == ("answer", "llm", "ok")
    assert action.input_messages == [{"role": "user", "content": "Capital of France? y"}]
    assert action.output_message == {"role": "assistant", "content": "Paris"}
    assert action.node_output == {"a": "Paris"}


def _routed_desk():
    """An LLM intent router on a conditional START edge, in a subgraph node `desk` behind a node `prep`."""
    from langchain_core.messages import HumanMessage
    from langgraph.graph import END, START, StateGraph
    from typing_extensions import TypedDict

    from mappa_graph.testing import ScriptedChatModel

    class State(TypedDict, total=False):
        q: str
        answer: str

    router = ScriptedChatModel(reply=lambda messages: "billing" if "bill" in messages[-1].content else "tech")
    worker = ScriptedChatModel(reply=lambda messages: f"answer to {messages[-1].content}")

    def route(state) -> str:  # no annotation: LangGraph would resolve a local name
        return router.invoke([HumanMessage(state["q"])]).content

    inner = StateGraph(State)
    inner.add_node("billing", lambda state: {"answer": worker.invoke([HumanMessage("billing " + state["q"])]).content})
    inner.add_node("tech", lambda state: {"answer": worker.invoke([HumanMessage("tech " + state["q"])]).content})
    inner.add_conditional_edges(START, route, ["billing", "tech"])
    inner.add_edge("billing", END)
    inner.add_edge("tech", END)
    outer = StateGraph(State)
    outer.add_node("prep", lambda state: {"q": state["q"] + "!"})
    outer.add_node("desk", inner.compile())
    outer.add_edge(START, "prep")
    outer.add_edge("prep", "desk")
    return outer.compile(), inner.compile()


def test_a_model_call_in_a_start_edge_router_is_a_turn_of_the_graph_it_routes() -> None:
    """The router runs in LangGraph's internal `__start__` task: its model call went to agent `__start__` with
    no path, sorted after everything, even inside a subgraph node."""
    team, desk = _routed_desk()
    app = instrument(team)
    assert app.invoke({"q": "my bill"}) == team.invoke({"q": "my bill"})
    assert [(a.agent, a.path, a.kind, a.output_text) for a in app.last_episode.actions] == [
        ("prep", "prep", "node", ""),
        ("desk", "desk/__start__", "llm", "billing"),
        ("desk", "desk/billing", "llm", "answer to billing my bill!")]
    app = instrument(desk, agents={"__start__": "router"})
    app.invoke({"q": "the tech"})
    assert [(a.agent, a.path, a.output_text) for a in app.last_episode.actions] == [
        ("router", "__start__", "tech"), ("tech", "tech", "answer to tech the tech")]
    app = instrument(_routed_desk()[0], agents={"desk/__start__": "router"})
    app.invoke({"q": "my bill"})
    assert [a.agent for a in app.last_episode.actions] == ["prep", "router", "desk"]


def test_branches_of_a_fan_out_whose_model_reuses_tool_call_ids_each_get_their_own_results() -> None:
    """A model that numbers its tool calls per conversation gives every branch of a Send fan-out the id
    `call_0`: every result went to the last branch's model call, the others got none."""
    import operator
    import re
    from typing import Annotated

    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langgraph.graph import START, StateGraph
    from langgraph.types import Send
    from typing_extensions import TypedDict

    from mappa_graph.testing import ScriptedChatModel

    @tool
    def lookup(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    def reply(messages: list) -> AIMessage:
        city = re.search(r"city (\w+)", messages[0].content).group(1)
        if isinstance(messages[-1], ToolMessage):
            return AIMessage(f"{city}: {messages[-1].content}")
        return AIMessage("", tool_calls=[{"name": "lookup", "args": {"city": city}, "id": "call_0"}])

    # the functional form: class syntax leaves string annotations (this module's __future__ import) that
    # LangGraph would look up among the module's names
    State = TypedDict("State", {"cities": list, "messages": Annotated[list, operator.add]}, total=False)
    graph = StateGraph(State)
    graph.add_node("weather", create_agent(ScriptedChatModel(reply=reply), [lookup]))
    graph.add_conditional_edges(START, lambda state: [Send("weather", {"messages": [HumanMessage(f"city {c}")]})
                                                      for c in state["cities"]], ["weather"])
    app = instrument(graph.compile())
    app.invoke({"cities": ["Oslo", "Rome", "Lima"]})
    asked = [(a.tool_calls[0].args["city"], [r.output for r in a.tool_results])
             for a in app.last_episode.actions if a.kind == "llm" and a.tool_calls]
    assert asked == [("Oslo", ["sunny in Oslo"]), ("Rome", ["sunny in Rome"]), ("Lima", ["sunny in Lima"])]


@pytest.mark.parametrize("own_thread", [False, True])
def test_a_start_edge_router_in_a_subagent_run_by_a_tool_is_that_subagents(own_thread: bool) -> None:
    """Run by a tool, the routed graph's nodes belong to the tool (`tools/ask_desk/...`): its router's model
    call went to the ToolNode's agent, or with the tool's own thread_id to a top-level `__start__`, sorted
    before the call that asked for the tool."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode

    from tests.fakes import ScriptedChatModel

    desk = _routed_desk()[1]

    @tool
    def ask_desk(q: str) -> str:
        """Ask the desk."""
        config = {"configurable": {"thread_id": "desk"}} if own_thread else None
        return desk.invoke({"q": q}, config)["answer"]

    def boss(messages: list) -> AIMessage:
        if isinstance(messages[-1], ToolMessage):
            return AIMessage("done")
        return AIMessage("", tool_calls=[{"name": "ask_desk", "args": {"q": "my bill"}, "id": "c1"}])

    model = ScriptedChatModel(script=boss)
    graph = StateGraph(MessagesState)
    graph.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
    graph.add_node("tools", ToolNode([ask_desk]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", lambda state: "tools" if state["messages"][-1].tool_calls else END,
                                ["tools", END])
    graph.add_edge("tools", "agent")
    app = instrument(graph.compile())
    app.invoke({"messages": [HumanMessage("hi")]})
    assert [(a.agent, a.path, a.output_text) for a in app.last_episode.actions if a.kind == "llm"] == [
        ("agent", "agent", ""),
        ("ask_desk", "tools/ask_desk/__start__", "billing"),
        ("ask_desk", "tools/ask_desk/billing", "answer to billing my bill"),
        ("agent", "agent", "done")]


def test_branches_of_a_fan_out_into_a_plain_node_that_runs_its_tools_itself_get_their_own_results() -> None:
    import operator
    import re
    import threading
    from typing import Annotated

    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.tools import tool
    from langgraph.graph import START, StateGraph
    from langgraph.types import Send
    from typing_extensions import TypedDict

    from mappa_graph.testing import ScriptedChatModel

    @tool
    def lookup(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    model = ScriptedChatModel(reply=lambda messages: AIMessage("", tool_calls=[
        {"name": "lookup", "args": {"city": re.search(r"city (\w+)", messages[-1].content).group(1)}, "id": "call_0"}]))

    both_asked = threading.Barrier(2)

    def weather(state: dict) -> dict:
        asked = model.invoke([HumanMessage(f"city {state['city']}")])
        both_asked.wait(10)  # both branches' model calls are made before either runs its tool
        return {"answers": [lookup.invoke(asked.tool_calls[0]).content]}

    State = TypedDict("State", {"cities": list, "answers": Annotated[list, operator.add]}, total=False)
    graph = StateGraph(State)
    graph.add_node("weather", weather)
    graph.add_conditional_edges(START, lambda state: [Send("weather", {"city": c}) for c in state["cities"]],
                                ["weather"])
    app = instrument(graph.compile())
    app.invoke({"cities": ["Oslo", "Rome"]})
    assert [(a.tool_calls[0].args["city"], [r.output for r in a.tool_results])
            for a in app.last_episode.actions if a.kind == "llm"] == [("Oslo", ["sunny in Oslo"]), ("Rome", ["sunny in Rome"])]


def test_the_users_on_episode_still_gets_an_episode_whose_store_write_failed() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from mappa_graph.capture.collector import TraceCollector

    def write_fails():
        raise OSError("disk full")

    handed = []
    with ThreadPoolExecutor(1) as pool:
        collector = TraceCollector(recorder=lambda episode: write_fails, on_episode=handed.append, executor=pool)
        build_graph().compile().invoke(task_input(4), {"callbacks": [collector]})
        with pytest.raises(OSError, match="disk full"):
            collector.wait()
    assert [e.actions[-1].output_text for e in handed] == ["task-4 answer: 104"]


def test_router_and_error_handler_episodes_are_the_same_under_every_call_style() -> None:
    """The fixes above, under ainvoke, astream, stream (updates) and a batch of 4, as under invoke."""
    from langgraph.errors import NodeError
    from langgraph.graph import START, StateGraph
    from langgraph.types import Command

    def handled():
        def fetch(state: dict) -> dict:
            raise KeyError("no such page")

        def recover(state: dict, error: NodeError) -> Command:
            return Command(update={"answer": f"recovered {error.node}"}, goto="report")

        graph = StateGraph(dict).set_node_defaults(error_handler=recover)
        graph.add_node("fetch", fetch)
        graph.add_node("report", lambda state: {"q": state["q"] + "!"})
        graph.add_edge(START, "fetch")
        return graph.compile()

    def shape(episode) -> list:
        return [(a.agent, a.path, a.kind, a.status, a.output_text) for a in episode.actions]

    for build, fixed in ((lambda: _routed_desk()[0], ("desk", "desk/__start__", "llm", "ok", "billing")),
                         (handled, ("fetch", "fetch", "node", "error", ""))):
        app = instrument(build())
        app.invoke({"q": "my bill"})
        expected = shape(app.last_episode)
        assert fixed in expected
        asyncio.run(app.ainvoke({"q": "my bill"}))
        assert shape(app.last_episode) == expected
        list(app.stream({"q": "my bill"}, stream_mode="updates"))
        assert shape(app.last_episode) == expected

        async def drain(app) -> None:
            async for _ in app.astream({"q": "my bill"}):
                pass

        asyncio.run(drain(app))
        assert shape(app.last_episode) == expected
        app.batch([{"q": "my bill"}] * 4)
        assert [shape(e) for e in app.episodes[-4:]] == [expected] * 4
