"""instrument() on the multi-agent apps people build (tests/capture/apps.py): supervisor, swarm, subgraph + Send +
structured output, a retried node, interrupt() and resume. For each call style: the same outputs as the plain
graph, one episode per call, and the ordered (agent, path, kind, what it did) of every action."""

from __future__ import annotations

import asyncio
import operator
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.messages import AIMessage, BaseMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command, Interrupt, interrupt
from pydantic import BaseModel

from mappa_graph import TraceStore, instrument
from mappa_graph.judging.llm_prompt import build_prompt
from mappa_graph.messages import content_text
from tests.capture import apps
from tests.capture.apps import APPS, THREADED, interrupt_app, retry_app, supervisor_app, task_input

pytestmark = pytest.mark.filterwarnings("ignore::langgraph.warnings.LangGraphDeprecatedSinceV10")

STYLES = ["invoke", "stream_updates", "stream_messages", "ainvoke", "astream", "batch"]


def norm(x: Any) -> Any:
    """What must be equal between a plain and an instrumented run: no random message or task ids."""
    if isinstance(x, BaseMessage):
        calls = [(c["name"], c["args"]) for c in getattr(x, "tool_calls", None) or []]
        return (type(x).__name__.replace("Chunk", ""), x.name, content_text(x.content), calls)
    if isinstance(x, Interrupt):
        return ("interrupt", norm(x.value))
    if isinstance(x, BaseModel):
        return norm(x.model_dump())
    if isinstance(x, dict):
        if "langgraph_node" in x:  # stream_mode="messages" metadata: task ids differ run to run
            return ("node", x["langgraph_node"])
        return {k: norm(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [norm(v) for v in x]
    return x


def config(name: str, n: int) -> dict:
    return {"configurable": {"thread_id": f"{name}-{n}"}} if name in THREADED else {}


def run_style(graph: Any, name: str, style: str, ns: list[int], make_input: Any = None) -> list[Any]:
    """Run `graph` the way `style` says; returns one comparable output per call."""
    make_input = make_input or APPS[name][1]
    if style == "invoke":
        return [norm(graph.invoke(make_input(n), config(name, n))) for n in ns]
    if style in ("stream_updates", "stream_messages"):
        mode = style.split("_")[1]
        return [sorted(map(repr, norm(list(graph.stream(make_input(n), config(name, n), stream_mode=mode)))))
                for n in ns]
    if style == "batch":
        return [norm(o) for o in graph.batch([make_input(n) for n in ns], [config(name, n) for n in ns])]

    async def run() -> list[Any]:
        if style == "ainvoke":
            outs = await asyncio.gather(*(graph.ainvoke(make_input(n), config(name, n)) for n in ns))
            return [norm(o) for o in outs]
        return [sorted(map(repr, norm([c async for c in graph.astream(make_input(n), config(name, n))])))
                for n in ns]

    return asyncio.run(run())


def did(action: Any) -> str:
    if action.kind == "llm":
        return action.output_text
    if action.handoff:
        return "handoff:" + ",".join(action.handoff)
    return "interrupted" if action.status == "interrupted" else ""


def summary(action: Any) -> tuple:
    return (action.agent, action.path, action.kind, did(action), [c.name for c in action.tool_calls],
            action.attempt, action.status)


def expected_rows(name: str, n: int) -> list[tuple]:
    rows = APPS[name][2](n)
    return [r if len(r) == 7 else (*r, 1, "interrupted" if r[3] == "interrupted" else "ok") for r in rows]


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("name", list(APPS))
def test_app_traces_match_the_plain_graph_in_every_call_style(name: str, style: str) -> None:
    factory = APPS[name][0]
    ns = [1, 2, 3, 4] if style == "batch" else [7]
    plain, app = factory(), instrument(factory())
    assert run_style(app, name, style, ns) == run_style(plain, name, style, ns)
    episodes = app.episodes
    assert len(episodes) == len(ns)  # exactly one episode per call
    by_task = {}
    for ep in episodes:
        n = int(str(ep.input).split("task-")[1].split("'")[0].split('"')[0])
        by_task[n] = ep
        assert [summary(a) for a in ep.actions] == expected_rows(name, n), (name, style, n)
        assert [a.index for a in ep.actions] == list(range(len(ep.actions)))
        assert all(a.error is None for a in ep.actions if a.status == "ok")
        assert not any(a.node.startswith("__") for a in ep.actions)
        if name == "interrupt":
            assert (ep.status, ep.interrupts) == ("interrupted", [{"approve": f"draft for task-{n}"}])
            assert ep.metadata["thread_id"] == f"interrupt-{n}" and ep.metadata["end_checkpoint_id"]
        else:
            assert (ep.status, ep.error, ep.interrupts) == ("ok", None, [])
    assert sorted(by_task) == ns


def test_supervisor_model_calls_and_tool_results_per_worker() -> None:
    app = instrument(supervisor_app())
    app.invoke({"messages": [{"role": "user", "content": "solve task-5"}]})
    ep = app.last_episode
    research_call = ep.actions[2]
    assert [(c.name, c.args) for c in research_call.tool_calls] == [("search", {"query": "task-5"})]
    assert [(r.name, r.output) for r in research_call.tool_results] == [("search", "facts about task-5")]
    handoff_call, handoff_node = ep.actions[0], ep.actions[1]
    # the handoff tool's result is the message it adds, not a Command repr, and no error anywhere
    assert [(r.name, r.output, r.error) for r in handoff_call.tool_results] == [
        ("transfer_to_researcher", "Successfully transferred to researcher", None)]
    assert handoff_node.node_output["command"]["goto"] == ["researcher"]
    assert handoff_node.node_output["command"]["graph"] == "parent"
    assert ep.agents == ["supervisor", "researcher", "math_expert"]


def _cyclic_garbage_per_run(app: Any, runs: int) -> float:
    """Objects per call that only the garbage collector frees (reference cycles), counted with DEBUG_SAVEALL."""
    import gc

    app.invoke({"messages": [{"role": "user", "content": "solve task-0"}]})
    getattr(app, "flush", lambda: None)()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for n in range(runs):
            app.invoke({"messages": [{"role": "user", "content": f"solve task-{n}"}]})
        getattr(app, "flush", lambda: None)()
        gc.collect()
        return len(gc.garbage) / runs
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        gc.enable()


def test_tracing_a_team_leaves_no_more_cyclic_garbage_than_the_team() -> None:
    """A handoff is an exception whose frames hold the run's config, so its callbacks and each collector are
    garbage in a cycle; the episode the collector kept and the builder's task tree (tasks and inner tasks
    pointing at each other) were too, some 600 objects per run that only a collection frees. The team ran its
    collector six times as long traced as untraced. Now both are freed as the episode is stored."""
    plain = _cyclic_garbage_per_run(supervisor_app(), 6)
    traced = _cyclic_garbage_per_run(instrument(supervisor_app()), 6)
    assert plain > 100  # the team's own handoff exceptions: what this test would otherwise miss
    assert traced < plain + 40, (plain, traced)


def test_judge_sees_a_handoff_as_control_flow_not_failure() -> None:
    app = instrument(supervisor_app())
    app.invoke({"messages": [{"role": "user", "content": "solve task-5"}]})
    ep = app.last_episode
    text = build_prompt(ep, ep.actions[1]).messages[1].content
    assert "handed control to researcher (a LangGraph handoff, not an error)" in text
    assert "ParentCommand" not in text and "failed" not in text
    later = build_prompt(ep, ep.actions[4]).messages[1].content
    assert "researcher (node researcher/agent)" in later and "node path: researcher/agent" in later


def test_agents_map_over_paths_or_a_function_of_the_path() -> None:
    app = instrument(supervisor_app(), agents={"supervisor": "router", "researcher/tools": "search_tool"})
    app.invoke({"messages": [{"role": "user", "content": "solve task-1"}]})
    agents = [a.agent for a in app.last_episode.actions]
    assert agents[:5] == ["router", "router", "researcher", "search_tool", "researcher"]
    app = instrument(supervisor_app(), agents=lambda path: "tools" if path[-1] == "tools" else None)
    app.invoke({"messages": [{"role": "user", "content": "solve task-1"}]})
    assert [a.agent for a in app.last_episode.actions][:4] == ["supervisor", "tools", "researcher", "tools"]
    with pytest.raises(ValueError, match=r"unknown node 'researcher/agnet'.*researcher/agent, researcher/tools"):
        instrument(supervisor_app(), agents={"researcher/agnet": "r"})


def test_failed_attempt_is_judged_as_failed_and_not_trained_unless_asked() -> None:
    app = instrument(retry_app())
    app.invoke(task_input(3))
    ep = app.last_episode
    failed, succeeded = ep.actions[1], ep.actions[2]
    assert failed.error == "its node attempt failed after this call: Flaky: the press was busy"
    assert succeeded.error is None and succeeded.node_output == {"published": "edited draft for task-3"}
    assert failed.checkpoint_ns == succeeded.checkpoint_ns
    text = build_prompt(ep, failed).messages[1].content
    assert "the action itself failed (attempt 1)" in text and "ran this node again" in text
    assert "(node publish, attempt 2)" not in text
    later = build_prompt(ep, succeeded).messages[1].content
    assert "attempt: 2 (earlier attempts of this node failed)" in later
    assert "#1 publish (node publish, attempt 1, FAILED): edited draft for task-3" in later
    for action in (failed, succeeded):  # as if a policy backend had reported tokens
        action.prompt_token_ids, action.output_token_ids = [1, 2], [3]
    assert (failed.trainable, succeeded.trainable) == (False, True)
    opted = instrument(retry_app(), train_failed_attempts=True)
    opted.invoke(task_input(3))
    failed = opted.last_episode.actions[1]
    failed.prompt_token_ids, failed.output_token_ids = [1, 2], [3]
    assert failed.status == "error" and failed.trainable


def test_interrupt_and_resume_are_two_episodes_of_one_thread_joined_in_the_store(tmp_path) -> None:
    store = TraceStore(tmp_path / "t.db")
    app = instrument(interrupt_app(), store=store)
    cfg = {"configurable": {"thread_id": "th-1"}}
    first = app.invoke(task_input(9), cfg)
    assert first["__interrupt__"][0].value == {"approve": "draft for task-9"}
    out = app.invoke(Command(resume="approved"), cfg)
    assert out["published"] == "approved: draft for task-9"
    app.flush()
    paused, resumed = store.episodes(thread_id="th-1")
    assert (paused.status, resumed.status) == ("interrupted", "ok")
    assert resumed.metadata["resumed"] is True
    assert resumed.metadata["start_checkpoint_id"] == paused.metadata["end_checkpoint_id"]
    assert [summary(a)[:4] for a in resumed.actions] == [("review", "review", "node", "")]
    assert resumed.actions[0].node_output == {"published": "approved: draft for task-9"}
    text = build_prompt(paused, paused.actions[1]).messages[1].content
    assert "paused here in interrupt()" in text and "GraphInterrupt" not in text
    joined = store.join_thread("th-1")
    assert store.episodes(thread_id="th-1") == [joined]
    assert joined.id == paused.id and joined.status == "ok" and joined.metadata["joined_episode_ids"] == [
        paused.id, resumed.id]
    assert [(a.node, a.status) for a in joined.actions] == [
        ("write", "ok"), ("review", "interrupted"), ("review", "ok")]
    assert [a.index for a in joined.actions] == [0, 1, 2] and {a.episode_id for a in joined.actions} == {joined.id}
    assert store.count("episodes") == 1 and store.count("actions") == 3


def test_a_tool_that_asks_a_human_pauses_the_call_and_its_result_joins_it_on_resume(tmp_path) -> None:
    from langchain_core.messages import AIMessage
    from langchain_core.tools import tool
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import START, MessagesState, StateGraph

    from tests.capture.apps import call, message_input, number, react_agent, seen

    @tool
    def publish(text: str) -> str:
        """Publish the text once a human approves it."""
        return f"published ({interrupt({'approve': text})}): {text}"

    def script(messages: list) -> AIMessage:
        done = seen(messages, "publish")
        return AIMessage(f"done: {done.content}") if done else call("publish", {"text": "a draft"}, f"p-{number(messages)}")

    team = StateGraph(MessagesState)
    team.add_node("writer", react_agent("writer", script, [publish]))
    team.add_edge(START, "writer")
    store = TraceStore(tmp_path / "t.db")
    app = instrument(team.compile(checkpointer=InMemorySaver()), store=store)
    cfg = {"configurable": {"thread_id": "th-2"}}
    assert app.invoke(message_input(4), cfg)["__interrupt__"][0].value == {"approve": "a draft"}
    paused = app.last_episode
    asked = paused.actions[0]
    assert (paused.status, paused.interrupts) == ("interrupted", [{"approve": "a draft"}])
    assert [(r.name, r.output, r.error, r.paused, r.interrupt) for r in asked.tool_results] == [
        ("publish", "", None, True, {"approve": "a draft"})]
    text = build_prompt(paused, asked).messages[1].content
    assert "paused in interrupt() for human input" in text and "ERROR" not in text and "GraphInterrupt" not in text
    app.invoke(Command(resume="yes"), cfg)
    joined = store.join_thread("th-2")
    asked = joined.actions[0]
    assert [(r.output, r.error, r.interrupt) for r in asked.tool_results] == [
        ("", None, {"approve": "a draft"}), ("published (yes): a draft", None, None)]
    assert joined.actions[-1].output_text == "done: published (yes): a draft"


def test_a_model_call_of_a_node_that_paused_is_not_trained_unless_failed_attempts_are() -> None:
    from mappa_graph.traces import Action

    tokens = {"prompt_token_ids": [1, 2], "output_token_ids": [3], "node": "review", "agent": "review"}
    assert Action(**tokens).trainable
    assert not Action(**tokens, status="interrupted").trainable  # the node reruns on resume: a new call
    assert Action(**tokens, status="interrupted", train_failed=True).trainable


def test_a_chain_run_inside_a_tool_is_not_a_second_attempt_of_its_node() -> None:
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.runnables import RunnableLambda
    from langchain_core.tools import tool

    from tests.capture.apps import call, number, react_agent, seen

    upper = RunnableLambda(lambda text: text.upper(), name="upper")

    @tool
    def shout(text: str) -> str:
        """Shout the text."""
        return upper.invoke(text)

    def script(messages):
        found = seen(messages, "shout")
        return AIMessage(f"heard {found.content}") if found else call("shout", {"text": "hi"}, f"c-{number(messages)}")

    app = instrument(react_agent("crier", script, [shout]))
    app.invoke({"messages": [HumanMessage("task-3")]})
    assert [(a.path, a.kind, a.attempt, [r.output for r in a.tool_results]) for a in app.last_episode.actions] == [
        ("agent", "llm", 1, ["HI"]), ("tools", "node", 1, ["HI"]), ("agent", "llm", 1, [])]


def test_a_node_that_hands_off_with_command_parent_keeps_its_model_call_and_target() -> None:
    from typing import TypedDict

    from langchain_core.messages import AIMessage, HumanMessage
    from langgraph.graph import END, START, StateGraph

    from tests.fakes import ScriptedChatModel

    class State(TypedDict, total=False):
        task: str
        note: str
        verdict: str

    lead_model = ScriptedChatModel(script=lambda m: AIMessage(f"note on {m[-1].content}"))
    reviewer_model = ScriptedChatModel(script=lambda m: AIMessage(f"ok: {m[-1].content}"))

    def lead(state: State) -> Command:
        note = lead_model.invoke([HumanMessage(state["task"])]).content
        return Command(graph=Command.PARENT, goto="reviewer", update={"note": note})

    inner = StateGraph(State)
    inner.add_node("lead", lead)
    inner.add_edge(START, "lead")
    outer = StateGraph(State)
    outer.add_node("team", inner.compile())
    outer.add_node("reviewer", lambda s: {"verdict": reviewer_model.invoke([HumanMessage(s["note"])]).content})
    outer.add_edge(START, "team")
    outer.add_edge("reviewer", END)
    app = instrument(outer.compile())
    assert app.invoke({"task": "task-4"})["verdict"] == "ok: note on task-4"
    ep = app.last_episode
    assert [(a.agent, a.path, a.kind, a.status, a.handoff, a.error) for a in ep.actions] == [
        ("team", "team/lead", "llm", "ok", ["reviewer"], None),
        ("reviewer", "reviewer", "llm", "ok", None, None)]
    assert ep.actions[0].output_text == "note on task-4" and ep.status == "ok"


def _mailer(checkpointer: Any = None, interrupt_mode: str = "batched") -> Any:
    """A create_agent whose tool call a human approves first (HumanInTheLoopMiddleware pauses the run after the
    model, before the tool runs)."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import HumanInTheLoopMiddleware
    from langchain_core.messages import AIMessage
    from langchain_core.tools import tool

    from tests.capture.apps import call, number, seen
    from tests.fakes import ScriptedChatModel

    @tool
    def send_email(to: str) -> str:
        """Send an email."""
        return f"sent to {to}"

    def script(messages: list) -> AIMessage:
        sent = seen(messages, "send_email")
        return AIMessage(f"done: {sent.content}") if sent else call("send_email", {"to": f"bob-{number(messages)}"},
                                                                    f"e-{number(messages)}")

    return create_agent(ScriptedChatModel(script=script), [send_email], name="mailer", checkpointer=checkpointer,
                        middleware=[HumanInTheLoopMiddleware(interrupt_on={"send_email": True},
                                                                     interrupt_mode=interrupt_mode)])


def test_a_tool_call_a_human_approved_gets_its_result_when_the_thread_is_joined(tmp_path) -> None:
    from langgraph.checkpoint.memory import InMemorySaver

    from tests.capture.apps import message_input

    store = TraceStore(tmp_path / "t.db")
    app = instrument(_mailer(InMemorySaver()), store=store)
    cfg = {"configurable": {"thread_id": "mail"}}
    app.invoke(message_input(2), cfg)
    app.invoke(Command(resume={"decisions": [{"type": "approve"}]}), cfg)
    joined = store.join_thread("mail")
    asked = next(a for a in joined.actions if a.tool_calls)
    assert [(r.tool_call_id, r.output) for r in asked.tool_results] == [("e-2", "sent to bob-2")]
    assert [a for a in joined.actions if a.kind == "llm"][-1].output_text == "done: sent to bob-2"


def test_a_tool_call_a_human_rejected_gets_the_rejection_when_the_thread_is_joined(tmp_path) -> None:
    """The rejection is a ToolMessage the approval node adds on resume, no tool run: the model was told it."""
    from langgraph.checkpoint.memory import InMemorySaver

    from tests.capture.apps import message_input

    store = TraceStore(tmp_path / "t.db")
    app = instrument(_mailer(InMemorySaver()), store=store)
    cfg = {"configurable": {"thread_id": "mail"}}
    app.invoke(message_input(2), cfg)
    out = app.invoke(Command(resume={"decisions": [{"type": "reject", "message": "no emails today"}]}), cfg)
    told = out["messages"][2]
    assert told.status == "error" and "no emails today" in told.content
    joined = store.join_thread("mail")
    asked = next(a for a in joined.actions if a.tool_calls)
    assert [(r.tool_call_id, r.output, r.error) for r in asked.tool_results] == [("e-2", told.content, told.content)]
    assert "no emails today" in build_prompt(joined, asked).messages[1].content


@pytest.mark.parametrize("mode", ["batched", "per_call"])
def test_a_reviewers_edit_or_answer_is_on_the_record_as_what_happened_not_as_the_models_own_call(
        tmp_path, mode: str) -> None:
    """HumanInTheLoopMiddleware's "edit" runs another call than the model's (its message keeps the model's call);
    "respond" runs no tool and gives the human's text as its result. In "per_call" mode the decision is made in
    the tools task (a wrap_tool_call that paused), and the resumed task's answer once reached no action."""
    from langgraph.checkpoint.memory import InMemorySaver

    from tests.capture.apps import message_input

    store = TraceStore(tmp_path / "t.db")
    edit = {"type": "edit", "edited_action": {"name": "send_email", "args": {"to": "alice"}}}
    respond = {"type": "respond", "message": "I phoned bob myself"}
    for decision in (edit, respond):
        app = instrument(_mailer(InMemorySaver(), interrupt_mode=mode), store=store)
        cfg = {"configurable": {"thread_id": decision["type"]}}
        app.invoke(message_input(2), cfg)
        out = app.invoke(Command(resume=decision if mode == "per_call" else {"decisions": [decision]}), cfg)
        assert out["messages"][-1].content.startswith("done: ")
        asked = next(a for a in store.join_thread(decision["type"]).actions if a.tool_calls)
        assert [(c.name, c.args) for c in asked.tool_calls] == [("send_email", {"to": "bob-2"})]
        (result,) = asked.tool_results
        text = build_prompt(store.episodes(thread_id=decision["type"])[0], asked).messages[1].content
        feedback = text.split("### Tool feedback")[1]
        if decision is edit:
            assert result.output == "sent to alice" and result.given_by is None
            assert (result.ran_call.name, result.ran_call.args) == ("send_email", {"to": "alice"})
            assert 'changed before it ran: send_email({"to": "alice"})' in feedback
        else:
            assert (result.output, result.error, result.ran_call) == ("I phoned bob myself", None, None)
            assert result.given_by == "hitl_interrupt_decision:respond"
            assert "the tool did not run: a human reviewer answered in its place" in feedback


def test_a_call_a_middleware_answered_after_a_resume_gets_that_answer(tmp_path) -> None:
    """A wrap_tool_call that answers without running the tool, in a call resumed at a breakpoint before the
    tools node: create_agent's tools task gets the tool call itself, not a message that holds it."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import wrap_tool_call
    from langchain_core.messages import ToolMessage
    from langgraph.checkpoint.memory import InMemorySaver

    from tests.capture.apps import call, message_input, seen, search
    from tests.fakes import ScriptedChatModel

    @wrap_tool_call
    def policy(request: Any, handler: Any) -> ToolMessage:
        return ToolMessage("blocked by policy", tool_call_id=request.tool_call["id"], name="search", status="error")

    def script(messages: list) -> AIMessage:
        told = seen(messages, "search")
        return AIMessage(f"told: {told.content}") if told else call("search", {"query": "q"}, "s-1")

    store = TraceStore(tmp_path / "t.db")
    app = instrument(create_agent(ScriptedChatModel(script=script), [search], middleware=[policy],
                                  checkpointer=InMemorySaver(), interrupt_before=["tools"]), store=store)
    cfg = {"configurable": {"thread_id": "policy"}}
    app.invoke(message_input(1), cfg)
    assert app.invoke(None, cfg)["messages"][-1].content == "told: blocked by policy"
    asked = next(a for a in store.join_thread("policy").actions if a.tool_calls)
    assert [(r.output, r.error, r.given_by) for r in asked.tool_results] == [
        ("blocked by policy", "blocked by policy", "node")]


def test_a_model_call_a_middleware_retried_or_fell_back_from_is_a_failed_call_and_the_next_says_so() -> None:
    """ModelRetryMiddleware and ModelFallbackMiddleware call a model again inside one model-node task: the
    failed call is failed, the one made in its place says whose place it took, and the judge reads both so."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import ModelFallbackMiddleware, ModelRetryMiddleware

    from tests.capture.apps import message_input
    from tests.fakes import ScriptedChatModel

    def fails_first() -> Any:
        calls = []

        def script(messages: list) -> AIMessage:
            calls.append(1)
            if len(calls) == 1:
                raise TimeoutError("provider timed out")
            return AIMessage("4")
        return script

    def down(messages: list) -> AIMessage:
        raise ConnectionError("primary down")

    backup = ScriptedChatModel(script=lambda messages: AIMessage("4"))
    retry = ModelRetryMiddleware(max_retries=2, initial_delay=0)
    for middleware, model in ((retry, ScriptedChatModel(script=fails_first())),
                              (ModelFallbackMiddleware(backup), ScriptedChatModel(script=down))):
        app = instrument(create_agent(model, [], middleware=[middleware]))
        out, episode = app.run_episode(message_input(1))
        assert out["messages"][-1].content == "4"
        failed, replaced = episode.actions
        assert (failed.status, failed.retry_of, replaced.status, replaced.retry_of) == ("error", None, "ok", failed.id)
        assert not failed.trainable
        said = build_prompt(episode, failed).messages[1].content
        assert "a model was called again in its place" in said.split("### Tool feedback")[1]
        role = build_prompt(episode, replaced).messages[1].content.split("### The agent's role")[1].split("###")[0]
        assert f"made in place of a failed model call (#{failed.index}: {failed.error})" in role

    # a node that goes on after a failed best-effort call to ask another question is not retrying it
    from langchain_core.messages import HumanMessage
    from langgraph.graph import START, MessagesState, StateGraph

    def moderate_then_write(state: dict) -> dict:
        try:
            ScriptedChatModel(script=down).invoke([HumanMessage("is this ok?")])
        except ConnectionError:
            pass
        return {"messages": [backup.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("writer", moderate_then_write)
    graph.add_edge(START, "writer")
    _, episode = instrument(graph.compile()).run_episode(message_input(1))
    assert [(a.status, a.retry_of) for a in episode.actions] == [("error", None), ("ok", None)]


def _cached_team() -> Any:
    """A node with a CachePolicy on a graph compiled with a cache, then a node without one; and the functional
    API's cached `@task`s called by an entrypoint: on a cache hit LangGraph applies the node's stored writes
    and never runs it."""
    from langchain_core.messages import AIMessage
    from langgraph.cache.memory import InMemoryCache
    from langgraph.func import entrypoint, task
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.types import CachePolicy

    from tests.fakes import ScriptedChatModel

    model = ScriptedChatModel(script=lambda messages: AIMessage(f"answer to {messages[-1].content}"))
    graph = StateGraph(MessagesState)
    graph.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]},
                   cache_policy=CachePolicy(key_func=lambda state: repr([m.content for m in state["messages"]])))
    graph.add_node("post", lambda state: {"messages": [AIMessage("posted")]})
    graph.add_edge(START, "agent")
    graph.add_edge("agent", "post")

    @task(cache_policy=CachePolicy())
    def ask(question: str) -> str:
        return model.invoke(question).content

    @entrypoint(cache=InMemoryCache())
    def workflow(question: str) -> list[str]:
        return [ask(question).result(), ask(question + "?").result()]

    return graph.compile(cache=InMemoryCache()), workflow


@pytest.mark.parametrize("style", ["invoke", "stream_updates", "ainvoke", "astream", "batch"])
def test_a_node_a_cache_answered_is_on_the_record_as_answered_from_cache(style: str) -> None:
    from tests.capture.apps import message_input

    for which, make_input in ((0, message_input), (1, lambda n: f"task-{n}")):
        app = instrument(_cached_team()[which])
        first = run_style(app, "cached", style, [1], make_input=make_input)
        again = run_style(app, "cached", style, [1], make_input=make_input)
        plain = _cached_team()[which]
        assert [first, again] == [run_style(plain, "cached", style, [1], make_input=make_input) for _ in "12"]
        app.flush()
        missed, hit = app.episodes
        if which == 0:
            assert [(a.path, a.kind, a.cached) for a in missed.actions] == [
                ("agent", "llm", False), ("post", "node", False)]
            assert [(a.path, a.kind, a.cached) for a in hit.actions] == [("agent", "node", True), ("post", "node", False)]
            assert hit.actions[0].node_output["messages"][0]["content"] == "answer to solve task-1"
            text = build_prompt(hit, hit.actions[1]).messages[1].content
            assert "#0 agent (node agent, answered from the cache: it did not run)" in text
        else:
            assert [(a.path, a.kind, a.cached, a.node_output) for a in hit.actions] == [
                ("workflow/ask", "node", True, "answer to task-1"), ("workflow/ask", "node", True, "answer to task-1?")]


def test_a_cached_graph_still_sees_what_is_set_on_it_later_and_two_equal_sends_are_one_hit_and_one_run() -> None:
    from langgraph.cache.memory import InMemoryCache
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import START, StateGraph
    from langgraph.types import CachePolicy, Send

    ran = []

    def work(state: dict) -> dict:
        ran.append(state["out"])
        return {"out": ["done"]}

    graph = StateGraph(Form)
    graph.add_node("work", work, cache_policy=CachePolicy())
    graph.add_conditional_edges(START, lambda state: [Send("work", {"out": ["x"]})] * 2, ["work"])
    compiled = graph.compile(cache=InMemoryCache())
    app = instrument(compiled)
    assert app.cache is compiled.cache
    compiled.checkpointer = InMemorySaver()  # wiring done after compile (and after instrument)
    cfg = {"configurable": {"thread_id": "t"}}
    app.invoke({"out": []}, cfg)
    assert app.get_state(cfg).values["out"] == ["done", "done"]
    ran.clear()
    app.invoke({"out": []}, {"configurable": {"thread_id": "u"}})
    assert len(ran) == 1  # LangGraph answers one of the two equal tasks from the cache and runs the other
    assert sorted(a.cached for a in app.last_episode.actions) == [False, True]


def test_a_subagent_tool_that_paused_gives_its_result_to_the_call_that_asked(tmp_path) -> None:
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langgraph.checkpoint.memory import InMemorySaver

    from tests.capture.apps import message_input, number
    from tests.fakes import ScriptedChatModel

    mailer = _mailer()

    @tool
    def ask_mailer(request: str) -> str:
        """Ask the mail subagent."""
        return "mailer: " + mailer.invoke({"messages": [HumanMessage(request)]})["messages"][-1].content

    def orchestrate(messages: list) -> AIMessage:
        done = [m.content for m in messages if isinstance(m, ToolMessage)]
        return AIMessage(f"final {done[0]}") if done else AIMessage("", tool_calls=[
            {"name": "ask_mailer", "args": {"request": f"mail task-{number(messages)}"}, "id": "m-1"}])

    store = TraceStore(tmp_path / "t.db")
    app = instrument(create_agent(ScriptedChatModel(script=orchestrate), [ask_mailer], checkpointer=InMemorySaver()),
                     store=store)
    cfg = {"configurable": {"thread_id": "orch"}}
    app.invoke(message_input(3), cfg)
    app.invoke(Command(resume={"decisions": [{"type": "approve"}]}), cfg)
    joined = store.join_thread("orch")
    asked = joined.actions[0]
    assert (asked.agent, asked.tool_calls[0].name) == ("model", "ask_mailer")
    assert [r.output for r in asked.tool_results] == ["", "mailer: done: sent to bob-3"]  # paused, then resumed
    assert asked.tool_results[0].interrupt is not None
    assert [a for a in joined.actions if a.kind == "llm"][-1].output_text == "final mailer: done: sent to bob-3"
    assert {a.agent for a in joined.actions if a.path and "/" in a.path} == {"ask_mailer"}


def test_join_refuses_a_thread_that_time_travel_forked_and_joins_one_branch(tmp_path) -> None:
    store = TraceStore(tmp_path / "t.db")
    app = instrument(interrupt_app(), store=store)
    cfg = {"configurable": {"thread_id": "fork"}}
    app.invoke(task_input(5), cfg)
    paused_at = app.get_state(cfg).config
    app.invoke(Command(resume="yes"), cfg)
    app.invoke(Command(resume="yes"), paused_at)  # resume again from the paused checkpoint: a second branch
    paused, first, second = sorted(store.episodes(thread_id="fork"), key=lambda e: e.started_at)
    assert first.metadata["start_checkpoint_id"] == second.metadata["start_checkpoint_id"]
    with pytest.raises(ValueError, match=f"episode {second.id} starts from checkpoint .* forked this thread"):
        store.join_thread("fork")
    joined = store.join_thread("fork", episode_ids=[paused.id, second.id])
    assert joined.metadata["joined_episode_ids"] == [paused.id, second.id]
    assert [(a.node, a.status) for a in joined.actions] == [("write", "ok"), ("review", "interrupted"), ("review", "ok")]
    assert sorted(e.id for e in store.episodes(thread_id="fork")) == sorted([joined.id, first.id])


class Form(TypedDict):
    out: Annotated[list, operator.add]


def test_a_thread_whose_resume_pauses_again_joins_and_a_later_fork_is_still_refused(tmp_path) -> None:
    """A resume that pauses again (a node asks interrupt() twice, or parallel interrupts are answered one at a
    time) writes no checkpoint of its own: the next resume starts where it started. That is the thread going on,
    not a fork; a resume from there after the thread went past it is."""
    from langgraph.graph import END, START, StateGraph

    def ask_twice(state: Form) -> dict:
        return {"out": [f"{interrupt('name?')} is {interrupt('age?')}"]}

    def ask(question: str) -> Any:
        return lambda state: {"out": [f"{question}={interrupt(question)}"]}

    twice = StateGraph(Form)
    twice.add_node("form", ask_twice)
    twice.add_edge(START, "form")
    parallel = StateGraph(Form)
    for name in ("a", "b"):
        parallel.add_node(name, ask(name))
        parallel.add_edge(START, name)
        parallel.add_edge(name, END)
    for graph, answers in ((twice, lambda pending: "ann" if not pending else "42"),
                           (parallel, None)):
        store = TraceStore(tmp_path / f"{len(graph.nodes)}.db")
        app = instrument(graph.compile(checkpointer=InMemorySaver()), store=store)
        cfg = {"configurable": {"thread_id": "t"}}
        pending = app.invoke({"out": []}, cfg)["__interrupt__"]
        answered: list[str] = []
        while pending:
            value = answers(answered) if answers else {pending[0].id: "yes"}
            answered.append(str(value))
            paused_at = app.get_state(cfg).config
            pending = app.invoke(Command(resume=value), cfg).get("__interrupt__")
        final = app.get_state(cfg).values["out"]
        assert final == (["ann is 42"] if graph is twice else ["a=yes", "b=yes"])
        parts = store.episodes(thread_id="t")
        assert [p.status for p in parts] == ["interrupted", "interrupted", "ok"]
        assert parts[1].metadata["start_checkpoint_id"] == parts[1].metadata["end_checkpoint_id"]
        app.invoke(Command(resume="again"), paused_at)  # back to the last pause after the thread went past it
        with pytest.raises(ValueError, match="forked this thread"):
            store.join_thread("t")
        joined = store.join_thread("t", episode_ids=[p.id for p in parts])
        assert joined.status == "ok" and joined.metadata["joined_episode_ids"] == [p.id for p in parts]
        assert joined.final_state["out"] == final


def test_a_worker_that_fails_for_good_keeps_what_it_finished_and_a_retried_one_does_not() -> None:
    from langchain_core.tools import tool
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode

    from tests.capture.apps import call, message_input, number, react_agent

    @tool
    def fetch(query: str) -> str:
        """Fetch a page."""
        raise ConnectionError("network down")

    def build(retry: Any) -> Any:
        worker = react_agent("researcher", lambda m: call("fetch", {"query": "q"}, f"f-{number(m)}"),
                             ToolNode([fetch], handle_tool_errors=False))
        team = StateGraph(MessagesState)
        team.add_node("researcher", worker, retry_policy=retry)
        team.add_edge(START, "researcher")
        return instrument(team.compile())

    from langgraph.types import RetryPolicy

    for retry, statuses in ((None, ["ok", "error"]),
                            (RetryPolicy(max_attempts=2, initial_interval=0.0, jitter=False,
                                         retry_on=ConnectionError), ["error", "error", "ok", "error"])):
        app = build(retry)
        with pytest.raises(ConnectionError):
            app.invoke(message_input(1))
        episode = app.last_episode
        assert [(a.path, a.status) for a in episode.actions] == list(zip(
            ["researcher/agent", "researcher/tools"] * len(statuses), statuses)), retry
        assert episode.status == "error"


def test_a_subagent_tool_stays_under_the_task_that_ran_it_and_after_the_call_that_asked() -> None:
    """Two shapes that once put a subagent's calls elsewhere: a node whose own loop asks a model and runs the
    tool itself (the subagent sorted before the asking call), and a subagent invoked with a config of its own
    (its own thread_id restarts LangGraph's namespace: it was taken for the orchestrator's `model`)."""
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import START, MessagesState, StateGraph

    from tests.capture.apps import message_input
    from tests.fakes import ScriptedChatModel

    expert = create_agent(ScriptedChatModel(script=lambda m: AIMessage(f"expert on {m[-1].content}")), [],
                          checkpointer=InMemorySaver())

    @tool
    def ask_expert(question: str) -> str:
        """Ask the expert subagent (it keeps its own memory thread)."""
        reply = expert.invoke({"messages": [HumanMessage(question)]}, {"configurable": {"thread_id": "expert"}})
        return reply["messages"][-1].content

    def ask_then_answer(messages: list) -> AIMessage:
        if any(isinstance(m, ToolMessage) for m in messages):
            return AIMessage("final: " + messages[-1].content)
        return AIMessage("", tool_calls=[{"name": "ask_expert", "args": {"question": "why"}, "id": "x1"}])

    planner = ScriptedChatModel(script=ask_then_answer)

    def agent(state: dict) -> dict:  # a hand-written tool loop inside one node
        messages = list(state["messages"])
        asked = planner.invoke(messages)
        messages += [asked, *(ask_expert.invoke(call) for call in asked.tool_calls)]
        return {"messages": [planner.invoke(messages)]}

    loop = StateGraph(MessagesState)
    loop.add_node("agent", agent)
    loop.add_edge(START, "agent")
    for app in (instrument(loop.compile()), instrument(create_agent(planner, [ask_expert]))):
        app.invoke(message_input(1))
        node = app.last_episode.actions[0].path
        assert [(a.agent, a.path, a.output_text) for a in app.last_episode.actions if a.kind == "llm"] == [
            (node, node, ""), ("ask_expert", f"{'agent' if node == 'agent' else 'tools'}/ask_expert/model",
                               "expert on why"), (node, node, "final: expert on why")]


def test_a_thread_edited_between_pause_and_resume_joins(tmp_path) -> None:
    store = TraceStore(tmp_path / "t.db")
    app = instrument(interrupt_app(), store=store)
    cfg = {"configurable": {"thread_id": "edit"}}
    app.invoke(task_input(6), cfg)
    app.update_state(cfg, {"draft": "edited by a human"})  # a checkpoint of its own between the two calls
    app.invoke(Command(resume="yes"), cfg)
    joined = store.join_thread("edit")
    assert joined.final_state["published"] == "yes: edited by a human"
    assert [(a.node, a.status) for a in joined.actions] == [("write", "ok"), ("review", "interrupted"), ("review", "ok")]


def test_a_tool_that_pauses_asking_nothing_is_still_a_pause() -> None:
    from langchain_core.messages import AIMessage
    from langchain_core.tools import tool
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import START, MessagesState, StateGraph

    from mappa_graph.capture.store import join_episodes
    from tests.capture.apps import call, message_input, react_agent, seen

    @tool
    def send(to: str) -> str:
        """Send once someone says go."""
        interrupt(None)
        return f"sent to {to}"

    def script(messages: list) -> AIMessage:
        done = seen(messages, "send")
        return AIMessage(f"done: {done.content}") if done else call("send", {"to": "bob"}, "e1")

    team = StateGraph(MessagesState)
    team.add_node("mailer", react_agent("mailer", script, [send]))
    team.add_edge(START, "mailer")
    app = instrument(team.compile(checkpointer=InMemorySaver()))
    cfg = {"configurable": {"thread_id": "none"}}
    app.invoke(message_input(1), cfg)
    app.invoke(Command(resume="go"), cfg)
    paused, resumed = app.episodes
    assert [(r.paused, r.interrupt) for r in paused.actions[0].tool_results] == [(True, None)]
    assert "paused in interrupt() for human input" in build_prompt(paused, paused.actions[0]).messages[1].content
    asked = join_episodes([paused, resumed]).actions[0]
    assert [(r.paused, r.output) for r in asked.tool_results] == [(True, ""), (False, "sent to bob")]


def test_a_model_called_with_its_own_callbacks_is_recorded_and_its_handler_still_sees_it() -> None:
    from tests.capture.apps import own_callbacks_app

    graph = own_callbacks_app()
    app = instrument(graph)
    app.invoke({"task": "task-3"})
    assert graph.handler.model_calls == 2  # the user's tracer keeps its calls (write, edit)
    [episode] = app.episodes
    assert [(a.node, a.kind) for a in episode.actions] == [("write", "llm"), ("agent", "llm"), ("edit", "llm")]
    assert episode.actions[0].input_messages[-1]["content"] == "task-3"


def test_model_calls_a_stream_consumer_makes_between_chunks_are_not_the_calls() -> None:
    from langchain_core.messages import AIMessage

    from tests.capture.apps import own_callbacks_app
    from tests.fakes import ScriptedChatModel

    app = instrument(own_callbacks_app())
    aside = ScriptedChatModel(script=lambda m: AIMessage("aside"))
    for _ in app.stream({"task": "task-4"}):
        aside.invoke("what is going on?", config={"callbacks": []})
        aside.invoke("and now?")
    [episode] = app.episodes
    assert [a.output_text for a in episode.actions] == [
        "draft for task-4", "review of draft for task-4", "edited review of draft for task-4"]
    aside.invoke("after the call")
    assert len(app.episodes) == 1


def test_parallel_handoffs_record_what_the_supervisor_was_told() -> None:
    """create_supervisor(parallel_tool_calls=True) sends each worker its handoff's ToolMessage in a Send's state
    rather than in the Command's update: the supervisor's tool results read "Command(goto=['researcher'])"
    instead of the "Successfully transferred" text it was told. Found by review."""
    from langchain_core.messages import AIMessage, ToolMessage
    from langgraph.prebuilt import create_react_agent
    from langgraph_supervisor import create_supervisor

    from tests.fakes import ScriptedChatModel

    def both(messages: list[BaseMessage]) -> AIMessage:
        if any(isinstance(m, AIMessage) and m.name in ("researcher", "math_expert") for m in messages):
            return AIMessage("done")
        return AIMessage("", tool_calls=[{"name": "transfer_to_researcher", "args": {}, "id": "h1"},
                                         {"name": "transfer_to_math_expert", "args": {}, "id": "h2"}])

    workers = [create_react_agent(ScriptedChatModel(script=lambda m: AIMessage(f"{name} done")), [], name=name)
               for name in ("researcher", "math_expert")]
    app = instrument(create_supervisor(workers, model=ScriptedChatModel(script=both),
                                       parallel_tool_calls=True).compile())
    out = app.invoke(task_input(1), {"recursion_limit": 20})
    told = {m.tool_call_id: m.content for m in out["messages"] if isinstance(m, ToolMessage)}
    first = app.last_episode.actions[0]
    assert first.agent == "supervisor" and [r.tool_call_id for r in first.tool_results] == ["h1", "h2"]
    assert [r.output for r in first.tool_results if r.tool_call_id in told] == [
        told[r.tool_call_id] for r in first.tool_results if r.tool_call_id in told]
    assert all(r.output.startswith("Successfully transferred") for r in first.tool_results), first.tool_results


class _AsyncOnlySaver(InMemorySaver):
    """An InMemorySaver whose sync reads refuse to run on the event loop's thread, as langgraph's
    AsyncSqliteSaver and AsyncPostgresSaver do."""

    def get_tuple(self, config):  # type: ignore[override]
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return super().get_tuple(config)
        raise asyncio.InvalidStateError("Synchronous calls are only allowed from a different thread")

    async def aget_tuple(self, config):  # type: ignore[override]
        return InMemorySaver.get_tuple(self, config)


def _search_once(messages: list[BaseMessage]) -> AIMessage:
    """A worker that searches, then answers with what it found."""
    found = apps.seen(messages, "search")
    return AIMessage(f"found {found.content}") if found else apps.call("search", {"query": "q"}, "s-1")


def test_a_breakpoint_inside_a_worker_or_subgraph_is_a_paused_episode() -> None:
    """A static breakpoint of a subgraph (a supervisor's create_react_agent worker compiled with
    `interrupt_before=["tools"]`, a subgraph node compiled with `interrupt_after=`) pauses the whole run, as
    the parent's own breakpoint does: its episode ended 'ok' with nothing to say where it stopped."""
    from typing import TypedDict

    from langgraph.graph import START, StateGraph
    from langgraph.prebuilt import create_react_agent
    from langgraph_supervisor import create_supervisor

    from tests.fakes import ScriptedChatModel

    def supervisor(messages):
        if apps.seen(messages, "transfer_to_researcher"):
            return AIMessage("done")
        return apps.call("transfer_to_researcher", {}, "h-1")

    def team():
        worker = create_react_agent(ScriptedChatModel(script=_search_once), [apps.search], name="researcher",
                                    interrupt_before=["tools"])
        return create_supervisor([worker], model=ScriptedChatModel(script=supervisor)).compile(checkpointer=InMemorySaver())

    class State(TypedDict):
        x: int

    def nested():
        inner = StateGraph(State)
        inner.add_node("a", lambda state: {"x": state["x"] + 1})
        inner.add_node("b", lambda state: {"x": state["x"] * 10})
        inner.add_edge(START, "a")
        inner.add_edge("a", "b")
        outer = StateGraph(State)
        outer.add_node("sub", inner.compile(interrupt_after=["a"]))
        outer.add_edge(START, "sub")
        return outer.compile(checkpointer=InMemorySaver())

    for build, first, paused_node in ((team, apps.message_input(1), "researcher"), (nested, {"x": 1}, "sub")):
        plain, app = build(), instrument(build())
        config = {"configurable": {"thread_id": "t"}}
        assert norm(app.invoke(first, config)) == norm(plain.invoke(first, config))
        assert plain.get_state(config).next == (paused_node,)
        paused = app.last_episode
        assert (paused.status, paused.metadata.get("paused_before")) == ("interrupted", [paused_node]), build
        assert norm(app.invoke(None, config)) == norm(plain.invoke(None, config))
        done = app.last_episode
        assert (done.status, "paused_before" in done.metadata) == ("ok", False), build


@pytest.mark.parametrize("style", ["ainvoke", "astream", "abatch"])
def test_an_async_only_checkpointer_still_gives_a_paused_episode_its_breakpoint_and_checkpoints(style: str) -> None:
    """Under ainvoke/astream on a saver that reads only asynchronously, the episode of a call that stopped at a
    breakpoint said 'ok', with no paused_before and no checkpoint ids: the sync reads were refused."""
    from langgraph.prebuilt import create_react_agent

    from tests.fakes import ScriptedChatModel

    app = instrument(create_react_agent(ScriptedChatModel(script=_search_once), [apps.search],
                                        interrupt_before=["tools"], checkpointer=_AsyncOnlySaver()))
    config = {"configurable": {"thread_id": "t"}}

    async def call(value: Any) -> Any:
        if style == "astream":
            return [chunk async for chunk in app.astream(value, config)]
        if style == "abatch":
            return await app.abatch([value], config)
        return await app.ainvoke(value, config)

    async def main() -> list[Any]:
        checkpoints = []
        await call(apps.message_input(1))
        checkpoints.append((await app.aget_state(config)).config["configurable"]["checkpoint_id"])
        await call(None)
        checkpoints.append((await app.aget_state(config)).config["configurable"]["checkpoint_id"])
        return checkpoints

    paused_at, done_at = asyncio.run(main())
    paused, done = app.episodes
    assert (paused.status, paused.metadata.get("paused_before"), paused.metadata.get("end_checkpoint_id")) == (
        "interrupted", ["tools"], paused_at)
    assert (done.status, "paused_before" in done.metadata) == ("ok", False)
    assert (done.metadata.get("start_checkpoint_id"), done.metadata.get("end_checkpoint_id")) == (paused_at, done_at)


def test_a_node_that_removes_messages_says_which_it_removed() -> None:
    """RemoveMessage is nothing but the id of what it removes (or REMOVE_ALL_MESSAGES): kept, with the message
    it removed from the node's input, so the judge can tell a trim from a reset."""
    from langchain_core.messages import HumanMessage, RemoveMessage
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.graph.message import REMOVE_ALL_MESSAGES

    graph = StateGraph(MessagesState)
    graph.add_node("trim", lambda state: {"messages": [RemoveMessage(id=state["messages"][0].id)]})
    graph.add_node("reset", lambda state: {"messages": [RemoveMessage(id=REMOVE_ALL_MESSAGES),
                                                        HumanMessage("summary: two", id="s")]})
    graph.add_edge(START, "trim")
    graph.add_edge("trim", "reset")
    app = instrument(graph.compile())
    out, episode = app.run_episode({"messages": [HumanMessage("one", id="m1"), HumanMessage("two", id="m2")]})
    assert [m.content for m in out["messages"]] == ["summary: two"]
    trim, reset = (a.node_output["messages"] for a in episode.actions)
    assert trim == [{"role": "remove", "content": "", "id": "m1", "removes": {"role": "user", "content": "one"}}]
    assert reset[0] == {"role": "remove", "content": "", "id": REMOVE_ALL_MESSAGES, "removes": "all messages"}


def test_a_command_that_sends_keeps_what_it_sent() -> None:
    """Command(goto=[Send(node, arg)]) hands each target its own input: the record keeps it beside the targets."""
    from langgraph.graph import START, StateGraph
    from langgraph.types import Send

    graph = StateGraph(Form)
    graph.add_node("plan", lambda state: Command(goto=[Send("work", {"out": [f"part {i}"]}) for i in (1, 2)]))
    graph.add_node("work", lambda state: {"out": [f"did {state['out'][-1]}"]})
    graph.add_edge(START, "plan")
    out, episode = instrument(graph.compile()).run_episode({"out": []})
    assert out["out"] == ["did part 1", "did part 2"]
    plan = episode.actions[0]
    assert plan.handoff == ["work", "work"]
    assert plan.node_output == {"command": {"goto": ["work", "work"], "sends": [
        {"node": "work", "arg": {"out": ["part 1"]}}, {"node": "work", "arg": {"out": ["part 2"]}}]}}


def test_parallel_branches_whose_models_reuse_a_call_id_each_get_their_own_results() -> None:
    """Local providers and fakes number tool calls from zero in every reply (`call_0`): two branches' models
    ask with one id, and each tool task, given its own model's reply, belongs to that model call."""
    import time

    from langchain_core.messages import HumanMessage
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode
    from langgraph.types import Send

    from tests.capture.apps import call, search
    from tests.fakes import ScriptedChatModel

    model = ScriptedChatModel(script=lambda messages: call("search", {"query": messages[-1].content}, "call_0"))

    def ask(state: dict) -> Command:
        reply = model.invoke([HumanMessage(state["messages"][-1].content)])
        if reply.tool_calls[0]["args"]["query"] == "cats":
            time.sleep(0.1)  # the other branch's model replies later but its tool runs first
        return Command(goto=[Send("tools", {"messages": [reply]})])

    graph = StateGraph(MessagesState)
    graph.add_node("ask", ask)
    graph.add_node("tools", ToolNode([search]))
    graph.add_conditional_edges(START, lambda state: [Send("ask", {"messages": [HumanMessage(topic)]})
                                                      for topic in ("cats", "dogs")], ["ask"])
    _, episode = instrument(graph.compile()).run_episode({"messages": []})
    asked = [a for a in episode.actions if a.kind == "llm"]
    assert [([c.args["query"] for c in a.tool_calls], [(r.output, r.ran_call) for r in a.tool_results])
            for a in asked] == [(["cats"], [(search.invoke("cats"), None)]), (["dogs"], [(search.invoke("dogs"), None)])]
