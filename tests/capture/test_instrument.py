from __future__ import annotations

import asyncio
import gc
from contextlib import contextmanager, suppress
from datetime import date

import pytest
from langchain_core.callbacks import BaseCallbackHandler

from mappa_graph import TraceStore, instrument
from tests.graphs import build_graph, task_input


def _shape(state: dict) -> list[tuple]:
    """Messages without their random ids: what must be equal between plain and instrumented runs."""
    return [(type(m).__name__, m.content, getattr(m, "tool_calls", None), getattr(m, "tool_call_id", None))
            for m in state["messages"]]




def test_instrumented_equals_plain_for_every_call_style() -> None:
    plain = build_graph().compile()
    app = instrument(build_graph().compile())
    assert _shape(app.invoke(task_input(3))) == _shape(plain.invoke(task_input(3)))
    assert [_shape(o) for o in app.batch([task_input(1), task_input(2)])] == [_shape(o) for o in plain.batch([task_input(1), task_input(2)])]
    plain_chunks = [sorted(c) for c in plain.stream(task_input(4), stream_mode="updates")]
    app_chunks = [sorted(c) for c in app.stream(task_input(4), stream_mode="updates")]
    assert app_chunks == plain_chunks and len(app_chunks) == 4

    async def both():
        a = await app.ainvoke(task_input(5))
        p = await plain.ainvoke(task_input(5))
        chunks = [c async for c in app.astream(task_input(6), stream_mode="values")]
        return a, p, chunks

    a, p, chunks = asyncio.run(both())
    assert _shape(a) == _shape(p)
    assert _shape(chunks[-1])[-1][1] == "task-6 answer: 106"
    # invoke, 2 batch, stream, ainvoke, astream: one episode each, all complete
    assert len(app.episodes) == 6
    assert all(len(e.actions) == 4 and e.error is None for e in app.episodes)


def test_kept_episodes_are_not_work_for_the_garbage_collector() -> None:
    """A kept episode was about 60 container objects (this graph's 4 actions); each outlived the collector's
    young generations, and every quarter more of them in the oldest one set off a full collection of the whole
    process (125 ms each in the overhead benchmark, 0.2 ms per run). Kept episodes are now pickled, one
    untracked bytes object each; what `episodes` returns is unpickled, so editing it changes nothing kept."""
    app = instrument(build_graph().compile())
    app.invoke(task_input(0))
    app.flush()
    gc.collect()
    before = len(gc.get_objects())
    for i in range(1, 41):
        app.invoke(task_input(i))
    app.flush()
    gc.collect()
    assert len(gc.get_objects()) - before < 40, "kept episodes must not be containers the collector walks"
    episodes = app.episodes
    assert len(episodes) == 41 and episodes[-1].input["messages"][0]["content"] == "solve task-40"
    assert episodes[-1] == app.last_episode and len(episodes[0].actions) == 4
    episodes[0].actions.clear()
    assert len(app.episodes[0].actions) == 4


def test_the_writer_holds_no_built_episode_once_it_is_stored(tmp_path) -> None:
    """A server that never calls flush(): every finished build stayed in the writer's job list with its
    Episode until a flush, so memory grew with every call. Once stored, nothing of the writer's holds it."""
    import weakref

    built: list[weakref.ref] = []

    class Watched(TraceStore):
        def add_episode(self, episode):  # the writer thread stores each built episode here
            super().add_episode(episode)
            built.append(weakref.ref(episode))

    app = instrument(build_graph().compile(), store=Watched(tmp_path / "t.db"))
    for i in range(20):
        app.invoke(task_input(i))
    app._worker._last.exception()  # the last job has run, and so have all before it; no flush() (it would free them)
    gc.collect()
    assert len(built) == 20 and [ref() for ref in built] == [None] * 20
    assert len(app.episodes) == 20


def test_what_langchain_builds_on_a_runnable_records_too() -> None:
    """Entry points the wrapper inherits as a Runnable, or hands the graph with its config: each records one
    complete episode and returns what the plain graph returns."""
    from langchain_core.runnables import RunnableLambda

    plain = build_graph().compile()
    app = instrument(build_graph().compile())
    last = RunnableLambda(lambda state: state["messages"][-1].content)
    calls = {
        "with_config": lambda g: g.with_config(recursion_limit=50).invoke(task_input(1))["messages"][-1].content,
        "with_retry": lambda g: g.with_retry().invoke(task_input(2))["messages"][-1].content,
        "pipe": lambda g: (g | last).invoke(task_input(3)),
        "batch_as_completed": lambda g: [o["messages"][-1].content for _, o in g.batch_as_completed([task_input(4)])],
        "astream_events": lambda g: asyncio.run(_last_event(g.astream_events(task_input(5), version="v2"))),
    }
    for name, call in calls.items():
        before = len(app.episodes)
        assert call(app) == call(plain), name
        assert len(app.episodes) == before + 1, name
        assert len(app.last_episode.actions) == 4 and app.last_episode.error is None, name
    assert app.name == plain.name and app.get_graph().nodes.keys() == plain.get_graph().nodes.keys()
    assert app.get_input_jsonschema() == plain.get_input_jsonschema()


async def _last_event(events) -> str:
    found = [e["name"] async for e in events if e["event"] == "on_chain_end"]
    return found[-1]


@pytest.mark.filterwarnings("ignore:The v3 streaming protocol")
def test_the_v3_event_streams_record_and_return_the_graphs_own_objects() -> None:
    """`astream_events(version="v3")` returns an awaitable (a run stream whose events pump the run as they
    are read), not an async iterator: wrapped as one, `await app.astream_events(..., version="v3")` raised
    TypeError. Both v3 streams return LangGraph's own run stream and record one episode."""
    plain = build_graph().compile()
    app = instrument(build_graph().compile())

    async def read(graph):
        run = await graph.astream_events(task_input(6), version="v3")
        return (await run.output())["messages"][-1].content

    assert asyncio.run(read(app)) == asyncio.run(read(plain))
    assert len(app.episodes) == 1 and len(app.last_episode.actions) == 4 and app.last_episode.error is None
    run = app.stream_events(task_input(7), version="v3")
    assert run.output["messages"][-1].content == plain.stream_events(task_input(7), version="v3").output[
        "messages"][-1].content
    assert len(app.episodes) == 2 and len(app.last_episode.actions) == 4


def test_user_callbacks_are_kept() -> None:
    class Count(BaseCallbackHandler):
        def __init__(self) -> None:
            self.starts = 0

        def on_chat_model_start(self, *args, **kwargs) -> None:
            self.starts += 1

    counter = Count()
    app = instrument(build_graph().compile())
    app.invoke(task_input(1), config={"callbacks": [counter]})
    assert counter.starts == 3
    assert len(app.last_episode.actions) == 4


def test_uncompiled_graph_is_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match=r"call graph.compile\(\) first"):
        instrument(build_graph())
    with pytest.raises(TypeError, match="compiled LangGraph graph"):
        instrument(lambda x: x)
    from langchain_core.runnables import RunnableLambda

    graph = build_graph().compile()
    for wrapped in (graph.with_retry(), graph.with_types(input_type=dict), RunnableLambda(lambda x: x) | graph):
        with pytest.raises(TypeError, match=r"wraps a compiled graph: instrument the graph itself .*instrument\(graph\)"
                                            r"\.with_retry\(\)"):
            instrument(wrapped)






def test_failing_graph_still_records_its_episode(tmp_path) -> None:
    from tests.fakes import ScriptedChatModel

    def broken(messages):
        raise ValueError("model exploded")

    store = TraceStore(tmp_path / "t.db")
    app = instrument(build_graph(coder_model=ScriptedChatModel(script=broken)).compile(), store=store)
    with pytest.raises(ValueError, match="model exploded"):
        app.invoke(task_input(1))
    app.flush()
    (ep,) = store.episodes()
    assert "model exploded" in ep.error
    assert ep.actions[0].output_text.startswith("plan for task-1")
    assert ep.actions[1].node == "coder" and "model exploded" in ep.actions[1].error


def test_a_failed_background_store_write_is_raised_not_swallowed(tmp_path) -> None:
    class BrokenStore(TraceStore):
        def add_episodes(self, episodes) -> None:
            raise OSError("disk full")

    app = instrument(build_graph().compile(), store=BrokenStore(tmp_path / "t.db"))
    out = app.invoke(task_input(1))  # the graph's own result is untouched
    assert out["messages"][-1].content == "task-1 answer: 101"
    with pytest.raises(OSError, match="disk full"):
        app.flush()
    app.flush()  # reported once, then the writer carries on
    assert len(app.episodes) == 1


def test_a_failed_store_write_is_raised_once_by_whoever_waits_for_it(tmp_path) -> None:
    """run_episode waits for its own episode and raises its failed write; the next flush() must not raise the
    same failure again (it would be reported as a second lost episode)."""

    class BrokenStore(TraceStore):
        def add_episodes(self, episodes) -> None:
            raise OSError("disk full")

    app = instrument(build_graph().compile(), store=BrokenStore(tmp_path / "t.db"))
    with pytest.raises(OSError, match="disk full"):
        app.run_episode(task_input(1), task_id="t1")
    app.flush()  # already raised to run_episode's caller
    app.invoke(task_input(2))
    with pytest.raises(OSError, match="disk full"):  # a new failure is still raised
        app.flush()


def test_a_store_write_that_fails_at_interpreter_exit_is_reported(tmp_path) -> None:
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "from mappa_graph import TraceStore, instrument\n"
        "from tests.graphs import build_graph, task_input\n"
        "class BrokenStore(TraceStore):\n"
        "    def add_episodes(self, episodes):\n"
        "        raise OSError('disk full')\n"
        f"app = instrument(build_graph(delay_s=0.002).compile(), store=BrokenStore({str(tmp_path / 't.db')!r}))\n"
        "for n in range(3):\n"
        "    app.invoke(task_input(n))\n"  # no flush: the exit hook meets the failures
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "disk full" in done.stderr and "3 episodes" in done.stderr, done.stderr


def test_background_episodes_are_complete_in_order_and_stored_when_flush_returns(tmp_path) -> None:
    store = TraceStore(tmp_path / "t.db")
    app = instrument(build_graph().compile(), store=store)
    for n in range(12):
        app.invoke(task_input(n))
    app.flush()
    assert store.count("episodes") == 12 and store.count("actions") == 48
    assert [e.actions[-1].output_text for e in app.episodes] == [f"task-{n} answer: {n + 100}" for n in range(12)]
    assert [e.actions[2].node_input["messages"][-1]["tool_calls"][0]["args"] for e in store.episodes()] == [
        {"a": n, "b": 100} for n in range(12)]


def test_the_writer_builds_while_the_graph_waits_for_a_model_and_whenever_someone_waits_for_it() -> None:
    """A finished call's episode is built while the graph waits for its next model call, not while the graph's
    own code runs (a build there holds the GIL the graph wants back); flush() does not wait for a model call."""
    import time

    from tests.fakes import ScriptedChatModel, task_number
    from tests.graphs import planner_script

    seen_by_the_model: list[int] = []

    def planner(messages):
        if task_number(messages) == 1:  # the second call: the first call's episode is built meanwhile
            deadline = time.monotonic() + 10
            while not app._episodes and time.monotonic() < deadline:
                time.sleep(0.005)
            seen_by_the_model.append(len(app._episodes))
        return planner_script(messages)

    app = instrument(build_graph(planner_model=ScriptedChatModel(script=planner)).compile())
    app._worker.gate.patience = 60.0  # only a model call or a waiter lets the writer go
    app.invoke(task_input(0))
    time.sleep(0.3)
    assert app._episodes == []  # queued, not built: the graph called no model since
    app.invoke(task_input(1))
    assert seen_by_the_model == [1]
    started = time.monotonic()
    app.flush()
    assert time.monotonic() - started < 5  # far from the 60 s the gate would wait by itself
    assert [e.input["messages"][0]["content"] for e in app.episodes] == ["solve task-0", "solve task-1"]


def test_an_episode_is_written_within_the_writers_patience_without_another_model_call(tmp_path) -> None:
    import time

    store = TraceStore(tmp_path / "t.db")
    app = instrument(build_graph().compile(), store=store)
    app._worker.gate.patience = 0.05
    app.invoke(task_input(0))
    deadline = time.monotonic() + 10
    while not app._episodes and time.monotonic() < deadline:  # no flush, no store read: nothing hurries it
        time.sleep(0.01)
    assert len(app._episodes) == 1
    assert store.count("episodes") == 1


def test_the_writer_thread_ends_with_its_graph() -> None:
    import gc
    import time

    app = instrument(build_graph().compile())
    app.invoke(task_input(1))
    thread = app._worker._thread  # one per instrumented graph; a graph dropped must not leave it running
    assert thread is not None and thread.is_alive()
    del app
    gc.collect()
    deadline = time.monotonic() + 10
    while thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not thread.is_alive()


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork (POSIX)")
def test_a_forked_child_records_with_its_own_writer_thread() -> None:
    """The parent's writer thread does not exist in a forked child: the child's first call must start one,
    or its episodes would queue forever and flush() would never return."""
    app = instrument(build_graph().compile())
    app.invoke(task_input(1))
    app.flush()  # the parent's writer thread is running now
    answer = _in_forked_child(lambda: f"{len(app.episodes)} {app.episodes[-1].actions[-1].output_text}", app)
    assert answer == "2 task-2 answer: 102", "the forked child's flush() never returned: its episodes were never built"
    assert len(app.episodes) == 1  # the parent is untouched by the child's call


def _in_forked_child(report, app) -> str | None:
    """Fork; the child runs one more call, flushes, and sends back report(); None if it hangs for 60 s."""
    import os
    import time

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        try:
            app.invoke(task_input(2))
            app.flush()
            os.write(write, report().encode())
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 60
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            os.close(read)
            return None
        time.sleep(0.01)
    with os.fdopen(read) as answer:
        return answer.read()


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork (POSIX)")
def test_a_child_forked_while_builds_are_in_flight_neither_redoes_nor_waits_for_them() -> None:
    """The parent's running and queued builds are the parent's: a child that inherited them would build the
    queued one again (a duplicate episode) and wait forever on the running one in flush()."""
    import threading

    app = instrument(build_graph().compile())
    app.invoke(task_input(1))
    app.flush()
    release, ran = threading.Event(), []
    app._worker.submit(release.wait)  # running in the parent's writer thread when the fork happens
    app._worker.submit(ran.append, "queued")  # queued behind it
    answer = _in_forked_child(lambda: f"{len(app.episodes)} {ran}", app)
    release.set()
    assert answer is not None, "the forked child's flush() waited on a build of its parent"
    assert answer == "2 []"  # its own episode built, the parent's queued build not redone
    app.flush()
    assert ran == ["queued"] and len(app.episodes) == 1


def test_episodes_still_queued_at_interpreter_exit_are_written(tmp_path) -> None:
    import subprocess
    import sys
    from pathlib import Path

    db = tmp_path / "t.db"
    script = (
        "from mappa_graph import instrument\n"
        "from tests.graphs import build_graph, task_input\n"
        f"app = instrument(build_graph(delay_s=0.002).compile(), store={str(db)!r})\n"
        "for n in range(20):\n"
        "    app.invoke(task_input(n))\n"  # no flush: the exit hook must drain the writer
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", script], cwd=root, check=True, timeout=120)
    assert TraceStore(db).count("episodes") == 20


def test_the_store_waits_for_background_episodes_before_answering(tmp_path) -> None:
    from mappa_graph.traces import Reward

    store = TraceStore(tmp_path / "t.db")
    app = instrument(build_graph(delay_s=0.001).compile(), store=store)
    for n in range(6):
        app.invoke(task_input(n))
        # no flush: each read (and a reward for the episode just run) sees the call that has returned
        assert store.count("episodes") == n + 1
        (ep,) = store.episodes(task_id=None, limit=n + 1)[n:]
        assert ep.actions[-1].output_text == f"task-{n} answer: {n + 100}"
        store.add_rewards([Reward(action_id=ep.actions[0].id, episode_id=ep.id, agent="planner", judge="j", score=1.0)])
    assert len(store.rewards()) == 6


def test_a_stream_the_caller_stops_reading_gives_an_episode_that_says_so() -> None:
    app = instrument(build_graph().compile())
    for _ in app.stream(task_input(2), stream_mode="updates"):
        break
    episode = app.last_episode
    assert episode.status == "error" and episode.error.startswith("cut short: the caller stopped reading the stream")
    assert [a.node for a in episode.actions] == ["planner"]


def test_the_public_scripted_model_drives_a_prebuilt_agent() -> None:
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool

    from mappa_graph.testing import ScriptedChatModel

    @tool
    def double(x: int) -> int:
        """Double a number."""
        return 2 * x

    def reply(messages: list) -> AIMessage:
        if isinstance(messages[-1], ToolMessage):
            return AIMessage(f"it is {messages[-1].content}")
        return AIMessage("", tool_calls=[{"name": "double", "args": {"x": 21}, "id": "d1"}])

    app = instrument(create_agent(ScriptedChatModel(reply=reply), [double]))
    assert app.invoke({"messages": [HumanMessage("double 21")]})["messages"][-1].content == "it is 42"
    assert [(a.path, [r.output for r in a.tool_results]) for a in app.last_episode.actions if a.kind == "llm"] == [
        ("model", ["42"]), ("model", [])]


class Answer:
    """The app's own type, as a task's reference."""

    def __init__(self, value: int) -> None:
        self.value = value


def test_kept_episodes_come_back_as_they_were() -> None:
    """Kept as bytes, an episode reads back with every value of its own type (a JSON round trip turned a tuple
    into a list, an int key into a string, the app's reference type into a dict or an error); one that cannot be
    pickled (a lambda in its reference) is kept as the object."""
    app = instrument(build_graph().compile())
    reference = {"answer": Answer(106), "pair": (1, 2), "when": date(2026, 12, 5), 3: float("-inf")}
    _, episode = app.run_episode(task_input(6), task_id="t6", reference=reference)
    unpicklable = {"check": lambda answer: answer == 107}
    app.run_episode(task_input(7), task_id="t7", reference=unpicklable)
    first, second = app.episodes
    assert first.id == episode.id and first.actions == episode.actions and first is not episode
    assert isinstance(first.reference["answer"], Answer) and first.reference["answer"].value == 106
    assert first.reference["pair"] == (1, 2) and first.reference["when"] == date(2026, 12, 5)
    assert first.reference[3] == float("-inf")
    assert second.reference["check"] is unpicklable["check"] and len(second.actions) == 4
    assert [e.task_id for e in app.episodes_newest_first()] == ["t7", "t6"]


def test_an_instrumented_graph_used_as_a_node_is_its_parents_subgraph_as_the_plain_one_is() -> None:
    """LangGraph finds a node's subgraph by type: the wrapped one must still be found, or the parent's
    `get_state(subgraphs=True)` loses the paused subgraph's state (and so `update_state` inside it), as do
    `get_subgraphs()` and the debug stream's task states."""
    from typing import TypedDict

    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import START, StateGraph
    from langgraph.types import Command, interrupt

    class State(TypedDict):
        x: int
        log: list[str]

    def ask(state: State) -> dict:
        return {"x": state["x"] + 1, "log": [*state["log"], f"asked: {interrupt('go on?')}"]}

    def sub():
        graph = StateGraph(State)
        graph.add_node("ask", ask)
        graph.add_edge(START, "ask")
        return graph.compile()

    def run(node) -> tuple:
        graph = StateGraph(State)
        graph.add_node("sub", node)
        graph.add_node("after", lambda state: {"log": [*state["log"], "after"]})
        graph.add_edge(START, "sub")
        graph.add_edge("sub", "after")
        parent = graph.compile(checkpointer=InMemorySaver())
        config = {"configurable": {"thread_id": "t"}}
        debug = [(ns, chunk["type"]) for ns, mode, chunk in
                 parent.stream({"x": 1, "log": []}, config, subgraphs=True, stream_mode=["debug"])]
        (task,) = parent.get_state(config, subgraphs=True).tasks
        assert task.state is not None, "the paused subgraph's state is lost"
        parent.update_state(task.state.config, {"x": 10})  # edit inside the paused subgraph
        return ([name for name, _ in parent.get_subgraphs()], [(len(ns), kind) for ns, kind in debug],
                task.state.values, task.state.next, parent.invoke(Command(resume="yes"), config))

    app = instrument(sub())
    assert run(app) == run(sub())
    assert [(e.status, [a.node for a in e.actions]) for e in app.episodes] == [("interrupted", ["ask"]), ("ok", ["ask"])]


def test_a_subgraph_compiled_without_checkpoints_stays_no_subgraph_when_instrumented() -> None:
    """LangGraph does not treat a `checkpointer=False` graph as a subgraph; found as one through the wrapper,
    the parent's get_state(subgraphs=True) raised 'No checkpointer set'."""
    from typing import TypedDict

    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import START, StateGraph
    from langgraph.types import interrupt

    class State(TypedDict):
        x: int

    def run(node) -> tuple:
        graph = StateGraph(State)
        graph.add_node("sub", node)
        graph.add_node("stop", lambda state: {"x": interrupt("?")})
        graph.add_edge(START, "sub")
        graph.add_edge("sub", "stop")
        parent = graph.compile(checkpointer=InMemorySaver())
        config = {"configurable": {"thread_id": "t"}}
        parent.invoke({"x": 1}, config)
        (before_sub,) = [s for s in parent.get_state_history(config) if s.next == ("sub",)]
        return [n for n, _ in parent.get_subgraphs()], parent.get_state(before_sub.config, subgraphs=True).tasks[0].state

    def sub():
        graph = StateGraph(State)
        graph.add_node("inner", lambda state: {"x": state["x"] + 1})
        graph.add_edge(START, "inner")
        return graph.compile(checkpointer=False)

    assert run(instrument(sub())) == run(sub()) == ([], None)


@pytest.mark.parametrize("where", ["compiled", "per call"])
def test_a_call_that_stops_at_a_static_breakpoint_is_a_paused_episode(where: str) -> None:
    """`interrupt_before=` pauses the run like interrupt() does, with no value and no error: its episode
    ended 'ok' with nothing to say the run had not finished."""
    from typing import TypedDict

    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import START, StateGraph

    from mappa_graph.capture.store import join_episodes
    from mappa_graph.judging.llm_prompt import build_prompt

    class State(TypedDict):
        x: int

    graph = StateGraph(State)
    graph.add_node("a", lambda state: {"x": state["x"] + 1})
    graph.add_node("b", lambda state: {"x": state["x"] * 10})
    graph.add_edge(START, "a")
    graph.add_edge("a", "b")
    compiled = graph.compile(checkpointer=InMemorySaver(), interrupt_before=["b"] if where == "compiled" else None)
    app = instrument(compiled)
    config = {"configurable": {"thread_id": "t"}}
    kwargs = {"interrupt_before": ["b"]} if where == "per call" else {}
    assert app.invoke({"x": 1}, config, **kwargs) == {"x": 2}
    paused = app.last_episode
    assert (paused.status, paused.metadata["paused_before"], [a.node for a in paused.actions]) == (
        "interrupted", ["b"], ["a"])
    assert "stopped at a breakpoint before b (not a failure)" in build_prompt(paused, paused.actions[0]).messages[1].content
    assert app.invoke(None, config) == {"x": 20}
    done = app.last_episode
    assert (done.status, "paused_before" in done.metadata, [a.node for a in done.actions]) == ("ok", False, ["b"])
    joined = join_episodes([paused, done])
    assert (joined.status, "paused_before" in joined.metadata, [a.node for a in joined.actions]) == ("ok", False, ["a", "b"])


def test_a_model_stream_a_node_stops_reading_keeps_what_the_model_said() -> None:
    from langchain_core.messages import AIMessage, HumanMessage
    from langgraph.graph import END, START, StateGraph
    from typing_extensions import TypedDict

    from tests.fakes import ScriptedChatModel

    class State(TypedDict, total=False):
        task: str
        head: str

    class Streaming(ScriptedChatModel):
        def _stream(self, messages, stop=None, run_manager=None, **kwargs):  # type: ignore[override]
            from langchain_core.outputs import ChatGenerationChunk
            from langchain_core.messages import AIMessageChunk

            for word in self.script(messages).content.split():
                yield ChatGenerationChunk(message=AIMessageChunk(content=word + " "))

    model = Streaming(script=lambda m: AIMessage(f"ANSWER 42 then a long tail for {m[-1].content}"))

    def head(state: State) -> dict:
        said = ""
        for chunk in model.stream([HumanMessage(state["task"])]):
            said += chunk.content
            if "42" in said:
                break  # the node has what it needs
        return {"head": said}

    graph = StateGraph(State)
    graph.add_node("head", head)
    graph.add_edge(START, "head")
    graph.add_edge("head", END)
    app = instrument(graph.compile())
    assert app.invoke({"task": "task-1"}) == {"task": "task-1", "head": "ANSWER 42 "}
    [call] = app.last_episode.actions
    assert call.kind == "llm" and call.output_text == "ANSWER 42 "
    assert call.status == "error" and call.error.startswith("cut short")  # not trained as a whole reply


def test_models_a_node_calls_on_threads_of_its_own_are_recorded_with_the_context_or_config_passed() -> None:
    """What the README says to do when a node calls models on threads it starts: a bare thread has no
    LangChain context (the call is not seen), ContextThreadPoolExecutor or the node's config passed on does."""
    from concurrent.futures import ThreadPoolExecutor

    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.runnables import RunnableConfig
    from langchain_core.runnables.config import ContextThreadPoolExecutor
    from langgraph.graph import END, START, StateGraph
    from typing_extensions import TypedDict

    from tests.fakes import ScriptedChatModel

    class State(TypedDict, total=False):
        task: str
        said: list[str]

    model = ScriptedChatModel(script=lambda m: AIMessage(f"on {m[-1].content}"))

    def fan(state: State, config: RunnableConfig) -> dict:
        with ContextThreadPoolExecutor(2) as pool:
            a = pool.submit(model.invoke, [HumanMessage("context")]).result().content
        with ThreadPoolExecutor(2) as pool:
            b = pool.submit(model.invoke, [HumanMessage("config")], config).result().content
            c = pool.submit(model.invoke, [HumanMessage("bare")]).result().content
        return {"said": [a, b, c]}

    graph = StateGraph(State)
    graph.add_node("fan", fan)
    graph.add_edge(START, "fan")
    graph.add_edge("fan", END)
    app = instrument(graph.compile())
    assert app.invoke({"task": "t"})["said"] == ["on context", "on config", "on bare"]
    assert [(a.node, a.output_text) for a in app.last_episode.actions] == [("fan", "on context"),
                                                                          ("fan", "on config")]


def test_the_temperature_an_app_asks_of_a_model_is_recorded_without_a_token_record() -> None:
    from langchain_core.messages import AIMessage, HumanMessage
    from langgraph.graph import END, START, StateGraph
    from typing_extensions import TypedDict

    from tests.fakes import ScriptedChatModel

    class State(TypedDict, total=False):
        task: str
        out: str

    model = ScriptedChatModel(script=lambda m: AIMessage("ok"))
    graph = StateGraph(State)
    graph.add_node("hot", lambda s: {"out": model.bind(temperature=0.7).invoke([HumanMessage(s["task"])]).content})
    graph.add_node("cold", lambda s: {"out": model.invoke([HumanMessage(s["task"])]).content})
    graph.add_edge(START, "hot")
    graph.add_edge("hot", "cold")
    graph.add_edge("cold", END)
    app = instrument(graph.compile())
    app.invoke({"task": "t"})
    assert [(a.node, a.temperature) for a in app.last_episode.actions] == [("hot", 0.7), ("cold", None)]


def test_what_the_caller_changes_after_a_call_does_not_change_its_episode() -> None:
    """The episode is built on the writer thread after the call returned: it read the caller's edits of the
    returned state (a reply's text, the next turn a chat loop appends to the returned messages, its input
    reused) and recorded them as what the graph did."""
    from langchain_core.messages import HumanMessage

    app = instrument(build_graph().compile())
    given = task_input(1)
    out = app.invoke(given)
    reply = out["messages"][-1].content
    out["messages"][-1].content = "EDITED BY CALLER"
    out["messages"].append(HumanMessage("turn 2, typed after turn 1 returned"))
    given["messages"].append(HumanMessage("the caller reuses its input"))
    episode = app.last_episode
    assert [m["content"] for m in episode.final_state["messages"]][-1] == reply
    assert len(episode.final_state["messages"]) == len(out["messages"]) - 1
    assert len(episode.input["messages"]) == 1
    assert episode.actions[-1].output_message["content"] == reply


def test_the_caller_editing_a_returned_replys_tool_call_or_content_blocks_leaves_its_episode() -> None:
    """What the call returned is frozen as it ends; a message's nested parts (a tool call's arguments, a list
    of content blocks) are the app's objects too, and editing them in place must not reach the episode."""
    from langchain_core.messages import AIMessage

    from tests.fakes import ScriptedChatModel

    blocks = lambda messages: AIMessage([{"type": "text", "text": "blocks"}])  # noqa: E731
    app = instrument(build_graph(planner_model=ScriptedChatModel(script=blocks)).compile())
    out = app.invoke(task_input(3))
    asked = next(m for m in out["messages"] if getattr(m, "tool_calls", None))
    asked.tool_calls[0]["args"]["a"] = -1
    out["messages"][1].content[0]["text"] = "EDITED"
    episode = app.last_episode
    final = episode.final_state["messages"]
    assert final[1]["content"] == [{"type": "text", "text": "blocks"}]
    assert [m["tool_calls"][0]["args"] for m in final if m.get("tool_calls")] == [{"a": 3, "b": 100}]


def test_a_caller_still_filling_the_returned_state_loses_no_episode() -> None:
    """A caller that keeps growing a dict it got back while the writer converted it made the build fail
    ("dictionary changed size during iteration"): the episode was lost and flush() raised it."""
    import threading
    from typing import TypedDict

    from langgraph.graph import START, StateGraph

    from tests.fakes import ScriptedChatModel

    from langchain_core.messages import AIMessage

    model = ScriptedChatModel(script=lambda messages: AIMessage("reply"))

    class State(TypedDict, total=False):
        cache: dict

    def node(state: State) -> dict:
        model.invoke("hi")
        return {"cache": {f"k{i}": [i, {"v": i}] for i in range(20000)}}

    graph = StateGraph(State)
    graph.add_node("node", node)
    graph.add_edge(START, "node")
    app = instrument(graph.compile())
    for trial in range(3):
        cache = app.invoke({"cache": {}})["cache"]
        done = threading.Event()
        writer_done = threading.Thread(target=lambda: (app.flush(), done.set()))
        writer_done.start()
        i = 0
        while not done.is_set():  # the app keeps using its own dict while the episode is written
            cache[f"new{i}"] = i
            i += 1
        writer_done.join()
        assert len(app.last_episode.final_state["cache"]) == 20000
        assert app.last_episode.actions[0].node_output["cache"]["k7"] == [7, {"v": 7}]
    assert len(app.episodes) == 3


def test_a_waiter_runs_the_job_the_writer_has_not_started_itself(tmp_path) -> None:
    """flush() right after a call: the writer is still at its gate (no model call since), so flush() builds and
    stores the episode on its own thread instead of waiting for the writer's wake-ups."""
    import threading

    stored_on: list[str] = []

    class Watched(TraceStore):
        def add_episode(self, episode):
            super().add_episode(episode)
            stored_on.append(threading.current_thread().name)

    app = instrument(build_graph().compile(), store=Watched(tmp_path / "t.db"))
    app._worker.gate.patience = 60.0  # the writer would hold the job at its gate for a minute
    app.invoke(task_input(0))
    app.flush()
    assert stored_on == [threading.current_thread().name]
    assert [e.input["messages"][0]["content"] for e in app.episodes] == ["solve task-0"]
    app._worker.gate.patience = 0.01
    app.invoke(task_input(1))
    app._worker._last._wait(10)  # no one waits: the writer stores it once its patience is over
    app.flush()
    assert stored_on == [threading.current_thread().name, "mappa-trace"]


def test_a_waiter_leaves_a_job_to_the_writer_while_the_one_before_it_runs() -> None:
    """Jobs run in order: a flush() that comes while the writer runs the job before the last does not take the
    last (it would wait holding it, and a Ctrl-C there lost it); it waits, and the writer runs both."""
    import threading

    app = instrument(build_graph().compile())
    app.invoke(task_input(0))
    app.flush()
    release, ran = threading.Event(), []
    app._worker.submit(lambda: (release.wait(), ran.append(("first", threading.current_thread().name))))
    app._worker.submit(lambda: ran.append(("second", threading.current_thread().name)))
    flushing = threading.Thread(target=app.flush, name="flusher")
    flushing.start()
    flushing.join(0.3)
    assert flushing.is_alive() and ran == []
    release.set()
    flushing.join(10)
    assert not flushing.is_alive()
    assert ran == [("first", "mappa-trace"), ("second", "mappa-trace")]


def test_a_job_run_by_a_waiter_may_read_the_store_it_writes(tmp_path) -> None:
    """A store whose write reads the store (its reads wait for the graph's queued episodes): on the writer
    thread it never waited for itself, nor may it on the thread that runs the job in flush()'s place."""
    import threading

    counts: list[int] = []

    class Counting(TraceStore):
        def add_episode(self, episode):
            super().add_episode(episode)
            counts.append(self.count("episodes"))

    app = instrument(build_graph().compile(), store=Counting(tmp_path / "t.db"))
    app._worker.gate.patience = 60.0
    app.invoke(task_input(0))
    flushing = threading.Thread(target=app.flush, daemon=True)
    flushing.start()
    flushing.join(10)
    assert not flushing.is_alive(), "flush() waited for the job it was running"
    assert counts == [1]


def test_a_ctrl_c_during_a_job_run_in_place_is_raised_once_the_job_is_done() -> None:
    """On the writer thread a Ctrl-C never cut a build short; run in flush()'s place on the main thread, it cut
    the job (and its store write) in the middle and the episode was lost."""
    import signal

    app, ran = _held_job_app(lambda: signal.raise_signal(signal.SIGINT))
    with _handler(signal.SIGINT, signal.default_int_handler), pytest.raises(KeyboardInterrupt):
        app.flush()
    assert ran == ["MainThread"]
    app.flush()  # the interrupt is not kept as the job's failure


def test_failed_writes_do_not_keep_each_other_alive(tmp_path) -> None:
    """A failure's traceback keeps the frame that ran the job: it held the job before it, whose failure held
    the one before that, so a store that kept failing kept every episode since."""
    import weakref

    alive: list[weakref.ref] = []

    class Failing(TraceStore):
        def add_episode(self, episode):
            alive.append(weakref.ref(episode))
            raise OSError("disk full")

    app = instrument(build_graph().compile(), store=Failing(tmp_path / "t.db"))
    for n in range(20):
        app.invoke(task_input(n))
        with pytest.raises(OSError):
            app.flush()
    gc.collect()
    assert len(alive) == 20 and sum(ref() is not None for ref in alive) <= 2


def test_a_store_write_run_in_place_is_not_part_of_the_waiters_call() -> None:
    """A sub-agent run with run_episode inside a node of an instrumented graph, its store asking a judge model
    as it writes: run in the node's place, the judge's call joined the outer call's episode as an action."""
    from langchain_core.messages import AIMessage, HumanMessage
    from langgraph.graph import END, START, MessagesState, StateGraph

    from tests.fakes import ScriptedChatModel

    judge = ScriptedChatModel(script=lambda messages: AIMessage(content="score: 1"))

    class Judging(TraceStore):
        def add_episode(self, episode):
            judge.invoke([HumanMessage("JUDGE this episode")])
            super().add_episode(episode)

    inner = instrument(build_graph().compile(), store=Judging(":memory:"), run="inner")

    def delegate(state):
        _, episode = inner.run_episode(task_input(7))
        return {"messages": [AIMessage(content=f"delegated: {len(episode.actions)} actions")]}

    graph = StateGraph(MessagesState)
    graph.add_node("delegate", delegate)
    graph.add_edge(START, "delegate")
    graph.add_edge("delegate", END)
    _, episode = instrument(graph.compile(), run="outer").run_episode(task_input(1))
    assert "JUDGE" not in str([action.model_dump() for action in episode.actions])
    assert len(episode.actions) == 4  # the inner graph's four model and tool actions, through the configure hook


def test_a_job_inside_another_graphs_job_run_in_place_still_knows_its_own() -> None:
    """Two graphs on one store, whose write of graph a's episodes reads the store: a thread running a's job in
    place reads from inside it. Once, it ran b's job in place on the way and then forgot it was inside a's; now
    a read inside a job waits for no writer, and b's episode is in once the store is read from outside."""
    import threading

    class Audited(TraceStore):
        def add_episode(self, episode):
            super().add_episode(episode)
            if episode.run == "a":
                self.count("episodes")  # a read: waits for both graphs' queued episodes

    store = Audited(":memory:")
    b = instrument(build_graph().compile(), store=store, run="b")
    a = instrument(build_graph().compile(), store=store, run="a")
    for graph in (a, b):
        graph.invoke(task_input(0))
        graph.flush()
    a._worker.gate.patience = b._worker.gate.patience = 60.0
    b.invoke(task_input(1))
    a.invoke(task_input(2))
    flushing = threading.Thread(target=a.flush, daemon=True)
    flushing.start()
    flushing.join(10)
    assert not flushing.is_alive(), "a's job waited for itself"
    assert store.count("episodes") == 4


def test_the_exit_drain_finishes_a_store_write_that_reads_the_store(tmp_path) -> None:
    import subprocess
    import sys
    from pathlib import Path

    db = tmp_path / "t.db"
    script = (
        "from mappa_graph import instrument, TraceStore\n"
        "from tests.graphs import build_graph, task_input\n"
        "class Counting(TraceStore):\n"
        "    def add_episode(self, episode):\n"
        "        super().add_episode(episode)\n"
        "        self.count('episodes')\n"
        f"app = instrument(build_graph().compile(), store=Counting({str(db)!r}))\n"
        "app._worker.gate.patience = 60.0\n"
        "app.invoke(task_input(0))\n"  # still queued at exit: the drain runs it on the writer
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", script], cwd=root, check=True, timeout=60)
    assert TraceStore(db).count("episodes") == 1


@contextmanager
def _handler(signum: int, handler):
    """`handler` for the block (a background CI job starts with SIGINT ignored, so a Ctrl-C raised nothing),
    which the flush inside must leave in place."""
    import signal

    outside = signal.signal(signum, handler)
    try:
        yield
        assert signal.getsignal(signum) is handler
    finally:
        signal.signal(signum, outside)


def _held_job_app(steps):
    """A graph whose writer holds its next job at the gate, and that job: flush() runs it on this thread."""
    import threading

    assert threading.current_thread() is threading.main_thread()
    app = instrument(build_graph().compile())
    app.invoke(task_input(0))
    app.flush()
    app._worker.gate.patience = 60.0
    ran: list[str] = []

    def job() -> None:
        steps()
        for _ in range(1000):  # a Python handler would run on one of these steps
            pass
        ran.append(threading.current_thread().name)

    app._worker.submit(job)
    return app, ran


def test_one_ctrl_c_during_a_job_run_in_place_reaches_an_asyncio_loops_handler_once() -> None:
    """asyncio's add_signal_handler learns of a signal from the wakeup fd, which the signal itself writes:
    raising the held Ctrl-C again after the job wrote it a second time, and the loop saw two."""
    import signal

    app, ran = _held_job_app(lambda: signal.raise_signal(signal.SIGINT))
    outside = signal.getsignal(signal.SIGINT)
    loop = asyncio.new_event_loop()
    seen: list[int] = []
    try:
        loop.add_signal_handler(signal.SIGINT, seen.append, 1)
        app.flush()
        loop.run_until_complete(asyncio.sleep(0.2))
        loop.remove_signal_handler(signal.SIGINT)
    finally:
        loop.close()
        signal.signal(signal.SIGINT, outside)
    assert ran == ["MainThread"]
    assert seen == [1]


def test_a_python_signal_handler_that_raises_waits_for_the_job_run_in_place() -> None:
    """A server's SIGTERM handler that exits: run on the writer thread, the job finished and its episode was
    stored; run in flush()'s place, the handler's exception cut it short and the episode was lost."""
    import signal

    def stop(signum, frame):
        raise SystemExit(143)

    app, ran = _held_job_app(lambda: signal.raise_signal(signal.SIGTERM))
    with _handler(signal.SIGTERM, stop), pytest.raises(SystemExit):
        app.flush()
    assert ran == ["MainThread"]
    app.flush()


def test_a_second_ctrl_c_cuts_a_job_run_in_place_short_and_leaves_no_job_hanging() -> None:
    """The first Ctrl-C waits for the job; a second one (a store write that hangs) goes through at once, the
    job fails with it, and later flushes and the next jobs go on."""
    import signal
    import threading

    def twice() -> None:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)

    app, ran = _held_job_app(twice)
    with _handler(signal.SIGINT, signal.default_int_handler), pytest.raises(KeyboardInterrupt):
        app.flush()
    assert ran == []
    app.invoke(task_input(1))
    flushing = threading.Thread(target=app.flush, daemon=True)
    flushing.start()
    flushing.join(10)
    assert not flushing.is_alive()
    assert [e.input["messages"][0]["content"] for e in app.episodes][-1] == "solve task-1"


def test_a_job_claimed_in_place_and_interrupted_before_it_starts_still_runs(monkeypatch) -> None:
    """An interrupt between the claim and the job's start left the job claimed and never run: every later
    flush(), and the exit drain, waited for it forever."""
    import threading
    from contextlib import contextmanager

    from mappa_graph.capture.courtesy import ModelGate

    app, ran = _held_job_app(lambda: None)
    hurried = ModelGate.hurried

    @contextmanager
    def interrupted(gate, wake: bool = True):
        if not wake:  # the in-place run's, right after its claim
            monkeypatch.setattr(ModelGate, "hurried", hurried)
            raise KeyboardInterrupt
        with hurried(gate, wake):
            yield

    monkeypatch.setattr(ModelGate, "hurried", interrupted)
    with pytest.raises(KeyboardInterrupt):
        app.flush()
    flushing = threading.Thread(target=app.flush, daemon=True)
    flushing.start()
    flushing.join(10)
    assert not flushing.is_alive(), "the claimed job was never run"
    assert ran == ["MainThread"]


def test_two_graphs_on_one_store_whose_every_write_reads_it_run_from_two_threads() -> None:
    """Each writer, inside its job, read the store, which waited for the other graph's last job: the other
    writer's, inside its own job and waiting for this one's. A read from inside a trace job now reads what is
    stored without waiting for any writer, so no two jobs can wait for each other."""
    import threading

    class Audited(TraceStore):
        def add_episode(self, episode):
            super().add_episode(episode)
            self.count("episodes")

    store = Audited(":memory:")
    graphs = [instrument(build_graph().compile(), store=store, run=run) for run in ("a", "b")]
    for graph in graphs:
        graph._worker.gate.patience = 0.0

    def calls(graph) -> None:
        for n in range(40):
            graph.invoke(task_input(n))

    threads = [threading.Thread(target=calls, args=(graph,), daemon=True) for graph in graphs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "the graphs' calls hung"
    done = threading.Thread(target=store.count, args=("episodes",), daemon=True)
    done.start()
    done.join(30)
    assert not done.is_alive(), "the two writers wait for each other"
    assert store.count("episodes") == 80


def test_a_handler_that_counts_presses_sees_both_ctrl_cs_of_a_forced_job() -> None:
    """A server's handler: the first Ctrl-C asks to stop gracefully, the second forces. Held, the first was
    dropped once the second went through, so two presses read as one."""
    import signal

    presses: list[str] = []

    def graceful_then_force(signum, frame):
        presses.append("force" if presses else "graceful")
        if len(presses) > 1:
            raise KeyboardInterrupt

    def twice() -> None:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)

    app, ran = _held_job_app(twice)
    with _handler(signal.SIGINT, graceful_then_force), pytest.raises(KeyboardInterrupt):
        app.flush()
    assert presses == ["graceful", "force"] and ran == []


def test_stop_signals_that_came_during_a_job_run_in_place_all_reach_their_handlers() -> None:
    """A Ctrl-C and a SIGTERM during the job: as without a job, both handlers run after it, the SIGTERM's
    exit raised with the Ctrl-C as its context (only the first was raised, and the exit was lost)."""
    import signal

    def stop(signum, frame):
        raise SystemExit(143)

    def both() -> None:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGTERM)

    app, ran = _held_job_app(both)
    with (_handler(signal.SIGINT, signal.default_int_handler), _handler(signal.SIGTERM, stop),
          pytest.raises(SystemExit) as raised):
        app.flush()
    assert ran == ["MainThread"]
    assert isinstance(raised.value.__context__, KeyboardInterrupt)


def test_ctrl_c_pressed_over_and_over_during_a_job_run_in_place_leaves_nothing_held_or_hanging() -> None:
    import signal
    import threading

    from mappa_graph.capture.instrument import _gates_here

    def mashed() -> None:
        for _ in range(5):
            with suppress(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)
                for _ in range(100):
                    pass

    app, ran = _held_job_app(mashed)
    with _handler(signal.SIGINT, signal.default_int_handler), suppress(KeyboardInterrupt):
        app.flush()
    assert _gates_here() == []
    app.invoke(task_input(1))
    flushing = threading.Thread(target=app.flush, daemon=True)
    flushing.start()
    flushing.join(10)
    assert not flushing.is_alive()
    assert app.last_episode.input["messages"][0]["content"] == "solve task-1"


def test_a_second_ctrl_c_in_a_nested_job_run_in_place_forces_the_inner_job() -> None:
    """A store write that runs a judge graph's run_episode, whose own job runs in place too: two Ctrl-Cs in the
    judge's store write force that write, as they would unnested."""
    import signal

    from mappa_graph.capture.instrument import _gates_here

    finished: list[str] = []

    class JudgeStore(TraceStore):
        def add_episode(self, episode):
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            for _ in range(1000):
                pass
            finished.append("judge write")

    judge = instrument(build_graph().compile(), store=JudgeStore(":memory:"), run="judge")
    judge._worker.gate.patience = 60.0

    class Judging(TraceStore):
        def add_episode(self, episode):
            judge.run_episode(task_input(100))
            finished.append("outer write")

    app = instrument(build_graph().compile(), store=Judging(":memory:"))
    app._worker.gate.patience = 60.0
    app.invoke(task_input(1))
    with _handler(signal.SIGINT, signal.default_int_handler), pytest.raises(KeyboardInterrupt):
        app.flush()
    assert finished == [] and _gates_here() == []


def test_a_store_write_reads_another_graphs_episode_once_it_is_in() -> None:
    """A store write that calls an instrumented judge graph and reads its last episode: inside a trace job the
    store's own reads do not wait for writers, but another graph's flush() still waits for its episode."""
    import threading

    judge = instrument(build_graph().compile(), run="judge")
    seen: list[str | None] = []

    class Judging(TraceStore):
        def add_episode(self, episode):
            judge.invoke(task_input(len(seen) + 100))
            last = judge.last_episode
            seen.append(None if last is None else last.input["messages"][0]["content"])
            super().add_episode(episode)

    app = instrument(build_graph().compile(), store=Judging(":memory:"))
    for n in range(3):
        app.invoke(task_input(n))
    done = threading.Thread(target=app.flush, daemon=True)
    done.start()
    done.join(20)
    assert not done.is_alive()
    assert seen == ["solve task-100", "solve task-101", "solve task-102"]


def test_a_store_read_inside_a_job_writes_another_graphs_unstarted_episode_first() -> None:
    """Inside graph a's store write, a judge graph on the same store runs and the write reads the judge's
    episodes: skipping every writer there read 0 (nothing waits in a cycle: the judge's job had not started, so
    the reading thread writes it itself)."""
    seen: list[int] = []

    class Judging(TraceStore):
        def add_episode(self, episode):
            super().add_episode(episode)
            if episode.run == "a":
                judge.invoke(task_input(100))
                seen.append(len(self.episodes(run="judge")))

    store = Judging(":memory:")
    judge = instrument(build_graph().compile(), store=store, run="judge")
    judge._worker.gate.patience = 60.0
    a = instrument(build_graph().compile(), store=store, run="a")
    a.invoke(task_input(0))
    a.flush()
    assert seen == [1]


def test_a_handler_that_installs_the_forcing_one_forces_a_job_run_in_place() -> None:
    """"Press again to force" where the first press's handler installs the second's: held, both presses went
    to the first handler, and nothing was forced."""
    import signal

    log: list[str] = []

    def force(signum, frame):
        log.append("force")
        raise KeyboardInterrupt

    def graceful(signum, frame):
        log.append("graceful")
        signal.signal(signal.SIGINT, force)

    def twice() -> None:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)

    app, ran = _held_job_app(twice)
    outside = signal.signal(signal.SIGINT, graceful)
    try:
        with pytest.raises(KeyboardInterrupt):
            app.flush()
        assert signal.getsignal(signal.SIGINT) is force
    finally:
        signal.signal(signal.SIGINT, outside)
    assert log == ["graceful", "force"] and ran == []


def test_stop_signals_held_during_a_job_reach_their_handlers_in_the_order_they_came() -> None:
    import signal

    log: list[str] = []

    def note(signum, frame):
        log.append(signal.Signals(signum).name)

    def steps() -> None:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGINT):
            signal.raise_signal(signum)

    app, ran = _held_job_app(steps)
    with _handler(signal.SIGINT, note), _handler(signal.SIGTERM, note):
        app.flush()
    assert log == ["SIGINT", "SIGTERM", "SIGINT"] and ran == ["MainThread"]
