"""Multi-agent apps built the way LangGraph users build them, with the real constructors: `create_supervisor`
(langgraph-supervisor), `create_swarm` and its handoff tool (langgraph-swarm), `create_react_agent`
(langgraph.prebuilt), a subgraph node fed by `Send` with `with_structured_output` inside a node, a node with a
RetryPolicy that fails once, and `interrupt()` on an InMemorySaver thread.

Every model is tests.fakes.ScriptedChatModel: its reply is a pure function of the prompt (the task number and
which tool results it has seen), never a shared iterator, so batch and parallel branches stay reproducible.
Each factory returns a fresh compiled graph; `EXPECTED[name](n)` is the (agent, path, kind, what it did) list
the instrumented graph must record for task n.
"""

from __future__ import annotations

import operator
import re
import warnings
from collections.abc import Callable
from typing import Annotated, Any, TypedDict

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import RetryPolicy, Send, interrupt
from pydantic import BaseModel

from tests.fakes import ScriptedChatModel

with warnings.catch_warnings():  # create_react_agent moved to langchain.agents in LangGraph 1.0; still the prebuilt
    warnings.simplefilter("ignore")
    from langgraph.prebuilt import create_react_agent
from langgraph_supervisor import create_supervisor
from langgraph_swarm import SwarmState, create_handoff_tool, create_swarm


def number(messages: list[BaseMessage]) -> int:
    for m in messages:
        found = re.search(r"task-(\d+)", str(m.content))
        if found:
            return int(found.group(1))
    raise AssertionError("no task-N in the prompt")


def seen(messages: list[BaseMessage], tool_name: str) -> ToolMessage | None:
    return next((m for m in reversed(messages) if isinstance(m, ToolMessage) and m.name == tool_name), None)


def call(name: str, args: dict[str, Any], call_id: str) -> AIMessage:
    return AIMessage(content="", tool_calls=[{"name": name, "args": args, "id": call_id}])


@tool
def search(query: str) -> str:
    """Search the web."""
    return f"facts about {query}"


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def react_agent(name: str, script: Callable[[list[BaseMessage]], AIMessage], tools: list[Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return create_react_agent(ScriptedChatModel(script=script), tools, name=name)


# ---- supervisor over two react agents ---------------------------------------------------------------------
def researcher_script(messages: list[BaseMessage]) -> AIMessage:
    n, found = number(messages), seen(messages, "search")
    return AIMessage(f"research: {found.content}") if found else call("search", {"query": f"task-{n}"}, f"s-{n}")


def math_script(messages: list[BaseMessage]) -> AIMessage:
    n, found = number(messages), seen(messages, "add")
    return AIMessage(f"sum: {found.content}") if found else call("add", {"a": n, "b": 1}, f"a-{n}")


def supervisor_script(messages: list[BaseMessage]) -> AIMessage:
    n = number(messages)
    if not seen(messages, "transfer_to_researcher"):
        return call("transfer_to_researcher", {}, f"h-r-{n}")
    if not seen(messages, "transfer_to_math_expert"):
        return call("transfer_to_math_expert", {}, f"h-m-{n}")
    return AIMessage(f"done task-{n}")


def supervisor_app(supervisor_model: Any = None, workers: list[Any] | None = None) -> Any:
    workers = workers or [react_agent("researcher", researcher_script, [search]),
                          react_agent("math_expert", math_script, [add])]
    model = supervisor_model or ScriptedChatModel(script=supervisor_script)
    return create_supervisor(workers, model=model, prompt="You route the task.").compile()


def supervisor_expected(n: int) -> list[tuple]:
    return [
        ("supervisor", "supervisor/agent", "llm", "", ["transfer_to_researcher"]),
        ("supervisor", "supervisor/tools", "node", "handoff:researcher", []),
        ("researcher", "researcher/agent", "llm", "", ["search"]),
        ("researcher", "researcher/tools", "node", "", []),
        ("researcher", "researcher/agent", "llm", f"research: facts about task-{n}", []),
        ("supervisor", "supervisor/agent", "llm", "", ["transfer_to_math_expert"]),
        ("supervisor", "supervisor/tools", "node", "handoff:math_expert", []),
        ("math_expert", "math_expert/agent", "llm", "", ["add"]),
        ("math_expert", "math_expert/tools", "node", "", []),
        ("math_expert", "math_expert/agent", "llm", f"sum: {n + 1}", []),
        ("supervisor", "supervisor/agent", "llm", f"done task-{n}", []),
    ]


# ---- swarm: alice adds, then hands off to bob ---------------------------------------------------------------
def alice_script(messages: list[BaseMessage]) -> AIMessage:
    n = number(messages)
    if not seen(messages, "add"):
        return call("add", {"a": n, "b": 2}, f"a-{n}")
    return call("transfer_to_bob", {}, f"h-b-{n}")


def bob_script(messages: list[BaseMessage]) -> AIMessage:
    n = number(messages)
    return AIMessage(f"bob: task-{n} is {seen(messages, 'add').content}")


def swarm_app() -> Any:
    alice = react_agent("alice", alice_script, [add, create_handoff_tool(agent_name="bob")])
    bob = react_agent("bob", bob_script, [create_handoff_tool(agent_name="alice")])
    return create_swarm([alice, bob], default_active_agent="alice", state_schema=SwarmState).compile()


def swarm_expected(n: int) -> list[tuple]:
    return [
        ("alice", "alice/agent", "llm", "", ["add"]),
        ("alice", "alice/tools", "node", "", []),
        ("alice", "alice/agent", "llm", "", ["transfer_to_bob"]),
        ("alice", "alice/tools", "node", "handoff:bob", []),
        ("bob", "bob/agent", "llm", f"bob: task-{n} is {n + 2}", []),
    ]


# ---- a structured-output planner, Send fan-out to a subgraph node, a writer ---------------------------------
class Plan(BaseModel):
    parts: list[str]


class TeamState(TypedDict, total=False):
    task: str
    parts: list[str]
    drafts: Annotated[list[str], operator.add]
    report: str


class PartState(TypedDict, total=False):
    part: str
    drafts: Annotated[list[str], operator.add]


def planner_script(messages: list[BaseMessage]) -> AIMessage:
    n = number(messages)
    return call("Plan", {"parts": [f"task-{n}.a", f"task-{n}.b", f"task-{n}.c"]}, f"p-{n}")


def fanout_app() -> Any:
    planner = ScriptedChatModel(script=planner_script).with_structured_output(Plan)
    drafter = ScriptedChatModel(script=lambda m: AIMessage(f"draft of {m[-1].content}"))
    writer = ScriptedChatModel(script=lambda m: AIMessage(f"report on task-{number(m)}: {m[-1].content}"))

    def draft(state: PartState) -> dict:
        return {"drafts": [drafter.invoke([HumanMessage(state["part"])]).content]}

    def check(state: PartState) -> dict:
        return {}

    part = StateGraph(PartState)
    part.add_node("draft", draft)
    part.add_node("check", check)
    part.add_edge(START, "draft")
    part.add_edge("draft", "check")
    part.add_edge("check", END)

    def plan(state: TeamState) -> dict:
        return {"parts": planner.invoke([HumanMessage(f"plan {state['task']}")]).parts}

    def write(state: TeamState) -> dict:
        drafts = " | ".join(state["drafts"])
        return {"report": writer.invoke([HumanMessage(state["task"]), HumanMessage(drafts)]).content}

    team = StateGraph(TeamState)
    team.add_node("plan", plan)
    team.add_node("part", part.compile())
    team.add_node("write", write)
    team.add_edge(START, "plan")
    team.add_conditional_edges("plan", lambda s: [Send("part", {"part": p}) for p in s["parts"]], ["part"])
    team.add_edge("part", "write")
    team.add_edge("write", END)
    return team.compile()


def fanout_expected(n: int) -> list[tuple]:
    parts = [f"task-{n}.{x}" for x in "abc"]
    drafts = " | ".join(f"draft of {p}" for p in parts)
    return [
        ("plan", "plan", "llm", "", ["Plan"]),
        *[row for p in parts for row in (("part", "part/draft", "llm", f"draft of {p}", []),
                                         ("part", "part/check", "node", "", []))],
        ("write", "write", "llm", f"report on task-{n}: {drafts}", []),
    ]


# ---- a node with a RetryPolicy that fails once ---------------------------------------------------------------
class Flaky(Exception):
    """A transient failure LangGraph's default retry_on retries."""


def fail_once(failed: set[str], task: str, message: str) -> None:
    """Raise Flaky on a task's first attempt only (per task, so batch and parallel calls each fail once)."""
    if task not in failed:
        failed.add(task)
        raise Flaky(message)


def then_retried(state: type, first: tuple[str, Callable], retried: tuple[str, Callable], *, attempts: int) -> Any:
    """START -> first -> retried -> END, `retried` under a RetryPolicy of `attempts` that does not wait."""
    graph = StateGraph(state)
    graph.add_node(*first)
    graph.add_node(*retried, retry_policy=RetryPolicy(max_attempts=attempts, initial_interval=0.0, jitter=False))
    graph.add_edge(START, first[0])
    graph.add_edge(first[0], retried[0])
    graph.add_edge(retried[0], END)
    return graph.compile()


class DocState(TypedDict, total=False):
    task: str
    draft: str
    published: str


def retry_app() -> Any:
    failed: set[str] = set()  # per task, so batch and parallel calls each fail exactly once
    writer = ScriptedChatModel(script=lambda m: AIMessage(f"draft for {m[-1].content}"))
    editor = ScriptedChatModel(script=lambda m: AIMessage(f"edited {m[-1].content}"))

    def write(state: DocState) -> dict:
        return {"draft": writer.invoke([HumanMessage(state["task"])]).content}

    def publish(state: DocState) -> dict:
        edited = editor.invoke([HumanMessage(state["draft"])]).content
        fail_once(failed, state["task"], "the press was busy")
        return {"published": edited}

    return then_retried(DocState, ("write", write), ("publish", publish), attempts=3)


def retry_expected(n: int) -> list[tuple]:
    return [
        ("write", "write", "llm", f"draft for task-{n}", []),
        ("publish", "publish", "llm", f"edited draft for task-{n}", [], 1, "error"),
        ("publish", "publish", "llm", f"edited draft for task-{n}", [], 2, "ok"),
    ]


# ---- interrupt() on a checkpointed thread ---------------------------------------------------------------------
def interrupt_app() -> Any:
    writer = ScriptedChatModel(script=lambda m: AIMessage(f"draft for {m[-1].content}"))

    def write(state: DocState) -> dict:
        return {"draft": writer.invoke([HumanMessage(state["task"])]).content}

    def review(state: DocState) -> dict:
        verdict = interrupt({"approve": state["draft"]})
        return {"published": f"{verdict}: {state['draft']}"}

    graph = StateGraph(DocState)
    graph.add_node("write", write)
    graph.add_node("review", review)
    graph.add_edge(START, "write")
    graph.add_edge("write", "review")
    graph.add_edge("review", END)
    return graph.compile(checkpointer=InMemorySaver())


def interrupt_expected(n: int) -> list[tuple]:
    return [
        ("write", "write", "llm", f"draft for task-{n}", []),
        ("review", "review", "node", "interrupted", []),
    ]


# ---- one node task running graphs several times: a loop over a subgraph, then an agent, retried -------------
class RunsState(TypedDict, total=False):
    task: str
    part: str
    draft: str
    brief: str
    review: str


def repeated_runs_app() -> Any:
    """`team`'s body invokes a compiled subgraph once per part, then a react agent, and fails after all that on
    its first attempt per task (RetryPolicy): LangGraph numbers the graph runs of one task (`team:<id>|2|...`),
    the retry's runs included."""
    failed: set[str] = set()
    briefer = ScriptedChatModel(script=lambda m: AIMessage(f"brief for {m[-1].content}"))
    drafter = ScriptedChatModel(script=lambda m: AIMessage(f"draft of {m[-1].content}"))
    draft = StateGraph(RunsState)
    draft.add_node("draft", lambda s: {"draft": drafter.invoke([HumanMessage(s["part"])]).content})
    draft.add_edge(START, "draft")
    draft.add_edge("draft", END)
    drafts = draft.compile()
    reviewer = react_agent("reviewer", lambda m: AIMessage(f"review of {m[-1].content}"), [])

    def team(state: RunsState) -> dict:
        parts = [drafts.invoke({"part": f"{state['task']}.{i}"})["draft"] for i in range(2)]
        review = reviewer.invoke({"messages": [HumanMessage(" + ".join(parts))]})["messages"][-1].content
        fail_once(failed, state["task"], "the reviewer timed out")
        return {"review": review}

    brief = ("brief", lambda s: {"brief": briefer.invoke([HumanMessage(s["task"])]).content})
    return then_retried(RunsState, brief, ("team", team), attempts=2)


def repeated_runs_expected(n: int) -> list[tuple]:
    def attempt(number: int, status: str) -> list[tuple]:
        return [("team", "team/draft", "llm", f"draft of task-{n}.0", [], number, status),
                ("team", "team/draft", "llm", f"draft of task-{n}.1", [], number, status),
                ("team", "team/agent", "llm", f"review of draft of task-{n}.0 + draft of task-{n}.1", [], number,
                 status)]

    return [("brief", "brief", "llm", f"brief for task-{n}", []), *attempt(1, "error"), *attempt(2, "ok")]


# ---- the functional API: an entrypoint runs an agent, then a @task on its answer --------------------------------
def functional_app() -> Any:
    from langgraph.func import entrypoint, task

    helper = react_agent("helper", lambda m: AIMessage(f"answer to {m[-1].content}"), [])
    summarizer = ScriptedChatModel(script=lambda m: AIMessage(f"summary of {m[-1].content}"))

    @task
    def summarize(text: str) -> str:
        return summarizer.invoke([HumanMessage(text)]).content

    @entrypoint()
    def workflow(inputs: dict) -> dict:
        answer = helper.invoke({"messages": [HumanMessage(inputs["task"])]})["messages"][-1].content
        return {"summary": summarize(answer).result()}

    return workflow


def functional_expected(n: int) -> list[tuple]:
    return [("workflow", "workflow/agent", "llm", f"answer to task-{n}", []),
            ("workflow", "workflow/summarize", "llm", f"summary of answer to task-{n}", [])]


# ---- LangChain 1.x subagents as tools: a create_agent orchestrator calls two create_agent subagents at once -----
def subagent_tools_app() -> Any:
    from langchain.agents import create_agent

    researcher = create_agent(ScriptedChatModel(script=lambda m: AIMessage(f"research on {m[-1].content}")), [],
                              name="researcher")
    writer = create_agent(ScriptedChatModel(script=lambda m: AIMessage(f"prose for {m[-1].content}")), [],
                          name="writer")

    @tool
    def ask_researcher(question: str) -> str:
        """Ask the research subagent."""
        return researcher.invoke({"messages": [HumanMessage(question)]})["messages"][-1].content

    @tool
    def ask_writer(request: str) -> str:
        """Ask the writing subagent."""
        return writer.invoke({"messages": [HumanMessage(request)]})["messages"][-1].content

    def orchestrate(messages: list[BaseMessage]) -> AIMessage:
        n = number(messages)
        answers = [m.content for m in messages if isinstance(m, ToolMessage)]
        if answers:
            return AIMessage("final: " + " | ".join(answers))
        return AIMessage("", tool_calls=[{"name": "ask_researcher", "args": {"question": f"facts task-{n}"}, "id": f"r{n}"},
                                         {"name": "ask_writer", "args": {"request": f"intro task-{n}"}, "id": f"w{n}"}])

    return create_agent(ScriptedChatModel(script=orchestrate), [ask_researcher, ask_writer], name="orchestrator")


def subagent_tools_expected(n: int) -> list[tuple]:
    return [("model", "model", "llm", "", ["ask_researcher", "ask_writer"]),
            ("ask_researcher", "tools/ask_researcher/model", "llm", f"research on facts task-{n}", []),
            ("ask_writer", "tools/ask_writer/model", "llm", f"prose for intro task-{n}", []),
            ("model", "model", "llm", f"final: research on facts task-{n} | prose for intro task-{n}", [])]


# ---- workers that keep their own memory per thread (compiled with checkpointer=True) ------------------------------
def memory_supervisor_app() -> Any:
    """The supervisor team with workers compiled `checkpointer=True` (each keeps its own conversation on the
    parent's thread): LangGraph names their tasks under the worker's name with no task id
    (`researcher|agent:<id>`, not `researcher:<id>|agent:<id>`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        workers = [create_react_agent(ScriptedChatModel(script=researcher_script), [search], name="researcher",
                                      checkpointer=True),
                   create_react_agent(ScriptedChatModel(script=math_script), [add], name="math_expert",
                                      checkpointer=True)]
    model = ScriptedChatModel(script=supervisor_script)
    return create_supervisor(workers, model=model, prompt="You route the task.").compile(checkpointer=InMemorySaver())


def memory_retry_app() -> Any:
    """A retried node that runs a react agent compiled `checkpointer=True`: the agent's call in the failed
    attempt is that attempt's, and the retry's is attempt 2 (LangGraph drops the failed attempt's writes, the
    agent's memory of it included, so both calls see one message)."""
    failed: set[str] = set()
    briefer = ScriptedChatModel(script=lambda m: AIMessage(f"brief for {m[-1].content}"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        helper = create_react_agent(
            ScriptedChatModel(script=lambda m: AIMessage(f"answer {len(m)} to {m[-1].content}")), [], name="helper",
            checkpointer=True)

    def team(state: RunsState) -> dict:
        review = helper.invoke({"messages": [HumanMessage(state["task"])]})["messages"][-1].content
        fail_once(failed, state["task"], "the reviewer timed out")
        return {"review": review}

    brief = ("brief", lambda s: {"brief": briefer.invoke([HumanMessage(s["task"])]).content})
    graph = StateGraph(RunsState)
    graph.add_node(*brief)
    graph.add_node("team", team, retry_policy=RetryPolicy(max_attempts=2, initial_interval=0.0, jitter=False))
    graph.add_edge(START, "brief")
    graph.add_edge("brief", "team")
    graph.add_edge("team", END)
    return graph.compile(checkpointer=InMemorySaver())


def memory_retry_expected(n: int) -> list[tuple]:
    return [("brief", "brief", "llm", f"brief for task-{n}", []),
            ("team", "team/agent", "llm", f"answer 1 to task-{n}", [], 1, "error"),
            ("team", "team/agent", "llm", f"answer 1 to task-{n}", [], 2, "ok")]


# ---- nodes that call models with callbacks of their own ---------------------------------------------------------
class CountingHandler(BaseCallbackHandler):
    """A user's own tracer, passed per call: `model.invoke(x, config={"callbacks": [handler]})` replaces the
    callbacks the node inherited (LangGraph's and the instrumented graph's) with the user's."""

    def __init__(self) -> None:
        self.model_calls = 0

    def on_chat_model_start(self, *args: Any, **kwargs: Any) -> None:
        self.model_calls += 1


def own_callbacks_app() -> Any:
    """`write` passes its own handler, `review` runs a react agent with `callbacks: []`, `edit` passes its own
    handler and metadata: none of them hands the node's callbacks on."""
    handler = CountingHandler()
    writer = ScriptedChatModel(script=lambda m: AIMessage(f"draft for {m[-1].content}"))
    editor = ScriptedChatModel(script=lambda m: AIMessage(f"edited {m[-1].content}"))
    reviewer = react_agent("reviewer", lambda m: AIMessage(f"review of {m[-1].content}"), [])

    def write(state: RunsState) -> dict:
        return {"draft": writer.invoke([HumanMessage(state["task"])], config={"callbacks": [handler]}).content}

    def review(state: RunsState) -> dict:
        out = reviewer.invoke({"messages": [HumanMessage(state["draft"])]}, config={"callbacks": []})
        return {"review": out["messages"][-1].content}

    def edit(state: RunsState) -> dict:
        reply = editor.invoke([HumanMessage(state["review"])], config={"callbacks": [handler],
                                                                        "metadata": {"team": "docs"}})
        return {"brief": reply.content}

    graph = StateGraph(RunsState)
    for name, fn in (("write", write), ("review", review), ("edit", edit)):
        graph.add_node(name, fn)
    graph.add_edge(START, "write")
    graph.add_edge("write", "review")
    graph.add_edge("review", "edit")
    graph.add_edge("edit", END)
    compiled = graph.compile()
    compiled.handler = handler  # type: ignore[attr-defined]  # for tests that check the user's tracer still sees
    return compiled


def own_callbacks_expected(n: int) -> list[tuple]:
    return [("write", "write", "llm", f"draft for task-{n}", []),
            ("review", "review/agent", "llm", f"review of draft for task-{n}", []),
            ("edit", "edit", "llm", f"edited review of draft for task-{n}", [])]


def message_input(n: int) -> dict:
    return {"messages": [HumanMessage(f"solve task-{n}")]}


def task_input(n: int) -> dict:
    return {"task": f"task-{n}"}


APPS: dict[str, tuple[Callable[[], Any], Callable[[int], dict], Callable[[int], list[tuple]]]] = {
    "supervisor": (supervisor_app, message_input, supervisor_expected),
    "swarm": (swarm_app, message_input, swarm_expected),
    "fanout": (fanout_app, task_input, fanout_expected),
    "retry": (retry_app, task_input, retry_expected),
    "interrupt": (interrupt_app, task_input, interrupt_expected),
    "repeated_runs": (repeated_runs_app, task_input, repeated_runs_expected),
    "functional": (functional_app, task_input, functional_expected),
    "subagent_tools": (subagent_tools_app, message_input, subagent_tools_expected),
    "memory_supervisor": (memory_supervisor_app, message_input, supervisor_expected),
    "memory_retry": (memory_retry_app, task_input, memory_retry_expected),
    "own_callbacks": (own_callbacks_app, task_input, own_callbacks_expected),
}

# apps compiled with a checkpointer: each call runs on a thread of its own
THREADED = frozenset({"interrupt", "memory_supervisor", "memory_retry"})
