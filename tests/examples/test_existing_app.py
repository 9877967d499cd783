"""examples/existing_app.py end to end: the unchanged support team (agents/support_team.py, no mappa import)
trained through the policy endpoint. Every model call, the supervisor's handoffs included, reaches the endpoint
and its trace holds the exact token ids and log-probs sampled; each adapter moves only on its own agent's
actions (the researcher's are left unscored here, so its adapter must stay bit-identical)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from examples import existing_app
from mappa_graph.messages import dict_to_message
from mappa_graph.models.chat import to_hf_messages

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning",
                                         "ignore::langgraph.warnings.LangGraphDeprecatedSinceV10")]
ROOT = Path(__file__).resolve().parents[2]


def test_the_app_module_imports_no_mappa():
    tree = ast.parse((ROOT / "agents" / "support_team.py").read_text())
    modules = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(m.split(".")[0] == "mappa_graph" for m in modules), modules


@pytest.fixture(scope="module")
def run(tmp_path_factory, one_torch_thread):
    rubric = existing_app.team_rubric

    def researcher_unscored(action, episode, reference):
        return None if action.agent == "researcher" else rubric(action, episode, reference)

    patch = pytest.MonkeyPatch()
    patch.setattr(existing_app, "team_rubric", researcher_unscored)
    try:
        yield existing_app.main(["--iterations", "1", "--out", str(tmp_path_factory.mktemp("existing_app"))])
    finally:
        patch.undo()


def test_every_model_call_goes_through_the_endpoint_with_exact_tokens(run):
    calls = [a for e in run["episodes"] for a in e.actions if a.kind == "llm"]
    by_agent = {agent: [a for a in calls if a.agent == agent] for agent in existing_app.AGENTS}
    assert set(a.agent for a in calls) <= set(existing_app.AGENTS)
    assert len(by_agent["supervisor"]) >= len(run["episodes"])  # its first call, in every episode
    assert by_agent["researcher"] and by_agent["writer"]  # the warm-started supervisor hands off to both
    assert run["served"] == len(calls) and run["pending"] == 0  # one request per call, none left behind
    for action in calls:
        assert action.adapter == action.agent and action.token_source == "backend"
        assert action.prompt_token_ids and action.output_token_ids
        assert len(action.output_logprobs) == len(action.output_token_ids)
        assert all(lp <= 0 for lp in action.output_logprobs)
    # the supervisor's handoffs are real tool calls, parsed by the endpoint from what the adapter sampled
    handoffs = [a for a in by_agent["supervisor"] if existing_app.supervisor_move(a).startswith("transfer_to_")]
    assert handoffs and all(a.output_message["tool_calls"] for a in handoffs)


def test_the_warm_start_saw_exactly_the_prompts_the_endpoint_renders(run):
    """The warm start records the app's prompts through scripted models; the endpoint renders what the app's
    ChatOpenAI sends over HTTP. The supervisor's first prompt must be the same tokens both ways."""
    policies = run["policies"]
    firsts = run["examples"][:2]  # the supervisor's first prompt, with its handoff tools in both orders
    assert {t["function"]["name"] for t in firsts[0].tools} == {"transfer_to_researcher", "transfer_to_writer"}
    for episode in run["episodes"]:
        action = next(a for a in episode.actions if a.kind == "llm" and a.agent == "supervisor")
        user = next(m for m in action.input_messages if m["role"] in ("user", "human"))
        rendered = []
        for first in firsts:
            messages = [dict(m) for m in first.messages]
            messages[-1]["content"] = user["content"]
            rendered.append(policies.render(messages, tools=first.tools))
        assert action.prompt_token_ids in rendered
        hf = to_hf_messages([dict_to_message(m) for m in action.input_messages])
        assert [m["role"] for m in hf] == [m["role"] for m in firsts[0].messages]


def test_each_adapter_moved_only_on_its_own_agents_actions(run):
    assert run["moved"]["researcher"] == 0.0  # unscored: its actions train nothing, and no one else's reach it
    assert run["moved"]["supervisor"] > 0.0 and run["moved"]["writer"] > 0.0
    record = run["records"][-1]["agents"]
    assert (record.get("researcher") or {}).get("samples", 0) == 0
