from __future__ import annotations

import asyncio

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
