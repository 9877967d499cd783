"""The trainer on an app whose tool runs only async (an `async def` @tool, as MCP tools are): under `invoke`
its ToolNode fails at the first call, so rollouts run with `ainvoke`, by default when the app shows such a tool."""

from __future__ import annotations

import asyncio
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langgraph.graph import START, MessagesState, StateGraph

from mappa_graph.judging.verifier import VerifierJudge
from mappa_graph.models.policies import AgentPolicies
from mappa_graph.traces import Task
from mappa_graph.training.config import TrainConfig
from mappa_graph.training.credit import RewardConfig
from mappa_graph.training.rollouts import RolloutJob, has_async_only_tools, run_job
from mappa_graph.training.trainer import Trainer
from tests.fakes import ScriptedChatModel

pytestmark = pytest.mark.filterwarnings("ignore::langgraph.warnings.LangGraphDeprecatedSinceV10")


LOOPS: list = []  # every loop the async tool ran on, kept alive so no two can share an id


@tool
async def lookup(query: str) -> str:
    """Look the query up."""
    LOOPS.append(asyncio.get_running_loop())
    return f"notes on {query}"


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def _fetch_script(messages):
    if any(m.type == "tool" for m in messages):
        return AIMessage("fetched")
    return AIMessage("", tool_calls=[{"id": "c1", "name": "lookup", "args": {"query": messages[-1].content}}])


def team(policies: AgentPolicies | None = None, tools=(lookup,)):
    """A fetcher (a create_react_agent, scripted, with the tool) and a writer on the policy's adapter."""
    from langgraph.prebuilt import create_react_agent

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fetcher = create_react_agent(ScriptedChatModel(script=_fetch_script), list(tools), name="fetcher")
    writer = policies.chat_model("writer", max_new_tokens=4) if policies is not None else ScriptedChatModel(
        script=lambda messages: AIMessage("written"))
    graph = StateGraph(MessagesState)
    graph.add_node("fetcher", fetcher)
    graph.add_node("writer", lambda state: {"messages": [writer.invoke(state["messages"])]})
    graph.add_edge(START, "fetcher")
    graph.add_edge("fetcher", "writer")
    return graph.compile()


def test_a_tool_with_no_sync_implementation_is_seen_in_a_subgraph() -> None:
    assert has_async_only_tools(team())
    assert not has_async_only_tools(team(tools=(add,)))


def test_run_job_picks_ainvoke_and_says_what_to_set_when_told_not_to() -> None:
    from mappa_graph import instrument

    app = instrument(team())
    job = RolloutJob(task_id="t1", input={"messages": [{"role": "user", "content": "tides"}]}, run="r", metadata={})
    result = run_job(app, job)
    assert result.error is None
    fetch_call = result.episode.actions[0]
    assert [(r.name, r.output) for r in fetch_call.tool_results] == [("lookup", "notes on tides")]
    forced = run_job(app, job.model_copy(update={"use_async": False}))
    assert "does not support sync invocation" in forced.error and "async_rollouts=True" in forced.error
    assert forced.episode is not None and forced.episode.status == "error"  # the partial run, kept


def test_async_rollouts_share_one_event_loop_from_any_thread_or_running_loop() -> None:
    """A loop per rollout broke clients that pool connections per loop (ChatOpenAI: "Event loop is closed"),
    and `asyncio.run` refused inside a running loop (a notebook, an async server)."""
    from mappa_graph import instrument

    app = instrument(team())
    job = RolloutJob(task_id="t", input={"messages": [{"role": "user", "content": "q"}]}, run="r", metadata={})
    LOOPS.clear()
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda _: run_job(app, job), range(4)))

    async def inside_a_loop():
        return run_job(app, job)

    results.append(asyncio.run(inside_a_loop()))
    assert [r.error for r in results] == [None] * 5
    assert len(LOOPS) == 5 and len({id(loop) for loop in LOOPS}) == 1
    assert len({r.episode.metadata["rollout_id"] for r in results}) == 5


def test_the_trainer_passes_async_rollouts_on(tmp_path, tiny_path, one_torch_thread) -> None:
    """Told not to run rollouts async, the trainer's rollouts fail, and the error says which setting to change."""
    policies = AgentPolicies.from_pretrained(str(tiny_path), ["writer"])
    tasks = [Task(id=f"t{n}", input={"messages": [{"role": "user", "content": f"topic {n}"}]}) for n in range(2)]
    config = TrainConfig(run_name="sync", output_dir=str(tmp_path), iterations=1, tasks_per_iteration=2,
                         rollouts_per_task=2, rollout_concurrency=2, max_new_tokens=2, async_rollouts=False)
    trainer = Trainer(team, policies, VerifierJudge(lambda a, e, r: 1.0, name="one"), tasks, config)
    with pytest.raises(RuntimeError, match="async_rollouts=True"):
        trainer.train()
    trainer.close()


def test_the_trainer_trains_an_app_whose_tool_runs_only_async(tmp_path, tiny_path, one_torch_thread) -> None:
    torch.manual_seed(0)
    policies = AgentPolicies.from_pretrained(str(tiny_path), ["writer"])
    tasks = [Task(id=f"t{n}", input={"messages": [{"role": "user", "content": f"topic {n}"}]}) for n in range(2)]
    config = TrainConfig(run_name="async", output_dir=str(tmp_path), iterations=1, tasks_per_iteration=2,
                         rollouts_per_task=2, rollout_concurrency=2, max_new_tokens=4, lr=5e-2,
                         reward=RewardConfig(filter_zero_signal=False))
    judge = VerifierJudge(lambda action, episode, reference: float(len(action.output_text) % 2)
                          if action.agent == "writer" else None, name="parity")
    trainer = Trainer(team, policies, judge, tasks, config)
    before = {n: p.detach().clone() for n, p in policies.adapter_parameters("writer").items()}
    records = trainer.train()
    trainer.close()
    assert trainer.failed_rollouts == 0
    episodes = trainer.store.episodes(run="async")
    assert len(episodes) == 4
    for ep in episodes:
        assert [(r.name, r.output) for r in ep.actions[0].tool_results] == [("lookup", f"notes on {ep.input['messages'][0]['content']}")]
        assert [a.agent for a in ep.actions if a.trainable] == ["writer"]
    assert records[0]["agents"]["writer"]["samples"] == 4
    after = policies.adapter_parameters("writer")
    assert any(not torch.equal(before[n], after[n]) for n in after)
