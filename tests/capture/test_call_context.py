"""Which call a model call made with callbacks of its own belongs to, when calls are nested, interleaved in one
context, abandoned part way, or fanned out over threads: the collector the configure hook adds must be the one
of the call whose step is running, and no other."""

from __future__ import annotations

import asyncio
import operator
import sys
from typing import Annotated, Any, TypedDict

from langchain_core.callbacks import BaseCallbackHandler, CallbackManager
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

from mappa_graph import instrument
from mappa_graph.capture.collector import TraceCollector
from tests.fakes import ScriptedChatModel


class State(TypedDict, total=False):
    task: str
    out: list[str]


def _model(tag: str) -> ScriptedChatModel:
    return ScriptedChatModel(script=lambda m: AIMessage(f"{tag}:{m[-1].content}"))


def _two_steps(tag: str) -> Any:
    """Two nodes, each calling a model with a handler of its own (the node's inherited callbacks are replaced)."""
    model = _model(tag)

    def first(state: State) -> dict:
        return {"out": [model.invoke([HumanMessage(f"a {state['task']}")], config={"callbacks": [BaseCallbackHandler()]}).content]}

    def second(state: State) -> dict:
        reply = model.invoke([HumanMessage(f"b {state['task']}")], config={"callbacks": [BaseCallbackHandler()]})
        return {"out": [*state["out"], reply.content]}

    graph = StateGraph(State)
    graph.add_node("first", first)
    graph.add_node("second", second)
    graph.add_edge(START, "first")
    graph.add_edge("first", "second")
    graph.add_edge("second", END)
    return graph.compile()


def _outputs(app: Any) -> list[list[str]]:
    return [[a.output_text for a in episode.actions] for episode in app.episodes]


def _hooked() -> list[str]:
    """The handlers the configure hook adds to a callback manager made here and now."""
    return [type(h).__name__ for h in CallbackManager.configure().handlers if isinstance(h, TraceCollector)]


def test_streams_consumed_in_turn_in_one_context_each_keep_their_own_calls() -> None:
    apps = [instrument(_two_steps(tag), run=tag) for tag in "xyz"]
    live = [app.stream({"task": app.run}, stream_mode="updates") for app in apps]
    while live:
        for stream in list(live):
            if next(stream, None) is None:
                live.remove(stream)
    assert [_outputs(app) for app in apps] == [[[f"{t}:a {t}", f"{t}:b {t}"]] for t in "xyz"]
    assert _hooked() == []


def test_an_async_stream_the_caller_stops_reading_leaves_no_collector_behind() -> None:
    app = instrument(_two_steps("x"))

    async def main() -> list[str]:
        async for _ in app.astream({"task": "t1"}, stream_mode="updates"):
            break
        return _hooked()

    assert asyncio.run(main()) == []
    assert app.last_episode.actions[0].output_text == "x:a t1"


def test_a_call_that_fails_leaves_no_collector_behind() -> None:
    def boom(state: State) -> dict:
        raise RuntimeError("boom")

    graph = StateGraph(State)
    graph.add_node("boom", boom)
    graph.add_edge(START, "boom")
    graph.add_edge("boom", END)
    app = instrument(graph.compile())
    for call in (lambda: app.invoke({"task": "t"}), lambda: list(app.stream({"task": "t"}))):
        try:
            call()
        except RuntimeError:
            pass
        assert _hooked() == []


def test_model_calls_a_node_makes_between_chunks_of_an_instrumented_stream_are_not_that_streams() -> None:
    inner = instrument(_two_steps("inner"), run="inner")
    consumer = _model("consumer")

    def read(state: State) -> dict:
        notes = [consumer.invoke([HumanMessage(f"note {list(chunk)}")]).content
                 for chunk in inner.stream({"task": state["task"]}, stream_mode="updates")]
        return {"out": notes}

    graph = StateGraph(State)
    graph.add_node("read", read)
    graph.add_edge(START, "read")
    graph.add_edge("read", END)
    outer = instrument(graph.compile(), run="outer")
    assert outer.invoke({"task": "t"})["out"] == ["consumer:note ['first']", "consumer:note ['second']"]
    assert _outputs(inner) == [["inner:a t", "inner:b t"]]
    [episode] = outer.episodes
    assert [(a.node, a.agent, a.output_text) for a in episode.actions][-1] == ("read", "read", "consumer:note ['second']")


class Fanned(TypedDict, total=False):
    n: int
    out: Annotated[list[str], operator.add]


def test_fanned_out_branches_calling_with_their_own_callbacks_lose_no_call() -> None:
    """Branches run on threads; each call with callbacks of its own looks for its task among the open runs
    while the other branches add runs (it used to fail on a dict that changed size, and the call was lost)."""
    model = _model("w")

    def work(state: Fanned) -> dict:
        outs = []
        for k in range(3):
            outs.append(model.invoke([HumanMessage(f"{state['n']}.{k}")], config={"callbacks": [BaseCallbackHandler()]}).content)
            model.invoke([HumanMessage("inherited")])
        return {"out": outs}

    graph = StateGraph(Fanned)
    graph.add_node("work", work)
    graph.add_conditional_edges(START, lambda s: [Send("work", {"n": i}) for i in range(s["n"])], ["work"])
    graph.add_edge("work", END)
    app = instrument(graph.compile())
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so the race shows in a few runs
    try:
        for _ in range(8):
            app.invoke({"n": 16})
    finally:
        sys.setswitchinterval(interval)
    own = [sum(1 for a in episode.actions if a.output_text != "w:inherited") for episode in app.episodes]
    assert own == [48] * 8
